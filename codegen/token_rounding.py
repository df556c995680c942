"""Tile-aware token rounding (SonicMoE): make every expert's token count a multiple of the GEMM M tile.

Plain top-k first. Expert e receives c_e tokens; the grouped GEMM pads its last M tile, wasting
(M - c_e mod M) rows. Rounding moves each count to a multiple of M, by less than one tile:

    down:    c_e -> M * floor(c_e / M)  drops e's lowest-scoring top-k tokens
    up:      c_e -> M * ceil(c_e / M)   adds e's highest-probability tokens outside its top-k
             (capped at T: an expert cannot take a token twice)
    nearest: per expert, whichever of the two is closer (a remainder of exactly M/2 rounds up)

Everything runs on the device with fixed shapes (two [E, T] top-k selections of width tile - 1), no
host sync, so it can be captured in a CUDA graph. The result is a dense assignment: `mask` [T, E]
(token t goes to expert e) and `weights` [T, E] (its combine weight: the top-k weight where the pair
was in the top-k, the router probability where rounding up added it, 0 elsewhere).

A token can lose every expert when its only experts all round down. With `keep_every_token=True`
(the default) such a token goes back to its best top-k expert, and that expert drops as many more of
its weakest members among the tokens that keep another expert, so its count stays a multiple of the
tile (only if it has too few such members, or two experts drop the same token that way, does an
expert end a token or two over); with False, such tokens are dropped (they contribute nothing to the
layer output, as a capacity-limited router would do).

`round_routing` turns the result into the slot form that `sonic::moe_experts` takes (flat ids with
-1 padding, weights, and the token of each slot), with a static number of slots, so the rounded
layer runs on the same kernels. It is the composite op `sonic::round_routing_slots` (torch ops
underneath, which Inductor fuses under torch.compile), differentiable in the weights: the gradient
of a kept top-k pair goes to its top-k weight, that of a pair added by rounding up to the router
probability. The compiler option `sonic.token_rounding` inserts it in
front of every rewritten MoE whose router scores it can see (see the README).
"""
from __future__ import annotations

import torch
from torch import Tensor

MODES = ("nearest", "up", "down")
# The M tile of the grouped GEMMs on the GPU (every autotuned config of codegen.triton_moe uses it):
# the tile the compiler rounds to, so no tile of a rounded expert is padded.
M_TILE = 128


def round_token_counts(counts: torch.Tensor, tile: int, mode: str, max_count: int) -> torch.Tensor:
    """Per-expert target counts [E]: multiples of `tile` (except where capped at `max_count`)."""
    if mode not in MODES:
        raise ValueError(f"token rounding mode must be one of {MODES}, got {mode!r}")
    if tile <= 0:
        raise ValueError(f"tile must be positive, got {tile}")
    down = torch.div(counts, tile, rounding_mode="floor") * tile
    up = torch.clamp(down + torch.where(counts > down, tile, 0), max=max_count)
    if mode == "down":
        return down
    if mode == "up":
        return up
    return torch.where(2 * (counts - down) >= tile, up, down)


def token_rounding(
    router_probs: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    tile: int,
    mode: str = "nearest",
    keep_every_token: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [T, E] bool, weights [T, E]) after rounding each expert's count to a multiple of `tile`.

    router_probs [T, E]: the scores that rank tokens for an expert (softmax or sigmoid output).
    topk_ids / topk_weights [T, K]: the plain top-k routing being rounded.
    """
    T, E = router_probs.shape
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        raise ValueError(f"topk ids {tuple(topk_ids.shape)} / weights {tuple(topk_weights.shape)} do not fit T={T}")
    device = router_probs.device
    in_topk = torch.zeros(T, E, dtype=torch.bool, device=device).scatter_(1, topk_ids.long(), True)
    topk_w = torch.zeros(T, E, dtype=topk_weights.dtype, device=device).scatter_(1, topk_ids.long(), topk_weights)
    counts = in_topk.sum(0)
    target = round_token_counts(counts, tile, mode, T)  # [E]

    # Each expert moves by less than a tile, so only its `tile - 1` weakest members (by probability)
    # can drop and its `tile - 1` most probable outsiders join: two top-k selections of width
    # tile - 1 per expert instead of sorting all T tokens (~10x cheaper at T = 16384, E = 256).
    probs = router_probs.float().t()  # [E, T]
    members = in_topk.t()
    width = torch.sym_min(tile - 1, T)
    moves = torch.arange(width, device=device)
    weakest = torch.topk(probs.masked_fill(~members, float("inf")), width, dim=1, largest=False).indices
    strongest = torch.topk(probs.masked_fill(members, float("-inf")), width, dim=1).indices
    n_drop = (counts - target).clamp(min=0)[:, None]  # < tile
    n_add = (target - counts).clamp(min=0)[:, None]  # < tile, and <= the number of outsiders
    dropped = torch.zeros_like(members).scatter_(1, weakest, moves < n_drop)
    added = torch.zeros_like(members).scatter_(1, strongest, moves < n_add)
    mask = ((members & ~dropped) | added).t()  # [T, E]

    if keep_every_token:
        best = topk_ids.gather(1, topk_weights.float().argmax(1, keepdim=True)).long()  # [T, 1]
        best_pair = torch.zeros_like(mask).scatter_(1, best, True)
        orphans = ~mask.any(1) & in_topk.any(1)
        restore = best_pair & orphans[:, None]  # each orphan goes back to its best top-k expert...
        # ...which then drops as many of its weakest members that keep another expert, so its count
        # stays a multiple of the tile (fewer such members than orphans: it ends that many over)
        spare = (mask & (mask.sum(1, keepdim=True) >= 2)).t()
        n_swap = restore.sum(0)[:, None]  # < tile: only tokens the expert dropped come back
        weakest_spare = torch.topk(probs.masked_fill(~spare, float("inf")), width, dim=1, largest=False).indices
        swapped = torch.zeros_like(members).scatter_(1, weakest_spare, (moves < n_swap)) & spare
        mask = (mask & ~swapped.t()) | restore
        # two experts may swap out the same token: it goes back to its best expert (rare; that
        # expert ends one over its multiple)
        mask = mask | (best_pair & (~mask.any(1) & in_topk.any(1))[:, None])
    weights = torch.where(in_topk, topk_w, router_probs.to(topk_weights.dtype))
    weights = torch.where(mask, weights, torch.zeros((), dtype=weights.dtype, device=device))
    return mask, weights


def slot_capacity(T, E, K, tile: int, mode: str):
    """A static bound on the number of (token, expert) pairs after rounding, from shapes alone.

    Rounding down only removes pairs (a token kept by keep_every_token goes back to an expert that
    lost at least as many), up adds fewer than `tile` per expert, nearest at most tile // 2.
    T and E may be symbolic sizes (a dynamic batch).
    """
    extra = {"down": 0, "up": tile - 1, "nearest": tile // 2}[mode]
    return torch.sym_min(T * K + E * extra, T * E)


# A composite op: one node in the graph (AOTAutograd's cache wants op targets), and under
# torch.compile it decomposes into the torch ops below, which Inductor fuses; autograd follows them.
_LIB = torch.library.Library("sonic", "FRAGMENT")
_LIB.define(
    "round_routing_slots(Tensor router_probs, Tensor topk_ids, Tensor topk_weights, int tile, str mode, "
    "bool keep_every_token) -> (Tensor, Tensor, Tensor)"
)


@torch.library.impl(_LIB, "round_routing_slots", "CompositeImplicitAutograd")
def _round_routing_slots(router_probs, topk_ids, topk_weights, tile, mode, keep_every_token):
    """(slot_ids int32 [S] (-1: padding), slot_weights [S], slot_token int32 [S]), token-major."""
    T, E = router_probs.shape
    S = slot_capacity(T, E, topk_ids.shape[1], tile, mode)
    mask, weights = token_rounding(router_probs, topk_ids, topk_weights, tile=tile, mode=mode,
                                   keep_every_token=keep_every_token)
    flat = mask.reshape(-1)
    position = torch.cumsum(flat, 0) - 1  # row-major [T, E]: token-major, experts ascending
    target = torch.where(flat & (position < S), position, S)
    pair = torch.full((S + 1,), T * E, dtype=torch.int64, device=mask.device)
    pair = pair.scatter(0, target, torch.arange(T * E, device=mask.device))[:S]
    real = pair < T * E
    slot_ids = torch.where(real, pair % E, -1).to(torch.int32)
    slot_token = (pair // E).to(torch.int32)  # padding slots carry T: they sort after every token
    padded = torch.cat([weights.reshape(-1), weights.new_zeros(1)])
    return slot_ids, padded[pair], slot_token


def round_routing(
    router_probs: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    *,
    tile: int = M_TILE,
    mode: str = "nearest",
    keep_every_token: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Token rounding in the slot form that `codegen.moe_experts(..., slot_token=...)` takes.

    Returns (slot_ids int32 [S], slot_weights [S], slot_token int32 [S]) with the static S of
    `slot_capacity`: the pairs of `token_rounding`'s mask in token-major order, then padding
    (id -1, token T). Differentiable in topk_weights and router_probs (see the module docstring):

        ids, w, tok = round_routing(probs, topk_ids, topk_weights, mode="nearest")
        out = moe_experts(x, ids, w, w1, w2, slot_token=tok)

    Apply it in training only: evaluation should route by plain top-k.
    """
    if mode not in MODES:
        raise ValueError(f"token rounding mode must be one of {MODES}, got {mode!r}")
    if router_probs.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != router_probs.shape[0]:
        raise ValueError(f"router_probs [T, E] {tuple(router_probs.shape)} and topk_ids [T, K] "
                         f"{tuple(topk_ids.shape)} do not fit")
    return torch.ops.sonic.round_routing_slots(router_probs, topk_ids, topk_weights, int(tile), mode,
                                               bool(keep_every_token))
