"""Experts looped over the token rows repeated K times: DeepSeek-MoE's and DeepSeek-V2's
published modeling code (their training path), copied into many code bases.

Eager code it matches, shapes (T tokens, d hidden, E experts, K top-k):

    w, ids = torch.topk(scores, K, dim=-1)                    # [T, K] (any [T, K] weights)
    flat = ids.view(-1)                                       # [T*K] (or reshape(-1), flatten())
    xr = x.repeat_interleave(K, dim=0)                        # [T*K, d]: row t*K + k is token t
    y = torch.empty_like(xr)                                  # (or zeros_like, torch.zeros(T * K, d), x.new_zeros(T * K, d))
    for e, expert in enumerate(self.experts):
        y[flat == e] = expert(xr[flat == e])                   # (or xr[torch.where(flat == e)[0]])
    out = (y.view(*w.shape, -1) * w.unsqueeze(-1)).sum(dim=1)   # [T, d]; or (y * w.reshape(-1, 1)).view(T, K, d).sum(1),
                                                              #   w.flatten()[:, None] too

(a scatter-add of the scaled rows into zeros by each row's token, `arange(T).repeat_interleave(K)`,
reaches this finder as that view and sum: `canonical_layout.copies_added_back_to_sum`)

Row t*K + k of y is expert ids[t, k] on x[t], so `out[t] = sum_k w[t, k] * expert_{ids[t, k]}(x[t])`:
the op's contract. It becomes `moe_experts_list(x, ids, w, ...)` (or `moe_experts` for slices of
stacked parameters), with the experts matched as `expert_loop` matches them (`module_list`).

Checked, not guessed: ids are a top-k's [T, K] indices (distinct per token, in [0, E)), flattened in
their own row-major order, and x is repeated K times along the token dim, so slot t*K + k pairs
token t with ids[t, k]; every expert 0..E-1 writes exactly the rows `flat == e` and reads the rows
`xr[flat == e]` of that same e, so every row of y is written once; y is a fresh tensor of xr's
dtype that nothing reads but the combine, after the last write; the combine views y as [T, K, d],
scales it by [T, K] weights broadcast over d, and sums over K. Like `expert_loop`, Dynamo traces
the loop into one graph only with `torch._dynamo.config.capture_dynamic_output_shape_ops = True`
(boolean-mask indexing has a data-dependent size).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .common import (MoEMatch, NoMatch, RegionWalk, Rejection, arg, dtype_of, expect, getitem_of, is_call, module_path,
                     same_shape, same_size, shape_of)
from .canonical_routing import _where_rows
from .expert_loop import _is_bool_mask, _is_index, _size_asserts
from .module_list import expert_mlp, finish_expert_match, through_float_casts, topk_routing

IDIOM = "repeat_loop"
_FRESH = ("empty_like", "zeros_like")
_FRESH_SIZED = ("empty", "zeros")
_FLATTEN = ("view", "reshape", "flatten")
_INT_DTYPES = (torch.int32, torch.int64)


def find(gm: fx.GraphModule) -> list[MoEMatch | Rejection]:
    """Every `y[flat == e] = expert_e(xr[flat == e])` loop, grouped by the y it fills."""
    results: list[MoEMatch | Rejection] = []
    filled: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if _is_mask_write(node):
            filled.setdefault(node.args[0], []).append(node)
    for y, writes in filled.items():
        try:
            results.append(_check(y, writes))
        except NoMatch as exc:
            results.append(Rejection(IDIOM, module_path(writes[-1]), str(exc)))
    return results


def _is_mask_write(node: fx.Node) -> bool:
    """`y[flat == e] = value` with flat a 1-D view of a top-k's [T, K] indices and e an int: the
    candidates. Any other setitem (`emb[ids == pad] = v`...) is none of this pattern's business."""
    if not (node.op == "call_function" and node.target is operator.setitem and len(node.args) == 3 and not node.kwargs):
        return False
    mask = node.args[1]
    return _is_bool_mask(mask) and _flat_ids(mask) is not None


def _flat_ids(mask: fx.Node) -> tuple[fx.Node, int, fx.Node, list[fx.Node]] | None:
    """(flat, e, ids, casts) of `flat == e` where flat = ids.view(-1) (reshape(-1), flatten()) of the
    indices output of a torch.topk, through integer casts (`casts`, e.g. `ids.to(torch.int32)`: the
    same values); None otherwise."""
    if len(mask.args) != 2 or mask.kwargs:
        return None
    flat, e = mask.args
    if isinstance(flat, int):
        flat, e = e, flat
    if not (isinstance(e, int) and not isinstance(e, bool) and is_call(flat, *_FLATTEN)):
        return None
    size = flat.args[1:] if flat.target != "flatten" else ()
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    if flat.kwargs or tuple(size) not in ((), (-1,)) or (flat.target == "flatten" and len(flat.args) > 1):
        return None
    ids, casts = flat.args[0], []
    while _is_int_cast(ids):
        casts.append(ids)
        ids = ids.args[0]
    if not is_call(getitem_of(ids, 1), "topk"):
        return None
    return flat, e, ids, casts


def _is_int_cast(node) -> bool:
    """`.to(<int dtype>)`, `.int()`, `.long()` of an integer tensor (top-k ids are in [0, E))."""
    if not is_call(node, "to", "int", "long") or len(node.args) > 2 or set(node.kwargs) - {"dtype"}:
        return False
    src, out = dtype_of(node.args[0]), dtype_of(node)
    return src in _INT_DTYPES and out in _INT_DTYPES


def _fresh_sized(y: fx.Node) -> bool:
    """`torch.zeros(sizes)` / `torch.empty(sizes)` (or `t.new_zeros(sizes)` / `t.new_empty(sizes)`),
    sizes as arguments or one tuple, with at most a dtype, a device and a layout."""
    sized = is_call(y, *_FRESH_SIZED) and y.op == "call_function" and bool(y.args)
    sized |= is_call(y, "new_zeros", "new_empty") and y.op == "call_method" and len(y.args) >= 2
    return sized and set(y.kwargs) <= {"dtype", "device", "layout", "requires_grad"} and not y.kwargs.get("requires_grad")


def _check(y: fx.Node, writes: list[fx.Node]) -> MoEMatch:
    walk = RegionWalk()
    like = is_call(y, *_FRESH) and len(y.args) == 1 and set(y.kwargs) <= {"memory_format"}
    expect(like or _fresh_sized(y),
           f"the loop writes into {y.name}, not a fresh empty_like/zeros_like (or zeros/empty/new_zeros) of the repeated rows")
    if like:
        xr = y.args[0]
    else:  # torch.zeros(T * K, d, ...): the rows the first expert reads, of y's shape and dtype
        rows = through_float_casts(expert_mlp(through_float_casts(writes[0].args[2], walk), RegionWalk(), 0,
                                              stacked=True).rows, walk)
        xr = rows.args[0] if _is_index(rows) else None
        expect(isinstance(xr, fx.Node) and same_shape(shape_of(xr), shape_of(y)) and dtype_of(xr) == dtype_of(y),
               f"the loop writes into {y.name}, not a tensor shaped as the rows its experts read")
    x, repeats = _repeated(xr)
    walk.mark(y, xr)

    experts, flats, ids_nodes, asserts = {}, set(), set(), []
    for write in writes:
        _, mask, value = write.args
        flat, e, ids, casts = _flat_ids(mask)
        expect(e not in experts, f"expert {e}'s rows are written twice")
        out = through_float_casts(value, walk)
        expect(is_call(out, "linear", "matmul", "mm", "__matmul__"), f"expert {e}'s rows of {y.name} are not an expert's output")
        expert = expert_mlp(out, walk, e, stacked=True)
        rows = through_float_casts(expert.rows, walk)
        read_mask = rows.args[1] if _is_index(rows) and rows.args[0] is xr else None
        where = read_mask.args[0] if _where_rows(read_mask) is not None else None
        if where is not None:  # xr[torch.where(m)[0]]: the rows of m, in order
            walk.mark(read_mask)
            read_mask = where.args[0]
        found = _flat_ids(read_mask) if _is_bool_mask(read_mask) else None
        expect(found is not None and found[:2] == (flat, e), f"expert {e} does not read the repeated rows xr[flat == {e}] it writes")
        experts[e] = expert
        flats.add(flat)
        ids_nodes.add(ids)
        asserts += _size_asserts(where if where is not None else read_mask, walk)
        walk.mark(write, mask, read_mask, rows, flat, where, *casts)
    expect(len(flats) == 1 and len(ids_nodes) == 1, "experts are selected from different expert ids")
    (topk_ids,) = ids_nodes

    E, K = topk_routing(topk_ids, walk)
    expect(repeats == K, f"hidden states are repeated {repeats} times for K={K} experts a token")
    expect(all(0 <= e < E for e in experts), f"expert index {max(experts)} is outside the router's E={E} experts")
    expect(len(experts) == E, f"the loop writes the rows of experts {sorted(experts)} of the router's E={E}: not every expert")
    expect(len(shape_of(x)) == 2, "hidden states are not [T, d]")
    T, d = shape_of(x)
    expect(same_size(T, shape_of(topk_ids)[0]), "hidden states are not [T, d] for the routed T")
    expect(dtype_of(y) == dtype_of(x), f"the expert outputs are stored in {dtype_of(y)}, not the hidden states' {dtype_of(x)}")

    total, weights = _combine(y, writes, T, K, d, walk)
    expect(shape_of(weights) == shape_of(topk_ids), "top-k weights and ids differ in shape")
    return finish_expert_match(
        IDIOM, total, walk, total, [*writes, total], x, topk_ids, weights, [experts[e] for e in range(E)],
        E=E, K=K, T=T, d=d, extra_region=asserts,
    )


def _repeated(xr) -> tuple[fx.Node, int]:
    """(x, repeats) of `x.repeat_interleave(repeats, dim=0)` (or torch.repeat_interleave) with an int
    repeats; `output_size`, if given, must be the repeated row count."""
    expect(is_call(xr, "repeat_interleave"), "the loop's rows are not repeat_interleave'd hidden states")
    x, repeats, dim = arg(xr, 0, "input"), arg(xr, 1, "repeats"), arg(xr, 2, "dim")
    expect(set(xr.kwargs) <= {"input", "repeats", "dim", "output_size"} and len(xr.args) <= 3,
           f"repeat_interleave with {sorted(set(xr.kwargs) - {'input', 'repeats', 'dim', 'output_size'})}")
    expect(isinstance(repeats, int) and not isinstance(repeats, bool), "hidden states are repeated by a tensor of counts")
    expect(dim in (0, -2) and len(shape_of(x)) == 2, f"hidden states are repeated along dim {dim}, not the token dim of [T, d]")
    size = xr.kwargs.get("output_size")
    expect(size is None or same_size(size, shape_of(x)[0] * repeats), f"repeat_interleave output_size {size}")
    return x, repeats


def _combine(y: fx.Node, writes: list[fx.Node], T, K: int, d, walk: RegionWalk) -> tuple[fx.Node, fx.Node]:
    """(the [T, d] sum, the [T, K] weights) of `(y.view(T, K, d) * w.unsqueeze(-1)).sum(dim=1)` or
    `(y * w.reshape(-1, 1)).view(T, K, d).sum(dim=1)`, the only read of y, after its last write."""
    readers = [u for u in y.users if u not in writes]
    expect(len(readers) == 1, f"{y.name} is read {len(readers)} times besides the loop's writes, not once by the combine")
    (first,) = readers
    order = {n: i for i, n in enumerate(y.graph.nodes)}
    expect(order[first] > max(order[w] for w in writes), f"{y.name} is read inside the loop (by {first.name})")
    if is_call(first, "mul", "__mul__") and len(first.args) == 2 and not first.kwargs:  # rows scaled, then viewed
        mul = first
        weights = _weight_column(mul.args[1] if mul.args[0] is y else mul.args[0], T, K, walk)
        view = walk.only_reader(mul)
        expect(is_call(view, "view", "reshape", "unflatten"), f"the scaled rows {mul.name} are not viewed as [T, K, d]")
    else:
        view = first
        expect(is_call(view, "view", "reshape", "unflatten"), f"{y.name} is read by {view.name}, not viewed as [T, K, d]")
        mul = walk.only_reader(view)
        expect(is_call(mul, "mul", "__mul__") and len(mul.args) == 2 and not mul.kwargs and view in mul.args,
               "the experts' rows are not scaled by the routing weights")
        weights = _broadcast_weights(mul.args[1] if mul.args[0] is view else mul.args[0], walk)
    shape = shape_of(view)
    expect(len(shape) == 3 and same_size(shape[0], T) and shape[1] == K and same_size(shape[2], d),
           f"{y.name} is viewed as {shape}, not [T, K={K}, d]")
    expect(weights is not None and len(shape_of(weights)) == 2 and dtype_of(weights) is not None
           and dtype_of(weights).is_floating_point, "the experts' rows are not scaled by [T, K] weights broadcast over d")
    total = walk.only_reader(view if mul is first else mul)
    dim, keepdim = (arg(total, 1, "dim"), arg(total, 2, "keepdim", False)) if is_call(total, "sum") else (None, None)
    expect(is_call(total, "sum") and dim in (1, -2, (1,), (-2,), [1], [-2]) and keepdim is False
           and set(total.kwargs) <= {"dim", "keepdim"} and len(total.args) <= 3,
           "the scaled rows are not summed over each token's K experts")
    walk.mark(view, mul, total)
    return total, weights


def _weight_column(scale, T, K: int, walk: RegionWalk) -> fx.Node | None:
    """w of `w.reshape(-1, 1)` / `w.view(T * K, 1)`, or of a flat `w.flatten()` / `w.reshape(-1)` made a
    column (`[:, None]`, `.unsqueeze(-1)`): [T, K] weights as one column of the T K rows, in row-major
    order, cast or not after the reshape; else None."""
    scale = through_float_casts(scale, walk)
    if len(shape_of(scale)) != 2 or shape_of(scale)[1] != 1:
        return None
    if is_call(scale, "unsqueeze") and arg(scale, 1, "dim") in (-1, 1) or (
            _is_index(scale) and scale.args[1] == (slice(None), None)):
        flat = scale.args[0]  # a flat [T K] view of the weights, made a column
        flat_view = is_call(flat, "flatten") and len(flat.args) == 1 and not flat.kwargs
        flat_view = flat_view or (is_call(flat, "view", "reshape") and flat.args[1:] in ((-1,), ((-1,),)))
        if not flat_view:
            return None
        walk.mark(flat)
        inner = flat.args[0]
    elif is_call(scale, "view", "reshape"):
        inner = scale.args[0]
    else:
        return None
    shape = shape_of(inner)
    if not (len(shape) == 2 and same_size(shape[0], T) and shape[1] == K):
        return None
    walk.mark(scale)
    return inner


def _broadcast_weights(scale, walk: RegionWalk) -> fx.Node | None:
    """w of `w.unsqueeze(-1)`, `w[..., None]`, `w[:, :, None]` or `w.view(T, K, 1)`, cast or not after
    the broadcast; w itself as the combine reads it (its casts are the op's input)."""
    scale = through_float_casts(scale, walk)
    if is_call(scale, "unsqueeze") and arg(scale, 1, "dim") in (-1, len(shape_of(scale)) - 1):
        inner = scale.args[0]
    elif _is_index(scale) and scale.args[1] in ((Ellipsis, None), (slice(None), slice(None), None)):
        inner = scale.args[0]
    elif is_call(scale, "view", "reshape") and len(shape_of(scale)) == 3 and shape_of(scale)[2] == 1:
        inner = scale.args[0]
        if not (len(shape_of(inner)) == 2 and same_size(shape_of(inner)[0], shape_of(scale)[0])
                and shape_of(inner)[1] == shape_of(scale)[1]):
            return None
    else:
        return None
    walk.mark(scale)
    return inner  # as the combine reads it, casts included
