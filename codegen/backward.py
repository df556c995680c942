"""The backward's launchers and the backward entry points `codegen.ops` calls on CUDA.

    triton_moe_experts_bwd(...)            -> (dx, d_topk_weights, dw1, dw2, db1 | None, db2 | None)
    triton_moe_experts_bwd_part(part, ...) -> one of its four parts (the split ops of `codegen.ops`)
    triton_moe_experts_list_bwd / _list_bwd_part: the same for per-expert weights

    _up_proj_kernel as a gathered GEMM (dA' = gather(dO) W2) -> _act_grad_kernel (dS, dH, A' = s A)
    -> then, in the order `backward_order` finds holds the fewest bytes at once: _wgrad_kernel for
    dW2 and for dW1 (and the biases; or torch._grouped_mm or the Gluon kernel where `wgrad_choice`
    measured it faster), _scatter_gemm_kernel (dX~ = dH W1) -> _gather_sum_kernel (dX).

Compiled graphs may run it as four ops (`triton_moe_experts_bwd_part`: act, dw2, dw1, dx;
`moe_compiler.grad_fold`), dX's gather-sum then adding the router's [T, E] @ [E, d] term
(_gather_sum_product_kernel).
"""
from __future__ import annotations

from itertools import permutations
from typing import NamedTuple

import torch
from torch import Tensor

from . import forward, wgrad_choice
from .activations import GATED
from .direct_launch import launch
from .forward import triton_moe_gather_sum, triton_moe_scatter_gemm, triton_moe_up
from .ints import cdiv, pow2
from .kernels.backward import _act_grad_kernel
from .kernels.routing import e_pow2
from .launch import (
    M_TILE,
    _ACT_CODE,
    _IDENTITY,
    INTERPRETED,
    Bank,
    _dact,
    _dact_persistent,
    _dact_tma,
    _dot_precision,
    _gluon_module,
    _launch,
    _major,
    _or,
    _persistent_grid,
    _persistent_up,
    _programs,
    _stacked_banks,
    _tile_grid,
    _tma_operand,
    _weight_desc,
    _wgrad,
    _wgrad_tma,
)
from .reference import tokens_of_slots
from .routing import _dense_routing, _row_token, _slot_routing


def act_grad_blocks(n: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of the activation-gradient pass over rows of n columns: 1024-element tiles
    (4 rows at n >= 256), 213 against 226 us for 2048 at the 7b-256 shape, H100
    (`benchmarks/kernels/probe_memory_passes.py`); 2.85 TB/s, as the gather-sums move theirs."""
    block_c = min(256, pow2(n))
    if INTERPRETED:
        return 4, min(block_c, 16)
    return max(1, 1024 // block_c), block_c


def triton_moe_dact(grad_out, w2: Bank, h, s_flat, sorted_rows, offsets, *, n, top_k, activation, interleaved,
                    alpha, limit, row_token=None, ds_dtype=torch.float32, **_):
    """(dH [TK, w1_out], A' = s A [TK, n], dS [TK] in slot order) from dA' = gather(dO) W2.

    dS is summed in float32 and stored in `ds_dtype`, rounded once: the router weights' own dtype
    where nothing is added to it, which spares the backward a cast of [TK] (and its launch)."""
    T, d = grad_out.shape
    E = offsets.numel() - 1
    TK = sorted_rows.numel()
    # every slot of [T, K] routing is some expert's row; the slot form's padding slots are not, and stay 0
    ds = (torch.zeros if row_token is not None else torch.empty)(TK, dtype=ds_dtype, device=h.device)
    if TK == 0:
        return torch.empty_like(h), h.new_empty(TK, n), ds
    # dA' [TK, n] = gather(dO) @ W2[e]: the up-projection kernel with W2 read as (e, out=n, in=d)
    da = h.new_empty(TK, n)
    sw = w2.strides  # (e, d, n)
    w_ptr, w_table, has_table, align = w2.kernel_args()
    desc, w_desc = _weight_desc(w2, E, n, d, sw[2], sw[1])
    flags = dict(ACTIVATION=_IDENTITY, GATED=False, INTERLEAVED=False, HAS_B1=False, STORE_H=False, STORE_A=True,
                 E_POW2=e_pow2(E), TOKEN_MAP=row_token is not None, W_DESC=w_desc)
    if _persistent_up(desc, w_desc, False, False):
        _launch(
            _dact_persistent, _persistent_grid(TK, E, n, h.device),
            grad_out, desc, grad_out, sorted_rows, _or(row_token, sorted_rows), offsets, da, da,
            TK, d, n, E, top_k,
            grad_out.stride(0), grad_out.stride(1),
            0, 0,
            0.0, 0.0,
            **flags,
        )
    else:
        _launch(
            _dact_tma if desc is not None else _dact, _tile_grid(TK, E, n),
            grad_out, _or(desc, w_ptr), grad_out, sorted_rows, _or(row_token, sorted_rows), offsets, da, da, w_table,
            TK, d, n, E, top_k,
            grad_out.stride(0), grad_out.stride(1),
            sw[0], sw[2], sw[1],
            0, 0,
            0.0, 0.0,
            DOT_PRECISION=_dot_precision(h.dtype), W_TABLE=has_table, W_ALIGN=align, **flags,
        )
    gated = GATED[activation]
    block_r, block_c = act_grad_blocks(n)
    dh = torch.empty_like(h)
    # A' overwrites dA' in place (the kernel's barrier orders each tile's loads before its stores),
    # and dA' is not needed afterwards: one [TK, n] buffer less while dH and A' are live
    a_scaled = da
    launch(_act_grad_kernel, (cdiv(TK, block_r),),
        da, h, s_flat, sorted_rows, offsets, dh, a_scaled, ds,
        TK, n, E, float(alpha), float(limit),
        ACTIVATION=_ACT_CODE[activation], GATED=gated, INTERLEAVED=bool(interleaved and gated),
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
    )
    return dh, a_scaled, ds


def triton_moe_wgrad(lhs, rhs, *, gather_lhs, gather_rhs, sorted_rows, offsets, top_k, dw, dw_strides,
                     db=None, s_flat=None, row_token=None):
    """dW[e] [P, Q] = sum over expert e's rows of Lhs[r]^T Rhs[r], written into `dw` via (e, p, q) strides.

    A gathered operand is [T, .] read at each row's token; the other is [TK, .] in expert order.
    db [E, P] (optional) gets the column sums of Lhs, weighted by s_flat when given.
    """
    P, Q = lhs.shape[1], rhs.shape[1]
    E = offsets.numel() - 1
    TK = sorted_rows.numel()
    grid = lambda META: (E * cdiv(P, META["BLOCK_P"]) * cdiv(Q, META["BLOCK_Q"]),)
    # the expert-ordered operand (never the gathered one) through TMA when it can be
    lhs_d = None if gather_lhs else _tma_operand(lhs, tuple(lhs.shape), tuple(lhs.stride()))
    rhs_d = None if gather_rhs else _tma_operand(rhs, tuple(rhs.shape), tuple(rhs.stride()))
    kernel = _wgrad_tma if lhs_d is not None or rhs_d is not None else _wgrad
    _launch(
        kernel, grid,
        _or(lhs_d, lhs), _or(rhs_d, rhs), _or(s_flat, lhs), sorted_rows, _or(row_token, sorted_rows), offsets, dw,
        db if db is not None else dw,
        TK, P, Q, E, top_k,
        lhs.stride(0), lhs.stride(1), rhs.stride(0), rhs.stride(1),
        *dw_strides,
        GATHER_LHS=gather_lhs, GATHER_RHS=gather_rhs, BIAS_GRAD=db is not None,
        BIAS_SCALED=s_flat is not None, DOT_PRECISION=_dot_precision(lhs.dtype),
        TOKEN_MAP=row_token is not None, LHS_DESC=lhs_d is not None, RHS_DESC=rhs_d is not None,
    )
    return dw


class GradBuffer(NamedTuple):
    """Where a weight gradient goes: a tensor like `like` (shape, dtype, strides of `empty_like`; a
    meta tensor stands for one with no storage yet), read by the kernels as [E, P, Q] through its
    (e, out, in) strides: its own, or its last two swapped for a transposed weight ([E, in, out])."""

    like: Tensor
    transposed: bool

    def empty(self, device: torch.device) -> tuple[Tensor, tuple[int, int, int]]:
        """(a fresh gradient tensor, its (e, p, q) strides)."""
        dw = torch.empty_like(self.like, device=device)
        s = dw.stride()
        return dw, ((s[0], s[2], s[1]) if self.transposed else s)


def _weight_grad(lhs, rhs, out: GradBuffer, *, gather_lhs, gather_rhs, sorted_rows, offsets, top_k, row_token=None,
                 db=None, s_flat=None) -> Tensor:
    """dW[e] = sum over expert e's rows of Lhs[r]^T Rhs[r], laid out as `out` says, by our kernel
    (`triton_moe_wgrad`) or torch's grouped GEMM, whichever `wgrad_choice` measured faster here."""

    def triton_kernel():
        dw, strides = out.empty(lhs.device)
        return triton_moe_wgrad(lhs, rhs, gather_lhs=gather_lhs, gather_rhs=gather_rhs, sorted_rows=sorted_rows,
                                offsets=offsets, top_k=top_k, dw=dw, dw_strides=strides, db=db, s_flat=s_flat,
                                row_token=row_token)

    candidates = {"triton": triton_kernel}
    gluon = _gluon_wgrad(lhs, rhs, out, gather_lhs=gather_lhs, db=db)
    if gluon is not None:
        def gluon_kernel():
            dw, strides = out.empty(lhs.device)
            return gluon.gluon_wgrad(lhs, rhs, gather_lhs=gather_lhs, sorted_rows=sorted_rows, offsets=offsets,
                                     top_k=top_k, dw=dw, dw_strides=strides, row_token=row_token,
                                     num_programs=_programs(lhs.device))

        candidates["gluon"] = gluon_kernel
    if _grouped_mm_usable(lhs, rhs, out, db=db, s_flat=s_flat):
        candidates["grouped_mm"] = lambda: wgrad_choice.grouped_mm_wgrad(
            lhs, rhs, gather_lhs=gather_lhs, gather_rhs=gather_rhs, sorted_rows=sorted_rows, offsets=offsets,
            top_k=top_k, transposed=out.transposed, row_token=row_token, db=db, bias_scale=s_flat)
    key = _wgrad_key(lhs, rhs, out, gather_lhs=gather_lhs, offsets=offsets, top_k=top_k, row_token=row_token, db=db)
    return wgrad_choice.choose(key, candidates, cuda=lhs.is_cuda)()


def _gluon_wgrad(lhs, rhs, out: GradBuffer, *, gather_lhs, db):
    """`kernels.gluon_wgrad` where it can compute this weight gradient (Hopper, a checked Triton,
    16-bit contiguous operands, no bias gradient), else None."""
    module = None if db is not None else _gluon_module("gluon_wgrad", lhs)
    if module is None or module.supports(lhs, rhs, gather_lhs=gather_lhs, dw=out.like) is not None:
        return None
    return module


def _grouped_mm_usable(lhs, rhs, out: GradBuffer, *, db, s_flat) -> bool:
    return wgrad_choice.usable(lhs, rhs, out.like, bias_scale=s_flat, bias_grad=db is not None,
                               interpreted=INTERPRETED, major=_major(lhs.device) if lhs.is_cuda else 0)


def _wgrad_key(lhs, rhs, out: GradBuffer, *, gather_lhs, offsets, top_k, row_token, db) -> tuple:
    """`wgrad_choice`'s key: the problem's dims and layout, never the row count."""
    return (lhs.shape[1], rhs.shape[1], offsets.numel() - 1, top_k, row_token is not None, gather_lhs, out.transposed,
            db is not None, lhs.dtype, lhs.device.type)


def _wgrad_copy_bytes(lhs, rhs, out: GradBuffer, *, gather_lhs, offsets, top_k, row_token, db, s_flat, **_) -> int:
    """Bytes of the gathered operand's expert-order copy the weight gradient will make: torch's
    grouped GEMM needs one ([TK, Q or P]); our kernel reads it in place."""
    if not _grouped_mm_usable(lhs, rhs, out, db=db, s_flat=s_flat):
        return 0
    key = _wgrad_key(lhs, rhs, out, gather_lhs=gather_lhs, offsets=offsets, top_k=top_k, row_token=row_token, db=db)
    if wgrad_choice.expected(key, ("triton", "grouped_mm")) != "grouped_mm":
        return 0
    gathered = lhs if gather_lhs else rhs
    return (rhs if gather_lhs else lhs).shape[0] * gathered.shape[1] * gathered.element_size()


BACKWARD_STEPS = ("dw2", "dw1", "dx")


def _dh_last(order: tuple[str, ...]) -> int:
    """The step of `order` after which dH is dead: the later of its readers, dW1 and dX~."""
    return max(order.index("dw1"), order.index("dx"))


def backward_peak(order: tuple[str, ...], *, a_scaled: int, dh: int, dw1: int, dw2: int, dx_rows: int, dx: int,
                  dw1_copy: int = 0, dw2_copy: int = 0) -> int:
    """The most bytes the backward's three products hold at once when run in `order` (a permutation
    of BACKWARD_STEPS), counted from the activation gradient's outputs A' and dH:

        "dw2": dW2 from gather(dO) and A' (A' dies after it); holds dw2_copy while it runs
        "dw1": dW1 from dH and gather(x); holds dw1_copy while it runs
        "dx":  dX~ rows [TK, d] from dH, then their gather-sum into dx [T, d] (the rows die)

    dH dies after the later of "dw1" and "dx". Buffers held throughout (x, dO, H) are the same in
    every order and left out."""
    live, peak = a_scaled + dh, 0
    dh_last = _dh_last(order)
    for i, step in enumerate(order):
        if step == "dw2":
            peak = max(peak, live + dw2 + dw2_copy)
            live += dw2 - a_scaled
        elif step == "dw1":
            peak = max(peak, live + dw1 + dw1_copy)
            live += dw1
        else:
            peak = max(peak, live + dx_rows + dx)
            live += dx
        if i == dh_last:
            live -= dh
    return peak


def backward_order(**sizes: int) -> tuple[tuple[str, ...], int]:
    """(order, peak): the order of the backward's three products with the lowest `backward_peak`
    at these sizes (ties keep BACKWARD_STEPS' order). It depends on the shape: at (T, d, n, E, K) =
    (24576, 1536, 256, 128, 8), "dx" before "dw1" keeps dW1 out of the dX~ stage (0.98 against
    1.18 GB); at Qwen3-30B-A3B's sizes, dW1 and dX~ before dW2 free dH before dW2 is allocated."""
    orders = sorted(permutations(BACKWARD_STEPS), key=lambda order: order != BACKWARD_STEPS)
    return min(((order, backward_peak(order, **sizes)) for order in orders), key=lambda item: item[1])


def triton_moe_experts_bwd(grad_out, x, topk_ids, topk_weights, w1, w2, b1, b2, h, sorted_rows, expert_offsets, *,
                           activation, interleaved, transposed, alpha, limit, slot_token=None):
    W1, W2 = _stacked_banks(w1, w2, transposed)
    n = w2.shape[1] if transposed else w2.shape[2]
    # dW in the weights' own layout (the kernels write it through (e, out, in) strides)
    return _backward(grad_out, x, topk_ids, topk_weights, W1, W2, b1, b2, h, sorted_rows, expert_offsets,
                     dw1=GradBuffer(w1, transposed), dw2=GradBuffer(w2, transposed), n=n, activation=activation,
                     interleaved=interleaved, alpha=alpha, limit=limit, slot_token=slot_token)


def triton_moe_experts_list_bwd(grad_out, x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, h, sorted_rows,
                                expert_offsets, *, banks, activation, interleaved, alpha, limit, slot_token=None):
    """-> (dx, d_topk_weights, dW1 [E, w1_out, d], dW2 [E, d, n], db1 | None, db2 | None): weight
    gradients stacked (fresh tensors; `codegen.ops` hands each expert a view of its slice)."""
    gated = GATED[activation]
    W1, W2 = banks
    E, n, d = len(w_gate), w_down[0].shape[1], x.shape[1]
    shape = lambda *size: torch.empty(size, dtype=x.dtype, device="meta")  # noqa: E731
    return _backward(grad_out, x, topk_ids, topk_weights, W1, W2, b1, b2, h, sorted_rows, expert_offsets,
                     dw1=GradBuffer(shape(E, 2 * n if gated else n, d), False), dw2=GradBuffer(shape(E, d, n), False),
                     n=n, activation=activation, interleaved=interleaved, alpha=alpha, limit=limit,
                     slot_token=slot_token)


class _BwdRouting(NamedTuple):
    """What every part of the backward reads of the routing."""

    topk_ids: Tensor  # contiguous
    topk_weights: Tensor  # contiguous
    slot_token: Tensor | None
    K: int  # K of [T, K] routing, 1 in the slot form
    slots: tuple[Tensor, Tensor] | None  # the gather-sum's slot form argument
    kernel_args: dict  # sorted_rows, offsets, top_k, row_token: the kernels' routing keywords


def _bwd_routing(x, topk_ids, topk_weights, sorted_rows, expert_offsets, slot_token) -> _BwdRouting:
    topk_ids, topk_weights, slot_token = _dense_routing(topk_ids, topk_weights, slot_token)
    K, slots = _slot_routing(topk_ids, slot_token, x.shape[0], check=False)  # checked by the forward
    row_token = _row_token(slot_token, sorted_rows)
    args = dict(sorted_rows=sorted_rows, offsets=expert_offsets, top_k=K, row_token=row_token)
    return _BwdRouting(topk_ids, topk_weights, slot_token, K, slots, args)


def _bwd_act(r: _BwdRouting, grad_out, x, W1: Bank, W2: Bank, b1, b2, h, *, n, **flags):
    """(dH [TK, w1_out], A' = s A [TK, n], dS [TK] in slot order, <dO, b2> included): dS in the router
    weights' dtype, or float32 where <dO, b2> is added to it."""
    T, E = x.shape[0], r.kernel_args["offsets"].numel() - 1
    if h.numel() == 0 and r.topk_ids.numel() > 0:  # the forward ran without save_h: recompute H (A is not needed)
        h, _ = triton_moe_up(x, W1, b1, n=n, store_a=False, **r.kernel_args, **flags)
    ds_dtype = r.topk_weights.dtype if b2 is None else torch.float32
    dh, a_scaled, ds = triton_moe_dact(grad_out, W2, h, r.topk_weights.reshape(-1), n=n, ds_dtype=ds_dtype,
                                       **r.kernel_args, **flags)
    if b2 is not None:  # dS also gets <dO[t], b2[e]>: one [T, E] product, read at each slot's (token, expert)
        dob2 = (grad_out.float() @ b2.float().t()).reshape(-1)
        tok = tokens_of_slots(r.topk_ids, r.slot_token).clamp(max=T - 1)  # padding slots may carry T
        ids = r.topk_ids.reshape(-1).long()
        ds = ds + torch.where(ids >= 0, dob2[tok * E + ids.clamp(min=0)], 0.0)
    return dh, a_scaled, ds


def _bias_grad(b: Tensor | None) -> Tensor | None:
    return None if b is None else torch.empty(b.shape, dtype=b.dtype, device=b.device)


def _bwd_dw2(r: _BwdRouting, grad_out, a_scaled, dw2: GradBuffer, b2) -> tuple[Tensor, Tensor | None]:
    """(dW2 [E, P=d, Q=n] laid out as `dw2` says, db2) from gather(dO) and A'."""
    db2 = _bias_grad(b2)
    dw = _weight_grad(grad_out, a_scaled, dw2, gather_lhs=True, gather_rhs=False, db=db2,
                      s_flat=r.topk_weights.reshape(-1), **r.kernel_args)
    return dw, db2


def _bwd_dw1(r: _BwdRouting, dh, x, dw1: GradBuffer, b1) -> tuple[Tensor, Tensor | None]:
    """(dW1 [E, P=w1_out, Q=d] laid out as `dw1` says, db1) from dH and gather(x)."""
    db1 = _bias_grad(b1)
    return _weight_grad(dh, x, dw1, gather_lhs=False, gather_rhs=True, db=db1, **r.kernel_args), db1


def _bwd_dx(r: _BwdRouting, dh, x, W1: Bank, product=None) -> Tensor:
    """dX: dX~ = dH @ B[e] with B[e] = W1[e] [w1_out, d], in slot order (or TILE order, `SCATTER_TILES`);
    then each token's K rows summed (with the `product` term, when given, added in the same pass)."""
    T, d = x.shape
    kw = r.kernel_args
    dx_rows, rows = triton_moe_scatter_gemm(dh, W1, W1.strides, None, kw["sorted_rows"], kw["offsets"], n_dim=d,
                                            split=W1.split, row_map=True)
    return triton_moe_gather_sum(dx_rows, None, T, r.K, x.dtype, r.slots, product=product, row_map=rows)


def scatter_rows(TK: int, E: int, t: Tensor) -> int:
    """Rows the scatter GEMMs' output (Y, dX~) may take on `t`'s device: TK in slot order; in TILE
    order (`SCATTER_TILES`, where the Gluon kernel can run) up to cdiv(TK, 128) + E whole 128-row
    tiles (`gluon_scatter.tile_rows`), whichever kernel `wgrad_choice` then picks."""
    gluon = _gluon_module("gluon_scatter", t) if forward.SCATTER_TILES else None
    return TK if gluon is None else gluon.tile_rows(TK, E, M_TILE)


def backward_sizes(*, T: int, d: int, TK: int, w1_out: int, n: int, elem: int, dw1: int, dw2: int,
                   dx_rows: int | None = None) -> dict[str, int]:
    """The byte sizes `backward_order` weighs (without the grouped-GEMM copies): activations of
    `elem` bytes, dw1 and dw2 in bytes; dX~ of `dx_rows` rows (`scatter_rows`; default TK)."""
    return dict(a_scaled=TK * n * elem, dh=TK * w1_out * elem, dx_rows=(TK if dx_rows is None else dx_rows) * d * elem,
                dx=T * d * elem, dw1=dw1, dw2=dw2)


def _bwd_sizes(x, dh, a_scaled, dw1: GradBuffer, dw2: GradBuffer) -> dict[str, int]:
    T, d = x.shape
    TK = dh.shape[0]
    bytes_of = lambda t: t.numel() * t.element_size()  # noqa: E731
    return backward_sizes(T=T, d=d, TK=TK, w1_out=dh.shape[1], n=a_scaled.shape[1], elem=x.element_size(),
                          dw1=bytes_of(dw1.like), dw2=bytes_of(dw2.like),
                          dx_rows=scatter_rows(TK, dw1.like.shape[0], dh))


def _backward(grad_out, x, topk_ids, topk_weights, W1: Bank, W2: Bank, b1, b2, h, sorted_rows, expert_offsets, *,
              dw1: GradBuffer, dw2: GradBuffer, n, activation, interleaved, alpha, limit, slot_token):
    """(dx, d_topk_weights, dW1, dW2, db1, db2); each dW is laid out as its GradBuffer says."""
    r = _bwd_routing(x, topk_ids, topk_weights, sorted_rows, expert_offsets, slot_token)
    flags = dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    grad_out = grad_out.to(x.dtype)
    dh, a_scaled, ds = _bwd_act(r, grad_out, x, W1, W2, b1, b2, h, n=n, **flags)
    del h
    wgrad2 = dict(gather_lhs=True, gather_rhs=False, db=b2, s_flat=r.topk_weights.reshape(-1))
    wgrad1 = dict(gather_lhs=False, gather_rhs=True, db=b1)
    order, _ = backward_order(**_bwd_sizes(x, dh, a_scaled, dw1, dw2),
                              dw1_copy=_wgrad_copy_bytes(dh, x, dw1, **wgrad1, s_flat=None, **r.kernel_args),
                              dw2_copy=_wgrad_copy_bytes(grad_out, a_scaled, dw2, **wgrad2, **r.kernel_args))
    dh_last = _dh_last(order)
    grads = {}
    for i, step in enumerate(order):
        if step == "dw2":
            grads[step] = _bwd_dw2(r, grad_out, a_scaled, dw2, b2)
            a_scaled = None
        elif step == "dw1":
            grads[step] = _bwd_dw1(r, dh, x, dw1, b1)
        else:
            grads[step] = _bwd_dx(r, dh, x, W1)
        if i == dh_last:
            dh = None
    (dw1, db1), (dw2, db2), dx = grads["dw1"], grads["dw2"], grads["dx"]
    return dx, ds.view(r.topk_weights.shape).to(r.topk_weights.dtype), dw1, dw2, db1, db2


def triton_moe_experts_bwd_part(part: str, x, topk_ids, topk_weights, w1, w2, b1, b2, sorted_rows, expert_offsets,
                                *, activation, interleaved, transposed, alpha, limit, slot_token=None, **tensors):
    """One part of `triton_moe_experts_bwd`, as `codegen.ops`' split backward ops run them:

        "act" (grad_out, h) -> (dH, A', d_topk_weights)   "dw2" (grad_out, a_scaled) -> (dW2, db2 | None)
        "dw1" (dh) -> (dW1, db1 | None)                    "dx" (dh, product) -> dx
    """
    W1, W2 = _stacked_banks(w1, w2, transposed)
    n = w2.shape[1] if transposed else w2.shape[2]
    flags = dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    return _bwd_part(part, x, topk_ids, topk_weights, W1, W2, b1, b2, sorted_rows, expert_offsets, slot_token,
                     GradBuffer(w1, transposed), GradBuffer(w2, transposed), n=n, flags=flags, **tensors)


def triton_moe_experts_list_bwd_part(part: str, x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2,
                                     sorted_rows, expert_offsets, *, banks, activation, interleaved, alpha, limit,
                                     slot_token=None, **tensors):
    """`triton_moe_experts_bwd_part` for per-expert weights (`list_banks`): the weight gradients come
    stacked, dW1 [E, w1_out, d] and dW2 [E, d, n] (as `triton_moe_experts_list_bwd` gives them), in
    (dw, db | None) pairs."""
    E, (d, n) = len(w_gate), w_down[0].shape
    w1_out = w_gate[0].shape[0] + (w_up[0].shape[0] if w_up else 0)
    meta = lambda *size: torch.empty(size, dtype=x.dtype, device="meta")  # noqa: E731
    flags = dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    return _bwd_part(part, x, topk_ids, topk_weights, *banks, b1, b2, sorted_rows, expert_offsets, slot_token,
                     GradBuffer(meta(E, w1_out, d), False), GradBuffer(meta(E, d, n), False), n=n, flags=flags,
                     **tensors)


def _bwd_part(part, x, topk_ids, topk_weights, W1: Bank, W2: Bank, b1, b2, sorted_rows, expert_offsets, slot_token,
              dw1: GradBuffer, dw2: GradBuffer, *, n, flags, grad_out=None, h=None, dh=None, a_scaled=None,
              product=None):
    r = _bwd_routing(x, topk_ids, topk_weights, sorted_rows, expert_offsets, slot_token)
    if part == "act":
        dh, a_scaled, ds = _bwd_act(r, grad_out.to(x.dtype), x, W1, W2, b1, b2, h, n=n, **flags)
        return dh, a_scaled, ds.view(r.topk_weights.shape).to(r.topk_weights.dtype)
    if part == "dw2":
        return _bwd_dw2(r, grad_out.to(x.dtype), a_scaled, dw2, b2)
    if part == "dw1":
        return _bwd_dw1(r, dh, x, dw1, b1)
    if part == "dx":
        return _bwd_dx(r, dh, x, W1, product)
    raise ValueError(f"unknown backward part {part!r}")
