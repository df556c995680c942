"""Canonical form of rows permuted by expert and put back: the work runs on the rows unpermuted. A
rule of `patterns.canonical` (which runs it with the others and states what a rule must keep).

    perm = torch.sort(flat)[1]                     (or argsort; flat [N] the flattened top-k ids)
    xs = x[perm // K]                              (x.index_select(0, perm // K), torch.gather(x, 0,
                                                    (perm // K)[:, None].expand(-1, d)); K = 1: x[perm])
    ys = y(xs, flat[perm], w.view(-1)[perm], ...)  (row i of ys from row i of the permuted reads alone;
                                                    sort(flat)[0] is flat[perm])
    z.index_add_(0, perm // K, ys)                 ->  z + y(x.repeat_interleave(K, 0), flat, w.view(-1), ...)
                                                           .reshape(T, K, ...).sum(1)     (K = 1: z + y(x, ...))

Row i of ys depends only on row perm[i] of what the permutation reads, so ys = y_u[perm] with y_u
computed from the unpermuted rows, and adding row i back into row perm[i] // K adds every row p of
y_u into row p // K: the same sums (in another order: rounding aside). Row-wise here:

- elementwise ops whose other operands broadcast over the rows and do not depend on perm, `W[r]`
  of a row-wise integer r, sums and unsqueezes off the rows' dim;
- an expert loop over masks of the rows: a fresh zeros [N, ...] written at `out[m] = v` (or
  `out[torch.where(m)[0]] = v`, `index_put_`, `index_copy_`, or their functional forms chained),
  m a row-wise boolean mask (`flat[perm] == e`) and v computed row by row from the rows m selects
  (`A[m]`, `A[torch.where(m)[0]]`, `index_select`) through elementwise ops, chunks of the last dim
  and products with weights that do not depend on perm (`F.linear`, `@`): selecting, computing and
  writing back at the same rows commutes with the permutation.

Every node of the computation (the permuted reads, the masks, the selections, the writes) must be
read by the computation alone (they change order), the zeros z (or any base of a functional
index_add, then added to) by the put-back alone.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from .canonical_routing import _only_asserted, floor_division, repeated_rows, row_mask, row_write
from .common import (ZEROS, arg, dtype_of, getitem_of, insert_call, is_call, is_getitem, is_int, same_size, shape_of,
                     writes_in_place)

_ROW_ELEMENTWISE = ("silu", "gelu", "relu", "sigmoid", "tanh", "neg", "__neg__", "exp", "softplus", "square", "erf",
                    "abs", "mul", "__mul__", "add", "__add__", "sub", "__sub__", "truediv", "__truediv__", "div", "float",
                    "bfloat16", "half", "to", "type_as", "eq", "__eq__", "ne", "__ne__")
_PROJECTIONS = ("linear", "matmul", "__matmul__", "mm")


def _permutation_of_rows(perm, n) -> bool:
    """`perm` is `torch.sort(v)[1]` (or argsort) of a 1-D v of n entries: a permutation of range(n)."""
    found = getitem_of(perm, 1)
    if found is None or not is_call(found, "sort", "argsort"):
        found = perm if is_call(perm, "argsort") else None
    if found is None:
        return False
    v = found.args[0] if found.args else None
    return isinstance(v, fx.Node) and len(shape_of(v)) == 1 and same_size(shape_of(v)[0], n) and same_size(shape_of(perm)[0], n)


def _divided(index, perm) -> int | None:
    """K when `index` is perm itself (1) or `perm // K` (`canonical_routing.floor_division`); else None."""
    if index is perm:
        return 1
    divided = floor_division(index)
    return divided[1] if divided is not None and divided[0] is perm else None


def _row_broadcast(idx) -> fx.Node | None:
    from .canonical import _row_broadcast_of  # canonical imports this module

    return _row_broadcast_of(idx) if isinstance(idx, fx.Node) else None


class _Rows:
    """The row-wise computation over rows permuted by `perm` (n of them) that a put-back reads."""

    def __init__(self, perm: fx.Node, n, put_back: fx.Node, order: dict):
        self.perm, self.n = perm, n
        self.inside: set[fx.Node] = set()
        self.leaves: dict[fx.Node, tuple[fx.Node, int]] = {}  # permuted read -> (tensor, K): its rows x[p // K]
        self.position = order  # the canonical pass's order of the graph's calls
        self.tainted = self._tainted(put_back)

    def _tainted(self, put_back: fx.Node) -> set[fx.Node]:
        """The nodes up to the put-back whose value depends on perm (a tensor one of them writes in
        place too), found forward from perm."""
        tainted, todo = {self.perm}, [self.perm]
        limit = self.position[put_back]
        while todo:
            for user in todo.pop().users:
                if user is put_back or user in tainted or self.position.get(user, limit + 1) > limit:
                    continue
                tainted.add(user)
                todo.append(user)
                target = user.args[0] if writes_in_place(user) and user.args else None
                if isinstance(target, fx.Node) and target not in tainted:
                    tainted.add(target)
                    todo.append(target)
        return tainted

    def free(self, node) -> bool:
        """A value the permutation does not reach (a weight, a constant)."""
        return not isinstance(node, fx.Node) or node not in self.tainted

    def leaf(self, node) -> tuple[fx.Node, int] | None:
        """(t, K) when `node` reads t's rows through the permutation: `t[perm]`, `t.index_select(0,
        perm)`, `torch.sort(t)[0]` of the sort perm comes from (K = 1), or `x[perm // K]`,
        `x.index_select(0, perm // K)`, `torch.gather(x, 0, (perm // K)[:, None].expand(-1, d))`."""
        if getitem_of(node, 0) is not None and is_call(node.args[0], "sort") and self._sorts(node.args[0]):
            t = arg(node.args[0], 0, "input")
            return (t, 1) if self.free(t) else None
        if is_getitem(node) and isinstance(node.args[1], fx.Node):
            t, index = node.args
        elif is_call(node, "index_select") and len(node.args) == 3 and node.args[1] == 0 and not node.kwargs:
            t, _, index = node.args
        elif is_call(node, "gather") and arg(node, 1, "dim") == 0 and not set(node.kwargs) - {"input", "dim", "index"}:
            t, index = arg(node, 0, "input"), _row_broadcast(arg(node, 2, "index"))
        else:
            return None
        K = _divided(index, self.perm)
        rows = (shape_of(t) or (None,))[0] if isinstance(t, fx.Node) else None
        if K is None or not self.free(t) or rows is None or not same_size(rows * K, self.n):
            return None
        return t, K

    def _sorts(self, sort: fx.Node) -> bool:
        """`sort`'s values are t[perm]: it sorts the t perm sorts, in the same direction (the sorted
        values of t are one sequence, whichever sort, stable or not, ordered them)."""
        source = getitem_of(self.perm, 1) if getitem_of(self.perm, 1) is not None else self.perm
        if not is_call(source, "sort", "argsort") or arg(source, 0, "input") is not arg(sort, 0, "input"):
            return False
        direction = lambda n: (arg(n, 1, "dim", -1), arg(n, 2, "descending", False))  # noqa: E731
        return direction(source) == direction(sort) and not (set(sort.kwargs) - {"dim", "descending", "stable"})

    def rowwise(self, node, depth: int = 96) -> bool:
        """Row i of `node` depends only on row perm[i] of the permuted reads (module docstring)."""
        if node in self.inside or node in self.leaves:
            return True
        if not isinstance(node, fx.Node) or depth <= 0 or (writes_in_place(node) and not is_call(node, *ZEROS)):
            return False
        found = self.leaf(node)
        if found is not None:
            self.leaves[node] = found
            return True
        shape = shape_of(node)
        if not shape or not same_size(shape[0], self.n) or any(isinstance(v, fx.Node) for v in node.kwargs.values()):
            return False
        if is_call(node, *ZEROS):
            ok = self._filled(node, depth)
        elif is_call(node, "index_copy", "index_put") and row_write(node) is not None:
            ok = self._functional_write(node, depth)
        elif is_getitem(node) and isinstance(node.args[1], fx.Node) and self.free(node.args[0]) \
                and len(shape_of(node.args[1])) == 1:
            ok = self.rowwise(node.args[1], depth - 1)  # W[r]: row i is W[r[i]]
        elif is_call(node, "unsqueeze", "squeeze", "sum") and len(node.args) >= 2 and is_int(node.args[1]) \
                and isinstance(node.args[0], fx.Node) \
                and node.args[1] % (len(shape_of(node.args[0])) + is_call(node, "unsqueeze")) != 0:
            ok = self.rowwise(node.args[0], depth - 1)  # the rows stay dim 0
        elif is_call(node, "view", "reshape") and isinstance(node.args[0], fx.Node) \
                and same_size(shape_of(node.args[0])[0], self.n) \
                and same_size(math.prod(shape_of(node.args[0])[1:]), math.prod(shape[1:])):
            ok = self.rowwise(node.args[0], depth - 1)  # each row's elements regrouped within the row
        elif is_call(node, *_ROW_ELEMENTWISE):
            ok = all(self._operand(a, shape, lambda v: self.rowwise(v, depth - 1)) for a in node.args)
        else:
            return False
        if ok:
            self.inside.add(node)
        return ok

    def _operand(self, a, shape, aligned) -> bool:
        """An elementwise op's operand: row-aligned (as `aligned` checks), or broadcast over the rows
        (fewer dims) and free of the permutation."""
        if not isinstance(a, fx.Node):
            return True
        if len(shape_of(a)) == len(shape):
            return aligned(a)
        return len(shape_of(a)) < len(shape) and self.free(a)

    # --- an expert loop over masks of the permuted rows ------------------------------------

    def _filled(self, zeros: fx.Node, depth: int) -> bool:
        """A fresh zeros [n, ...] (its inputs only give its size) whose in-place writes are row
        writes (`_write`) that all come before its first other reader."""
        writes = [u for u in zeros.users if writes_in_place(u)]
        if not all(self._in_place_write(w, depth) for w in writes):
            return False
        last = max((self.position.get(w, -1) for w in writes), default=-1)
        if any(self.position.get(u, -1) < last for u in zeros.users if u not in writes):
            return False
        self.inside.update(writes)
        return True

    def _in_place_write(self, node: fx.Node, depth: int) -> bool:
        """`z[m] = v`, `z[rows] = v`, `z.index_put_((rows,), v)`, `z.index_copy_(0, rows, v)`."""
        found = row_write(node) if not is_call(node, "index_copy", "index_put") else None
        return found is not None and self._write(found[1], found[2], depth)

    def _functional_write(self, node: fx.Node, depth: int) -> bool:
        """`base.index_copy(0, rows, v)` or `base.index_put((rows,), v)` of a row-wise base."""
        base, index, value = row_write(node)
        return self.rowwise(base, depth - 1) and self._write(index, value, depth)

    def _write(self, index, value, depth: int) -> bool:
        """Rows `index` (a row-wise boolean mask m, or `torch.where(m)[0]`) written with `value`
        computed from the rows m selects alone."""
        mask = row_mask(index)
        if mask is None or not self.rowwise(mask, depth - 1):
            return False
        if index is not mask:
            self.inside.update((index, index.args[0]))
        return self._selected(value, mask, depth - 1)

    def _selected(self, node, mask: fx.Node, depth: int) -> bool:
        """Row j of `node` depends only on the j-th row that `mask` selects from row-wise tensors
        (`A[m]`, `A[torch.where(m)[0]]`, `A.index_select(0, ...)`), through elementwise ops, chunks
        and slices of the last dim and products with free 2-D weights."""
        if node in self.inside:
            return True
        if not isinstance(node, fx.Node) or depth <= 0 or writes_in_place(node) \
                or any(isinstance(v, fx.Node) for v in node.kwargs.values()):
            return False
        again = lambda v: self._selected(v, mask, depth - 1)  # noqa: E731
        if is_getitem(node) and isinstance(node.args[1], fx.Node) or is_call(node, "index_select"):
            t, index = (node.args[0], node.args[1]) if is_getitem(node) else (node.args[0], node.args[2])
            if is_call(node, "index_select") and (len(node.args) != 3 or node.args[1] != 0):
                return False
            ok = _same_mask(row_mask(index), mask) and isinstance(t, fx.Node) and self.rowwise(t, depth - 1)
            if ok and index is not mask:
                self.inside.update((index, index.args[0]))
        elif is_getitem(node) and is_call(node.args[0], "chunk") and is_int(node.args[1]):
            cut = node.args[0]
            rank = len(shape_of(cut.args[0]))
            ok = arg(cut, 2, "dim", 0) in (-1, rank - 1) and rank >= 2 and again(cut.args[0])
            if ok:
                self.inside.add(cut)
        elif is_getitem(node) and isinstance(node.args[1], tuple) and node.args[1][:1] in ((Ellipsis,), (slice(None),)) \
                and all(isinstance(i, slice) or i is Ellipsis for i in node.args[1]):
            ok = again(node.args[0])  # h[..., a:b], h[:, a:b]: columns of each row
        elif is_call(node, *_PROJECTIONS):
            h, weights = node.args[0], node.args[1:]
            ok = len(shape_of(h)) == 2 and all(self.free(w) and len(shape_of(w)) <= 2 for w in weights) and again(h)
        elif is_call(node, *_ROW_ELEMENTWISE):
            shape = shape_of(node)
            ok = all(self._operand(a, shape, again) for a in node.args)
        else:
            return False
        if ok:
            self.inside.add(node)
        return ok

    def read_alone(self, put_back: fx.Node) -> bool:
        """Every node of the computation is read by the computation (or the put-back) alone."""
        chain = self.inside | set(self.leaves)
        return all(u in chain or u is put_back or _no_value(u) or (c in self.leaves and _counts(u))
                   for c in chain for u in c.users)


def _same_mask(a, b) -> bool:
    """a and b hold one mask: one node, or one comparison of the same operands (`es == e` written
    twice, which Dynamo traces twice)."""
    if a is b:
        return a is not None
    return (is_call(a, "eq", "__eq__") and is_call(b, "eq", "__eq__") and a.args == b.args and not a.kwargs
            and not b.kwargs)


def _no_value(node: fx.Node) -> bool:
    """A read that gives no value: a size (`t.size(i)`, `t.shape[i]` as Dynamo traces them), Dynamo's
    checks of a size, or a selection read only so."""
    if node.target is torch.ops.aten.sym_size.int or is_call(node, "size") or _only_asserted(node):
        return True
    return is_getitem(node) and bool(node.users) and all(_no_value(u) for u in node.users)


def _counts(node: fx.Node) -> bool:
    """A histogram of a permuted read (`torch.histc(v.float(), ...)`, `torch.bincount(v)`): the same
    counts in any order of v, so it may read the unpermuted v."""
    if is_call(node, "float", "to", "long", "int") and node.users:
        return all(_counts(u) for u in node.users)
    return is_call(node, "histc", "bincount")


def _put_back(node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(base, index, y) of `base.index_add(0, index, y)` (`index_add_`, `torch.index_add`)."""
    if not is_call(node, "index_add", "index_add_") or len(node.args) != 4 or node.kwargs or node.args[1] != 0:
        return None
    base, _, index, y = node.args
    ok = all(isinstance(v, fx.Node) for v in (base, index, y))
    return (base, index, y) if ok else None


def permuted_rows_put_back_to_rows(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`z.index_add_(0, perm // K, ys)` with ys computed row-wise from rows read through the
    permutation -> the same computation on the unpermuted rows, summed over each token's K rows and
    added to z (module docstring). z: fresh zeros read by the put-back alone, or the base of a
    functional index_add (then `z + ...`)."""
    found = _put_back(node)
    if found is None:
        return None
    z, index, y = found
    perm = index if _permutation_of_rows(index, (shape_of(index) or (None,))[0]) else (
        index.args[0] if isinstance(index, fx.Node) and index.args and isinstance(index.args[0], fx.Node) else None)
    n = (shape_of(y) or (None,))[0]
    if perm is None or not _permutation_of_rows(perm, n):
        return None
    K = _divided(index, perm)
    T = (shape_of(z) or (None,))[0]
    if K is None or T is None or not same_size(T * K, n) or shape_of(z)[1:] != shape_of(y)[1:] or dtype_of(z) != dtype_of(y):
        return None
    zeros = is_call(z, *ZEROS)
    later = [u for u in z.users if u is not node]
    if is_call(node, "index_add_"):  # in place into fresh zeros: their later readers read the sum
        if not zeros or any(order.get(u, len(order)) < order[node] for u in later):
            return None
    elif zeros and later:
        return None
    rows = _Rows(perm, n, node, order)
    if not rows.rowwise(y) or not rows.leaves or not rows.read_alone(node) or not rows.free(z):
        return None
    unpermuted = {leaf: repeated_rows(gm, t, k) if k != 1 else t for leaf, (t, k) in rows.leaves.items()}
    for leaf, rows_read in unpermuted.items():
        leaf.replace_all_uses_with(rows_read)
    result = unpermuted.get(y, y)  # y itself a permuted read: the rows it read
    if K != 1:
        result = insert_call(gm, node, torch.reshape, (result, (T, K, *shape_of(y)[1:])))
        result = insert_call(gm, node, torch.sum, (result, 1))
    if not zeros:
        result = insert_call(gm, node, operator.add, (z, result))
    for new in {result, *result.all_input_nodes} - set(order):
        order[new] = order[node]
    for u in later if is_call(node, "index_add_") else ():
        u.replace_input_with(z, result)
    node.replace_all_uses_with(result)
    from .canonical import _erase_if_dead  # canonical imports this module

    gm.graph.erase_node(node)
    order.pop(node, None)
    for dead in [*rows.leaves, index, perm] + ([z] if zeros else []):
        if dead in order:  # not erased with an earlier one
            _erase_if_dead(gm.graph, dead, order)  # the permuted reads, then the permutation, where nothing else reads them
    return f"{node.name} -> {result.name} ({len(rows.leaves)} reads through {perm.name} dropped{f', K={K}' if K != 1 else ''})"
