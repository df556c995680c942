"""Experts over rows already grouped by expert (the opt-in `grouped_rows` idiom) against Inductor:
torchtitan's grouped_mm experts step as it computes (three `torch._grouped_mm` over the counts'
offsets, bf16 casts, rows marked as torchtitan leaves them), fwd+bwd, bf16, in one process.

    python benchmarks/bench_grouped_rows.py              # three shapes (R rows, d, n, E)
    python benchmarks/bench_grouped_rows.py --shapes 1

Per shape and provider: host, GPU-busy and wall ms of a normally launched step
(`moe_compiler.benchmarking.step_times`), TFLOPS over busy and wall (18 R' d n, R' the rows in a
group: a sixteenth of the rows are padding past the last offset), and the relative difference of
the output and every gradient between the two. GPU only.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

SHAPES = [(65536, 2048, 768, 64), (32768, 2048, 768, 32), (131072, 1536, 256, 64)]


def experts(w1, w2, w3, x, counts):
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x.bfloat16(), w1.bfloat16().transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(x.bfloat16(), w3.bfloat16().transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offs).type_as(x)


def measure(R, d, n, E):
    import moe_compiler
    from moe_compiler.benchmarking import step_times
    from moe_compiler.options import PATTERNS

    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w3 = ((torch.randn(E, n, d, device="cuda", generator=g) / d ** 0.5).bfloat16().requires_grad_()
              for _ in range(2))
    w2 = (torch.randn(E, d, n, device="cuda", generator=g) / n ** 0.5).bfloat16().requires_grad_()
    x = torch.randn(R, d, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(R, d, device="cuda", generator=g, dtype=torch.bfloat16)
    used = R - R // 16
    counts = torch.bincount(torch.randint(0, E, (used,), device="cuda", generator=g), minlength=E)
    flop = 18 * used * d * n
    leaves, results = [x, w1, w2, w3], {}
    for name in ("sonic", "inductor"):
        torch._dynamo.reset()
        f = torch.compile(experts, backend="inductor") if name == "inductor" else \
            torch.compile(experts, backend="sonic", options={"sonic.patterns": PATTERNS})

        def zero():
            for t in leaves:
                t.grad = None

        def step():
            f(w1, w2, w3, x, counts).backward(dy)

        with moe_compiler.capture() as report:
            zero()
            step()
        for _ in range(5):
            zero()
            step()
        values = [f(w1, w2, w3, x, counts)[:used].float(), x.grad[:used].float(), *(t.grad.float() for t in leaves[1:])]
        t = step_times(step, zero, iters=20)
        results[name] = values
        print(f"R={R} d={d} n={n} E={E} {name:8s} rewritten {len(report.rewritten)}: host {t.host_ms:.3f} "
              f"busy {t.busy_ms:.3f} wall {t.wall_ms:.3f} ms  busy TFLOPS {flop / t.busy_ms * 1e-9:.0f}  "
              f"wall TFLOPS {flop / t.wall_ms * 1e-9:.0f}", flush=True)
    diffs = [((a - b).norm() / b.norm()).item() for a, b in zip(results["sonic"], results["inductor"])]
    print("   rel diff sonic vs inductor (out, dx, dw1, dw2, dw3):", [f"{e:.1e}" for e in diffs], flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help=f"the first N of {SHAPES}")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a GPU")
    torch._dynamo.config.recompile_limit = 64
    for shape in SHAPES[:args.shapes]:
        measure(*shape)


if __name__ == "__main__":
    main()
