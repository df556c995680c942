"""Canonical forms of products: einsum and matmul spellings as batched matmuls, products of
gathered weights as einsums, and a loop over the experts' blocks of rows as grouped products. Rules of `patterns.canonical` (which runs them
with the others and states what a rule must keep).

Rules (eager spelling -> canonical form):

    torch.einsum("td,edn->etn", x, W)             ->  torch.bmm(x.unsqueeze(0).expand(E, -1, -1), W)
    torch.einsum("etn,edn->etd", a, W)            ->  torch.bmm(a, W.transpose(1, 2))
    torch.einsum("td,edf->tef", x, W)             ->  torch.bmm(x.unsqueeze(0).expand(E, -1, -1), W).transpose(0, 1)
        # an einsum of two operands that is a batched matrix product: one contracted letter, the
        # batch letter b and n on one operand (b may be missing from the other: broadcast by
        # expand, no copy); the operands laid out [b, m, i] and [b, i, n] by transpose/permute, the
        # [b, m, n] product laid out as the output asks (token-major [m, b, n]: a transpose, which
        # `canonical_layout` moves past the elementwise code after it). A product laid out other
        # than the einsum's own result only where no reader depends on its strides (a view does);
        # under autocast (float32 operands, a bf16/fp16 result) the bmm is lowered as the einsum was
    x @ W, x[None] @ W  (W [E, i, n], x [T, i])   ->  torch.bmm(x.unsqueeze(0).expand(E, -1, -1), W)
    a @ W  (a [E, T, i])                          ->  torch.bmm(a, W)
        # matmul broadcasting rows over a stack of weights: the same products, as one batched form
    torch.einsum("te,etd->td", g, y)              ->  (y * g.t().unsqueeze(-1)).sum(0)
    torch.einsum("te,ted->td", g, y)              ->  (y * g.unsqueeze(-1)).sum(1)
        # a [T, E] matrix weighting [E, T, d] (or [T, E, d]) values summed over E
        # (both: the same sums of products, in float32/float64 only: in bf16/fp16 each product
        # would be rounded before the sum, which einsum's matmul accumulates in float32)
    torch.einsum("te,tm->etm", g, x)              ->  g.t().unsqueeze(-1) * x.unsqueeze(0)
        # an einsum that contracts no letter (GShard-style dispatch of tokens to experts): each
        # element one product, as the broadcast product of the operands laid out as the output
    F.linear(x, W, b).view(T, E, f)               ->  torch.einsum("td,efd->tef", x, W.view(E, f, d)) + b.view(E, f)
        # every expert's first projection packed in one Linear(d, E * f) (`packed_linear_view_to_einsum`),
        # where the [T, E, f] value reaches a product with a stacked [E, ., .] operand
    torch.addmm(b, a, W)                          ->  a @ W + b
        # 2-D a and W, beta = alpha = 1: the product and the bias added as two ops (the form
        # `module_list.biased_matmul` reads: an expert `addmm(B[e], rows, W[e])`), up to rounding
    x[:, None, None, :] @ W[ids]                  ->  torch.einsum("ta,tkab->tkb", x, W[ids]).unsqueeze(2)
    torch.bmm(x[:, None].expand(T, K, d).reshape(T * K, 1, d), W[ids.reshape(-1)])
                                                  ->  torch.einsum("ta,tkab->tkb", x, W[ids]).reshape(-1, 1, b)
        # products of weights gathered by [T, K] ids with one row per slot, the einsums
        # `gathered_weights` reads (`gathered_product_to_einsum` lists the forms); the reshapes
        # left around them go by `canonical_views`
    blocks = torch.split(rows, C.tolist())         ->  offs = torch.cumsum(C, 0, dtype=torch.int32)
    y = torch.cat([f(b, W1[e], W2[e]) for e, b in enumerate(blocks)])
                                                  ->  y = f(rows, W1, W2), each `b @ W[e]` (through
                                                      transposes of W[e]) as torch._grouped_mm(rows, W, offs=offs)
        # torchtitan's and torchtune's for-loop experts (traced whole with capture_scalar_outputs):
        # every block through the same steps, row by row (elementwise, chunks of the last dim) and
        # products with its own slices of 3-D weights; bf16 operands with strides grouped_mm takes;
        # rows[:sum(sizes)] read as rows where the graph asserts sum(sizes) == or >= its row count
"""
from __future__ import annotations

import math
import operator
import weakref

import torch
import torch.fx as fx

from .canonical_views import chain_top, mark, view_root
from .common import (Rejection, arg, dtype_of, getitem_of, insert_call, is_call, is_getitem, is_int, op_name, same_shape,
                     same_size, shape_of, table_index)


# --- einsum as batched products --------------------------------------------------------------


def _einsum_spec(node: fx.Node) -> tuple[str, str, str, fx.Node, fx.Node] | None:
    """(letters of operand a, of operand b, of the output, a, b) of a two-operand einsum with an
    explicit output and no ellipsis, each letter at most once per term; else None."""
    if not is_call(node, "einsum") or node.kwargs or not node.args or not isinstance(node.args[0], str):
        return None
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    terms = equation.replace(" ", "")
    if len(operands) != 2 or "..." in terms or terms.count("->") != 1 or not all(isinstance(o, fx.Node) for o in operands):
        return None
    ins, out = terms.split("->")
    ins = ins.split(",")
    if len(ins) != 2 or not all(t.isalpha() and len(set(t)) == len(t) for t in (*ins, out)):
        return None
    if any(len(shape_of(o) or ()) != len(t) for o, t in zip(operands, ins)):
        return None
    return ins[0], ins[1], out, operands[0], operands[1]


def _autocast_dtype(node: fx.Node, *operands: fx.Node) -> tuple[bool, torch.dtype | None]:
    """(the product can be respelled, the autocast dtype it ran in or None): operands and result
    of one dtype, or float32 operands lowered to the bf16/fp16 result (Dynamo traced it under
    autocast, as it runs)."""
    out, ins = dtype_of(node), {dtype_of(o) for o in operands}
    if out is None or None in ins:
        return False, None
    if ins == {out}:
        return True, None
    lowered = out in (torch.bfloat16, torch.float16) and all(dt.is_floating_point for dt in ins)
    return lowered, out if lowered else None


def _laid_out(gm, before, node: fx.Node, letters: str, order: str) -> fx.Node:
    """`node` (dims named by `letters`) with its dims in `order`: itself, a transpose of two, or a permute."""
    if letters == order:
        return node
    perm = [letters.index(c) for c in order]
    swapped = [i for i, p in enumerate(perm) if p != i]
    if len(swapped) == 2:
        return insert_call(gm, before, torch.transpose, (node, *swapped))
    return insert_call(gm, before, torch.permute, (node, perm))


def einsum_to_bmm(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """A two-operand einsum that is a batched matrix product, as `torch.bmm` (see the module docstring)."""
    spec = _einsum_spec(node)
    if spec is None or len(spec[2]) != 3:
        return None
    la, lb, out, a, b = spec
    ok, autocast = _autocast_dtype(node, a, b)  # under autocast the bmm is lowered as the einsum was
    if not ok:
        return None
    contracted = (set(la) & set(lb)) - set(out)
    if len(contracted) != 1 or not set(la + lb) <= set(out) | contracted:
        return None
    (i,) = contracted
    if _goes_right(la, lb, out, i):
        la, lb, a, b = lb, la, b, a
    letters = _bmm_letters(la, lb, i)
    if letters != out and _bmm_letters(lb, la, i) == out:  # the other order needs no transpose after
        la, lb, a, b, letters = lb, la, b, a, out
    if letters is None:
        return None
    batch, m, n = letters
    E = shape_of(b)[lb.index(batch)] if batch in lb else shape_of(a)[la.index(batch)]
    if not isinstance(E, int):
        return None
    canonical = batch + m + n
    if out != canonical and not _layout_free(node):
        return None  # a view reads the einsum's own (contiguous) layout, which the permuted product lacks

    def side(t, letters: str, order: str):  # t laid out as `order`; broadcast over E where it lacks the batch
        if batch in letters:
            return _laid_out(gm, node, t, letters, order)
        rows = _laid_out(gm, node, t, letters, order.replace(batch, ""))
        return insert_call(gm, node, torch.Tensor.expand, (insert_call(gm, node, torch.unsqueeze, (rows, 0)), E, -1, -1))

    left, right = side(a, la, batch + m + i), side(b, lb, batch + i + n)
    product = insert_call(gm, node, torch.bmm, (left, right), autocast=autocast)
    result = _laid_out(gm, node, product, canonical, out)
    node.replace_all_uses_with(result)
    return f"{node.name} ({node.args[0]!r}) -> bmm" + ("" if result is product else f", laid out {out}")


def _feeds_expert_product(node: fx.Node, E: int, f) -> bool:
    """Whether `node` [T, E, f] reaches, through elementwise code and its pieces, a product (einsum,
    bmm, matmul) with a 3-D [E, ., .] weight (an input of the graph) that holds an f-wide dim: the
    experts' next projection (attention's keys, split into heads too, are computed: not weights)."""
    seen, todo = set(), list(node.users)
    while todo and len(seen) < 64:
        user = todo.pop()
        if user in seen or user.op not in ("call_function", "call_method"):
            continue
        seen.add(user)
        name = op_name(user.target)
        if name in ("einsum", "bmm", "matmul", "__matmul__"):
            others = [a for a in user.all_input_nodes if a not in seen and a is not node]
            if any(len(shape_of(o) or ()) == 3 and shape_of(o)[0] == E and f in shape_of(o)[1:] and _a_weight(o) for o in others):
                return True
            continue
        if name in _ELEMENTWISE and name not in ("sum", "mean", "gather", "index_select", "reshape", "flatten"):
            todo.extend(user.users)
    return False


def _a_weight(node: fx.Node) -> bool:
    """An input of the graph (a parameter), read as it is or through transposes and views."""
    while is_call(node, "transpose", "permute", "view", "reshape", "t") and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.op in ("placeholder", "get_attr")


def packed_linear_view_to_einsum(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`F.linear(x, W, b).view(T, E, f)` (x [T, d], W [E*f, d]; `reshape`, `unflatten(-1, (E, f))`) ->
    `torch.einsum("td,efd->tef", x, W.view(E, f, d)) + b.view(E, f)`: every expert's first projection
    packed in one Linear (column block e of its output is expert e's), the same dot products per
    element. Only where the [T, E, f] value reaches a product with a stacked [E, ., .] operand (the
    experts' next projection), so a projection split into heads stays one matmul."""
    if not is_call(node, "view", "reshape", "unflatten") or len(shape_of(node) or ()) != 3:
        return None
    lin = node.args[0]
    if not is_call(lin, "linear") or len(lin.users) != 1 or lin.kwargs.keys() - {"bias"}:
        return None
    x, W = lin.args[0], lin.args[1]
    b = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
    T, E, f = shape_of(node)
    if not (isinstance(x, fx.Node) and isinstance(W, fx.Node) and len(shape_of(x)) == 2 and len(shape_of(W)) == 2):
        return None
    d = shape_of(W)[1]
    if not (is_int(E) and is_int(f) and is_int(d) and shape_of(W)[0] == E * f and same_size(shape_of(x)[0], T)):
        return None
    if is_call(node, "unflatten") and not (node.args[1] in (-1, 1) and tuple(node.args[2]) == (E, f)):
        return None
    dtypes = {dtype_of(x), dtype_of(W), dtype_of(lin)} | ({dtype_of(b)} if isinstance(b, fx.Node) else set())
    if len(dtypes) != 1 or not _feeds_expert_product(node, E, f):
        return None
    stacked = insert_call(gm, node, torch.Tensor.view, (W, E, f, d))
    product = insert_call(gm, node, torch.einsum, ("td,efd->tef", x, stacked))
    result = product
    if isinstance(b, fx.Node):
        result = insert_call(gm, node, operator.add, (product, insert_call(gm, node, torch.Tensor.view, (b, E, f))))
    node.replace_all_uses_with(result)
    return f"{node.name}: {lin.name} packs E={E} experts -> einsum over {W.name}.view({E}, {f}, {d})"


def _bmm_letters(la: str, lb: str, i: str) -> str | None:
    """(batch, m, n) of `bmm(a laid out [batch, m, i], b laid out [batch, i, n])` for operands with
    letters la and lb contracting i (one of them may lack the batch letter: broadcast), or None. The
    batch letter is the one both share, or the first of the 3-D operand's other letters."""
    if sorted((len(la), len(lb))) not in ([2, 3], [3, 3]):
        return None
    shared = (set(la) & set(lb)) - {i}
    if len(la) == len(lb):
        batch = shared.pop() if len(shared) == 1 else None
    else:
        batch = None if shared else next(c for c in (la if len(la) == 3 else lb) if c != i)
    if batch is None:
        return None
    rest_a, rest_b = set(la) - {batch, i}, set(lb) - {batch, i}
    if len(rest_a) != 1 or len(rest_b) != 1 or rest_a == rest_b:
        return None
    return batch + rest_a.pop() + rest_b.pop()


def _goes_right(la: str, lb: str, out: str, i: str) -> bool:
    """Whether operand a (letters la) is the weights' side of the product, the bmm's right operand:
    the 3-D one of a 3-D and a 2-D operand; of two 3-D ones, the one holding the output's last
    letter alone, else the one led by the shared batch letter."""
    if len(la) != len(lb):
        return len(la) == 3
    if (out[-1] in la) != (out[-1] in lb):
        return out[-1] in la
    batch = (set(la) & set(lb)) - {i}
    return len(batch) == 1 and la[0] in batch and lb[0] not in batch


# readers whose values do not depend on their input's strides (views, `view_as` and `unflatten` need
# the strides they were traced with; reshape and flatten copy where they must, but may return a view)
_ELEMENTWISE = ("mul", "__mul__", "add", "__add__", "sub", "__sub__", "truediv", "div", "__truediv__", "neg",
                "sigmoid", "silu", "gelu", "relu", "tanh", "exp", "to", "float", "half", "bfloat16", "type_as", "clamp",
                "getitem", "chunk", "split", "unbind", "transpose", "permute", "sum", "mean", "reshape", "flatten",
                "einsum", "bmm", "matmul", "__matmul__", "unsqueeze", "squeeze", "silu_", "mul_", "gather", "index_select",
                "softmax", "pow", "__pow__", "square", "sqrt", "rsqrt", "gelu_", "relu_", "sigmoid_")
_LAYOUT_READERS = ("view", "view_as", "unflatten", "as_strided", "data_ptr", "stride", "is_contiguous")


def _layout_free(node: fx.Node) -> bool:
    """Whether no reader of `node`, followed through code that reads values rather than strides
    (elementwise, slices, reductions, products), depends on its strides: True when only such code
    reads it and none of it reaches a stride-dependent view."""
    seen, todo = set(), list(node.users)
    while todo:
        user = todo.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op == "output":
            return False  # the graph's own output keeps the strides it was traced with
        name = op_name(user.target)
        if name in _LAYOUT_READERS or name not in _ELEMENTWISE:
            return False
        if name not in ("sum", "mean", "einsum", "bmm", "matmul", "__matmul__", "gather", "index_select"):
            todo.extend(user.users)  # a reduction, product or copy makes a fresh tensor of its own layout
    return True


def einsum_weighted_sum_to_product(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """einsum("te,etd->td" / "te,ted->td") of a [T, E] matrix and [E, T, d] / [T, E, d] values, as
    the product broadcast over d, summed over E (see the module docstring)."""
    spec = _einsum_spec(node)
    if spec is None or len(spec[2]) != 2:
        return None
    la, lb, out, a, b = spec
    # float32/float64 only: in bf16/fp16 (autocast too) the product rounds each term before the sum,
    # where einsum's matmul keeps them in a float32 accumulator (2.7% off at a cancellation, bf16)
    if not dtype_of(a) == dtype_of(b) == dtype_of(node) or dtype_of(node) not in (torch.float32, torch.float64):
        return None
    if len(la) == 3:
        la, lb, a, b = lb, la, b, a
    t, d = out
    contracted = (set(la) & set(lb)) - set(out)
    if len(la) != 2 or len(lb) != 3 or len(contracted) != 1:
        return None
    (e,) = contracted
    if set(la) != {t, e} or lb not in (e + t + d, t + e + d):
        return None
    gates = insert_call(gm, node, torch.unsqueeze, (_laid_out(gm, node, a, la, lb[:2]), -1))  # [E, T, 1] / [T, E, 1]
    product = insert_call(gm, node, torch.mul, (b, gates))
    total = insert_call(gm, node, torch.sum, (product, lb.index(e)))
    node.replace_all_uses_with(total)
    return f"{node.name} ({node.args[0]!r}) -> (values * weights).sum({lb.index(e)})"


def einsum_outer_to_product(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """A two-operand einsum that contracts nothing (every letter of each operand is in the output:
    `einsum("te,tm->etm", g, x)`, GShard-style dispatch) as the broadcast product of its operands laid
    out in the output's order (`g.t().unsqueeze(-1) * x.unsqueeze(0)`): each element is one product,
    rounded once either way. Operands and result of one dtype (no autocast)."""
    spec = _einsum_spec(node)
    if spec is None:
        return None
    la, lb, out, a, b = spec
    if not (set(la) | set(lb)) == set(out) or not dtype_of(a) == dtype_of(b) == dtype_of(node):
        return None
    sizes = {c: shape_of(a)[la.index(c)] for c in la}
    if not all(same_size(sizes[c], shape_of(b)[lb.index(c)]) for c in lb if c in sizes):
        return None  # a letter of unequal sizes (one of them 1) would broadcast
    laid = []
    for operand, letters in ((a, la), (b, lb)):
        own = "".join(c for c in out if c in letters)
        value = _laid_out(gm, node, operand, letters, own)
        for i, c in enumerate(out):
            if c not in letters:
                value = insert_call(gm, node, torch.unsqueeze, (value, i))
        laid.append(value)
    product = insert_call(gm, node, torch.mul, tuple(laid))
    node.replace_all_uses_with(product)
    return f"{node.name} ({node.args[0]!r}) -> a broadcast product"


def addmm_to_matmul_plus_bias(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`torch.addmm(b, a, W)` (or `b.addmm(a, W)`) of 2-D a and W with beta = alpha = 1 -> `a @ W + b`."""
    if not is_call(node, "addmm") or len(node.args) != 3 or node.kwargs.keys() - {"beta", "alpha"}:
        return None
    if any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
        return None
    bias, a, w = node.args
    if not all(isinstance(n, fx.Node) and len(shape_of(n)) == 2 for n in (a, w)) or not isinstance(bias, fx.Node):
        return None
    product = insert_call(gm, node, operator.matmul, (a, w))
    added = insert_call(gm, node, operator.add, (product, bias))
    if not same_shape(shape_of(added), shape_of(node)) or dtype_of(added) != dtype_of(node):
        gm.graph.erase_node(added)
        gm.graph.erase_node(product)
        return None
    node.replace_all_uses_with(added)
    order[added] = order[node]
    return f"{node.name} -> {a.name} @ {w.name} + {bias.name}"


def broadcast_matmul_to_bmm(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """A matmul of 3-D stacked weights W [E, i, n] with rows [T, i], [1, T, i] or [E, T, i], as
    `torch.bmm` of the rows broadcast over E (expand: no copy) and W (see the module docstring)."""
    if not is_call(node, "matmul", "__matmul__") or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    sa, sb = shape_of(a), shape_of(b)
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or sa is None or sb is None or len(sb) != 3:
        return None
    ok, autocast = _autocast_dtype(node, a, b)
    if not ok or not isinstance(sb[0], int):
        return None
    E = sb[0]
    if len(sa) == 2:
        rows = insert_call(gm, node, torch.unsqueeze, (a, 0))
    elif len(sa) == 3 and isinstance(sa[0], int) and sa[0] in (1, E):
        rows = a
    else:
        return None
    if (shape_of(rows) or (None,))[0] != E:
        rows = insert_call(gm, node, torch.Tensor.expand, (rows, E, -1, -1))
    product = insert_call(gm, node, torch.bmm, (rows, b), autocast=autocast)
    node.replace_all_uses_with(product)
    return f"{node.name}: matmul over E={E} stacked weights -> bmm"


# --- products of weights gathered by top-k ids, as the einsums `gathered_weights` reads ---------


def _gathered_operand(node) -> tuple[fx.Node, fx.Node, fx.Node | None, bool] | None:
    """(W [E, a, b], ids [T, K], the gather W[ids] or None, its last two dims swapped) when `node` is
    `W[ids]` ([T, K, a, b]) or `W[ids.reshape(-1)]` ([T K, a, b]: gather None), either read as is or
    through a transpose of its last two dims; else None."""
    swapped = False
    if is_call(node, "transpose") and len(node.args) == 3 and not node.kwargs:
        ndim = len(shape_of(node))
        if not (ndim and all(is_int(d) for d in node.args[1:]) and sorted(d % ndim for d in node.args[1:]) == [ndim - 2, ndim - 1]):
            return None
        node, swapped = node.args[0], True
    found = table_index(node)
    if found is None or len(shape_of(found[0])) != 3 or dtype_of(found[1]) not in (torch.int64, torch.int32):
        return None
    W, index = found
    if len(shape_of(index)) == 2:
        return W, index, node, swapped
    ids = chain_top(index)
    if len(shape_of(index)) == 1 and ids is not index and len(shape_of(ids)) == 2:
        return W, ids, None, swapped
    return None


def _token_rows(gm, before, rows: fx.Node, T, K: int, width: int, flat: bool) -> fx.Node | None:
    """A [T, width] tensor whose row t is every (t, k) product's rows, when `rows` holds each token's
    row once for all its K slots (a size-1 K dim) or repeated over them (`x[:, None].expand(T, K, d)`,
    `x.repeat_interleave(K, dim=0)`, reshaped); else None."""
    base = None
    if not flat and shape_of(rows)[1] == 1:
        base = rows
    else:
        top = chain_top(rows)
        if is_call(top, "expand") and len(shape_of(top)) >= 3 and same_size(shape_of(top)[0], T) and shape_of(top)[1] == K:
            source = top.args[0]
            shape = shape_of(source)
            if len(shape) == len(shape_of(top)) and shape[1] == 1 and all(is_int(s) for s in shape[2:]) \
                    and math.prod(shape[2:]) == width == math.prod(shape_of(top)[2:]):
                base = source
        elif is_call(top, "repeat_interleave") and len(shape_of(top.args[0])) == 2 and shape_of(top.args[0])[1] == width:
            if arg(top, 1, "repeats") == K and arg(top, 2, "dim") in (0, -2) and len(top.args) <= 3 \
                    and set(top.kwargs) <= {"repeats", "dim"}:
                return top.args[0]
    if base is None:
        return None
    return view_root(base, (T, width)) or insert_call(gm, before, torch.reshape, (base, (-1, width)))


_TAKEN: "weakref.WeakKeyDictionary[fx.Graph, tuple[int, set]]" = weakref.WeakKeyDictionary()


def _taken_as_written(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of the regions `hf_batched_mm` finds in the graph as it is: transformers' batched_mm
    experts, whose finder also reads what they do with expert-parallel sentinel ids; their bmm
    products stay as written. Cached per graph until its node count changes."""
    from . import hf_batched_mm

    size = len(gm.graph.nodes)
    cached = _TAKEN.get(gm.graph)
    if cached is None or cached[0] != size:
        regions = [m.region for m in hf_batched_mm.find(gm) if not isinstance(m, Rejection)]
        cached = _TAKEN[gm.graph] = (size, set().union(*regions))
    return cached[1]


def gathered_product_to_einsum(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """A matmul or bmm of weights gathered by [T, K] ids and one row vector per (t, k) slot, as
    the einsum `gathered_weights` reads:

        x[:, None, None, :] @ W[ids]                  ->  einsum("ta,tkab->tkb", x, W[ids]).unsqueeze(2)
        a @ W[ids]             (a [T, K, 1, a])        ->  einsum("tka,tkab->tkb", a.squeeze(2), W[ids]).unsqueeze(2)
        torch.bmm(r, W[ids.reshape(-1)])  (r [T K, 1, a]: x repeated per slot, or any rows)
                                                      ->  einsum("ta,tkab->tkb", x, W[ids]).reshape(-1, 1, b)
        torch.bmm(W[f].transpose(1, 2), r.unsqueeze(-1))  ->  einsum("ta,tkab->tkb", ...).reshape(-1, b, 1)

    W [E, a, b] either way round: the product of slot (t, k) is its row with expert ids[t, k]'s
    matrix, in every spelling. The reshapes left around the results go by `canonical_views`."""
    if not is_call(node, "matmul", "__matmul__", "bmm") or len(node.args) != 2 or node.kwargs:
        return None
    for side in (1, 0):
        found = _gathered_operand(node.args[side])
        if found is not None:
            break
    else:
        return None
    W, ids, gather, swapped = found
    if node in _taken_as_written(gm):
        return None
    rows = node.args[1 - side]
    ok, autocast = _autocast_dtype(node, *node.args) if isinstance(rows, fx.Node) else (False, None)
    if not ok or not is_int(shape_of(ids)[1]):
        return None
    T, K = shape_of(ids)
    sizes = dict(zip("ab", shape_of(W)[1:]))
    matrix = "ba" if swapped else "ab"  # the operand's [rows, cols] as W's letters
    contracted, kept = (matrix[0], matrix[1]) if side == 1 else (matrix[1], matrix[0])
    tail = (1, sizes[contracted]) if side == 1 else (sizes[contracted], 1)
    shape, flat = shape_of(rows), gather is None
    if flat:
        if not (len(shape) == 3 and same_size(shape[0], T * K) and tuple(shape[1:]) == tail):
            return None
    elif not (len(shape) == 4 and same_size(shape[0], T) and shape[1] in (1, K) and tuple(shape[2:]) == tail):
        return None
    width = sizes[contracted]
    per_token = _token_rows(gm, node, rows, T, K, width, flat)
    if per_token is not None:
        operand, spec = per_token, "t" + contracted
    else:
        operand = view_root(rows, (T, K, width)) or mark(insert_call(gm, node, torch.reshape, (rows, (-1, K, width))))
        spec = "tk" + contracted
    if flat:
        gather = insert_call(gm, node, operator.getitem, (W, ids))
    product = mark(insert_call(gm, node, torch.einsum, (f"{spec},tkab->tk{kept}", operand, gather), autocast=autocast))
    if flat:
        out = insert_call(gm, node, torch.reshape, (product, (-1, *((1, sizes[kept]) if side == 1 else (sizes[kept], 1)))))
    else:
        out = insert_call(gm, node, torch.unsqueeze, (product, 2 if side == 1 else 3))
    mark(out)
    node.replace_all_uses_with(out)
    return f"{node.name}: product with {W.name} gathered by {ids.name} -> einsum"


# --- a loop over the experts' row blocks as grouped products -----------------------------------

# ops applied to each row on its own (elementwise, or along the last dim): the same on one expert's
# block of rows as on all the rows at once
_ROWWISE = {"silu", "gelu", "relu", "sigmoid", "tanh", "mul", "__mul__", "add", "__add__", "sub", "__sub__", "truediv",
            "__truediv__", "div", "neg", "__neg__", "pow", "__pow__", "clamp", "to", "float", "bfloat16", "half",
            "type_as", "exp", "softplus", "square", "chunk"}
_WEIGHT_VIEWS = ("transpose", "t", "permute")


def _weight_slice(node, e: int):
    """(W, chain) when `node` is W[e] of a 3-D W followed by transposes (`chain`: [(op, args)]); else None."""
    chain = []
    while is_call(node, *_WEIGHT_VIEWS):
        chain.append((node.target if node.op == "call_method" else op_name(node.target), tuple(node.args[1:])))
        node = node.args[0]
    if getitem_of(node, e) is None or len(shape_of(node.args[0]) or ()) != 3:
        return None
    return node.args[0], tuple(reversed(chain))


def _on_the_stack(gm, before, W: fx.Node, chain) -> fx.Node:
    """The stack W [E, ., .] through the 2-D views of one slice W[e], as views of each slice."""
    for name, args in chain:
        if name == "t" or (name == "transpose" and sorted(a % 2 for a in args) == [0, 1]):
            W = insert_call(gm, before, torch.transpose, (W, -2, -1))
        elif name == "permute" and tuple(args[0] if len(args) == 1 else args) == (1, 0):
            W = insert_call(gm, before, torch.transpose, (W, -2, -1))
        else:
            raise _NotCanonical
    return W


class _NotCanonical(Exception):
    pass


def _expert_block(chunk: fx.Node, y: fx.Node, e: int, order: dict) -> list[fx.Node]:
    """The nodes from expert e's rows `chunk` to its output `y`, in graph order; each reads only
    the block's nodes, the expert's weight slices, and plain numbers."""
    reach, todo = set(), [chunk]
    while todo:
        n = todo.pop()
        if n not in reach:
            reach.add(n)
            todo.extend(n.users)
    if y not in reach:
        raise _NotCanonical
    block, todo = set(), [y]
    while todo:
        n = todo.pop()
        if n in block or n is chunk:
            continue
        block.add(n)
        for i in n.all_input_nodes:
            if i in reach:
                todo.append(i)
            elif _weight_slice(i, e) is None:
                raise _NotCanonical
    return sorted(block, key=order.get)


def _same_step(a: fx.Node, b: fx.Node, mapped: dict, e: int) -> bool:
    """Node `b` of expert e does what `a` of expert 0 does, reading the matching nodes."""
    if a.op != b.op or a.target != b.target or len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
        return False
    for x, y in zip((*a.args, *a.kwargs.values()), (*b.args, *b.kwargs.values())):
        if isinstance(x, fx.Node) and isinstance(y, fx.Node):
            if mapped.get(y) is not x and not (_weight_slice(x, 0) is not None and _weight_slice(x, 0) == _weight_slice(y, e)):
                return False
        elif isinstance(x, fx.Node) or isinstance(y, fx.Node) or x != y:
            return False
    return True


def _sizes_tensor(sizes) -> fx.Node | None:
    """C when the split sizes are C[0].item(), ..., C[E-1].item() of one 1-D integer tensor C."""
    counts = set()
    for e, size in enumerate(sizes):
        if not is_call(size, "item") or getitem_of(size.args[0], e) is None:
            return None
        counts.add(size.args[0].args[0])
    if len(counts) != 1:
        return None
    (C,) = counts
    return C if shape_of(C) == (len(sizes),) and dtype_of(C) is not None and not dtype_of(C).is_floating_point else None


def _whole_rows(rows: fx.Node, sizes) -> fx.Node:
    """`x` for `x[:s]` where s is the sum of `sizes` and the graph asserts s == N or s >= N for x's N rows."""
    if not (is_getitem(rows) and isinstance(rows.args[1], slice)):
        return rows
    src, cut = rows.args
    total = cut.stop
    if cut.start is not None or cut.step is not None or not (is_call(total, "sym_sum") and list(total.args[0]) == list(sizes)):
        return rows
    N = (shape_of(src) or (None,))[0]
    for user in total.users:  # total == N or total >= N (x[:s] is x then), then aten._assert_scalar(that, ...)
        if is_call(user, "eq", "__eq__", "ge", "__ge__") and user.args[1:] == (N,) and isinstance(N, int):
            if any(a.op == "call_function" and a.target is torch.ops.aten._assert_scalar.default for a in user.users):
                return src
    return rows


def split_loop_to_grouped_mm(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """cat([f(chunk_e, W[e]) for e, chunk_e in enumerate(split(rows, C.tolist()))]) -> f over all
    rows with each product `chunk @ W[e]` (through transposes of W[e]) as
    `torch._grouped_mm(rows, W, offs=cumsum(C, dtype=int32))` (see the module docstring)."""
    if not is_call(node, "cat") or arg(node, 1, "dim", 0) != 0 or not isinstance(node.args[0], (list, tuple)):
        return None
    ys = list(node.args[0])
    try:
        chunks = [_find_chunk(y, e) for e, y in enumerate(ys)]
        split = chunks[0].args[0]
        if any(c.args[0] is not split for c in chunks) or not is_call(split, "split"):
            raise _NotCanonical
        rows, sizes = split.args[0], arg(split, 1, "split_size_or_sections")
        if arg(split, 2, "dim", 0) != 0 or not isinstance(sizes, (list, tuple)) or len(ys) < 2:
            raise _NotCanonical
        if len(sizes) != len(ys):  # every block concatenated, in order
            raise _NotCanonical
        C = _sizes_tensor(sizes)
        if C is None or dtype_of(rows) != torch.bfloat16:  # torch._grouped_mm takes bf16 operands only
            raise _NotCanonical
        blocks = [_expert_block(c, y, e, order) for e, (c, y) in enumerate(zip(chunks, ys))]
        for e in range(1, len(ys)):
            mapped = {chunks[e]: chunks[0]}
            if len(blocks[e]) != len(blocks[0]):
                raise _NotCanonical
            for a, b in zip(blocks[0], blocks[e]):
                if not _same_step(a, b, mapped, e):
                    raise _NotCanonical
                mapped[b] = a
        for n in blocks[0]:
            name = n.target if n.op == "call_method" else op_name(n.target)
            if name == "getitem" and not (is_call(n.args[0], "chunk") and isinstance(n.args[1], int)):
                raise _NotCanonical  # only the pieces of a chunk along the last dim
            if name not in _ROWWISE and name not in ("matmul", "mm", "__matmul__", "linear", "getitem"):
                raise _NotCanonical
            if name == "chunk" and arg(n, 2, "dim", 0) not in (-1, len(shape_of(n.args[0])) - 1):
                raise _NotCanonical
    except _NotCanonical:
        return None
    counted = C.args[0] if is_call(C, "int", "long", "to") and dtype_of(C.args[0]) is not None else C
    before = set(gm.graph.nodes)
    try:
        offs = insert_call(gm, node, torch.cumsum, (counted, 0), {"dtype": torch.int32})
        values = {chunks[0]: _whole_rows(rows, sizes)}
        for n in blocks[0]:
            values[n] = _grouped_step(gm, node, n, values, offs)
    except (_NotCanonical, RuntimeError):  # a step without a grouped twin, or operands grouped_mm refuses (strides)
        for added in reversed([n for n in gm.graph.nodes if n not in before]):
            gm.graph.erase_node(added)
        return None
    node.replace_all_uses_with(values[ys[0]])
    return f"{node.name}: {len(ys)} experts' row blocks -> grouped products over {rows.name}"


def _find_chunk(y: fx.Node, e: int) -> fx.Node:
    """The `split(...)[e]` node that expert e's output is computed from (the only one it reads)."""
    found, seen, todo = set(), set(), [y]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if getitem_of(n, e) is not None and is_call(n.args[0], "split"):
            found.add(n)
            continue
        todo.extend(n.all_input_nodes)
    if len(found) != 1:
        raise _NotCanonical
    return found.pop()


def _grouped_step(gm, before: fx.Node, n: fx.Node, values: dict, offs: fx.Node) -> fx.Node:
    """Expert 0's step `n` over all the rows: its products with W[0] as grouped products with W."""
    name = n.target if n.op == "call_method" else op_name(n.target)
    if name in ("matmul", "mm", "__matmul__", "linear"):
        a, b = n.args[0], n.args[1]
        if name == "linear" and (len(n.args) > 2 and n.args[2] is not None or n.kwargs):
            raise _NotCanonical  # a per-expert bias
        weight = _weight_slice(b, 0)
        if a not in values or weight is None:
            raise _NotCanonical
        W, chain = weight
        if dtype_of(W) != torch.bfloat16:
            raise _NotCanonical
        if name == "linear":
            chain = (*chain, ("t", ()))  # linear(a, w) = a @ w.t()
        return insert_call(gm, before, torch._grouped_mm, (values[a], _on_the_stack(gm, before, W, chain)), {"offs": offs})
    args = fx.node.map_arg(n.args, lambda x: values[x] if x in values else _raise())
    kwargs = fx.node.map_arg(n.kwargs, lambda x: values[x] if x in values else _raise())
    if n.op == "call_method":
        target = getattr(torch.Tensor, n.target)
    else:
        target = n.target
    return insert_call(gm, before, target, args, kwargs)


def _raise():
    raise _NotCanonical
