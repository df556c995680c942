"""Canonical forms of routing: which rows an expert gets and what scales them, spelled as a count of
one_hot slots, as the nonzeros of a gate matrix, as a gate matrix read at (rows, column), or as one
scale applied to the sum of every expert's rows; and every expert's outputs read at the top-k ids. Rules of `patterns.canonical` (which runs them with
the others and states what a rule must keep); each brings a spelling to the form `expert_loop`
reads: `tok, k = torch.where(ids == e)`, `w[tok, k, None]`, the product before the add.

Rules (eager spelling -> canonical form; ids [T, K] the indices of a top-k over E scores):

    F.one_hot(ids, E)[:, :, e].sum(1) > 0          ->  (ids == e).any(-1)
        # also `!= 0`, `>= 1`, `.any(1)` of the column, `F.one_hot(ids, E).sum(1)[:, e] > 0` and
        # `(ids == e).sum(-1) > 0`: a count of the slots holding e is positive exactly when one does
    G[:, e] != 0                                   ->  (ids == e).any(-1)
        # G a [T, E] gate matrix zero outside the top-k (`dense_experts.sparse_gates`: top-k weights
        # scattered into zeros, one_hot(ids) * w summed over K, a softmax / sigmoid / exp of top-k
        # logits scattered into -inf). Only where the rows the mask selects are read as rows
        # (`v[tok]`, `index_select`), among them the rows of G's column e, and added into rows
        # (`index_add`, `out[m] += y`; never assigned): a row whose top-k weight is exactly 0 (an underflowed softmax) is then
        # added as 0 * y, the same sum wherever the expert's output is finite (that weight's
        # gradient is then <dy, y> where eager's skipped row gives it none: the same router gradient
        # where the weight's own derivative is 0 at 0, as an underflowed softmax's or sigmoid's is)
    G[tok, e], G[tok, e:e+1]                        ->  G[:, e][tok], G[:, e:e+1][tok]
        # G such a gate matrix, tok 1-D integer rows: the same elements (`canonical`'s
        # gate_column_rows_to_weights then reads them as w[tok, k])
    out = zeros(T, d); out[tok_e] = y_e ...; out * s[:, None]
                                                   ->  out[tok_e] = y_e * s[tok_e, None] ...; out
        # one scale per token applied after every expert of a top-1 router wrote its rows (a Switch
        # layer scaled by its router probability after the loop): rows `ids == e` or
        # torch.where(ids == e)[0] of [T] max indices, written by `out[rows] = y`, `out.index_add_(0,
        # rows, y)` (or an `index_add` chain) into a fresh zeros nothing else reads. Each written row is
        # scaled once (index_add: the sum of scaled terms, up to rounding), a row never written is
        # 0 either way (for a finite scale); the product keeps out's dtype and shape
    buf.index_copy_(0, torch.where(m)[0], y)       ->  buf[m] = y
        # m a 1-D boolean mask over buf's rows: the same rows written with the same values
    arange(T).repeat_interleave(K)[torch.where(m)[0]]  ->  torch.where(m)[0] // K
        # each slot's token read from copies of arange(T) (m over the T * K slots): slot p's is p // K
    x[torch.where(m)[0] // K]                      ->  x.repeat_interleave(K, 0)[m]
        # m over the T * K slots of flattened [T, K] ids, x [T, d]: slot p is token p // K (the
        # form `repeat_loop` reads: rows of x repeated K times, selected by `flat == e`)
    zeros.masked_scatter(m[:, None].expand_as(zeros), y)  ->  zeros.index_add(0, torch.where(m)[0], y)
        # m = (ids == e).any(-1), y with as many rows as a read x[m]: y's rows in order into the
        # rows where m holds
    a + zeros.index_add(0, tok, y)                 ->  a.index_add(0, tok, y)
        # the zeros and the index_add read by nothing else: the same row sums
    (Y[arange(T)[:, None], ids] * w[..., None]).sum(1)  ->  (Y * G[..., None]).sum(1),
                                                       G = zeros_like(scores, dtype=w.dtype).scatter(1, ids, w)
        # Y [T, E, d] every expert's output for every token (token-major), read at each token's
        # top-k ids (`torch.gather(Y, 1, ids[..., None].expand(-1, -1, d))` too) and weighted: the
        # same terms plus zeros, as a gate matrix the dense finders read (they then compute sparsely)
    zeros(T, E).scatter_(1, ids[:, None], 1)      ->  F.one_hot(ids, E).to(dtype)
        # ids top-k/max indices, the zeros fresh and read after the ones alone (fairseq's one_hot)
    i1 = s1.argmax(-1); s2.masked_fill(one_hot(i1).bool(), -inf).argmax(-1)  ->  torch.topk(s2, 2)
        # s1 is s2 or a float32/float64 softmax of it; ties as topk leaves them (fairseq's top2gating)
    w0 * one_hot(ids[:, 0], E) + ... + w_{K-1} * one_hot(ids[:, K-1], E)
                                                   ->  (one_hot(ids, E) * cat(w_k).unsqueeze(-1)).sum(1)
        # every slot once: at most one nonzero term an entry
    z.index_copy(0, where(m0)[0], v0).index_copy(0, where(m1)[0], v1)  ->  z[m0] = v0; z[m1] = v1; z
        # z fresh zeros, each link read by the next alone
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .canonical_layout import arange_as, arange_copies
from .common import (ZEROS, NoMatch, RegionWalk, arg, dtype_of, example_value, flattens_indices, getitem_of,
                     insert_call, is_call, is_getitem, is_int, same_shape, same_size, shape_of, unit_slice, writes_in_place)
from .dense_experts import sparse_gates, sums_dim
from .verify import nonnegative

_POSITIVE = {("gt", 0), ("ne", 0), ("ge", 1)}  # count > 0, count != 0, count >= 1: some slot holds e
_FLIPPED = {"gt": "lt", "ne": "ne", "ge": "le"}  # 0 < count, 0 != count, 1 <= count
_COMPARE = {"gt": ("gt", "__gt__"), "ne": ("ne", "__ne__"), "ge": ("ge", "__ge__"),
            "lt": ("lt", "__lt__"), "le": ("le", "__le__")}


def _positive_test(node) -> fx.Node | None:
    """c when node is `c > 0`, `c != 0` or `c >= 1` (either side: `0 < c`...), else None."""
    if not isinstance(node, fx.Node) or node.kwargs or len(node.args) != 2:
        return None
    for name, names in _COMPARE.items():
        if not is_call(node, *names):
            continue
        a, b = node.args
        if isinstance(a, fx.Node) and (name, b) in _POSITIVE:
            return a
        if isinstance(b, fx.Node) and any(_FLIPPED[p] == name and a == v for p, v in _POSITIVE):
            return b
    return None


def _range_of(ids):
    from .canonical import _range_of as range_of  # canonical imports this module

    return range_of(ids) if isinstance(ids, fx.Node) else None


def _slot_count(count) -> tuple[fx.Node, int] | None:
    """(ids, e) when `count` counts, per token, the slots of [T, K] top-k ids holding expert e:
    `F.one_hot(ids, E)[:, :, e].sum(1)` (or `[..., e]`, sum(-1) of the [T, K] column),
    `F.one_hot(ids, E).sum(1)[:, e]` or `(ids == e).sum(-1)`."""
    if is_getitem(count) and isinstance(count.args[1], tuple) and len(count.args[1]) == 2:
        summed, (rows, e) = count.args[0], count.args[1]  # one_hot(ids, E).sum(1)[:, e]
        if rows == slice(None) and is_int(e) and is_call(summed, "sum") and sums_dim(summed, (1, -2)):
            found = _one_hot_ids(summed.args[0])
            if found is not None and 0 <= e < found[1]:
                return found[0], e
        return None
    if not (is_call(count, "sum") and sums_dim(count, (1, -1))):
        return None
    column = count.args[0]
    if is_call(column, "eq", "__eq__") and len(column.args) == 2 and not column.kwargs:  # (ids == e).sum(-1)
        ids, e = column.args if isinstance(column.args[0], fx.Node) else column.args[::-1]
        E = _range_of(ids)
        if E is not None and is_int(e) and 0 <= e < E and len(shape_of(ids)) == 2:
            return ids, e
        return None
    return _one_hot_column(column)


def _one_hot_column(column) -> tuple[fx.Node, int] | None:
    """(ids, e) when `column` is `F.one_hot(ids, E)[:, :, e]` (or `[..., e]`): the [T, K] slots
    holding expert e, e a constant in [0, E)."""
    if not (is_getitem(column) and isinstance(column.args[1], tuple)
            and column.args[1][:-1] in ((slice(None), slice(None)), (Ellipsis,))):
        return None
    e, found = column.args[1][-1], _one_hot_ids(column.args[0])
    return (found[0], e) if found is not None and is_int(e) and 0 <= e < found[1] else None


def _one_hot_ids(one_hot) -> tuple[fx.Node, int] | None:
    """(ids, E) when `one_hot` is F.one_hot(ids, E) of [T, K] top-k ids over E scores."""
    if not is_call(one_hot, "one_hot"):
        return None
    ids, E = one_hot.args[0], arg(one_hot, 1, "num_classes", -1)
    if not is_int(E) or _range_of(ids) != E or len(shape_of(ids)) != 2:
        return None
    return ids, E


def _any_hit(gm: fx.GraphModule, node: fx.Node, ids: fx.Node, e: int) -> fx.Node:
    hit = insert_call(gm, node, operator.eq, (ids, e))
    return insert_call(gm, node, torch.any, (hit, -1))


def one_hot_count_to_any_hit(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`F.one_hot(ids, E)[:, :, e].sum(1) > 0` (the spellings `_slot_count` reads, compared by
    `_positive_test`, or the column's `.any(1)`) -> `(ids == e).any(-1)`: a token's count of slots
    holding e is positive exactly when one of its slots holds e. Exact for ids in [0, E)."""
    if is_call(node, "any") and len(node.args) + len(node.kwargs) == 2 and arg(node, 1, "dim") in (1, -1):
        found = _one_hot_column(node.args[0])  # one_hot(ids, E)[:, :, e].any(1)
    else:
        count = _positive_test(node)
        found = _slot_count(count) if count is not None else None
    if found is None or len(shape_of(node)) != 1:
        return None
    ids, e = found
    node.replace_all_uses_with(_any_hit(gm, node, ids, e))
    return f"{node.name} -> ({ids.name} == {e}).any(-1)"


# --- the nonzeros of a gate matrix's column -----------------------------------------------------

_ROW_READS = ("index_select",)
_ROW_ADDS = ("index_add", "index_add_")


def _gate_support(gates) -> tuple[fx.Node, fx.Node | None] | None:
    """(ids, values or None) of a [T, E] gate matrix provably zero outside [T, K] top-k ids, with E
    the ids' range; else None."""
    if not isinstance(gates, fx.Node) or len(shape_of(gates)) != 2:
        return None
    try:  # the finders' own proof of sparsity
        support = sparse_gates(gates, RegionWalk())
    except NoMatch:
        return None
    E = _range_of(support.ids)
    if E is None or not same_size(shape_of(gates)[1], E) or not same_shape(shape_of(support.ids)[:1], shape_of(gates)[:1]):
        return None
    return support.ids, support.values


def _gate_column(column) -> tuple[fx.Node, int] | None:
    """(G, e) when `column` is G[:, e] of a sparse [T, E] gate matrix."""
    if not (is_getitem(column) and isinstance(column.args[1], tuple) and len(column.args[1]) == 2):
        return None
    rows, e = column.args[1]
    if rows != slice(None) or not is_int(e):
        return None
    return (column.args[0], e) if _gate_support(column.args[0]) is not None else None


def _rows_of(mask: fx.Node) -> list[fx.Node] | None:
    """The row indices a 1-D mask selects, as the graph reads them: `torch.where(m)[0]`,
    `m.nonzero()` squeezed or flattened, or m itself as an index; None if any other use reads m."""
    rows = []
    for user in mask.users:
        if is_call(user, "where") and len(user.args) == 1 and not user.kwargs:
            for u in user.users:
                if not (is_getitem(u) and u.args[1] == 0):
                    return None
                rows.append(u)
        elif is_call(user, "nonzero", "argwhere") and len(user.args) == 1 and not user.kwargs:
            for u in user.users:
                if _only_asserted(u):
                    rows.append(u)
                    continue
                if not (flattens_indices(u, user) or (is_getitem(u) and u.args[1] == (slice(None), 0))):
                    return None
                rows.append(u)
        elif (is_getitem(user) and (user.args[1] is mask or (isinstance(user.args[1], tuple) and user.args[1]
                                                            and user.args[1][0] is mask))) or _added_in_place(user, mask):
            rows.append(mask)  # v[m], v[m, None], out[m] += y: m itself selects the rows
        else:
            return None
        if is_call(user, "nonzero", "argwhere"):
            rows = [r for r in rows if not _only_asserted(r)]  # Dynamo's checks of nonzero's count
    return rows


def _only_asserted(node: fx.Node) -> bool:
    """`node` is a size Dynamo reads only to assert bounds on it (`sym_size` -> `ge`/`le` ->
    `_assert_scalar`): no value of the graph depends on it."""
    if node.target is not torch.ops.aten.sym_size.int:
        return False
    return all(all(u.target is torch.ops.aten._assert_scalar.default for u in check.users) for check in node.users)


def _reads_only_rows(rows: list[fx.Node], mask: fx.Node, column: fx.Node) -> bool:
    """Every use of the selected rows reads rows of a tensor or adds into rows, and some use reads
    the rows of the gate column itself (so the rows come with their weights)."""
    weights_read = False
    for tok in set(rows):
        for user in tok.users:
            if _only_asserted(user):
                continue  # Dynamo's checks of the row count
            if is_getitem(user) and (user.args[1] is tok or (isinstance(user.args[1], tuple) and user.args[1]
                                                               and user.args[1][0] is tok and user.args[0] is not tok)):
                weights_read |= _same_column(user.args[0], column) or (
                    isinstance(user.args[1], tuple) and user.args[0] is column.args[0]
                    and user.args[1][1:] in ((column.args[1][1],), (column.args[1][1], None),
                                             (slice(column.args[1][1], column.args[1][1] + 1),)))
                continue
            if is_call(user, *_ROW_READS) and len(user.args) == 3 and user.args[1] in (0, -2) and user.args[2] is tok:
                weights_read |= _same_column(user.args[0], column)
                continue
            if is_call(user, *_ROW_ADDS) and len(user.args) >= 3 and user.args[1] == 0 and user.args[2] is tok:
                continue
            if tok is mask and _added_in_place(user, mask):
                continue
            if not (tok is mask and (is_call(user, "where", "nonzero", "argwhere"))):
                return False
    return weights_read


def _added_in_place(node: fx.Node, mask: fx.Node) -> bool:
    """`out[m] += y` (Dynamo: `out[m] = iadd(out[m], y)`) or `out[m] = out[m] + y`: rows added to,
    where adding 0 leaves a row as it was (an assignment `out[m] = y` would overwrite it)."""
    if not (node.op == "call_function" and node.target is operator.setitem and node.args[1] is mask):
        return False
    value = node.args[2]
    if not (is_call(value, "iadd", "add", "__add__", "__iadd__") and len(value.args) == 2):
        return False
    read = value.args[0]
    return is_getitem(read) and read.args[0] is node.args[0] and read.args[1] is mask


def _same_column(read, column: fx.Node) -> bool:
    """`read` is `column` (G[:, e]) or another G[:, e] of the same G (Dynamo gives each its node)."""
    return read is column or (is_getitem(read) and read.args[0] is column.args[0] and read.args[1] == column.args[1])


def gate_nonzero_to_any_hit(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`G[:, e] != 0` -> `(ids == e).any(-1)` for a gate matrix G zero outside the top-k ids, when
    the selected rows are only read as rows (among them G's column e) and added into rows: see the
    module docstring for why a zero weight inside the top-k keeps the sum. `G[:, e] > 0` too where
    G's weights are provably never negative (`verify.nonnegative`: a softmax's, normalised or not),
    so that > 0 and != 0 select the same rows."""
    column = _positive_test(node) if is_call(node, "ne", "__ne__", "gt", "__gt__", "lt", "__lt__") else None
    found = _gate_column(column) if column is not None else None
    if found is None or len(shape_of(node)) != 1:
        return None
    gates, e = found
    rows = _rows_of(node)
    if not rows or not _reads_only_rows(rows, node, column):
        return None
    ids, values = _gate_support(gates)
    if not is_call(node, "ne", "__ne__") and values is not None and not nonnegative(values):
        return None
    node.replace_all_uses_with(_any_hit(gm, node, ids, e))
    return f"{node.name} -> ({ids.name} == {e}).any(-1)"


def gate_rows_column_to_column_rows(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`G[tok, e]` (or `G[tok, e:e+1]`, `G[tok, e, None]`) -> `G[:, e][tok]` (`G[:, e:e+1][tok]`,
    `G[:, e][tok, None]`) for a sparse gate matrix G and 1-D integer rows tok: the same elements."""
    if not (is_getitem(node) and isinstance(node.args[1], tuple) and len(node.args[1]) in (2, 3)):
        return None
    gates, (tok, e, *last) = node.args[0], node.args[1]
    if last not in ([], [None]) or (last and not is_int(e)):
        return None
    if not (is_int(e) or unit_slice(e) is not None) or not isinstance(tok, fx.Node) or len(shape_of(tok)) != 1:
        return None
    dtype = dtype_of(tok)
    if dtype is None or dtype.is_floating_point or dtype == torch.bool or _gate_support(gates) is None:
        return None
    column = insert_call(gm, node, operator.getitem, (gates, (slice(None), e)))
    picked = insert_call(gm, node, operator.getitem, (column, (tok, None) if last else tok))
    node.replace_all_uses_with(picked)
    order[picked] = order[node]
    return (f"{node.name} -> {gates.name}[:, {e if is_int(e) else f'{e.start}:{e.stop}'}]"
            f"[{tok.name}{', None' if last else ''}]")


# --- one scale for the rows of every expert, applied after the loop -----------------------------

_MUL = ("mul", "__mul__", "__rmul__")


def _row_writes(acc: fx.Node, until: fx.Node, order: dict) -> list[tuple[fx.Node, int]] | None:
    """(writer, position of its value argument) for every write of rows into `acc` before `until`,
    when acc is a fresh 2-D zeros that nothing else reads: `acc[rows] = y`, `acc.index_add_(0, rows,
    y)`, or a chain of functional `index_add(0, rows, y)` ending in `until`'s operand."""
    chain = []
    while is_call(acc, "index_add") and len(acc.args) == 4 and acc.args[1] == 0 and not acc.kwargs:
        if len(acc.users) != 1:
            return None
        chain.append((acc, 3))
        acc = acc.args[0]
    if not is_call(acc, *ZEROS) or len(shape_of(acc)) != 2:
        return None
    writes = []
    for user in acc.users:
        if chain and user is chain[-1][0]:
            continue
        if user is until and not chain:
            continue
        if order.get(user, len(order)) > order[until]:
            return None
        if user.op == "call_function" and user.target is operator.setitem and user.args[0] is acc:
            writes.append((user, 2))
        elif is_call(user, "index_add_") and len(user.args) == 4 and user.args[1] == 0 and not user.kwargs \
                and user.args[0] is acc and not user.users:
            writes.append((user, 3))
        else:
            return None
    return writes + chain


def _top1_rows(index) -> bool:
    """`index` selects the tokens of one expert of a top-1 router: the mask `ids == e` or
    `torch.where(ids == e)[0]`, ids the [T] indices of a max (or top-1) over E scores. (Rows of
    other kinds, slots of flattened top-k ids, keep their scale where it is: `repeat_loop` reads it
    after the loop.)"""
    index = _where_rows(index) or index
    if not (is_call(index, "eq", "__eq__") and len(index.args) == 2 and not index.kwargs):
        return False
    ids, e = index.args if isinstance(index.args[0], fx.Node) else index.args[::-1]
    E = _range_of(ids)
    return E is not None and is_int(e) and 0 <= e < E and len(shape_of(ids)) == 1


def scale_after_row_writes_to_scaled_rows(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`acc * s[:, None]` (s [T]; or `s.unsqueeze(-1)`, `s.view(-1, 1)`, `s.reshape(-1, 1)`) with acc
    a fresh [T, d] zeros written only by row writes before it -> each write's value scaled by
    `s[rows, None]`, and acc itself: see the module docstring."""
    if not is_call(node, *_MUL) or len(node.args) != 2 or node.kwargs:
        return None
    for acc, scale in (node.args, node.args[::-1]):
        if not isinstance(acc, fx.Node) or not isinstance(scale, fx.Node):
            continue
        s = _column_of_vector(scale)
        if s is None or len(shape_of(acc)) != 2 or not same_size(shape_of(s)[0], shape_of(acc)[0]):
            continue
        if dtype_of(node) != dtype_of(acc) or not same_shape(shape_of(node), shape_of(acc)):
            continue  # the product promotes or broadcasts: not the accumulator's value scaled
        writes = _row_writes(acc, node, order)
        if not writes or not all(_top1_rows(w.args[1] if pos == 2 else w.args[2]) for w, pos in writes):
            continue
        for writer, pos in writes:
            rows = writer.args[1] if pos == 2 else writer.args[2]
            picked = insert_call(gm, writer, operator.getitem, (s, (rows, None)))
            scaled = insert_call(gm, writer, operator.mul, (writer.args[pos], picked))
            writer.args = (*writer.args[:pos], scaled, *writer.args[pos + 1:])
        node.replace_all_uses_with(acc)
        return f"{node.name} -> {acc.name}, its {len(writes)} row writes scaled by {s.name}"
    return None


def _column_of(column) -> fx.Node | None:
    """s when `column` is the [T, 1] column of a 1-D s: s[:, None], s.unsqueeze(-1), s.view(-1, 1),
    s.reshape(-1, 1) (or (T, 1))."""
    s = None
    if is_getitem(column) and column.args[1] in ((slice(None), None), (Ellipsis, None)):
        s = column.args[0]
    elif is_call(column, "unsqueeze") and arg(column, 1, "dim") in (-1, 1) and len(column.args) + len(column.kwargs) == 2:
        s = column.args[0]
    elif is_call(column, "view", "reshape") and len(shape_of(column)) == 2 and shape_of(column)[1] == 1:
        s = column.args[0]
    if not isinstance(s, fx.Node) or len(shape_of(s)) != 1 or writes_in_place(column):
        return None
    return s if isinstance(example_value(s), torch.Tensor) else None


def _column_of_vector(scale: fx.Node) -> fx.Node | None:
    """s when `scale` is the [T, 1] column (`_column_of`) of a 1-D floating s."""
    s = _column_of(scale)
    dtype = dtype_of(s) if s is not None else None
    return s if dtype is not None and dtype.is_floating_point else None


# --- slots of flattened top-k ids: rows written by position, tokens read by position // K --------

_FLOOR_DIV = ("floordiv", "floor_divide", "__floordiv__")


def floor_division(index) -> tuple[fx.Node, int] | None:
    """(a, K) when `index` is `a // K` (`torch.floor_divide`, `torch.div(a, K, rounding_mode="floor")`)
    of a node a by a positive int K; else None."""
    floor = is_call(index, *_FLOOR_DIV) and len(index.args) == 2 and not index.kwargs
    floor |= is_call(index, "div") and len(index.args) == 2 and index.kwargs == {"rounding_mode": "floor"}
    if not floor or not isinstance(index.args[0], fx.Node) or not is_int(index.args[1]) or index.args[1] < 1:
        return None
    return index.args[0], index.args[1]


def repeated_rows(gm: fx.GraphModule, x: fx.Node, K: int) -> fx.Node:
    """`x.repeat_interleave(K, dim=0)`, made once per (x, K) and graph, right after x."""
    made = gm.meta.setdefault("sonic_slot_repeats", {})
    if (x, K) not in made or made[(x, K)].graph is not gm.graph:
        at = x.next if x.op != "placeholder" else next(n for n in gm.graph.nodes if n.op != "placeholder")
        made[(x, K)] = insert_call(gm, at, torch.repeat_interleave, (x, K), {"dim": 0})
    return made[(x, K)]


def _where_rows(index) -> fx.Node | None:
    """m when `index` is `torch.where(m)[0]` of a 1-D boolean m: its True positions, ascending."""
    if not (is_getitem(index) and index.args[1] == 0):
        return None
    where = index.args[0]
    if not (is_call(where, "where") and len(where.args) == 1 and not where.kwargs):
        return None
    m = where.args[0]
    return m if isinstance(m, fx.Node) and dtype_of(m) == torch.bool and len(shape_of(m)) == 1 else None


def position_copy_to_mask_write(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`buf.index_copy_(0, torch.where(m)[0], y)` -> `buf[m] = y` for a 1-D boolean m over buf's
    rows: both write y's rows, in order, to the rows where m is True (the positions are distinct)."""
    if not (is_call(node, "index_copy_") and len(node.args) == 4 and node.args[1] == 0 and not node.kwargs):
        return None
    buf, index, y = node.args[0], node.args[2], node.args[3]
    m = _where_rows(index)
    if m is None or node.users or len(shape_of(buf)) != 2 or not same_size(shape_of(m)[0], shape_of(buf)[0]):
        return None
    twin = insert_call(gm, node, operator.setitem, (buf, m, y))
    twin.meta.pop("example_value", None)
    order[twin] = order[node]
    order.pop(node)
    gm.graph.erase_node(node)  # an effect: _erase_if_dead would keep it
    return f"{node.name} -> {buf.name}[{m.name}] = {y.name}"


def row_write(node) -> tuple[fx.Node, object, object] | None:
    """(base, rows, value) of a write of whole rows: `base[rows] = value` (setitem), `index_put_` or
    `index_put` at `(rows,)` (no accumulate), `index_copy_` or `index_copy` along dim 0."""
    if node.op == "call_function" and node.target is operator.setitem and len(node.args) == 3:
        return node.args[0], node.args[1], node.args[2]
    if is_call(node, "index_put", "index_put_") and len(node.args) == 3 and not node.kwargs \
            and isinstance(node.args[1], (tuple, list)) and len(node.args[1]) == 1:
        return node.args[0], node.args[1][0], node.args[2]
    if is_call(node, "index_copy", "index_copy_") and len(node.args) == 4 and node.args[1] == 0 and not node.kwargs:
        return node.args[0], node.args[2], node.args[3]
    return None


def row_mask(index) -> fx.Node | None:
    """m when `index` selects the rows where a 1-D boolean m holds: m itself or `torch.where(m)[0]`."""
    if isinstance(index, fx.Node) and len(shape_of(index)) == 1 and dtype_of(index) == torch.bool:
        return index
    return _where_rows(index)


def _functional_row_write(node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(base, m, value) of `base.index_copy(0, torch.where(m)[0], value)` or `base.index_put((rows,),
    value)` (rows `torch.where(m)[0]` or m itself), m a 1-D boolean mask over base's rows."""
    found = row_write(node) if is_call(node, "index_copy", "index_put") else None
    if found is None:
        return None
    base, index, value = found
    m = row_mask(index)
    if m is None or not isinstance(base, fx.Node) or not same_size(shape_of(m)[0], shape_of(base)[0]):
        return None
    return base, m, value


def functional_row_writes_to_mask_writes(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`z.index_copy(0, torch.where(m0)[0], v0).index_copy(0, torch.where(m1)[0], v1)...` (or
    `index_put((rows,), v)`) on fresh zeros z -> `z[m0] = v0; z[m1] = v1; ...; z`: each link writes
    its value's rows, in order, to the rows where its mask holds, into a copy of the previous one
    that nothing else reads, so writing into z itself gives the same final value (megablocks' and
    Megatron's loops over experts, written functionally)."""
    found = _functional_row_write(node)
    if found is None or not is_call(found[0], *ZEROS) or len(found[0].users) != 1:
        return None
    z = found[0]
    chain = [(node, found)]
    while len(chain[-1][0].users) == 1:
        nxt = next(iter(chain[-1][0].users))
        link = _functional_row_write(nxt)
        if link is None or link[0] is not chain[-1][0]:
            break
        chain.append((nxt, link))
    for link, (_, m, value) in chain:
        write = insert_call(gm, link, operator.setitem, (z, m, value))
        write.meta.pop("example_value", None)
        order[write] = order[link]
    chain[-1][0].replace_all_uses_with(z)
    for link, _ in reversed(chain):
        order.pop(link, None)
        gm.graph.erase_node(link)
    return f"{node.name} .. {chain[-1][0].name} -> {len(chain)} mask writes into {z.name}"


def slot_token_rows_to_repeat(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`x[torch.where(m)[0] // K]` (or `index_select(x, 0, ...)`, `div(..., rounding_mode="floor")`)
    with x [T, d] and m [T * K] -> `x.repeat_interleave(K, 0)[m]`: slot p of flattened [T, K] ids
    belongs to token p // K, and row p of the repeat is x[p // K]. The repeat is made once per
    (x, K), right after x."""
    if is_getitem(node) and len(node.args) == 2:
        x, index = node.args
    elif is_call(node, "index_select") and len(node.args) == 3 and node.args[1] == 0 and not node.kwargs:
        x, index = node.args[0], node.args[2]
    else:
        return None
    divided = floor_division(index)
    if divided is None or not isinstance(x, fx.Node) or len(shape_of(x)) != 2:
        return None
    positions, K = divided
    m = _where_rows(positions)
    if m is None or not same_size(shape_of(m)[0], shape_of(x)[0] * K):
        return None
    picked = insert_call(gm, node, operator.getitem, (repeated_rows(gm, x, K), m))
    node.replace_all_uses_with(picked)
    order[picked] = order[node]
    return f"{node.name} -> {x.name}.repeat_interleave({K}, 0)[{m.name}]"


def tiled_rows_to_repeat(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`x.view(T, 1, d).repeat(1, K, 1).reshape(T * K, d)` (x[:, None] or x.unsqueeze(1) for the view,
    `.expand(T, K, d)` for the repeat, `view` for the reshape) with x [T, d] ->
    `x.repeat_interleave(K, 0)`: row t * K + k of both is x[t] (vLLM's reference MoE copies each token
    for its K slots so). The repeat is made once per (x, K), right after x."""
    if not is_call(node, "reshape", "view") or len(shape_of(node)) != 2:
        return None
    tiled = node.args[0]
    if not (is_call(tiled, "repeat", "expand") and isinstance(tiled.args[0], fx.Node)):
        return None
    column = tiled.args[0]
    x = _unit_column_of(column)
    if x is None:
        return None
    T, d = shape_of(x)
    shape = shape_of(tiled)
    if len(shape) != 3 or not (same_size(shape[0], T) and same_size(shape[2], d)) or not is_int(shape[1]):
        return None
    if is_call(tiled, "repeat"):  # repeat(1, K, 1) (or as one tuple): copies along the unit dim alone
        counts = tiled.args[1] if len(tiled.args) == 2 and isinstance(tiled.args[1], (tuple, list)) else tiled.args[1:]
        if tuple(counts) != (1, shape[1], 1) or tiled.kwargs:
            return None
    K = shape[1]
    if not (same_size(shape_of(node)[0], T * K) and same_size(shape_of(node)[1], d)) or dtype_of(node) != dtype_of(x):
        return None
    rows = repeated_rows(gm, x, K)
    node.replace_all_uses_with(rows)
    return f"{node.name} -> {x.name}.repeat_interleave({K}, 0)"


def _unit_column_of(node) -> fx.Node | None:
    """x when `node` is a [T, d] x with a unit dim inserted at 1: `x.view(T, 1, d)` (or -1 for the 1,
    or reshape), `x.unsqueeze(1)`, `x[:, None]`, `x[:, None, :]`; else None."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    x = node.args[0]
    shape, base = shape_of(node), shape_of(x)
    if len(base) != 2 or len(shape) != 3 or shape[1] != 1 or not (same_size(shape[0], base[0]) and same_size(shape[2], base[1])):
        return None
    if is_call(node, "view", "reshape") or (is_call(node, "unsqueeze") and node.args[1:] in ((1,), (-2,))):
        return x
    if is_getitem(node) and node.args[1] in ((slice(None), None), (slice(None), None, slice(None))):
        return x
    return None


def copies_at_slots_to_floor_div(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`arange(T).repeat_interleave(K)[torch.where(m)[0]]` (any `arange_copies` spelling of each
    slot's token, read by `index_select` too) with m [T * K] -> `torch.where(m)[0] // K`: entry p of
    the copies is p // K, and the positions of m lie in [0, T * K)."""
    if is_getitem(node) and len(node.args) == 2:
        copies_node, positions = node.args
    elif is_call(node, "index_select") and len(node.args) == 3 and node.args[1] in (0, -1) and not node.kwargs:
        copies_node, positions = node.args[0], node.args[2]
    else:
        return None
    if not isinstance(copies_node, fx.Node) or len(shape_of(copies_node)) != 1 or not isinstance(positions, fx.Node):
        return None
    copies = arange_copies(copies_node)
    m = _where_rows(positions)
    if copies is None or not copies.interleaved or m is None or dtype_of(copies_node) != dtype_of(positions):
        return None
    if not (is_int(copies.copies) and same_size(shape_of(m)[0], shape_of(copies_node)[0])):
        return None
    token = insert_call(gm, node, operator.floordiv, (positions, copies.copies))
    order[token] = order[node]
    node.replace_all_uses_with(token)
    return f"{node.name} -> {positions.name} // {copies.copies}"


# --- rows put back by masked_scatter, sums of row adds into zeros ---------------------------------

def masked_scatter_rows_to_index_add(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`z.masked_scatter(m.unsqueeze(-1).expand_as(z), y)` (or `m[:, None].expand(-1, d)`, `.expand(T, d)`)
    with z a fresh [T, d] zeros and m = `(ids == e).any(-1)` of top-k ids -> `z.index_add(0, tok, y)`,
    tok = torch.where(m)[0] (then torch.where(ids == e)[0] by `any_hit_where_to_hit_where`): the
    expanded mask takes y's elements row by row into the rows where m holds, in order, which is y's
    row i added to zero row tok[i]. Only where y has exactly those rows (the count of a read `v[m]`)."""
    from .canonical import _any_expert_hit, _where_before, _where_output_before

    if not (is_call(node, "masked_scatter") and len(node.args) == 3 and not node.kwargs):
        return None
    z, wide, y = node.args
    if not (is_call(z, *ZEROS) and len(shape_of(z)) == 2 and list(z.users) == [node]) or len(shape_of(y)) != 2:
        return None
    if not (is_call(wide, "expand", "expand_as") and isinstance(wide.args[0], fx.Node) and same_shape(shape_of(wide), shape_of(z))):
        return None
    column = wide.args[0]
    m = None
    if is_call(column, "unsqueeze") and arg(column, 1, "dim") in (-1, 1):
        m = column.args[0]
    elif is_getitem(column) and column.args[1] in ((slice(None), None), (Ellipsis, None)):
        m = column.args[0]
    hit = _any_expert_hit(m) if isinstance(m, fx.Node) else None
    if hit is None or not same_size(shape_of(m)[0], shape_of(z)[0]) or not same_size(shape_of(y)[1], shape_of(z)[1]):
        return None
    # y's rows are as many as the mask's True rows: a read v[m] of the mask has y's row count (runs
    # before `boolean_index_to_where`, which gives v[m] a torch.where's fresh count)
    if not any(is_getitem(u) and u.args[1] is m and same_size(shape_of(u)[0], shape_of(y)[0]) for u in m.users):
        return None
    tok = _where_output_before(gm, _where_before(gm, m, node, order), 0, node, order)
    added = insert_call(gm, node, torch.index_add, (z, 0, tok, y))
    node.replace_all_uses_with(added)
    order[added] = order[node]
    return f"{node.name} -> {z.name}.index_add(0, {tok.name}, {y.name})"


def add_of_rows_into_zeros_to_index_add(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`a + z.index_add(0, tok, y)` with z a fresh zeros read by that index_add alone, whose result
    the add alone reads -> `a.index_add(0, tok, y)`: each row of a gets the same rows of y (a + (0 +
    y) is a + y; rows of y at one token summed in another order where tok repeats)."""
    if not is_call(node, "add", "__add__") or len(node.args) != 2 or node.kwargs:
        return None
    for a, added in (node.args, node.args[::-1]):
        if not (isinstance(a, fx.Node) and is_call(added, "index_add") and len(added.args) == 4 and added.args[1] == 0
                and not added.kwargs and list(added.users) == [node]):
            continue
        z = added.args[0]
        if not (is_call(z, *ZEROS) and list(z.users) == [added]):
            continue
        if not same_shape(shape_of(a), shape_of(node)) or dtype_of(a) != dtype_of(node) or dtype_of(z) != dtype_of(node):
            continue
        twin = insert_call(gm, node, torch.index_add, (a, 0, added.args[2], added.args[3]))
        node.replace_all_uses_with(twin)
        order[twin] = order[node]
        return f"{node.name} -> {a.name}.index_add(0, {added.args[2].name}, ...)"
    return None


def _token_rows_at(sel) -> tuple[fx.Node, fx.Node] | None:
    """(Y [T, E, d], ids [T, K]) when sel [T, K, d] holds each token's outputs at its top-k ids:
    `Y[arange(T)[:, None], ids]` (any [T, 1] spelling of the arange, a trailing `:` too) or
    `torch.gather(Y, 1, ids[..., None].expand(-1, -1, d))` (`unsqueeze(-1)`, `expand(T, K, d)`)."""
    if not isinstance(sel, fx.Node) or len(shape_of(sel)) != 3:
        return None
    if is_getitem(sel) and isinstance(sel.args[1], tuple) and len(sel.args[1]) in (2, 3):
        Y, (col, ids, *rest) = sel.args[0], sel.args[1]
        if rest not in ([], [slice(None)]) or not isinstance(ids, fx.Node) or len(shape_of(ids)) != 2:
            return None
        T = arange_as(col, 1)
        ok = T is not None and len(shape_of(Y)) == 3 and same_size(shape_of(Y)[0], T) and same_size(shape_of(ids)[0], T)
        return (Y, ids) if ok else None
    if is_call(sel, "gather") and arg(sel, 1, "dim") in (1, -2) and not arg(sel, 3, "sparse_grad", False):
        Y, idx = arg(sel, 0, "input"), arg(sel, 2, "index")
        if not (is_call(idx, "expand") and isinstance(Y, fx.Node) and len(shape_of(Y)) == 3):
            return None
        column = idx.args[0]
        if not (is_call(column, "unsqueeze") and arg(column, 1, "dim") in (-1, 2)
                or is_getitem(column) and column.args[1] in ((Ellipsis, None), (slice(None), slice(None), None))):
            return None
        ids = column.args[0]
        shape = shape_of(sel)
        ok = len(shape_of(ids)) == 2 and same_size(shape[-1], shape_of(Y)[-1]) and same_size(shape_of(Y)[0], shape[0])
        return (Y, ids) if ok else None
    return None


def _slot_weights(col) -> fx.Node | None:
    """w [T, K] of its [T, K, 1] column: `w.unsqueeze(-1)`, `w[..., None]`, `w[:, :, None]`."""
    if is_call(col, "unsqueeze") and arg(col, 1, "dim") in (-1, 2):
        return col.args[0]
    if is_getitem(col) and col.args[1] in ((Ellipsis, None), (slice(None), slice(None), None)):
        return col.args[0]
    return None


def gathered_outputs_to_gate_matrix(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`(Y[arange(T)[:, None], ids] * w[..., None]).sum(1)` -> `(Y * G[..., None]).sum(1)` with
    `G = torch.zeros_like(scores, dtype=w.dtype).scatter(1, ids, w)`: each token's outputs of every
    expert (Y [T, E, d], computed token-major), weighted at its top-k ids. ids are a top-k over the E
    experts' scores, distinct in a row, so G holds each weight once, at its expert, and 0 elsewhere:
    the same terms plus zeros (in another order; an unchosen expert's inf or nan output becomes nan,
    as in every dense gate form, and the finders then compute it sparsely). The product and its sum
    keep their dtype and shape; `torch.gather(Y, 1, ids[..., None].expand(-1, -1, d))` too."""
    if not (is_call(node, "sum") and sums_dim(node, (1, -2))) or node.kwargs.get("keepdim") or len(node.args) > 2:
        return None
    product = node.args[0]
    if not (is_call(product, "mul", "__mul__") and len(product.args) == 2 and len(product.users) == 1):
        return None
    for sel, col in (product.args, product.args[::-1]):
        found, w = _token_rows_at(sel), _slot_weights(col)
        if found is not None and w is not None and len(sel.users) == 1:
            break
    else:
        return None
    Y, ids = found
    topk = getitem_of(ids, 1)
    scores = arg(topk, 0, "input") if is_call(topk, "topk") else None
    if scores is None or len(shape_of(scores)) != 2 or arg(topk, 2, "dim", -1) not in (-1, 1):
        return None
    if not (shape_of(scores)[1] == shape_of(Y)[1] and same_shape(shape_of(w), shape_of(ids)) and dtype_of(w).is_floating_point):
        return None
    zeros = insert_call(gm, node, torch.zeros_like, (scores,), {"dtype": dtype_of(w)})
    gates = insert_call(gm, node, torch.scatter, (zeros, 1, ids, w))
    weighted = insert_call(gm, node, torch.mul, (Y, insert_call(gm, node, torch.unsqueeze, (gates, -1))))
    total = insert_call(gm, node, torch.sum, (weighted, 1))
    if not same_shape(shape_of(total), shape_of(node)) or dtype_of(total) != dtype_of(node):
        for new in (total, weighted, weighted.args[1], gates, zeros):
            gm.graph.erase_node(new)
        return None
    for new in (zeros, gates, weighted, total):
        order[new] = order[node]
    node.replace_all_uses_with(total)
    return f"{node.name} -> ({Y.name} * scatter({ids.name}, {w.name})[..., None]).sum(1)"


def _prefix_width(node) -> int | None:
    """K when `node` reads the first K entries of its input's last dim: `v[..., :K]`, `v[:, :K]` of a
    2-D v, `v.narrow(-1, 0, K)`; else None."""
    src = node.args[0] if isinstance(node, fx.Node) and node.args else None
    rank = len(shape_of(src) or ())
    if is_getitem(node) and isinstance(node.args[1], tuple) and rank:
        index = node.args[1]
        lead = (Ellipsis,) if len(index) == 2 and index[0] is Ellipsis else tuple(index[:-1])
        last = index[-1]
        if lead not in ((Ellipsis,), (slice(None),) * (rank - 1)) or not isinstance(last, slice):
            return None
        if last.start not in (None, 0) or last.step not in (None, 1) or not is_int(last.stop) or last.stop <= 0:
            return None
        return last.stop
    if is_call(node, "narrow") and len(node.args) == 4 and not node.kwargs and node.args[1] in (-1, rank - 1) and node.args[2] == 0:
        return node.args[3] if is_int(node.args[3]) and node.args[3] > 0 else None
    return None


def sorted_prefix_to_topk(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`v, i = torch.sort(s, dim=-1, descending=True); v[..., :K], i[..., :K]` (and
    `torch.argsort(s, dim=-1, descending=True)[..., :K]`) -> `torch.topk(s, K, dim=-1)`: the K largest
    scores of each row, largest first, and their indices. Every reader of the sort must take the
    same first K (K below the row's width); where scores tie at the K-th place the two may pick
    different ones of the tied experts, which torch.topk leaves unspecified as well."""
    if not is_call(node, "sort", "argsort") or len(node.args) > 3 or node.kwargs.keys() - {"dim", "descending", "stable"}:
        return None
    s = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    descending = node.args[2] if len(node.args) > 2 else node.kwargs.get("descending", False)
    rank = len(shape_of(s) or ())
    if not isinstance(s, fx.Node) or rank < 2 or dim not in (-1, rank - 1) or descending is not True:
        return None
    if is_call(node, "argsort"):
        outputs = {1: list(node.users)}
    else:
        if not all(is_getitem(u) and u.args[1] in (0, 1) for u in node.users):
            return None
        outputs = {u.args[1]: list(u.users) for u in node.users}
    slices = [(i, reader) for i, readers in outputs.items() for reader in readers]
    widths = {_prefix_width(reader) for _, reader in slices}
    if not slices or len(widths) != 1 or None in widths:
        return None
    (K,) = widths
    if not (is_int(shape_of(s)[-1]) and K < shape_of(s)[-1]):
        return None
    topk = insert_call(gm, node, torch.topk, (s, K), {"dim": -1})
    parts = {i: insert_call(gm, node, operator.getitem, (topk, i)) for i in sorted(outputs)}
    for i, reader in slices:
        order[parts[i]] = order[node]
        reader.replace_all_uses_with(parts[i])
        order.pop(reader, None)
        gm.graph.erase_node(reader)
    if not is_call(node, "argsort"):
        for user in list(node.users):
            order.pop(user, None)
            gm.graph.erase_node(user)
    order[topk] = order[node]
    return f"{node.name} -> topk({s.name}, {K})"


def _last_dim_reduction(node: fx.Node, name: str) -> tuple[fx.Node, bool] | None:
    """(s, keepdim) when `node` is `name(s, dim=-1)` (method or function, keepdim given or not) over
    the last dim of a tensor of two or more dims; else None."""
    if not is_call(node, name) or node.kwargs.keys() - {"dim", "keepdim"} or len(node.args) > 3:
        return None
    s = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    rank = len(shape_of(s) or ()) if isinstance(s, fx.Node) else 0
    if rank < 2 or dim not in (-1, rank - 1, (-1,), (rank - 1,)) or keepdim not in (True, False):
        return None
    return s, keepdim


def argmax_to_max(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`torch.argmax(s, dim=-1)` (`s.argmax(-1)`, keepdim too) -> `torch.max(s, dim=-1)[1]`: both give
    the index of each row's largest score, the first one where scores tie (documented for both), so
    a top-1 written with argmax reaches the finders as the `max` they read. Only over the last dim of
    a floating tensor of two or more dims (a row of scores per token)."""
    read = _last_dim_reduction(node, "argmax")
    if read is None or dtype_of(read[0]) is None or not dtype_of(read[0]).is_floating_point:
        return None
    s, keepdim = read
    found = insert_call(gm, node, torch.max, (s, -1), {"keepdim": True} if keepdim else {})
    ids = insert_call(gm, node, operator.getitem, (found, 1))
    order[found] = order[ids] = order[node]
    node.replace_all_uses_with(ids)
    return f"{node.name} -> max({s.name}, -1)[1]"


def amax_to_max_values(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`torch.amax(s, dim=-1)` (`s.amax(-1)`, keepdim too) -> `torch.max(s, -1)[0]` of the `max(s, -1)`
    the graph already takes over the same scores (a top-1's ids, T5X's router): the same values, so
    the weight reads the router's own max. Where a row's largest scores tie, the gradient goes to the
    max's index (the expert the top-1 picks) rather than split among the tied entries, as a top-k's
    values give it."""
    read = _last_dim_reduction(node, "amax")
    if read is None:
        return None
    s, keepdim = read
    rank = len(shape_of(s))
    found = next((u for u in s.users if is_call(u, "max") and len(u.args) == 2 and u.args[1] in (-1, rank - 1)
                  and u.kwargs.get("keepdim", False) in (True, False) and not u.kwargs.keys() - {"keepdim"}
                  and order.get(u, len(order)) < order[node]), None)
    if found is None:
        return None
    values = insert_call(gm, node, operator.getitem, (found, 0))
    order[values] = order[node]
    kept = found.kwargs.get("keepdim", False)
    if keepdim != kept:  # the max's values with the amax's dims
        values = insert_call(gm, node, torch.unsqueeze if keepdim else torch.squeeze, (values, -1))
        order[values] = order[node]
    node.replace_all_uses_with(values)
    return f"{node.name} -> max({s.name}, -1)[0]"


def scattered_ones_to_one_hot(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`z = torch.zeros(T, E, dtype=D); z.scatter_(1, ids.unsqueeze(-1), 1)` (or `-1`, `ids[:, None]`,
    `ids.view(-1, 1)`, the indices of a `max(s, -1, keepdim=True)`, zeros_like / new_zeros; fairseq's
    and GShard ports' own `one_hot`) ->
    `F.one_hot(ids, E).to(D)`: a 1 at each row's id, 0 elsewhere. ids [T] top-k / max indices over E
    (each in [0, E)); z fresh zeros read only after the scatter."""
    if not (is_call(node, "scatter_") and len(node.args) == 4 and not node.kwargs and node.args[3] in (1, 1.0, True)):
        return None
    z, dim, index, _ = node.args
    ids = _column_of(index) if isinstance(index, fx.Node) else None  # ids top-k indices: checked below
    found = getitem_of(index, 1)  # a top-1 taken with keepdim: its [T, 1] indices
    kept = ids is None and is_call(found, "max") and arg(found, 2, "keepdim") is True and len(found.args) <= 3 \
        and arg(found, 1, "dim") in (-1, 1) and _range_of(index) is not None
    shape = shape_of(z) if isinstance(z, fx.Node) else None
    if (ids is None and not kept) or not is_call(z, *ZEROS) or len(shape) != 2 or dim not in (1, -1) or not is_int(shape[1]):
        return None
    if kept:  # the same reduction without keepdim: the indices as [T]
        plain = insert_call(gm, node, torch.max, (found.args[0], -1))
        ids = insert_call(gm, node, operator.getitem, (plain, 1))
        order[plain] = order[ids] = order[node]
    if _range_of(ids) != shape[1] or not same_size(shape_of(ids)[0], shape[0]) or dtype_of(z) is None \
            or any(order.get(u, len(order)) < order[node] for u in z.users if u is not node):  # read before the ones
        if kept:
            gm.graph.erase_node(ids)
            gm.graph.erase_node(plain)
        return None
    one_hot = insert_call(gm, node, F.one_hot, (ids, shape[1]))
    result = one_hot if dtype_of(z) == torch.int64 else insert_call(gm, node, torch.Tensor.to, (one_hot, dtype_of(z)))
    for new in {one_hot, result}:
        order[new] = order[node]
    node.replace_all_uses_with(result)
    z.replace_all_uses_with(result)
    order.pop(node, None)
    gm.graph.erase_node(node)  # an effect: _erase_if_dead would keep it
    order.pop(z, None)
    gm.graph.erase_node(z)
    return f"{node.name} -> one_hot({ids.name}, {shape[1]})"


def _bool_of(mask) -> fx.Node | None:
    """m when `mask` reads a 0/1 tensor m as booleans: `m.bool()`, `m.to(torch.bool)`, `m > 0`,
    `m != 0`, `m == 1`; else None."""
    if is_call(mask, "bool") and len(mask.args) == 1 and not mask.kwargs:
        return mask.args[0]
    if is_call(mask, "to") and len(mask.args) == 2 and mask.args[1] is torch.bool and not mask.kwargs:
        return mask.args[0]
    found = _positive_test(mask)
    if found is not None:
        return found
    if is_call(mask, "eq", "__eq__") and len(mask.args) == 2 and not mask.kwargs and 1 in mask.args[1:]:
        return mask.args[0]
    return None


def _below_every(value, s) -> bool:
    """Whether the number `value` is below every entry of s: -inf, or a negative number where s is
    never negative (`verify.nonnegative`: softmax probabilities masked with -1, as some top-2
    gatings write it)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and (
        value == -math.inf or (value < 0 and isinstance(s, fx.Node) and nonnegative(s)))


def _masked_out(node) -> tuple[fx.Node, fx.Node] | None:
    """(s, ids) when `node` is s with each row's entry at ids set below every other (-inf, or a
    negative number on scores never negative): `s.masked_fill(M, -inf)`, `torch.where(M, -inf, s)`
    or `s.scatter(-1, ids[:, None], -inf)`, with M a boolean view of `F.one_hot(ids, E)` (E = s's
    last dim); or `s.scatter(-1, i, -inf)` with i the [..., 1] ids of a `max(-1, keepdim=True)`
    (PhiMoE's sparsemixer), ids then i itself; else None."""
    if is_call(node, "masked_fill") and len(node.args) == 3 and not node.kwargs and _below_every(node.args[2], node.args[0]):
        s, mask = node.args[:2]
    elif is_call(node, "where") and len(node.args) == 3 and not node.kwargs and _below_every(node.args[1], node.args[2]):
        mask, _, s = node.args
    elif is_call(node, "scatter") and len(node.args) == 4 and not node.kwargs and _below_every(node.args[3], node.args[0]):
        s, dim, column = node.args[:3]
        rank = len(shape_of(s) or ())
        last = (column.args[1:] in ((-1,), (rank - 1,)) if is_call(column, "unsqueeze")
                else is_getitem(column) and column.args[1] in ((Ellipsis, None), (slice(None),) * (rank - 1) + (None,)))
        if dim in (-1, rank - 1) and last:  # ids.unsqueeze(-1), ids[:, None], ids[..., None]
            return (s, column.args[0]) if same_shape(shape_of(column.args[0]), shape_of(s)[:-1]) else None
        kept = getitem_of(column, 1)  # the [..., 1] ids of a max that keeps its dim
        if dim in (-1, rank - 1) and is_call(kept, "max") and arg(kept, 2, "keepdim", False) is True \
                and same_shape(shape_of(column), tuple(shape_of(s)[:-1]) + (1,)):
            return s, column
        return None
    else:
        return None
    one_hot = _bool_of(mask)
    if one_hot is not None and is_call(one_hot, "to", "float", "long", "int") and len(one_hot.args) <= 2:
        one_hot = one_hot.args[0]  # a cast of 0/1 keeps which entries are nonzero
    if not is_call(one_hot, "one_hot") or not isinstance(s, fx.Node) or not shape_of(s):
        return None
    ids = one_hot.args[0]
    if arg(one_hot, 1, "num_classes", -1) != shape_of(s)[-1] or not same_shape(shape_of(ids), shape_of(s)[:-1]):
        return None
    return s, ids


def _same_order(s1: fx.Node, s2: fx.Node) -> bool:
    """Whether rows of s1 order their entries as s2's do: s1 is s2, or a float32/float64 softmax of s2
    over its last dim (strictly increasing in each entry; in a narrower float, entries a softmax
    rounds to one value would tie more often than the scores do)."""
    if s1 is s2:
        return True
    rank = len(shape_of(s2) or ())
    return (is_call(s1, "softmax") and arg(s1, 0, "input") is s2 and arg(s1, 1, "dim") in (-1, rank - 1)
            and dtype_of(s1) in (torch.float32, torch.float64))


def second_max_to_topk(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`i1 = s1.max(-1)[1]` and `s2.masked_fill(F.one_hot(i1, E).bool(), -inf).max(-1)` (the top-2 of
    fairseq's and DeepSpeed's `top2gating`: argmax, then argmax of the rest) -> `t = torch.topk(s2, 2,
    dim=-1)`, i1 -> `t[1][..., 0]`, the second max -> `t[0][..., 1], t[1][..., 1]`: each row's largest
    entry and the largest of the others. With `keepdim=True` on both maxes and the first masked out
    by a scatter at its [..., 1] ids (PhiMoE's sparsemixer in eval), the slices `[..., 0:1]` and
    `[..., 1:2]` instead. s1 is s2 or a float32/float64 softmax of it (argmax of
    `softmax(logits)`, second argmax over the logits): the same order. Where scores tie, either may
    pick or order the tied experts differently (as torch.topk leaves unspecified); a tie only the
    softmax makes (two logits that round to one probability) too."""
    if not is_call(node, "max") or len(node.args) > 3 or node.kwargs.keys() - {"dim", "keepdim"}:
        return None
    found = _masked_out(node.args[0])
    if found is None:
        return None
    s2, ids1 = found
    rank = len(shape_of(s2))
    first = getitem_of(ids1, 1)
    kept = len(shape_of(ids1) or ()) == rank  # the first max keeps its dim: [..., 1] ids
    if (rank < 2 or arg(node, 1, "dim") not in (-1, rank - 1) or not is_call(first, "max") or len(first.args) > 3
            or first.kwargs.keys() - {"dim", "keepdim"} or arg(first, 1, "dim") not in (-1, rank - 1)
            or arg(first, 2, "keepdim", False) is not kept or not _same_order(first.args[0], s2)):
        return None
    E = shape_of(s2)[-1]
    # every max of the masked scores over the experts (Dynamo may trace the second argmax twice)
    maxes = [u for u in node.args[0].users if is_call(u, "max") and len(u.args) <= 3 and arg(u, 1, "dim") in (-1, rank - 1)
             and not u.kwargs.keys() - {"dim", "keepdim"} and arg(u, 2, "keepdim", False) in (True, False)]
    if not is_int(E) or E < 2 or node not in maxes or not all(
            is_getitem(g) and g.args[1] in (0, 1) for m in maxes for g in m.users):
        return None
    topk = insert_call(gm, ids1, torch.topk, (s2, 2), {"dim": -1})
    parts = [insert_call(gm, ids1, operator.getitem, (topk, i)) for i in (0, 1)]
    top = insert_call(gm, ids1, operator.getitem, (parts[1], (Ellipsis, slice(0, 1) if kept else 0)))
    for new in (topk, *parts, top):
        order[new] = order[ids1]
    ids1.replace_all_uses_with(top)
    for m in maxes:
        second = (Ellipsis, slice(1, 2)) if arg(m, 2, "keepdim", False) else (Ellipsis, 1)
        for user in list(m.users):
            picked = insert_call(gm, ids1, operator.getitem, (parts[user.args[1]], second))
            order[picked] = order[ids1]
            user.replace_all_uses_with(picked)
            order.pop(user, None)
            gm.graph.erase_node(user)
    for dead in [*maxes, ids1]:
        if not dead.users:
            order.pop(dead, None)
            gm.graph.erase_node(dead)
    if not first.users:
        order.pop(first, None)
        gm.graph.erase_node(first)
    return f"{node.name} and {ids1.name} -> topk({s2.name}, 2)"


def _add_terms(node, top: bool = True) -> list:
    """The terms of a chain of `+` (`a + b + c`), through inner sums nothing else reads, less a
    literal 0 (Python's `sum(...)` starts from one)."""
    if (is_call(node, "add", "__add__") and len(node.args) == 2 and not node.kwargs
            and (top or len(node.users) == 1)):
        return _add_terms(node.args[0], False) + _add_terms(node.args[1], False)
    return [] if isinstance(node, (int, float)) and not isinstance(node, bool) and node == 0 else [node]


def _slot_one_hot(term) -> tuple[fx.Node, int, fx.Node] | None:
    """(ids, k, w) when `term` is `w * F.one_hot(ids[:, k], E)` (either order; the one_hot cast to a
    float dtype: 0/1 stay exact) with w a [T, 1] column and ids [T, K] top-k ids over E; else None."""
    if not (is_call(term, *_MUL) and len(term.args) == 2 and not term.kwargs):
        return None
    for w, one_hot in (term.args, term.args[::-1]):
        if is_call(one_hot, "to", "float", "half", "bfloat16", "type_as") and len(one_hot.args) <= 2:
            one_hot = one_hot.args[0]
        if not is_call(one_hot, "one_hot") or not isinstance(w, fx.Node):
            continue
        column = one_hot.args[0]
        if not (is_getitem(column) and isinstance(column.args[1], tuple) and len(column.args[1]) == 2
                and column.args[1][0] in (slice(None), Ellipsis) and is_int(column.args[1][1])):
            continue
        ids, k = column.args[0], column.args[1][1]
        shape = shape_of(ids)
        if (len(shape) != 2 or not 0 <= k < shape[1] or _range_of(ids) != arg(one_hot, 1, "num_classes", -1)
                or not same_shape(shape_of(w), (shape[0], 1))):
            continue
        return ids, k, w
    return None


def slot_one_hots_to_gate_matrix(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`w0 * F.one_hot(ids[:, 0], E) + ... + w_{K-1} * F.one_hot(ids[:, K-1], E)` (fairseq's and
    DeepSpeed's top-2 combine: a gate column per slot times that slot's one_hot) -> `(F.one_hot(ids,
    E) * w.unsqueeze(-1)).sum(1)` with `w = torch.cat([w0, ..., w_{K-1}], -1)`, ids [T, K] top-k ids
    over E: every slot exactly once, the same products summed; the ids of a row are distinct, so
    each entry sums at most one nonzero term (equal values, up to the sign of a zero)."""
    terms = _add_terms(node)
    if len(terms) < 2:
        return None
    found = [_slot_one_hot(t) for t in terms]
    if None in found or len({f[0] for f in found}) != 1:
        return None
    ids = found[0][0]
    slots = sorted(found, key=lambda f: f[1])
    if [f[1] for f in slots] != list(range(shape_of(ids)[1])):
        return None
    dtypes = {dtype_of(f[2]) for f in slots}
    if len(dtypes) != 1 or dtypes != {dtype_of(node)} or not dtype_of(node).is_floating_point:
        return None  # weights of other dtypes, or one_hots cast to a wider float: left as written
    from .canonical import _gate_matrix  # canonical imports this module

    weights = insert_call(gm, node, torch.cat, ([f[2] for f in slots], -1))
    order[weights] = order[node]
    gates = _gate_matrix(gm, ids, weights, _range_of(ids), order)
    node.replace_all_uses_with(gates)
    return f"{node.name} -> (one_hot({ids.name}) * cat(weights)[..., None]).sum(1)"
