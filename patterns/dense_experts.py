"""Every expert of an `nn.ModuleList` run on every token, combined by a dense [T, E] gate matrix.

Eager code it matches, shapes (T tokens, d hidden, E experts, K top-k):

    probs = F.softmax(self.gate(x), dim=-1)                        # [T, E]
    w, ids = torch.topk(probs, K, dim=-1)                          # [T, K] (any [T, K] weights)
    gates = torch.zeros_like(probs).scatter(1, ids, w)             # [T, E]; or zeros(...).scatter_(1, ids, w),
                                                                   #   (F.one_hot(ids, E) * w.unsqueeze(-1)).sum(1)
    outs = torch.stack([e(x) for e in self.experts], dim=1)        # [T, E, d]
    out = (gates.unsqueeze(-1) * outs).sum(1)                      # [T, d]; or einsum("te,ted->td", gates, outs),
                                                                   #   sum_e gates[:, e:e+1] * self.experts[e](x)
    outs = torch.stack([e(x) for e in self.experts])               # [E, T, d] (dim=0, the default)
    out = torch.einsum("te,etd->td", gates, outs)                  #   or (gates.t().unsqueeze(-1) * outs).sum(0)
    outs = torch.stack([e(x) for e in self.experts], dim=-1)       # [T, d, E]
    out = (gates.unsqueeze(1) * outs).sum(-1)                      #   or einsum("te,tde->td", gates, outs)

with experts as in `module_list`, the sum of columns also started from one other term (a shared
expert's output, added to the op's output), and hidden states that keep two leading token dims
([B, S, d] with [B, S, E] gates, `gates[..., e:e+1]`, `stack(outs, dim=-2)`: `MoEMatch.token_dims`).
It becomes the sparse computation

    out = moe_experts_list(x, ids, w, [w1_e], [w3_e] or [], [w2_e], b1?, b2?, activation=<probed>)

which runs each expert on its top-k tokens only. That is the same function because the gate
matrix is checked to be zero outside the top-k: built by scattering the top-k weights into zeros
(top-k ids are distinct per token, so the scatter writes each weight once) or from one_hot(ids).
A gate matrix that is not provably sparse (the softmax probabilities themselves, a top-p mask...)
is rejected. One difference remains, by design: where an unselected expert's output is inf or nan,
the dense code gives nan (0 * inf) and the rewrite gives the finite answer of the selected experts.
"""
from __future__ import annotations

import math
import re
from typing import NamedTuple

import torch.fx as fx

from .common import (
    ZEROS,
    MoEMatch,
    NoMatch,
    RegionWalk,
    Rejection,
    arg,
    dtype_of,
    einsum_parts,
    expect,
    is_call,
    is_getitem,
    is_int,
    module_path,
    same_shape,
    same_size,
    shape_of,
    unit_slice,
    writes_in_place,
)
from .module_list import (
    _transposed_2d,
    expert_mlp,
    finish_expert_match,
    same_weights,
    through_float_casts,
    top_k_or_max_routing,
    topk_routing,
)

IDIOM = "dense_experts"
_ADD = ("add", "__add__")
_MUL = ("mul", "__mul__")


def find(gm: fx.GraphModule) -> list[MoEMatch | Rejection]:
    """Candidates: a stack of expert outputs (linear calls) read by a product or an einsum, or a sum
    of products of gate columns with expert outputs."""
    results: list[MoEMatch | Rejection] = []
    candidates = []
    for node in gm.graph.nodes:
        if is_call(node, "stack") and _stacked_outputs(node):
            candidates.append((node, _check_stacked))
    for anchor in _column_sums(gm.graph):
        candidates.append((anchor, _check_columns))
    for anchor in _column_sums(gm.graph, _slot_term):
        candidates.append((anchor, _check_slot_terms))
    for node, check in candidates:
        try:
            results.append(check(node))
        except NoMatch as exc:
            results.append(Rejection(IDIOM, module_path(node), str(exc)))
    return results


def _stacked_outputs(stack: fx.Node) -> list[fx.Node] | None:
    """The expert outputs of `torch.stack([expert(x) ...], dim)` when each is a linear call."""
    items = arg(stack, 0, "tensors")
    if not isinstance(items, (list, tuple)) or len(items) < 2:
        return None
    walk = RegionWalk()
    return list(items) if all(is_call(through_float_casts(i, walk), "linear") for i in items) else None


# -- the combine ------------------------------------------------------------------------------


def _check_stacked(stack: fx.Node) -> MoEMatch:
    """sum_e gates[t, e] * stack(outs, dim)[.., e, ..] with the experts' dim first, after the tokens'
    dims or last: a product with the gates broadcast to the stack's layout summed over that dim, or an
    einsum."""
    walk = RegionWalk()
    outs = _stacked_outputs(stack)
    lead = len(shape_of(outs[0])) - 1  # the tokens' dims: [T, d] outputs, or [B, S, d]
    dim = arg(stack, 1, "dim", 0)
    dim = dim + lead + 2 if isinstance(dim, int) and dim < 0 else dim
    expect(dim in (0, lead, lead + 1), f"expert outputs are stacked at dim {dim}: not first, after the tokens' "
                                       "dims or last")
    walk.mark(stack)
    readers = list(stack.users)
    expect(len(readers) == 1, "the stacked expert outputs are read more than once")
    (combine,) = readers
    if is_call(combine, "einsum"):  # left as written in bf16/fp16 and under autocast (canonical_products)
        gates = _einsum_gates(combine, stack, dim)
        anchor = combine
    else:  # the product, also einsum("te,ted->td", ...)'s canonical form
        expect(is_call(combine, *_MUL) and len(combine.args) == 2, "stacked expert outputs are not weighted by a gate matrix")
        other = combine.args[1] if combine.args[0] is stack else combine.args[0]
        gates = _broadcast_gates(other, walk, dim, lead)
        anchor = next(iter(combine.users), None) if len(combine.users) == 1 else None
        expect(is_call(anchor, "sum") and sums_dim(anchor, (dim, dim - lead - 2)),
               "weighted expert outputs are not summed over the experts")
        walk.mark(combine, other)
    walk.mark(anchor)
    return _finish(anchor, gates, outs, walk)


def _einsum_gates(einsum: fx.Node, stack: fx.Node, dim: int) -> fx.Node:
    """The gates operand of einsum("te,ted->td", gates, outs) with the experts' letter at `dim` of the
    stack's subscripts (any letters, either operand order)."""
    equation, *operands = einsum.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    expect(isinstance(equation, str) and len(operands) == 2 and stack in operands, "einsum does not combine two operands")
    spec = re.fullmatch(r"(\w+),(\w+)->(\w+)", equation.replace(" ", ""))
    expect(spec is not None, f"einsum {equation!r} has no explicit output")
    ins, out = [spec.group(1), spec.group(2)], spec.group(3)
    i = operands.index(stack)
    spec_outs = ins[i]
    ok = len(set(spec_outs)) == len(spec_outs) >= 3 and dim < len(spec_outs)
    e = spec_outs[dim] if ok else ""
    rest = spec_outs[:dim] + spec_outs[dim + 1:]
    t, d = rest[:-1], rest[-1:]
    ok = ok and ins[1 - i] == t + e and out == t + d
    expect(ok, f"einsum {equation!r} is not sum_e gates[t, e] * outs[t, e, d]")
    return operands[1 - i]


def _broadcast_gates(node, walk: RegionWalk, dim: int, lead: int) -> fx.Node:
    """g [*T, E] from its broadcast to the stacked outputs' layout with the experts at `dim`:
    after the tokens, [*T, E, 1] (`_last_dim_broadcast`); last, [*T, 1, E] (`g.unsqueeze(-2)`,
    `g[..., None, :]`, and of a 2-D g `g[:, None]`, `g[:, None, :]`); first, of a 2-D g, its transpose
    (`g.t()`, `g.T`, `g.transpose(0, 1)`, `g.permute(1, 0)`) broadcast over a last dim."""
    if dim != lead + 1:
        gates = _last_dim_broadcast(node, walk)
        if dim == lead:
            return gates
        expect(lead == 1 and isinstance(gates, fx.Node) and len(shape_of(gates)) == 2,
               "expert outputs stacked first are weighted by no transposed [T, E] gate matrix")
        gates = through_float_casts(gates, walk)
        inner = _transposed_2d(gates)
        expect(inner is not None, f"expert outputs stacked first are weighted by no transposed [T, E] gate matrix "
                                  f"({gates.name} is not one)")
        walk.mark(gates)
        return inner
    node = through_float_casts(node, walk)
    rank = len(shape_of(node))  # lead + 2
    two_d = ((slice(None), None), (slice(None), None, slice(None))) if rank == 3 else ()
    if is_call(node, "unsqueeze") and arg(node, 1, "dim") in (-2, rank - 2):
        walk.mark(node)
        return node.args[0]
    if is_getitem(node) and node.args[1] in ((Ellipsis, None, slice(None)), *two_d):
        walk.mark(node)
        return node.args[0]
    raise NoMatch(f"{getattr(node, 'name', node)} is not a [T, E] matrix broadcast over the features before its last dim")


def _last_dim_broadcast(node, walk: RegionWalk) -> fx.Node:
    """g from g.unsqueeze(-1) / g[..., None] / g[:, :, None] (g broadcast over a last dim; the last
    form of a 2-D g only)."""
    node = through_float_casts(node, walk)
    if is_call(node, "unsqueeze") and arg(node, 1, "dim") in (-1, len(shape_of(node)) - 1):
        walk.mark(node)
        return node.args[0]
    if is_getitem(node) and node.args[1] in ((Ellipsis, None), (slice(None), slice(None), None)):
        walk.mark(node)
        return node.args[0]
    raise NoMatch(f"{getattr(node, 'name', node)} is not a [T, E] matrix broadcast over a last dim")


def sums_dim(node: fx.Node, dims) -> bool:
    """A `sum` node over one of `dims` (an int or a one-element list), no keepdim, no dtype (numpy's
    names `axis`, `keepdims` too)."""
    dim = arg(node, 1, "dim", node.kwargs.get("axis"))
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    keepdim = arg(node, 2, "keepdim", node.kwargs.get("keepdims", False))
    return dim in dims and not keepdim and arg(node, 3, "dtype") is None


def _all_tokens(index, gates) -> bool:
    """`index` selects every token of `gates`: `:` of a 2-D matrix, `...` of one of any rank."""
    rank = len(shape_of(gates))
    return (index == Ellipsis and rank >= 2) or (index == slice(None) and rank == 2)


def _column(node, walk: RegionWalk | None = None):
    """(gates, e) for gates[:, e:e+1], gates[:, e, None] or gates[:, e].unsqueeze(-1) of a 2-D gates
    (`...` for `:` too)."""
    walk = walk or RegionWalk()
    node = through_float_casts(node, walk)
    picked = [node]
    if is_call(node, "unsqueeze") and arg(node, 1, "dim") in (-1, 1):
        node = through_float_casts(node.args[0], walk)
        picked.append(node)
        if is_getitem(node) and isinstance(node.args[1], tuple) and len(node.args[1]) == 2:
            full, e = node.args[1]
            if _all_tokens(full, node.args[0]) and isinstance(e, int):
                walk.mark(*picked)
                return node.args[0], e
        return None
    if not is_getitem(node) or not isinstance(node.args[1], tuple):
        return None
    index = node.args[1]
    if len(index) == 2 and _all_tokens(index[0], node.args[0]) and unit_slice(index[1]) is not None:
        walk.mark(node)
        return node.args[0], unit_slice(index[1])
    if len(index) == 3 and _all_tokens(index[0], node.args[0]) and isinstance(index[1], int) and index[2] is None:
        walk.mark(node)
        return node.args[0], index[1]
    return None


def _column_product(node, walk: RegionWalk | None = None):
    """(gates, e, expert output) for `gates[:, e:e+1] * y` (either order)."""
    if not is_call(node, *_MUL) or len(node.args) != 2:
        return None
    walk = walk or RegionWalk()
    for col, y in (node.args, node.args[::-1]):
        found = _column(col, walk)
        if found is not None and _projection_output(through_float_casts(y, walk)):
            return (*found, y)
    return None


def _projection_output(y) -> bool:
    """`y` is what a Linear gives (`F.linear`) or a matmul, plus a bias or not (`h @ W[e] + B[e]`,
    `h @ W + b`): a candidate expert's down projection, which `expert_mlp` then checks (and names
    what it is not, for `explain`)."""
    if is_call(y, "add", "__add__") and len(y.args) == 2 and not y.kwargs:
        return any(is_call(a, "matmul", "__matmul__") for a in y.args)
    return is_call(y, "linear", "matmul", "__matmul__")


def _column_sums(graph: fx.Graph, term=None) -> list[fx.Node]:
    """Tops of add trees over gate-column products: `sum_e gates[:, e:e+1] * experts[e](x)` (or over
    the terms `term` recognises)."""
    term = term or _column_product
    tops = []
    for node in graph.nodes:
        if term(node) is None:
            continue
        top = node
        while len(top.users) == 1 and is_call(next(iter(top.users)), *_ADD):
            top = next(iter(top.users))
        if top is not node and top not in tops:
            tops.append(top)
    return tops


def _sum_terms(anchor: fx.Node, walk: RegionWalk) -> list:
    """The terms of the add tree ending at `anchor` (a builtin sum()'s starting 0 left out); each
    partial sum must be read by the next add alone."""
    terms = []

    def flatten(node):
        if is_call(node, *_ADD) and len(node.args) == 2 and not node.kwargs:
            expect(node is anchor or len(node.users) == 1, f"a partial sum of the experts ({node.name}) is read elsewhere")
            walk.mark(node)
            for a in node.args:
                flatten(a)
        elif node not in (0, 0.0):
            terms.append(node)

    flatten(anchor)
    return terms


def _added_term(others: list, anchor: fx.Node, what: str):
    """The one term of the sum that is no expert's (a shared expert's output the sum starts from, a
    residual), added to the op's output; None without one."""
    expect(len(others) <= 1, f"{', '.join(getattr(t, 'name', str(t)) for t in others)} are not {what}: at most "
                             "one other term is added to the experts' sum")
    added_to = others[0] if others else None
    expect(added_to is None or (isinstance(added_to, fx.Node) and same_shape(shape_of(added_to), shape_of(anchor))
                                and dtype_of(added_to) == dtype_of(anchor)),
           f"{getattr(added_to, 'name', added_to)} added to the experts' sum is not shaped as it")
    return added_to


def _check_columns(anchor: fx.Node) -> MoEMatch:
    walk = RegionWalk()
    by_expert, gates_nodes, others = {}, set(), []
    for term in _sum_terms(anchor, walk):
        found = _column_product(term, walk)
        if found is None:
            others.append(term)
            continue
        gates, e, y = found
        expect(e not in by_expert, f"expert {e} is added twice")
        by_expert[e] = y
        gates_nodes.add(gates)
        walk.mark(term)
    expect(len(gates_nodes) == 1, "experts are weighted by columns of different gate matrices")
    expect(sorted(by_expert) == list(range(len(by_expert))), f"the sum covers experts {sorted(by_expert)}: not 0..E-1")
    added_to = _added_term(others, anchor, "gate columns times expert outputs")
    return _finish(anchor, gates_nodes.pop(), [by_expert[e] for e in range(len(by_expert))], walk, added_to)


def _slot_term(node, walk: RegionWalk | None = None):
    """(ids, w, k, e, y, k_w) for `torch.where((ids[:, k] == e)[:, None], w[:, k_w:k_w+1] * y, 0)` (the mask
    also `.unsqueeze(-1)`, the zero also `torch.zeros_like` of the value, the weight column as
    `_column` reads it): slot k's weight times expert e's output where slot k holds e, else 0."""
    if not is_call(node, "where") or len(node.args) != 3 or node.kwargs:
        return None
    cond, value, zero = node.args
    if not (zero in (0, 0.0) or (is_call(zero, "zeros_like") and zero.args[0] is value and len(zero.args) == 1
                                 and not zero.kwargs)):
        return None
    if is_call(cond, "unsqueeze") and arg(cond, 1, "dim") in (-1, 1):
        mask = cond.args[0]
    elif is_getitem(cond) and cond.args[1] in ((slice(None), None), (Ellipsis, None)):
        mask = cond.args[0]
    else:
        return None
    if not (is_call(mask, "eq", "__eq__") and len(mask.args) == 2 and is_int(mask.args[1])):
        return None
    column_of_ids, e = mask.args
    if not (is_getitem(column_of_ids) and isinstance(column_of_ids.args[1], tuple) and len(column_of_ids.args[1]) == 2
            and column_of_ids.args[1][0] == slice(None) and is_int(column_of_ids.args[1][1])):
        return None
    ids, k = column_of_ids.args[0], column_of_ids.args[1][1]
    found = _column_product(value, walk)
    if found is None:
        return None
    w, k_w, y = found
    if shape_of(w) != shape_of(ids) or len(shape_of(ids)) != 2:
        return None
    if walk is not None:
        walk.mark(node, cond, mask, column_of_ids, value, zero if isinstance(zero, fx.Node) else None)
    return ids, w, k, e, y, k_w


def _check_slot_terms(anchor: fx.Node) -> MoEMatch:
    """sum over slots k and experts e of `where(ids[:, k] == e, w[:, k] * experts[e](x), 0)`: each
    (k, e) once, from one [T, K] top-k ids and weights; each expert's outputs of the K slots computed
    by the same weights (the op computes each expert once, on its rows only; where eager computed an
    unselected expert's output it selected 0, as the op's sum does)."""
    walk = RegionWalk()
    terms, others = [], []
    for node in _sum_terms(anchor, walk):
        found = _slot_term(node, walk)
        (terms if found is not None else others).append(found if found is not None else node)
    expect(len({(t[0], t[1]) for t in terms}) == 1, "the slot terms read different top-k ids or weights")
    ids, w = terms[0][0], terms[0][1]
    E, K = topk_routing(ids, walk)
    crossed = next(((k, k_w) for *_, k, _, _, k_w in terms if k_w != k), None)
    expect(crossed is None, f"slot {crossed and crossed[0]}'s term is weighted by slot {crossed and crossed[1]}'s weight")
    pairs = [(k, e) for _, _, k, e, _, _ in terms]
    expect(sorted(pairs) == [(k, e) for k in range(K) for e in range(E)],
           f"the sum does not hold each of the K={K} slots of each of the E={E} experts exactly once")
    added_to = _added_term(others, anchor, "slot terms")
    experts = {}
    for _, _, k, e, y, _ in sorted(terms, key=lambda t: (t[2], t[3])):
        expert = expert_mlp(through_float_casts(y, walk), walk, e, stacked=True)
        if e in experts:
            expect(same_weights(expert, experts[e]), f"expert {e}'s output in slot {k} is computed by other weights "
                                                     "than in slot 0")
        else:
            experts[e] = expert
    experts = [experts[e] for e in range(E)]
    xs = {through_float_casts(ex.rows, walk) for ex in experts}
    expect(len(xs) == 1, "experts read different inputs")
    x = xs.pop()
    expect(len(shape_of(x)) == 2 and same_size(shape_of(x)[0], shape_of(ids)[0]), "expert input is not [T, d] for the routed T")
    T, d = shape_of(x)
    expect(same_shape(shape_of(anchor), shape_of(x)), f"combined output {shape_of(anchor)} is not [T, d]")
    return finish_expert_match(IDIOM, anchor, walk, anchor, [anchor], x, ids, w, experts, E=E, K=K, T=T, d=d,
                               added_to=added_to)


# -- the gate matrix and the experts ------------------------------------------------------------


# f(-inf) == 0 (and f'(-inf) == 0): a top-k scattered into -inf and squashed by one of these is zero
# outside the top-k (softmax only along the experts; every row keeps its K finite values)
_ZERO_AT_NEG_INF = ("sigmoid", "exp", "softmax")
_FULL = ("full", "full_like", "new_full")


class GateSupport(NamedTuple):
    """A [T, E] gate matrix proven zero outside the top-k ids."""

    ids: fx.Node  # [T, K] top-k ids: the only columns of a row that may be nonzero
    values: fx.Node | None  # [T, K] the values at the ids when the graph holds them (else gather them)
    base: fx.Node | None  # the zeros / -inf tensor scattered into
    inplace_scatter: fx.Node | None  # base.scatter_(...), which no reader of the gates uses directly


def sparse_gates(gates, walk: RegionWalk) -> GateSupport:
    """The support of a gate matrix provably zero outside the top-k, or NoMatch. Forms:
    zeros.scatter(1, ids, w) (or scatter_), (one_hot(ids, E) * w[..., None]).sum(1) (or its einsum
    `einsum("tk,tke->te", w, one_hot(ids, E))`), and
    f(full(-inf).scatter(1, ids, v)) with f a sigmoid, exp or softmax over the experts (Llama 4's
    router: sigmoid of the top-k logits scattered into -inf), each through float casts."""
    gates = through_float_casts(gates, walk)
    not_sparse = (f"the gate matrix ({getattr(gates, 'name', gates)}) is not provably zero outside the top-k: only top-k "
                  f"weights scattered into zeros, one_hot(ids, E) * w summed over K, or a sigmoid / exp / softmax of "
                  f"top-k values scattered into -inf are rewritten")
    squash = None
    if is_call(gates, *_ZERO_AT_NEG_INF):
        expect(not is_call(gates, "softmax") or arg(gates, 1, "dim") in (1, -1), f"{gates.name} is a softmax across tokens")
        squash = gates
        walk.mark(gates)
        gates = through_float_casts(arg(gates, 0, "input"), walk)
    if is_call(gates, "einsum") and squash is None:  # einsum("tk,tke->te", w, one_hot(ids, E)), as written in bf16
        found = _einsum_one_hot_gates(gates, walk)
        expect(found is not None, not_sparse)
        return found
    one_hot = gates.args[0] if is_call(gates, "to", "float", "type_as") else gates  # 0/1 as floats: exact
    if is_call(one_hot, "one_hot") and squash is None:  # a top-1's ids [T] as 0/1 rows: weights 1
        ids = one_hot.args[0]
        num_classes = arg(one_hot, 1, "num_classes", -1)
        expect(len(shape_of(ids)) == len(shape_of(gates)) - 1 and num_classes == shape_of(gates)[-1],
               f"one_hot({getattr(ids, 'name', ids)}, {num_classes}) is not a [T, E] gate matrix of top-1 ids")
        walk.mark(gates, one_hot)
        return GateSupport(ids, None, None, None)
    if is_call(gates, "sum") and squash is None:  # (one_hot(ids, E) * w.unsqueeze(-1)).sum(1)
        mul = gates.args[0]
        expect(sums_dim(gates, (len(shape_of(mul)) - 2, -2)) and is_call(mul, *_MUL) and len(mul.args) == 2, not_sparse)
        for oh, wb in (mul.args, mul.args[::-1]):
            cast = oh if is_call(oh, "to", "float", "type_as") else None  # 0/1 as floats: exact
            oh = oh.args[0] if cast is not None else oh
            if is_call(oh, "one_hot"):
                num_classes = arg(oh, 1, "num_classes", -1)
                expect(num_classes == shape_of(gates)[-1], f"one_hot has num_classes={num_classes}, the gate matrix {shape_of(gates)[-1]} columns")
                walk.mark(gates, mul, oh, cast)
                return GateSupport(oh.args[0], _last_dim_broadcast(wb, walk), None, None)
        raise NoMatch(not_sparse)
    scatter = base = None
    if is_call(gates, "scatter", "scatter_"):
        scatter, base = gates, gates.args[0]
    elif is_call(gates, *ZEROS, *_FULL):
        base = gates
        inplace = [u for u in gates.users if is_call(u, "scatter_") and u.args[0] is gates]
        expect(len(inplace) == 1, not_sparse)
        scatter = inplace[0]
    fill = _fill_value(base)
    expect(scatter is not None and fill == (-math.inf if squash is not None else 0.0), not_sparse)
    expect(len(scatter.args) == 4 and not scatter.kwargs, "the gate scatter has a reduce or a scalar value")
    _, dim, ids, w = scatter.args
    expect(dim in (len(shape_of(scatter)) - 1, -1), f"the gates scatter along dim {dim}, not over the experts")
    expect(isinstance(w, fx.Node) and shape_of(w) == shape_of(ids), "the scattered values are not [T, K] weights")
    if is_call(scatter, "scatter_"):
        order = {n: i for i, n in enumerate(base.graph.nodes)}
        early = [u for u in base.users if u is not scatter and order[u] < order[scatter]]
        expect(not early, f"the gate matrix is read before its scatter (by {early[0].name if early else ''})")
        others = [u for u in base.users if u is not scatter and writes_in_place(u)]
        expect(not others, "the gate matrix is written more than once")
    walk.mark(base, scatter)
    return GateSupport(ids, w if squash is None else None, base, scatter if is_call(scatter, "scatter_") else None)


def _einsum_one_hot_gates(einsum: fx.Node, walk: RegionWalk) -> GateSupport | None:
    """The support of `einsum("tk,tke->te", w, F.one_hot(ids, E))` (any letters, either order; the
    one_hot cast to a float dtype: 0 and 1 stay exact), else None."""
    parts = einsum_parts(einsum)
    if parts is None:
        return None
    ins, operands, out = parts
    for i in (0, 1):
        oh = operands[i]
        cast = oh if is_call(oh, "to", "float", "half", "bfloat16", "type_as") else None
        oh = oh.args[0] if cast is not None else oh
        if not is_call(oh, "one_hot") or len(ins[i]) != 3 or len(ins[1 - i]) != 2:
            continue
        t, k, e = ins[i]
        if ins[1 - i] != t + k or out != t + e or arg(oh, 1, "num_classes", -1) != shape_of(einsum)[-1]:
            return None
        walk.mark(einsum, oh, cast)
        return GateSupport(oh.args[0], operands[1 - i], None, None)
    return None


def _fill_value(node) -> float | None:
    """The constant a zeros / full tensor is filled with, or None."""
    if is_call(node, *ZEROS):
        return 0.0
    if is_call(node, "full", "full_like"):
        value = arg(node, 1, "fill_value")
    elif is_call(node, "new_full"):
        value = arg(node, 2, "fill_value")
    else:
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _finish(anchor: fx.Node, gates: fx.Node, outs: list[fx.Node], walk: RegionWalk, added_to: fx.Node | None = None) -> MoEMatch:
    """The match of a combine `anchor` of expert outputs `outs` by `gates` (plus `added_to`, a term of
    the sum that is no expert's: added to the op's output)."""
    ids, topk_weights, zeros, inplace_scatter = sparse_gates(gates, walk)
    gathered = topk_weights is None  # a squashed gate matrix: the op's weights are gathered from it
    if gathered:
        topk_weights, zeros, inplace_scatter = gates, None, None
    lead = shape_of(gates)[:-1]  # the tokens' dims: [T], or [B, S] in code that never flattens them
    expect(len(lead) >= 1, f"the gate matrix {shape_of(gates)} is not [T, E]")
    flat = False  # top-1 ids [T] of a max (one_hot gates), handed to the op as [T, 1]
    if len(lead) == 1:
        E, K, flat = top_k_or_max_routing(ids, walk)
    else:
        E, K = topk_routing(ids, walk, token_dims=len(lead))
    expect(shape_of(gates)[-1] == E, f"the gate matrix {shape_of(gates)} is not [T, E={E}]")
    expect(len(outs) == E, f"{len(outs)} expert outputs are combined, the router ranks E={E}")
    expect(dtype_of(topk_weights) is not None and dtype_of(topk_weights).is_floating_point, "routing weights are not floating point")
    experts = []
    for e, y in enumerate(outs):
        experts.append(expert_mlp(through_float_casts(y, walk), walk, e, stacked=True))
    xs = {through_float_casts(ex.rows, walk) for ex in experts}
    expect(len(xs) == 1, "experts read different inputs")
    x = xs.pop()
    expect(len(shape_of(x)) == len(lead) + 1, "expert input is not [T, d]")
    d = shape_of(x)[-1]
    ids_tokens = shape_of(ids) if flat else shape_of(ids)[:-1]
    same_tokens = all(same_size(a, b) for shape in (shape_of(x)[:-1], ids_tokens, shape_of(anchor)[:-1])
                      for a, b in zip(shape, lead))
    expect(same_tokens and len(ids_tokens) == len(shape_of(anchor)) - 1 == len(lead),
           "gate matrix, ids, expert input and combined output differ in their token dims")
    expect(same_size(shape_of(anchor)[-1], d), f"combined output {shape_of(anchor)} is not [T, d]")
    T = math.prod(lead)
    match = finish_expert_match(
        IDIOM, anchor, walk, anchor, [anchor], x, ids, topk_weights, experts, E=E, K=K, T=T, d=d,
        extra_region=[inplace_scatter] if inplace_scatter is not None else [],
        shape_only=[zeros] if zeros is not None else [], gates=gathered, added_to=added_to, token_dims=len(lead) > 1,
    )
    match.flat_top1 = flat
    return match
