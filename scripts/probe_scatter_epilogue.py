"""What the Gluon scatter GEMM's time is made of: the kernel as it runs, without its epilogue, and
without its MMAs (GPU; `gluon_scatter.gluon_scatter_gemm(probe=...)`, diagnostics that give wrong
results).

    PYTHONPATH=. python scripts/probe_scatter_epilogue.py --shapes 7b-256,1.4b-256,qwen3

Per shape and GEMM (Y, dX~, as benchmarks/bench_gluon_scatter.py builds them), us per call from
CUDA graphs of --calls calls (median of 10 replays): probe 0 (the kernel), 1 (no epilogue: the
accumulator computed, nothing stored), 2 (no wgmma: the loads, the ring and the stores of zeros),
and the time the output alone takes to write once ([TK, d] bf16 by `Tensor.fill_`, the memory
floor of the stores). Question: at 7b-256 the Y GEMM takes ~384 us in the layer's graph against
SonicMoE's ~332; is the scattered-row epilogue or the mainloop the part to work on?
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from bench_gluon_scatter import W_LAYOUT, operands  # noqa: E402
from bench_route import gpu_us  # noqa: E402
from gluon_bench_common import routed_shape  # noqa: E402

from codegen.kernels import gluon_scatter as gs  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="7b-256,1.4b-256,qwen3")
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    for name in args.shapes.split(","):
        (T, d, n, E, K), sorted_rows, offsets, gen = routed_shape(name)
        for gemm in ("Y", "dX~"):
            inp, w, wl, k_dim = operands(gemm, T, d, n, E, K, gen)
            out = torch.empty(inp.shape[0], d, device="cuda", dtype=inp.dtype)
            times = {}
            for probe in (0, 1, 2):
                def call(probe=probe):
                    gs.gluon_scatter_gemm(inp, w, wl, None, sorted_rows, offsets, n_dim=d, out=out, probe=probe)
                call()
                times[probe] = gpu_us(call, calls=args.calls)
            fill = gpu_us(lambda: out.fill_(1.0), calls=args.calls)
            flop = 2 * inp.shape[0] * k_dim * d
            print(f"{name} {gemm} (w_layout {W_LAYOUT[gemm]}, k_dim {k_dim}, n_dim {d}): kernel {times[0]:.1f} us "
                  f"({flop / times[0] * 1e-6:.0f} TFLOPS), no epilogue {times[1]:.1f}, no wgmma {times[2]:.1f}, "
                  f"writing the output once {fill:.1f}", flush=True)


if __name__ == "__main__":
    main()
