"""Two CPU processes (gloo) running an MoE layer with all-to-all expert parallelism as torchtitan
runs it: each rank routes its own tokens, sends each routed row to the rank holding its expert
(counts first, then the rows, `all_to_all_single`), regroups the rows it receives by local expert,
runs its experts as one compiled function over those grouped rows (torchtitan's
`apply_compile` compiles `_run_experts_grouped_mm(w1, w2, w3, x, num_tokens_per_expert)` alone,
rows marked dynamic), and sends the outputs back to be weighted and summed per token. Only the
experts function is compiled, with backend="sonic"; dispatch and combine stay eager.

    python -m tests.a2a_ep_worker OUT_DIR PORT

Writes OUT_DIR/rank{r}.json: the idioms of the regions rewritten and rejected, `sonic::` forward
calls per step, and per step whether the loss, this rank's input gradient and its experts'
gradients are as close to one float32 process running every expert on both ranks' tokens as the
same bf16 EP step with eager experts is (`moe_compiler.testing.closeness`). bf16:
`torch._grouped_mm` compiles in bf16 only on the CPU.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

RANKS, E, K, T, D, N = 2, 4, 2, 24, 16, 8
LOCAL = E // RANKS
STEPS = 2  # the second step's token counts differ: the rows' dynamic size compiles once
DTYPE = torch.bfloat16


def experts(w1, w2, w3, x, num_rows_per_expert):
    """The experts over rows grouped by expert, as torchtitan's grouped_mm experts compute them."""
    offsets = torch.cumsum(num_rows_per_expert, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)


def _weights():
    g = torch.Generator().manual_seed(0)
    router = torch.randn(E, D, generator=g) / D ** 0.5
    w1, w3 = (torch.randn(E, N, D, generator=g) / D ** 0.5 for _ in range(2))
    w2 = torch.randn(E, D, N, generator=g) / N ** 0.5
    return [t.to(DTYPE) for t in (router, w1, w2, w3)]


def _data(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(T, D, generator=g).to(DTYPE), torch.randn(T, D, generator=g).to(DTYPE)


def _route(x, router):
    probs = torch.softmax(x.float() @ router.float().t(), dim=-1)
    w, ids = torch.topk(probs, K, dim=-1)
    return (w / w.sum(-1, keepdim=True)).to(x.dtype), ids


def _combine(rows, w, order, tok):
    """Each token's K expert rows, weighted by the router, summed back to it."""
    rows = rows * w.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros(T, D, dtype=rows.dtype).index_add(0, tok, rows)


def _layer_ep(x, router, w1, w2, w3, run_experts, rank):
    """One rank's MoE layer: its tokens dispatched to the experts' ranks and back."""
    from torch.distributed.nn.functional import all_to_all_single

    w, ids = _route(x, router)
    order = torch.argsort(ids.reshape(-1), stable=True)
    tok = order // K
    rows = x[tok]  # this rank's routed rows, sorted by global expert
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts)  # [RANKS * LOCAL]: rows each rank sends to my experts
    send = counts.view(RANKS, LOCAL).sum(1).tolist()
    recv = received.view(RANKS, LOCAL).sum(1).tolist()
    got = all_to_all_single(torch.empty(sum(recv), D, dtype=x.dtype), rows, recv, send)
    # got holds [rank 0's rows for my expert 0, 1, ...][rank 1's ...]: regroup them by local expert
    blocks = received.view(RANKS, LOCAL)
    starts = torch.cumsum(blocks.reshape(-1), 0) - blocks.reshape(-1)
    regroup = torch.cat([torch.arange(int(starts[r * LOCAL + e]), int(starts[r * LOCAL + e] + blocks[r, e]))
                         for e in range(LOCAL) for r in range(RANKS)]).long()
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    y = run_experts(w1[mine], w2[mine], w3[mine], got[regroup], blocks.sum(0))
    back = torch.empty_like(y).index_copy(0, regroup, y)
    out_rows = all_to_all_single(torch.empty(sum(send), D, dtype=x.dtype), back, send, recv)
    return _combine(out_rows, w, order, tok)


def _layer_one_process(x, router, w1, w2, w3):
    w, ids = _route(x, router)
    order = torch.argsort(ids.reshape(-1), stable=True)
    tok = order // K
    y = experts(w1, w2, w3, x[tok], torch.bincount(ids.reshape(-1), minlength=E))
    return _combine(y, w, order, tok)


def _reference() -> list[dict]:
    """Per step, in float32 from the same bf16 values: the summed loss, each rank's input gradient,
    every expert weight's gradient (one process, every expert)."""
    steps = []
    for step in range(STEPS):
        params = [p.float().requires_grad_() for p in _weights()]
        xs = [_data(r, step)[0].float().requires_grad_() for r in range(RANKS)]
        loss = sum((_layer_one_process(x, *params) * _data(r, step)[1].float()).sum() for r, x in enumerate(xs))
        loss.backward()
        steps.append({"loss": loss.detach(), "x": [x.grad for x in xs], "w": [p.grad for p in params[1:]]})
    return steps


def _step(rank: int, step: int, run_experts) -> dict:
    """This rank's loss (summed over ranks), input gradient and its experts' gradients."""
    params = [p.clone().requires_grad_() for p in _weights()]
    x, cot = _data(rank, step)
    x.requires_grad_()
    loss = (_layer_ep(x, *params, run_experts, rank) * cot).float().sum()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    # the router's gradient is each rank's own share (no data-parallel reduce here): experts only
    return {"loss": total, "x": x.grad, **{f"w{i}": p.grad[mine] for i, p in enumerate(params[1:])}}


def _forward_calls(profile) -> int:
    return sum(1 for e in profile.events() if e.name.startswith("sonic::moe_experts") and "backward" not in e.name)


def _run(rank: int, out_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        import moe_compiler
        from moe_compiler.testing import closeness

        ref = torch.load(os.path.join(out_dir, "reference.pt"))
        from moe_compiler.options import PATTERNS

        options = {"sonic.fallback": False, "sonic.compiler": "aot_eager", "sonic.patterns": PATTERNS}  # grouped_rows: opt-in
        compiled = torch.compile(experts, backend="sonic", fullgraph=True, options=options)

        def run_experts(w1, w2, w3, x, counts):
            torch._dynamo.mark_dynamic(x, 0)  # the rows received vary from step to step
            return compiled(w1, w2, w3, x, counts)

        result = {"rewritten": [], "rejected": [], "calls": [], "close": []}
        mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
        for step in range(STEPS):
            eager = _step(rank, step, experts)
            with moe_compiler.capture() as report, torch.profiler.profile() as prof:
                got = _step(rank, step, run_experts)
            result["rewritten"] += [r.idiom for r in report.rewritten]
            result["rejected"] += [r.idiom for r in report.rejected]
            result["calls"].append(_forward_calls(prof))
            want = ref[step]
            truth = {"loss": want["loss"], "x": want["x"][rank], **{f"w{i}": g[mine] for i, g in enumerate(want["w"])}}
            for name in truth:  # as close to the float32 run as the same EP step with eager experts is
                ok, why = closeness(got[name], eager[name], truth[name], DTYPE)
                result["close"].append([step, name, ok, why])
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def main(out_dir: str, port: int) -> None:
    torch.save(_reference(), os.path.join(out_dir, "reference.pt"))
    mp.spawn(_run, args=(out_dir, port), nprocs=RANKS)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
