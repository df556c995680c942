"""Our weight-gradient GEMMs against torch._grouped_mm (CUTLASS, K-grouped) (GPU).

    python benchmarks/kernels/bench_wgrad.py --shapes 7b-256,olmoe,qwen3
    python benchmarks/kernels/bench_wgrad.py --shapes olmoe --tokens 8192,16384

Per shape (d, n, E, K of `moe_compiler.benchmarking.SHAPES`; T from --tokens, or the shape's own),
on top-k routing of random logits, the two weight gradients of a SwiGLU layer's backward:
    dW1[e] = dH_e^T gather(x)_e      [2n, d], reduced over expert e's rows
    dW2[e] = gather(dO)_e^T A'_e     [d, n]
median times (`benchmarking.median_ms`: do_bench over about --iters calls) and TFLOPS of ours (the
gathered operand read in place) and of torch._grouped_mm on operands gathered beforehand (that
gather is not timed), and the relative difference of the two results.
"""
from __future__ import annotations

import argparse

import torch

from moe_compiler.benchmarking import SHAPES, add_common_args, comma_list, median_ms, print_table


def _cutlass(lhs_t, rhs, ends):
    try:
        return torch._grouped_mm(lhs_t, rhs, offs=ends)
    except RuntimeError as exc:  # an older torch without K-grouped 2D x 2D inputs
        print(f"grouped_mm unavailable: {exc}".splitlines()[0])
        return None


def bench_shape(T, d, n, E, K, warmup, iters):
    from moe_compiler import codegen

    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randn(T, E, device="cuda", generator=gen).topk(K, -1).indices
    sorted_rows, offsets = codegen.routing.route(ids, E)
    TK = T * K
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16)  # noqa: E731
    x, do, dh, a_s = rnd(T, d), rnd(T, d), rnd(TK, 2 * n), rnd(TK, n)
    dw1, dw2 = torch.empty(E, 2 * n, d, device="cuda", dtype=torch.bfloat16), torch.empty(
        E, d, n, device="cuda", dtype=torch.bfloat16)
    routing = dict(sorted_rows=sorted_rows, offsets=offsets, top_k=K)
    calls = {
        "dW1": (lambda: codegen.backward.triton_moe_wgrad(dh, x, gather_lhs=False, gather_rhs=True, dw=dw1,
                                                    dw_strides=dw1.stride(), **routing), 2 * TK * 2 * n * d),
        "dW2": (lambda: codegen.backward.triton_moe_wgrad(do, a_s, gather_lhs=True, gather_rhs=False, dw=dw2,
                                                    dw_strides=dw2.stride(), **routing), 2 * TK * n * d),
    }
    tokens = (sorted_rows.long() // K)
    ends = offsets[1:].contiguous()
    x_g, do_g = x[tokens], do[tokens]
    cutlass = {"dW1": lambda: _cutlass(dh.t(), x_g, ends), "dW2": lambda: _cutlass(do_g.t(), a_s, ends)}
    rows = []
    for gemm, (fn, flop) in calls.items():
        ours = fn().float().clone()
        t = median_ms(fn, iters, warmup) * 1e3
        row = [gemm, t, flop / t * 1e-6, None, None, None]
        ref = cutlass[gemm]()
        if ref is not None:
            t = median_ms(cutlass[gemm], iters, warmup) * 1e3
            row[3:] = t, flop / t * 1e-6, ((ref.float() - ours).norm() / ref.float().norm()).item()
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, shapes="7b-256,qwen3,olmoe", warmup=10, iters=100, iters_aliases=("--rep",))
    ap.add_argument("--tokens", type=comma_list, default="",
                    help="comma list of T to run each shape at (default: the shape's)")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    rows = []
    for sname in args.shapes:
        T0, d, n, E, K = SHAPES[sname]
        for T in [int(t) for t in args.tokens] or [T0]:
            for gemm, t1, f1, t2, f2, diff in bench_shape(T, d, n, E, K, args.warmup, args.iters):
                rows.append([sname, T, gemm, t1, f1, t2, f2, t1 / t2 if t2 else None, diff])
                print(f"  {sname} T={T} {gemm}: ours {t1:.0f} us" + (f", grouped_mm {t2:.0f} us" if t2 else ""),
                      flush=True)
    print_table(["shape", "T", "GEMM", "ours us", "ours TFLOPS", "grouped_mm us", "grouped_mm TFLOPS",
                 "ours / grouped_mm time", "rel diff"], rows,
                {"ours us": ".0f", "ours TFLOPS": ".0f", "grouped_mm us": ".0f", "grouped_mm TFLOPS": ".0f",
                 "ours / grouped_mm time": ".2f", "rel diff": ".1e"})


if __name__ == "__main__":
    main()
