"""Tile-aware token rounding (SonicMoE): make every expert's token count a multiple of the GEMM M tile.

Plain top-k first. Expert e receives c_e tokens; the grouped GEMM pads its last M tile, wasting
(M - c_e mod M) rows. Rounding moves each count to a multiple of M, by less than one tile:

    down:    c_e -> M * floor(c_e / M)  drops e's lowest-scoring top-k tokens
    up:      c_e -> M * ceil(c_e / M)   adds e's highest-probability tokens outside its top-k
             (capped at T: an expert cannot take a token twice)
    nearest: per expert, whichever of the two is closer (a remainder of exactly M/2 rounds up)

Everything runs on the device with fixed shapes (one [E, T] sort), no host sync, so it can be
captured in a CUDA graph. The result is a dense assignment: `mask` [T, E] (token t goes to expert
e) and `weights` [T, E] (its combine weight: the top-k weight where the pair was in the top-k, the
router probability where rounding up added it, 0 elsewhere).

A token can lose every expert when its only experts all round down. With `keep_every_token=True`
(the default) such a token keeps its best top-k expert, so that expert's count can exceed its
multiple by the number of tokens kept this way (usually 0); with False, such tokens are dropped
(they contribute nothing to the layer output, as a capacity-limited router would do).

Status: this is the routing function alone; `sonic::moe_experts` still takes [T, K] ids, so the
compiler option `sonic.token_rounding` is not wired yet.
"""
from __future__ import annotations

import torch

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

    # rank tokens per expert: top-k members first (by score), then the others (by probability)
    probs = router_probs.float()
    span = (probs.max() - probs.min()).clamp(min=0) + 1.0  # a device scalar: no host sync
    key = probs + in_topk * span  # every top-k member outranks every other token
    order = torch.argsort(key.t(), dim=1, descending=True, stable=True)  # [E, T]
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(T, device=device).expand(E, T))
    mask = (rank < target[:, None]).t()  # [T, E]

    if keep_every_token:
        orphan = ~mask.any(1) & in_topk.any(1)
        best = topk_ids.gather(1, topk_weights.float().argmax(1, keepdim=True)).long()  # [T, 1]
        restore = torch.zeros_like(mask).scatter_(1, best, True) & orphan[:, None]
        mask = mask | restore
    weights = torch.where(in_topk, topk_w, router_probs.to(topk_weights.dtype))
    weights = torch.where(mask, weights, torch.zeros((), dtype=weights.dtype, device=device))
    return mask, weights
