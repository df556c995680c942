"""Tile-aware token rounding (SonicMoE): make every expert's token count a multiple of the GEMM M tile.

Plain top-k first. Expert e receives c_e tokens; the grouped GEMM pads its last M tile, wasting
(M - c_e mod M) rows. Rounding moves each count to a multiple of M, by less than one tile:

    down:    c_e -> M * floor(c_e / M)  drops e's lowest-scoring top-k tokens
    up:      c_e -> M * ceil(c_e / M)   adds e's highest-probability tokens outside its top-k
             (capped at T: an expert cannot take a token twice)
    nearest: per expert, whichever of the two is closer (a remainder of exactly M/2 rounds up)

Everything runs on the device with fixed shapes, no host sync, so it can be captured in a CUDA
graph. This module's torch functions are the reference (CPU, and the test oracle: two [E, T] top-k
selections of width tile - 1 per expert); on CUDA, `codegen.kernels.rounding` does the same in four
Triton kernels (a per-expert radix select instead of the top-k selections). The result is a dense
assignment: `mask` [T, E] (token t goes to expert e) and `weights` [T, E] (its combine weight: the
top-k weight where the pair was in the top-k, where rounding up added it the router probability scaled
as the token's top-k weights are (`added_pair_scale`: renormalised top-k weights give an added pair its
probability over the top-k probabilities' sum), 0 elsewhere).

A token can lose every expert when its only experts all round down. With `keep_every_token=True`
(the default) such a token goes back to its best top-k expert, and that expert drops as many more of
its weakest members among the tokens that keep another expert, so its count stays a multiple of the
tile (only if it has too few such members, or two experts drop the same token that way, does an
expert end a token or two over); with False, such tokens are dropped (they contribute nothing to the
layer output, as a capacity-limited router would do).

`round_routing` turns the result into the slot form that `sonic::moe_experts` takes (flat ids with
-1 padding, weights, and the token of each slot), with a static number of slots, so the rounded
layer runs on the same kernels. It is the op `sonic::round_routing_slots`, differentiable in the
weights: the gradient of a kept top-k pair goes to its top-k weight, that of a pair added by
rounding up to its router probability and, through the scale, to the token's top-k weights and
probabilities (torch ops, which Inductor fuses under torch.compile). The
compiler option `sonic.token_rounding` inserts it in front of every rewritten MoE whose router
scores it can see (see the README).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .direct_launch import launch
from .ints import cdiv
from .launch import M_TILE, runs_triton
from .nograd import register_nograd

MODES = ("nearest", "up", "down")


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
    scale = added_pair_scale(router_probs, topk_ids, topk_weights)
    added = router_probs.to(scale.dtype) * scale[:, None]
    weights = torch.where(in_topk, topk_w, added.to(topk_weights.dtype))
    weights = torch.where(mask, weights, torch.zeros((), dtype=weights.dtype, device=device))
    return mask, weights


def added_pair_scale(router_probs: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
    """Per token [T] (fp32, fp64 for fp64 inputs): W / P, its top-k weights' sum over their
    probabilities' sum.

    A pair added by rounding up weighs its router probability times this: the factor by which the
    model's router turned the token's top-k probabilities into weights (1 without renormalisation or
    scaling; 1 / P with it, as `softmax` over the top-k logits gives too), so an added expert counts on
    the same scale as the token's top-k experts. 1 where P = 0. The sums run over k in order, as the
    Triton emit kernel's do, so both paths give the same bits.
    """
    W, P = _topk_sums(router_probs, topk_ids, topk_weights)
    return torch.where(P > 0, W / torch.where(P > 0, P, 1.0), 1.0)


def _topk_sums(router_probs: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> tuple[Tensor, Tensor]:
    """(W, P) [T]: each token's top-k weights' and top-k probabilities' sums, over k in order, in
    `_scale_dtype`."""
    dtype = _scale_dtype(router_probs.dtype, topk_weights.dtype)
    W = torch.zeros(topk_ids.shape[0], dtype=dtype, device=router_probs.device)
    P = torch.zeros_like(W)
    probs = router_probs.to(dtype).gather(1, topk_ids.long())
    for k in range(topk_ids.shape[1]):
        W = W + topk_weights[:, k].to(dtype)
        P = P + probs[:, k]
    return W, P


def _scale_dtype(probs_dtype: torch.dtype, weights_dtype: torch.dtype) -> torch.dtype:
    """Where the added pairs' scale and the rounding's gradients are computed: fp32, or fp64."""
    return torch.promote_types(torch.float32, torch.promote_types(probs_dtype, weights_dtype))


def slot_capacity(T, E, K, tile: int, mode: str):
    """A static bound on the number of (token, expert) pairs after rounding, from shapes alone.

    Rounding down only removes pairs (a token kept by keep_every_token goes back to an expert that
    lost at least as many), up adds fewer than `tile` per expert, nearest at most tile // 2.
    T and E may be symbolic sizes (a dynamic batch).
    """
    extra = {"down": 0, "up": tile - 1, "nearest": tile // 2}[mode]
    return torch.sym_min(T * K + E * extra, T * E)


def _slots_of_mask(mask: Tensor, weights: Tensor, S) -> tuple[Tensor, Tensor, Tensor]:
    """The slot form of a [T, E] assignment: its pairs token-major (experts ascending), then padding."""
    T, E = mask.shape
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


# The select kernel's chunk of a row, and how many candidates on the radix prefix it lists to finish
# on them instead of the whole row (tests shrink both to reach every branch at small T).
_SELECT_BLOCK = 1024
_SELECT_CAP = 4096


def _round_routing_triton(router_probs, topk_ids, topk_weights, tile, mode, keep_every_token):
    """`round_routing` by the Triton kernels of `codegen.kernels.rounding` (same result as the
    reference where no two candidates of an expert tie in probability; ties go to the lower token)."""
    import triton

    from .kernels import rounding as kr

    T, E = router_probs.shape
    K = topk_ids.shape[1]
    S = slot_capacity(T, E, K, tile, mode)
    device = router_probs.device
    if T == 0 or S == 0:
        return (torch.full((S,), -1, dtype=torch.int32, device=device),
                torch.zeros(S, dtype=topk_weights.dtype, device=device),
                torch.full((S,), T, dtype=torch.int32, device=device))
    slot_ids = torch.empty(S, dtype=torch.int32, device=device)  # every slot written by the emit kernel
    slot_w = torch.empty(S, dtype=topk_weights.dtype, device=device)
    slot_token = torch.empty(S, dtype=torch.int32, device=device)
    probs_t = torch.empty(E, T, dtype=torch.float32, device=device)
    assign = torch.empty(E, T, dtype=torch.int8, device=device)
    per_token = torch.empty(T, dtype=torch.int32, device=device)
    n_swap = torch.zeros(E, dtype=torch.int32, device=device)
    launch(kr._transpose_kernel, (cdiv(T, 64), cdiv(E, 64)),
        router_probs, topk_ids, probs_t, assign, T, E, *router_probs.stride(), *topk_ids.stride(),
        K=K, BLOCK_T=64, BLOCK_E=64)
    e_pow2 = triton.next_power_of_2(E)
    block = min(triton.next_power_of_2(T), _SELECT_BLOCK)
    block_t = max(1, 8192 // e_pow2)
    token_grid = (cdiv(T, block_t),)
    token_args = (assign, topk_ids, topk_weights, per_token, n_swap, T, E, *topk_ids.stride(), *topk_weights.stride(),
                  K)
    token_meta = dict(K_POW2=triton.next_power_of_2(K), BLOCK_T=block_t, E_POW2=e_pow2)
    cap = min(T, _SELECT_CAP)
    scratch = torch.empty(E, cap, dtype=torch.int32, device=device)
    select_args = (probs_t, assign, n_swap, per_token, scratch, T, tile, cap)
    launch(kr._select_kernel, (E,), *select_args, MODE=kr.MODES[mode], BLOCK_T=block, num_warps=16)
    launch(kr._token_pass_kernel, token_grid, *token_args, KEEP=keep_every_token, FIRST=True, **token_meta)
    if keep_every_token:
        launch(kr._select_kernel, (E,), *select_args, MODE=kr.MODES["swap"], BLOCK_T=block, num_warps=16)
        launch(kr._token_pass_kernel, token_grid, *token_args, KEEP=True, FIRST=False, **token_meta)
    slot_end = torch.cumsum(per_token, 0, dtype=torch.int32)
    launch(kr._emit_slots_kernel, token_grid,
        assign, router_probs, topk_ids, topk_weights, slot_end, per_token, slot_ids, slot_w, slot_token, T, E, S, K,
        *router_probs.stride(), *topk_ids.stride(), *topk_weights.stride(), BLOCK_T=block_t, E_POW2=e_pow2,
        BLOCK_PAD=256, num_warps=8)
    return slot_ids, slot_w, slot_token


def _use_triton(router_probs: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> bool:
    """Where the experts op runs its Triton kernels (CUDA, SONIC_MOE_KERNEL not "reference"); their
    int8 state holds a top-k pair index + 1, so 1 <= K <= 126; they scale added pairs in fp32, so
    fp64 routing takes the reference."""
    return (1 <= topk_ids.shape[1] <= 126 and _scale_dtype(router_probs.dtype, topk_weights.dtype) == torch.float32
            and runs_triton(router_probs))


# One op in the graph (AOTAutograd's cache wants op targets). Forward: the Triton kernels on CUDA,
# the torch reference elsewhere; backward (torch ops, so Inductor fuses it): each slot's weight
# gradient goes to the top-k weight it came from, or to the router probability of an added pair.
def _round_routing_slots_impl(router_probs: Tensor, topk_ids: Tensor, topk_weights: Tensor, tile: int, mode: str,
                              keep_every_token: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(slot_ids int32 [S] (-1: padding), slot_weights [S], slot_token int32 [S]), token-major."""
    if mode not in MODES:
        raise ValueError(f"token rounding mode must be one of {MODES}, got {mode!r}")
    if _use_triton(router_probs, topk_ids, topk_weights):
        return _round_routing_triton(router_probs, topk_ids, topk_weights, tile, mode, keep_every_token)
    T, E = router_probs.shape
    with torch.no_grad():
        mask, weights = token_rounding(router_probs, topk_ids, topk_weights, tile=tile, mode=mode,
                                       keep_every_token=keep_every_token)
        return _slots_of_mask(mask, weights, slot_capacity(T, E, topk_ids.shape[1], tile, mode))


_round_routing_slots = torch.library.custom_op("sonic::round_routing_slots", _round_routing_slots_impl,
                                               mutates_args=())


@_round_routing_slots.register_fake
def _round_routing_slots_fake(router_probs, topk_ids, topk_weights, tile, mode, keep_every_token):
    T, E = router_probs.shape
    S = slot_capacity(T, E, topk_ids.shape[1], tile, mode)
    return (topk_ids.new_empty(S, dtype=torch.int32), topk_weights.new_empty(S),
            topk_ids.new_empty(S, dtype=torch.int32))


register_nograd("round_routing_slots", _round_routing_slots_impl, _round_routing_slots_fake)


def _setup_rounding_context(ctx, inputs, output):
    router_probs, topk_ids, topk_weights, _tile, mode = inputs[:5]
    slot_ids, _, slot_token = output
    ctx.adds = mode != "down"  # only up and nearest add pairs (whose weights read the scale)
    ctx.save_for_backward(topk_ids, slot_ids, slot_token, *((router_probs, topk_weights) if ctx.adds else ()))
    ctx.shapes = (router_probs.shape, router_probs.dtype, topk_weights.dtype)


def _rounding_backward(ctx, _grad_ids, grad_w, _grad_token):
    topk_ids, slot_ids, slot_token = ctx.saved_tensors[:3]
    (T, E), probs_dtype, weights_dtype = ctx.shapes
    K = topk_ids.shape[1]
    if grad_w is None or T == 0:
        return None, None, None, None, None, None
    token = slot_token.long().clamp(max=T - 1)  # padding slots carry T (and id -1, weight 0)
    expert = slot_ids.long()
    pairs = topk_ids[token] == expert[:, None]  # [S, K]: the top-k pair a slot came from, if any
    from_topk = pairs.any(1)
    grad_w = torch.where(expert >= 0, grad_w, 0)
    acc = _scale_dtype(probs_dtype, weights_dtype)
    d_weights = torch.zeros(T * K, dtype=acc, device=grad_w.device).scatter_add_(
        0, token * K + pairs.int().argmax(1), torch.where(from_topk, grad_w, 0).to(acc))
    pair = token * E + expert.clamp(min=0)
    g_added = torch.where(from_topk, 0, grad_w).to(acc)
    if not ctx.adds:
        d_probs = torch.zeros(T * E, dtype=acc, device=grad_w.device).scatter_add_(0, pair, g_added)
        return d_probs.view(T, E).to(probs_dtype), None, d_weights.view(T, K).to(weights_dtype), None, None, None
    # an added pair weighs p * W / P (added_pair_scale): d p += g W / P; and with a = sum of g p over
    # the token's added pairs, d w_k += a / P and d p at its top-k ids -= a W / P^2 (where P > 0)
    router_probs, topk_weights = ctx.saved_tensors[3:]
    probs = router_probs.to(acc)
    ids = topk_ids.long()
    W, P = _topk_sums(router_probs, topk_ids, topk_weights)
    scaled = P > 0
    P = torch.where(scaled, P, 1.0)
    scale = torch.where(scaled, W / P, 1.0)
    d_probs = torch.zeros(T * E, dtype=acc, device=grad_w.device).scatter_add_(
        0, pair, g_added * scale[token])
    a = torch.zeros(T, dtype=acc, device=grad_w.device).scatter_add_(
        0, token, g_added * probs.reshape(-1)[pair])
    a = torch.where(scaled, a / P, 0.0)
    d_probs = d_probs.view(T, E).scatter_add(1, ids, (-a * W / P)[:, None].expand(T, K))
    d_weights = d_weights.view(T, K) + a[:, None]
    return d_probs.to(probs_dtype), None, d_weights.to(weights_dtype), None, None, None


_round_routing_slots.register_autograd(_rounding_backward, setup_context=_setup_rounding_context)


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
