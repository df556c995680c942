"""Expert parallelism: the experts of one rank under transformers' expert-parallel plans.

Under an expert-parallel plan each rank keeps E / ranks experts; the ids of experts on other ranks
reach its experts module as the sentinel E_local with weight 0 (transformers' all-reduce plan,
`AllReduceEP` / `EpRouterParallel`), and the experts forward drops those slots (or, transformers
5.17's batched_mm, clamps them to expert E_local - 1). The rewrite must compute the same, on the
device. `OneRankEP` is that rank's view, in one process; the plans themselves run in two gloo
processes in `test_expert_parallel_plans` (tests/ep_plan_worker.py) and
`test_ep_train_example_matches_one_process` (examples/ep_train.py under torchrun). torchtitan's
all-to-all form, where only the experts over the received rows are compiled, runs in
`test_all_to_all_expert_parallel_runs_the_op_over_the_received_rows` (tests/a2a_ep_worker.py).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import moe_compiler

from .helpers import assert_close_to_eager, compile_sonic, nan_filled_buffers, profiled_op_names


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
        if implementation == "clamped":
            self.experts.forward = clamped_batched_experts.__get__(self.experts)

    def forward(self, x):
        _, weights, ids = self.gate(x)
        off_rank = ids // self.local != self.rank
        local_ids = torch.where(off_rank, self.local, ids % self.local)
        return self.experts(x, local_ids, weights.masked_fill(off_rank, 0.0))


def clamped_batched_experts(self, hidden_states, top_k_index, top_k_weights):
    """transformers 5.17's batched_mm experts path, written out: every slot gathers the weights of
    expert `id.clamp(0, E - 1)` (a sentinel E runs expert E-1) and keeps its own weight (5.17's
    router hook has zeroed the weights of sentinel slots before)."""
    K, (T, d) = top_k_index.shape[-1], hidden_states.shape
    rows = hidden_states.repeat_interleave(K, dim=0)
    ids = top_k_index.reshape(-1).clamp(0, self.num_experts - 1)
    h = torch.bmm(self.gate_up_proj[ids], rows.unsqueeze(-1)).squeeze(-1)
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(self.down_proj[ids], (torch.nn.functional.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    return (y * top_k_weights.reshape(-1).unsqueeze(-1)).view(T, K, d).sum(dim=1)


def _loss_and_grads(model, x, dy):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.backward(dy)
    grads = {name.removeprefix("_orig_mod."): p.grad.clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return out.detach(), x.grad.clone(), grads


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "sonic", "clamped"])
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
    if implementation != "sonic":
        details = report.rewritten[0].details
        assert details["verified"] == "evaluated equal on 5 routings", str(report)
        rule = "clamped to E-1" if implementation == "clamped" else "dropped"
        assert details["layout"].endswith(f", ids >= E {rule} (expert parallel)"), str(report)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_one_rank_drops_other_ranks_slots_gpu_bf16(implementation):
    """bf16 on the GPU: output and every gradient as close to the fp32 model as eager bf16 is."""
    g = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(512, 16, generator=g).cuda() for _ in range(2))
    truth = _loss_and_grads(OneRankEP(implementation=implementation).cuda(), x, dy)
    model = OneRankEP(implementation=implementation).cuda().to(torch.bfloat16)
    eager = _loss_and_grads(model, x.bfloat16(), dy.bfloat16())
    with moe_compiler.capture() as report:
        got = _loss_and_grads(compile_sonic(model), x.bfloat16(), dy.bfloat16())
    assert len(report.rewritten) == 1 and not report.rejected, str(report)
    for a, b, c, what in ((got[0], eager[0], truth[0], "output"), (got[1], eager[1], truth[1], "dx")):
        assert_close_to_eager(a.float(), b.float(), c, torch.bfloat16, what)
    for name in truth[2]:
        assert_close_to_eager(got[2][name].float(), eager[2][name].float(), truth[2][name], torch.bfloat16, name)


@pytest.mark.gpu
def test_one_rank_at_kernel_sizes_gpu_bf16():
    """grouped_mm experts at sizes where the TMA and Gluon kernels run (d 1024, n 512, 32 of 64
    experts, top-8, 4096 tokens: half the slots dropped; the batched_mm path's eager fp32 run would
    gather 128 GiB of weights), our buffers starting as NaN: output, dx and every gradient as close to
    the fp32 model as eager bf16 is (finite included), over three steps."""
    sizes = dict(E=64, K=8, d=1024, n=512, implementation="grouped_mm")
    g = torch.Generator().manual_seed(2)
    x, dy = (torch.randn(4096, 1024, generator=g).cuda() for _ in range(2))
    truth = _loss_and_grads(OneRankEP(**sizes).cuda(), x, dy)
    model = OneRankEP(**sizes).cuda().to(torch.bfloat16)
    eager = _loss_and_grads(model, x.bfloat16(), dy.bfloat16())
    compiled = compile_sonic(model)
    with moe_compiler.capture() as report:
        for _ in range(3):
            with nan_filled_buffers():
                got = _loss_and_grads(compiled, x.bfloat16(), dy.bfloat16())
            for a, b, c, what in ((got[0], eager[0], truth[0], "output"), (got[1], eager[1], truth[1], "dx")):
                assert_close_to_eager(a.float(), b.float(), c, torch.bfloat16, what)
            for name in truth[2]:
                assert_close_to_eager(got[2][name].float(), eager[2][name].float(), truth[2][name], torch.bfloat16,
                                      name)
    assert len(report.rewritten) == 1 and not report.rejected, str(report)


@pytest.mark.gpu
@pytest.mark.parametrize("wgrad", ["triton", "gluon", "grouped_mm"])
def test_dropped_slots_with_a_small_last_expert_at_kernel_sizes_gpu(wgrad):
    """The op on one rank's routing at sizes where the TMA and Gluon kernels run: half of the
    [T, K] slots dropped (ids >= E), the last expert given 5 rows (fewer than any tile has), each
    weight-gradient kernel pinned in turn, our buffers starting as NaN. Output, dx,
    the kept slots' weight gradients and dW1, dW2 are as close to the fp32 reference as the bf16
    reference is; the dropped slots' weight gradients are 0. (A weight-gradient box that runs past
    the last expert's rows reads the padding rows of dH and A': they must hold zeros.)"""
    from moe_compiler.codegen import wgrad_choice
    from moe_compiler.codegen.ops import drop_slots_from, moe_experts
    from moe_compiler.codegen.reference import torch_moe_experts

    T, d, n, E, K = 4096, 1024, 512, 32, 8
    g = torch.Generator(device="cuda").manual_seed(3)
    ids = torch.rand(T, 2 * E, device="cuda", generator=g).argsort(dim=1)[:, :K]  # distinct ids of 2E experts
    last = (ids == E - 1).nonzero()
    ids[last[5:, 0], last[5:, 1]] = E  # expert E-1 keeps 5 rows; ids >= E are other ranks' (dropped)
    ids = torch.where(ids >= E, E, ids)
    w = torch.rand(T, K, device="cuda", generator=g)
    x, dy = (torch.randn(T, d, device="cuda", generator=g) for _ in range(2))
    w1 = torch.randn(E, 2 * n, d, device="cuda", generator=g) / d ** 0.5
    w2 = torch.randn(E, d, n, device="cuda", generator=g) / n ** 0.5
    kept = ids < E

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w, w1, w2)]
        out = fn(*leaves)
        out.backward(dy.to(dtype))
        return [out.detach().float()] + [t.grad.float() for t in leaves]

    def reference(x_, w_, w1_, w2_):  # the dropped slots as expert 0 with weight 0
        return torch_moe_experts(x_, torch.where(kept, ids, 0), w_ * kept, w1_, w2_)

    def ours(x_, w_, w1_, w2_):
        slot_ids, slot_w, slot_token = drop_slots_from(ids, w_, E)
        return moe_experts(x_, slot_ids, slot_w, w1_, w2_, slot_token=slot_token)

    truth, eager = grads(reference, torch.float32), grads(reference, torch.bfloat16)
    saved = wgrad_choice.PINNED
    wgrad_choice.PINNED = wgrad
    try:
        with nan_filled_buffers():
            got = grads(ours, torch.bfloat16)
    finally:
        wgrad_choice.PINNED = saved
    assert (got[2][~kept] == 0).all(), "a dropped slot's weight got a gradient"
    got[2], eager[2], truth[2] = got[2][kept], eager[2][kept], truth[2][kept]
    for a, b, c, what in zip(got, eager, truth, ("output", "dx", "d_weights", "dW1", "dW2")):
        assert_close_to_eager(a, b, c, torch.bfloat16, what)


@pytest.mark.gpu
def test_one_rank_step_syncs_no_host_and_replays_from_a_cuda_graph():
    """The dropped-slot routing adds no host sync: one rank's compiled fwd+bwd (bf16, the ids of
    the other rank's experts dropped) makes no synchronizing CUDA call, and captured in a CUDA graph
    it follows new hidden states copied into the captured input, to the gradients of a step run
    normally on them."""
    from moe_compiler.benchmarking import count_host_syncs, graphed

    model = OneRankEP(E=16, K=4, d=256, n=128).cuda().to(torch.bfloat16)
    compiled = compile_sonic(model)
    g = torch.Generator(device="cuda").manual_seed(4)
    x, new_x, dy = (torch.randn(512, 256, device="cuda", generator=g).bfloat16() for _ in range(3))
    x.requires_grad_(True)
    leaves = [x, *model.parameters()]

    def zero():
        for t in leaves:
            t.grad = None

    def step():
        compiled(x).backward(dy)

    for _ in range(3):  # compile, and measure the weight-gradient choices (timing syncs, once)
        zero()
        step()
    zero()
    assert count_host_syncs(step) == 0
    replay = graphed(step, zero)
    with torch.no_grad():
        x.copy_(new_x)
    replay()
    torch.cuda.synchronize()
    got = [t.grad.clone() for t in leaves]
    zero()
    step()
    for name, a, b in zip(["x", *(n for n, _ in model.named_parameters())], got, [t.grad for t in leaves]):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")


def test_one_rank_under_token_rounding_keeps_plain_routing():
    """sonic.token_rounding does not apply where sentinel slots are dropped: the rewrite stands,
    rounding off with the reason, output equal to eager."""
    model = OneRankEP()
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    want = model(x)
    with moe_compiler.capture() as report:
        got = compile_sonic(model, token_rounding="nearest")(x)
    (match,) = report.rewritten
    assert match.details["token_rounding"].startswith("off (expert-parallel sentinels"), str(report)
    assert_close_to_eager(got.detach(), want.detach(), what="output")


def test_one_rank_region_is_verified_on_sentinel_routing():
    """The sentinel routing is part of the evaluation: the report shows the region equal on it."""
    model = OneRankEP()
    with torch.no_grad(), moe_compiler.capture() as report:
        compile_sonic(model)(torch.randn(24, 16))
    (match,) = report.rewritten
    assert match.details["verified"] == "evaluated equal on 5 routings", str(report)
    assert "slot form" in match.details["router"], str(report)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_results(module: str, tmp_path, ranks: int) -> list[dict]:
    """Run `python -m module OUT PORT` (it spawns the gloo ranks) and read each rank's JSON."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-m", module, str(tmp_path), str(_free_port())], cwd=root,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def test_expert_parallel_plans(tmp_path):
    """Two gloo processes under transformers' plan (`DistributedConfig(tp_size=2, ep_size=2)`):
    each rank rewrites both MoE layers at inference (the all-reduce plan: other ranks' experts as
    sentinels) and in training (the all-to-all plan), runs one `sonic::` forward call per layer, and
    matches a one-process eager run: logits, loss, and its own experts' gradients."""
    from .ep_plan_worker import LAYERS, RANKS

    for got in _worker_results("tests.ep_plan_worker", tmp_path, RANKS):
        assert (got["infer_rewritten"], got["infer_rejected"]) == (LAYERS, 0), got
        assert (got["train_rewritten"], got["train_rejected"]) == (LAYERS, 0), got
        assert got["infer_calls"] == got["train_calls"] == LAYERS, got
        assert all("slots dropped" in r for r in got["dropped"]), got
        assert got["logits_err"] < 1e-5 and got["loss_err"] < 1e-5, got
        assert got["expert_grads"] == 2 * LAYERS and got["grad_err"] < 1e-4 * got["grad_scale"], got


def test_all_to_all_expert_parallel_runs_the_op_over_the_received_rows(tmp_path):
    """Two gloo processes with torchtitan's form of expert parallelism (tests/a2a_ep_worker.py: each
    rank's routed rows sent to their experts' rank by all_to_all, regrouped, the experts compiled on
    their own with backend="sonic", rows marked dynamic): on each rank the experts are rewritten once
    (`grouped_rows`; `sorted_grouped_mm` finds no router there and says so), a later step with
    other counts runs one `sonic::` forward call and compiles nothing, and at every step the loss,
    the input's gradient and the rank's experts' gradients are as close to a float32 one-process
    run as the same EP step with eager experts."""
    from .a2a_ep_worker import RANKS, STEPS

    for got in _worker_results("tests.a2a_ep_worker", tmp_path, RANKS):
        assert got["rewritten"] == ["grouped_rows"] and got["rejected"] == ["sorted_grouped_mm"], got
        assert got["calls"][-1] == 1, got
        assert len(got["close"]) == STEPS * 5 and all(ok for _, _, ok, _ in got["close"]), got["close"]


@pytest.mark.parametrize("scope", ["layers", "model", "data"])
def test_ep_train_example_matches_one_process(tmp_path, scope):
    """examples/ep_train.py under torchrun (2 gloo processes, tiny Qwen3-MoE, fp32): its decoder
    layers compiled apart or the whole model at once, the ranks sharing each batch; or ("data") each
    rank training on its own rows, tokens dispatched all-to-all (transformers >= 5.20). Every rank
    rewrites its experts, runs the op and its backward once per layer per step, and the losses equal
    one process's on the same batches while training moves them; --profile and --step-times
    (layers), --host-profile (model) take their extra steps on every rank (a rank that skipped one
    would hang the other's collectives)."""
    import json
    import pathlib
    import subprocess
    import sys

    from moe_compiler.testing import FP32_RTOL

    root = pathlib.Path(__file__).resolve().parent.parent
    layers, steps = 2, 3
    if scope == "data":
        from transformers.distributed import DistributedConfig

        if not hasattr(DistributedConfig(), "fsdp_size") or not hasattr(DistributedConfig(), "ep_size"):
            pytest.skip("data-parallel expert parallelism needs transformers >= 5.20")
    flags = {"layers": ["--profile", "--step-times", "--compile-scope", "layers"],
             "model": ["--host-profile", "--compile-scope", "model"], "data": ["--plan", "data"]}[scope]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(root / "examples" / "ep_train.py"), "--device", "cpu", "--model", "qwen3_moe", "--scale", "tiny",
           "--layers", str(layers), "--steps", str(steps), "--batch", "4", "--lr", "5", "--providers", "sonic",
           "--sonic-compiler", "aot_eager", *flags, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (sonic,) = json.loads((tmp_path / "qwen3_moe_tiny_ep2.json").read_text())["results"]
    if scope == "layers":
        assert proc.stdout.count("sonic EP x2: one step by cpu_time_total") == 1, proc.stdout[-4000:]
        assert sonic["step_wall_ms"] > 0 and sonic["step_enqueue_ms"] > 0, sonic
        assert sonic["step_syncs"] is None, sonic  # counted on CUDA only
    elif scope == "model":
        assert proc.stdout.count("sonic EP x2: three fwd+bwd steps under cProfile") == 1, proc.stdout[-4000:]
        assert (tmp_path / "sonic_EP_x2_rank1_host.prof").stat().st_size > 0
    else:  # each rank its own rows: the ranks' losses differ, their mean is the whole batch's
        first, second = sonic["rank_losses"]
        assert all(abs(a - b) > 10 * FP32_RTOL * abs(a) for a, b in zip(first, second)), sonic["rank_losses"]
    assert all(n >= 1 for n in sonic["moe_regions_rewritten"]), sonic["moe_regions_rewritten"]
    for calls in sonic["sonic_op_calls"]:
        assert calls == {"sonic::moe_experts": layers, "sonic::moe_experts_backward": layers}, calls
    assert len(sonic["losses"]) == len(sonic["reference_losses"]) == steps
    assert sonic["max_rel_loss_diff"] < FP32_RTOL, sonic
    assert abs(sonic["losses"][-1] - sonic["losses"][0]) > 100 * FP32_RTOL * abs(sonic["losses"][0])
