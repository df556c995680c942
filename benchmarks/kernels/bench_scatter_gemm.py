"""Our scatter GEMMs against torch._grouped_mm (CUTLASS) on the same expert-ordered rows (GPU).

Question: is the down-projection / dX~ GEMM core behind the CUTLASS grouped GEMM that
transformers' grouped_mm path (and so Inductor) runs?

    python benchmarks/kernels/bench_scatter_gemm.py --shapes 7b-256,qwen3,olmoe,30b-512

Per shape (T, d, n, E, K of `moe_compiler.benchmarking.SHAPES`), on top-k routing of random logits:
    Y   = A [TK, n] @ W2[e]^T     (forward down-projection; ours stores rows in slot order)
    dX~ = dH [TK, 2n] @ W1[e]     (backward input gradient before the gather-sum)
median times (`benchmarking.median_ms`: do_bench over about --iters calls) and TFLOPS of each, and
the relative difference of the two results (ours permuted back to expert order). grouped_mm writes
expert order, which a gather-sum would then read through the inverse permutation: that read is not
timed here.
"""
from __future__ import annotations

import argparse

import torch

from moe_compiler.benchmarking import SHAPES, add_common_args, median_ms, print_table


def bench_shape(T, d, n, E, K, warmup, iters):
    from moe_compiler import codegen

    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randn(T, E, device="cuda", generator=gen).topk(K, -1).indices
    sorted_rows, offsets = codegen.routing.route(ids, E)
    TK = T * K
    rnd = lambda *s, std: (torch.randn(*s, device="cuda", generator=gen) * std).to(torch.bfloat16)  # noqa: E731
    w1, w2 = rnd(E, 2 * n, d, std=d**-0.5), rnd(E, d, n, std=n**-0.5)
    a, dh = rnd(TK, n, std=1.0), rnd(TK, 2 * n, std=1.0)
    W1, W2 = codegen.launch._stacked_banks(w1, w2, False)
    sw = W2.strides
    ends = offsets[1:].contiguous()
    cases = {
        "Y": (lambda: codegen.forward.triton_moe_scatter_gemm(a, W2, (sw[0], sw[2], sw[1]), None, sorted_rows, offsets, n_dim=d),
              lambda: torch._grouped_mm(a, w2.transpose(1, 2), offs=ends), 2 * TK * n * d),
        "dX~": (lambda: codegen.forward.triton_moe_scatter_gemm(dh, W1, W1.strides, None, sorted_rows, offsets, n_dim=d),
                lambda: torch._grouped_mm(dh, w1, offs=ends), 2 * TK * 2 * n * d),
    }
    out = {}
    for name, (ours, cutlass, flop) in cases.items():
        got, want = ours()[sorted_rows.long()].float(), cutlass().float()
        diff = ((got - want).norm() / want.norm()).item()
        t_ours = median_ms(ours, iters, warmup) * 1e3
        t_cutlass = median_ms(cutlass, iters, warmup) * 1e3
        out[name] = (t_ours, flop / t_ours * 1e-6, t_cutlass, flop / t_cutlass * 1e-6, diff)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, shapes="7b-256,qwen3,olmoe,30b-512", warmup=10, iters=100, iters_aliases=("--rep",))
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    rows = []
    for sname in args.shapes:
        for gemm, (t1, f1, t2, f2, diff) in bench_shape(*SHAPES[sname], args.warmup, args.iters).items():
            rows.append([sname, gemm, t1, f1, t2, f2, t1 / t2, diff])
            print(f"  {sname} {gemm}: ours {t1:.0f} us, grouped_mm {t2:.0f} us", flush=True)
    print_table(["shape", "GEMM", "ours us", "ours TFLOPS", "grouped_mm us", "grouped_mm TFLOPS",
                 "ours / grouped_mm time", "rel diff"], rows,
                {"ours us": ".0f", "ours TFLOPS": ".0f", "grouped_mm us": ".0f", "grouped_mm TFLOPS": ".0f",
                 "ours / grouped_mm time": ".2f", "rel diff": ".1e"})


if __name__ == "__main__":
    main()
