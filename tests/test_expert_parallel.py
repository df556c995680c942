"""Expert parallelism: the experts of one rank under transformers' expert-parallel plans.

Under an expert-parallel plan each rank keeps E / ranks experts; the ids of experts on other ranks
reach its experts module as the sentinel E_local with weight 0 (transformers' all-reduce plan,
`AllReduceEP` / `EpRouterParallel`), and the experts forward drops those slots. The rewrite must
drop them too, on the device, with no rows computed for them. `OneRankEP` is that rank's view, in
one process; the two-process plans themselves run in `test_expert_parallel_plans` (gloo).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import moe_compiler

from .helpers import assert_close_to_eager, compile_sonic, profiled_op_names


class OneRankEP(nn.Module):
    """Rank `rank` of `ranks` under transformers' all-reduce expert-parallel plan: a Qwen3-MoE block
    whose experts module keeps this rank's experts (`num_experts` = E / ranks, `_is_expert_parallel`
    set, as the plan sets them); the router's ids of other ranks' experts become the sentinel E_local
    with weight 0 and the rest their local index, as the plan's dispatch computes them."""

    def __init__(self, rank=1, ranks=2, E=8, K=2, d=16, n=8, implementation="grouped_mm"):
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        super().__init__()
        config = Qwen3MoeConfig(hidden_size=d, moe_intermediate_size=n, num_experts=E, num_experts_per_tok=K,
                                norm_topk_prob=True)
        config._experts_implementation = implementation
        torch.manual_seed(0)
        block = Qwen3MoeSparseMoeBlock(config)
        nn.init.normal_(block.gate.weight, std=0.5)
        self.gate, self.experts = block.gate, block.experts
        self.rank, self.local = rank, E // ranks
        mine = slice(rank * self.local, (rank + 1) * self.local)
        self.experts.gate_up_proj = nn.Parameter(torch.randn(E, 2 * n, d)[mine] / d ** 0.5)
        self.experts.down_proj = nn.Parameter(torch.randn(E, d, n)[mine] / n ** 0.5)
        self.experts.num_experts = self.local
        self.experts._is_expert_parallel = True

    def forward(self, x):
        _, weights, ids = self.gate(x)
        off_rank = ids // self.local != self.rank
        local_ids = torch.where(off_rank, self.local, ids % self.local)
        return self.experts(x, local_ids, weights.masked_fill(off_rank, 0.0))


def _loss_and_grads(model, x, dy):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.backward(dy)
    grads = {name.removeprefix("_orig_mod."): p.grad.clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return out.detach(), x.grad.clone(), grads


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "sonic"])
def test_one_rank_drops_other_ranks_slots(implementation):
    """Output, dx and every gradient equal eager (the grouped_mm path's); one region rewritten, or
    the registered "sonic" experts forward; the op runs."""
    model = OneRankEP(implementation=implementation)
    if implementation == "sonic":
        moe_compiler.register_hf_experts()
        reference = OneRankEP(implementation="grouped_mm")
    else:
        reference = model
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g)
    _, _, ids = model.gate(x)
    assert bool((ids // model.local != model.rank).any()) and bool((ids // model.local == model.rank).any())
    eager = _loss_and_grads(reference, x, dy)
    compiled = compile_sonic(model)
    with moe_compiler.capture() as report:
        got = _loss_and_grads(compiled, x, dy)
    assert len(report.rewritten) == (implementation != "sonic") and not report.rejected, str(report)
    assert_close_to_eager(got[0], eager[0], what="output")
    assert_close_to_eager(got[1], eager[1], what="dx")
    assert got[2].keys() == eager[2].keys() == {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}
    for name in eager[2]:
        assert_close_to_eager(got[2][name], eager[2][name], what=f"grad {name}")
    names = profiled_op_names(lambda: compiled(x))
    assert any(n.startswith("sonic::moe_experts") for n in names), sorted(names)[:20]


def test_one_rank_region_is_verified_on_sentinel_routing():
    """The sentinel routing is part of the evaluation: the report shows the region equal on it."""
    model = OneRankEP()
    with torch.no_grad(), moe_compiler.capture() as report:
        compile_sonic(model)(torch.randn(24, 16))
    (match,) = report.rewritten
    assert match.details["verified"] == "evaluated equal on 5 routings", str(report)
    assert "slot form" in match.details["router"], str(report)
