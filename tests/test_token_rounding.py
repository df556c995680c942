"""Properties of tile-aware token rounding (codegen.token_rounding), on the CPU."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from codegen.token_rounding import MODES, round_token_counts, token_rounding


@st.composite
def routings(draw):
    T = draw(st.integers(1, 40))
    E = draw(st.integers(1, 8))
    K = draw(st.integers(1, E))
    tile = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    seed = draw(st.integers(0, 2**16))
    skew = draw(st.sampled_from(["none", "one_expert", "ties"]))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if skew == "one_expert":
        logits[:, 0] += 10.0  # every token's top-1 is expert 0: others nearly empty
    if skew == "ties":
        logits = logits.round()  # many equal probabilities
    probs = logits.softmax(-1)
    weights, ids = probs.topk(K, dim=-1)
    return probs, ids, weights, tile


def _counts(ids, E):
    return torch.zeros(ids.shape[0], E, dtype=torch.bool).scatter_(1, ids, True).sum(0)


@given(routings(), st.sampled_from(MODES))
def test_counts_are_tile_multiples_and_move_less_than_a_tile(routing, mode):
    probs, ids, weights, tile = routing
    T, E = probs.shape
    mask, _ = token_rounding(probs, ids, weights, tile=tile, mode=mode, keep_every_token=False)
    before, after = _counts(ids, E), mask.sum(0)
    capped = after == T
    assert torch.all((after % tile == 0) | capped), (before, after, tile)
    assert torch.all((after - before).abs() < tile), (before, after, tile)
    if mode == "down":
        assert torch.all(after <= before)
    if mode == "up":
        assert torch.all(after >= before)


@given(routings())
def test_round_down_drops_the_lowest_scoring_topk_tokens(routing):
    probs, ids, weights, tile = routing
    in_topk = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, ids, True)
    mask, _ = token_rounding(probs, ids, weights, tile=tile, mode="down", keep_every_token=False)
    assert not torch.any(mask & ~in_topk)  # never adds
    for e in range(probs.shape[1]):
        kept, dropped = probs[mask[:, e], e], probs[in_topk[:, e] & ~mask[:, e], e]
        if kept.numel() and dropped.numel():
            assert kept.min() >= dropped.max()


@given(routings())
def test_round_up_adds_the_highest_probability_outsiders(routing):
    probs, ids, weights, tile = routing
    in_topk = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, ids, True)
    mask, _ = token_rounding(probs, ids, weights, tile=tile, mode="up")
    assert torch.all(mask | ~in_topk)  # never drops a top-k pair
    for e in range(probs.shape[1]):
        added, left = probs[mask[:, e] & ~in_topk[:, e], e], probs[~mask[:, e], e]
        if added.numel() and left.numel():
            assert added.min() >= left.max()


@given(routings(), st.sampled_from(MODES))
def test_weights_follow_the_assignments(routing, mode):
    probs, ids, weights, tile = routing
    mask, w = token_rounding(probs, ids, weights, tile=tile, mode=mode)
    topk_w = torch.zeros_like(probs).scatter_(1, ids, weights)
    in_topk = topk_w > 0
    assert torch.all(w[~mask] == 0)
    assert torch.equal(w[mask & in_topk], topk_w[mask & in_topk])
    assert torch.equal(w[mask & ~in_topk], probs[mask & ~in_topk])


@given(routings(), st.sampled_from(MODES))
def test_no_token_loses_every_expert_by_default(routing, mode):
    probs, ids, weights, tile = routing
    mask, _ = token_rounding(probs, ids, weights, tile=tile, mode=mode)
    assert torch.all(mask.any(1))
    bare, _ = token_rounding(probs, ids, weights, tile=tile, mode=mode, keep_every_token=False)
    # the guarantee adds exactly one pair per token the bare rounding orphaned, and nothing else
    orphans = ~bare.any(1)
    assert torch.all(bare <= mask)
    assert torch.equal((mask & ~bare).sum(1), orphans.long())


def test_round_token_counts_examples():
    counts = torch.tensor([0, 1, 7, 8, 9, 12, 15])
    assert round_token_counts(counts, 8, "down", 100).tolist() == [0, 0, 0, 8, 8, 8, 8]
    assert round_token_counts(counts, 8, "up", 100).tolist() == [0, 8, 8, 8, 16, 16, 16]
    assert round_token_counts(counts, 8, "nearest", 100).tolist() == [0, 0, 8, 8, 8, 16, 16]
    assert round_token_counts(torch.tensor([9]), 8, "up", 10).tolist() == [10]  # capped at T
    with pytest.raises(ValueError, match="mode"):
        round_token_counts(counts, 8, "sideways", 100)


def test_rounding_has_no_data_dependent_shapes():
    """fullgraph compilation fails on any .item()/.tolist()/nonzero: the function is sync-free."""
    probs = torch.randn(32, 8).softmax(-1)
    weights, ids = probs.topk(2, dim=-1)
    compiled = torch.compile(token_rounding, backend="eager", fullgraph=True, dynamic=False)
    got = compiled(probs, ids, weights, tile=4, mode="nearest")
    want = token_rounding(probs, ids, weights, tile=4, mode="nearest")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
