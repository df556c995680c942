"""Tile-aware token rounding on the CPU: properties of the rounding, its slot form through the op,
and the `sonic.token_rounding` compiler option end to end."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moe_compiler
from moe_compiler.codegen import moe_experts
from moe_compiler.codegen.token_rounding import (
    MODES,
    round_routing,
    round_token_counts,
    slot_capacity,
    token_rounding,
)
from moe_compiler.options import split_options
from moe_compiler.testing import rel_err, tiny_moe_model

from .helpers import assert_close_to_eager, compile_sonic, loss_and_grads


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
    if draw(st.booleans()):  # renormalised and scaled, as Qwen3-MoE's or DeepSeek-V3's router does
        weights = weights / weights.sum(-1, keepdim=True) * draw(st.sampled_from([1.0, 2.5]))
    return probs, ids, weights, tile


def _counts(ids, E):
    return torch.zeros(ids.shape[0], E, dtype=torch.bool).scatter_(1, ids, True).sum(0)


@given(routings(), st.sampled_from(MODES), st.booleans())
def test_counts_are_tile_multiples_and_move_less_than_a_tile(routing, mode, keep):
    probs, ids, weights, tile = routing
    T, E = probs.shape
    mask, _ = token_rounding(probs, ids, weights, tile=tile, mode=mode, keep_every_token=keep)
    before, after = _counts(ids, E), mask.sum(0)
    capped = after == T
    # kept orphans: their expert swaps out as many spare members; it can end over its multiple by
    # at most the number it took back (too few spare members, or a token swapped out twice)
    bare, _ = token_rounding(probs, ids, weights, tile=tile, mode=mode, keep_every_token=False)
    taken_back = (mask & ~bare).sum(0)
    assert torch.all((after % tile == 0) | capped | (after % tile <= taken_back)), (before, after, tile)
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
    # an added pair: its probability on the scale of the token's top-k weights (W / P)
    scale = weights.sum(1) / probs.gather(1, ids).sum(1)
    added = mask & ~in_topk
    torch.testing.assert_close(w[added], (probs * scale[:, None])[added], rtol=1e-6, atol=0)


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


# ------------------------------------------------------------------------ the slot form (round_routing)


@given(routings(), st.sampled_from(MODES))
def test_round_routing_lists_the_mask_pairs_token_major(routing, mode):
    probs, ids, weights, tile = routing
    T, E = probs.shape
    mask, w = token_rounding(probs, ids, weights, tile=tile, mode=mode)
    slot_ids, slot_w, slot_token = round_routing(probs, ids, weights, tile=tile, mode=mode)
    S = slot_capacity(T, E, ids.shape[1], tile, mode)
    assert slot_ids.shape == slot_w.shape == slot_token.shape == (S,)
    real = slot_ids >= 0
    n = int(mask.sum())
    assert n <= S and torch.all(real[:n]) and not torch.any(real[n:])  # pairs first, then padding
    tok, exp = mask.nonzero(as_tuple=True)  # row-major: token-major, experts ascending
    assert torch.equal(slot_token[:n].long(), tok) and torch.equal(slot_ids[:n].long(), exp)
    assert torch.equal(slot_w[:n], w[tok, exp]) and torch.all(slot_w[n:] == 0)
    assert torch.all(slot_token[n:] == T)


@pytest.mark.parametrize("mode", MODES)
def test_round_routing_gradients_through_the_op(mode):
    """float64 gradcheck of router -> round_routing -> moe_experts: x, router logits, w1, w2."""
    g = torch.Generator().manual_seed(1)
    T, d, n, E, K = 23, 8, 6, 5, 2
    x = torch.randn(T, d, generator=g, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64, requires_grad=True)
    w1 = (torch.randn(E, 2 * n, d, generator=g, dtype=torch.float64) / 3).requires_grad_()
    w2 = (torch.randn(E, d, n, generator=g, dtype=torch.float64) / 3).requires_grad_()

    def layer(x, logits, w1, w2):
        probs = logits.softmax(-1)
        top_w, top_i = probs.topk(K, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True) * 2.5  # renormalised and scaled: added pairs scale too
        slot_ids, slot_w, slot_token = round_routing(probs, top_i, top_w, tile=4, mode=mode)
        return moe_experts(x, slot_ids, slot_w, w1, w2, slot_token=slot_token)

    assert torch.autograd.gradcheck(layer, (x, logits, w1, w2))


def test_slot_form_rejects_unsorted_or_out_of_range_tokens():
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(3, 4, generator=g), torch.randn(2, 6, 4, generator=g), torch.randn(2, 4, 3, generator=g)
    ids, weights = torch.tensor([0, 1, 1, -1]), torch.ones(4)
    for tok in ([0, 2, 1, 3], [0, 1, 3, 3]):  # unsorted; a real slot on token 3 of 3
        with pytest.raises(IndexError, match="slot_token must be nondecreasing"):
            moe_experts(x, ids, weights, w1, w2, slot_token=torch.tensor(tok))
    assert moe_experts(x, ids, weights, w1, w2, slot_token=torch.tensor([0, 1, 2, 3])).shape == (3, 4)


# --------------------------------------------------------------------- the compiler option, end to end


def _rounded_eager_twin(model, mode):
    """The model with each MoE block's experts routed through round_routing in eager (the oracle)."""
    twin = copy.deepcopy(model)
    for layer in twin.model.layers:
        moe, stash = layer.mlp, {}
        moe.gate.register_forward_hook(lambda mod, args, out, stash=stash: stash.update(logits=out[0]))

        def experts(hidden, top_k_index, top_k_weights, experts=moe.experts, stash=stash):
            probs = stash["logits"].float().softmax(-1)
            slot_ids, slot_w, slot_token = round_routing(probs, top_k_index, top_k_weights, mode=mode)
            return moe_experts(hidden, slot_ids, slot_w, experts.gate_up_proj, experts.down_proj, slot_token=slot_token)

        moe.experts.forward = experts
    return twin


@pytest.mark.parametrize("mode", MODES)
def test_compiled_training_step_rounds_like_the_public_function(mode):
    """Train mode: logits and every gradient equal the eager model routed by `round_routing`, and
    differ from plain top-k (the rounding really happened); eval mode routes plain top-k exactly."""
    pytest.importorskip("transformers")
    model = tiny_moe_model("qwen3_moe")
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    compiled = compile_sonic(model, compiler="aot_eager", token_rounding=mode)
    with moe_compiler.capture() as report:
        logits, grads = loss_and_grads(compiled, ids)
    assert [r.details["token_rounding"] for r in report.rewritten] == [mode, mode]

    want_logits, want_grads = loss_and_grads(_rounded_eager_twin(model, mode), ids)
    plain_logits, _ = loss_and_grads(model, ids)
    assert_close_to_eager(logits, want_logits, what="logits")
    for name, grad in want_grads.items():
        assert_close_to_eager(grads[name], grad, what=name)
    assert rel_err(logits, plain_logits) > 1e-4  # rounding to 128-row tiles changes 32 tokens' routing

    model.eval()
    with moe_compiler.capture() as report:
        eval_logits = compiled(ids).logits
    assert {r.details["token_rounding"] for r in report.rewritten} == {"off (module in eval mode)"}
    torch.testing.assert_close(eval_logits, model(ids).logits, rtol=2e-5, atol=2e-6)


def test_no_grad_graphs_route_plain_topk():
    pytest.importorskip("transformers")
    model = tiny_moe_model("olmoe")
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    compiled = compile_sonic(model, compiler="aot_eager", token_rounding="up")
    with torch.no_grad(), moe_compiler.capture() as report:
        got = compiled(ids).logits
    assert {r.details["token_rounding"] for r in report.rewritten} == {"off (traced without grad: inference)"}
    torch.testing.assert_close(got, model(ids).logits, rtol=2e-5, atol=2e-6)


def test_router_without_visible_probabilities_keeps_topk(caplog):
    """gpt-oss ranks by raw logits (top-k, then softmax over the k): no probability to round by."""
    pytest.importorskip("transformers")
    model = tiny_moe_model("gpt_oss")
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    compiled = compile_sonic(model, compiler="aot_eager", token_rounding="nearest")
    with moe_compiler.capture() as report, caplog.at_level("WARNING", logger="moe_compiler"):
        logits, _ = loss_and_grads(compiled, ids)
    assert report.rewritten and {r.details["token_rounding"] for r in report.rewritten} == {
        "off (router scores not visible)"}
    assert "keeps plain top-k" in caplog.text
    assert_close_to_eager(logits, loss_and_grads(model, ids)[0], what="logits")


def test_bad_rounding_option_is_a_clear_error():
    with pytest.raises(ValueError, match="sonic.token_rounding must be None or one of"):
        split_options({"sonic.token_rounding": "sideways"})
    assert split_options({"sonic.token_rounding": "up"})[0].token_rounding == "up"
