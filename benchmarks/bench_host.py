"""Host time of one MoE layer call: the op's Python and kernel launches, with the GPU idle.

At decode batch sizes (and at small layers) a step is bound by the host enqueueing its launches, not
by the GPU. This times `sonic::moe_experts` forward (decode) and forward+backward (training) at a few
token counts, as launches go now and as they went through Triton's autotuner at every call, side by
side in one process (the two alternate, median of the rounds).

    PYTHONPATH=. python benchmarks/bench_host.py                       # Qwen3-30B-A3B layer sizes
    PYTHONPATH=. python benchmarks/bench_host.py --shape 2048,768,128,8 --tokens 1,8,64 --calls 200
    PYTHONPATH=. python benchmarks/bench_host.py --profile     # also: where the forward's host time goes

At a few tokens the forward is host-bound. The backward is not: it writes dense weight gradients
(E x 3 n d values, 1.2 GB at these sizes) whatever the token count, so its calls wait on the GPU and
its column measures the GPU there, not the host.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from moe_compiler.codegen import moe_experts
from moe_compiler.codegen import triton_moe as tm

_FAST = tm._launch


def _through_autotuner(tuner, grid, *args, **kwargs):
    tuner[grid](*args, **kwargs)


def host_us(fn, calls: int) -> float:
    """Wall time per call of `calls` calls enqueued back to back (the GPU kept busy by nothing else)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    enqueued = time.perf_counter() - start
    torch.cuda.synchronize()
    return enqueued / calls * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2048,768,128,8", help="d,n,E,K")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the last token count's forward calls (tuned launches): top functions by own time")
    args = ap.parse_args()
    d, n, E, K = (int(v) for v in args.shape.split(","))
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w1 = (torch.randn(E, 2 * n, d, device=dev, dtype=dt, generator=g) / d**0.5).requires_grad_()
    w2 = (torch.randn(E, d, n, device=dev, dtype=dt, generator=g) / n**0.5).requires_grad_()
    print(f"d={d} n={n} E={E} K={K}, bf16, {torch.cuda.get_device_name()}; host us per call "
          f"(median of {args.rounds} rounds of {args.calls} calls)")
    print("| tokens | pass | via autotuner | tuned launches | saved |")
    print("|---|---|---|---|---|")
    for T in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(T, d, device=dev, dtype=dt, generator=g).requires_grad_()
        logits = torch.randn(T, E, device=dev, generator=g)
        w, ids = logits.softmax(-1).topk(K, dim=-1)
        w = w.to(dt)
        go = torch.randn(T, d, device=dev, dtype=dt, generator=g)

        def forward():
            with torch.no_grad():
                moe_experts(x, ids, w, w1, w2)

        def train():
            moe_experts(x, ids, w, w1, w2).backward(go)

        for name, fn in (("forward", forward), ("fwd+bwd", train)):
            fn()  # tune and compile
            times = {"slow": [], "fast": []}
            for _ in range(args.rounds):
                for mode, launch in (("slow", _through_autotuner), ("fast", _FAST)):
                    tm._launch = launch
                    fn()
                    times[mode].append(host_us(fn, args.calls))
            tm._launch = _FAST
            slow, fast = statistics.median(times["slow"]), statistics.median(times["fast"])
            print(f"| {T} | {name} | {slow:.0f} | {fast:.0f} | {slow - fast:.0f} ({slow / fast:.2f}x) |", flush=True)
            x.grad = w1.grad = w2.grad = None
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        host_us(forward, args.calls)
        profiler.disable()
        print(f"\ncProfile of {args.calls} forward calls at {T} tokens (cProfile slows Python ~2x):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
