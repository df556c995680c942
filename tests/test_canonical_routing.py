"""Canonical forms of routing (`patterns.canonical_routing`): an expert's rows found by counting
one_hot slots or by its gate column's nonzeros, a gate matrix read at (rows, column), one scale
applied after every expert wrote its rows, and `addmm` experts, each brought to the form
`expert_loop` reads; the value never changes, and a spelling outside a rule's condition stays."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_compiler.patterns.canonical import canonicalize

from .test_canonical import ops, same_value, traced

T, d, E, K = 10, 6, 4, 2


def rules(applied: list[str]) -> list[str]:
    return [line.split(":")[0] for line in applied]


def _member(spelling, ids, e):
    if spelling == "count":
        return F.one_hot(ids, E)[:, :, e].sum(1) > 0
    if spelling == "count_dim_list":
        return F.one_hot(ids, E)[..., e].sum(dim=[1]) != 0
    if spelling == "count_after":
        return F.one_hot(ids, E).sum(1)[:, e] >= 1
    if spelling == "eq_count":
        return 0 < (ids == e).sum(-1)
    return F.one_hot(ids, E)[:, :, e].any(1)  # any


@pytest.mark.parametrize("spelling", ["count", "count_dim_list", "count_after", "eq_count", "any"])
def test_a_count_of_an_experts_slots_becomes_its_any_hit(spelling):
    def fn(x, scores):
        w, ids = torch.topk(scores, K)
        out = torch.zeros_like(x)
        for e in range(E):
            tok = torch.where(_member(spelling, ids, e))[0]
            out = out.index_add(0, tok, x[tok] * (e + 1))
        return out

    x, scores = torch.randn(T, d), torch.randn(T, E)
    gm = traced(fn, x, scores)
    applied = rules(canonicalize(gm))
    assert applied.count("one_hot_count_to_any_hit") == E, applied
    # then read as the rows of torch.where(ids == e), as expert_loop reads them
    assert applied.count("any_hit_where_to_hit_where") == E, applied
    assert "one_hot" not in ops(gm) and "any" not in ops(gm), ops(gm)
    same_value(gm, fn, x, scores)


def more_than_one_slot(x, scores):  # count > 1: a token holding e twice, never true of top-k ids
    _, ids = torch.topk(scores, K)
    return x[torch.where(F.one_hot(ids, E)[:, :, 1].sum(1) > 1)[0]]


def ids_given(x, ids):  # ids from outside the graph: not provably in [0, E)
    return x[torch.where(F.one_hot(ids, E)[:, :, 1].sum(1) > 0)[0]]


@pytest.mark.parametrize("fn", [more_than_one_slot, ids_given])
def test_other_counts_stay(fn):
    x = torch.randn(T, d)
    second = torch.randn(T, E) if fn is more_than_one_slot else torch.randint(0, E, (T, K))
    gm = traced(fn, x, second)
    assert "one_hot_count_to_any_hit" not in rules(canonicalize(gm))


def _gates(kind, scores):
    if kind == "softmax_neg_inf":
        top, ids = scores.topk(K, dim=-1)
        return torch.full_like(scores, float("-inf")).scatter(1, ids, top).softmax(dim=1), ids
    w, ids = scores.softmax(-1).topk(K, dim=-1)
    if kind == "one_hot":
        return (F.one_hot(ids, E) * w.unsqueeze(-1)).sum(1), ids
    return torch.zeros_like(scores).scatter(1, ids, w), ids


@pytest.mark.parametrize("weight", ["rows_column", "column_rows", "index_select"])
@pytest.mark.parametrize("kind", ["softmax_neg_inf", "one_hot", "scatter"])
def test_an_experts_gate_column_nonzeros_become_its_any_hit(kind, weight):
    def fn(x, scores):
        gates, _ = _gates(kind, scores)
        out = torch.zeros_like(x)
        for e in range(E):
            tok = torch.nonzero(gates[:, e] != 0).view(-1)
            if weight == "rows_column":
                coef = gates[tok, e:e + 1]
            elif weight == "column_rows":
                coef = gates[:, e][tok].unsqueeze(-1)
            else:
                coef = torch.index_select(gates[:, e], 0, tok)[:, None]
            out = torch.index_add(out, 0, tok, torch.index_select(x, 0, tok).exp() * coef)
        return out

    x, scores = torch.randn(T, d), torch.randn(T, E)
    gm = traced(fn, x, scores)
    applied = rules(canonicalize(gm))
    assert applied.count("gate_nonzero_to_any_hit") == E, applied
    assert applied.count("gate_column_rows_to_weights") == E, applied  # w[tok, k]
    assert "ne" not in ops(gm), ops(gm)
    same_value(gm, fn, x, scores)


def dense_probs(x, scores):  # every expert's column of a dense softmax: all tokens, not a top-k
    gates = scores.softmax(-1)
    out = torch.zeros_like(x)
    for e in range(E):
        tok = torch.where(gates[:, e] != 0)[0]
        out = out.index_add(0, tok, x[tok] * gates[tok, e, None])
    return out


def rows_counted(x, scores):  # the rows also count the expert's load: a zero weight inside the top-k would change it
    gates, _ = _gates("scatter", scores)
    out, load = torch.zeros_like(x), []
    for e in range(E):
        tok = torch.where(gates[:, e] != 0)[0]
        out = out.index_add(0, tok, x[tok] * gates[:, e][tok, None])
        load.append(tok.float().mean())
    return out, torch.stack(load)


def weights_of_another_column(x, scores):  # rows of expert e, weights of expert e + 1: not proven to come with them
    gates, _ = _gates("scatter", scores)
    out = torch.zeros_like(x)
    for e in range(E - 1):
        tok = torch.where(gates[:, e] != 0)[0]
        out = out.index_add(0, tok, x[tok] * gates[:, e + 1][tok, None])
    return out


@pytest.mark.parametrize("fn", [dense_probs, rows_counted, weights_of_another_column])
def test_gate_nonzeros_stay_where_rows_may_differ(fn):
    x, scores = torch.randn(T, d), torch.randn(T, E)
    gm = traced(fn, x, scores)
    assert "gate_nonzero_to_any_hit" not in rules(canonicalize(gm))
    same_value(gm, fn, x, scores)


@pytest.mark.parametrize("write", ["mask", "where", "index_add_", "index_add"])
@pytest.mark.parametrize("scale", ["view", "unsqueeze", "none"])
def test_a_scale_after_the_row_writes_scales_each_write(write, scale):
    def fn(x, scores):
        p, ids = scores.softmax(-1).max(-1)
        out = x.new_zeros(x.shape)
        for e in range(E):
            mask = ids == e
            if write == "mask":
                out[mask] = x[mask] * (e + 1)
                continue
            tok = torch.where(mask)[0]
            if write == "where":
                out[tok] = x[tok] * (e + 1)
            elif write == "index_add_":
                out.index_add_(0, tok, x[tok] * (e + 1))
            else:
                out = out.index_add(0, tok, x[tok] * (e + 1))
        column = p.view(-1, 1) if scale == "view" else p.unsqueeze(-1) if scale == "unsqueeze" else p[:, None]
        return out * column

    x, scores = torch.randn(T, d), torch.randn(T, E)
    gm = traced(fn, x, scores)
    assert rules(canonicalize(gm)).count("scale_after_row_writes_to_scaled_rows") == 1
    assert ops(gm)[-1] != "mul", ops(gm)  # the output is the accumulator itself
    same_value(gm, fn, x, scores)


def read_before_the_scale(x, scores):  # the unscaled sum is read too: scaling each write would change that read
    p, ids = scores.softmax(-1).max(-1)
    out = torch.zeros_like(x)
    for e in range(E):
        tok = torch.where(ids == e)[0]
        out[tok] = x[tok] * (e + 1)
    return out * p[:, None], out.sum()


def promoted(x, scores):  # a float64 scale promotes the product: not the accumulator's value scaled
    p, ids = scores.double().softmax(-1).max(-1)
    out = torch.zeros_like(x)
    for e in range(E):
        tok = torch.where(ids == e)[0]
        out[tok] = x[tok] * (e + 1)
    return out * p[:, None]


def started_from_x(x, scores):  # the accumulator starts from x, not zeros: x's rows are scaled too
    p, ids = scores.softmax(-1).max(-1)
    out = x.clone()
    for e in range(E):
        tok = torch.where(ids == e)[0]
        out.index_add_(0, tok, x[tok] * (e + 1))
    return out * p[:, None]


@pytest.mark.parametrize("fn", [read_before_the_scale, promoted, started_from_x])
def test_a_scale_stays_where_the_accumulator_is_not_only_rows(fn):
    x, scores = torch.randn(T, d), torch.randn(T, E)
    gm = traced(fn, x, scores)
    assert "scale_after_row_writes_to_scaled_rows" not in rules(canonicalize(gm))
    same_value(gm, fn, x, scores)


def test_addmm_becomes_a_product_plus_bias():
    def fn(x, W, b):
        return torch.addmm(b[1], x, W[1]).relu() + b[0].addmm(x, W[0]) + torch.addmm(b[2], x, W[2], beta=0.5)

    x, W, b = torch.randn(T, d), torch.randn(3, d, 5), torch.randn(3, 5)
    gm = traced(fn, x, W, b)
    applied = rules(canonicalize(gm))
    assert applied.count("addmm_to_matmul_plus_bias") == 2, applied  # beta=0.5 stays
    assert ops(gm).count("addmm") == 1, ops(gm)
    same_value(gm, fn, x, W, b)


class GateColumnLoop(torch.nn.Module):
    """An expert loop over the nonzeros of each expert's gate column: a top-k MoE when the gates
    are sparse ("top-k"), a dense mixture of every expert when they are the softmax itself
    ("dense": every column nonzero, every token on every expert), and a layer whose expert e reads
    its rows by column e but its weights from column e + 1 ("shifted")."""

    def __init__(self, gates="top-k", d=16, n=8):
        super().__init__()
        self.router = torch.nn.Linear(d, E, bias=False)
        self.up = torch.nn.ModuleList(torch.nn.Linear(d, n) for _ in range(E))
        self.down = torch.nn.ModuleList(torch.nn.Linear(n, d) for _ in range(E))
        self.gates = gates

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        if self.gates == "dense":
            gates = probs
        else:
            w, ids = probs.topk(K, dim=-1)
            gates = torch.zeros_like(probs).scatter(1, ids, w)
        out = torch.zeros_like(x)
        for e in range(E):
            tok = torch.where(gates[:, e] != 0)[0]
            column = (e + 1) % E if self.gates == "shifted" else e
            y = self.down[e](F.relu(self.up[e](x[tok])))
            out = out.index_add(0, tok, y * gates[:, column][tok, None])
        return out


@pytest.mark.parametrize("gates, rewritten", [("top-k", 1), ("dense", 0), ("shifted", 0)])
def test_a_gate_column_loop_is_rewritten_only_when_sparse_and_weighted_by_its_column(gates, rewritten):
    import moe_compiler

    from .helpers import assert_close_to_eager, compile_sonic

    torch.manual_seed(0)
    model, x = GateColumnLoop(gates), torch.randn(12, 16)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        eager = model(x)
        with moe_compiler.capture() as report:
            got = compile_sonic(model, compiler="aot_eager")(x)
    assert len(report.rewritten) == rewritten, str(report)
    assert_close_to_eager(got, eager, what="output")


@pytest.mark.parametrize("read", ["floordiv", "div_floor", "index_select"])
def test_slots_copied_by_position_become_a_masked_write_of_repeated_rows(read):
    def fn(x, scores):
        _, ids = torch.topk(scores, K)
        flat = ids.reshape(-1)
        y = x.new_zeros(x.shape[0] * K, x.shape[1])
        for e in range(E):
            pos = (flat == e).nonzero().flatten()
            tok = pos // K if read == "floordiv" else torch.div(pos, K, rounding_mode="floor")
            rows = x.index_select(0, tok) if read == "index_select" else x[tok]
            y.index_copy_(0, pos, rows * (e + 1))
        return y

    x, scores = torch.randn(T, d), torch.randn(T, E)
    gm = traced(fn, x, scores)
    applied = rules(canonicalize(gm))
    assert applied.count("position_copy_to_mask_write") == E and applied.count("slot_token_rows_to_repeat") == E, applied
    assert ops(gm).count("repeat_interleave") == 1 and "index_copy_" not in ops(gm), ops(gm)
    same_value(gm, fn, x, scores)


def other_divisor(x, scores):  # pos // 3 over T * 2 slots: not the slot's token
    _, ids = torch.topk(scores, K)
    pos = torch.where(ids.reshape(-1) == 1)[0]
    return x[pos // 3]


def copied_to_other_rows(x, scores):  # the positions of a [T] mask copied into a [2T, d] buffer: the sizes differ
    _, ids = torch.topk(scores, 1)
    pos = torch.where(ids.reshape(-1) == 1)[0]
    y = torch.zeros(2 * x.shape[0], x.shape[1])
    y.index_copy_(0, pos, x[pos])
    return y


@pytest.mark.parametrize("fn", [other_divisor, copied_to_other_rows])
def test_slot_rules_stay_outside_their_condition(fn):
    x, scores = torch.randn(T, d), torch.randn(T, E)
    gm = traced(fn, x, scores)
    applied = rules(canonicalize(gm))
    assert "position_copy_to_mask_write" not in applied and "slot_token_rows_to_repeat" not in applied, applied
    same_value(gm, fn, x, scores)


@pytest.mark.parametrize("lead", [(T,), (2, 5)])
@pytest.mark.parametrize("spelling", ["where", "where_zeros_like", "mul", "masked_fill"])
def test_a_weight_picked_from_the_slots_holding_an_expert_is_a_gate_column(spelling, lead):
    def fn(x, scores):
        w, ids = torch.topk(scores.softmax(-1), K)
        out = 0
        for e in range(E):
            if spelling == "mul":
                g = (w * (ids == e)).sum(-1, keepdim=True)
            elif spelling == "masked_fill":
                g = w.masked_fill(ids != e, 0.0).sum(-1, keepdim=True)
            else:
                g = torch.where(ids == e, w, 0.0 if spelling == "where" else torch.zeros_like(w)).sum(-1, keepdim=True)
            out = out + g * x.exp() * (e + 1)
        return out

    x, scores = torch.randn(*lead, d), torch.randn(*lead, E)
    gm = traced(fn, x, scores)
    assert rules(canonicalize(gm)).count("masked_weight_to_gate_column") == E
    assert "where" not in ops(gm) and ops(gm).count("one_hot") == 1, ops(gm)
    same_value(gm, fn, x, scores)


def where_of_another_value(x, scores):  # where(ids == e, w, 1): the other slots hold 1, not 0
    w, ids = torch.topk(scores.softmax(-1), K)
    return torch.where(ids == 1, w, 1.0).sum(-1, keepdim=True) * x


def where_of_other_zeros(x, scores):  # the zeros of another tensor of w's shape: allowed only as zeros_like(w) itself
    w, ids = torch.topk(scores.softmax(-1), K)
    return torch.where(ids == 1, w, torch.zeros_like(ids, dtype=w.dtype) + x[:, :K]).sum(-1, keepdim=True) * x


def masked_where_equal(x, scores):  # w.masked_fill(ids == 1, 0): every slot but expert 1's
    w, ids = torch.topk(scores.softmax(-1), K)
    return w.masked_fill(ids == 1, 0.0).sum(-1, keepdim=True) * x


def masked_fill_of_another_value(x, scores):
    w, ids = torch.topk(scores.softmax(-1), K)
    return w.masked_fill(ids != 1, 0.5).sum(-1, keepdim=True) * x


@pytest.mark.parametrize("fn", [where_of_another_value, where_of_other_zeros, masked_where_equal,
                                masked_fill_of_another_value])
def test_a_where_with_another_fill_stays(fn):
    x, scores = torch.randn(T, d), torch.randn(T, E)
    gm = traced(fn, x, scores)
    assert "masked_weight_to_gate_column" not in rules(canonicalize(gm))
    same_value(gm, fn, x, scores)


@pytest.mark.parametrize("expand", ["expand_as", "none_expand"])
def test_rows_put_back_by_masked_scatter_become_row_adds(expand):
    def fn(x, scores):
        _, ids = torch.topk(scores, K)
        out = torch.zeros_like(x)
        for e in range(E):
            sel = (ids == e).any(-1)
            y = x[sel].exp() * (e + 1)
            wide = sel.unsqueeze(-1).expand_as(x) if expand == "expand_as" else sel[:, None].expand(-1, x.shape[1])
            out = out + torch.zeros_like(x).masked_scatter(wide, y)
        return out

    x, scores = torch.randn(T, d), torch.randn(T, E)
    gm = traced(fn, x, scores)
    applied = rules(canonicalize(gm))
    assert applied.count("masked_scatter_rows_to_index_add") == E, applied
    assert applied.count("add_of_rows_into_zeros_to_index_add") == E - 1, applied  # the first is zeros + v
    assert "masked_scatter" not in ops(gm) and ops(gm).count("index_add") == E, ops(gm)
    same_value(gm, fn, x, scores)


def masked_scatter_of_other_rows(x, scores):  # y is not read at the mask's rows: its row count is unproven
    _, ids = torch.topk(scores, K)
    sel = (ids == 1).any(-1)
    y = x[: int(sel.sum())]
    return torch.zeros_like(x).masked_scatter(sel.unsqueeze(-1).expand_as(x), y)


def masked_scatter_into_x(x, scores):  # into x's own rows, not zeros: the unselected rows keep x
    _, ids = torch.topk(scores, K)
    sel = (ids == 1).any(-1)
    return x.masked_scatter(sel.unsqueeze(-1).expand_as(x), x[sel] * 2)


@pytest.mark.parametrize("fn", [masked_scatter_of_other_rows, masked_scatter_into_x])
def test_a_masked_scatter_stays_outside_its_condition(fn):
    x, scores = torch.randn(T, d), torch.randn(T, E)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        gm = traced(fn, x, scores)
    assert "masked_scatter_rows_to_index_add" not in rules(canonicalize(gm))
    same_value(gm, fn, x, scores)


def gate_rows_added_by_mask(x, scores):  # out[m] += y: adding a zero-weight row's 0 leaves it as it was
    gates, _ = _gates("scatter", scores)
    out = torch.zeros_like(x)
    for e in range(E):
        m = gates[:, e] != 0
        out[m] += x[m].exp() * gates[:, e][m, None]
    return out


def gate_rows_assigned(x, scores):  # out[m] = y over x's rows: a zero-weight row would be overwritten with 0
    gates, _ = _gates("scatter", scores)
    out = x.clone()
    for e in range(E):
        m = gates[:, e] != 0
        out[m] = x[m].exp() * gates[:, e][m, None]
    return out


@pytest.mark.parametrize("fn, applied", [(gate_rows_added_by_mask, True), (gate_rows_assigned, False)])
def test_gate_nonzero_rows_are_added_to_never_assigned(fn, applied):
    x, scores = torch.randn(T, d), torch.randn(T, E)
    gm = traced(fn, x, scores)
    assert ("gate_nonzero_to_any_hit" in rules(canonicalize(gm))) == applied
    same_value(gm, fn, x, scores)


# --- every expert's outputs read at each token's top-k ids --------------------------------------


def _picked(spelling, y, ids):
    if spelling == "gather":
        return torch.gather(y, 1, ids.unsqueeze(-1).expand(-1, -1, y.shape[-1]))
    rows = torch.arange(y.shape[0])
    rows = {"index_none": rows[:, None], "unsqueeze": rows.unsqueeze(1), "view": rows.view(-1, 1)}[spelling]
    return y[rows, ids]


@pytest.mark.parametrize("spelling", ["gather", "index_none", "unsqueeze", "view"])
@pytest.mark.parametrize("weights", ["unsqueeze", "index_none"])
def test_outputs_read_at_the_top_k_ids_become_a_gate_matrix_product(spelling, weights):
    def fn(y, scores):
        w, ids = torch.topk(scores.softmax(-1), K)
        col = w.unsqueeze(-1) if weights == "unsqueeze" else w[..., None]
        return (_picked(spelling, y, ids) * col).sum(1)

    y, scores = torch.randn(T, E, d), torch.randn(T, E)
    gm = traced(fn, y, scores)
    assert rules(canonicalize(gm)) == ["gathered_outputs_to_gate_matrix"]
    assert "scatter" in ops(gm) and "gather" not in ops(gm), ops(gm)
    same_value(gm, fn, y, scores)


def _ids_of_another_token(y, scores):
    w, ids = torch.topk(scores, K)
    return (y[torch.arange(T)[:, None], ids.roll(1, 0)] * w[..., None]).sum(1)


def _ids_not_a_top_k(y, scores):
    ids = torch.randint(0, E, (T, K))  # duplicates possible: a scatter would write one of them
    return (y[torch.arange(T)[:, None], ids] * scores[:, :K, None]).sum(1)


def _summed_over_the_features(y, scores):
    w, ids = torch.topk(scores, K)
    return (y[torch.arange(T)[:, None], ids] * w[..., None]).sum(-1)


def _rows_of_other_tokens(y, scores):
    w, ids = torch.topk(scores, K)
    return (y[torch.arange(T).flip(0)[:, None], ids] * w[..., None]).sum(1)


@pytest.mark.parametrize("fn", [_ids_of_another_token, _ids_not_a_top_k, _summed_over_the_features, _rows_of_other_tokens])
def test_outputs_read_elsewhere_stay(fn):
    y, scores = torch.randn(T, E, d), torch.randn(T, E)
    torch.manual_seed(0)
    gm = traced(fn, y, scores)
    assert "gathered_outputs_to_gate_matrix" not in rules(canonicalize(gm))


# --- the first K of a descending sort ---------------------------------------------------------


def _sort_prefix(scores):
    ranked, order = torch.sort(scores, dim=-1, descending=True)
    return ranked[..., :K] * 2, order[:, :K]


def _argsort_prefix(scores):
    ids = scores.argsort(dim=-1, descending=True)[..., :K]
    return scores.gather(-1, ids), ids


def _narrow_prefix(scores):
    ranked, order = scores.sort(-1, True)
    return ranked.narrow(-1, 0, K), order.narrow(-1, 0, K)


@pytest.mark.parametrize("fn", [_sort_prefix, _argsort_prefix, _narrow_prefix])
def test_the_first_k_of_a_descending_sort_become_a_top_k(fn):
    scores = torch.randn(T, E)
    gm = traced(fn, scores)
    assert rules(canonicalize(gm)) == ["sorted_prefix_to_topk"]
    assert "topk" in ops(gm) and "sort" not in ops(gm) and "argsort" not in ops(gm), ops(gm)
    same_value(gm, fn, scores)


def _ascending_suffix(scores):
    ranked, order = torch.sort(scores, dim=-1)
    return ranked[..., -K:], order[..., -K:]  # the top K, smallest first: another slot order


def _widths_differ(scores):
    ranked, order = torch.sort(scores, dim=-1, descending=True)
    return ranked[..., :K + 1], order[..., :K]


def _top_p(scores):
    ranked, order = torch.sort(scores.softmax(-1), dim=-1, descending=True)
    keep = ranked.cumsum(-1) < 0.7  # every sorted value read: a variable number of experts
    return ranked * keep, order[..., :K]


def _over_the_tokens(scores):
    ranked, order = torch.sort(scores, dim=0, descending=True)
    return ranked[:K], order[:K]


@pytest.mark.parametrize("fn", [_ascending_suffix, _widths_differ, _top_p, _over_the_tokens])
def test_other_sorts_stay(fn):
    scores = torch.randn(T, E)
    gm = traced(fn, scores)
    assert "sorted_prefix_to_topk" not in rules(canonicalize(gm))


def _argmax(scores):
    return torch.argmax(scores, dim=-1)


def _argmax_method_keepdim(scores):
    return scores.softmax(-1).argmax(-1, keepdim=True)


def _argmax_ties(scores):  # whole rows of ties: both pick the first index of the row's largest
    return torch.argmax(scores.round(), dim=1)


@pytest.mark.parametrize("fn", [_argmax, _argmax_method_keepdim, _argmax_ties])
def test_an_argmax_over_the_experts_becomes_a_max(fn):
    scores = torch.randn(T, E) * 0.4
    gm = traced(fn, scores)
    assert rules(canonicalize(gm)) == ["argmax_to_max"]
    assert "max" in ops(gm) and "argmax" not in ops(gm), ops(gm)
    same_value(gm, fn, scores)


def _top1_weighted_by_amax(scores):  # T5X's Switch router: the argmax, weighted by the largest probability
    probs = scores.view(2, -1, E).softmax(-1)
    return probs.argmax(-1), torch.amax(probs, dim=-1), probs.amax(-1, keepdim=True)


def _amax_of_other_scores(scores):  # the max is over the probabilities, the amax over the scores
    return scores.softmax(-1).argmax(-1), torch.amax(scores, dim=-1), scores.amax(0)


def test_an_amax_beside_a_max_of_the_same_scores_reads_its_values():
    scores = torch.randn(T, E)
    gm = traced(_top1_weighted_by_amax, scores)
    assert rules(canonicalize(gm)).count("amax_to_max_values") == 2
    assert "amax" not in ops(gm), ops(gm)
    same_value(gm, _top1_weighted_by_amax, scores)
    gm = traced(_amax_of_other_scores, scores)
    assert "amax_to_max_values" not in rules(canonicalize(gm))


def _argmax_flat(scores):
    return torch.argmax(scores)  # over every element


def _argmax_tokens(scores):
    return scores.argmax(0)


def _argmax_ints(scores):
    return (scores * 10).long().argmax(-1)


@pytest.mark.parametrize("fn", [_argmax_flat, _argmax_tokens, _argmax_ints])
def test_other_argmaxes_stay(fn):
    scores = torch.randn(T, E)
    gm = traced(fn, scores)
    assert "argmax_to_max" not in rules(canonicalize(gm))


def _two_argmaxes(logits):  # values and keepdim of the second max too
    i1 = logits.softmax(-1).argmax(-1)
    v2, i2 = logits.masked_fill(F.one_hot(i1, E).bool(), float("-inf")).max(dim=-1, keepdim=True)
    return i1, v2, i2


def _two_argmaxes_scatter(logits):
    i1 = logits.argmax(1)
    return i1, logits.scatter(-1, i1[:, None], float("-inf")).argmax(1)


def _two_argmaxes_where(logits):
    i1 = logits.argmax(-1)
    return i1, torch.where(F.one_hot(i1, E) == 1, float("-inf"), logits).argmax(-1)


def _two_argmaxes_of_probabilities_masked_with_minus_one(logits):  # below every probability, as -inf is
    probs = logits.softmax(-1)
    i1 = probs.argmax(-1)
    return i1, probs.masked_fill(F.one_hot(i1, E).bool(), -1.0).argmax(-1)


def _sparsemixer_ids(logits):  # PhiMoE's eval routing: both maxes keep their dim, the ids concatenated
    v1, i1 = logits.max(dim=-1, keepdim=True)
    v2, i2 = torch.scatter(logits, -1, i1, float("-inf")).max(dim=-1, keepdim=True)
    return torch.cat((i1, i2), dim=-1), v2


def _kept_max_then_a_plain_argmax(logits):
    _, i1 = logits.max(dim=-1, keepdim=True)
    return i1, torch.scatter(logits, -1, i1, float("-inf")).argmax(-1)


@pytest.mark.parametrize("fn", [_two_argmaxes, _two_argmaxes_scatter, _two_argmaxes_where,
                                _two_argmaxes_of_probabilities_masked_with_minus_one, _sparsemixer_ids,
                                _kept_max_then_a_plain_argmax])
def test_an_argmax_of_the_rest_after_an_argmax_becomes_a_top2(fn):
    logits = torch.randn(T, E)
    gm = traced(fn, logits)
    assert "second_max_to_topk" in rules(canonicalize(gm))
    assert "topk" in ops(gm) and "max" not in ops(gm) and "argmax" not in ops(gm), ops(gm)
    same_value(gm, fn, logits)


def _masked_by_another_argmax(logits):  # the first id is another scores' argmax
    i1 = (logits * torch.arange(E)).argmax(-1)
    return logits.masked_fill(F.one_hot(i1, E).bool(), float("-inf")).argmax(-1)


def _masked_to_zero(logits):  # the first expert set to 0, not -inf: it may stay the largest
    i1 = logits.argmax(-1)
    return logits.masked_fill(F.one_hot(i1, E).bool(), 0.0).argmax(-1)


def _logits_masked_with_minus_one(logits):  # a logit may be below -1: the masked expert may win again
    i1 = logits.argmax(-1)
    return logits.masked_fill(F.one_hot(i1, E).bool(), -1.0).argmax(-1)


def _first_of_a_bf16_softmax(logits):  # rounded probabilities tie more often than the logits do
    i1 = logits.softmax(-1, dtype=torch.bfloat16).argmax(-1)
    return logits.masked_fill(F.one_hot(i1, E).bool(), float("-inf")).argmax(-1)


def _masked_over_the_tokens(logits):
    i1 = logits.argmax(-1)
    return logits.masked_fill(F.one_hot(i1, E).bool(), float("-inf")).argmax(0)


def _scattered_at_a_kept_max_of_other_scores(logits):
    _, i1 = (logits * torch.arange(E)).max(dim=-1, keepdim=True)
    return torch.scatter(logits, -1, i1, float("-inf")).max(dim=-1, keepdim=True)[1]


@pytest.mark.parametrize("fn", [_masked_by_another_argmax, _masked_to_zero, _logits_masked_with_minus_one,
                                _first_of_a_bf16_softmax, _masked_over_the_tokens,
                                _scattered_at_a_kept_max_of_other_scores])
def test_other_second_argmaxes_stay(fn):
    gm = traced(fn, torch.randn(T, E))
    assert "second_max_to_topk" not in rules(canonicalize(gm))


def _slot_combine(logits, w):
    ids = logits.topk(K, dim=-1)[1]
    return sum(w[:, k, None] * F.one_hot(ids[:, k], E).float() for k in range(K))


def _slot_combine_columns(logits, w):
    ids = logits.topk(K, dim=-1)[1]
    return F.one_hot(ids[..., 1], E) * w[:, 1:2] + w[:, 0:1] * F.one_hot(ids[..., 0], E)


@pytest.mark.parametrize("fn", [_slot_combine, _slot_combine_columns])
def test_a_sum_of_each_slots_one_hot_times_its_weight_becomes_a_gate_matrix(fn):
    logits, w = torch.randn(T, E), torch.randn(T, K)
    gm = traced(fn, logits, w)
    assert "slot_one_hots_to_gate_matrix" in rules(canonicalize(gm))
    same_value(gm, fn, logits, w)


def _one_slot_twice(logits, w):
    ids = logits.topk(K, dim=-1)[1]
    return w[:, 0:1] * F.one_hot(ids[:, 0], E) + w[:, 1:2] * F.one_hot(ids[:, 0], E)


def _a_slot_missing(logits, w):
    ids = logits.topk(3, dim=-1)[1]
    return w[:, 0:1] * F.one_hot(ids[:, 0], E) + w[:, 1:2] * F.one_hot(ids[:, 1], E)


def _slots_of_other_ids(logits, w):
    a, b = logits.topk(K, dim=-1)[1], (-logits).topk(K, dim=-1)[1]
    return w[:, 0:1] * F.one_hot(a[:, 0], E) + w[:, 1:2] * F.one_hot(b[:, 1], E)


@pytest.mark.parametrize("fn", [_one_slot_twice, _a_slot_missing, _slots_of_other_ids])
def test_slot_one_hot_sums_that_are_not_every_slot_once_stay(fn):
    gm = traced(fn, torch.randn(T, E), torch.randn(T, K))
    assert "slot_one_hots_to_gate_matrix" not in rules(canonicalize(gm))


def test_permuted_rows_put_back_unchanged_are_the_rows():
    def fn(x, scores):
        perm = torch.argsort(scores.argmax(-1))
        out = torch.zeros_like(x)
        out.index_add_(0, perm, x[perm])
        return out * 2

    x, scores = torch.randn(T, d), torch.randn(T, E)
    gm = traced(fn, x, scores)
    assert "permuted_rows_put_back_to_rows" in rules(canonicalize(gm))
    assert "index_add_" not in ops(gm) and "sort" not in ops(gm), ops(gm)
    same_value(gm, fn, x, scores)


@pytest.mark.parametrize("put", ["scatter_add_", "index_add"])
def test_rows_permuted_then_put_back_are_computed_in_place(put):
    def fn(x, scores, w):
        e = scores.argmax(-1)
        perm = torch.argsort(e)
        ys = torch.relu(x[perm] * w[e[perm]]).sum(-1, keepdim=True) * scores.softmax(-1)[perm]
        out = torch.zeros(x.shape[0], E)
        if put == "scatter_add_":
            out.scatter_add_(0, perm.unsqueeze(-1).expand(-1, E), ys)
        else:
            out = out.index_add(0, perm, ys)
        return out

    x, scores, w = torch.randn(T, d), torch.randn(T, E), torch.randn(E, d)
    gm = traced(fn, x, scores, w)
    assert "permuted_rows_put_back_to_rows" in rules(canonicalize(gm))
    assert "index_add" not in ops(gm) and "index_add_" not in ops(gm), ops(gm)
    same_value(gm, fn, x, scores, w)


def _rows_in_order(x, scores, w):  # a running sum over the permuted rows: their order matters
    perm = torch.argsort(scores.argmax(-1))
    ys = (x[perm] * w[0]).cumsum(0)
    return torch.zeros_like(x).index_add(0, perm, ys)


def _rows_read_elsewhere(x, scores, w):  # the permuted rows are also returned: they must keep their order
    perm = torch.argsort(scores.argmax(-1))
    xs = x[perm]
    return torch.zeros_like(x).index_add(0, perm, xs * w[0]), xs


def _not_a_permutation(x, scores, w):  # top-k ids repeat rows: not a permutation of them
    tok = scores.topk(1, dim=0).indices.reshape(-1).repeat(T // E + 1)[:T]
    return torch.zeros_like(x).index_add(0, tok, x[tok] * w[0])


def _put_back_by_another_permutation(x, scores, w):  # read in one order, put back in another
    perm = torch.argsort(scores.argmax(-1))
    other = torch.argsort(scores.argmin(-1))
    return torch.zeros_like(x).index_add(0, other, x[perm] * w[0])


def _rows_mixed_with_unpermuted_rows(x, scores, w):  # x[perm] + x: row i mixes rows perm[i] and i
    perm = torch.argsort(scores.argmax(-1))
    return torch.zeros_like(x).index_add(0, perm, x[perm] + x)


@pytest.mark.parametrize("fn", [_rows_in_order, _rows_read_elsewhere, _not_a_permutation,
                                _put_back_by_another_permutation, _rows_mixed_with_unpermuted_rows])
def test_permuted_rows_stay_outside_the_rule(fn):
    x, scores, w = torch.randn(T, d), torch.randn(T, E), torch.randn(E, d)
    gm = traced(fn, x, scores, w)
    assert "permuted_rows_put_back_to_rows" not in rules(canonicalize(gm))
    same_value(gm, fn, x, scores, w)


def _sorted_slots(scores, K):
    """(flat ids, perm sorting them, flat weights) of a top-K over the scores."""
    w, ids = scores.softmax(-1).topk(K, dim=-1)
    flat = ids.reshape(-1)
    return flat, torch.sort(flat, stable=True)[1], w.reshape(-1)


def _sorted_mask_loop(x, scores, W, spelling="setitem", K=2, base="zeros"):
    """megablocks' / torchtitan's form: slots sorted by expert, tokens read at perm // K, a loop over
    the sorted ids' masks, weights applied, rows put back at perm // K."""
    flat, perm, w = _sorted_slots(scores, K)
    tok = perm // K
    xs = torch.gather(x, 0, tok[:, None].expand(-1, x.shape[1])) if spelling == "gather" else x.index_select(0, tok)
    es = torch.sort(flat, stable=True)[0] if spelling == "sort_values" else flat[perm]
    out = xs.new_zeros(xs.shape[0], x.shape[1])
    for e in range(E):
        m = es == e
        if spelling == "index_copy":
            rows = torch.where(m)[0]
            out = out.index_copy(0, rows, torch.relu(xs[rows] @ W[e]))
        else:
            out[m] = torch.relu(xs[m] @ W[e])
    ys = out * w[perm].unsqueeze(-1)
    start = torch.zeros_like(x) if base == "zeros" else x * 2
    return start.index_add(0, tok, ys)


@pytest.mark.parametrize("spelling, K, base", [("setitem", 2, "zeros"), ("index_copy", 2, "zeros"),
                                               ("gather", 3, "shared"), ("sort_values", 1, "shared")])
def test_a_loop_over_the_masks_of_sorted_slots_runs_on_the_slots_unsorted(spelling, K, base):
    x, scores, W = torch.randn(T, d), torch.randn(T, E), torch.randn(E, d, d)
    fn = lambda *a: _sorted_mask_loop(*a, spelling=spelling, K=K, base=base)  # noqa: E731
    gm = traced(fn, x, scores, W)
    assert "permuted_rows_put_back_to_rows" in rules(canonicalize(gm))
    assert "sort" not in ops(gm) and "index_add" not in ops(gm), ops(gm)
    assert ("repeat_interleave" in ops(gm)) == (K > 1), ops(gm)
    same_value(gm, fn, x, scores, W)


def _reads_another_experts_rows(x, scores, W):  # rows of mask e plus a sum of the rows of mask e + 1
    flat, perm, w = _sorted_slots(scores, 2)
    xs, es = x.index_select(0, perm // 2), flat[perm]
    out = torch.zeros_like(xs)
    for e in range(E):
        out[es == e] = torch.relu(xs[es == e] @ W[e]) + xs[es == (e + 1) % E].sum(0)
    return torch.zeros_like(x).index_add(0, perm // 2, out * w[perm, None])


def _put_back_at_other_tokens(x, scores, W):  # read at perm // 2, put back at perm % T
    flat, perm, w = _sorted_slots(scores, 2)
    xs, es = x.index_select(0, perm // 2), flat[perm]
    out = torch.zeros_like(xs)
    for e in range(E):
        out[es == e] = xs[es == e] @ W[e]
    return torch.zeros_like(x).index_add(0, perm % T, out)


def _unsorted_ids_as_masks(x, scores, W):  # masks of the unsorted ids over the sorted rows
    flat, perm, w = _sorted_slots(scores, 2)
    xs = x.index_select(0, perm // 2)
    out = torch.zeros_like(xs)
    for e in range(E):
        out[flat == e] = xs[flat == e] @ W[e]
    return torch.zeros_like(x).index_add(0, perm // 2, out)


def _a_running_sum_in_the_loop(x, scores, W):  # each expert's rows summed cumulatively: order matters
    flat, perm, w = _sorted_slots(scores, 2)
    xs, es = x.index_select(0, perm // 2), flat[perm]
    out = torch.zeros_like(xs)
    for e in range(E):
        out[es == e] = (xs[es == e] @ W[e]).cumsum(0)
    return torch.zeros_like(x).index_add(0, perm // 2, out)


def _accumulator_read_in_the_loop(x, scores, W):  # the zeros read before the last write
    flat, perm, w = _sorted_slots(scores, 2)
    xs, es = x.index_select(0, perm // 2), flat[perm]
    out = torch.zeros_like(xs)
    seen = []
    for e in range(E):
        out[es == e] = xs[es == e] @ W[e]
        seen.append(out.sum())
    return torch.zeros_like(x).index_add(0, perm // 2, out), torch.stack(seen)


@pytest.mark.parametrize("fn", [_reads_another_experts_rows, _put_back_at_other_tokens, _unsorted_ids_as_masks,
                                _a_running_sum_in_the_loop, _accumulator_read_in_the_loop])
def test_sorted_mask_loops_outside_the_rule_stay(fn):
    x, scores, W = torch.randn(T, d), torch.randn(T, E), torch.randn(E, d, d)
    gm = traced(fn, x, scores, W)
    assert "permuted_rows_put_back_to_rows" not in rules(canonicalize(gm))
    same_value(gm, fn, x, scores, W)


# --- each slot's token read from copies of arange(T) --------------------------------------------


@pytest.mark.parametrize("read", ["getitem", "index_select"])
def test_a_slots_token_from_arange_copies_becomes_its_position_floor_k(read):
    def fn(x, scores):
        _, ids = torch.topk(scores, K)
        tokens = torch.arange(x.shape[0]).repeat_interleave(K)
        sel = torch.where(ids.reshape(-1) == 1)[0]
        tok = tokens[sel] if read == "getitem" else tokens.index_select(0, sel)
        return x[tok] * 2

    x, scores = torch.randn(T, d), torch.randn(T, E)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        gm = traced(fn, x, scores)
    applied = rules(canonicalize(gm))
    assert "copies_at_slots_to_floor_div" in applied and "slot_token_rows_to_repeat" in applied, applied
    same_value(gm, fn, x, scores)


def test_a_tiled_arange_read_at_slots_stays():
    def fn(x, scores):
        _, ids = torch.topk(scores, K)
        tokens = torch.arange(x.shape[0]).repeat(K)  # tiled: entry p is p mod T, not p // K
        return x[tokens[torch.where(ids.reshape(-1) == 1)[0]]]

    x, scores = torch.randn(T, d), torch.randn(T, E)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        gm = traced(fn, x, scores)
    assert "copies_at_slots_to_floor_div" not in rules(canonicalize(gm))
    same_value(gm, fn, x, scores)


def _functional_writes(x, ids, read_between=False):
    out = torch.zeros_like(x)
    seen = None
    for e in range(E):
        rows = torch.where(ids == e)[0]
        out = out.index_copy(0, rows, x[rows] * (e + 1)) if e % 2 else out.index_put((rows,), x[rows] - e)
        if read_between and e == 1:
            seen = out * 1
    return out if seen is None else (out, seen)


def test_functional_row_writes_into_fresh_zeros_become_mask_writes():
    x, ids = torch.randn(T, d), torch.randint(0, E, (T,))
    gm = traced(_functional_writes, x, ids)
    assert "functional_row_writes_to_mask_writes" in rules(canonicalize(gm))
    assert "index_copy" not in ops(gm) and "index_put" not in ops(gm), ops(gm)
    same_value(gm, _functional_writes, x, ids)


def test_functional_row_writes_read_between_stay():
    x, ids = torch.randn(T, d), torch.randint(0, E, (T,))
    fn = lambda x, ids: _functional_writes(x, ids, read_between=True)  # noqa: E731
    gm = traced(fn, x, ids)
    canonicalize(gm)
    assert "index_copy" in ops(gm), ops(gm)  # the links after the read stay functional
    same_value(gm, fn, x, ids)


def _scattered_one_hot(scores, spelling):
    ids = scores.argmax(-1)
    if spelling == "unsqueeze":
        return torch.zeros(scores.shape[0], E, dtype=torch.int64).scatter_(1, ids.unsqueeze(-1), 1)
    if spelling == "none_float":
        z = torch.zeros_like(scores)
        z.scatter_(-1, ids[:, None], 1)
        return z * 2
    if spelling == "keepdim":  # fairseq's one_hot of [T, 1] indices
        return torch.zeros(scores.shape[0], E, dtype=torch.int64).scatter_(1, scores.argmax(1, keepdim=True), 1)
    return scores.new_zeros(scores.shape[0], E).scatter_(1, ids.view(-1, 1), 1.0)


@pytest.mark.parametrize("spelling", ["unsqueeze", "none_float", "view", "keepdim"])
def test_ones_scattered_at_the_argmax_into_zeros_are_a_one_hot(spelling):
    scores = torch.randn(T, E)
    fn = lambda s: _scattered_one_hot(s, spelling)  # noqa: E731
    gm = traced(fn, scores)
    assert "scattered_ones_to_one_hot" in rules(canonicalize(gm))
    assert "scatter_" not in ops(gm) and "one_hot" in ops(gm), ops(gm)
    same_value(gm, fn, scores)


def _ones_at_given_ids(scores, ids):  # ids not a top-k's: maybe out of range
    return torch.zeros(scores.shape[0], E).scatter_(1, ids.unsqueeze(-1), 1)


def _twos_at_the_argmax(scores, ids):
    return torch.zeros(scores.shape[0], E).scatter_(1, scores.argmax(-1, keepdim=True), 2)


def _read_before_the_ones(scores, ids):
    z = torch.zeros(scores.shape[0], E)
    before = z.sum()
    z.scatter_(1, scores.argmax(-1).unsqueeze(-1), 1)
    return z, before


@pytest.mark.parametrize("fn", [_ones_at_given_ids, _twos_at_the_argmax, _read_before_the_ones])
def test_other_scatters_stay(fn):
    scores, ids = torch.randn(T, E), torch.randint(0, E, (T,))
    gm = traced(fn, scores, ids)
    assert "scattered_ones_to_one_hot" not in rules(canonicalize(gm))
    same_value(gm, fn, scores, ids)


def test_the_ids_of_two_kept_maxes_concatenated_are_the_top2_ids():
    """PhiMoE's ids: once both maxes are slices of one top-k, their concatenation is its indices."""
    logits = torch.randn(T, E)
    gm = traced(_sparsemixer_ids, logits)
    applied = rules(canonicalize(gm))
    assert "second_max_to_topk" in applied and "slices_cat_to_whole" in applied, applied
    assert "cat" not in ops(gm), ops(gm)
    same_value(gm, _sparsemixer_ids, logits)


def _slices_with_a_gap(t):
    return torch.cat((t[..., 0:1], t[..., 2:3]), dim=-1)


def _slices_short_of_the_end(t):
    return torch.cat((t[:, 0:1], t[:, 1:2]), dim=1)


def _slices_out_of_order(t):
    return torch.cat((t[..., 1:3], t[..., 0:1], t[..., 3:]), dim=-1)


def _slices_of_two_tensors(t):
    return torch.cat((t[..., 0:2], (t * 2)[..., 2:]), dim=-1)


def _slices_along_another_dim(t):
    return torch.cat((t[0:5], t[5:]), dim=-1)


def test_slices_put_back_whole_are_the_tensor():
    t = torch.randn(T, 4)
    fn = lambda t: torch.cat((t[..., 0:1], t[:, 1:3], t[..., 3:4]), dim=-1) * 2  # noqa: E731
    gm = traced(fn, t)
    assert "slices_cat_to_whole" in rules(canonicalize(gm)) and "cat" not in ops(gm), ops(gm)
    same_value(gm, fn, t)


@pytest.mark.parametrize("fn", [_slices_with_a_gap, _slices_short_of_the_end, _slices_out_of_order, _slices_of_two_tensors,
                                _slices_along_another_dim])
def test_other_concatenated_slices_stay(fn):
    gm = traced(fn, torch.randn(T, 4))
    assert "slices_cat_to_whole" not in rules(canonicalize(gm)) and "cat" in ops(gm), ops(gm)


@pytest.mark.parametrize("fn", [
    lambda x: x.view(T, 1, d).repeat(1, 3, 1).reshape(-1, d),
    lambda x: x.unsqueeze(1).expand(-1, 3, -1).reshape(T * 3, d),
    lambda x: x[:, None].repeat(1, 3, 1).view(-1, d),
    lambda x: x.reshape(T, -1, d).expand(T, 3, d).reshape(-1, d),
], ids=["view-repeat-reshape", "unsqueeze-expand", "none-repeat-view", "reshape-expand"])
def test_each_token_tiled_for_its_slots_is_a_repeat_interleave(fn):
    x = torch.randn(T, d)
    gm = traced(lambda x: fn(x) * 2, x)
    assert "tiled_rows_to_repeat" in rules(canonicalize(gm)) and "repeat_interleave" in ops(gm), ops(gm)
    same_value(gm, lambda x: fn(x) * 2, x)


@pytest.mark.parametrize("fn", [
    lambda x: x.view(1, T, d).repeat(3, 1, 1).reshape(-1, d),  # the whole x three times: tiled
    lambda x: x.view(T, 1, d).repeat(1, 3, 2).reshape(-1, 2 * d),  # copies along d too
    lambda x: x.view(T, 1, d).repeat(1, 3, 1).transpose(0, 1).reshape(-1, d),  # slot-major
    lambda x: x.view(T, 1, d).repeat(1, 3, 1).reshape(T, 3 * d),  # not one row per slot
], ids=["tiled", "along-d", "slot-major", "rows-per-token"])
def test_other_copies_of_the_tokens_stay(fn):
    gm = traced(lambda x: fn(x) * 2, torch.randn(T, d))
    assert "tiled_rows_to_repeat" not in rules(canonicalize(gm)), ops(gm)
