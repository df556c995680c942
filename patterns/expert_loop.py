"""Experts in an `nn.ModuleList`, looped over in Python (Mixtral-style code users write themselves).

Eager code it matches, shapes (T tokens, d hidden, E experts, K top-k):

    probs = F.softmax(self.gate(x), dim=-1)                       # [T, E]
    w, ids = torch.topk(probs, K, dim=-1)                         # [T, K] (any [T, K] weights: renormalised, cast...)
    out = torch.zeros_like(x)                                     # or torch.zeros((T, d), ...): [T, d]
    mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)         # [E, K, T]
    for e in range(E):
        k, tok = torch.where(mask[e])                             # or tok, k = torch.where(ids == e),
                                                                  #    mask[e].nonzero(as_tuple=True)
        y = self.experts[e](x[tok]) * w[tok, k, None]             # or w[tok, k].unsqueeze(-1), w[tok, k][:, None]
        out.index_add_(0, tok, y.to(x.dtype))                     # or out = out.index_add(0, tok, y),
                                                                  #    out[tok] += y, out[tok] = out[tok] + y

or a loop over the ids' columns around (or inside) the loop over experts, each expert called once
per column on the rows that picked it there:

    for k in range(K):
        for e in range(E):
            tok = torch.where(ids[:, k] == e)[0]                  # or the boolean mask ids[:, k] == e itself
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, k, None])   # or w[tok, k:k+1]; out[tok] += ...

(every (e, k) pair once, expert e on the same weights for every k, the weights' column k as its
mask's: the sum over all (token, k) slots, as the op sums them; K = 1 of `max(keepdim=True)`
reads `ids[:, 0]` and `p[:, 0]` so),

or top-1 (Switch Transformer): `p, ids = probs.max(dim=-1)` ([T] ids and weights), `tok, =
torch.where(ids == e)` (or `.nonzero(as_tuple=True)`, or the boolean mask `m = ids == e` itself:
`x[m]`, `p[m]`, `out[m]`), `y * p[tok, None]`, and `out[tok] = y` as well as the adds (with one
expert per token, the assigned rows of different experts are disjoint and cover each routed token
once: the sum). The op gets the [T] ids and weights as [T, 1]. An expert's rows may also be read as
`x[None, tok].reshape(-1, d)` (transformers 4.x's Mixtral block, copied into many code bases).

with each expert `w2(act(w1(x)) * w3(x))`, `w2(act(chunk(w13(x))))` or `w2(act(w1(x)))`,
nn.Linear layers with or without biases (see `module_list`). It becomes

    out = moe_experts_list(x, ids, w, [w1_e], [w3_e] or [], [w2_e], b1?, b2?, activation=<probed>)

(b1, b2: the experts' biases stacked in the graph, when they have them)

reading each expert's weights where they are. Experts stored as stacked [E, ., .] parameters and
sliced per expert work too (see `module_list`):

    h = F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)      # or F.linear(xe, self.w1[e]); or xe @ self.w13[e]
                                                             # (+ self.b1[e]: a stacked bias, added or in F.linear)
    out.index_add_(0, tok, (h @ self.w2[e].T) * w[tok, k, None])

become `moe_experts(x, ids, w, w13 or w1, w2, transposed=<[E, in, out]>)` on the parameters
themselves when gate and up share one parameter (or there is no up), and the list op on the slices
`w1[e]`, `w3[e]`, `w2[e]` (views, no copy) when they are two [E, out, in] parameters. Expert e must
read slice e of each parameter, all projections in one orientation, and no parameter may be
modified in the graph; two [E, in, out] gate/up parameters are left alone (either op would need a
copy). Dynamo traces the loop into one graph only with
`torch._dynamo.config.capture_dynamic_output_shape_ops = True` (a global setting this package never
changes); `torch.where` then yields unbacked sizes with `sym_size`/`_assert_scalar` nodes on them,
which belong to the region and go with it. Without the flag Dynamo skips the frame that holds the
loop; when a fragment of it still reaches the backend (a one_hot or `ids == e` mask computed and
returned, the loop being in another function), it is reported with a hint to set the flag.

Checked, not guessed: every expert 0..E-1 visited exactly once, with E the one_hot's num_classes
(or the `ids == e` constants) and the router's expert count; ids from a top-k (distinct per token,
in [0, E)); each expert's rows `x[tok_e]` of one x; its output scaled by `w[tok_e, k_e]`; one
zero-initialised [T, d] accumulator that nothing reads before the last add. `out[tok] += y` (the
Mistral reference code's spelling: Dynamo gives `setitem(out, tok, iadd(out[tok], y))`) is an
index_add there: the ids are distinct per token, so an expert's rows `tok` are distinct and the
read-add-write of each row happens once; the read `out[tok]` belongs to the add.
"""
from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from .common import (
    ZEROS,
    MoEMatch,
    NoMatch,
    RegionWalk,
    Rejection,
    arg,
    dtype_of,
    example_value,
    expect,
    getitem_of,
    is_call,
    is_getitem,
    is_int,
    module_path,
    same_size,
    shape_of,
)
from .module_list import (
    ExpertMLP,
    biased_matmul,
    expert_mlp,
    finish_expert_match,
    same_weights,
    through_float_casts,
    top_k_or_max_routing,
)

IDIOM = "expert_loop"
FLAG = "torch._dynamo.config.capture_dynamic_output_shape_ops"
HINT = (
    f"this graph returns what looks like the per-expert mask of an experts loop (one_hot(ids) or ids == e) whose "
    f"torch.where/nonzero graph-broke, so the loop never reaches the backend; if it is one, set {FLAG} = True "
    f"before torch.compile: the loop then becomes one graph that backend='sonic' rewrites"
)
_ZEROS_KWARGS = {"dtype", "device", "layout", "pin_memory", "requires_grad", "memory_format"}


def find(gm: fx.GraphModule) -> list[MoEMatch | Rejection]:
    results: list[MoEMatch | Rejection] = []
    done: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node in done or _parts(node) is None or not _rows_of_mask(node):
            continue
        acc = _accumulator(node)
        chain = _combine_chain(acc)
        done.update(chain)
        try:
            results.append(_check(acc, chain))
        except NoMatch as exc:
            results.append(Rejection(IDIOM, module_path(chain[-1]), str(exc)))
    if not torch._dynamo.config.capture_dynamic_output_shape_ops:
        results += _flag_off_hints(gm)
    return results


class _Step(NamedTuple):
    """One combine step of the loop."""

    index: fx.Node  # the rows it writes (torch.where's token output)
    source: fx.Node  # what it adds there
    reads: list[fx.Node]  # `out[tok]` and the add, for `out[tok] += y`: the step's own read of its rows
    kind: str  # "index_add" (either form), "add" (out[tok] += y) or "assign" (out[tok] = y)


def _parts(add: fx.Node) -> _Step | None:
    """The combine step `add` is: `out.index_add_(0, tok, y)`, `out.index_add(...)`, `out[tok] += y`
    / `out[tok] = out[tok] + y` (setitem of an add to the getitem of the same rows), or
    `out[tok] = y` (an index_add only with one expert per token: `_check` sees to it); `out[tok, :]`
    alike. None for any other node."""
    if is_call(add, "index_add", "index_add_"):
        return _Step(arg(add, 2, "index"), arg(add, 3, "source"), [], "index_add")
    if not (add.op == "call_function" and add.target is operator.setitem and len(add.args) == 3 and not add.kwargs):
        return None
    acc, index, value = add.args
    tok = _row_index(index)
    if tok is None or not isinstance(value, fx.Node):
        return None
    if value.op == "call_function" and value.target in (operator.iadd, operator.add) and len(value.args) == 2 \
            and not value.kwargs and _is_index(value.args[0], acc, index):
        return _Step(tok, value.args[1], [value.args[0], value], "add")
    return _Step(tok, value, [], "assign")


def _row_index(index) -> fx.Node | None:
    """tok of the index `[tok]` or `[tok, :]`."""
    if isinstance(index, tuple) and len(index) == 2 and index[1] == slice(None):
        index = index[0]
    return index if isinstance(index, fx.Node) else None


def _rows_of_mask(add: fx.Node) -> bool:
    """A candidate adds rows indexed by the output of torch.where/nonzero (a per-expert loop), or
    by a boolean mask `ids == e` (top-1 ids). A setitem is one only when its mask has an expert's
    shape (`ids == <int>`, `mask[<int>]` of a permute): `emb[ids == pad] = v` and the like, in any
    model, are not candidates to report."""
    step = _parts(add)
    index = step.index
    if step.kind == "index_add":
        return _is_index(index) and _is_where(index.args[0])
    if _is_index(index) and _is_where(index.args[0]):
        return _expert_mask_shaped(index.args[0].args[0])
    return _is_bool_mask(index) and _expert_mask_shaped(index)


def _expert_mask_shaped(mask) -> bool:
    """`ids == e` (or `ids[:, k] == e`) with constant ints, or `m[e]` of a permuted one_hot, where
    ids are a router's: the indices output of a topk or a max."""
    if is_call(mask, "eq", "__eq__") and len(mask.args) == 2:
        ids = [a for a in mask.args if isinstance(a, fx.Node)]
        if len(ids) == 1 and (column := _column(ids[0])) is not None:
            ids = [column[0]]
        return (len(ids) == 1 and any(is_int(a) for a in mask.args)
                and is_call(getitem_of(ids[0], 1), "topk", "max"))
    one_hot = mask.args[0].args[0] if _is_index(mask) and is_call(mask.args[0], "permute") else None
    return is_call(one_hot, "one_hot") and is_call(getitem_of(one_hot.args[0], 1), "topk", "max")


def _column(node) -> tuple[fx.Node, int] | None:
    """(ids, k) when `node` is `ids[:, k]` with a constant int k."""
    if not _is_index(node) or not isinstance(node.args[1], tuple) or len(node.args[1]) != 2:
        return None
    rows, k = node.args[1]
    return (node.args[0], k) if rows == slice(None) and is_int(k) else None


def _is_bool_mask(node) -> bool:
    """`ids == e`, a boolean [T] tensor (rows selected as x[m], out[m] = ...)."""
    value = example_value(node)
    return (is_call(node, "eq", "__eq__") and isinstance(value, torch.Tensor) and value.dtype == torch.bool
            and value.dim() == 1)


def _selects(node, where: fx.Node, tok_pos: int) -> bool:
    """`node` indexes this expert's rows: torch.where's token output `where[tok_pos]`, or the
    boolean mask itself (`where` is then the mask)."""
    return node is where if _is_bool_mask(where) else _is_index(node, where, tok_pos)


def _is_where(node) -> bool:
    """`torch.where(mask)` (one argument) or `mask.nonzero(as_tuple=True)`: a tuple of index tensors."""
    if is_call(node, "where"):
        return len(node.args) == 1 and not node.kwargs
    return is_call(node, "nonzero") and arg(node, 1, "as_tuple", False) is True


def _accumulator(add: fx.Node) -> fx.Node:
    """The tensor a chain of index_add(_) starts from: `out` of `out.index_add_` / `out = out.index_add(...)`."""
    acc = add.args[0]
    while is_call(acc, "index_add"):
        acc = acc.args[0]
    return acc


def _combine_chain(acc: fx.Node) -> list[fx.Node]:
    """Every index_add(_) (or `out[tok] += y`) into `acc`, in graph order: in-place adds on it, or
    functional adds chained from it (`out = out.index_add(...)`, each reading the previous)."""
    chain, todo = [], [acc]
    while todo:
        node = todo.pop()
        for user in node.users:
            if _parts(user) is not None and user.args[0] is node and user not in chain:
                chain.append(user)
                if is_call(user, "index_add"):
                    todo.append(user)
    order = {n: i for i, n in enumerate(acc.graph.nodes)}
    return sorted(chain, key=order.get)


def _check(acc: fx.Node, chain: list[fx.Node]) -> MoEMatch:
    walk = RegionWalk()
    anchor = chain[-1]
    inplace = _check_accumulator(acc, chain, walk)

    experts: dict[int, ExpertMLP] = {}
    columns: dict[int, list[int]] = {}  # per-k masks: the columns k each expert was added for
    whole: set[int] = set()  # experts added once, with a mask over all their slots
    xs, ids_nodes, weights_nodes, classes, extra = set(), set(), set(), set(), []
    for add in chain:
        e, k, expert, x, ids, weights, num_classes, asserts = _check_expert_add(add, walk)
        if k is None:
            expect(e not in experts, f"expert {e} is added twice")
            experts[e] = expert
            whole.add(e)
        else:
            expect(k not in columns.setdefault(e, []), f"expert {e} is added twice for column {k} of the ids")
            expect(e not in experts or same_weights(experts[e], expert),
                   f"expert {e} runs on different weights for different columns of the ids")
            experts.setdefault(e, expert)
            columns[e].append(k)
        xs.add(x)
        ids_nodes.add(ids)
        weights_nodes.add(weights)
        classes.add(num_classes)
        extra += asserts
    expect(len(xs) == 1, "experts read rows of different hidden states")
    expect(len(ids_nodes) == 1, "experts are selected from different expert ids")
    expect(len(weights_nodes) == 1, "experts are scaled by different routing weights")
    (x,), (topk_ids,), (topk_weights,) = xs, ids_nodes, weights_nodes

    E, K, flat = top_k_or_max_routing(topk_ids, walk)
    expect(not columns or not whole, "the loop mixes per-column masks (ids[:, k] == e) with masks over all the ids")
    for e, ks in columns.items():
        # sum over k and e of the rows where ids[:, k] == e: every (token, k) slot once, as the op sums them
        expect(sorted(ks) == list(range(K)), f"expert {e} is added for the ids' columns {sorted(ks)}, not each of "
               f"the K={K} columns")
    assigned = [add.name for add in chain if _parts(add).kind == "assign"]
    expect(not assigned or K == 1, f"{assigned[0] if assigned else ''} assigns its expert's rows (out[tok] = y) while "
           f"each token has K={K} experts: the last expert's rows would win, not their sum")
    for num_classes in classes - {None}:
        expect(num_classes == E, f"one_hot has num_classes={num_classes} but the router ranks E={E} experts")
    expect(all(0 <= e < E for e in experts), f"expert index {max(experts)} is outside the router's E={E} experts")
    expect(len(experts) == E, f"the loop visits experts {sorted(experts)} of the router's E={E}: not every expert")
    expect(shape_of(topk_weights) == shape_of(topk_ids), "top-k weights and ids differ in shape")
    expect(len(shape_of(x)) == 2, "hidden states are not [T, d]")
    T, d = shape_of(x)
    expect(same_size(T, shape_of(topk_ids)[0]), "hidden states are not [T, d] for the routed T")
    expect(same_size(shape_of(acc)[0], T) and same_size(shape_of(acc)[1], d), f"accumulator {shape_of(acc)} is not [T, d]")
    match = finish_expert_match(
        IDIOM, anchor, walk, anchor, chain, x, topk_ids, topk_weights, [experts[e] for e in range(E)],
        E=E, K=K, T=T, d=d, accumulator=acc if inplace else None, extra_region=extra, shape_only=[acc],
    )
    match.flat_top1 = flat
    return match


def _check_accumulator(acc: fx.Node, chain: list[fx.Node], walk: RegionWalk) -> bool:
    """A fresh zeros [T, d] accumulator, added to only (in place or chained), read after the last add.
    Returns whether the adds are in place."""
    expect(is_call(acc, *ZEROS), f"the loop accumulates into {acc.name}, not a fresh torch.zeros/zeros_like")
    expect(set(acc.kwargs) <= _ZEROS_KWARGS, f"accumulator is created with {sorted(set(acc.kwargs) - _ZEROS_KWARGS)}")
    expect(len(shape_of(acc)) == 2, "accumulator is not [T, d]")
    walk.mark(acc)
    own_reads = set()  # out[tok] of `out[tok] += y`: the add's own read of the rows it writes
    for add in chain:
        step = _parts(add)
        reads = step.reads
        if reads:
            rows, value = reads
            # Dynamo's checks of a boolean selection's size (sym_size, then asserts) read no value
            readers = [u for u in rows.users if u.target is not torch.ops.aten.sym_size.int]
            expect(readers == [value] and list(value.users) == [add],
                   f"{add.name} adds into rows {rows.name} that are read elsewhere too")
        elif step.kind == "index_add":
            expect(arg(add, 1, "dim") in (0, -2), f"{add.name} adds along dim {arg(add, 1, 'dim')}, not the token dim")
            expect(arg(add, 4, "alpha", 1) == 1, f"{add.name} scales its rows by alpha")
        own_reads.update(reads)
        walk.mark(add, *reads)
    inplace = {not is_call(add, "index_add") for add in chain}
    expect(len(inplace) == 1, "the loop mixes in-place and functional index_add")
    order = {n: i for i, n in enumerate(acc.graph.nodes)}
    last = order[chain[-1]]
    if inplace == {True}:
        expect(all(add.args[0] is acc for add in chain), "in-place adds go into different tensors")
        early = [u for alias in (acc, *chain) for u in alias.users
                 if u not in chain and u not in own_reads and order[u] < last]
        expect(not early, f"the accumulator is read inside the loop (by {early[0].name if early else ''}), before the last add")
        return True
    for node in (acc, *chain[:-1]):
        expect(len(node.users) == 1, f"the accumulator is read inside the loop (by {', '.join(u.name for u in node.users if u not in chain)})")
    return False


def _check_expert_add(add: fx.Node, walk: RegionWalk):
    """(e, k, expert, x, ids, weights, one_hot num_classes, assert nodes) of
    `out.index_add_(0, tok, experts[e](x[tok]) * w[tok, k, None])` (k: the column of a per-k mask
    `ids[:, k] == e`, else None)."""
    tok, source = _parts(add)[:2]
    if _is_bool_mask(tok):  # out[m] = ... with m = ids == e of top-1 [T] ids (or ids[:, k] == e): the rows m selects
        where = tok
        e, ids, tok_pos, num_classes, k = _expert_of_mask(tok, walk)
        expect(len(shape_of(ids)) == 1 or k is not None, f"{add.name} indexes rows by a boolean mask of [T, K] ids")
    else:
        where = tok.args[0] if _is_index(tok) else None
        expect(_is_where(where), f"{add.name} adds at rows that are not torch.where/nonzero indices")
        e, ids, tok_pos, num_classes, k = _expert_of_mask(where.args[0], walk)
        expect(tok.args[1] == tok_pos, f"{add.name} adds at the K positions of the mask, not its token positions")
        walk.mark(tok, where)

    # y * w[tok, k, None] (either order), cast or not
    mul = through_float_casts(source, walk)
    expect(is_call(mul, "mul", "__mul__") and len(mul.args) == 2, f"expert {e}'s output is not scaled by the routing weights")
    scaled = None
    for y, scale in (mul.args, mul.args[::-1]):
        weights = _routing_weight(scale, where, tok_pos, walk, k)
        y = through_float_casts(y, walk) if weights is not None else None
        if is_call(y, "linear", "matmul", "mm", "__matmul__") or biased_matmul(y):
            scaled = y, weights
            break
    expect(scaled is not None, f"expert {e}'s output is not scaled by its top-k weights w[tok, k]"
           + (f" (the weights' column {k}, as its mask's)" if k is not None else ""))
    walk.mark(mul)
    y, weights = scaled
    expert = expert_mlp(y, walk, e, stacked=True)
    x = _rows_read(through_float_casts(expert.rows, walk), where, tok_pos, walk)
    expect(x is not None, f"expert {e} does not read the rows x[tok] of its tokens")
    return e, k, expert, x, ids, weights, num_classes, _size_asserts(where, walk)


def _rows_read(rows: fx.Node, where: fx.Node, tok_pos: int, walk: RegionWalk) -> fx.Node | None:
    """x when `rows` is x[tok], x[tok, :] or x.index_select(0, tok) of a 2-D x, or
    `x[None, tok].reshape(-1, d)` (transformers 4.x's Mixtral block, copied into many code bases),
    with tok this expert's torch.where output."""
    if is_call(rows, "reshape", "view") and len(rows.args) >= 2 and not rows.kwargs:
        size = rows.args[1:] if len(rows.args) > 2 else rows.args[1]
        inner = rows.args[0]
        d = shape_of(rows)[-1] if len(shape_of(rows)) == 2 else None
        if not (isinstance(size, (tuple, list)) and len(size) == 2 and size[0] == -1 and same_size(size[1], d)
                and _is_index(inner) and isinstance(inner.args[1], tuple) and len(inner.args[1]) == 2
                and inner.args[1][0] is None):
            return None
        nodes, tok = [rows, inner], inner.args[1][1]  # x[None, tok] is [1, rows, d]
        rows = inner
    elif is_call(rows, "index_select") and len(rows.args) + len(rows.kwargs) == 3 and arg(rows, 1, "dim") == 0:
        tok, nodes = arg(rows, 2, "index"), [rows]
    else:
        tok = _row_index(rows.args[1]) if _is_index(rows) else None
        nodes = [rows]
    x = rows.args[0]
    if not _selects(tok, where, tok_pos) or len(shape_of(x)) != 2:
        return None
    if len(nodes) == 2 and not same_size(shape_of(nodes[0])[-1], shape_of(x)[1]):
        return None  # reshaped to another width: not x's rows
    walk.mark(*nodes, tok)
    return x


def _is_index(node, of=None, pos=None) -> bool:
    """`src[...]` (operator.getitem), optionally `of[pos]`."""
    if not is_getitem(node):
        return False
    return of is None or (node.args[0] is of and node.args[1] == pos)


def _expert_of_mask(mask_e, walk: RegionWalk) -> tuple[int, fx.Node, int, int | None, int | None]:
    """(e, ids, which output of torch.where is the token, one_hot's num_classes, k) for the mask of
    one expert: `mask[e]` with mask = one_hot(ids, E).permute(2, 1, 0) (or (2, 0, 1)), `ids == e`,
    or `ids[:, k] == e` (a loop over k around the loop over experts: k is the column it selects,
    None for the other masks)."""
    if is_call(mask_e, "eq", "__eq__"):  # ids == e: [T, K] -> (tok, k)
        ids, e = mask_e.args
        if isinstance(ids, int):
            ids, e = e, ids
        expect(is_int(e), "experts are selected by ids == <not a constant>")
        column = _column(ids)
        if column is not None:  # ids[:, k] == e: [T] -> (tok,)
            walk.mark(ids)
            ids, k = column
            expect(len(shape_of(ids)) == 2 and 0 <= k < shape_of(ids)[1],
                   f"experts are selected from column {k} of something that is not [T, K] ids")
        else:
            k = None
        expect(len(shape_of(ids)) in (1, 2) and not dtype_of(ids).is_floating_point,
               "experts are selected from something that is not [T, K] (or top-1 [T]) ids")
        walk.mark(mask_e)
        return e, ids, 0, None, k
    permuted = mask_e.args[0] if _is_index(mask_e) else None
    e = mask_e.args[1] if permuted is not None else None
    expect(is_call(permuted, "permute") and isinstance(e, int), "rows are not selected by mask[e] or ids == e")
    dims = permuted.args[1:] if len(permuted.args) > 2 else arg(permuted, 1, "dims")
    dims = tuple(int(d) % 3 for d in dims)
    expect(dims in ((2, 1, 0), (2, 0, 1)), f"expert mask permuted by {dims}: the expert dim must come first")
    one_hot = permuted.args[0]
    expect(is_call(one_hot, "one_hot"), "the expert mask is not a one_hot of the expert ids")
    num_classes = arg(one_hot, 1, "num_classes", -1)
    expect(isinstance(num_classes, int) and num_classes > 0, "one_hot has no explicit num_classes")
    walk.mark(mask_e, permuted, one_hot)
    # [E, K, T] -> torch.where gives (k, tok); [E, T, K] -> (tok, k)
    return e, one_hot.args[0], 1 if dims == (2, 1, 0) else 0, num_classes, None


def _routing_weight(scale, where: fx.Node, tok_pos: int, walk: RegionWalk, column: int | None = None) -> fx.Node | None:
    """The [T, K] weights w when `scale` is w[tok, k, None], w[tok, k].unsqueeze(-1) or
    w[tok, k][:, None] (casts anywhere), with (tok, k) this expert's torch.where outputs. With a
    per-k mask (`column`: ids[:, column] == e), k is that constant column, and w[tok, k:k+1]
    is also taken, as is v[tok, None] of the column v = w[:, k] (top-1 `max(keepdim=True)`
    values and ids, each taken at column 0)."""
    # torch.where of top-1 [T] ids: (tok,), or a boolean mask of them; weights w [T]
    flat = column is None and (_is_bool_mask(where) or len(example_value(where)) == 1)

    def picks_rows(node, extra=()):
        read = _read_at(node)
        if read is None:
            return False
        base, index = read
        if column == 0 and extra == (None,) and len(index) == 1 and shape_of(base)[1:] == (1,):
            return _selects(index[0], where, 0)  # w[tok] of top-1 [T, 1] weights: w[tok, 0:1]
        if column is not None:  # w[tok, k] (then broadcast), w[tok, k, None] or w[tok, k:k+1], k the mask's column
            if (read := _column(node.args[0])) is not None and read[1] == column:  # w[:, k][tok, None]
                return len(index) == 1 + len(extra) and _selects(index[0], where, 0) and tuple(index[1:]) == extra
            if len(index) != 2 + len(extra) and not (extra == (None,) and len(index) == 2):
                return False
            if not _selects(index[0], where, 0):
                return False
            if extra == (None,) and len(index) == 2:
                return index[1] == slice(column, column + 1, None)
            return is_int(index[1]) and index[1] == column and tuple(index[2:]) == extra
        if flat:  # w[tok] (then broadcast) or w[tok, None]
            return len(index) == 1 + len(extra) and _selects(index[0], where, 0) and tuple(index[1:]) == extra
        if len(index) != 2 + len(extra):
            return False
        t, k, *rest = index
        return _is_index(t, where, tok_pos) and _is_index(k, where, 1 - tok_pos) and tuple(rest) == extra

    scale = through_float_casts(scale, walk)
    nodes = [scale]
    if not picks_rows(scale, (None,)):
        broadcast = (is_call(scale, "unsqueeze") and arg(scale, 1, "dim") in (-1, 1)) or (
            _is_index(scale) and scale.args[1] in ((slice(None), None), (Ellipsis, None)))
        if not broadcast:
            return None
        scale = through_float_casts(scale.args[0], walk)
        if not picks_rows(scale):
            return None
        nodes.append(scale)
    w, index = _read_at(scale)  # w as the loop reads it, casts included
    if column is not None and (whole := _column(w)) is not None:  # the column w[:, k] of [T, K] weights
        nodes.append(w)
        w = whole[0]
    if len(shape_of(w)) != (1 if flat else 2) or dtype_of(w) is None or not dtype_of(w).is_floating_point:
        return None
    walk.mark(*nodes, *(i for i in index[:1 if flat or column is not None else 2] if i is not where))
    return w


def _read_at(node) -> tuple[fx.Node, tuple] | None:
    """(w, index) for `w[index]` (the index as a tuple) or `w.index_select(0, tok)` ((tok,))."""
    if _is_index(node):
        return node.args[0], node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if is_call(node, "index_select") and len(node.args) == 3 and node.args[1] == 0 and not node.kwargs:
        return node.args[0], (node.args[2],)
    return None


def _size_asserts(where: fx.Node, walk: RegionWalk) -> list[fx.Node]:
    """What Dynamo hangs on torch.where's unbacked sizes (getitem -> sym_size -> ge/le ->
    _assert_scalar): non-tensor nodes read by nothing else, erased with the region. For a boolean
    mask, the sizes are those of the rows it selects (`x[m]` -> sym_size -> ...)."""
    todo = [u for u in where.users]
    if _is_bool_mask(where):
        todo = [u for g in where.users if _is_index(g) for u in g.users if not isinstance(example_value(u), torch.Tensor)]
    found = []
    while todo:
        node = todo.pop()
        if node in found:
            continue
        is_index = is_getitem(node) and node.args[0] is where
        if not is_index and isinstance(example_value(node), torch.Tensor):
            continue  # a tensor computed from the rows: the region's own walk decides on it
        found.append(node)
        walk.mark(node)
        todo.extend(node.users)
    return found


def _flag_off_hints(gm: fx.GraphModule) -> list[Rejection]:
    """Fragments of an expert loop Dynamo did not trace: a one_hot (optionally permuted) or an
    `ids == e` of 2-D integer ids, returned from the graph for a torch.where that graph-broke."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returned = set(output.all_input_nodes)
    found = []
    for node in gm.graph.nodes:
        mask = None
        if is_call(node, "one_hot") and not _is_hf_eager_mask(node):
            permuted = [u for u in node.users if is_call(u, "permute")]
            if node in returned or any(p in returned for p in permuted):
                mask = node
        elif is_call(node, "eq", "__eq__") and node in returned and len(node.args) == 2:
            ids, e = node.args
            if isinstance(ids, fx.Node) and len(shape_of(ids)) == 2 and dtype_of(ids) in (torch.int64, torch.int32):
                if isinstance(e, int) and not isinstance(e, bool) or isinstance(example_value(e), torch.SymInt):
                    mask = node
        if mask is not None:
            found.append(Rejection(IDIOM, module_path(mask), HINT, hint=True))
    return found[:1]  # one hint per graph is enough


def _is_hf_eager_mask(one_hot: fx.Node) -> bool:
    """transformers' eager experts loop (its own finder explains it): one_hot -> permute -> sum -> greater."""
    return any(
        is_call(s, "sum") and any(is_call(g, "greater", "gt", "__gt__") for g in s.users)
        for p in one_hot.users if is_call(p, "permute") for s in p.users
    )
