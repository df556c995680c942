"""Block sizes of the two memory-bound passes of a fwd+bwd (GPU): the gather-sum
(`kernels.combine._gather_sum_kernel`, run twice a step) and the activation gradient
(`kernels.backward._act_grad_kernel`). Each is launched directly with each candidate block shape
and timed (median us, `moe_compiler.benchmarking.median_ms`) beside the bytes it must move, as GB/s.

"dx + router" times x's gradient with the router's term [T, E] @ [E, d]: as autograd makes it
(the gather-sum, a cuBLAS mm, an add) against the gather-sum that adds the term itself
(`moe_compiler.grad_fold`), over that kernel's block shapes.

    python benchmarks/kernels/probe_memory_passes.py --shapes 7b-256,qwen3
    python benchmarks/kernels/probe_memory_passes.py --shapes 7b-256 --passes "dx + router" --row-map

`--row-map`: the gather-sums read y in TILE order through a row map (what the op's Gluon scatter
GEMMs store, `gluon_scatter.slot_rows_in_tiles`), on a realistic routing (top-k of random scores).

The launchers' current choices are marked with *.
"""
from __future__ import annotations

import argparse
import functools
import itertools

import torch
import triton

from moe_compiler.benchmarking import SHAPES, add_common_args, comma_list, median_ms
from moe_compiler.codegen.kernels.backward import _act_grad_kernel
from moe_compiler.codegen.kernels.combine import _gather_sum_kernel


def _time(fn, iters):
    return median_ms(fn, iters, warmup=5) * 1e3


def gather_sum(T, d, K, iters):
    from moe_compiler import codegen

    TK = T * K
    y = torch.randn(TK, d, device="cuda").bfloat16()
    s = torch.rand(TK, device="cuda").bfloat16()
    out = torch.empty(T, d, device="cuda", dtype=torch.bfloat16)
    nbytes = TK * d * 2 + T * d * 2 + TK * 2
    current = (*codegen.forward.gather_sum_blocks(d), 4)
    rows = []
    for bt, bd, warps in itertools.product((1, 2, 4, 8), (256, 512, 1024), (4, 8)):
        if bd > triton.next_power_of_2(d):
            continue
        grid = (triton.cdiv(T, bt), triton.cdiv(d, bd))
        fn = lambda: _gather_sum_kernel[grid](y, s, y, y, y, out, T, d, TOP_K=K, HAS_WEIGHTS=True,  # noqa: E731
                                              SLOTS=False, ROW_MAP=False, BLOCK_T=bt, BLOCK_D=bd, num_warps=warps)
        us = _time(fn, iters)
        rows.append((us, f"BLOCK_T {bt} BLOCK_D {bd} warps {warps}{' *' if (bt, bd, warps) == current else ''}",
                     nbytes / us * 1e-3))
    return rows


def _tile_order(T, E, K, y):
    """(y in TILE order, its row map): y's rows placed as the Gluon scatter GEMM stores them for the
    routing of top-k of random scores (every row no slot maps to is zero)."""
    from moe_compiler import codegen
    from moe_compiler.codegen.kernels.gluon_scatter import slot_rows_in_tiles, tile_rows

    sorted_rows, offsets = codegen.routing.route(torch.randn(T, E, device="cuda").topk(K, -1).indices, E)
    row_map = slot_rows_in_tiles(sorted_rows, offsets, codegen.launch.M_TILE)
    tiled = y.new_zeros(tile_rows(T * K, E, codegen.launch.M_TILE), y.shape[1])
    tiled[row_map.long()] = y
    return tiled, row_map


def dx_with_router_term(T, d, E, K, iters, row_map=False, block_j=(64, 128), block_d=(64, 128, 256)):
    from moe_compiler import codegen

    TK = T * K
    y = torch.randn(TK, d, device="cuda").bfloat16()
    lhs = torch.randn(T, E, device="cuda").bfloat16()
    rhs = torch.randn(E, d, device="cuda").bfloat16()
    y_read, rows_kw = y, {}
    if row_map:
        y_read, rows_kw["row_map"] = _tile_order(T, E, K, y)
    nbytes = TK * d * 2 + T * d * 2 + T * E * 2
    plain = functools.partial(codegen.forward.triton_moe_gather_sum, y_read, None, T, K, **rows_kw)
    rows = [(_time(lambda: plain(torch.bfloat16) + lhs @ rhs, iters), "unfolded: gather-sum, mm, add", nbytes)]
    rows.append((_time(lambda: plain(torch.bfloat16), iters), "the gather-sum alone", nbytes - T * E * 2))
    current = codegen.forward.gather_sum_product_launch(d, E, K)
    for bt, bd, bj, warps, waves, first in itertools.product((16, 32, 64), block_d, block_j, (4, 8),
                                                             (0, 4, 8), (True, False)):
        rows_tile = max(2, triton.next_power_of_2(K)) * bt * bd  # elements of the [K * BLOCK_T, BLOCK_D] row load
        if bd > triton.next_power_of_2(d) or rows_tile > 65536 or bj > max(16, triton.next_power_of_2(E)):
            continue
        launch = codegen.forward.ProductLaunch(bt, bd, bj, warps, waves, first)
        us = _time(lambda: plain(torch.bfloat16, product=(lhs, rhs), product_launch=launch), iters)
        rows.append((us, f"folded: {tuple(launch)}{' *' if launch == current else ''}", nbytes))
    want = codegen.forward.triton_moe_gather_sum(y, None, T, K, torch.float32) + lhs.float() @ rhs.float()
    got = plain(torch.bfloat16, product=(lhs, rhs)).float()
    print(f"  {T}x{d} E {E}: folded against float32, max rel err {((got - want).abs().max() / want.abs().max()).item():.2e}")
    return [(us, label, nb / us * 1e-3) for us, label, nb in rows]


def act_grad(T, n, E, K, iters):
    from moe_compiler import codegen

    TK = T * K
    da = torch.randn(TK, n, device="cuda").bfloat16()
    h = torch.randn(TK, 2 * n, device="cuda").bfloat16()
    s = torch.rand(TK, device="cuda").bfloat16()
    ids = torch.randn(T, E, device="cuda").topk(K, -1).indices
    sorted_rows, offsets = codegen.routing.route(ids, E)
    dh = torch.empty_like(h)
    ds = torch.zeros(TK, device="cuda")
    nbytes = TK * n * 2 * 2 + TK * 2 * n * 2 * 2 + TK * (4 + 2 + 4)
    current = (*codegen.backward.act_grad_blocks(n), 4)
    rows = []
    for br, bc, warps in itertools.product((4, 8, 16, 32), (64, 128, 256), (4, 8)):
        if bc > triton.next_power_of_2(n):
            continue
        grid = (triton.cdiv(TK, br),)
        fn = lambda: _act_grad_kernel[grid](da, h, s, sorted_rows, offsets, dh, da, ds, TK, n, E, 1.702, 7.0,  # noqa: E731
                                            ACTIVATION=codegen.launch._ACT_CODE["swiglu"], GATED=True, INTERLEAVED=False, BLOCK_R=br, BLOCK_C=bc,
                                            num_warps=warps)
        us = _time(fn, iters)  # in place, as the launcher runs it: the values drift, the bytes do not
        rows.append((us, f"BLOCK_R {br} BLOCK_C {bc} warps {warps}{' *' if (br, bc, warps) == current else ''}",
                     nbytes / us * 1e-3))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, shapes="7b-256,qwen3", iters=50, iters_aliases=("--rep",))
    ap.add_argument("--passes", type=comma_list, default="gather-sum,act-grad,dx + router")
    ap.add_argument("--top", type=int, default=6, help="rows printed per table (the current choice always)")
    ap.add_argument("--row-map", action="store_true", help="dx + router: y in TILE order, read through a row map")
    ap.add_argument("--block-j", type=comma_list, default="64,128", help="dx + router: the BLOCK_J values swept")
    ap.add_argument("--block-d", type=comma_list, default="64,128,256", help="dx + router: the BLOCK_D values swept")
    args = ap.parse_args()
    block_j, block_d = (tuple(int(b) for b in v) for v in (args.block_j, args.block_d))
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}")
    for name in args.shapes:
        T, d, n, E, K = SHAPES[name]
        passes = {"gather-sum": lambda: gather_sum(T, d, K, args.iters),
                  "act-grad": lambda: act_grad(T, n, E, K, args.iters),
                  "dx + router": lambda: dx_with_router_term(T, d, E, K, args.iters, args.row_map, block_j, block_d)}
        for what in args.passes:
            rows = passes[what]()
            rows.sort()
            print(f"\n{name} {what}:")
            for us, label, gbs in rows:
                if rows.index((us, label, gbs)) < args.top or label.endswith("*") or not label.startswith("folded"):
                    print(f"  {us:8.1f} us  {gbs:7.0f} GB/s  {label}")


if __name__ == "__main__":
    main()
