"""Canonical forms of reshapes: view chains that come back to a tensor's own shape, and reshapes
of elementwise code moved onto its inputs. Rules of `patterns.canonical` (which runs them with the
others and states what a rule must keep).

A reshape here is an op that changes only the shape and keeps the elements in row-major order:
`view`/`reshape` to sizes, `unsqueeze`, `squeeze`, `flatten`, `unflatten`, and indexing by `None`,
`:` and `...` alone. Two reshapes of one tensor to one shape hold the same values. A rule replaces a
tensor only by one of the same strides too: a later `view` of it (HF's loss views its labels) must
still be possible.

Rules (eager spelling -> canonical form):

    y = x[:, None, None, :].reshape(T, d)              ->  y = x
    y = g.unsqueeze(2).squeeze(2)                      ->  y = g
        # a chain of reshapes whose result has the shape of a tensor on the chain: that tensor,
        # when nothing writes in place into the chain's storage
    (F.silu(g.unsqueeze(2)) * u.unsqueeze(2)).squeeze(2)   ->  F.silu(g) * u
    (F.silu(c[0]) * c[1]).view(T, K, n), c = h.view(T * K, 2 * n).chunk(2, -1)
                                                       ->  F.silu(c'[0]) * c'[1], c' = h.chunk(2, -1)
    (y * w.reshape(-1, 1)).view(T, K, d)               ->  y' * w.reshape(-1, K, 1)
        # a reshape of elementwise code that regroups leading dims and keeps the trailing ones,
        # moved onto the code's inputs, when each input of the code's full shape is itself a
        # reshape of a tensor of the target shape (or a chunk along the last dim of one, or rows
        # of a table picked by a flat index: `B[ids.reshape(-1)]` as `B[ids]`): the elementwise
        # ops run on the same elements; inputs broadcast over trailing dims are regrouped alike. Gathered-weight products respelled as einsums
        # (`canonical_products.gathered_product_to_einsum`) leave their [T, K, n] results
        # reshaped around the expert's elementwise code; these rules bring the results back.

Both rules act only on reshapes next to a product that rule respelled (`mark`ed): elsewhere a
finder may read the views as written (Llama 4's dense experts, transformers' loss).

    W.chunk(E, 0)[e].squeeze(0)                        ->  W[e]
        # also `torch.split(W, 1)[e].squeeze(0)`, `W.unbind(0)[e]`, `[e][0]`: pieces of one row of
        # the first dim (DBRX's experts cut from a parameter viewed [E, n, d]), the same view
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from .common import (arg, dtype_of, example_value, insert_call, is_call, is_getitem, is_int, same_shape, same_size, shape_of, storage_of,
                     writes_in_place)

_RESHAPES = ("view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten")
# ops that compute each output element from the elements at its position alone (scalars and
# broadcast inputs aside)
_ELEMENTWISE = {"silu", "gelu", "relu", "sigmoid", "tanh", "neg", "__neg__", "exp", "softplus", "square", "erf", "abs",
                "mul", "__mul__", "__rmul__", "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "rsub",
                "truediv", "__truediv__", "__rtruediv__", "div", "pow", "__pow__", "clamp", "float", "bfloat16",
                "half", "to", "type_as"}


_MARK = "sonic_respelled_product"


def mark(node: fx.Node) -> fx.Node:
    """Mark a node a canonical rule inserted around a respelled product, for these rules to act on."""
    node.meta[_MARK] = True
    return node


def _up(node: fx.Node) -> fx.Node | None:
    """The tensor `node` reshapes or is a chunk of, else None."""
    return reshaped(node) or (node.args[0].args[0] if is_getitem(node) and is_call(node.args[0], "chunk") else None)


def _near_product(node) -> bool:
    """`node` or a tensor up its chain of reshapes and chunks is `mark`ed."""
    while isinstance(node, fx.Node):
        if node.meta.get(_MARK):
            return True
        node = _up(node)
    return False


def reshaped(node) -> fx.Node | None:
    """The tensor that `node` reshapes (same elements, same order, another shape), else None."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if is_getitem(node):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        plain = all(i is None or i is Ellipsis or i == slice(None) for i in index)
        return node.args[0] if plain and shape_of(node.args[0]) else None
    if not is_call(node, *_RESHAPES) or not shape_of(node.args[0]):
        return None
    if is_call(node, "view") and any(isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values())):
        return None  # view(dtype) reinterprets the bytes
    return node.args[0]


def view_root(node, shape) -> fx.Node | None:
    """The nearest tensor up `node`'s chain of reshapes (`node` included) whose shape is `shape`."""
    while node is not None:
        if same_shape(shape_of(node), shape):
            return node
        node = reshaped(node)
    return None


def chain_top(node: fx.Node) -> fx.Node:
    """The first tensor up `node`'s chain of reshapes that is not itself a reshape."""
    while (above := reshaped(node)) is not None:
        node = above
    return node


def _between(node: fx.Node, root: fx.Node) -> list[fx.Node]:
    """The tensors from `node` up its reshapes (chunks included) to `root`."""
    out = []
    while node is not None and node is not root:
        out.append(node)
        node = _up(node)
    return out + [root]


def _same_strides(a: fx.Node, b: fx.Node) -> bool:
    """The two tensors are laid out alike (fake values' strides, provably equal)."""
    va, vb = example_value(a), example_value(b)
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and same_shape(va.stride(), vb.stride())


def _written(gm: fx.GraphModule, nodes) -> bool:
    """Something in the graph writes in place into the storage of one of `nodes`."""
    storages = {s for s in map(storage_of, nodes) if s is not None}
    return any(writes_in_place(n) and n.args and storage_of(n.args[0]) in storages for n in gm.graph.nodes)


def reshape_chain_to_base(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """A chain of reshapes that ends in the shape of a tensor on it, as that tensor (module docstring)."""
    above = reshaped(node)
    root = view_root(above, shape_of(node)) if above is not None else None
    if root is None:
        return None
    chain, step = [node], node
    while step is not root:
        step = reshaped(step)
        chain.append(step)
    # a graph that returned a view of its input returns that view still: an output aliasing an input
    # is a different contract for AOTAutograd
    of_input = chain_top(root).op in ("placeholder", "get_attr")
    if not _near_product(node) or not _same_strides(node, root) or _written(gm, chain) or (of_input and all(u.op == "output" for u in node.users)):
        return None
    node.replace_all_uses_with(root, delete_user_cb=lambda user: not of_input or user.op != "output")
    return f"{node.name}: reshapes back to {root.name}'s shape -> {root.name}"


def _split(full: tuple, target: tuple) -> int | None:
    """How many trailing dims a reshape from `full` to `target` keeps when it only regroups the
    leading ones, else None."""
    kept = 0
    while kept < min(len(full), len(target)) and same_size(full[-1 - kept], target[-1 - kept]):
        kept += 1
    lead_full, lead_target = full[:len(full) - kept], target[:len(target) - kept]
    return kept if same_size(math.prod(lead_full), math.prod(lead_target)) else None


class _Push:
    """Moves a reshape to `target` onto the inputs of the elementwise code below it: `plan` says
    whether it can (and counts the inputs that come back to a tensor of the target shape), `build`
    inserts the code again on the moved inputs."""

    def __init__(self, gm: fx.GraphModule, before: fx.Node, full: tuple, target: tuple, kept: int):
        self.gm, self.before, self.full, self.target, self.kept = gm, before, full, target, kept
        self.chunks: dict = {}
        self.built: dict = {}
        self.inserted: list[fx.Node] = []
        self.resolved = 0
        self.near_product = False  # an input comes back through a marked reshape
        self.seen: list[fx.Node] = []  # the code and its inputs, with the reshapes between

    def plan(self, node, top: fx.Node) -> bool:
        """Whether `node` (an input of the code, or the code's top) can take the reshape."""
        if not isinstance(node, fx.Node):
            return True  # a scalar, a dtype, an option
        shape = shape_of(node)
        self.seen.append(node)
        if not same_shape(shape, self.full):
            return self._broadcast_shape(shape) is not None
        root = view_root(node, self.target)
        if root is None and (source := self._chunk_source(node)) is not None:
            root = source[0]
        if root is not None:
            between = _between(node, root)
            self.seen += between
            self.resolved += 1
            self.near_product = self.near_product or _near_product(node)
            return True
        if (gathered := self._gathered_rows(node)) is not None:
            self.seen += [node, *_between(node.args[1], gathered[1])]
            self.resolved += 1
            return True
        callable_ = node.op == "call_function" or (node.op == "call_method" and hasattr(torch.Tensor, node.target))
        if node is top or (is_call(node, *_ELEMENTWISE) and len(node.users) == 1 and not writes_in_place(node)):
            return callable_ and all(self.plan(a, top) for a in (*node.args, *node.kwargs.values()))
        return False

    def build(self, node):
        """The input (or code) `node` reshaped to the target, inserted before the reshape."""
        if not isinstance(node, fx.Node):
            return node
        if node in self.built:
            return self.built[node]
        shape = shape_of(node)
        if not same_shape(shape, self.full):  # broadcast: only an input of more dims than are kept moves
            moves = len(shape) > self.kept
            new = self._insert(torch.reshape, (chain_top(node), self._broadcast_shape(shape))) if moves else node
        elif (root := view_root(node, self.target)) is not None:
            new = root
        elif (source := self._chunk_source(node)) is not None:
            new = self._chunk(*source)
        elif (gathered := self._gathered_rows(node)) is not None:
            new = self._insert(operator.getitem, gathered)
        else:
            args = tuple(self.build(a) for a in node.args)
            kwargs = {k: self.build(v) for k, v in node.kwargs.items()}
            target = getattr(torch.Tensor, node.target) if node.op == "call_method" else node.target
            new = self._insert(target, args, kwargs)
        self.built[node] = new
        return new

    def _insert(self, target, args, kwargs=None) -> fx.Node:
        new = mark(insert_call(self.gm, self.before, target, args, kwargs))
        self.inserted.append(new)
        return new

    def undo(self) -> None:
        """Erase what `build` inserted."""
        for new in reversed(self.inserted):
            self.gm.graph.erase_node(new)

    def _broadcast_shape(self, shape: tuple) -> tuple | None:
        """The target shape of an input broadcast over some of the kept trailing dims: the leading
        dims regrouped as the code's, the trailing ones as they are; None if it broadcasts elsewhere.
        An input of no more dims than are kept stays as it is."""
        lead = len(self.full) - self.kept
        if len(shape) <= self.kept:
            return tuple(shape)
        if len(shape) != len(self.full) or not same_shape(shape[:lead], self.full[:lead]):
            return None
        lead_target = self.target[:len(self.target) - self.kept]
        if not all(is_int(s) for s in (*lead_target[1:], *shape[lead:])):
            return None
        return (-1, *lead_target[1:], *shape[lead:]) if lead_target else tuple(shape[lead:])

    def _gathered_rows(self, node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
        """(table, index) when `node` is `table[j]`, rows of a table picked by a 1-D integer j that is
        a reshape of `index`, an index of the target's leading dims: `B[ids.reshape(-1)]` viewed as
        [T, K, d] is `B[ids]` (the same rows in the same row-major order)."""
        if not (is_getitem(node) and isinstance(node.args[1], fx.Node) and len(shape_of(node.args[1])) == 1):
            return None
        table, flat = node.args
        dtype = dtype_of(flat)
        if dtype is None or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            return None
        row = shape_of(table)[1:]
        lead = len(self.target) - len(row)
        if lead < 1 or not same_shape(self.target[lead:], row):
            return None
        index = view_root(flat, self.target[:lead])
        return (table, index) if index is not None and index is not flat else None

    def _chunk_source(self, node: fx.Node) -> tuple[fx.Node, int, int] | None:
        """(the tensor of the target's leading dims, chunks, which) when `node` is a chunk along the
        last dim of a reshape that keeps that dim: `h.view(T * K, 2 * n).chunk(2, -1)[i]`."""
        if not (is_getitem(node) and is_int(node.args[1]) and is_call(node.args[0], "chunk") and self.kept >= 1):
            return None
        cut = node.args[0]
        src, chunks, dim = cut.args[0], arg(cut, 1, "chunks"), arg(cut, 2, "dim", 0)
        ndim = len(shape_of(src))
        if not (is_int(chunks) and is_int(dim) and ndim == len(self.full) and dim % ndim == ndim - 1):
            return None
        root = view_root(src, (*self.target[:-1], shape_of(src)[-1]))
        return (root, chunks, node.args[1]) if root is not None and root is not src else None

    def _chunk(self, root: fx.Node, chunks: int, which: int) -> fx.Node:
        if (root, chunks) not in self.chunks:
            self.chunks[root, chunks] = self._insert(torch.chunk, (root, chunks, -1))
        return self._insert(operator.getitem, (self.chunks[root, chunks], which))


def reshape_through_elementwise(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """A reshape of elementwise code moved onto the code's inputs (module docstring): `node` is the
    last of a chain of reshapes over elementwise code read by that chain alone."""
    if reshaped(node) is None or is_getitem(node):
        return None
    target, top = shape_of(node), chain_top(node)
    if view_root(reshaped(node), target) is not None or not is_call(top, *_ELEMENTWISE) or writes_in_place(top):
        return None
    step = node
    while step is not top:  # every reshape between the code and `node` read only by the next
        step = reshaped(step)
        if len(step.users) != 1:
            return None
    full = shape_of(top)
    kept = _split(full, target)
    if kept is None:
        return None
    push = _Push(gm, node, full, target, kept)
    if not push.plan(top, top) or push.resolved == 0:  # nothing comes back: the move would only shuffle reshapes
        return None
    if not (push.near_product or _near_product(node)):
        return None
    if _written(gm, [*push.seen, *_between(node, top)]):
        return None
    new = push.build(top)
    if not _same_strides(new, node):  # laid out otherwise than the reshape was
        push.undo()
        return None
    node.replace_all_uses_with(new)
    return f"{node.name}: reshape of {top.name}'s elementwise code moved onto its inputs"


def _unit_piece(node) -> tuple[fx.Node, int] | None:
    """(W, e) when `node` is piece e of W cut along dim 0 into pieces of one row each: `W.chunk(n,
    0)[e]` with n W's first size, `torch.split(W, 1)[e]` (`split(1, 0)`, `split_with_sizes([1] *
    n)`)."""
    if not (is_getitem(node) and is_int(node.args[1]) and isinstance(node.args[0], fx.Node)):
        return None
    cut, e = node.args
    W = cut.args[0] if cut.args else None
    rows = (shape_of(W) or (None,))[0]
    if not isinstance(W, fx.Node) or not is_int(rows) or not 0 <= e < rows:
        return None
    if is_call(cut, "chunk") and arg(cut, 1, "chunks") == rows and arg(cut, 2, "dim", 0) == 0:
        return W, e
    if is_call(cut, "split") and arg(cut, 1, "split_size_or_sections", arg(cut, 1, "split_size")) in (1, [1] * rows) \
            and arg(cut, 2, "dim", 0) == 0:
        return W, e
    return None


def unit_pieces_to_select(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`W.chunk(E, 0)[e].squeeze(0)` (or `torch.split(W, 1)[e]`, either followed by `.squeeze(0)`
    or `[0]`; `W.unbind(0)[e]`) -> `W[e]`: the row e of W's first dim, as a view of the same
    elements (a finder reads `W[e]` as expert e's slice of a stacked parameter)."""
    if is_getitem(node) and is_int(node.args[1]) and is_call(node.args[0], "unbind") \
            and arg(node.args[0], 1, "dim", 0) == 0:
        W, e = node.args[0].args[0], node.args[1]
    elif (is_call(node, "squeeze") and len(node.args) == 2 and node.args[1] == 0 and not node.kwargs) or (
            is_call(node, "squeeze") and len(node.args) == 1 and node.kwargs == {"dim": 0}) or (
            is_getitem(node) and node.args[1] == 0):
        found = _unit_piece(node.args[0])
        if found is None:
            return None
        W, e = found
    else:
        return None
    if not isinstance(W, fx.Node) or not same_shape(shape_of(W)[1:], shape_of(node)):
        return None
    picked = insert_call(gm, node, operator.getitem, (W, e))
    order[picked] = order[node]
    node.replace_all_uses_with(picked)
    return f"{node.name} -> {W.name}[{e}]"


def slices_cat_to_whole(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`torch.cat((t[..., 0:a], t[..., a:b], ..., t[..., y:n]), dim=-1)` -> `t`: consecutive slices
    of one tensor's last dim, from 0 to its size, put back together are its values (PhiMoE's ids,
    each max's [..., 1] index concatenated, once both are slices of one top-k)."""
    if not is_call(node, "cat") or len(node.args) not in (1, 2) or node.kwargs.keys() - {"dim"}:
        return None
    pieces, dim = node.args[0], arg(node, 1, "dim", 0)
    if not isinstance(pieces, (list, tuple)) or len(pieces) < 2 or not all(is_getitem(p) for p in pieces):
        return None
    base = pieces[0].args[0]
    rank = len(shape_of(base) or ())
    if rank == 0 or dim not in (-1, rank - 1) or not isinstance(base, fx.Node):
        return None
    start = 0
    for piece in pieces:
        index = piece.args[1]
        if piece.args[0] is not base or not isinstance(index, tuple) or not index:
            return None
        last = index[-1]
        lead = index[:-1]
        if lead not in ((Ellipsis,), (slice(None),) * (rank - 1)) or not isinstance(last, slice) \
                or last.step not in (None, 1) or (last.start or 0) != start or not is_int(last.stop):
            return None
        start = last.stop
    if not isinstance(shape_of(base)[-1], int) or start != shape_of(base)[-1] or dtype_of(node) != dtype_of(base):
        return None
    node.replace_all_uses_with(base)
    return f"{node.name} -> {base.name}"
