"""Host time of one MoE layer call: the op's Python and kernel launches, with the host never waiting.

At decode batch sizes (and at small layers) a step is bound by the host enqueueing its launches, not
by the GPU. This times `sonic::moe_experts` forward (decode) and forward+backward (training) at a few
token counts, as launches go now and as they went through Triton's autotuner at every call, side by
side in one process (the two alternate, median of the rounds).

    python benchmarks/kernels/bench_host.py                       # Qwen3-30B-A3B layer sizes
    python benchmarks/kernels/bench_host.py --shape 2048,768,128,8 --tokens 1,8,64 --iters 200
    python benchmarks/kernels/bench_host.py --profile     # also: where the forward's host time goes

Each call is enqueued behind a GPU sleep (`moe_compiler.benchmarking.host_ms`), so that the host
never waits on the GPU inside it: both columns are the host's own time, the backward's too (it
writes dense weight gradients, E x 3 n d values, 1.2 GB at these sizes, whatever the token count,
so launched back to back its calls would wait on the GPU).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from moe_compiler.benchmarking import add_common_args, comma_list, host_ms, host_profile, print_table


def _through_autotuner(tuner, grid, *args, **kwargs):
    tuner[grid](*args, **kwargs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, iters=200, rounds=5, iters_aliases=("--calls",))
    ap.add_argument("--shape", default="2048,768,128,8", help="d,n,E,K")
    ap.add_argument("--tokens", type=comma_list, default="1,8,64")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the last token count's forward calls (tuned launches): top functions by own time")
    args = ap.parse_args()
    from moe_compiler.codegen import moe_experts
    from moe_compiler import codegen

    fast = codegen.launch._launch
    d, n, E, K = (int(v) for v in args.shape.split(","))
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w1 = (torch.randn(E, 2 * n, d, device=dev, dtype=dt, generator=g) / d**0.5).requires_grad_()
    w2 = (torch.randn(E, d, n, device=dev, dtype=dt, generator=g) / n**0.5).requires_grad_()
    title = (f"d={d} n={n} E={E} K={K}, bf16, {torch.cuda.get_device_name()}; host us per call "
             f"(median of {args.rounds} rounds of {args.iters} calls)")
    rows = []
    for T in (int(v) for v in args.tokens):
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

        def zero():
            x.grad = w1.grad = w2.grad = None

        for name, fn in (("forward", forward), ("fwd+bwd", train)):
            fn()  # tune and compile
            times = {"slow": [], "fast": []}
            for _ in range(args.rounds):
                for mode, launch in (("slow", _through_autotuner), ("fast", fast)):
                    codegen.launch._launch = launch
                    times[mode].append(host_ms(fn, iters=args.iters, warmup=1, zero=zero) * 1e3)
            codegen.launch._launch = fast
            slow, fast_us = statistics.median(times["slow"]), statistics.median(times["fast"])
            rows.append([T, name, slow, fast_us, f"{slow - fast_us:.0f} ({slow / fast_us:.2f}x)"])
            print(f"  {T} tokens {name}: {slow:.0f} us through the autotuner, {fast_us:.0f} us tuned", flush=True)
            zero()
    print_table(["tokens", "pass", "via autotuner", "tuned launches", "saved"], rows,
                {"via autotuner": ".0f", "tuned launches": ".0f"}, title=title)
    if args.profile:
        print(f"\ncProfile of {args.iters} forward calls at {T} tokens (cProfile slows Python ~2x):")
        print(host_profile(forward, iters=args.iters, rows=25, sort=("tottime", "cumulative")))


if __name__ == "__main__":
    main()
