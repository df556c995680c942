"""Canonical forms of layout: transposes taken twice or moved past elementwise code, device moves
that stay, and rows tiled by index. Rules of `patterns.canonical` (which runs them with the others
and states what a rule must keep). transformers 4.5x's Llama 4 (`Llama4TextMoe` before v5) spells
its dense experts this way; these rules bring it to the form v5 writes, which `dense_bmm` reads.

Rules (eager spelling -> canonical form):

    a.transpose(0, 1).transpose(0, 1)               ->  a
        # also .t(), transpose(1, 0), permute(1, 0) of a 2-D tensor: the same view of a
    f(a.transpose(0, 1))                            ->  f(a).transpose(0, 1)
        # f one-input elementwise code (a cast, sigmoid, exp, ...) of a 2-D a that the graph computes
        # (not an input: weights stay as written): f runs on the same elements and keeps the layout
    t.to(device)                                    ->  t
        # device t's own and nothing else asked: `to` returns t itself
    torch.gather(x, 0, A.reshape(-1, 1).expand(-1, d))  ->  x.repeat(E, 1)
    x[A.reshape(-1)], x.index_select(0, A.reshape(-1))  ->  x.repeat(E, 1)
        # A = arange(T) tiled E times (`torch.arange(T).view(1, -1).expand(E, -1)`, `.repeat(E, 1)`,
        # `arange(T).repeat(E)`), x [T, d]: row r of both is x[r mod T]
    out.scatter_add_(0, A.reshape(-1, 1).expand(-1, d), v)  ->  out.add_(v.view(E, T, d).sum(0))
    out.index_add_(0, A.reshape(-1), v)                     ->  out.add_(v.view(E, T, d).sum(0))
        # (functional forms: out + ...) each of out's T rows gets the E rows of v at r mod T: the
        # same sums, added in another order (as CUDA's atomic index_add already may)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .common import arg, example_value, insert_call, is_call, is_getitem, is_int, same_size, shape_of

# one-input elementwise code that keeps its input's layout: casts and pointwise functions
_CASTS = ("to", "float", "half", "bfloat16", "double", "type_as")
_POINTWISE = ("sigmoid", "exp", "tanh", "relu", "neg", "abs", "sqrt", "rsqrt", "log", "silu", "gelu")


def _transposed_2d(node) -> fx.Node | None:
    """a for `a.transpose(0, 1)` (either order of dims, negative dims, `torch.transpose`), `a.t()`,
    `a.permute(1, 0)` on a 2-D a; else None."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    a = node.args[0]
    if len(shape_of(a)) != 2:
        return None
    if is_call(node, "t") and len(node.args) == 1 and not node.kwargs:
        return a
    if is_call(node, "transpose") and len(node.args) == 3 and not node.kwargs:
        dims = {d % 2 for d in node.args[1:] if is_int(d)}
        return a if dims == {0, 1} else None
    if is_call(node, "permute") and not node.kwargs:
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        return a if [d % 2 if is_int(d) else d for d in dims] == [1, 0] else None
    return None


def transpose_pair_to_base(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`a.transpose(0, 1).transpose(0, 1)` (any spelling of `_transposed_2d`) -> `a`: the same view,
    strides and storage."""
    inner = _transposed_2d(node)
    base = _transposed_2d(inner)
    if base is None:
        return None
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


def elementwise_of_transpose_to_transpose(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`f(a.transpose(0, 1))` -> `f(a).transpose(0, 1)` for f of `_one_input_elementwise` and a 2-D a
    the graph computes (an input, a weight say, stays as written). f maps each element alone and
    keeps a dense input's strides, so both give the same values in the same layout; `f(a)` is new."""
    if not _one_input_elementwise(node):
        return None
    a = _transposed_2d(node.args[0])
    if a is None or a.op == "placeholder":
        return None
    value = example_value(node.args[0])
    if not isinstance(value, torch.Tensor) or not _dense(value):
        return None
    if node.op == "call_method":
        with gm.graph.inserting_before(node):
            applied = gm.graph.call_method(node.target, (a, *node.args[1:]), dict(node.kwargs))
        applied.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
        fake = example_value(node)
        if isinstance(fake, torch.Tensor):
            applied.meta["example_value"] = fake.t()
    else:
        applied = insert_call(gm, node, node.target, (a, *node.args[1:]), dict(node.kwargs))
    order[applied] = order[node]
    twin = insert_call(gm, node, torch.transpose, (applied, 0, 1))
    order[twin] = order[node]
    node.replace_all_uses_with(twin)
    return f"{node.name} -> {node.target if isinstance(node.target, str) else node.target.__name__}({a.name}).t()"


def _dense(value: torch.Tensor) -> bool:
    """A 2-D tensor whose elements fill its storage span without overlap (contiguous or transposed)."""
    s0, s1 = value.stride()
    rows, cols = value.shape
    return (s1 == 1 and s0 == cols) or (s0 == 1 and s1 == rows) or rows <= 1 or cols <= 1


def same_device_move_to_self(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`t.to(device)` with device t's own and no other argument -> `t`: `to` returns t itself."""
    if not is_call(node, "to") or node.op != "call_method" or len(node.args) != 2 or node.kwargs:
        return None
    t, device = node.args
    value = example_value(t)
    if isinstance(device, str):
        device = torch.device(device)
    if not isinstance(device, torch.device) or not isinstance(value, torch.Tensor):
        return None
    if device.type != value.device.type or (device.index is not None and device.index != value.device.index):
        return None
    node.replace_all_uses_with(t)
    return f"{node.name} -> {t.name}"


# -- rows tiled by index: arange(T) repeated E times --------------------------------------------------

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
    return args[0]


def _row_of_arange(node) -> object | None:
    """T when `node` is arange(T) made a [1, T] row (`.view(1, -1)`, `.view(1, T)`, `[None]`,
    `.unsqueeze(0)`, `.reshape(1, -1)`)."""
    if not isinstance(node, fx.Node) or not node.args:
        return None
    T = _arange_length(node.args[0])
    if T is None or len(shape_of(node)) != 2 or not same_size(shape_of(node)[0], 1):
        return None
    if is_call(node, "view", "reshape") or (is_call(node, "unsqueeze") and arg(node, 1, "dim") == 0):
        return T
    if is_getitem(node) and node.args[1] in (None, (None,), (None, slice(None))):
        return T
    return None


def tiled_arange(node) -> tuple[int, object] | None:
    """(E, T) when `node` holds arange(T) repeated E times in row-major order: a [E, T] matrix of
    rows arange(T) (`row.expand(E, -1)`, `row.expand(E, T)`, `row.repeat(E, 1)`, or a flat one
    viewed [E, T]), a flat view of one (`.reshape(-1)`, `.view(-1)`, `.flatten()`), or
    `arange(T).repeat(E)`; else None."""
    if not isinstance(node, fx.Node) or not node.args:
        return None
    shape = shape_of(node)
    if len(shape) == 1 and is_call(node, "reshape", "view", "flatten"):
        rest = node.args[1:]
        flat = rest in ((-1,), ((-1,),)) or (is_call(node, "flatten") and not rest and not node.kwargs)
        inner = tiled_arange(node.args[0]) if flat and len(shape_of(node.args[0])) == 2 else None
        return inner
    if len(shape) == 1 and is_call(node, "repeat") and len(node.args) == 2 and is_int(node.args[1]):
        T = _arange_length(node.args[0])
        return (node.args[1], T) if T is not None else None
    if len(shape) == 2 and is_call(node, "view", "reshape") and len(shape_of(node.args[0])) == 1:
        flat = tiled_arange(node.args[0])  # a flat tiled arange viewed as its [E, T] matrix
        return flat if flat is not None and shape[0] == flat[0] and same_size(shape[1], flat[1]) else None
    if len(shape) == 2 and is_call(node, "expand", "repeat"):
        T = _row_of_arange(node.args[0])
        if T is None or not is_int(shape[0]) or not same_size(shape[1], T):
            return None
        sizes = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        if is_call(node, "repeat") and tuple(sizes)[1:] != (1,):
            return None
        return shape[0], T
    return None


def _tiled_column(idx) -> tuple[int, object] | None:
    """(E, T) when idx [E*T, d] holds, in every column, arange(T) tiled E times: a [E*T, 1] column of
    a tiled arange (`A.reshape(-1, 1)`, `flat.view(-1, 1)`, `flat[:, None]`, `flat.unsqueeze(-1)`),
    widened (`expand(-1, d)`, `expand_as`, `repeat(1, d)`)."""
    if not is_call(idx, "expand", "expand_as", "repeat") or not isinstance(idx.args[0], fx.Node):
        return None
    if is_call(idx, "repeat"):
        reps = idx.args[1] if len(idx.args) == 2 and isinstance(idx.args[1], (tuple, list)) else idx.args[1:]
        if len(reps) != 2 or reps[0] != 1:
            return None
    column = idx.args[0]
    if len(shape_of(column)) != 2 or not same_size(shape_of(column)[1], 1) or len(shape_of(idx)) != 2:
        return None
    if is_call(column, "view", "reshape") and column.args[1:] in ((-1, 1), ((-1, 1),)):
        src = column.args[0]
        tiled = tiled_arange(src)
    elif is_call(column, "unsqueeze") and arg(column, 1, "dim") in (-1, 1):
        tiled = tiled_arange(column.args[0]) if len(shape_of(column.args[0])) == 1 else None
    elif is_getitem(column) and column.args[1] == (slice(None), None):
        tiled = tiled_arange(column.args[0]) if len(shape_of(column.args[0])) == 1 else None
    else:
        return None
    return tiled


def _rows_of(x, E: int, T) -> bool:
    """x a 2-D tensor of T rows read E times in all."""
    return len(shape_of(x)) == 2 and same_size(shape_of(x)[0], T) and E >= 1


def tiled_rows_to_repeat(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`torch.gather(x, 0, idx)` with idx every column a tiled arange (`_tiled_column`), `x[flat]`,
    `x.index_select(0, flat)` with flat a flat tiled arange -> `x.repeat(E, 1)`: row r is x[r mod T]."""
    tiled = x = None
    if is_call(node, "gather") and arg(node, 1, "dim") in (0, -2) and not arg(node, 3, "sparse_grad", False):
        x, idx = arg(node, 0, "input"), arg(node, 2, "index")
        tiled = _tiled_column(idx) if isinstance(idx, fx.Node) else None
        if tiled is not None and not same_size(shape_of(idx)[1], shape_of(x)[1] if len(shape_of(x)) == 2 else -1):
            tiled = None
    elif is_getitem(node) and isinstance(node.args[1], fx.Node):
        x, flat = node.args
        tiled = tiled_arange(flat) if len(shape_of(flat)) == 1 else None
    elif is_call(node, "index_select") and len(node.args) == 3 and node.args[1] in (0, -2) and not node.kwargs:
        x, _, flat = node.args
        tiled = tiled_arange(flat) if len(shape_of(flat)) == 1 else None
    if tiled is None or not isinstance(x, fx.Node) or not _rows_of(x, *tiled):
        return None
    E, T = tiled
    repeated = insert_call(gm, node, torch.Tensor.repeat, (x, E, 1))
    order[repeated] = order[node]
    node.replace_all_uses_with(repeated)
    return f"{node.name} -> {x.name}.repeat({E}, 1)"


def tiled_scatter_add_to_sum(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`out.scatter_add_(0, idx, v)` (idx `_tiled_column`) or `out.index_add_(0, flat, v)` (flat a
    flat tiled arange), out [T, d] and v [E*T, d] -> `out.add_(v.view(E, T, d).sum(0))`; the
    functional forms (`scatter_add`, `index_add`, `torch.scatter_add`) -> `out + v.view(E, T, d).sum(0)`.
    Each row of out gets the E rows of v at r mod T."""
    if is_call(node, "scatter_add", "scatter_add_") and len(node.args) + len(node.kwargs) == 4:
        out, dim, idx, v = (arg(node, i, name) for i, name in enumerate(("input", "dim", "index", "src")))
        tiled = _tiled_column(idx) if isinstance(idx, fx.Node) else None
    elif is_call(node, "index_add", "index_add_") and len(node.args) + len(node.kwargs) == 4:
        out, dim, flat, v = (arg(node, i, name) for i, name in enumerate(("input", "dim", "index", "source")))
        tiled = tiled_arange(flat) if isinstance(flat, fx.Node) and len(shape_of(flat)) == 1 else None
    else:
        return None
    if tiled is None or dim not in (0, -2) or not all(isinstance(t, fx.Node) for t in (out, v)):
        return None
    E, T = tiled
    (so, sv) = shape_of(out), shape_of(v)
    if len(so) != 2 or len(sv) != 2 or not same_size(so[0], T) or not same_size(sv[0], E * T) or not same_size(so[1], sv[1]):
        return None
    if example_value(out).dtype != example_value(v).dtype:
        return None
    per_copy = insert_call(gm, node, torch.Tensor.view, (v, E, T, so[1]))
    summed = insert_call(gm, node, torch.sum, (per_copy, 0))
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
    return f"{node.name} -> {out.name} + {v.name}.view({E}, T, d).sum(0)"
