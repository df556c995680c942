"""Routing metadata on the device, with no host sync: the expert order of the slots.

    route(topk_ids, E, padded) -> (sorted_rows int32 [TK], expert_offsets int32 [E+1])
    token_offsets(slot_token, T) -> int32 [T+1]

Rows r = 0..TK-1 are in expert order (stable: token order inside an expert); `sorted_rows[r]` is
the flat slot t*K + k of row r; `expert_offsets` [E+1] is the exclusive prefix of the per-expert
counts. `route` is a Triton counting sort: one program for small batches, three launches over
pieces of the slots for larger ones up to 511 experts, else a torch sort. The slot form (token
rounding) adds padding slots, id -1, sorted after every expert.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .direct_launch import launch
from .ints import cdiv, pow2
from .kernels.routing import (
    _route_count_kernel,
    _route_place_kernel,
    _route_prefix_kernel,
    _route_small_kernel,
    _slot_check_kernel,
)
from .launch import INTERPRETED
from .reference import PAD


# The one-program routing kernel scans [BLOCK, buckets] tiles: up to this many slot x bucket pairs
# (TK <= 1024 at 256 experts: decode and small prefills), where one launch beats the sort path's ten
# (more than 511 experts, and the interpreter), and up to BLOCK slots where the piece kernels would
# take it (`_small_route_block`).
_SMALL_ROUTE_WORK = 2**18
_SMALL_ROUTE_MAX_BLOCK = 64


def _small_route_block(TK: int, buckets: int, device: torch.device) -> int | None:
    """BLOCK of the one-program routing kernel where `route` runs it, else None.

    On the GPU beside the piece kernels, one program only for slots that fit one [BLOCK, buckets]
    tile, BLOCK <= 64: its time grows with the tile's length in slots more than with its size, and
    a walk over several tiles loses to the three piece launches. H100, `bench_route.py --small`, GPU
    us a call from CUDA graphs; one program with BLOCK 8192 // buckets up to 1024 (before) / up to
    64 (now) / the piece kernels:
        E=8:   TK=4 24.5 / 3.7 / 5.5,  TK=64 25.0 / 4.1 / 6.0,  TK=256 25.0 / 10.5 / 6.0,  TK=16384 364 / 545 / 6.4
        E=16:  TK=4 23.3 / 5.4 / 6.1,  TK=64 23.8 / 5.1 / 5.8,  TK=16384 697 / 859 / 6.7
        E=64:  TK=4 10.5 / 6.9 / 6.2,  TK=64 10.5 / 6.9 / 6.2,  TK=256 19.5 / 21.3 / 6.2
        E=128: TK=4 5.7 / 5.7 / 6.2,   TK=64 5.8 / 5.8 / 6.3,   TK=256 17.0 / 17.0 / 6.4
        E=256: TK=32 5.8 / 5.9 / 6.9,  TK=64 9.2 / 9.2 / 6.9
    The host pays for each launch (one program 27-55 us a call, the pieces 88-253 here), so one
    launch stays the choice where it fits (E=64's +0.7 us on the GPU included), where the
    alternative is the torch sort's dozen (more than `_PIECES_MAX_BUCKETS` buckets), and in the
    interpreter, where it is also the faster one."""
    if device.type != "cuda" or buckets > _PIECES_MAX_BUCKETS:
        return max(16, min(1024, 8192 // buckets)) if TK * buckets <= _SMALL_ROUTE_WORK else None
    block = max(16, min(_SMALL_ROUTE_MAX_BLOCK, 8192 // buckets))
    return block if TK <= block else None


# Up to this many buckets (E <= 512, or E < 512 with padding), larger batches route in three launches
# over pieces of the slots (`_route_pieces`); beyond, the [BLOCK, buckets] tiles grow too wide and the
# torch sort runs.
_PIECES_MAX_BUCKETS = 512
# The placement ranks a piece's slots by `tl.sort` on the GPU; the interpreter's sort is too slow for
# the tests' sizes (seconds a piece), so it ranks them as the one-program kernel does.
ROUTE_BY_SORT = not INTERPRETED


def _route_pieces(flat: Tensor, E: int, padded: bool, buckets: int) -> tuple[Tensor, Tensor]:
    """`route` by the three piece kernels of `kernels.routing`: bucket counts per piece of the
    slots, their prefix over the pieces, each slot's row."""
    TK = flat.numel()
    chunk = _route_chunk(TK, buckets)
    pieces = cdiv(TK, chunk)
    counts = torch.empty(2, buckets, pieces, dtype=torch.int32, device=flat.device)  # counts, starts
    sorted_rows = torch.empty(TK, dtype=torch.int32, device=flat.device)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=flat.device)
    meta = dict(PADDED=padded, B_POW2=buckets, CHUNK=chunk, num_warps=4 if chunk <= 1024 else 8)
    launch(_route_count_kernel, (pieces,), flat, counts[0], counts[1], TK, E, pieces, **meta)
    launch(_route_prefix_kernel, (buckets,), counts[0], counts[1], offsets, pieces, E, BLOCK_P=1024, num_warps=4)
    launch(_route_place_kernel, (pieces,), flat, counts[1], offsets, sorted_rows, TK, E, pieces, SORT=ROUTE_BY_SORT,
           BLOCK=max(16, min(1024, 8192 // buckets)), **meta)
    return sorted_rows, offsets


def _route_chunk(TK: int, buckets: int) -> int:
    """CHUNK, the slots of a piece (a power of two: one sorted tile per program): about TK x buckets
    / 65536 slots, 256 to 512. Past 512, sorting the longer tiles costs more than the fewer pieces
    save, now that the prefix kernel's work no longer grows with the pieces (H100, `bench_route.py
    --chunks 128,256,512,1024,2048 --cases paper`, GPU us a call from CUDA graphs, by chunk:
    E=128 TK=196608: 13.6, 13.3, 20.3, 26.4 for 256-2048; E=128 TK=327680: 18.4, 17.4, 26.4, 42.9;
    E=256 TK=524288: 35.9, 29.3, 36.4, 45.6; E=64 TK=163840: 10.5, 11.5, 19.1, 25.6; E=32 TK=81920:
    8.1, 9.6, 14.5, 25.6; 128-slot pieces lost everywhere)."""
    return min(512, max(256, pow2(cdiv(TK * buckets, 65536))))


def route_buckets(E: int, padded: bool = False) -> int:
    """The routing kernels' bucket count: the experts, and the padding slots' bucket E in the slot
    form, rounded up to a power of two (>= 2). 128 experts take 128 buckets, not 256: the piece
    kernels' work grows with slots x buckets."""
    return max(2, pow2(E + padded))


def _check_ids_on_cpu(topk_ids: Tensor, E: int, padded: bool = False) -> None:
    """The interpreter runs the kernels on CPU tensors and skips their device asserts: there an id
    outside [0, E) (-1 allowed when `padded`) raises IndexError up front (a CPU check costs no sync)."""
    if topk_ids.device.type != "cpu" or not topk_ids.numel():
        return
    valid = (topk_ids >= 0) & (topk_ids < E) | ((topk_ids == -1) if padded else False)
    if not bool(valid.all()):
        raise IndexError(f"expert id out of range [0, {E}) in topk_ids")


def route(topk_ids: Tensor, E: int, padded: bool = False) -> tuple[Tensor, Tensor]:
    """(sorted_rows int32 [TK], expert_offsets int32 [E+1]) on the device, with no host sync.

    Same contract as `codegen.reference.torch_route`. `padded` (the slot form): id -1 is a padding
    slot, sorted after every expert and not counted. Any other id outside [0, E) fails a device-side
    assert (an IndexError-like RuntimeError on the CPU): never a silent wrong expert.
    """
    flat = topk_ids.reshape(-1).contiguous()  # the kernels index it densely
    TK = flat.numel()
    buckets = route_buckets(E, padded)
    small = _small_route_block(TK, buckets, flat.device)
    if small or buckets <= _PIECES_MAX_BUCKETS:
        _check_ids_on_cpu(flat, E, padded)
    if small:
        sorted_rows = torch.empty(TK, dtype=torch.int32, device=flat.device)
        offsets = torch.empty(E + 1, dtype=torch.int32, device=flat.device)
        launch(_route_small_kernel, (1,), flat, sorted_rows, offsets, TK, E, PADDED=padded, B_POW2=buckets,
               BLOCK=small, num_warps=4)
        return sorted_rows, offsets
    if buckets <= _PIECES_MAX_BUCKETS:
        return _route_pieces(flat, E, padded, buckets)
    if padded:
        flat = torch.where(flat == -1, E, flat)
    # 16-bit keys: the radix sort makes 2 passes instead of 8 (59 -> ~15 us at TK = 196608 on the H100)
    keys = flat.to(torch.int16) if E < 2**15 else flat
    sorted_rows = torch.sort(keys, stable=True).indices.to(torch.int32)
    counts = torch.zeros(E + padded, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones(flat.shape, dtype=torch.int32, device=flat.device))
    offsets = torch.zeros(E + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(counts[:E], 0)
    return sorted_rows, offsets


def token_offsets(slot_token: Tensor, T: int) -> Tensor:
    """int32 [T+1]: the first slot of each token (slot_token is nondecreasing), on the device."""
    wanted = torch.arange(T + 1, dtype=slot_token.dtype, device=slot_token.device)
    return torch.searchsorted(slot_token, wanted, out_int32=True)


def _slot_routing(topk_ids, slot_token, T, check=True):
    """(K or 1, gather-sum slots argument or None) for [T, K] routing or the slot form. `check`
    (the forward; the backward gets the same tensors back): a device-side assert, no host sync, so
    unsorted or out-of-range tokens fail loudly, never silently."""
    if slot_token is None:
        return topk_ids.shape[1], None
    if check and slot_token.numel():
        ok = torch.ones(1, dtype=torch.int32, device=slot_token.device)
        S = slot_token.numel()
        launch(_slot_check_kernel, (cdiv(S, 1024),), topk_ids.reshape(-1), slot_token.reshape(-1), ok, S, T,
               PAD=PAD, BLOCK=1024, num_warps=4)
        torch._assert_async(ok, "sonic.moe_experts: slot_token must be nondecreasing with real slots' tokens in "
                            "[0, T)")
    return 1, (topk_ids, token_offsets(slot_token, T))


def _row_token(slot_token, sorted_rows):
    """int32 [TK]: the token of each expert-ordered row (slot form), or None for [T, K] routing."""
    return None if slot_token is None else slot_token.reshape(-1)[sorted_rows.long()].to(torch.int32)


def _dense_routing(topk_ids, topk_weights, slot_token):
    """The routing tensors with contiguous storage: the kernels read them through flat views, and
    a column sliced from a wider tensor (K = 1) has a strided one."""
    return topk_ids.contiguous(), topk_weights.contiguous(), None if slot_token is None else slot_token.contiguous()
