"""Gluon weight-gradient tiles on the layer's own operands against randn ones (GPU).

`bench_gluon_wgrad.py` times the kernel on randn operands; inside the layer `wgrad_choice` timed it
well below those figures at some shapes (docs/NOTES.md, seventeenth session). This runs one
fwd+bwd of the `ours-fused-router` layer per shape, keeps the operands each weight gradient got
(dH and x for dW1, dO and A' for dW2, with the routing), and times our Triton kernel and each
Gluon tile on them, then on randn operands of the same shapes and the same routing. Median us.

    PYTHONPATH=. python scripts/probe_wgrad_tiles.py --shapes 7b-256,qwen3,olmoe,1.4b-256
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from bench_gluon_wgrad import run_gluon, run_triton  # noqa: E402  (the launches bench_gluon_wgrad times)
from bench_layer import SHAPES, build_provider, layer_inputs  # noqa: E402

from moe_compiler.codegen import triton_moe  # noqa: E402
from moe_compiler.codegen.kernels import gluon_wgrad as gw  # noqa: E402

TILES = "256x128x64x4x8x88,128x256x64x4x8x88,256x128x64x3x8x88,128x256x64x3x8x88"


def capture(name):
    """{gather_lhs: (lhs, rhs, routing kwargs, dw shape)} of one fwd+bwd of the layer at `name`."""
    shape = SHAPES[name]
    master, x, dy = layer_inputs(shape)
    fn, _ = build_provider("ours-fused-router", master, shape)
    x.requires_grad_()
    seen = {}
    original = triton_moe._weight_grad

    def keep(lhs, rhs, out, **kw):
        routing = {k: kw.get(k) for k in ("sorted_rows", "offsets", "top_k", "row_token")}
        seen.setdefault(kw["gather_lhs"], (lhs.clone(), rhs.clone(), routing, tuple(out.like.shape), out.transposed))
        return original(lhs, rhs, out, **kw)

    triton_moe._weight_grad = keep
    try:
        fn(x).backward(dy)
    finally:
        triton_moe._weight_grad = original
    torch.cuda.synchronize()
    return seen


def time_us(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def probe(name, tiles):
    for gather_lhs, (lhs, rhs, routing, dw_shape, transposed) in sorted(capture(name).items()):
        gemm = "dW2" if gather_lhs else "dW1"
        if transposed:
            print(f"{name} {gemm}: transposed gradient, skipped", flush=True)
            continue
        stats = lambda t: f"std {t.float().std().item():.2e}"  # noqa: E731
        print(f"{name} {gemm}: lhs {tuple(lhs.shape)} {stats(lhs)}, rhs {tuple(rhs.shape)} {stats(rhs)}", flush=True)
        randn = (torch.randn_like(lhs), torch.randn_like(rhs))
        dw = torch.empty(dw_shape, device="cuda", dtype=lhs.dtype)
        rows = []
        for label, (a, b) in (("layer", (lhs, rhs)), ("randn", randn)):
            row = [label, f"{time_us(lambda: run_triton(a, b, gather_lhs, routing, dw)):.0f}"]
            for tile in tiles:
                row.append(f"{time_us(lambda: run_gluon(a, b, gather_lhs, routing, dw, tile)):.0f}")
            rows.append(row)
        print(f"| {name} {gemm} operands | triton | " + " | ".join(map(str, tiles)) + " |", flush=True)
        for row in rows:
            print("| " + " | ".join(row) + " |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="7b-256,qwen3,olmoe,1.4b-256")
    ap.add_argument("--tiles", default=TILES)
    args = ap.parse_args()
    tiles = [gw.WgradTile.parse(t) for t in args.tiles.split(",")]
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    for name in args.shapes.split(","):
        probe(name, tiles)


if __name__ == "__main__":
    main()
