"""Canonical forms of layout (`patterns.canonical_layout`): transposes taken twice or moved past
elementwise code, and rows tiled by an arange, become the form transformers v5's Llama 4 writes;
the value never changes, and a spelling outside a rule's condition is left as written."""
from __future__ import annotations

import pytest
import torch

from moe_compiler.patterns.canonical import canonicalize

from .test_canonical import ops, same_value, traced

T, d, E = 6, 4, 3


def rules(applied: list[str]) -> list[str]:
    return [line.split(":")[0] for line in applied]


def twice_transposed(logits):
    scores = logits.transpose(0, 1)
    return torch.sigmoid(scores.t().float()) + scores.transpose(1, 0).sum()


def test_a_transpose_taken_twice_becomes_its_base():
    logits = torch.randn(T, E)
    gm = traced(twice_transposed, logits)
    assert "transpose_pair_to_base" in rules(canonicalize(gm))
    assert ops(gm).count("transpose") + ops(gm).count("t") == 0, ops(gm)
    same_value(gm, twice_transposed, logits)


def sigmoid_of_transposed(x, w):
    scores = (x @ w).t()  # [E, T], computed by the graph
    gates = torch.sigmoid(scores.float()).to(x.dtype)
    return gates.reshape(-1, 1), w.t().float()


def test_elementwise_code_of_a_transpose_runs_before_it():
    x, w = torch.randn(T, d), torch.randn(d, E)
    gm = traced(sigmoid_of_transposed, x, w)
    applied = rules(canonicalize(gm))
    assert applied.count("elementwise_of_transpose_to_transpose") == 3, applied  # float, sigmoid, to
    order = ops(gm)
    assert order.index("sigmoid") < order.index("transpose") < order.index("reshape"), order
    # the weight w is an input: its transpose stays where it is, before its cast
    assert order[-2:] == ["t", "float"], order
    gm.recompile()
    got, want = gm(*gm.example_inputs), sigmoid_of_transposed(x, w)
    for g, v in zip(got, want):
        torch.testing.assert_close(g, v)
        assert g.stride() == v.stride()


def tiled_arange(spelling, n, copies):
    """arange(n) `copies` times: tiled ([copies, n], flat row r is r mod n) or interleaved ([n, copies],
    flat row r is r // copies)."""
    index = torch.arange(n).view(1, -1)
    if spelling == "expand":
        return index.expand(copies, -1)
    if spelling == "repeat":
        return index.repeat(copies, 1)
    if spelling == "flat_repeat":
        return torch.arange(n).repeat(copies).view(copies, n)
    if spelling == "interleave":
        return torch.arange(n).repeat_interleave(copies).view(n, copies)
    if spelling == "column_expand":
        return torch.arange(n)[:, None].expand(-1, copies)
    return torch.arange(n).unsqueeze(1).repeat(1, copies)  # column_repeat


TILES = ["expand", "repeat", "flat_repeat", "interleave", "column_expand", "column_repeat"]


@pytest.mark.parametrize("rows", ["gather", "getitem", "index_select"])
@pytest.mark.parametrize("tile", TILES)
def test_rows_read_by_a_tiled_arange_become_a_repeat(rows, tile):
    def fn(x):
        index = tiled_arange(tile, x.shape[0], E)
        if rows == "gather":
            return torch.gather(x, 0, index.reshape(-1, 1).expand(-1, x.shape[1])) * 2
        flat = index.reshape(-1)
        return (x[flat] if rows == "getitem" else x.index_select(0, flat)) * 2

    x = torch.randn(T, d)
    gm = traced(fn, x)
    assert "copied_rows_to_repeat" in rules(canonicalize(gm))
    copy = "repeat" if tile in ("expand", "repeat", "flat_repeat") else "repeat_interleave"
    assert copy in ops(gm) and not {"gather", "index_select", "getitem"} & set(ops(gm)), ops(gm)
    same_value(gm, fn, x)


@pytest.mark.parametrize("tile", ["expand", "interleave"])
@pytest.mark.parametrize("combine", ["scatter_add_", "scatter_add", "index_add_", "index_add"])
def test_rows_added_back_by_a_tiled_arange_become_a_sum_over_the_copies(combine, tile):
    def fn(base, v):
        index = tiled_arange(tile, base.shape[0], E)
        out = base * 1
        if combine.startswith("scatter_add"):
            wide = index.reshape(-1, 1).expand(-1, base.shape[1])
            return getattr(out, combine)(0, wide, v) if combine == "scatter_add" else out.scatter_add_(0, wide, v) * 1
        flat = index.reshape(-1)
        return out.index_add(0, flat, v) if combine == "index_add" else out.index_add_(0, flat, v) * 1

    base, v = torch.randn(T, d), torch.randn(E * T, d)
    gm = traced(fn, base, v)
    assert "copies_added_back_to_sum" in rules(canonicalize(gm))
    assert not {"scatter_add", "scatter_add_", "index_add", "index_add_"} & set(ops(gm)), ops(gm)
    assert "sum" in ops(gm)
    same_value(gm, fn, base, v)


def rows_of_other_tokens(x):  # arange(T - 1) tiled over T rows: x's last row never read, not a repeat
    index = torch.arange(x.shape[0] - 1).view(1, -1).expand(E, -1)
    return torch.gather(x, 0, index.reshape(-1, 1).expand(-1, x.shape[1]))


def shifted_rows(x):  # arange(1, T + 1) - 1 starts at 0 too, but is not spelled as a plain arange
    index = torch.roll(torch.arange(x.shape[0]), 1).view(1, -1).expand(E, -1)
    return x[index.reshape(-1)]


def rows_by_counts(x):  # each token's row repeated by a tensor of counts: not a fixed K copies
    counts = torch.arange(x.shape[0]) % 3
    return x[torch.arange(x.shape[0]).repeat_interleave(counts)]


def columns_by_tiled_arange(x):  # gather along dim 1
    index = torch.arange(x.shape[1]).view(1, -1).expand(E, -1)
    return torch.gather(x, 1, index.reshape(1, -1).expand(x.shape[0], -1))


def added_into_other_rows(base, v):  # index_add of E*T rows into a base of T + 1 rows
    index = torch.arange(base.shape[0] - 1).view(1, -1).expand(E, -1)
    return base.index_add(0, index.reshape(-1), v)


@pytest.mark.parametrize("fn,shapes", [
    (rows_of_other_tokens, [(T, d)]),
    (shifted_rows, [(T, d)]),
    (rows_by_counts, [(T, d)]),
    (columns_by_tiled_arange, [(T, d)]),
    (added_into_other_rows, [(T + 1, d), (E * T, d)]),
])
def test_other_tiled_reads_and_adds_stay(fn, shapes):
    args = [torch.randn(s) for s in shapes]
    gm = traced(fn, *args)
    applied = rules(canonicalize(gm))
    assert not {"copied_rows_to_repeat", "copies_added_back_to_sum"} & set(applied), applied
    same_value(gm, fn, *args)


# --- token-major products: an einsum laid out [T, E, .], then transposes moved and collapsed ----


def token_major(x, w1, w2, b):
    h = torch.einsum("td,edf->tef", x, w1)  # [T, E, f]: a bmm over E, transposed
    g, u = h.chunk(2, dim=-1)
    a = torch.nn.functional.silu(g) * (u + b)  # b [E, f // 2]: broadcast over the tokens
    return torch.einsum("tef,efd->ted", a * 0.5, w2)  # [T, E, d]


def test_a_token_major_chain_is_computed_expert_major():
    f = 6
    x, w1, w2, b = torch.randn(T, d), torch.randn(E, d, 2 * f), torch.randn(E, f, d), torch.randn(E, f)

    def fn(x, w1, w2, b):
        return token_major(x, w1, w2, b).sum(1)  # a reduction reads the values, not their strides

    gm = traced(fn, x, w1, w2, b)
    applied = rules(canonicalize(gm))
    assert applied.count("einsum_to_bmm") == 2, applied
    order = ops(gm)
    # one transpose left, at the end: chunk, silu, the bias add, the products all run on [E, T, .]
    assert order.count("bmm") == 2 and order.count("transpose") == 1, order
    assert order.index("transpose") > max(i for i, o in enumerate(order) if o == "bmm"), order
    assert "unsqueeze" in order  # b read as b.unsqueeze(1), [E, 1, f]
    same_value(gm, fn, x, w1, w2, b)


def test_a_token_major_einsum_read_by_a_view_stays():
    # the einsum's [T, E, f] output is contiguous; a bmm's transpose is not, and .view needs its strides
    x, w = torch.randn(T, d), torch.randn(E, d, 5)

    def fn(x, w):
        return torch.relu(torch.einsum("td,edf->tef", x, w)).view(T, -1)

    gm = traced(fn, x, w)
    assert "einsum_to_bmm" not in rules(canonicalize(gm))
    assert ops(gm).count("einsum") == 1
    same_value(gm, fn, x, w)


@pytest.mark.parametrize("other", ["same_swap", "scalar", "row", "stacked_rows"])
def test_binary_code_of_a_transposed_3d_value_runs_before_it(other):
    a_in, c_in = torch.randn(E, T, d), torch.randn(E, T, d)
    extra = {"same_swap": c_in, "scalar": 2.0, "row": torch.randn(d), "stacked_rows": torch.randn(E, d)}[other]

    def fn(a, c):
        v = (a * 2).transpose(0, 1)  # computed [T, E, d]
        o = c.transpose(0, 1) if other == "same_swap" else extra
        return ((v + o) * v).sum(1)

    gm = traced(fn, a_in, c_in)
    applied = rules(canonicalize(gm))
    assert applied.count("elementwise_of_transpose_to_transpose") == 2, applied
    same_value(gm, fn, a_in, c_in)


def test_binary_code_that_would_change_the_layout_stays():
    # v [T, E, d] transposed times a [T, E, 1] tensor: its own layout is no transpose of a's, so the
    # product is left as written
    a_in, g = torch.randn(E, T, d), torch.randn(T, E, 1)

    def fn(a, g):
        return ((a * 2).transpose(0, 1) * g).sum(1)

    gm = traced(fn, a_in, g)
    assert "elementwise_of_transpose_to_transpose" not in rules(canonicalize(gm))
    same_value(gm, fn, a_in, g)
