"""What the Gluon scatter GEMM's time is made of: the kernel as it runs, without its epilogue, and
without its MMAs (GPU; `gluon_scatter.gluon_scatter_gemm(probe=...)`, diagnostics that give wrong
results); and the kernel storing TILE order by TMA (`out_tiles=True`) instead of slot rows by
pointer stores, checked bit for bit against the slot-order output through `slot_rows_in_tiles`.

    PYTHONPATH=. python scripts/probe_scatter_epilogue.py --shapes 7b-256,1.4b-256,qwen3

Per shape and GEMM (Y, dX~, as benchmarks/bench_gluon_scatter.py builds them), us per call from
CUDA graphs of --calls calls (median of 10 replays): probe 0 (the kernel), 1 (no epilogue: the
accumulator computed, nothing stored), 2 (no wgmma: the loads, the ring and the stores of zeros),
the TILE-order kernel, and the time the output alone takes to write once ([TK, d] bf16 by `Tensor.fill_`, the memory
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

from moe_compiler.codegen.kernels import gluon_scatter as gs  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="7b-256,1.4b-256,qwen3")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--tiles", default="auto", help="comma list: `auto` or ScatterTile specs, each timed in "
                    "slot and TILE order (the probes run on the first)")
    args = ap.parse_args()
    for name in args.shapes.split(","):
        (T, d, n, E, K), sorted_rows, offsets, gen = routed_shape(name)
        for gemm in ("Y", "dX~"):
            inp, w, wl, k_dim = operands(gemm, T, d, n, E, K, gen)
            flop = 2 * inp.shape[0] * k_dim * d
            head = f"{name} {gemm} (w_layout {W_LAYOUT[gemm]}, k_dim {k_dim}, n_dim {d})"
            want = None
            for i, spec in enumerate(args.tiles.split(",")):
                tile = gs.default_tile(wl) if spec == "auto" else gs.ScatterTile.parse(spec)
                out = torch.empty(inp.shape[0], d, device="cuda", dtype=inp.dtype)
                tiled = torch.empty(gs.tile_rows(inp.shape[0], E, tile.block_m), d, device="cuda", dtype=inp.dtype)
                times = {}
                for probe in (0, 1, 2) if i == 0 else (0,):
                    def call(probe=probe):
                        gs.gluon_scatter_gemm(inp, w, wl, None, sorted_rows, offsets, n_dim=d, out=out, probe=probe,
                                              **tile.kwargs())
                    call()
                    times[probe] = gpu_us(call, calls=args.calls)

                def tiles_call():
                    gs.gluon_scatter_gemm(inp, w, wl, None, sorted_rows, offsets, n_dim=d, out=tiled, out_tiles=True,
                                          **tile.kwargs())
                gs.gluon_scatter_gemm(inp, w, wl, None, sorted_rows, offsets, n_dim=d, out=out, **tile.kwargs())
                want = out.clone() if want is None else want
                tiles_call()
                rows = gs.slot_rows_in_tiles(sorted_rows, offsets, tile.block_m).long()
                same = (torch.equal(out, want), torch.equal(tiled[rows], want))
                times["tiles"] = gpu_us(tiles_call, calls=args.calls)
                line = (f"{head} {tile}: slot order {times[0]:.1f} us ({flop / times[0] * 1e-6:.0f} TFLOPS), "
                        f"TILE order by TMA {times['tiles']:.1f} ({flop / times['tiles'] * 1e-6:.0f}); "
                        f"bit-equal to the first tile's slot output: {same[0]} / {same[1]}")
                if i == 0:
                    fill = gpu_us(lambda: out.fill_(1.0), calls=args.calls)
                    line += (f"; slot order without epilogue {times[1]:.1f}, without wgmma {times[2]:.1f}; "
                             f"writing the output once {fill:.1f}")
                print(line, flush=True)


if __name__ == "__main__":
    main()
