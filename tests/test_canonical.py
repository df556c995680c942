"""Canonical forms (`patterns.canonical`): two spellings of one computation become one graph, the
value never changes, and a spelling outside a rule's condition is left as written."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from moe_compiler.options import SonicOptions
from moe_compiler.passes import run_passes
from moe_compiler.patterns.canonical import canonicalize
from moe_compiler.patterns.common import op_name

T, d, E, K = 10, 8, 4, 2
FLAG = "capture_dynamic_output_shape_ops"


def traced(fn, *args) -> fx.GraphModule:
    graphs = []

    def capture(gm, example_inputs):
        gm.example_inputs = list(example_inputs)  # the real arguments, in the graph's order
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    with torch._dynamo.config.patch(**{FLAG: True}):
        torch.compile(fn, backend=capture, fullgraph=True)(*args)
    (gm,) = graphs
    return gm


def ops(gm: fx.GraphModule) -> list[str]:
    """The graph as a sequence of what each call does (names of values dropped)."""
    return [node.target if node.op == "call_method" else op_name(node.target)
            for node in gm.graph.nodes if node.op in ("call_function", "call_method")]


def same_value(gm: fx.GraphModule, fn, *args):
    before = fn(*args)
    gm.recompile()
    after = gm(*gm.example_inputs)
    after = after[0] if isinstance(after, (tuple, list)) and not isinstance(before, (tuple, list)) else after
    torch.testing.assert_close(after, before)


def _rows_by_mask(masks, x, w):
    out = torch.zeros_like(x)
    for e, mask in enumerate(masks):
        tok, k = torch.where(mask)
        out[tok] += w[tok, k, None] * x[tok] * (e + 1)
    return out


def arange_masks(x, scores):
    w, ids = torch.topk(scores, K)
    masks = (ids.unsqueeze(-1) == torch.arange(E)).permute(2, 0, 1)
    return _rows_by_mask(masks, x, w)


def one_hot_masks(x, scores):
    w, ids = torch.topk(scores, K)
    masks = F.one_hot(ids, E).permute(2, 0, 1)
    return _rows_by_mask(masks, x, w)


def test_a_mask_compared_against_arange_becomes_one_hot():
    args = (torch.randn(T, d), torch.randn(T, E))
    arange_form, one_hot_form = traced(arange_masks, *args), traced(one_hot_masks, *args)
    assert ops(arange_form) != ops(one_hot_form)
    applied = canonicalize(arange_form)
    assert [line.split(":")[0] for line in applied] == ["arange_mask_to_one_hot"]
    assert canonicalize(one_hot_form) == []
    assert ops(arange_form) == ops(one_hot_form)
    same_value(arange_form, arange_masks, *args)


def test_a_mask_read_as_booleans_stays():
    """`x[mask]` reads a boolean mask as booleans: one_hot's 0/1 integers would index rows 0 and 1."""
    def boolean_read(x, scores):
        _, ids = torch.topk(scores, K)
        masks = (ids.unsqueeze(-1) == torch.arange(E)).permute(2, 0, 1)
        return x[masks[0].any(-1)].sum(0)

    gm = traced(boolean_read, torch.randn(T, d), torch.randn(T, E))
    assert canonicalize(gm) == []


def test_ids_of_unknown_range_stay():
    """one_hot raises on an id outside [0, E) where the comparison gives False: only top-k ids qualify."""
    def given_ids(x, ids):
        masks = (ids.unsqueeze(-1) == torch.arange(E)).permute(2, 0, 1)
        return _rows_by_mask(masks, x, torch.ones(T, K))

    gm = traced(given_ids, torch.randn(T, d), torch.randint(0, E, (T, K)))
    assert canonicalize(gm) == []


def cast_cumsum(counts):
    return counts.cumsum(0).to(torch.int32)


def dtype_cumsum(counts):
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def test_a_cast_cumsum_becomes_an_int32_cumsum():
    counts = torch.bincount(torch.randint(0, E, (T * K,)), minlength=E)
    cast_form, dtype_form = traced(cast_cumsum, counts), traced(dtype_cumsum, counts)
    assert ops(cast_form) != ops(dtype_form)
    assert len(canonicalize(cast_form)) == 1 and canonicalize(dtype_form) == []
    assert ops(cast_form) == ops(dtype_form)
    same_value(cast_form, cast_cumsum, counts)


def test_float_counts_become_an_int32_cumsum_only_when_exact():
    def histc_offsets(ids):
        return torch.histc(ids.view(-1).float(), bins=E, min=0, max=E).cumsum(0).to(torch.int32)

    ids = torch.randint(0, E, (T, K))
    small = traced(histc_offsets, ids)
    assert len(canonicalize(small)) == 1
    same_value(small, histc_offsets, ids)

    def float_counts(counts):  # not a histogram: fractional values would sum differently
        return counts.cumsum(0).to(torch.int32)

    assert canonicalize(traced(float_counts, torch.rand(E) * 3)) == []


def test_duplicate_casts_and_row_reads_merge():
    def twice(x, tok):
        return x.bfloat16() @ x.bfloat16().t() + x[tok].sum() * x[tok].mean()

    args = (torch.randn(T, d), torch.tensor([1, 3, 3]))
    gm = traced(twice, *args)
    assert ops(gm).count("bfloat16") == 2 and ops(gm).count("getitem") == 2
    assert len(canonicalize(gm)) == 2
    assert ops(gm).count("bfloat16") == 1 and ops(gm).count("getitem") == 1
    same_value(gm, twice, *args)


def test_duplicates_under_two_grad_modes_stay_two():
    def twice(x):
        with torch.no_grad():
            a = x.float() * 2
        return a + x.float()

    gm = traced(twice, torch.randn(T, d, dtype=torch.float64, requires_grad=True))
    canonicalize(gm)
    assert ops(gm).count("float") == 2, ops(gm)


def test_a_write_between_duplicates_keeps_both():
    def written(x, tok):
        a = x[tok]
        x.mul_(2)
        b = x[tok]
        c = x.float()
        c.add_(1)
        return (a + b).sum() + (x.float() + c).sum()

    gm = traced(written, torch.randn(T, d), torch.tensor([0, 2]))
    assert canonicalize(gm) == []


def test_the_driver_leaves_a_graph_without_moe_as_traced():
    gm = traced(arange_masks, torch.randn(T, d), torch.randn(T, E))
    before = gm.code
    run_passes(gm, SonicOptions(compiler="eager", fallback=False))
    assert gm.code == before
    assert operator.eq in [node.target for node in gm.graph.nodes]


class _SwiGLUExperts(torch.nn.Module):
    """A router over E SwiGLU experts (`up` holds gate and up), written out by each subclass as `spelling` says."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.gate = torch.nn.Linear(d, E, bias=False)
        self.up = torch.nn.ModuleList(torch.nn.Linear(d, 2 * d, bias=False) for _ in range(E))
        self.down = torch.nn.ModuleList(torch.nn.Linear(d, d, bias=False) for _ in range(E))


def _rewritten_and_equal(model, x, *, flags=None) -> list:
    """`model` compiled with backend="sonic" (aot_eager): its rewritten regions, after checking its
    output and gradients (x's, every parameter's) against eager."""
    import moe_compiler

    cotangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    params = dict(model.named_parameters())

    def out_and_grads(fn):
        xg = x.clone().requires_grad_()
        out = fn(xg)
        return [out, *torch.autograd.grad((out * cotangent).sum(), [xg, *params.values()])]

    compiled = torch.compile(model, backend="sonic", options={"sonic.compiler": "aot_eager", "sonic.fallback": False})
    with torch._dynamo.config.patch(**(flags or {})), moe_compiler.capture() as report:
        got = out_and_grads(compiled)
    assert not report.rejected, str(report)
    for g, want in zip(got, out_and_grads(model)):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
    return report.rewritten


class MaskWeighted(_SwiGLUExperts):
    """Every expert on every token, a token's weight of expert e as `(w * (ids == e)).sum(-1)`."""

    def forward(self, x):
        w, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        if self.spelling == "column":
            gates = (F.one_hot(ids, E) * w.unsqueeze(-1)).sum(1)
        out = torch.zeros_like(x)
        for e in range(E):
            g, u = self.up[e](x).chunk(2, dim=-1)
            y = self.down[e](F.silu(g) * u)
            if self.spelling == "mask":
                out = out + (w * (ids == e)).sum(-1)[:, None] * y
            else:
                out = out + gates[:, e, None] * y
        return out


def test_a_weight_by_mask_becomes_a_gate_column():
    torch.manual_seed(0)
    mask_form, column_form = MaskWeighted("mask"), MaskWeighted("column")
    column_form.load_state_dict(mask_form.state_dict())
    x = torch.randn(T, d)
    masked, columns = traced(mask_form, x), traced(column_form, x)
    applied = [line.split(":")[0] for line in canonicalize(masked)]
    assert applied.count("masked_weight_to_gate_column") == E and applied.count("column_then_none_to_one_index") == E
    assert [line.split(":")[0] for line in canonicalize(columns)] == ["zeros_plus_value_to_value"]
    assert sorted(ops(masked)) == sorted(ops(columns))
    masked.recompile()
    torch.testing.assert_close(masked(*masked.example_inputs)[0], mask_form(x), rtol=0, atol=0)


def test_a_weight_by_mask_over_selected_rows_becomes_the_rows_of_a_gate_column():
    def weights(scores, spelling):
        w, ids = torch.topk(scores, K)
        tok = torch.where((ids == 1).any(-1))[0]
        if spelling == "rows-first":
            return (w[tok] * (ids[tok] == 1)).sum(-1, keepdim=True)
        return (w * (ids == 1)).sum(-1)[tok, None]

    scores = torch.rand(T, E)
    rows_first = traced(lambda s: weights(s, "rows-first"), scores)
    whole = traced(lambda s: weights(s, "whole"), scores)
    canonicalize(rows_first), canonicalize(whole)
    assert sorted(ops(rows_first)) == sorted(ops(whole))
    same_value(rows_first, lambda s: weights(s, "rows-first"), scores)


def test_a_mask_weight_of_ids_outside_a_top_k_stays():
    def weights(w, ids):
        return (w * (ids == 1)).sum(-1)

    assert canonicalize(traced(weights, torch.rand(T, K), torch.randint(0, E, (T, K)))) == []


def test_a_weight_by_mask_layer_is_rewritten_and_equal_to_eager():
    torch.manual_seed(0)
    model, x = MaskWeighted("mask"), torch.randn(T, d)
    assert [r.idiom for r in _rewritten_and_equal(model, x)] == ["dense_experts"]
    compiled = torch.compile(model, backend="sonic", options={"sonic.compiler": "aot_eager", "sonic.fallback": False})
    with torch.no_grad():
        from .helpers import profiled_op_names

        assert "sonic::moe_experts_list" in profiled_op_names(lambda: compiled(x))


class ScatteredCombine(_SwiGLUExperts):
    """Each expert's rows (torch.where of any hit) weighted by rows of a combine matrix of the top-k
    weights scattered into zeros (ST-MoE's spelling); `spelling` says how the column is read:
    "index_select" (`G[:, e].index_select(0, tok)`), "slice" (`G[:, e:e+1][tok]`), "getitem"
    (`G[:, e][tok]`), or "other_ids" (the combine scattered at the ids of a second top-k: never
    rewritten as the weights of the first)."""

    def forward(self, x):
        probs = self.gate(x).softmax(-1)
        w, ids = torch.topk(probs, K, dim=-1)
        at = torch.topk(probs * torch.arange(1, E + 1), K, dim=-1).indices if self.spelling == "other_ids" else ids
        combine = torch.zeros_like(probs).scatter_add(1, at, w)
        out = torch.zeros_like(x)
        for e in range(E):
            tok = torch.where((ids == e).any(-1))[0]
            g, u = self.up[e](x[tok]).chunk(2, dim=-1)
            y = self.down[e](F.silu(g) * u)
            if self.spelling == "index_select":
                scale = combine[:, e].index_select(0, tok).unsqueeze(1)
            elif self.spelling == "slice":
                scale = combine[:, e:e + 1][tok]
            else:
                scale = combine[:, e][tok].unsqueeze(-1)
            out.index_add_(0, tok, y * scale)
        return out


@pytest.mark.parametrize("spelling", ["index_select", "slice", "getitem"])
def test_rows_of_a_scattered_combine_matrix_are_the_top_k_weights(spelling):
    torch.manual_seed(0)
    regions = _rewritten_and_equal(ScatteredCombine(spelling), torch.randn(T, d), flags={FLAG: True})
    assert [r.idiom for r in regions] == ["expert_loop"]


def test_a_combine_matrix_scattered_at_other_ids_stays():
    torch.manual_seed(0)
    model, x = ScatteredCombine("other_ids"), torch.randn(T, d)
    gm = traced(model, x)
    applied = canonicalize(gm)
    assert not any(line.startswith("gate_column_rows_to_weights") for line in applied), applied
    same_value(gm, model, x)


class TopOne(_SwiGLUExperts):
    """A top-1 layer over its experts' rows; `spelling` says how the router's max is read: without
    keepdim ("plain"), or kept as a [T, 1] column then squeezed, selected (`[:, 0]`), read by rows, or
    read by rows and compared as a column ("column": `torch.where(expert == e)[0]` on [T, 1] ids)."""

    def forward(self, x):
        probs = self.gate(x).softmax(dim=1)
        if self.spelling == "plain":
            top, expert = torch.max(probs, dim=1)
        else:
            top, expert = torch.max(probs, dim=1, keepdim=True)
            if self.spelling == "squeeze":
                top, expert = top.squeeze(1), expert.squeeze(-1)
            elif self.spelling == "select":
                top, expert = top[:, 0], expert[:, 0]
        if self.spelling == "rows":
            expert = expert.squeeze(1)
        by_rows = self.spelling in ("rows", "column")
        out = torch.zeros_like(x)
        for e in range(E):
            rows = torch.where(expert == e)[0]
            g, u = self.up[e](x[rows]).chunk(2, dim=-1)
            scale = top[rows] if by_rows else top[rows, None]
            out[rows] = self.down[e](F.silu(g) * u) * scale
        return out


@pytest.mark.parametrize("spelling", ["squeeze", "select", "rows", "column"])
def test_a_top_one_kept_as_a_column_becomes_the_plain_top_one(spelling):
    torch.manual_seed(0)
    kept, plain = TopOne(spelling), TopOne("plain")
    plain.load_state_dict(kept.state_dict())
    x = torch.randn(T, d)
    kept_graph, plain_graph = traced(kept, x), traced(plain, x)
    applied = [line.split(":")[0] for line in canonicalize(kept_graph)]
    assert applied.count("keepdim_reduction_to_plain") == 1, applied
    canonicalize(plain_graph)
    assert sorted(ops(kept_graph)) == sorted(ops(plain_graph))
    kept_graph.recompile()
    torch.testing.assert_close(kept_graph(*kept_graph.example_inputs)[0], kept(x), rtol=0, atol=0)


def test_a_kept_column_read_otherwise_stays():
    def scaled(probs, x):
        top, expert = probs.max(-1, keepdim=True)
        return x * top, expert.squeeze(-1)  # the column broadcast over x's rows keeps its dim

    gm = traced(scaled, torch.rand(T, E), torch.randn(T, d))
    assert not any(line.startswith("keepdim_reduction_to_plain") for line in canonicalize(gm))

    def both_columns(probs):  # torch.where over the [T, 1] column, its column index read too
        _, expert = probs.max(-1, keepdim=True)
        rows, cols = torch.where(expert == 1)
        return rows + cols

    gm = traced(both_columns, torch.rand(T, E))
    assert not any(line.startswith("keepdim_reduction_to_plain") for line in canonicalize(gm))


@pytest.mark.parametrize("spelling", ["squeeze", "rows", "column"])
def test_a_top_one_kept_as_a_column_is_rewritten_and_equal_to_eager(spelling):
    torch.manual_seed(0)
    assert len(_rewritten_and_equal(TopOne(spelling), torch.randn(T, d), flags={FLAG: True})) == 1


def test_a_sum_started_from_zeros_starts_from_its_first_term():
    def from_zeros(x, y):
        out = torch.zeros_like(x)
        out = out + x * 2
        return out + y

    def direct(x, y):
        return x * 2 + y

    args = (torch.randn(T, d), torch.randn(T, d))
    gm = traced(from_zeros, *args)
    assert len(canonicalize(gm)) == 1 and ops(gm) == ops(traced(direct, *args))
    same_value(gm, from_zeros, *args)

    def read_twice(x):
        z = torch.zeros_like(x)
        return (z + x) * z.sum()

    assert canonicalize(traced(read_twice, torch.randn(T, d))) == []


def test_an_argsort_becomes_a_sort_permutation():
    def by_argsort(v):
        return torch.argsort(v, stable=True)

    def by_sort(v):
        return torch.sort(v, stable=True)[1]

    v = torch.randint(0, E, (T * K,))
    a, b = traced(by_argsort, v), traced(by_sort, v)
    assert len(canonicalize(a)) == 1 and canonicalize(b) == [] and ops(a) == ops(b)
    same_value(a, by_argsort, v)


def test_a_histogram_counts_the_sorted_values_when_there_are_some():
    def unsorted_count(v):
        values, perm = torch.sort(v)
        return torch.histc(v.float(), bins=E, min=0, max=E - 1), perm, values

    def sorted_count(v):
        values, perm = torch.sort(v)
        return torch.histc(values.float(), bins=E, min=0, max=E - 1), perm, values

    v = torch.randint(0, E, (T * K,))
    a, b = traced(unsorted_count, v), traced(sorted_count, v)
    assert len(canonicalize(a)) == 1 and canonicalize(b) == [] and ops(a) == ops(b)
    a.recompile()
    torch.testing.assert_close(a(*a.example_inputs)[0], unsorted_count(v)[0])


def scatter_unsort(y, v):
    perm = torch.sort(v)[1]
    out = torch.empty_like(y)
    out[perm] = y
    return out.view(T, K, d).sum(1)


def gather_unsort(y, v):
    perm = torch.sort(v)[1]
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(T * K)
    return y[inv].view(T, K, d).sum(1)


def scatter_unsort_into_zeros(y, v):
    perm = torch.sort(v)[1]
    out = torch.zeros_like(y)
    out[perm] = y
    return out.view(T, K, d).sum(1)


@pytest.mark.parametrize("spelling", [scatter_unsort, scatter_unsort_into_zeros])
def test_rows_unsorted_by_scatter_are_unsorted_by_the_inverse_permutation(spelling):
    y, v = torch.randn(T * K, d), torch.randint(0, E, (T * K,))
    a, b = traced(spelling, y, v), traced(gather_unsort, y, v)
    assert len(canonicalize(a)) == 1 and canonicalize(b) == []
    assert sorted(ops(a)) == sorted(ops(b))
    same_value(a, spelling, y, v)


def test_a_partial_scatter_stays():
    """Rows scattered by something that is not a sort's permutation may leave rows unwritten."""
    def partial(y, idx):
        out = torch.zeros_like(y)
        out[idx] = y[: idx.shape[0]]
        return out

    assert canonicalize(traced(partial, torch.randn(T * K, d), torch.tensor([0, 3, 5]))) == []


def grouped_mm_written_out(x, wr, w1, w2):
    """transformers' grouped_mm experts as many people write them: argsort, a histogram of the
    unsorted ids, a cast cumsum, and rows un-sorted by a scatter."""
    w, ids = torch.topk(torch.softmax(x @ wr.t(), -1, dtype=torch.float32), K)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    flat = ids.reshape(-1)
    perm = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.histc(flat.float(), bins=E, min=0, max=E - 1), 0).to(torch.int32)
    g, u = torch._grouped_mm(x[perm // K], w1.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, w2.transpose(1, 2), offs=offs) * w.reshape(-1)[perm].unsqueeze(-1)
    out = torch.empty_like(y)
    out[perm] = y
    return out.view(x.shape[0], K, -1).sum(1)


def test_grouped_mm_written_out_is_rewritten_and_close_to_eager():
    """torch._grouped_mm takes bf16 only on the CPU: the output is as close to float32 as eager's."""
    import moe_compiler
    from moe_compiler.testing import closeness

    g = torch.Generator().manual_seed(0)
    n = 16
    args32 = (torch.randn(T, d, generator=g), torch.randn(E, d, generator=g) * 0.3,
              torch.randn(E, 2 * n, d, generator=g) * 0.3, torch.randn(E, d, n, generator=g) * 0.3)
    args = [a.bfloat16() for a in args32]
    compiled = torch.compile(grouped_mm_written_out, backend="sonic",
                             options={"sonic.compiler": "aot_eager", "sonic.fallback": False})
    with moe_compiler.capture() as report:
        got = compiled(*args)
    assert [r.idiom for r in report.rewritten] == ["hf_grouped_mm"] and not report.rejected, str(report)
    truth = grouped_mm_written_out(*[a.float() for a in args])
    ok, why = closeness(got.float(), grouped_mm_written_out(*args).float(), truth, torch.bfloat16)
    assert ok, why


def test_a_weighted_bincount_keeps_counting_the_unsorted_ids():
    """bincount's weights pair with the ids in their own order: counting the sorted ids instead
    would pair each weight with another id."""
    def weighted(v, weights):
        values, perm = torch.sort(v)
        return torch.bincount(v, weights, minlength=E), perm, values

    assert canonicalize(traced(weighted, torch.randint(0, E, (T * K,)), torch.rand(T * K))) == []


n = 6


@pytest.mark.parametrize("equation,shapes,bmm_form", [
    # x [T, d] against every expert's [d, n] weight: x broadcast over the experts
    ("td,edn->etn", ((T, d), (E, d, n)), lambda x, w: torch.bmm(x.unsqueeze(0).expand(E, -1, -1), w)),
    # nn.Linear's orientation [E, out, in], rows already per expert, the operands in either order
    ("etn,edn->etd", ((E, T, n), (E, d, n)), lambda a, w: torch.bmm(a, w.transpose(1, 2))),
    ("edn,etn->etd", ((E, d, n), (E, T, n)), lambda w, a: torch.bmm(a, w.transpose(1, 2))),
    # the contracted letter first in the rows: a permute of the weight's dims
    ("dt,edn->etn", ((d, T), (E, d, n)), lambda x, w: torch.bmm(x.t().unsqueeze(0).expand(E, -1, -1), w)),
])
def test_an_einsum_batched_product_becomes_a_bmm(equation, shapes, bmm_form):
    args = tuple(torch.randn(s) for s in shapes)

    def einsum_form(a, b):
        return torch.einsum(equation, a, b)

    gm = traced(einsum_form, *args)
    assert len(canonicalize(gm)) == 1
    assert "einsum" not in ops(gm) and ops(gm).count("bmm") == 1
    same_value(gm, einsum_form, *args)
    torch.testing.assert_close(bmm_form(*args), einsum_form(*args))


@pytest.mark.parametrize("equation,values_shape,product_form", [
    ("te,etd->td", (E, T, d), lambda g, y: (y * g.t().unsqueeze(-1)).sum(0)),
    ("te,ted->td", (T, E, d), lambda g, y: (y * g.unsqueeze(-1)).sum(1)),
    ("et,etd->td", (E, T, d), lambda g, y: (y * g.unsqueeze(-1)).sum(0)),
])
def test_an_einsum_weighted_sum_becomes_a_product_summed(equation, values_shape, product_form):
    gates_shape = (E, T) if equation.startswith("et,") else (T, E)
    g, y = torch.randn(gates_shape), torch.randn(values_shape)

    def einsum_form(g, y):
        return torch.einsum(equation, g, y)

    einsum_gm, product_gm = traced(einsum_form, g, y), traced(product_form, g, y)
    assert len(canonicalize(einsum_gm)) == 1
    assert "einsum" not in ops(einsum_gm) and "sum" in ops(einsum_gm)
    same_value(einsum_gm, einsum_form, g, y)
    torch.testing.assert_close(product_form(g, y), einsum_form(g, y))
    assert canonicalize(product_gm) == []


@pytest.mark.parametrize("equation,shapes", [
    ("td,edn->tne", ((T, d), (E, d, n))),  # the batch letter not leading the output
    ("td,dn->tn", ((T, d), (d, n))),  # no batch: a plain matmul, left as written
    ("tdk,edk->etk", ((T, d, 3), (E, d, 3))),  # k in both operands and the output: not one batch letter
    ("td,td->t", ((T, d), (T, d))),  # a row-wise dot
])
def test_other_einsums_stay(equation, shapes):
    args = tuple(torch.randn(s) for s in shapes)

    def einsum_form(a, b):
        return torch.einsum(equation, a, b)

    gm = traced(einsum_form, *args)
    assert canonicalize(gm) == []
    assert ops(gm).count("einsum") == 1


@pytest.mark.parametrize("equation,shapes", [
    ("te,tm->etm", ((T, E), (T, d))),  # GShard's dispatch of each token to each expert
    ("ti,tj->tij", ((T, d), (T, n))),  # an outer product per row
    ("i,j->ji", ((d,), (n,))),
])
def test_an_einsum_that_contracts_nothing_becomes_a_broadcast_product(equation, shapes):
    args = tuple(torch.randn(s) for s in shapes)

    def einsum_form(a, b):
        return torch.einsum(equation, a, b)

    gm = traced(einsum_form, *args)
    assert [line.split(":")[0] for line in canonicalize(gm)] == ["einsum_outer_to_product"]
    assert "einsum" not in ops(gm) and "mul" in ops(gm)
    gm.recompile()
    torch.testing.assert_close(gm(*gm.example_inputs)[0], einsum_form(*args), rtol=0, atol=0)


def _split_loop(rows, counts, w1, w2, acts=None):
    """Each expert's block of sorted rows (split by the counts' values) through its own weights."""
    blocks = torch.split(rows, counts.tolist(), dim=0)
    acts = acts or [F.silu] * len(blocks)
    return torch.cat([acts[e](block @ w1[e].t()) @ w2[e].transpose(0, 1) for e, block in enumerate(blocks)], dim=0)


def _grouped(rows, counts, w1, w2):
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offs))
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)


def _split_loop_args(dtype=torch.bfloat16):
    counts = torch.tensor([3, 0, 5, 2])
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(int(counts.sum()), d, generator=g).to(dtype)
    return rows, counts, torch.randn(E, 16, d, generator=g).to(dtype), torch.randn(E, d, 16, generator=g).to(dtype)


def traced_with_scalars(fn, *args) -> fx.GraphModule:
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        return traced(fn, *args)


def test_a_loop_over_split_rows_becomes_grouped_products():
    args = _split_loop_args()
    loop, grouped = traced_with_scalars(_split_loop, *args), traced_with_scalars(_grouped, *args)
    applied = canonicalize(loop)
    assert any(line.startswith("split_loop_to_grouped_mm") for line in applied), applied
    assert "cat" not in ops(loop) and "split" not in ops(loop)
    assert ops(loop).count("_grouped_mm") == 2 == ops(grouped).count("_grouped_mm")
    same_value(loop, _split_loop, *args)
    torch.testing.assert_close(_grouped(*args), _split_loop(*args))


@pytest.mark.parametrize("case", ["experts-differ", "float32", "rows-summed", "misaligned-rows", "a-block-left-out"])
def test_other_loops_over_split_rows_stay(case):
    args = _split_loop_args(torch.float32 if case == "float32" else torch.bfloat16)
    if case == "misaligned-rows":  # 6-element bf16 rows: 12-byte strides, which grouped_mm refuses
        rows, counts, w1, w2 = args
        args = (rows[:, :6].contiguous(), counts, w1[:, :, :6].contiguous(), w2)
    if case == "experts-differ":
        def fn(*a):
            return _split_loop(*a, acts=[F.silu, F.relu, F.silu, F.silu])
    elif case == "a-block-left-out":  # the last expert's rows not in the result
        def fn(rows, counts, w1, w2):
            blocks = torch.split(rows, counts.tolist(), dim=0)
            return torch.cat([F.silu(block @ w1[e].t()) @ w2[e].t() for e, block in enumerate(blocks[:-1])], dim=0)
    elif case == "rows-summed":  # not row by row: a block's sum over its rows
        def fn(rows, counts, w1, w2):
            blocks = torch.split(rows, counts.tolist(), dim=0)
            return torch.cat([(block - block.sum(0)) @ w1[e].t() for e, block in enumerate(blocks)], dim=0)
    else:
        fn = _split_loop
    gm = traced_with_scalars(fn, *args)
    assert not any(line.startswith("split_loop_to_grouped_mm") for line in canonicalize(gm))
    assert "cat" in ops(gm)


@pytest.mark.parametrize("spelling", ["x @ W", "x[None] @ W", "a @ W"])
def test_a_matmul_over_stacked_weights_becomes_a_bmm(spelling):
    W = torch.randn(E, d, n)
    rows = torch.randn(E, T, d) if spelling == "a @ W" else torch.randn(T, d)
    fn = {"x @ W": lambda r, w: r @ w, "x[None] @ W": lambda r, w: r[None] @ w, "a @ W": lambda r, w: r @ w}[spelling]
    gm = traced(fn, rows, W)
    assert len(canonicalize(gm)) == 1 and ops(gm).count("bmm") == 1
    same_value(gm, fn, rows, W)


@pytest.mark.parametrize("case", ["2-D weight", "weight batch of 1"])
def test_other_matmuls_stay(case):
    rows = torch.randn(T, d) if case == "2-D weight" else torch.randn(E, T, d)
    W = torch.randn(d, n) if case == "2-D weight" else torch.randn(1, d, n)
    gm = traced(lambda r, w: r @ w, rows, W)
    assert canonicalize(gm) == [] and "bmm" not in ops(gm)


def test_an_einsum_product_under_autocast_becomes_a_bmm_lowered_as_it_was():
    args = (torch.randn(T, d), torch.randn(E, d, n))

    def fn(a, b):
        return torch.einsum("td,edn->etn", a, b)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        gm = traced(fn, *args)
        assert len(canonicalize(gm)) == 1 and "einsum" not in ops(gm)
        (out,) = [nd for nd in gm.graph.nodes if nd.op == "output"][0].args[0]
        assert op_name(out.target) == "bmm" and out.meta["example_value"].dtype == torch.bfloat16
        same_value(gm, fn, *args)


@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True)])
def test_a_low_precision_einsum_weighted_sum_stays(dtype, autocast):
    """In bf16 the product form would round each term before the sum (einsum accumulates in float32)."""
    g, y = torch.randn(T, E).to(dtype), torch.randn(E, T, d).to(dtype)

    def fn(g, y):
        return torch.einsum("te,etd->td", g, y)

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        gm = traced(fn, g, y)
        assert canonicalize(gm) == [] and "einsum" in ops(gm)


# ------------------------------------------------------------------ library ops proven by evaluation


def _library_ops():
    """Library ops of the combine shape: a scatter_add and an index_add (by other names), one that
    takes only bfloat16 (exact there), one without an autograd formula, and one whose result is
    the rows' sum minus `out` (a value a scatter_add never gives)."""
    from . import naive_models  # noqa: F401  (sonic_test::rows_scatter_add and the others)

    lib = torch.ops.sonic_test
    if not hasattr(lib, "rows_index_add"):
        def define(name, forward, grads=True):
            op = torch.library.custom_op(f"sonic_test::{name}", forward, mutates_args=())
            op.register_fake(lambda out, index, src: torch.empty_like(out))
            if grads:
                op.register_autograd(lambda ctx, g: (g, None, g.index_select(0, ctx.index)),
                                     setup_context=lambda ctx, inputs, output: setattr(ctx, "index", inputs[1]))

        def index_add(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
            return out.index_add(0, index, src)

        def bf16_only(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
            if out.dtype != torch.bfloat16:
                raise RuntimeError("bf16 only")
            return out.index_add(0, index, src)

        def sum_minus_out(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(out).index_add(0, index, src) - out

        define("rows_index_add", index_add)
        define("rows_index_add_bf16_only", bf16_only)
        define("rows_index_add_no_grad", index_add, grads=False)
        define("rows_sum_minus_out", sum_minus_out)
    return lib


def _combine(op, index_of):
    def fn(x, rows, tok):
        out = torch.zeros_like(x)
        return op(out, index_of(tok, x.shape[1]), rows * 2.0)
    return fn


def _combine_args(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(T, d, generator=g).to(dtype), torch.randn(T * K, d, generator=g).to(dtype),
            torch.randint(0, T, (T * K,), generator=g))


@pytest.mark.parametrize("name,index_of,torch_name,dtype", [
    # (a library op's stand-in stays a scatter_add: `restore_opaque_ops` puts it back by its arguments)
    ("rows_scatter_add", lambda tok, d: tok.reshape(-1, 1).expand(-1, d), "scatter_add", torch.float32),
    ("rows_index_add", lambda tok, d: tok, "index_add", torch.float32),
    ("rows_index_add_bf16_only", lambda tok, d: tok, "index_add", torch.bfloat16),
])
def test_a_library_op_that_computes_a_torch_op_becomes_it(name, index_of, torch_name, dtype):
    op = getattr(_library_ops(), name)
    fn = _combine(op, index_of)
    args = _combine_args(dtype)
    gm = traced(fn, *args)
    assert canonicalize(gm)
    assert torch_name in ops(gm) and not any("sonic_test" in o for o in ops(gm)), ops(gm)
    same_value(gm, fn, *args)


@pytest.mark.parametrize("name,why", [
    ("rows_index_add_no_grad", "no autograd formula"),
    ("rows_sum_minus_out", "its value differs"),
    ("rows_scatter_add_no_src_grad", "its gradient of src differs"),
])
def test_a_library_op_that_differs_from_every_candidate_stays_with_its_reason(name, why):
    from moe_compiler.patterns.canonical_opaque import refusal

    op = getattr(_library_ops(), name)
    index_of = (lambda tok, d: tok.reshape(-1, 1).expand(-1, d)) if "scatter" in name else (lambda tok, d: tok)
    gm = traced(_combine(op, index_of), *_combine_args())
    before = ops(gm)
    canonicalize(gm)
    assert ops(gm) == before
    (node,) = [n for n in gm.graph.nodes if "sonic_test" in str(n.target)]
    assert why in refusal(node), refusal(node)


def test_a_library_op_outside_the_rewritten_region_is_put_back():
    """The region's combine becomes the op; a second call of the library op, on the layer's output
    (no MoE), stays the library's op in the compiled graph."""
    from .naive_models import SortedGroupedMoE

    model = SortedGroupedMoE(combine="rows_scatter_add").to(torch.bfloat16)
    library_op = torch.ops.sonic_test.rows_scatter_add
    graphs = []

    def fn(x):
        y = model(x)
        tok = torch.arange(x.shape[0]).flip(0)
        return library_op(torch.zeros_like(y), tok.reshape(-1, 1).expand(-1, y.shape[1]), y)

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    from moe_compiler.backend import sonic_backend

    def backend(gm, example_inputs):
        compiled = sonic_backend(gm, example_inputs, options={"sonic.fallback": False})
        keep(gm, example_inputs)
        return compiled

    x = torch.randn(T, 16, dtype=torch.bfloat16)
    torch._dynamo.reset()
    got = torch.compile(fn, backend=backend)(x)
    names = ops(graphs[0])
    assert any(n.startswith("sonic::moe_experts") for n in names), names
    assert sum("sonic_test" in n for n in names) == 1 and "scatter_add" not in names, names
    torch.testing.assert_close(got.float(), fn(x).float(), rtol=2e-2, atol=2e-2)


def mask_counts(scores):
    _, ids = torch.topk(scores, K)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True).sum(dim=0)


def bincount_counts(scores):
    _, ids = torch.topk(scores, K)
    return torch.bincount(ids.reshape(-1), minlength=E)


def test_a_routing_mask_summed_over_the_tokens_becomes_the_ids_counts():
    scores = torch.randn(T, E)
    gm = traced(mask_counts, scores)
    assert canonicalize(gm)
    assert "sum" not in ops(gm) and "scatter_add" in ops(gm), ops(gm)
    same_value(gm, mask_counts, scores)
    same_value(gm, bincount_counts, scores)


def mask_counts_of_other_ids(scores, ids):
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True).sum(dim=0)


def mask_counts_after_a_write(scores):
    _, ids = torch.topk(scores, K)
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True)
    mask[:, 0] = False  # expert 0 not counted: no longer the ids' counts
    return mask.sum(dim=0)


def mask_counts_per_token(scores):
    _, ids = torch.topk(scores, K)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True).sum(dim=-1)


@pytest.mark.parametrize("fn,args", [
    (mask_counts_of_other_ids, (torch.randn(T, E), torch.randint(0, E, (T, K)))),  # repeats possible: not counts
    (mask_counts_per_token, (torch.randn(T, E),)),
    (mask_counts_after_a_write, (torch.randn(T, E),)),
])
def test_other_mask_sums_stay(fn, args):
    gm = traced(fn, *args)
    before = ops(gm)
    canonicalize(gm)
    assert ops(gm) == before


def test_a_library_op_into_other_than_fresh_zeros_is_never_run_at_compile_time():
    """Only a combine's shape is probed: a library op whose `out` is not a fresh zeros tensor (it
    could be a collective of the library's own) is left as it is without being called."""
    if not hasattr(torch.ops.sonic_test, "rows_add_counted"):
        @torch.library.custom_op("sonic_test::rows_add_counted", mutates_args=())
        def rows_add_counted(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
            _COUNTED.append(1)
            return out.index_add(0, index, src)

        rows_add_counted.register_fake(lambda out, index, src: torch.empty_like(out))

    def fn(x, rows, tok):
        return torch.ops.sonic_test.rows_add_counted(x * 1.0, tok, rows)

    gm = traced(fn, *_combine_args())
    before, ran = ops(gm), len(_COUNTED)
    canonicalize(gm)
    assert ops(gm) == before and len(_COUNTED) == ran


_COUNTED: list = []


def scatter_reduce_sum(out, index, src):
    return out.scatter_reduce(0, index, src, "sum")


def scatter_add_sum(out, index, src):
    return out.scatter_add(0, index, src)


def scatter_reduce_sum_into_zeros(out, index, src):
    return torch.zeros_like(out).scatter_reduce(0, index, src, "sum", include_self=False)


def scatter_reduce_sum_without_self(out, index, src):
    return out.scatter_reduce(0, index, src, "sum", include_self=False)


def scatter_reduce_max(out, index, src):
    return out.scatter_reduce(0, index, src, "amax")


def _scatter_args():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(T, d, generator=g), torch.randint(0, T, (T * K, d), generator=g),
            torch.randn(T * K, d, generator=g))


@pytest.mark.parametrize("fn", [scatter_reduce_sum, scatter_reduce_sum_into_zeros])
def test_a_summing_scatter_reduce_becomes_a_scatter_add(fn):
    args = _scatter_args()
    gm = traced(fn, *args)
    assert canonicalize(gm)
    assert "scatter_add" in ops(gm) and "scatter_reduce" not in ops(gm), ops(gm)
    if fn is scatter_reduce_sum:
        assert ops(gm) == ops(traced(scatter_add_sum, *args))  # two spellings, one graph
    same_value(gm, fn, *args)


@pytest.mark.parametrize("fn", [scatter_reduce_sum_without_self, scatter_reduce_max])
def test_other_scatter_reduces_stay(fn):
    gm = traced(fn, *_scatter_args())
    before = ops(gm)
    canonicalize(gm)
    assert ops(gm) == before


# --- nonzero's index pairs read by columns ------------------------------------------------------

def _pairs_args():
    g = torch.Generator().manual_seed(2)
    x, scores = torch.randn(T, d, generator=g), torch.randn(T, E, generator=g)
    return x, scores


def _pairs_by(spelling):
    def fn(x, scores):
        w, ids = torch.topk(scores.softmax(-1), K)
        out = torch.zeros_like(x)
        for e in range(E):
            m = ids == e
            if spelling == "where":
                tok, k = torch.where(m)
            elif spelling == "nonzero_columns":
                p = m.nonzero()
                tok, k = p[:, 0], p[:, 1]
            elif spelling == "argwhere_unbind":
                tok, k = torch.argwhere(m).unbind(1)
            out.index_add_(0, tok, x[tok] * w[tok, k, None] * (e + 1))
        return out
    return fn


@pytest.mark.parametrize("spelling", ["nonzero_columns", "argwhere_unbind"])
def test_nonzero_pairs_read_by_columns_become_where(spelling):
    args = _pairs_args()
    fn = _pairs_by(spelling)
    gm = traced(fn, *args)
    applied = canonicalize(gm)
    assert any(line.startswith("nonzero_columns_to_where") for line in applied), applied
    assert "nonzero" not in ops(gm) and "argwhere" not in ops(gm), ops(gm)
    where = traced(_pairs_by("where"), *args)
    canonicalize(where)
    assert [o for o in ops(gm) if o != "sym_size"] == [o for o in ops(where) if o != "sym_size"]  # one form
    same_value(gm, fn, *args)


def _one_column(spelling):
    def fn(x, scores):
        w, ids = torch.topk(scores, K)
        out = torch.zeros_like(x)
        for e in range(E):
            p = (ids[:, 0] == e).nonzero()
            tok = {"squeeze": lambda: p.squeeze(-1), "view": lambda: p.view(-1), "flatten": lambda: p.flatten(),
                   "column": lambda: p[:, 0], "matrix": lambda: p.sum(-1)}[spelling]()
            out.index_add_(0, tok, x[tok] * w[tok, 0, None])
        return out
    return fn


@pytest.mark.parametrize("spelling", ["squeeze", "view", "flatten", "column"])
def test_a_one_dimensional_masks_nonzero_as_one_vector_becomes_where(spelling):
    args = _pairs_args()
    gm = traced(_one_column(spelling), *args)
    canonicalize(gm)
    assert "nonzero" not in ops(gm) and "where" in ops(gm), ops(gm)
    same_value(gm, _one_column(spelling), *args)


def test_nonzero_read_as_a_matrix_stays():
    args = _pairs_args()
    gm = traced(_one_column("matrix"), *args)
    canonicalize(gm)
    assert ops(gm).count("nonzero") == E and "where" not in ops(gm), ops(gm)
    same_value(gm, _one_column("matrix"), *args)


# --- rows added by index_put(accumulate=True) and by a row-broadcast scatter_add ------------------

def _rows_args(dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    tok = torch.randint(0, T, (T * K,), generator=g)  # repeats: they must be summed
    return torch.randn(T, d, generator=g).to(dtype), tok, torch.randn(T * K, d, generator=g).to(dtype)


def rows_index_add(out, tok, v):
    return out.clone().index_add_(0, tok, v)


def rows_index_put(out, tok, v):
    return out.clone().index_put_((tok,), v, accumulate=True)


def rows_index_put_functional(out, tok, v):
    return out.index_put((tok,), v, accumulate=True)


def rows_scatter_add_expand(out, tok, v):
    return out.clone().scatter_add_(0, tok[:, None].expand(-1, v.shape[1]), v)


def rows_scatter_add_expand_as(out, tok, v):
    return torch.scatter_add(out, 0, tok.unsqueeze(-1).expand_as(v), v)


def rows_scatter_add_repeat(out, tok, v):
    return out.scatter_add(0, tok.view(-1, 1).repeat(1, v.shape[1]), v)


@pytest.mark.parametrize("fn", [rows_index_put, rows_index_put_functional, rows_scatter_add_expand,
                                rows_scatter_add_expand_as, rows_scatter_add_repeat])
def test_rows_added_by_index_put_or_a_row_scatter_add_become_an_index_add(fn):
    args = _rows_args()
    gm = traced(fn, *args)
    assert canonicalize(gm)
    assert {"index_add", "index_add_"} & set(ops(gm)), ops(gm)
    assert not {"index_put", "index_put_", "scatter_add", "scatter_add_"} & set(ops(gm)), ops(gm)
    same_value(gm, fn, *args)


def test_index_put_stays_under_deterministic_algorithms():
    args = _rows_args()
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        gm = traced(rows_index_put, *args)
        canonicalize(gm)
    finally:
        torch.use_deterministic_algorithms(before)
    assert "index_put_" in ops(gm) and "index_add_" not in ops(gm), ops(gm)


def rows_index_put_replace(out, tok, v):
    return out.clone().index_put_((tok,), v)  # accumulate=False: the last write wins, no sum


def rows_index_put_broadcast(out, tok, v):
    return out.clone().index_put_((tok,), v[:1], accumulate=True)  # one row broadcast to every index


def rows_scatter_add_per_element(out, tok, v):
    idx = torch.stack([tok, tok.flip(0)], 1).repeat(1, v.shape[1] // 2)  # columns differ
    return out.clone().scatter_add_(0, idx, v)


def rows_index_put_mask(out, tok, v):
    return out.clone().index_put_((tok[: out.shape[0]] > 3,), v[:1], accumulate=True)  # a boolean mask


@pytest.mark.parametrize("fn", [rows_index_put_replace, rows_index_put_broadcast, rows_scatter_add_per_element,
                                rows_index_put_mask])
def test_other_row_writes_stay(fn):
    args = _rows_args()
    gm = traced(fn, *args)
    before = ops(gm)
    canonicalize(gm)
    assert ops(gm) == before
    same_value(gm, fn, *args)


# --- an expert's weights selected by its [T, K] boolean mask --------------------------------------

def _mask_weighted(spelling):
    def fn(x, scores):
        w, ids = torch.topk(scores.softmax(-1), K)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, k = torch.where(ids == e)
            if spelling == "index":
                we = w[tok, k]
            elif spelling == "mask":  # `ids == e` spelled again: the selection reuses where's indices
                we = w[ids == e]
            elif spelling == "mask_none":
                we = w[ids == e, None][:, 0]
            out.index_add_(0, tok, x[tok] * we[:, None] * (e + 1))
        return out
    return fn


@pytest.mark.parametrize("spelling", ["mask", "mask_none"])
def test_weights_selected_by_a_two_dimensional_mask_become_where_indices(spelling):
    args = _pairs_args()
    fn = _mask_weighted(spelling)
    gm = traced(fn, *args)
    applied = canonicalize(gm)
    assert sum(line.startswith("boolean_index_to_where") for line in applied) == E, applied
    assert ops(gm).count("where") == E, ops(gm)  # one where per expert: the loop's own
    same_value(gm, fn, *args)


def test_a_one_dimensional_mask_selection_stays():
    def fn(x, scores):
        p, ids = scores.softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for e in range(E):
            m = ids == e
            out[m] = x[m] * p[m, None]
        return out

    args = _pairs_args()
    gm = traced(fn, *args)
    assert not any(line.startswith("boolean_index_to_where") for line in canonicalize(gm))
    same_value(gm, fn, *args)



# --- an expert's tokens as the rows holding it anywhere, its weights as a masked sum -------------

def _any_hit(spelling):
    def fn(x, scores):
        w, ids = torch.topk(scores.softmax(-1), K)
        out = torch.zeros_like(x)
        for e in range(E):
            if spelling == "where":
                tok, k = torch.where(ids == e)
                out.index_add_(0, tok, x[tok] * w[tok, k].unsqueeze(-1) * (e + 1))
                continue
            hit = ids == e
            sel, coef = hit.any(dim=-1), (w * hit).sum(-1)
            tok = torch.where(sel)[0] if spelling == "any_where" else sel.nonzero().squeeze(-1)
            out.index_add_(0, tok, x[tok] * coef[tok].unsqueeze(-1) * (e + 1))
        return out
    return fn


@pytest.mark.parametrize("spelling", ["any_where", "any_nonzero"])
def test_tokens_holding_an_expert_anywhere_become_its_where_tokens_and_weights(spelling):
    args = _pairs_args()
    fn = _any_hit(spelling)
    gm = traced(fn, *args)
    applied = [line.split(":")[0] for line in canonicalize(gm)]
    assert applied.count("any_hit_where_to_hit_where") == E and applied.count("gate_column_rows_to_weights") == E, applied
    assert "any" not in ops(gm) and "one_hot" not in ops(gm), ops(gm)  # the gate matrix is dead once read as w[tok, k]
    where = traced(_any_hit("where"), *args)
    canonicalize(where)
    assert sorted(o for o in ops(gm) if o != "sym_size") == sorted(o for o in ops(where) if o != "sym_size")
    same_value(gm, fn, *args)


def test_rows_holding_an_expert_of_ids_outside_a_top_k_stay():
    def fn(x, ids):  # ids of unknown range, possibly repeated in a row: any() is not one slot per token
        sel = (ids == 1).any(-1)
        return x[torch.where(sel)[0]]

    args = (torch.randn(T, d), torch.randint(0, E, (T, K)))
    gm = traced(fn, *args)
    assert not any(line.startswith("any_hit") for line in canonicalize(gm))
    same_value(gm, fn, *args)


# --- products of gathered weights as einsums, and the reshapes around them ---------------------

def _gathered_args():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(T, d, generator=g), torch.randint(0, E, (T, K), generator=g),
            torch.randn(E, d, 2 * n, generator=g), torch.randn(E, n, d, generator=g))


def _gathered_by(spelling):
    """Each slot's expert MLP, [T, K, d], on weights gathered by ids, in the spelling named."""
    def einsum_form(x, ids, w13, w2):  # the canonical form
        g, u = torch.einsum("ta,tkab->tkb", x, w13[ids]).chunk(2, -1)
        return torch.einsum("tkb,tkbc->tkc", F.silu(g) * u, w2[ids])

    def matmul_form(x, ids, w13, w2):
        g, u = (x[:, None, None, :] @ w13[ids]).chunk(2, -1)
        return ((F.silu(g) * u) @ w2[ids]).squeeze(2)

    def bmm_form(x, ids, w13, w2):  # rows repeated per slot, ids flattened
        flat = ids.reshape(-1)
        rows = x[:, None, :].expand(T, K, d).reshape(T * K, 1, d)
        g, u = torch.bmm(rows, w13[flat]).chunk(2, -1)
        return torch.bmm(F.silu(g) * u, w2[flat]).view(T, K, d)

    def bmm_columns_form(x, ids, w13, w2):  # the weights' output dim first, rows as columns
        flat = ids.reshape(-1)
        h = torch.bmm(w13[flat].transpose(1, 2), x.repeat_interleave(K, dim=0).unsqueeze(-1)).squeeze(-1)
        g, u = h.chunk(2, -1)
        return torch.bmm(w2[flat].transpose(1, 2), (F.silu(g) * u).unsqueeze(-1)).squeeze(-1).view(T, K, d)

    def tiled_form(x, ids, w13, w2):  # slot (t, k) reads row (t K + k) mod T: not per token
        flat = ids.reshape(-1)
        g, u = torch.bmm(x.repeat(K, 1)[:, None, :], w13[flat]).chunk(2, -1)
        return torch.bmm(F.silu(g) * u, w2[flat]).view(T, K, d)

    return {"einsum": einsum_form, "matmul": matmul_form, "bmm": bmm_form, "bmm_columns": bmm_columns_form,
            "tiled": tiled_form}[spelling]


@pytest.mark.parametrize("spelling", ["matmul", "bmm", "bmm_columns"])
def test_gathered_weight_products_become_einsums(spelling):
    args = _gathered_args()
    fn, canonical = _gathered_by(spelling), traced(_gathered_by("einsum"), *args)
    gm = traced(fn, *args)
    assert any(line.startswith("gathered_product_to_einsum") for line in canonicalize(gm))
    assert canonicalize(canonical) == []
    assert sorted(ops(gm)) == sorted(ops(canonical)), (ops(gm), ops(canonical))
    same_value(gm, fn, *args)


def test_a_gathered_product_of_rows_not_per_token_reads_them_per_slot():
    args = _gathered_args()
    fn = _gathered_by("tiled")
    gm = traced(fn, *args)
    canonicalize(gm)
    einsums = [node for node in gm.graph.nodes if node.op == "call_function" and op_name(node.target) == "einsum"]
    assert [node.args[0][:4] for node in einsums] == ["tka,", "tka,"]  # [T, K, d] rows, not x [T, d]
    same_value(gm, fn, *args)


def test_other_gathered_products_stay():
    W, rows = torch.randn(E, d, n), torch.randn(T, 1, d)
    by_positions = traced(lambda r, w, i: torch.bmm(r, w[i]), rows, W, torch.randint(0, E, (T,)))  # 1-D ids
    by_floats = traced(lambda r, w, m: r[:, None] @ (w[None] * m[:, :, None, None]), rows, W, torch.rand(T, E))
    assert canonicalize(by_positions) == [] and canonicalize(by_floats) == []


def test_a_combine_of_flat_slots_after_gathered_products_becomes_per_slot():
    """y [T K, d] scaled by w.reshape(-1, 1) and viewed [T, K, d]: after the products are einsums,
    the scaling runs on their [T, K, d] result with w regrouped alike."""
    def flat(x, ids, w13, w2, w):
        y = _gathered_by("bmm")(x, ids, w13, w2).reshape(T * K, d)
        return (y * w.reshape(-1, 1)).view(T, K, d).sum(1)

    def per_slot(x, ids, w13, w2, w):
        return (_gathered_by("einsum")(x, ids, w13, w2) * w.reshape(-1, K, 1)).sum(1)

    args = (*_gathered_args(), torch.rand(T, K))
    gm = traced(flat, *args)
    assert any(line.startswith("reshape_through_elementwise") for line in canonicalize(gm))
    assert sorted(ops(gm)) == sorted(ops(traced(per_slot, *args)))
    same_value(gm, flat, *args)


def test_reshapes_away_from_a_respelled_product_stay():
    """The view rules act only next to a product `gathered_product_to_einsum` respelled: a finder
    may read other views as written."""
    def chains(x, g):
        return x[:, None, None, :].reshape(T, d) * 2, g.unsqueeze(2).squeeze(2) + 1

    def elementwise(g, u):
        return (F.silu(g.unsqueeze(2)) * u.unsqueeze(2)).squeeze(2)

    for fn, args in ((chains, (torch.randn(T, d), torch.randn(T, K, n))),
                     (elementwise, (torch.randn(T, K, n), torch.randn(T, K, n)))):
        assert canonicalize(traced(fn, *args)) == []


def _marked_graph(fn, *args):
    """fn traced, its reshapes marked as a respelled product's (the view rules' precondition)."""
    from moe_compiler.patterns.canonical_views import mark, reshaped

    gm = traced(fn, *args)
    for node in gm.graph.nodes:
        if reshaped(node) is not None:
            mark(node)
    return gm


def test_marked_reshape_chains_written_in_place_reinterpreting_or_of_other_strides_stay():
    def written(x):
        v = x.view(1, T, d)
        v.mul_(2)
        return v.view(T, d) + 1

    def bits(x):
        return x.view(torch.int32).view(torch.float32) + 1

    def strides(x):  # x.t() flat and back: a contiguous copy (a later view may rely on it), not x.t()
        return x.t().reshape(-1).reshape(d, T) + 1

    for fn in (written, bits, strides):
        assert canonicalize(_marked_graph(fn, torch.randn(T, d))) == []


def test_a_marked_reshape_of_elementwise_code_stays_when_nothing_comes_back_or_the_code_is_read_twice():
    def nothing_back(a, b):
        return (a * b).view(-1)

    def read_twice(g):
        h = F.silu(g.unsqueeze(2))
        return h.squeeze(2), h.sum()

    for fn, args in ((nothing_back, (torch.randn(T, d), torch.randn(T, d))), (read_twice, (torch.randn(T, K, n),))):
        assert canonicalize(_marked_graph(fn, *args)) == []


@pytest.mark.gpu
def test_rows_of_a_scattered_combine_matrix_gpu_bf16():
    """The same layer in bf16 on CUDA through Inductor: as close to the fp32 model as eager bf16 is."""
    import moe_compiler

    from .helpers import assert_close_to_eager

    torch.manual_seed(0)
    fp32 = ScatteredCombine("index_select").cuda()
    bf16 = ScatteredCombine("index_select").cuda().to(torch.bfloat16)
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in fp32.state_dict().items()})
    x = torch.randn(64, d, device="cuda")
    truth, eager = fp32(x), bf16(x.to(torch.bfloat16))
    compiled = torch.compile(bf16, backend="sonic", options={"sonic.fallback": False})
    with torch._dynamo.config.patch(**{FLAG: True}), moe_compiler.capture() as report, torch.no_grad():
        got = compiled(x.to(torch.bfloat16))
    assert [r.idiom for r in report.rewritten] == ["expert_loop"], str(report)
    assert_close_to_eager(got, eager.detach(), truth.detach(), torch.bfloat16, "output")


def _heads(x, w, wk):
    q = F.linear(x, w).view(x.shape[0], 4, -1)  # split into heads, read by a product with the keys
    k = F.linear(x, wk).view(x.shape[0], 4, -1).transpose(0, 1)  # [H, T, hd]: computed, not a weight
    return torch.einsum("thf,hsf->hts", q, k)


def test_a_linear_split_into_heads_stays_one_matmul():
    x, w, wk = torch.randn(T, d), torch.randn(4 * 3, d), torch.randn(4 * 3, d)
    gm = traced(_heads, x, w, wk)
    assert not any(line.startswith("packed_linear_view_to_einsum") for line in canonicalize(gm))
    assert "linear" in ops(gm)


def _pieces(W):
    return W.chunk(4, 0)[1].squeeze(0), torch.split(W, 1)[2][0], W.unbind(0)[3], W.chunk(4, dim=0)[0].squeeze(dim=0)


def test_one_row_pieces_of_the_first_dim_become_selects():
    W = torch.randn(4, 3, 5)
    gm = traced(_pieces, W)
    applied = [line.split(":")[0] for line in canonicalize(gm)]
    assert applied.count("unit_pieces_to_select") == 4, applied
    assert not {"chunk", "split", "unbind", "squeeze"} & set(ops(gm)), ops(gm)
    same_value(gm, _pieces, W)


def _wider_pieces(W):  # two rows a piece, pieces along dim 1, squeezed elsewhere
    return W.chunk(2, 0)[1].squeeze(0), W.chunk(3, 1)[1].squeeze(1), W[:1].squeeze(0) + W.chunk(4, 0)[1][0, 0]


def test_other_pieces_stay():
    W = torch.randn(4, 3, 5)
    gm = traced(_wider_pieces, W)
    assert "unit_pieces_to_select" not in [line.split(":")[0] for line in canonicalize(gm)]
    same_value(gm, _wider_pieces, W)


def _scaled_in_place(y, w):  # DeepSeek-V2's moe_infer: rows, a view, a cast to their own dtype, then mul_
    rows = y[torch.arange(y.shape[0]).flip(0)]
    out = rows.view(-1, 2, y.shape[1]).type(torch.float32).mul_(w.unsqueeze(-1)).sum(1)
    acc = (y.sum(0) * 2)[1:].add_(1.0)  # a slice of a fresh product
    return out, acc


def test_in_place_arithmetic_on_values_nothing_else_reads_becomes_functional():
    y, w = torch.randn(8, 3), torch.randn(4, 2)
    gm = traced(_scaled_in_place, y, w)
    applied = [line.split(":")[0] for line in canonicalize(gm)]
    assert applied.count("fresh_inplace_to_functional") == 2, applied
    assert not {"mul_", "add_"} & set(ops(gm)), ops(gm)
    same_value(gm, _scaled_in_place, y, w)


def _written_where_seen(y, w):
    view = y.view(-1, 2, 3)
    view.mul_(2.0)  # the graph input itself
    rows = y[torch.tensor([1, 0, 3, 2])]
    seen = rows.view(2, 2, 3)
    seen.mul_(w.unsqueeze(-1))  # rows is read below as well
    fresh = y * 3
    part = fresh[0]  # a view of fresh...
    part.add_(1.0)
    return rows.sum(0), seen.sum(1), fresh  # ...which is returned: the write is seen through it


def test_in_place_arithmetic_whose_write_is_seen_stays():
    y, w = torch.randn(4, 3), torch.randn(2, 2)
    gm = traced(_written_where_seen, y.clone(), w)
    assert "fresh_inplace_to_functional" not in [line.split(":")[0] for line in canonicalize(gm)]
    assert [op for op in ops(gm) if op in ("mul_", "add_")] == ["mul_", "mul_", "add_"], ops(gm)


def test_nonzero_as_a_tuple_becomes_torch_where():
    def tuple_form(ids, x):
        tok = (ids == 1).any(-1).nonzero(as_tuple=True)[0]
        return x[tok] * 2

    def where_form(ids, x):
        return x[torch.where((ids == 1).any(-1))[0]] * 2

    args = (torch.randint(0, E, (T, K)), torch.randn(T, d))
    gm = traced(tuple_form, *args)
    assert "nonzero" in ops(gm)
    canonicalize(gm)
    want = traced(where_form, *args)
    canonicalize(want)
    assert [o for o in ops(gm) if o != "sym_size"] == [o for o in ops(want) if o != "sym_size"], (ops(gm), ops(want))
    same_value(gm, tuple_form, *args)


@pytest.mark.parametrize("fn", [
    lambda p: torch.max(p, -1)[1].float() + p.max(dim=-1).values,
    lambda p: p.topk(2)[0] + torch.topk(p, 2, dim=1, largest=True)[0],
    lambda p: torch.sort(p, -1)[1] * 1.0 + p.sort(dim=1, descending=False)[0],
], ids=["max", "topk", "sort"])
def test_a_reduction_repeated_with_other_argument_spellings_is_one_node(fn):
    p = torch.randn(T, E)
    gm = traced(fn, p)
    assert "merge_duplicate_reductions" in [a.split(":")[0] for a in canonicalize(gm)], ops(gm)
    name = [o for o in ops(gm) if o in ("max", "topk", "sort")]
    assert len(name) == 1, ops(gm)
    same_value(gm, fn, p)


def _under_no_grad_then_with_grad(p):
    with torch.no_grad():
        first = torch.max(p, -1)
    return first[1].float() + p.max(dim=-1).values


def _written_between(p):
    first = p.max(-1)[1].float()
    p.mul_(-1)
    return first + p.max(dim=-1).values


@pytest.mark.parametrize("fn", [
    lambda p: torch.max(p, -1)[0] + p.max(dim=0).values.sum(),  # other dims
    lambda p: torch.max(p, -1, keepdim=True)[0] + p.max(dim=-1).values[:, None],  # keepdim differs
    lambda p: p.topk(2)[0] + p.topk(2, largest=False)[0],  # the smallest
    lambda p: p.topk(2)[0] + p.topk(3)[0][:, :2],  # another k
    _written_between,  # the scores change between the two
    _under_no_grad_then_with_grad,  # the first max's values carry no gradient
], ids=["dim", "keepdim", "largest", "k", "written", "grad-mode"])
def test_reductions_that_differ_stay_two(fn):
    gm = traced(fn, torch.randn(T, E))
    assert "merge_duplicate_reductions" not in [a.split(":")[0] for a in canonicalize(gm)], ops(gm)
