"""The decode path: an inference forward at a few slots in two launches (`kernels.decode`).

    decode_path(TK, E, save_h, slot_token) -> bool
    triton_moe_decode(...) -> (out [T, d], sorted_rows, offsets)

No TMA descriptors, no expert-ordered rows, no padded tiles: the first launch ranks the slots and
computes A per slot, the second each token's weighted sum of its K down-projections.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from .activations import GATED
from .direct_launch import launch
from .ints import cdiv, pow2
from .kernels.decode import _decode_down_kernel, _decode_up_kernel
from .launch import _ACT_CODE, Bank
from .routing import _check_ids_on_cpu


# The decode path (`kernels.decode`): a forward that keeps no H, with at most DECODE_MAX_SLOTS slots
# and at most DECODE_SLOTS_PER_EXPERT slots per expert (two slots on one expert read its weights
# twice), runs in two launches: no TMA descriptors, no expert-ordered rows, no padded tiles. The
# routing is still computed (the first launch ranks the slots): the op returns it, and a backward
# that recomputes H (save_h False) reads it. SONIC_MOE_DECODE_MAX_SLOTS=0 turns the path off.
DECODE_MAX_SLOTS = int(os.environ.get("SONIC_MOE_DECODE_MAX_SLOTS", "64"))
DECODE_SLOTS_PER_EXPERT = 0.5
_DECODE_RANK_SLOTS = 128  # the first launch ranks all pairs of slots in one [TK, TK] tile: at most this
# The reduction chunk of each decode kernel (d for the up-projection, n for the down-projection) and
# their warps.
DECODE_CHUNK_UP, DECODE_CHUNK_DOWN, DECODE_WARPS = 256, 256, 8


def decode_path(TK: int, E: int, save_h: bool, slot_token: Tensor | None) -> bool:
    """Whether a forward of TK slots over E experts runs `triton_moe_decode`."""
    return (not save_h and slot_token is None and 0 < TK <= min(DECODE_MAX_SLOTS, _DECODE_RANK_SLOTS)
            and TK <= DECODE_SLOTS_PER_EXPERT * E)


def _w1_out(n: int, activation: str) -> int:
    return 2 * n if GATED[activation] else n


def _decode_blocks(parallel: int, width: int) -> int:
    """The widest block of `width` columns (16..64) that still gives ~2 programs per SM."""
    block = 64
    while block > 16 and parallel * cdiv(width, block) < 264:
        block //= 2
    return block


def triton_moe_decode(x, topk_ids, topk_weights, W1: Bank, W2: Bank, b1, b2, *, n, E, activation, interleaved,
                      alpha, limit) -> tuple[Tensor, Tensor, Tensor]:
    """(out [T, d], sorted_rows, offsets) of [T, K] routing through `kernels.decode`: A [TK, n] per
    slot, then each token's weighted sum of its K down-projections (see the kernels' docstring for
    the numerics); the routing as `route` gives it, ranked by the first launch."""
    T, d = x.shape
    K = topk_ids.shape[1]
    TK = T * K
    gated = GATED[activation]
    _check_ids_on_cpu(topk_ids, E)
    sorted_rows = torch.empty(TK, dtype=torch.int32, device=x.device)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=x.device)
    ok = torch.empty(1, dtype=torch.int32, device=x.device)
    a = x.new_empty(TK, n)
    w1_ptr, w1_table, w1_has_table, w1_align = W1.kernel_args()
    b1c = b1.contiguous() if b1 is not None else x
    block_n = _decode_blocks(TK, n)
    launch(_decode_up_kernel, (TK, cdiv(n, block_n)),
        x, topk_ids, w1_ptr, w1_table, b1c, a, sorted_rows, offsets, ok, TK, d, n, E, x.stride(0), x.stride(1),
        *W1.strides,
        _w1_out(n, activation) if b1 is not None else 0, 1, float(alpha), float(limit),
        TOP_K=K, ACTIVATION=_ACT_CODE[activation], GATED=gated, INTERLEAVED=bool(interleaved and gated),
        HAS_B1=b1 is not None, W_TABLE=w1_has_table, W_ALIGN=w1_align, BLOCK_N=block_n,
        BLOCK_D=DECODE_CHUNK_UP, BLOCK_S=max(16, pow2(TK)), BLOCK_E=64, num_warps=DECODE_WARPS,
    )
    # no host sync: a bad id fails here on the device, as the routing kernels' asserts do
    torch._assert_async(ok, f"sonic.moe_experts: expert id out of range [0, {E}) in topk_ids")
    out = torch.empty(T, d, dtype=x.dtype, device=x.device)
    w2_ptr, w2_table, w2_has_table, w2_align = W2.kernel_args()
    b2c = b2.contiguous() if b2 is not None else x
    block_d = _decode_blocks(T, d)
    launch(_decode_down_kernel, (T, cdiv(d, block_d)),
        a, topk_ids, topk_weights, w2_ptr, w2_table, b2c, out, d, n, E, *W2.strides, d if b2 is not None else 0, 1,
        TOP_K=K, HAS_B2=b2 is not None, W_TABLE=w2_has_table, W_ALIGN=w2_align, BLOCK_D=block_d,
        BLOCK_N=DECODE_CHUNK_DOWN, num_warps=DECODE_WARPS,
    )
    return out, sorted_rows, offsets
