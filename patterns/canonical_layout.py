"""Canonical forms of layout: transposes taken twice or moved past elementwise code, device moves
that stay, and rows tiled by index. Rules of `patterns.canonical` (which runs them with the others
and states what a rule must keep). transformers 4.5x's Llama 4 (`Llama4TextMoe` before v5) spells
its dense experts this way; these rules bring it to the form v5 writes, which `dense_bmm` reads.

Rules (eager spelling -> canonical form):

    a.transpose(i, j).transpose(i, j)               ->  a
        # also .t(), transpose(j, i), a permute that swaps two dims: the same view of a
    f(a.transpose(i, j))                            ->  f(a).transpose(i, j)
    g(a.transpose(i, j), b)                         ->  g(a, b').transpose(i, j)
    a.transpose(i, j).chunk(n, dim)[k]              ->  a.chunk(n, dim)[k].transpose(i, j)
        # f one-input elementwise code (a cast, sigmoid, exp, ...), g a product, sum, difference or
        # quotient with b' its other operand laid out for a (a number; a tensor broadcast over both
        # swapped dims; [E, f] beside [T, E, f] as b.unsqueeze(1); the same transpose of a tensor as
        # its base), pieces cut along a dim neither swapped; a computed by the graph (an input, a
        # weight, stays as written). The same elements from the same elements, applied only where
        # the new form's strides are the old one's (so a view after it reads the same layout).
        # Token-major einsums (`canonical_products.einsum_to_bmm`) leave such transposes; moved down
        # and collapsed in pairs, the experts' code runs expert-major, the form `dense_bmm` reads
    t.to(device)                                    ->  t
        # device t's own and nothing else asked: `to` returns t itself
    torch.gather(x, 0, A.reshape(-1, 1).expand(-1, d))  ->  x.repeat(E, 1)
    x[A.reshape(-1)], x.index_select(0, A.reshape(-1))  ->  x.repeat(E, 1)
        # A = arange(T) tiled E times (`torch.arange(T).view(1, -1).expand(E, -1)`, `.repeat(E, 1)`,
        # `arange(T).repeat(E)`), x [T, d]: row r of both is x[r mod T]
    x[arange(T).repeat_interleave(K)] (gather, index_select too)  ->  x.repeat_interleave(K, 0)
        # each value repeated K times (also `arange(T)[:, None].expand(-1, K).reshape(-1)`): row r is x[r // K]
    out.scatter_add_(0, A.reshape(-1, 1).expand(-1, d), v)  ->  out.add_(v.view(E, T, d).sum(0))
    out.index_add_(0, A.reshape(-1), v)                     ->  out.add_(v.view(E, T, d).sum(0))
    out.index_add_(0, arange(T).repeat_interleave(K), v)    ->  out.add_(v.view(T, K, d).sum(1))
        # (functional forms: out + ...) each of out's T rows gets the rows of v the index maps to it:
        # the same sums, added in another order (as CUDA's atomic index_add already may)
"""
from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from .common import (arg, call_sizes, example_value, insert_call, is_call, is_getitem, is_int, same_shape, same_size,
                     shape_of)

# one-input elementwise code that keeps its input's layout: casts and pointwise functions
_CASTS = ("to", "float", "half", "bfloat16", "double", "type_as")
_POINTWISE = ("sigmoid", "exp", "tanh", "relu", "neg", "abs", "sqrt", "rsqrt", "log", "silu", "gelu")


def swap_of(node) -> tuple[fx.Node, tuple[int, int]] | None:
    """(a, (i, j)), i < j, for a view of a that exchanges its dims i and j: `a.transpose(i, j)` (negative
    dims too, `torch.transpose`), `a.t()` of a 2-D a, `a.permute(...)` that swaps two dims; else None."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    a = node.args[0]
    rank = len(shape_of(a) or ())
    if rank < 2 or node.kwargs:
        return None
    if is_call(node, "t") and len(node.args) == 1:
        return (a, (0, 1)) if rank == 2 else None
    if is_call(node, "transpose") and len(node.args) == 3 and all(is_int(d) for d in node.args[1:]):
        i, j = sorted(d % rank for d in node.args[1:])
        return (a, (i, j)) if i != j else None
    if is_call(node, "permute"):
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        if len(dims) != rank or not all(is_int(d) for d in dims):
            return None
        moved = [i for i, d in enumerate(dims) if d % rank != i]
        if len(moved) == 2 and dims[moved[0]] % rank == moved[1]:
            return a, (moved[0], moved[1])
    return None


def transpose_pair_to_base(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`a.transpose(i, j).transpose(i, j)` (any spelling of `swap_of`, the same two dims) -> `a`: the
    same view, strides and storage."""
    outer = swap_of(node)
    inner = swap_of(outer[0]) if outer is not None else None
    if inner is None or inner[1] != outer[1]:
        return None
    base = inner[0]
    node.replace_all_uses_with(base)
    return f"{node.name} -> {base.name}"


def _one_input_elementwise(node: fx.Node) -> bool:
    """A cast to a dtype (no device, copy or memory format) or a pointwise function of one tensor."""
    if is_call(node, "to"):
        rest = list(node.args[1:]) + list(node.kwargs.values())
        return len(rest) == 1 and isinstance(rest[0], torch.dtype) and set(node.kwargs) <= {"dtype"}
    if is_call(node, "type_as"):
        return len(node.args) == 2 and not node.kwargs
    if is_call(node, *_CASTS):
        return len(node.args) == 1 and not node.kwargs
    if is_call(node, *_POINTWISE):
        return len(node.args) == 1 and not node.kwargs
    return False


_BINARY = ("mul", "__mul__", "add", "__add__", "sub", "__sub__", "div", "truediv", "__truediv__")


def _moved_operand(gm, before, other, rank: int, dims: tuple[int, int]):
    """The operand of a binary op that reads `x.transpose(*dims)` (rank `rank`) laid out for x
    itself, or None: a number as it is, a tensor of lower rank that broadcasts over both swapped
    dims as it is, a 2-D one beside 3-D values swapped (0, 1) as `other.unsqueeze(1)`, the same swap
    of a tensor as its base."""
    if isinstance(other, (int, float)) and not isinstance(other, bool):
        return other
    if not isinstance(other, fx.Node):
        return None
    swapped = swap_of(other)
    if swapped is not None and swapped[1] == dims and len(shape_of(swapped[0])) == rank:
        return swapped[0]
    r = len(shape_of(other) or (None,) * 99)
    if r < rank - dims[1]:
        return other  # both swapped dims are ones it is broadcast over
    if rank == 3 and dims == (0, 1) and r == 2:
        return insert_call(gm, before, torch.unsqueeze, (other, 1))  # [1, E, f] swapped: [E, 1, f]
    return None


def _fresh_value(node: fx.Node):
    """node's value computed again from its inputs' current fake values (a rule upstream may have
    changed their strides since Dynamo recorded node's), or None."""
    args, kwargs = fx.node.map_arg(node.args, example_value), fx.node.map_arg(node.kwargs, example_value)
    mode = next((v.fake_mode for v in args if hasattr(v, "fake_mode")), None)
    if mode is None:
        return None
    try:
        with mode:
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            return node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a value not computable here: the rule does not apply
        return None


def elementwise_of_transpose_to_transpose(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`f(a.transpose(i, j))` -> `f(a).transpose(i, j)` for f of `_one_input_elementwise`, and
    `g(a.transpose(i, j), b)` -> `g(a, b').transpose(i, j)` for g a product, sum, difference or
    quotient and b' the other operand laid out for a (`_moved_operand`), with a computed by the graph
    (an input, a weight say, stays as written). Each element is computed from the same elements, so
    the values agree; the rule applies only where the new form's strides are the old one's, so a view
    that reads the result sees the layout it was traced with. `f(a)` is new. Pieces of a transposed
    tensor cut along another dim (`a.transpose(i, j).chunk(2, -1)[k]`) are the same pieces of a,
    transposed."""
    if is_getitem(node) and is_int(node.args[1]) and is_call(node.args[0], "chunk", "split"):
        return _piece_of_transpose(gm, node, order)
    binary = is_call(node, *_BINARY) and len(node.args) == 2 and not node.kwargs
    if not (binary or _one_input_elementwise(node)):
        return None
    which = 0 if swap_of(node.args[0]) is not None or not binary else 1
    swapped = swap_of(node.args[which])
    # [T, E, f] expert values and [E, T] scores: 2-D and 3-D (attention's 4-D heads are left as written)
    if swapped is None or swapped[0].op == "placeholder" or len(shape_of(swapped[0])) > 3:
        return None
    a, dims = swapped
    before = dict.fromkeys(gm.graph.nodes)
    args = list(node.args)
    args[which] = a
    if binary:
        moved = _moved_operand(gm, node, node.args[1 - which], len(shape_of(a)), dims)
        if moved is None:
            return None
        args[1 - which] = moved
    try:
        if node.op == "call_method":
            with gm.graph.inserting_before(node):
                applied = gm.graph.call_method(node.target, tuple(args), dict(node.kwargs))
            applied.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
            applied.meta["example_value"] = example_value(node)  # a placeholder until computed below
            applied.meta["example_value"] = _fresh_value(applied)
        else:
            applied = insert_call(gm, node, node.target, tuple(args), dict(node.kwargs))
        twin = insert_call(gm, node, torch.transpose, (applied, *dims)) \
            if isinstance(example_value(applied), torch.Tensor) else None
    except Exception:  # noqa: BLE001 - a form whose value cannot be computed is not taken
        twin = None
    was, now = _fresh_value(node), example_value(twin) if twin is not None else None
    if not (isinstance(was, torch.Tensor) and isinstance(now, torch.Tensor) and was.dtype == now.dtype
            and same_shape(was.shape, now.shape) and _same_strides(was, now)):
        for new in reversed([n for n in gm.graph.nodes if n not in before]):
            gm.graph.erase_node(new)
        return None
    for new in gm.graph.nodes:
        if new not in before:
            order[new] = order[node]
    node.replace_all_uses_with(twin)
    name = node.target if isinstance(node.target, str) else node.target.__name__
    return f"{node.name} -> {name}({a.name}{', ...' if binary else ''}).transpose{dims}"


def _piece_of_transpose(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`a.transpose(i, j).chunk(n, dim)[k]` (or `split(size, dim)`, `torch.chunk`) with dim neither i
    nor j -> `a.chunk(n, dim)[k].transpose(i, j)`: the same elements, as long as the strides agree."""
    cut = node.args[0]
    swapped = swap_of(arg(cut, 0, "input"))
    rank = len(shape_of(arg(cut, 0, "input")) or ())
    dim = arg(cut, 2, "dim", 0)
    if swapped is None or swapped[0].op == "placeholder" or rank > 3 or not is_int(dim) or dim % rank in swapped[1]:
        return None
    size = arg(cut, 1, "chunks" if is_call(cut, "chunk") else "split_size_or_sections")
    if set(cut.kwargs) - {"dim"} or len(cut.args) > 3 or not is_int(size):
        return None
    a, dims = swapped
    target = torch.chunk if is_call(cut, "chunk") else torch.split
    cut_args = (a, size, dim)
    made = [u for u in a.users if u.target is target and u.args == cut_args and order.get(u, -1) <= order[node]]
    pieces = made[0] if made else insert_call(gm, node, target, cut_args)  # one cut for all its pieces
    piece = insert_call(gm, node, operator.getitem, (pieces, node.args[1]))
    twin = insert_call(gm, node, torch.transpose, (piece, *dims))
    fresh = _fresh_value(cut)
    was, now = fresh[node.args[1]] if isinstance(fresh, (tuple, list)) else None, example_value(twin)
    if not (isinstance(was, torch.Tensor) and isinstance(now, torch.Tensor) and same_shape(was.shape, now.shape)
            and _same_strides(was, now)):
        for new in (twin, piece, *([] if made else [pieces])):
            gm.graph.erase_node(new)
        return None
    for new in (pieces, piece, twin):
        order.setdefault(new, order[node])
    node.replace_all_uses_with(twin)
    return f"{node.name} -> {target.__name__}({a.name})[{node.args[1]}].transpose{dims}"


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal strides, where dims of size 1 (whose stride nothing reads) may differ; undecidable
    symbolic strides count as different."""
    try:
        return all((is_int(size) and size == 1) or same_size(sa, sb) for size, sa, sb in zip(a.shape, a.stride(), b.stride()))
    except Exception:  # noqa: BLE001
        return False


def same_device_move_to_self(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`t.to(device)` with device t's own (a CUDA device named with its index) and no other argument ->
    `t`: `to` returns t itself."""
    if not is_call(node, "to") or node.op != "call_method" or len(node.args) != 2 or node.kwargs:
        return None
    t, device = node.args
    value = example_value(t)
    if isinstance(device, str):
        device = torch.device(device)
    if not isinstance(device, torch.device) or not isinstance(value, torch.Tensor):
        return None
    # the same type and index ('cuda' without one means the current device at run time: not provably t's)
    if device.type != value.device.type or (device.index != value.device.index and device.type != "cpu"):
        return None
    node.replace_all_uses_with(t)
    return f"{node.name} -> {t.name}"


# -- rows copied by index: arange(T) tiled E times, or each of its values repeated K times ----------

class Copies(NamedTuple):
    """An index holding arange(T) `copies` times: tiled (row r is r mod T, `arange(T).repeat(E)`) or
    interleaved (row r is r // K, `arange(T).repeat_interleave(K)`)."""

    interleaved: bool
    copies: int
    T: object


def _arange_length(node) -> object | None:
    """T for `torch.arange(T)` / `torch.arange(0, T)` (step 1, integer), else None."""
    if not is_call(node, "arange") or node.op != "call_function":
        return None
    args = list(node.args)
    if len(args) == 2 and args[0] == 0:
        args = args[1:]
    if len(args) != 1 or set(node.kwargs) - {"device", "dtype"}:
        return None
    dtype = node.kwargs.get("dtype")
    if dtype is not None and (dtype.is_floating_point or dtype == torch.bool):
        return None
    return example_value(args[0])  # a symbolic length (a node under dynamic shapes) as its SymInt


def arange_as(node, dim: int) -> object | None:
    """T when `node` is arange(T) made a [1, T] row (dim 0: `.view(1, -1)`, `[None]`, `.unsqueeze(0)`)
    or a [T, 1] column (dim 1: `.view(-1, 1)`, `[:, None]`, `.unsqueeze(1)`)."""
    if not isinstance(node, fx.Node) or not node.args:
        return None
    T = _arange_length(node.args[0])
    shape = shape_of(node)
    if T is None or len(shape) != 2 or not same_size(shape[dim], 1):
        return None
    if is_call(node, "view", "reshape") or (is_call(node, "unsqueeze") and arg(node, 1, "dim") in (dim, dim - 2)):
        return T
    new_dim = (None, (None,), (None, slice(None))) if dim == 0 else ((slice(None), None),)
    return T if is_getitem(node) and node.args[1] in new_dim else None


def arange_copies(node) -> Copies | None:
    """The `Copies` `node` holds, flat [copies * T] or as a matrix ([E, T] tiled, [T, K] interleaved):
    a [1, T] row of arange(T) widened to [E, T] (`expand(E, -1)`, `repeat(E, 1)`), a [T, 1] column
    widened to [T, K] (`expand(-1, K)`, `repeat(1, K)`), a flat view of either (`.reshape(-1)`,
    `.view(-1)`, `.flatten()`), `arange(T).repeat(E)`, `arange(T).repeat_interleave(K)`, or a flat
    one viewed as its matrix; else None."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    shape, src = shape_of(node), node.args[0]
    if len(shape) == 1 and is_call(node, "reshape", "view", "flatten"):
        rest = node.args[1:]
        flat = rest in ((-1,), ((-1,),)) or (is_call(node, "flatten") and not rest and not node.kwargs)
        return arange_copies(src) if flat and len(shape_of(src)) == 2 else None
    if len(shape) == 1 and is_call(node, "repeat") and len(node.args) == 2 and is_int(node.args[1]):
        T = _arange_length(src)
        return Copies(False, node.args[1], T) if T is not None else None
    if len(shape) == 1 and is_call(node, "repeat_interleave"):
        repeats, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
        T = _arange_length(src)
        ok = is_int(repeats) and dim in (None, 0, -1) and set(node.kwargs) <= {"repeats", "dim", "output_size"}
        return Copies(True, repeats, T) if ok and T is not None else None
    if len(shape) != 2:
        return None
    if is_call(node, "view", "reshape") and len(shape_of(src)) == 1:
        flat = arange_copies(src)  # a flat one viewed as its matrix
        want = (flat.T, flat.copies) if flat is not None and flat.interleaved else (flat.copies, flat.T) if flat else None
        return flat if want and same_size(shape[0], want[0]) and same_size(shape[1], want[1]) else None
    if not is_call(node, "expand", "repeat"):
        return None
    reps = call_sizes(node)
    if (T := arange_as(src, 0)) is not None:  # [1, T] -> [E, T]
        if is_call(node, "repeat") and reps[1:] != (1,):
            return None
        return Copies(False, shape[0], T) if is_int(shape[0]) and same_size(shape[1], T) else None
    if (T := arange_as(src, 1)) is not None:  # [T, 1] -> [T, K]
        if is_call(node, "repeat") and reps[:1] != (1,):
            return None
        return Copies(True, shape[1], T) if is_int(shape[1]) and same_size(shape[0], T) else None
    return None


def _copies_column(idx) -> Copies | None:
    """The `Copies` of every column of idx [copies * T, d]: a [copies * T, 1] column of an
    `arange_copies` index (`A.reshape(-1, 1)`, `flat.view(-1, 1)`, `flat[:, None]`,
    `flat.unsqueeze(-1)`) widened (`expand(-1, d)`, `expand_as`, `repeat(1, d)`)."""
    if not is_call(idx, "expand", "expand_as", "repeat") or not isinstance(idx.args[0], fx.Node):
        return None
    if is_call(idx, "repeat") and (len(call_sizes(idx)) != 2 or call_sizes(idx)[0] != 1):
        return None
    column = idx.args[0]
    if len(shape_of(column)) != 2 or not same_size(shape_of(column)[1], 1) or len(shape_of(idx)) != 2:
        return None
    if is_call(column, "view", "reshape") and column.args[1:] in ((-1, 1), ((-1, 1),)):
        return arange_copies(column.args[0])
    flat = column.args[0]
    if len(shape_of(flat)) != 1:
        return None
    if (is_call(column, "unsqueeze") and arg(column, 1, "dim") in (-1, 1)) or (
            is_getitem(column) and column.args[1] == (slice(None), None)):
        return arange_copies(flat)
    return None


def _copied(x, v, copies: Copies) -> bool:
    """x a 2-D tensor of T rows; v (when given) its copies: [copies * T] rows as wide."""
    sx = shape_of(x)
    if len(sx) != 2 or not same_size(sx[0], copies.T):
        return False
    sv = shape_of(v) if v is not None else None
    return sv is None or (len(sv) == 2 and same_size(sv[0], copies.copies * copies.T) and same_size(sv[1], sx[1]))


def copied_rows_to_repeat(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`torch.gather(x, 0, idx)` with every column of idx an `arange_copies` index (`_copies_column`),
    `x[flat]` or `x.index_select(0, flat)` with flat one -> `x.repeat(E, 1)` (tiled: row r is
    x[r mod T]) or `x.repeat_interleave(K, 0)` (interleaved: row r is x[r // K])."""
    copies = x = None
    if is_call(node, "gather") and arg(node, 1, "dim") in (0, -2) and not arg(node, 3, "sparse_grad", False):
        x, idx = arg(node, 0, "input"), arg(node, 2, "index")
        copies = _copies_column(idx) if isinstance(idx, fx.Node) else None
        if copies is not None and not (isinstance(x, fx.Node) and _copied(x, idx, copies)):
            copies = None
    elif is_getitem(node) and isinstance(node.args[1], fx.Node):
        x, flat = node.args
        copies = arange_copies(flat) if len(shape_of(flat)) == 1 else None
    elif is_call(node, "index_select") and len(node.args) == 3 and node.args[1] in (0, -2) and not node.kwargs:
        x, _, flat = node.args
        copies = arange_copies(flat) if len(shape_of(flat)) == 1 else None
    if copies is None or not isinstance(x, fx.Node) or not _copied(x, None, copies):
        return None
    if copies.interleaved:
        copied = insert_call(gm, node, torch.repeat_interleave, (x, copies.copies, 0))
        spelled = f"{x.name}.repeat_interleave({copies.copies}, 0)"
    else:
        copied = insert_call(gm, node, torch.Tensor.repeat, (x, copies.copies, 1))
        spelled = f"{x.name}.repeat({copies.copies}, 1)"
    order[copied] = order[node]
    node.replace_all_uses_with(copied)
    return f"{node.name} -> {spelled}"


def copies_added_back_to_sum(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`out.scatter_add_(0, idx, v)` (idx `_copies_column`) or `out.index_add_(0, flat, v)` (flat an
    `arange_copies` index), out [T, d] and v [copies * T, d] -> `out.add_(v.view(E, T, d).sum(0))`
    (tiled) or `out.add_(v.view(T, K, d).sum(1))` (interleaved); the functional forms
    (`scatter_add`, `index_add`, `torch.scatter_add`) -> `out + ...`. Each row of out gets the rows
    of v that the index maps to it."""
    if is_call(node, "scatter_add", "scatter_add_") and len(node.args) + len(node.kwargs) == 4:
        out, dim, idx, v = (arg(node, i, name) for i, name in enumerate(("input", "dim", "index", "src")))
        copies = _copies_column(idx) if isinstance(idx, fx.Node) and same_shape(shape_of(idx), shape_of(v)) else None
    elif is_call(node, "index_add", "index_add_") and len(node.args) + len(node.kwargs) == 4:
        out, dim, flat, v = (arg(node, i, name) for i, name in enumerate(("input", "dim", "index", "source")))
        copies = arange_copies(flat) if isinstance(flat, fx.Node) and len(shape_of(flat)) == 1 else None
    else:
        return None
    if copies is None or dim not in (0, -2) or not all(isinstance(t, fx.Node) for t in (out, v)):
        return None
    if not _copied(out, v, copies) or example_value(out).dtype != example_value(v).dtype:
        return None
    width = shape_of(out)[1]
    if not is_int(width):
        return None
    # the copies' count and the width are static; the token count goes as -1 (no symbol baked in)
    sizes = (-1, copies.copies, width) if copies.interleaved else (copies.copies, -1, width)
    per_copy = insert_call(gm, node, torch.Tensor.view, (v, *sizes))
    summed = insert_call(gm, node, torch.sum, (per_copy, 1 if copies.interleaved else 0))
    if str(node.target).endswith("_"):
        with gm.graph.inserting_before(node):
            added = gm.graph.call_method("add_", (out, summed))
        added.meta.update({k: val for k, val in node.meta.items() if k in ("example_value", "nn_module_stack", "stack_trace")})
    else:
        added = insert_call(gm, node, operator.add, (out, summed))
    for new in (per_copy, summed, added):
        order[new] = order[node]
    node.replace_all_uses_with(added)
    order.pop(node)
    gm.graph.erase_node(node)
    shape = "T, K, d).sum(1)" if copies.interleaved else "E, T, d).sum(0)"
    return f"{node.name} -> {out.name} + {v.name}.view({shape}"
