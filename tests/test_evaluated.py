"""The `evaluated` finder (`patterns.evaluated`): stacked experts no finder reads, rewritten only
where a hypothesis of the op's arguments evaluates equal to the region; lookalikes stay."""
from __future__ import annotations

import pytest
import torch

import moe_compiler.patterns.verify as verify

import moe_compiler

from .helpers import assert_close_to_eager
from .naive_models import CapacityDispatchMoE, PermutedTop1MoE, SlotGatherMoE, TokenMajorMoE
from .test_naive_patterns import FLAG, _check_gpu_bf16, _check_rewrite, _compile, _inputs, _out_and_grads, assert_left_alone


@pytest.mark.parametrize("bias", [True, False])
def test_switch_dispatch_that_cannot_drop_is_found_by_evaluation(bias):
    # [T, E, C] one-hot dispatch and combine, C = T: every token keeps its slot, so it is the op
    report = _check_rewrite(CapacityDispatchMoE(bias=bias), "evaluated", op="sonic::moe_experts")
    assert report.rewritten[0].details["verified"].startswith("evaluated equal"), str(report)


def test_dispatch_by_positive_weights_is_found_where_the_weights_are_never_negative():
    # GShard's `dispatch = combine > 0`: the op's computation where gates are softmax probabilities,
    # which the region is then evaluated on (weights of one sign: `verify.nonnegative`)
    _check_rewrite(CapacityDispatchMoE(dispatch="positive"), "evaluated", op="sonic::moe_experts")


def test_nonnegative_weights_are_proven_from_the_ops_that_make_them():
    import torch.nn.functional as F

    from moe_compiler.patterns.verify import nonnegative

    def fn(x):
        w, ids = F.softmax(x, -1).topk(2, dim=-1)
        renormed = w / w.sum(-1, keepdim=True)
        scaled = torch.sigmoid(x).topk(2, dim=-1).values * 2.5
        raw = x.topk(2, dim=-1).values
        shifted = renormed - 0.1
        return renormed, scaled, raw, shifted, F.relu(x).max(-1).values + 1.0

    gm = torch.fx.symbolic_trace(fn)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert [nonnegative(n) for n in out] == [True, True, False, False, True]


def test_rows_permuted_by_expert_and_put_back_are_found_by_evaluation():
    # the canonical form drops the permutation (`permuted_rows_put_back_to_rows`); what is left, per-row
    # gathered weights of a top-1, is found by evaluation
    _check_rewrite(PermutedTop1MoE(), "evaluated", op="sonic::moe_experts_split")


def test_slot_loop_over_gathered_weights_is_found_by_evaluation():
    _check_rewrite(SlotGatherMoE(), "evaluated", op="sonic::moe_experts")


def test_a_layer_a_finder_refuses_is_found_by_evaluation():
    """A view of the up projection's own [T, E, f] layout keeps that einsum as written, so dense_bmm
    finds no bmm pair and says so; evaluated on its own the region is the op's, and is rewritten."""
    model = TokenMajorMoE(view=True)
    x, cotangent = _inputs()
    params = dict(model.named_parameters())
    with torch._dynamo.config.patch(**{FLAG: True}):
        eager = _out_and_grads(model, x, cotangent, params)
        with moe_compiler.capture() as report:
            got = _out_and_grads(_compile(model, "aot_eager"), x, cotangent, params)
    assert [r.idiom for r in report.rewritten] == ["evaluated"], str(report)
    assert [r.idiom for r in report.rejected] == ["dense_bmm"], str(report)
    assert_close_to_eager(got[0], eager[0], what="output")
    for name in eager[1]:
        assert_close_to_eager(got[1][name], eager[1][name], what=f"grad {name}")


@pytest.mark.parametrize("make,reason", [
    # half the tokens' capacity: the crowded routing drops tokens the op computes
    (lambda: CapacityDispatchMoE(capacity="half"), "no hypothesis evaluated equal"),
    # `combine > 0` over raw logits: a token with a negative gate is not dispatched
    (lambda: CapacityDispatchMoE(dispatch="positive", gate_from="logits"), "no hypothesis evaluated equal"),
    # slot k's output weighted by the other slot's weight
    (lambda: SlotGatherMoE(weights="swapped"), "no hypothesis evaluated equal"),
    # the gate clamped at 50: no probe value reaches it, so a plain SwiGLU would evaluate equal
    (lambda: SlotGatherMoE(clamp=50.0), "no hypothesis"),
])
def test_lookalikes_stay(make, reason, caplog):
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(make(), _inputs()[0], reason, caplog)


def test_a_region_too_large_to_evaluate_stays(caplog, monkeypatch):
    """No structural proof backs this finder: a region verify cannot evaluate is left alone."""
    monkeypatch.setitem(verify.MAX_FLOPS, "cpu", 1.0)
    monkeypatch.setitem(verify.MAX_BYTES, "cpu", 1)
    verify._cache.clear()
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(SlotGatherMoE(), _inputs()[0], "too large to evaluate", caplog)


@pytest.mark.gpu
@pytest.mark.parametrize("make", [CapacityDispatchMoE, SlotGatherMoE, lambda: CapacityDispatchMoE(dispatch="positive")],
                         ids=["capacity", "slots", "positive"])
def test_found_by_evaluation_gpu_bf16(make):
    _check_gpu_bf16(make, "evaluated")


def test_a_region_computed_partly_under_no_grad_is_left_alone():
    """The first projections computed under torch.no_grad: eager trains no gate/up weight and no x
    through them, the op placed at the combine would. The switch is a node no value reads: the
    pass driver finds the region's values computed under two grad modes and leaves it alone."""
    import torch.nn.functional as F

    class HalfFrozen(SlotGatherMoE):
        def forward(self, x):
            _, w, ids = self.route(x)
            out = x.new_zeros(x.shape)
            for k in range(self.K):
                e = ids[:, k]
                with torch.no_grad():
                    g, u = torch.einsum("td,tdf->tf", x, self.w13[e]).chunk(2, dim=-1)
                out = out + w[:, k, None] * torch.einsum("tf,tfd->td", F.silu(g) * u, self.w2[e])
            return out

    model = HalfFrozen()
    x, _ = _inputs()
    with torch._dynamo.config.patch(**{FLAG: True}), moe_compiler.capture() as report:
        _compile(model, "aot_eager")(x.requires_grad_(True))
    assert not report.rewritten, str(report)
    assert any("computed under another grad mode" in r.reason for r in report.rejected), str(report)
