"""The forward's launchers and the two forward entry points `codegen.ops` calls on CUDA.

    triton_moe_experts_fwd(...)      -> (out [T, d], H [TK, w1_out] or [0, w1_out], sorted_rows [TK], offsets [E+1])
    triton_moe_experts_list_fwd(...) -> the same, reading per-expert weights in place (`launch.list_banks`)

Notation as in `codegen.activations`; routing metadata as in `codegen.routing`. H (saved for the
backward) is in expert order.

    route -> _up_proj_kernel (gather x; H and A = act(H)) -> _scatter_gemm_kernel (Y = A W2^T + b2,
    stored in slot order; the Gluon kernel's in TILE order, `SCATTER_TILES`) -> _gather_sum_kernel (out)

A forward that keeps no H (inference) with few slots (`decode.decode_path`) runs `codegen.decode`
instead. The up-projection, scatter GEMM and gather-sum launchers also serve the backward.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
from torch import Tensor

from . import wgrad_choice
from .activations import GATED
from .decode import decode_path, triton_moe_decode, _w1_out
from .direct_launch import launch
from .ints import cdiv, pow2
from .kernels.combine import _gather_sum_kernel, _gather_sum_product_kernel
from .kernels.routing import e_pow2
from .launch import (
    _ACT_CODE,
    INTERPRETED,
    Bank,
    _dot_precision,
    _gluon_module,
    _launch,
    _or,
    _persistent_grid,
    _persistent_up,
    _programs,
    _scatter,
    _scatter_tma,
    _stacked_banks,
    _tile_grid,
    _tma_operand,
    _up,
    _up_persistent,
    _up_tma,
    _up_weight_desc,
    _weight_desc,
)
from .routing import _dense_routing, route, _row_token, _slot_routing


# The Gluon scatter GEMMs (Y, dX~) store TILE order (`gluon_scatter_gemm(out_tiles=True)`: every M
# tile's rows as whole boxes by TMA, no scattered row stores), and the gather-sums read each slot's
# row through the map that the same launch writes (`gluon_scatter_gemm(row_map=...)`); env
# SONIC_MOE_SCATTER_TILES=0 (or `set_scatter_tiles`) keeps slot order.
SCATTER_TILES = os.environ.get("SONIC_MOE_SCATTER_TILES", "1") != "0"
# The product gather-sum (dX with the router's term folded in) loads the next token block's row-map
# entries while it sums the current block's rows ([T, K] routing through a row map); False loads each
# block's entries just before its rows (A/B runs).
MAP_PREFETCH = True


def set_scatter_tiles(tiles: bool) -> None:
    """Switch `SCATTER_TILES` at run time (A/B runs; the scatter GEMM's choice keys on it)."""
    global SCATTER_TILES
    SCATTER_TILES = tiles


def triton_moe_up(x, w1: Bank, b1, sorted_rows, offsets, *, n, top_k, activation, interleaved, alpha, limit,
                  store_h=True, store_a=True, row_token=None, **_):
    """H [TK, w1_out] (or [0, w1_out]) and A [TK, n] (or [0, n]) in expert order."""
    T, d = x.shape
    E = offsets.numel() - 1
    TK = sorted_rows.numel()
    gated = GATED[activation]
    w1_out = 2 * n if gated else n
    h = x.new_empty(TK if store_h else 0, w1_out)
    a = x.new_empty(TK if store_a else 0, n)
    if TK == 0 or not (store_h or store_a):
        return h, a
    b1c = b1.contiguous() if b1 is not None else x
    w_ptr, w_table, has_table, align = w1.kernel_args()
    desc, w_desc = _up_weight_desc(w1, E, n, d, gated, interleaved)
    flags = dict(ACTIVATION=_ACT_CODE[activation], GATED=gated, INTERLEAVED=bool(interleaved and gated),
                 HAS_B1=b1 is not None, STORE_H=store_h, STORE_A=store_a, E_POW2=e_pow2(E),
                 TOKEN_MAP=row_token is not None)
    if _persistent_up(desc, w_desc, gated, interleaved):
        _launch(
            _up_persistent, _persistent_grid(TK, E, n, x.device),
            x, desc, b1c, sorted_rows, _or(row_token, sorted_rows), offsets, h, a,
            TK, d, n, E, top_k,
            x.stride(0), x.stride(1),
            w1_out if b1 is not None else 0, 1,
            float(alpha), float(limit),
            W_DESC=w_desc, **flags,
        )
        return h, a
    kernel = _up_tma if desc is not None else _up
    _launch(
        kernel, _tile_grid(TK, E, n),
        x, _or(desc, w_ptr), b1c, sorted_rows, _or(row_token, sorted_rows), offsets, h, a, w_table,
        TK, d, n, E, top_k,
        x.stride(0), x.stride(1),
        *w1.strides,
        w1_out if b1 is not None else 0, 1,
        float(alpha), float(limit),
        DOT_PRECISION=_dot_precision(x.dtype), W_TABLE=has_table, W_ALIGN=align, W_DESC=w_desc, **flags,
    )
    return h, a


def _gluon_scatter(gluon, tile, out_tiles: bool, inp, w_view, w_desc, bias, sorted_rows, offsets, *, n_dim,
                   num_programs) -> tuple[Tensor, Tensor | None]:
    """(out, row_map) of the Gluon scatter GEMM: TILE order and the map from slots to its rows
    (written by the same launch), or slot order and None."""
    row_map = torch.empty_like(sorted_rows) if out_tiles else None
    out = gluon.gluon_scatter_gemm(inp, w_view, w_desc, bias, sorted_rows, offsets, n_dim=n_dim,
                                   num_programs=num_programs, out_tiles=out_tiles, row_map=row_map, **tile.kwargs())
    return out, row_map


def triton_moe_scatter_gemm(inp, w: Bank, w_strides, bias, sorted_rows, offsets, *, n_dim, split=0, row_map=False):
    """out [TK, n_dim] in SLOT order: out[sorted_rows[r]] = inp[r] @ B[e] (+ bias[e]).

    w_strides = (e, k, n) strides reading the expert weight as B[e] [k_dim, n_dim]; `split` > 0:
    rows k >= split of B[e] come from the bank's up table (W1 as separate gate/up tensors).
    `row_map`: returns (out, row_map) instead, where the Gluon kernel, if chosen, stores out in
    TILE order (with `SCATTER_TILES`), slot s's product at row row_map[s] (the kernel writes the map); a
    row_map of None: slot order.
    """
    TK, k_dim = inp.shape
    E = offsets.numel() - 1
    tiles = row_map and SCATTER_TILES
    if TK == 0:
        out = inp.new_empty(TK, n_dim)
        return (out, None) if row_map else out
    biasc = bias.contiguous() if bias is not None else inp
    if split == 0:
        w_d, w_desc = _weight_desc(w, E, n_dim, k_dim, w_strides[2], w_strides[1])
        in_d = _tma_operand(inp, tuple(inp.shape), tuple(inp.stride())) if w_d is not None else None
        if in_d is not None:
            def triton_kernel():
                out = inp.new_empty(TK, n_dim)
                _launch(
                    _scatter_tma, _persistent_grid(TK, E, n_dim, inp.device),
                    in_d, w_d, biasc, sorted_rows, offsets, out,
                    TK, k_dim, n_dim, E, n_dim,
                    HAS_BIAS=bias is not None, E_POW2=e_pow2(E), W_DESC=w_desc,
                )
                return out, None

            candidates = {"triton": triton_kernel}
            gluon = _gluon_module("gluon_scatter", inp)
            if gluon is not None:
                # the stacked weight as the Gluon kernel's descriptor reads it (`_weight_desc`'s dims)
                dims = (E, n_dim, k_dim) if w_desc == 1 else (E, k_dim, n_dim)
                strides = (w.strides[0], w_strides[2] if w_desc == 1 else w_strides[1], 1)
                w_view = w.ptr.as_strided(dims, strides)
                b = biasc if bias is not None else None
                if gluon.supports(inp, w_view, w_desc, b, n_dim=n_dim) is None:
                    for name, tile in gluon.candidate_tiles(w_desc, k_dim, out_tiles=tiles).items():
                        out_tiles = tiles and tile.shared_bytes(True) <= gluon.SHARED_LIMIT
                        candidates[name] = functools.partial(
                            _gluon_scatter, gluon, tile, out_tiles, inp, w_view, w_desc, b, sorted_rows, offsets,
                            n_dim=n_dim, num_programs=_programs(inp.device))
            key = ("scatter", k_dim, n_dim, E, w_desc, bias is not None, inp.dtype, tiles)
            out, rows = wgrad_choice.choose(key, candidates, cuda=True, pinned=wgrad_choice.SCATTER_PINNED)()
            return (out, rows) if row_map else out
    out = inp.new_empty(TK, n_dim)
    w_ptr, w_table, has_table, align = w.kernel_args()
    _launch(
        _scatter, _tile_grid(TK, E, n_dim),
        inp, w_ptr, biasc, sorted_rows, offsets, out, w_table,
        TK, k_dim, n_dim, E, split,
        *w_strides, n_dim,
        HAS_BIAS=bias is not None, E_POW2=e_pow2(E), DOT_PRECISION=_dot_precision(inp.dtype),
        W_TABLE=has_table, SPLIT_K=split > 0, W_ALIGN=align,
    )
    return (out, None) if row_map else out


def gather_sum_blocks(d: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_D) of the gather-sum over rows of width d."""
    if INTERPRETED:
        return 2, min(16, pow2(d))
    lowbit = d & -d  # widest power-of-two block that tiles d exactly (no half-empty last block)
    return 4, min(1024, lowbit if lowbit >= 128 else pow2(d))


class ProductLaunch(NamedTuple):
    """How `_gather_sum_product_kernel` is launched (`benchmarks/kernels/probe_memory_passes.py` measures them)."""

    block_t: int
    block_d: int
    block_j: int  # the dot's inner chunk; R stays resident when J fits in one
    warps: int
    waves: int  # token-block programs per column: enough for `waves` per SM, each walking several blocks; 0: one block each
    product_first: bool  # the dot before the row loads

    def grid(self, T: int, d: int, sms: int) -> tuple[int, int]:
        blocks, cols = cdiv(T, self.block_t), cdiv(d, self.block_d)
        return (blocks if self.waves == 0 else max(1, min(blocks, cdiv(self.waves * sms, cols))), cols)


def gather_sum_product_launch(d: int, J: int, K: int) -> ProductLaunch:
    """The product gather-sum's launch at row width d, inner size J and K rows a token (8 warps, R
    resident up to J = 128, the rows loaded before the dot). A token block's K rows arrive in one
    [K * BLOCK_T, BLOCK_D] load, so the block's shape follows K. Measured on the H100 through a
    TILE-order row map (docs/BENCHMARKS.md, 2026-11-27; `benchmarks/kernels/probe_memory_passes.py
    --passes "dx + router" --row-map` sweeps the same launches), the best of 12 launches at each
    shape but OLMoE (J = 64: 211.8 us at BLOCK_D 128, 217.5 at 256) (us, against the gather-sum alone):
    K = 2, 7b-1024: (32, 128, 4 waves) 86.8 / 84.2;  K = 4, 7b-512: (16, 128, 4 waves) 136.9 / 135.8;
    K = 8, 7b-256 / 1.4b-256 / Qwen3 / 30b-512: (16, 256, 4 waves) 250.6 / 214.5 / 223.7 / 838.1
    against 239.0 / 202.9 / 212.0 / 812.9;  K = 16, 30b-256: (32, 128, one block a program) 1797.5
    / 1549.8."""
    block_j = max(16, min(128, pow2(J)))
    if INTERPRETED:
        return ProductLaunch(16, min(16, pow2(d)), min(block_j, 16), 4, 0, True)
    k_pow2 = max(2, pow2(K))
    # past K = 16 (not measured), the block keeps K = 16's 64 Ki elements of rows
    block_t, block_d, waves = {2: (32, 128, 4), 4: (16, 128, 4), 8: (16, 256, 4), 16: (32, 128, 0)}.get(
        k_pow2, (16, max(16, 4096 // k_pow2), 0))
    return ProductLaunch(block_t, max(16, min(block_d, pow2(d))), block_j, 8, waves, False)  # tl.dot: N >= 16


def triton_moe_gather_sum(y: Tensor, s: Tensor | None, T: int, top_k: int, out_dtype: torch.dtype,
                          slots: tuple[Tensor, Tensor] | None = None,
                          product: tuple[Tensor, Tensor] | None = None, product_launch: ProductLaunch | None = None,
                          row_map: Tensor | None = None) -> Tensor:
    """out [T, d] = sum_k (s[t, k]) y[t*K + k] (+ L[t] @ R), float32 accumulation; y [T*K, d] in slot order,
    or, given row_map [TK] (`triton_moe_scatter_gemm(row_map=True)`), slot j's row at y[row_map[j]].

    slots = (ids [TK], token_offsets [T+1]) for the slot form: token t sums its real slots in
    [token_offsets[t], token_offsets[t+1]). product = (L [T, J], R [J, d]), both of one float dtype,
    any strides, and no weights: a dense term added in float32 before the result is rounded (x's
    gradient through the router, folded in by `moe_compiler.grad_fold`); `product_launch` overrides how.
    """
    d = y.shape[1]
    out = torch.empty(T, d, dtype=out_dtype, device=y.device)
    if T == 0 or d == 0:
        return out
    ids, offs = slots if slots is not None else (y, y)
    K = top_k if slots is None else 1
    if product is None:
        block_t, block_d = gather_sum_blocks(d)
        grid = (cdiv(T, block_t), cdiv(d, block_d))
        launch(_gather_sum_kernel, grid, y, _or(s, y), ids, offs, _or(row_map, ids), out, T, d, TOP_K=K,
               HAS_WEIGHTS=s is not None, SLOTS=slots is not None, ROW_MAP=row_map is not None,
               BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
        return out
    lhs, rhs = product
    J = lhs.shape[1]
    if s is not None or lhs.shape != (T, J) or rhs.shape != (J, d) or lhs.dtype != rhs.dtype:
        raise ValueError(f"gather-sum product: L {tuple(lhs.shape)} {lhs.dtype} and R {tuple(rhs.shape)} {rhs.dtype} "
                         f"do not make a [{T}, {d}] term (or weights were given)")
    lp = product_launch or gather_sum_product_launch(d, J, K)
    launch(_gather_sum_product_kernel, lp.grid(T, d, _programs(y.device)),
        y, ids, offs, _or(row_map, ids), lhs, rhs, out, T, d, J, lhs.stride(0), lhs.stride(1), rhs.stride(0),
        rhs.stride(1), TOP_K=K, SLOTS=slots is not None, ROW_MAP=row_map is not None, BLOCK_T=lp.block_t,
        BLOCK_D=lp.block_d, BLOCK_J=lp.block_j,
        R_RESIDENT=J <= lp.block_j, PRODUCT_FIRST=lp.product_first, DOT_PRECISION=_dot_precision(lhs.dtype),
        K_POW2=max(2, pow2(K)), PREFETCH=MAP_PREFETCH and row_map is not None and slots is None,
        num_warps=lp.warps,
    )
    return out


def triton_moe_experts_fwd(x, topk_ids, topk_weights, w1, w2, b1, b2, *, activation, interleaved, transposed,
                           alpha, limit, save_h, slot_token=None):
    W1, W2 = _stacked_banks(w1, w2, transposed)
    n = w2.shape[1] if transposed else w2.shape[2]
    return _forward(x, topk_ids, topk_weights, W1, W2, b1, b2, n=n, activation=activation, interleaved=interleaved,
                    alpha=alpha, limit=limit, save_h=save_h, slot_token=slot_token)


def triton_moe_experts_list_fwd(x, topk_ids, topk_weights, w_gate, w_up, w_down, b1=None, b2=None, *, banks,
                                activation, interleaved, alpha, limit, save_h, slot_token=None):
    """`sonic::moe_experts_list` on CUDA: the same kernels, reading each expert's tensors in place
    (`banks` from `list_banks`); b1, b2 stacked, as the stacked form takes them."""
    W1, W2 = banks
    return _forward(x, topk_ids, topk_weights, W1, W2, b1, b2, n=w_down[0].shape[1], activation=activation,
                    interleaved=interleaved, alpha=alpha, limit=limit, save_h=save_h, slot_token=slot_token)


def _forward(x, topk_ids, topk_weights, W1: Bank, W2: Bank, b1, b2, *, n, activation, interleaved, alpha, limit,
             save_h, slot_token):
    topk_ids, topk_weights, slot_token = _dense_routing(topk_ids, topk_weights, slot_token)
    T, d = x.shape
    E = W1.table.numel() // 2 if W1.table is not None else W1.ptr.shape[0]
    K, slots = _slot_routing(topk_ids, slot_token, T)
    flags = dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    if decode_path(topk_ids.numel(), E, save_h, slot_token):
        out, sorted_rows, offsets = triton_moe_decode(x, topk_ids, topk_weights, W1, W2, b1, b2, n=n, E=E, **flags)
        return out, x.new_empty(0, _w1_out(n, activation)), sorted_rows, offsets
    sorted_rows, offsets = route(topk_ids, E, padded=slot_token is not None)
    h, a = triton_moe_up(x, W1, b1, sorted_rows, offsets, n=n, top_k=K, store_h=save_h,
                         row_token=_row_token(slot_token, sorted_rows), **flags)
    sw = W2.strides  # (e, d, n); the down-projection reads B[e] = W2[e]^T [n, d]
    y, y_rows = triton_moe_scatter_gemm(a, W2, (sw[0], sw[2], sw[1]), b2, sorted_rows, offsets, n_dim=d,
                                        row_map=True)
    del a
    out = triton_moe_gather_sum(y, topk_weights.reshape(-1), T, K, x.dtype, slots, row_map=y_rows)
    return out, h, sorted_rows, offsets
