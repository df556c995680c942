"""Host time of one `sonic::moe_experts` forward and backward (GPU): the op through torch.ops
(custom-op dispatch included) against the same Triton path called directly, each call enqueued
behind a GPU sleep so the host never waits on the GPU. Median us over --calls calls.

    PYTHONPATH=. python scripts/probe_host.py --shape 16384,1536,1024,128,2
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from bench_route import host_us  # noqa: E402  (its timing loop, here with the GPU kept busy ahead)

from moe_compiler.codegen import triton_moe  # noqa: E402
from moe_compiler.codegen.ops import moe_experts_backward_op, moe_experts_op  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384,1536,1024,128,2")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    T, d, n, E, K = map(int, args.shape.split(","))
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, d, device=dev, generator=g).bfloat16()
    w1 = (torch.randn(E, 2 * n, d, device=dev, generator=g) * d**-0.5).bfloat16()
    w2 = (torch.randn(E, d, n, device=dev, generator=g) * n**-0.5).bfloat16()
    ids = torch.randn(T, E, device=dev, generator=g).topk(K, -1).indices
    wts = torch.softmax(torch.randn(T, K, device=dev, generator=g), -1).bfloat16()
    dy = torch.randn(T, d, device=dev, generator=g).bfloat16()
    flags = dict(activation="swiglu", interleaved=False, transposed=False, alpha=1.702, limit=7.0)
    out, h, rows, offs = moe_experts_op(x, ids, wts, w1, w2, None, None, *flags.values(), True)
    fwd_op = lambda: moe_experts_op(x, ids, wts, w1, w2, None, None, *flags.values(), True)  # noqa: E731
    fwd_direct = lambda: triton_moe.triton_moe_experts_fwd(x, ids, wts, w1, w2, None, None, save_h=True, **flags)  # noqa: E731
    bwd_op = lambda: moe_experts_backward_op(dy, x, ids, wts, w1, w2, None, None, h, rows, offs, *flags.values())  # noqa: E731
    bwd_direct = lambda: triton_moe.triton_moe_experts_bwd(dy, x, ids, wts, w1, w2, None, None, h, rows, offs, **flags)  # noqa: E731
    for name, fn in [("fwd op", fwd_op), ("fwd direct", fwd_direct), ("bwd op", bwd_op), ("bwd direct", bwd_direct),
                     ("fwd op", fwd_op), ("bwd op", bwd_op)]:
        print(f"{name:>10}: {host_us(fn, args.calls, ahead_cycles=int(3e9)):8.1f} us host per call", flush=True)
    # the same through torch.profiler's CPU view: which calls take the host time in one backward
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        bwd_op()
    torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
