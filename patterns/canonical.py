"""Canonical forms: graph rewrites that change how a computation is spelled, never its value, run
once before every finder so that each finder sees one form of each idiom.

A rule replaces a node by its canonical twin only where the two agree for every input the graph
can give it (the condition each rule states), and records what it did. The pass driver restores
the graph as it came when no region is rewritten, so a graph without MoE code leaves the backend
exactly as Dynamo traced it.

Rules (eager spelling -> canonical form):

    out.scatter_reduce(d, index, src, "sum")     ->  torch.scatter_add(out, d, index, src)
        # include_self (the default), or into a fresh zeros
    lib::op(out, index, src)                      ->  torch.scatter_add(out, 0, index, src) (or index_add)
        # a library's own op (torchtitan's deterministic_scatter_add) whose value and gradients
        # equal the torch function's on probes (`canonical_opaque`); put back where no region takes it

    p = torch.nonzero(m); p[:, 0], p[:, 1]        ->  torch.where(m)[0], torch.where(m)[1]
        # when every use of p is a constant column (or p.unbind(1); of a 1-D mask p.squeeze(-1)):
        # the same indices, same order
    v[m], v[m] = u                                ->  v[torch.where(m)], v[torch.where(m)] = u
        # m a boolean mask of two or more of v's leading dims (w[ids == e]): the same elements in
        # the same order; one torch.where(m) per mask, shared with the code's own
    v[(ids == e).any(-1)], torch.where((ids == e).any(-1))[0]  ->  v[tok], tok = torch.where(ids == e)[0]
        # ids top-k indices (distinct in a row): each token of expert e once, in order
    G[:, e][tok]                                  ->  w[tok, k], (tok, k) = torch.where(ids == e)
        # G the gate matrix of the rule above (one_hot(ids) * w summed over k), or top-k weights
        # scattered into zeros (scatter, scatter_add); also G[:, e:e+1][tok], G[:, e].index_select(0, tok)
    out.index_put_((tok,), v, accumulate=True)    ->  out.index_add_(0, tok, v)
    out.scatter_add_(0, tok[:, None].expand(-1, d), v)  ->  out.index_add_(0, tok, v)
        # rows added into rows: tok 1-D integer, v exactly the rows' shape (functional forms too)
    m = ids.unsqueeze(-1) == torch.arange(E)      ->  m = F.one_hot(ids, E)
        # [T, K, E] masks (litgpt's LLaMAMoE), when ids are top-k/max indices over E scores (so in
        # [0, E), where one_hot is defined) and every use of m reads only where it is nonzero:
        # permute/transpose/select/unbind down to a one-argument torch.where or nonzero.
    wt = (w * (ids == e)).sum(-1)                 ->  G = (F.one_hot(ids, E) * w.unsqueeze(-1)).sum(1); wt = G[:, e]
        # also torch.where(ids == e, w, 0).sum(-1) and w.masked_fill(ids != e, 0).sum(-1)
    (w[tok] * (ids[tok] == e)).sum(-1)            ->  G[:, e][tok]      (keepdim: G[:, e][tok, None])
        # a token's weight of expert e by a mask multiplied in, as a column of the [T, E] gate
        # matrix (one per ids and w); the same terms, at most one nonzero: equal values
    i = torch.argmax(s, dim=-1)                   ->  i = torch.max(s, dim=-1)[1]
        # the first index of each row's largest score for both (keepdim too)
    v, i = x.max(-1, keepdim=True)                ->  v, i = x.max(-1)
    i.squeeze(-1), i[:, 0], v[tok]                    i, i, v[tok, None]
    torch.where(i == e)[0]                            torch.where(i' == e)[0]
        # max/min kept as a [T, 1] column (a top-1 written with keepdim) when every use of the
        # values and indices drops that dim again, or reads rows of a 2-D result: the same values,
        # indices and ties, one shape
    g[:, e][:, None]                              ->  g[:, e, None]
    out = torch.zeros_like(x); out = out + v      ->  out = v
        # a sum started from a fresh zero tensor nothing else reads (values equal: 0 + v == v)
    offs = counts.cumsum(0).to(torch.int32)       ->  offs = torch.cumsum(counts, 0, dtype=torch.int32)
        # integer counts: sums mod 2**32 agree whether truncated before or after; float counts
        # (histc) only where their sum, at most the static number of counted ids, is below 2**24
    c = zeros_like(s, dtype=bool).scatter_(-1, ids, True).sum((0, 1))
                                                  ->  f = ids.reshape(-1)
                                                      c = torch.zeros(E).scatter_add(0, f, ones_like(f))
        # ids top-k (or max) indices over E scores: one True per id in each row (torchtitan 0.3)
    perm = torch.argsort(v, stable=s)             ->  perm = torch.sort(v, stable=s)[1]
    counts = torch.histc(v.float(), ...)          ->  counts = torch.histc(torch.sort(v)[0].float(), ...)
        # when v is sorted in the graph: a histogram does not depend on the order it counts in
    z.index_add_(0, perm // K, y), y row-wise from t[perm], x[perm // K]  ->  y from t, x.repeat_interleave(K, 0)
        # perm a permutation of the rows (sort / argsort of a 1-D v): each row of y depends on row
        # perm[i] of the reads alone (elementwise ops, W[e[perm]], sums off the rows, an expert loop
        # over masks of the rows), so putting it back at perm[i] // K gives the unpermuted rows summed
        # per token (`canonical_permuted`)
    z.index_copy(0, where(m0)[0], v0).index_copy(0, where(m1)[0], v1)  ->  z[m0] = v0; z[m1] = v1
        # z fresh zeros, each link read by the next alone (`functional_row_writes_to_mask_writes`)
    out = torch.empty_like(y); out[perm] = y      ->  inv = torch.empty_like(perm); inv[perm] = torch.arange(N)
                                                      out = y[inv]
        # un-sorting rows by scatter or by gather through the inverse permutation (perm from a sort;
        # zeros_like as well: the permutation writes every row)
    torch.einsum(...), x @ W, torch.split(...) loops over experts   ->  torch.bmm, products, torch._grouped_mm
        # the rules of `canonical_products` (listed there)
    x[:, None, None, :] @ W[ids], torch.bmm(r, W[ids.reshape(-1)])  ->  torch.einsum("ta,tkab->tkb", x, W[ids])
        # `canonical_products.gathered_product_to_einsum`, then `canonical_views`' rules on the
        # reshapes left around the einsums
    a = x.bfloat16(); b = x.bfloat16()            ->  b is a
    a = x[tok]; b = x[tok]                        ->  b is a
        # duplicate casts, views and row selections of one tensor (torchtitan casts x once per
        # grouped_mm; expert code reads x[tok] once per projection), when nothing writes in place
        # into either result, nor into what they read between the two
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .canonical_layout import (copied_rows_to_repeat, copies_added_back_to_sum, elementwise_of_transpose_to_transpose,
                               same_device_move_to_self, transpose_pair_to_base)
from .canonical_opaque import ORIGINAL, opaque_op_to_torch
from .canonical_routing import (add_of_rows_into_zeros_to_index_add, amax_to_max_values, argmax_to_max,
                                gate_nonzero_to_any_hit, functional_row_writes_to_mask_writes, gathered_outputs_to_gate_matrix,
                                sorted_prefix_to_topk, copies_at_slots_to_floor_div,
                                gate_rows_column_to_column_rows, masked_scatter_rows_to_index_add,
                                one_hot_count_to_any_hit, position_copy_to_mask_write,
                                scale_after_row_writes_to_scaled_rows, scattered_ones_to_one_hot, second_max_to_topk,
                                slot_one_hots_to_gate_matrix, slot_token_rows_to_repeat, tiled_rows_to_repeat)
from .canonical_products import (addmm_to_matmul_plus_bias, broadcast_matmul_to_bmm, einsum_outer_to_product, einsum_to_bmm,
                                 einsum_weighted_sum_to_product, gathered_product_to_einsum, packed_linear_view_to_einsum,
                                 split_loop_to_grouped_mm)
from .canonical_permuted import permuted_rows_put_back_to_rows
from .canonical_views import reshape_chain_to_base, reshape_through_elementwise, slices_cat_to_whole, unit_pieces_to_select
from .common import (ZEROS, arg, dtype_of, example_value, fake_mode_of, flattens_indices, getitem_of, grad_modes,
                     insert_call, is_call, is_getitem, is_int, op_name, same_shape, same_size, shape_of, storage_of, unit_slice,
                     writes_in_place)


def canonicalize(gm: fx.GraphModule) -> list[str]:
    """Bring `gm` to canonical form in place; one line per rewrite applied (empty: untouched)."""
    applied: list[str] = []
    for rule in RULES:
        gm.meta[_PASS] = {}  # what a rule may remember during its one pass over the nodes
        nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        order = {n: i for i, n in enumerate(nodes)}
        for node in nodes:
            if node in order:  # not erased by an earlier rewrite of this pass
                done = rule(gm, node, order)
                if done:
                    applied.append(f"{rule.__name__}: {done}")
                    _erase_if_dead(gm.graph, node, order)
    gm.meta.pop(_PASS, None)
    return applied


_PASS = "sonic_canonical_pass"  # gm.meta key of the current rule pass's memo (`canonicalize`)


def _erase_if_dead(graph: fx.Graph, node: fx.Node, order: dict) -> None:
    """Erase a replaced node, then each input it alone kept alive, if it has no effect."""
    todo = [node]
    while todo:
        node = todo.pop()
        if node not in order or node.users or node.op not in ("call_function", "call_method") or node.is_impure() or writes_in_place(node):
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        order.pop(node, None)
        todo += inputs


# --- index pairs of a mask, by columns of nonzero ---------------------------------------------

def nonzero_tuple_to_where(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`m.nonzero(as_tuple=True)` (or `torch.nonzero(m, as_tuple=True)`) -> `torch.where(m)`: the same
    tuple of index vectors, documented as equal."""
    if not is_call(node, "nonzero") or node.kwargs != {"as_tuple": True} or len(node.args) != 1:
        return None
    mask = node.args[0]
    if not isinstance(mask, fx.Node) or not isinstance(example_value(node), tuple):
        return None
    where = insert_call(gm, node, torch.where, (mask,))
    where.meta["example_value"] = example_value(node)
    order[where] = order[node]
    node.replace_all_uses_with(where)
    return f"{node.name} -> torch.where({mask.name})"


def nonzero_columns_to_where(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`p = torch.nonzero(m)` (or `m.nonzero()`, `torch.argwhere(m)`) read only as columns `p[:, c]`
    -> `torch.where(m)[c]`: the same int64 indices in the same (row-major) order. Every use must be
    a constant column (`p[:, c]`, `p.unbind(1)`; for a 1-D mask also `p.squeeze(-1)`, `p.view(-1)`,
    `p.flatten()`), or Dynamo's read of the row count, so no reader sees the [N, D] matrix itself."""
    if not is_call(node, "nonzero", "argwhere") or arg(node, 1, "as_tuple", False) is not False:
        return None
    if node.kwargs.keys() - {"as_tuple"} or len(node.args) != 1:
        return None
    mask, value = node.args[0], example_value(node)
    ndim = len(shape_of(mask) or ())
    if not isinstance(mask, fx.Node) or not isinstance(value, torch.Tensor) or ndim < 1 or not node.users:
        return None
    columns = []  # (user, column index) or (unbind user, None)
    for user in node.users:
        index = user.args[1] if is_getitem(user) else None
        if (isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None) and is_int(index[1])
                and -ndim <= index[1] < ndim and user.args[0] is node):
            columns.append((user, index[1] % ndim))
        elif (is_call(user, "unbind") and arg(user, 1, "dim", 0) in (1, -1) and 1 <= len(user.args) <= 2
              and user.args[0] is node):
            columns.append((user, None))
        elif ndim == 1 and flattens_indices(user, node):
            columns.append((user, 0))  # the indices of a 1-D mask as one vector
        elif user.target is torch.ops.aten.sym_size.int and user.args[1:] == (0,):  # Dynamo's checks of the count
            columns.append((user, "count"))
        else:
            return None
    where = insert_call(gm, node, torch.where, (mask,))
    fake_mode = fake_mode_of(gm)
    if fake_mode is not None:  # the columns keep nonzero's row count (its symbol), as the readers have it
        with fake_mode:
            where.meta["example_value"] = tuple(value.unbind(1))
    for user, c in columns:
        if c == "count":
            first = insert_call(gm, user, operator.getitem, (where, 0))
            twin = insert_call(gm, user, torch.ops.aten.sym_size.int, (first, 0))
        else:
            twin = where if c is None else insert_call(gm, user, operator.getitem, (where, c))
        user.replace_all_uses_with(twin)
        _erase_if_dead(gm.graph, user, order)
    return f"{node.name} -> where({mask.name})"


# --- selection by a boolean mask -----------------------------------------------------------------

def boolean_index_to_where(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`v[m]` (read; also `v[m, None]`) or `v[m] = u` (write) with m a boolean mask of two or more of
    v's leading dims (`w[ids == e]`: an expert's weights) -> `v[i0, i1, ..]` with `(i0, i1, ..) =
    torch.where(m)`: both select the elements where m is True in row-major order. An existing
    `torch.where(m)` before `node` is reused, so the rows and the weights of one expert share it."""
    setitem = node.op == "call_function" and op_name(node.target) == "setitem" and len(node.args) == 3
    getitem = is_getitem(node) and len(node.args) == 2
    if not (setitem or getitem):
        return None
    v, m = node.args[0], node.args[1]
    rest = ()
    if isinstance(m, tuple) and m and all(r is None or r == slice(None) for r in m[1:]):
        m, rest = m[0], m[1:]  # v[m, None], v[m, :]: the mask, then new or whole dims
    if not isinstance(m, fx.Node) or dtype_of(m) != torch.bool or not isinstance(example_value(v), torch.Tensor):
        return None
    mask_shape, shape = shape_of(m) or (), shape_of(v) or ()
    tokens_of = _any_expert_hit(m)
    if tokens_of is not None:  # (ids == e).any(-1): the tokens of torch.where(ids == e)[0]
        m, count = tokens_of, 1
        if not same_size(shape_of(m)[0], shape[0]):
            return None
    elif len(mask_shape) < 2 or not same_shape(mask_shape, shape[:len(mask_shape)]):
        return None  # (other 1-D masks stay: the loop finders read `x[m]`, `out[m] = y` as they are)
    else:
        count = len(mask_shape)
    where = _where_before(gm, m, node, order)
    index = [_where_output_before(gm, where, i, node, order) for i in range(count)]
    index = index[0] if len(index) == 1 and not rest else (*index, *rest)
    if setitem:
        twin = insert_call(gm, node, operator.setitem, (v, index, node.args[2]))
        twin.meta.pop("example_value", None)
    else:
        twin = insert_call(gm, node, operator.getitem, (v, index))
        for user in list(node.users):  # Dynamo's checks of the selection's row count: the indices' count
            if user.target is torch.ops.aten.sym_size.int and user.args[1:] == (0,):
                count = insert_call(gm, user, torch.ops.aten.sym_size.int, (index if isinstance(index, fx.Node) else index[0], 0))
                user.replace_all_uses_with(count)
                _erase_if_dead(gm.graph, user, order)
    node.replace_all_uses_with(twin)
    order[twin] = order[node]
    if setitem:  # an effect: erased here, where _erase_if_dead would keep it
        order.pop(node)
        gm.graph.erase_node(node)
    return f"{node.name} -> {v.name}[where({m.name})]"


def any_hit_where_to_hit_where(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`torch.where((ids == e).any(-1))[0]` -> `torch.where(ids == e)[0]` for top-k ids (distinct in a
    row: the same tokens, in order, each once; `_any_expert_hit`), sharing that where if the graph
    has one before."""
    if not (is_call(node, "where") and len(node.args) == 1 and not node.kwargs):
        return None
    hit = _any_expert_hit(node.args[0])
    if hit is None or not all(getitem_of(u, 0) is node for u in node.users):
        return None
    where = _where_before(gm, hit, node, order)
    for user in list(node.users):
        user.replace_all_uses_with(_where_output_before(gm, where, 0, user, order))
        _erase_if_dead(gm.graph, user, order)
    return f"{node.name} -> where({hit.name})"


_COMPARISONS = ("eq", "__eq__", "ne", "__ne__", "lt", "__lt__", "le", "__le__", "gt", "__gt__", "ge", "__ge__")


def _any_expert_hit(m) -> fx.Node | None:
    """`hit` when m is `hit.any(-1)` (or `.any(dim=1)`) of `hit = ids == e`, ids the [T, K] indices
    of a top-k over E scores: distinct in a row, so token t has m[t] True for exactly one k, and
    m's True rows are torch.where(hit)[0], in order, each once."""
    if not (is_call(m, "any") and len(shape_of(m) or ()) == 1 and arg(m, 1, "dim") in (-1, 1)):
        return None
    if m.kwargs.keys() - {"dim"} or len(m.args) > 2:
        return None
    hit = m.args[0]
    if not (is_call(hit, "eq", "__eq__") and len(hit.args) == 2 and not hit.kwargs):
        return None
    ids, e = hit.args if isinstance(hit.args[0], fx.Node) else hit.args[::-1]
    if not isinstance(ids, fx.Node) or not is_int(e):
        return None
    return hit if len(shape_of(ids) or ()) == 2 and _range_of(ids) is not None else None


def _equal_masks(m: fx.Node) -> list[fx.Node]:
    """m, then the other comparisons of the same tensor with the same constants (`ids == e` spelled
    twice), when nothing writes into that tensor in place."""
    found = [m]
    if is_call(m, *_COMPARISONS) and len(m.args) == 2 and not m.kwargs and isinstance(m.args[0], fx.Node):
        src = m.args[0]
        if not any(writes_in_place(u) and u.args[0] is src for u in src.users):
            found += [u for u in src.users if u is not m and u.op == m.op and u.target == m.target
                      and u.args == m.args and not u.kwargs]
    return found


def _where_before(gm: fx.GraphModule, mask: fx.Node, node: fx.Node, order: dict) -> fx.Node:
    """A one-argument `torch.where` of `mask` (or of an `_equal_masks` twin) that runs before `node`:
    the graph's own if it has one, else one inserted there, which later selections by mask reuse."""
    where = next((u for twin in _equal_masks(mask) for u in twin.users if is_call(u, "where") and len(u.args) == 1
                  and not u.kwargs and order.get(u, len(order)) < order[node]), None)
    if where is None:
        where = insert_call(gm, node, torch.where, (mask,))
        order[where] = order[node] - 0.5
    return where


def _where_output_before(gm: fx.GraphModule, where: fx.Node, i: int, node: fx.Node, order: dict) -> fx.Node:
    """`where[i]`, read before `node`: the graph's own node if one is, else one inserted there."""
    got = next((u for u in where.users if getitem_of(u, i) is where and order.get(u, len(order)) < order[node]), None)
    if got is None:
        got = insert_call(gm, node, operator.getitem, (where, i))
        order[got] = order[node] - 0.25
    return got


# --- masks compared against arange ------------------------------------------------------------

_MASK_PATHS = ("permute", "transpose", "select", "unbind")


def arange_mask_to_one_hot(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    if not is_call(node, "eq", "__eq__") or len(node.args) != 2:
        return None
    ids, E = _ids_against_arange(*node.args) or _ids_against_arange(*reversed(node.args)) or (None, None)
    if ids is None or shape_of(node) != (*shape_of(ids), E) or not _read_only_where_nonzero(node):
        return None
    if not _indices_below(ids, E):
        return None
    one_hot = insert_call(gm, node, F.one_hot, (ids, E))
    node.replace_all_uses_with(one_hot)
    return f"{node.name} -> one_hot({ids.name}, {E})"


def _ids_against_arange(a, b) -> tuple[fx.Node, int] | None:
    """(ids, E) when a is `ids.unsqueeze(-1)` (or `ids[..., None]`) and b is `torch.arange(E)`."""
    ids = None
    if is_call(a, "unsqueeze") and arg(a, 1, "dim") in (-1, len(shape_of(a)) - 1):
        ids = a.args[0]
    elif getitem_of(a, (Ellipsis, None)) is not None:
        ids = a.args[0]
    if not isinstance(ids, fx.Node) or not is_call(b, "arange") or set(b.kwargs) - {"device", "dtype"}:
        return None
    if len(b.args) != 1 or not isinstance(b.args[0], int) or isinstance(b.args[0], bool):
        return None
    dtype = dtype_of(ids)
    return (ids, b.args[0]) if dtype is not None and not dtype.is_floating_point and dtype != torch.bool else None


def _indices_below(ids: fx.Node, E: int) -> bool:
    """ids are the indices of a top-k or max over a last dim of size E: each in [0, E)."""
    source = getitem_of(ids, 1)
    if not is_call(source, "topk", "max"):
        return False
    dim = arg(source, 2 if is_call(source, "topk") else 1, "dim", -1 if is_call(source, "topk") else None)
    scores = shape_of(arg(source, 0, "input"))
    return bool(scores) and dim in (-1, len(scores) - 1) and scores[-1] == E


def _read_only_where_nonzero(mask: fx.Node) -> bool:
    """Every use of `mask` (through layout changes and selections) is a one-argument torch.where or
    a nonzero: those read a mask only where it is nonzero, so 0/1 integers and False/True agree."""
    todo, seen = [mask], set()
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if is_call(user, "where") and len(user.args) == 1 and not user.kwargs:
                continue
            if is_call(user, "nonzero", "argwhere"):
                continue
            layout = is_call(user, *_MASK_PATHS) or (
                is_getitem(user) and isinstance(user.args[1], int)
                and isinstance(example_value(user), (torch.Tensor, tuple)))
            if not layout or user.args[0] is not node:
                return False
            todo.append(user)
    return True


# --- a token's weight of expert e, by a mask multiplied in ------------------------------------

_MUL = ("mul", "__mul__", "__rmul__")


def masked_weight_to_gate_column(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`(w * (ids == e)).sum(-1)` (or `torch.where(ids == e, w, 0).sum(-1)`, `w.masked_fill(ids != e,
    0).sum(-1)`) -> `G[:, e]` (keepdim:
    `G[:, e:e+1]`) with the [T, E] gate matrix `G = (F.one_hot(ids, E) * w.unsqueeze(-1)).sum(1)`,
    built once per (ids, w): each G[t, e] sums the very terms w[t, k] * (ids[t, k] == e), of which at
    most one is nonzero (top-k ids are distinct), so the values are equal (up to the sign of a zero;
    the where form also where another slot's weight is finite). The ids must be a top-k over E
    scores (one_hot needs them in [0, E)), e a constant in [0, E). Ids with more leading token dims
    ([B, S, K]) give a [B, S, E] G read as `G[..., e]`."""
    if not is_call(node, "sum"):
        return None
    keepdim = arg(node, 2, "keepdim", False)
    mul = arg(node, 0, "input")
    rank = len(shape_of(mul))
    dim = arg(node, 1, "dim")
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    if node.kwargs.keys() - {"dim", "keepdim"} or not is_int(dim) or rank < 2 or dim % rank != rank - 1:
        return None
    if is_call(mul, *_MUL) and len(mul.args) == 2:
        pairs = ((*mul.args, "eq"), (*mul.args[::-1], "eq"))
    elif is_call(mul, "where") and len(mul.args) == 3 and not mul.kwargs and _zero_of(mul.args[2], mul.args[1]):
        pairs = ((mul.args[1], mul.args[0], "eq"),)  # where(mask, w, 0): w where the mask holds, else 0
    elif is_call(mul, "masked_fill") and len(mul.args) == 3 and not mul.kwargs and _zero_of(mul.args[2], mul.args[0]):
        pairs = ((mul.args[0], mul.args[1], "ne"),)  # w.masked_fill(ids != e, 0): where(ids == e, w, 0)
    else:
        return None
    for w, mask, compare in pairs:
        if isinstance(mask, fx.Node) and is_call(mask, "to", "float", "type_as") and dtype_of(mask.args[0]) == torch.bool:
            mask = mask.args[0]
        if not (is_call(mask, compare, f"__{compare}__") and len(mask.args) == 2 and isinstance(w, fx.Node)):
            continue
        ids, e = mask.args
        if not isinstance(ids, fx.Node) or not isinstance(e, int) or isinstance(e, bool):
            continue
        rows = None  # (w[tok] * (ids[tok] == e)).sum(-1): the rows of the same column, G[:, e][tok]
        if is_getitem(ids) and is_getitem(w) and ids.args[1] is w.args[1] and _row_indices(ids.args[1]):
            ids, w, rows = ids.args[0], w.args[0], ids.args[1]
        shape = shape_of(ids)
        E = _range_of(ids)
        if E is None or len(shape) < 2 or (rows is not None and len(shape) != 2) or shape_of(w) != shape or not 0 <= e < E:
            continue
        dtype = dtype_of(w)
        if dtype is None or not dtype.is_floating_point or dtype_of(mul) != dtype:
            continue
        gates = _gate_matrix(gm, ids, w, E, order)
        if rows is not None:
            picked = insert_call(gm, node, operator.getitem, (gates, (slice(None), e)))
            picked = insert_call(gm, node, operator.getitem, (picked, (rows, None) if keepdim else rows))
            node.replace_all_uses_with(picked)
            return f"{node.name} -> {gates.name}[:, {e}][{rows.name}{', None' if keepdim else ''}]"
        lead = slice(None) if len(shape) == 2 else Ellipsis
        column = (lead, slice(e, e + 1)) if keepdim else (lead, e)
        picked = insert_call(gm, node, operator.getitem, (gates, column))
        node.replace_all_uses_with(picked)
        return f"{node.name} -> {gates.name}[{':' if len(shape) == 2 else '...'}, {e}{':' + str(e + 1) if keepdim else ''}]"
    return None


def _zero_of(value, like) -> bool:
    """`value` is 0 (an int or float literal) or `torch.zeros_like(like)` of `like` itself."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    return is_call(value, "zeros_like") and len(value.args) == 1 and value.args[0] is like and not value.kwargs


def _range_of(ids: fx.Node) -> int | None:
    """E when ids are the indices of a top-k or max over E scores (each in [0, E)), else None."""
    source = getitem_of(ids, 1)
    if not is_call(source, "topk", "max"):
        return None
    scores = shape_of(arg(source, 0, "input"))
    E = scores[-1] if scores else None
    return E if isinstance(E, int) and _indices_below(ids, E) else None


def _gate_matrix(gm: fx.GraphModule, ids: fx.Node, w: fx.Node, E: int, order: dict) -> fx.Node:
    """The [T, E] `(one_hot(ids, E) * w.unsqueeze(-1)).sum(1)` for (ids, w), made right after the later
    of the two (one per graph and pair: `gm.meta` remembers it)."""
    made = gm.meta.setdefault("sonic_gate_matrices", {})
    if (ids, w) in made and made[(ids, w)].graph is gm.graph:
        return made[(ids, w)]
    later = max((ids, w), key=lambda n: order.get(n, -1))
    at = later.next
    one_hot = insert_call(gm, at, F.one_hot, (ids, E))
    weights = insert_call(gm, at, torch.unsqueeze, (w, -1))
    product = insert_call(gm, at, operator.mul, (one_hot, weights))
    made[(ids, w)] = insert_call(gm, at, torch.sum, (product, len(shape_of(ids)) - 1))  # over K
    return made[(ids, w)]


def gate_column_rows_to_weights(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`G[:, e][tok]` (or `[tok, None]`, `G[:, e:e+1][tok]`, `G[:, e].index_select(0, tok)`) of a gate
    matrix G = (one_hot(ids, E) * w.unsqueeze(-1)).sum(1) made by `masked_weight_to_gate_column`, or
    of top-k weights scattered into zeros (`_scattered_support`), with (tok, k) = torch.where(ids == e)
    -> `w[tok, k]` (or `w[tok, k, None]`): row tok[i] of G's column e is w at the one slot k[i] whose
    id is e, so the values are equal (up to the sign of a zero) wherever the token's weights are
    finite (a NaN or inf weight in another slot makes the one_hot form's entry NaN, as 0 * inf is)."""
    if is_getitem(node) and len(node.args) == 2 and is_getitem(node.args[0]):
        column, index = node.args
    elif (is_call(node, "index_select") and len(node.args) == 3 and node.args[1] in (0, -2) and not node.kwargs
          and is_getitem(node.args[0])):
        column, index = node.args[0], node.args[2]
    else:
        return None
    made = {g: key for key, g in gm.meta.get("sonic_gate_matrices", {}).items()}
    gates, at = column.args
    if not (isinstance(at, tuple) and len(at) == 2 and at[0] == slice(None)):
        return None
    e, rest = at[1], ()
    if unit_slice(e) is not None:
        e, rest = unit_slice(e), (None,)  # G[:, e:e+1][tok]: the [N, 1] column
    if not is_int(e):
        return None
    ids_w = made.get(gates) or _scattered_support(gates) or _sparse_support(gates)
    if ids_w is None:
        return None
    ids, w = ids_w
    if isinstance(index, tuple) and len(index) == 2 and index[1] is None and not rest:
        index, rest = index[0], (None,)
    where = index.args[0] if isinstance(index, fx.Node) and getitem_of(index, 0) is not None else None
    hit = where.args[0] if is_call(where, "where") and len(where.args) == 1 and not where.kwargs else None
    if not (is_call(hit, "eq", "__eq__") and not hit.kwargs and tuple(hit.args) in ((ids, e), (e, ids))):
        return None
    if w is None:  # the values at the ids, gathered once after the gates
        made = gm.meta.setdefault("sonic_gate_values", {})
        if gates not in made or made[gates].graph is not gm.graph:
            made[gates] = insert_call(gm, gates.next, torch.gather, (gates, 1, ids))
        w = made[gates]
    k = _where_output_before(gm, where, 1, node, order)
    picked = insert_call(gm, node, operator.getitem, (w, (index, k, *rest)))
    node.replace_all_uses_with(picked)
    order[picked] = order[node]
    return f"{node.name} -> {w.name}[{index.name}, {k.name}]"


def _scattered_support(gates) -> tuple[fx.Node, fx.Node] | None:
    """(ids, w) when `gates` is [T, K] weights w scattered into a fresh zeros [T, E] at top-k ids
    (`torch.zeros_like(probs).scatter(1, ids, w)`, `scatter_add`, in place too): G[t, e] is w[t, k]
    at the one slot whose id is e (top-k ids are distinct), 0 elsewhere; else None."""
    if not (is_call(gates, "scatter", "scatter_", "scatter_add", "scatter_add_") and len(gates.args) == 4
            and not gates.kwargs):
        return None
    base, dim, ids, w = gates.args
    if not (is_call(base, *ZEROS) and dim in (1, -1) and isinstance(ids, fx.Node) and isinstance(w, fx.Node)):
        return None
    if str(gates.target).endswith("_") and list(base.users) != [gates]:
        return None  # the zeros read or written elsewhere
    shape, E = shape_of(gates), _range_of(ids)
    if E is None or len(shape) != 2 or shape[1] != E or not same_shape(shape_of(w), shape_of(ids)) or dtype_of(w) != dtype_of(gates):
        return None
    return ids, w


def _sparse_support(gates) -> tuple[fx.Node, fx.Node | None] | None:
    """(ids, w) of any gate matrix `dense_experts.sparse_gates` proves zero outside [T, K] top-k ids
    (one_hot(ids, E) * w summed over K, a softmax of top-k logits scattered into -inf...): w the
    values the graph holds when they are the gates' own, else None (the caller gathers
    `gates.gather(1, ids)`: G[t, e] is the value at the one slot k whose id is e)."""
    from .canonical_routing import _gate_support

    found = _gate_support(gates)
    if found is None:
        return None
    ids, w = found
    if w is not None and dtype_of(w) == dtype_of(gates) and same_shape(shape_of(w), shape_of(ids)):
        return ids, w
    return ids, None


def keepdim_reduction_to_plain(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`v, i = x.max(d, keepdim=True)` (or min) -> `v, i = x.max(d)` when every use of v and i drops
    dim d again (`squeeze(d)`, `[:, 0]` at d = 1 of a 2-D result) or, for a 2-D x and d = 1, reads
    rows (`v[tok]` -> `v[tok, None]`) or finds rows (`torch.where(i == e)[0]`, its [1] unread). The
    reduction and its ties are the same; only the kept size-1 dim goes, as a top-1 written without
    keepdim has it."""
    if not is_call(node, "max", "min") or arg(node, 2, "keepdim", False) is not True:
        return None
    source, dim = node.args[0] if node.args else None, arg(node, 1, "dim")
    rank = len(shape_of(source))
    if not isinstance(source, fx.Node) or not is_int(dim) or not -rank <= dim < rank:
        return None
    dim %= rank
    dropped = tuple([slice(None)] * dim) + (0,)
    plans = []  # (out, use, how): None (the plain result), a row index tok (-> [tok, None]) or "where"
    selects = (dropped, (Ellipsis, 0)) if dim == rank - 1 else (dropped,)
    outputs = list(node.users)
    for out in outputs:
        if not (is_getitem(out) and out.args[1] in (0, 1)):
            return None
        for use in out.users:
            if is_call(use, "squeeze") and use.args[0] is out and len(use.args) + len(use.kwargs) == 2 \
                    and arg(use, 1, "dim") in (dim, dim - rank, (dim,), (dim - rank,)):
                plans.append((out, use, None))
            elif is_getitem(use) and use.args[0] is out and use.args[1] in selects:
                plans.append((out, use, None))
            elif is_getitem(use) and use.args[0] is out and rank == 2 and dim == 1 and _row_indices(use.args[1]):
                plans.append((out, use, use.args[1]))
            elif rank == 2 and dim == 1 and _rows_where_equal(use, out):
                plans.append((out, use, "where"))
            else:
                return None
    if not plans:
        return None
    target = getattr(torch, node.target) if node.op == "call_method" else node.target
    plain = insert_call(gm, node, target, (source, dim))
    parts = {i: insert_call(gm, node, operator.getitem, (plain, i)) for i in (0, 1)}
    for out, use, tok in plans:
        part = parts[out.args[1]]
        if tok == "where":  # torch.where(i == c)[0] over the [T, 1] column: the rows of torch.where(i' == c)
            equal = insert_call(gm, use, operator.eq, (part, use.args[1]))
            for where in list(use.users):
                rows = insert_call(gm, where, torch.where, (equal,))
                for index in list(where.users):
                    index.replace_all_uses_with(insert_call(gm, index, operator.getitem, (rows, 0)))
                    _erase(gm, index, order)
                _erase(gm, where, order)
            _erase(gm, use, order)
            continue
        if tok is not None:
            part = insert_call(gm, use, operator.getitem, (part, (tok, None)))
        use.replace_all_uses_with(part)
        _erase(gm, use, order)
    for out in outputs:
        _erase(gm, out, order)
    return f"{node.name}: {node.target}(keepdim=True) -> {plain.name}, its {len(plans)} uses without the kept dim"


def _erase(gm: fx.GraphModule, node: fx.Node, order: dict) -> None:
    gm.graph.erase_node(node)
    order.pop(node, None)


def _rows_where_equal(compare, column: fx.Node) -> bool:
    """`column == c` (an int c) read only by one-argument torch.where calls, each read only at [0]:
    the rows where the [T, 1] column equals c (its [1], all zeros, unread)."""
    if not (is_call(compare, "eq", "__eq__") and len(compare.args) == 2 and compare.args[0] is column
            and is_int(compare.args[1]) and not compare.kwargs and compare.users):
        return False
    return all(is_call(w, "where") and len(w.args) == 1 and not w.kwargs and w.users
               and all(getitem_of(g, 0) is w for g in w.users) for w in compare.users)


def column_then_none_to_one_index(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`g[:, e][:, None]` -> `g[:, e, None]` on a 2D g: one index, as finders read a gate column."""
    inner = node.args[0] if is_getitem(node) else None
    if not isinstance(inner, fx.Node) or node.args[1] != (slice(None), None):
        return None
    if not (is_getitem(inner) and len(shape_of(inner.args[0])) == 2):
        return None
    index = inner.args[1]
    if not (isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None) and isinstance(index[1], int)):
        return None
    merged = insert_call(gm, node, operator.getitem, (inner.args[0], (slice(None), index[1], None)))
    node.replace_all_uses_with(merged)
    return f"{node.name} -> {inner.args[0].name}[:, {index[1]}, None]"


# --- in-place arithmetic on a value nothing else reads --------------------------------------

# Python's augmented assignments stay: `out[idx] += v` (getitem, iadd, setitem) is a row write the
# loop finders read as written
_INPLACE_ARITHMETIC = {"mul_": torch.mul, "add_": torch.add, "sub_": torch.sub, "div_": torch.div}
# ops whose result may share its input's storage (or be the input itself: a cast to its own dtype)
_ALIASING = ("view", "reshape", "view_as", "reshape_as", "type", "to", "contiguous", "unsqueeze", "squeeze",
             "transpose", "permute", "t", "expand", "expand_as", "flatten", "unflatten", "narrow", "select",
             "float", "half", "bfloat16", "double", "detach", "movedim")


def fresh_inplace_to_functional(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`t.mul_(w)` (`add_`, `sub_`, `div_`) -> `torch.mul(t, w)` where the write is seen by
    nothing else: t, and each tensor it may alias back to its first computed value (through views,
    reshapes, casts to its own dtype, slices), is read by the next of that chain alone, and that
    first value is computed in the graph (no input, no parameter, no buffer). DeepSeek-V2's
    `new_x.view(T, K, -1).type(dtype).mul_(w).sum(1)`. The same values; no one else sees the write."""
    name = node.target if node.op == "call_method" else None
    if name not in _INPLACE_ARITHMETIC or len(node.args) != 2 or node.kwargs or not isinstance(node.args[0], fx.Node):
        return None
    current, reader = node.args[0], node
    while True:
        if current.op not in ("call_function", "call_method") or list(current.users) != [reader] \
                or writes_in_place(current):
            return None
        index = current.args[1] if is_getitem(current) else None
        basic = is_getitem(current) and not any(
            isinstance(i, fx.Node) for i in (index if isinstance(index, tuple) else (index,)))  # a view
        if not (is_call(current, *_ALIASING) or basic):
            break
        if not isinstance(current.args[0], fx.Node):
            return None
        current, reader = current.args[0], current
    if dtype_of(node.args[0]) is None or shape_of(node) != shape_of(node.args[0]):
        return None  # a broadcast that would grow the value is no in-place op
    functional = insert_call(gm, node, _INPLACE_ARITHMETIC[name], tuple(node.args))
    order[functional] = order[node]
    node.replace_all_uses_with(functional)
    described = node.name
    _erase(gm, node, order)  # a write in place no one reads: not erased as dead code
    return f"{described} -> {_INPLACE_ARITHMETIC[name].__name__}({functional.args[0].name}, ...)"


# --- sums started from zeros -----------------------------------------------------------------

def zeros_plus_value_to_value(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`torch.zeros_like(x) + v` -> `v` (a sum started from a fresh zero tensor) when v already has the
    result's shape and dtype and nothing else reads or writes the zeros. Equal values (0 + v == v;
    only a -0.0 of v would come out as +0.0)."""
    if not is_call(node, "add", "__add__") or len(node.args) != 2 or node.kwargs:
        return None
    for zeros, value in (node.args, node.args[::-1]):
        if not (is_call(zeros, *ZEROS) and isinstance(value, fx.Node) and list(zeros.users) == [node]):
            continue
        if shape_of(value) != shape_of(node) or dtype_of(value) != dtype_of(node):
            continue
        node.replace_all_uses_with(value)
        return f"{node.name} -> {value.name}"
    return None


# --- rows added into rows: index_put(accumulate=True) and row-broadcast scatter_add -------------

def index_put_accumulate_to_index_add(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`out.index_put_((tok,), v, accumulate=True)` (or `index_put`) -> `out.index_add_(0, tok, v)`
    (`index_add`): both add row i of v into row tok[i] of out, repeated rows summed, when tok is one
    1-D integer index tensor and v has exactly the rows' shape (no broadcast). Not under
    `torch.use_deterministic_algorithms(True)`: index_put's accumulation has a deterministic CUDA
    kernel, index_add's raises there."""
    if not is_call(node, "index_put", "index_put_") or node.op != "call_method":
        return None
    if torch.are_deterministic_algorithms_enabled():
        return None
    if node.kwargs.keys() - {"accumulate"} or len(node.args) not in (3, 4):
        return None
    out, indices, v = node.args[:3]
    accumulate = node.args[3] if len(node.args) == 4 else node.kwargs.get("accumulate", False)
    if accumulate is not True or not isinstance(indices, (tuple, list)) or len(indices) != 1:
        return None
    tok = indices[0]
    if not _row_indices(tok) or not isinstance(v, fx.Node) or not isinstance(out, fx.Node):
        return None
    if not same_shape(shape_of(v), (shape_of(tok)[0], *shape_of(out)[1:])) or dtype_of(v) != dtype_of(out):
        return None
    name = "index_add_" if node.target == "index_put_" else "index_add"
    _replace_by_method(gm, node, name, (out, 0, tok, v), order)
    return f"{node.name} -> {name}(0, {tok.name})"


def row_scatter_add_to_index_add(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`out.scatter_add_(0, idx, v)` (or `scatter_add`, `torch.scatter_add`) with idx = tok's values
    repeated along each row (`tok[:, None].expand(-1, d)`, `tok.unsqueeze(-1).expand_as(v)`,
    `tok.view(-1, 1).repeat(1, d)`...) -> `out.index_add_(0, tok, v)`: idx[i, j] = tok[i] for every
    j, so both add row i of v into row tok[i] of out. out and v are 2-D with equal rows widths."""
    if not is_call(node, "scatter_add", "scatter_add_") or set(node.kwargs) - {"dim", "index", "src"} \
            or len(node.args) + len(node.kwargs) != 4:
        return None
    out, dim, idx, v = node.args[0], arg(node, 1, "dim"), arg(node, 2, "index"), arg(node, 3, "src")
    if not all(isinstance(t, fx.Node) for t in (out, idx, v)) or dim not in (0, -2):
        return None
    if ORIGINAL in node.meta:  # a library op's stand-in, put back as it was where no region takes it
        return None
    tok = _row_broadcast_of(idx)
    if tok is None or len(shape_of(out)) != 2 or not same_shape(shape_of(idx), shape_of(v)):
        return None
    if not same_shape(shape_of(v), (shape_of(tok)[0], shape_of(out)[1])) or dtype_of(v) != dtype_of(out):
        return None
    name = "index_add_" if is_call(node, "scatter_add_") else "index_add"
    _replace_by_method(gm, node, name, (out, 0, tok, v), order)
    return f"{node.name} -> {name}(0, {tok.name})"


def _row_indices(tok) -> bool:
    """A 1-D integer (not boolean) tensor node."""
    dtype = dtype_of(tok)
    return (isinstance(tok, fx.Node) and len(shape_of(tok) or ()) == 1 and dtype is not None
            and not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool)


def _row_broadcast_of(idx: fx.Node) -> fx.Node | None:
    """tok when `idx` [N, d] holds tok[i] in every column of row i: tok [N] made a column (`tok[:, None]`,
    `unsqueeze(-1|1)`, `view/reshape(-1|N, 1)`), then widened (`expand(-1|N, d)`, `expand_as`,
    `repeat(1, d)`)."""
    if is_call(idx, "expand", "expand_as", "repeat") and isinstance(idx.args[0], fx.Node):
        if is_call(idx, "repeat"):
            reps = idx.args[1] if len(idx.args) == 2 and isinstance(idx.args[1], (tuple, list)) else idx.args[1:]
            if tuple(reps)[:1] != (1,) or len(reps) != 2:
                return None
        column = idx.args[0]
        if len(shape_of(column) or ()) != 2 or not same_size(shape_of(column)[1], 1):
            return None
        if is_call(column, "unsqueeze") and arg(column, 1, "dim") in (-1, 1):
            tok = column.args[0]
        elif getitem_of(column, (slice(None), None)) is not None:
            tok = column.args[0]
        elif is_call(column, "view", "reshape") and len(column.args) >= 2:
            tok = column.args[0]
        else:
            return None
        return tok if _row_indices(tok) and same_size(shape_of(tok)[0], shape_of(idx)[0]) else None
    return None


def _replace_by_method(gm: fx.GraphModule, node: fx.Node, name: str, args: tuple, order: dict) -> None:
    """Put `args[0].<name>(*args[1:])` in node's place (its value and readers), and drop node."""
    with gm.graph.inserting_before(node):
        twin = gm.graph.call_method(name, args)
    twin.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "nn_module_stack", "stack_trace")})
    node.replace_all_uses_with(twin)
    order[twin] = order[node]
    order.pop(node)
    gm.graph.erase_node(node)


def scatter_reduce_sum_to_scatter_add(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`out.scatter_reduce(dim, index, src, "sum")` -> `torch.scatter_add(out, dim, index, src)`: the
    same sums (include_self=True, the default; with include_self=False only into a fresh zeros, whose
    entries add nothing either way). The in-place form stays."""
    if not is_call(node, "scatter_reduce") or len(node.args) < 4:
        return None
    base, dim, index = node.args[0], arg(node, 1, "dim"), arg(node, 2, "index")
    src, reduce = arg(node, 3, "src"), arg(node, 4, "reduce")
    if reduce != "sum" or set(node.kwargs) - {"dim", "index", "src", "reduce", "include_self"}:
        return None
    if not node.kwargs.get("include_self", True) and not is_call(base, *ZEROS):
        return None
    if not all(isinstance(t, fx.Node) for t in (base, index, src)) or not isinstance(dim, int):
        return None
    added = insert_call(gm, node, torch.scatter_add, (base, dim, index, src))
    node.replace_all_uses_with(added)
    return f"{node.name} -> scatter_add"


# --- sorting by expert: argsort, histograms, un-sorting ------------------------------------------

def argsort_to_sort(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`torch.argsort(v, stable=s)` -> `torch.sort(v, stable=s)[1]` (the same permutation, always)."""
    if not is_call(node, "argsort") or node.kwargs.keys() - {"dim", "descending", "stable"} or len(node.args) > 2:
        return None
    v = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    if not isinstance(v, fx.Node) or len(shape_of(v)) != 1 or dim not in (0, -1):
        return None
    kwargs = {"stable": bool(node.kwargs.get("stable", False)), "descending": bool(node.kwargs.get("descending", False))}
    sort = insert_call(gm, node, torch.sort, (v,), kwargs)
    perm = insert_call(gm, node, operator.getitem, (sort, 1))
    node.replace_all_uses_with(perm)
    return f"{node.name} -> sort({v.name})[1]"


def mask_count_to_counts(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`torch.zeros_like(s, dtype=torch.bool).scatter_(-1, ids, True).sum(<every dim but the last>)`
    -> `torch.zeros(E, dtype=torch.int64).scatter_add(0, f, torch.ones_like(f))`, f = ids.reshape(-1)
    (torchtitan 0.3 counts each expert's tokens from a routing mask): ids are the top-k (or max)
    indices over E scores, distinct within a row, so each row of the mask holds one True per id and
    the column sums are the ids' counts (int64 both); the zeros and the mask have no reader but the
    scatter and the sum (nothing writes into them between). The counts keep a static shape (a
    bincount's depends on the ids' values), wherever they are read."""
    if not is_call(node, "sum") or len(node.args) < 1:
        return None
    mask = node.args[0]
    if not is_call(mask, "scatter_", "scatter") or dtype_of(mask) != torch.bool or len(mask.args) != 4:
        return None
    base, dim, ids, value = mask.args
    shape = shape_of(mask)
    if not is_call(base, "zeros_like", "zeros") or value is not True or not shape or not isinstance(ids, fx.Node):
        return None
    if list(mask.users) != [node] or list(base.users) != [mask]:
        return None  # another reader could write into the mask (or its zeros) before the sum
    E, rank = shape[-1], len(shape)
    if dim not in (-1, rank - 1) or len(shape_of(ids)) != rank or tuple(shape_of(ids)[:-1]) != tuple(shape[:-1]):
        return None
    dims = arg(node, 1, "dim")
    dims = (dims,) if isinstance(dims, int) else tuple(dims or ())
    if sorted(d % rank for d in dims) != list(range(rank - 1)) or arg(node, 2, "keepdim", False):
        return None
    if node.kwargs.get("dtype"):
        return None
    if not isinstance(E, int) or not _indices_below(ids, E):
        return None
    flat = insert_call(gm, node, torch.reshape, (ids, (-1,)))
    zeros = insert_call(gm, node, torch.zeros, (E,), {"dtype": torch.int64, "device": example_value(ids).device})
    ones = insert_call(gm, node, torch.ones_like, (flat,))
    count = insert_call(gm, node, torch.scatter_add, (zeros, 0, flat, ones))
    node.replace_all_uses_with(count)
    return f"{node.name} -> counts of {ids.name} by scatter_add, {E} bins"


def histogram_of_sorted_values(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`histc(v)` / `bincount(v)` (through casts) -> the same of `sort(v).values` when v is sorted in
    the graph: a histogram does not depend on the order of what it counts."""
    if not is_call(node, "histc", "bincount") or (is_call(node, "bincount") and arg(node, 1, "weights") is not None):
        return None  # (weights pair with the unsorted order)
    chain, v = [], arg(node, 0, "input")
    while is_call(v, "float", "int", "long", "to") and len(v.users) == 1:
        chain.append(v)
        v = v.args[0]
    if not isinstance(v, fx.Node) or len(shape_of(v)) != 1:
        return None
    first = chain[-1] if chain else node
    sort = next((u for u in v.users if is_call(u, "sort") and u.args[0] is v and order.get(u, len(order)) < order[first]
                 and arg(u, 1, "dim", -1) in (0, -1)), None)
    if sort is None:
        return None
    values = next((u for u in sort.users if getitem_of(u, 0) is sort), None) or insert_call(gm, sort.next, operator.getitem,
                                                                                          (sort, 0))
    if order.get(values, -1) > order[first]:
        return None  # the sorted values are taken after the count
    first.replace_input_with(v, values)
    return f"{node.name} counts {values.name}"


def scatter_unsort_to_gather(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """`out = torch.empty_like(y); out[perm] = y` -> `out = y[inv]` with `inv = torch.empty_like(perm);
    inv[perm] = torch.arange(N)`: for a permutation perm of the N rows both put row i at perm[i]. perm
    must come from a sort or argsort of N elements, and `out` is written by that setitem alone."""
    if not (node.op == "call_function" and op_name(node.target) == "setitem" and len(node.args) == 3):
        return None
    out, perm, y = node.args
    if not (is_call(out, "empty_like", "zeros_like") and out.args[0] is y and isinstance(perm, fx.Node)
            and set(out.kwargs) <= {"memory_format"}):
        return None  # (a permutation writes every row: what the buffer held before is never read)
    sort = getitem_of(perm, 1)
    if not is_call(sort, "sort") or len(shape_of(perm)) != 1 or not shape_of(y):
        return None
    N = shape_of(perm)[0]
    if not (isinstance(N, int) and same_size(shape_of(y)[0], N)):
        return None
    if [u for u in out.users if u is not node and order.get(u, len(order)) < order[node]]:
        return None  # out is read before it is written
    if any(writes_in_place(u) and u is not node for u in out.users):
        return None
    inv = insert_call(gm, node, torch.empty_like, (perm,))
    rows = insert_call(gm, node, torch.arange, (N,), {"device": example_value(perm).device})
    write = insert_call(gm, node, operator.setitem, (inv, perm, rows))
    write.meta.pop("example_value", None)
    gathered = insert_call(gm, node, operator.getitem, (y, inv))
    out.replace_all_uses_with(gathered, delete_user_cb=lambda u: u is not node)
    for dead in (node, out):
        gm.graph.erase_node(dead)
        order.pop(dead, None)
    return f"{out.name} = {y.name}[inverse of {perm.name}]"


# --- offsets: cumsum then cast ------------------------------------------------------------------

_INT_CAST_METHODS = ("to", "int", "type")


def cast_cumsum_to_dtype(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    out = dtype_of(node)
    if out != torch.int32 or not is_call(node, *_INT_CAST_METHODS) or not _plain_cast(node, torch.int32):
        return None
    cumsum = node.args[0]
    if not is_call(cumsum, "cumsum") or len(cumsum.users) != 1 or arg(cumsum, 2, "dtype") is not None:
        return None
    counts, dim = arg(cumsum, 0, "input"), arg(cumsum, 1, "dim")
    src = dtype_of(counts)
    if src is None or src == torch.bool or not isinstance(dim, int) or not _exact_in_int32(counts, src):
        return None
    canonical = insert_call(gm, node, torch.cumsum, (counts, dim), {"dtype": torch.int32})
    node.replace_all_uses_with(canonical)
    return f"{node.name} -> cumsum({counts.name}, {dim}, dtype=int32)"


def _plain_cast(node: fx.Node, dtype: torch.dtype) -> bool:
    """`.to(dtype)` / `.to(dtype=dtype)` / `.int()` / `.type(dtype)`: a cast and nothing else."""
    if node.target == "int":
        return len(node.args) == 1 and not node.kwargs
    given = node.args[1:] + tuple(node.kwargs.values())
    return len(given) == 1 and given[0] is dtype and set(node.kwargs) <= {"dtype"}


def _exact_in_int32(counts: fx.Node, dtype: torch.dtype) -> bool:
    """The cumsum of `counts` cast to int32 equals the int32 cumsum: always for integers (both wrap
    mod 2**32); for float histc counts when no partial sum can exceed the float's exact range."""
    if not dtype.is_floating_point:
        return True
    if not is_call(counts, "histc"):
        return False
    counted = shape_of(arg(counts, 0, "input"))
    numel = 1
    for size in counted:
        if not isinstance(size, int):
            return False
        numel *= size
    exact = {torch.float32: 2**24, torch.float64: 2**53}.get(dtype, 0)
    return numel < exact


# --- duplicate reads: casts, views, row selections -------------------------------------------

_PURE_METHODS = ("to", "float", "half", "bfloat16", "double", "type_as", "contiguous", "transpose", "t", "permute",
                 "view", "reshape", "unsqueeze", "squeeze", "flatten")


def merge_duplicate_reads(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """A cast, view or `x[index]` identical to an earlier one, when both run under one grad mode (one
    under `torch.no_grad` passes no gradient) and nothing in the graph writes into either result,
    nor into what they read between the two."""
    pure = (node.op == "call_method" and node.target in _PURE_METHODS) or (
        is_getitem(node) and isinstance(example_value(node.args[0]), torch.Tensor))
    if not pure or not isinstance(node.args[0], fx.Node):
        return None
    if any(isinstance(a, (torch.device, str)) for a in (*node.args, *node.kwargs.values())):
        return None  # a device move
    for twin in node.args[0].users:
        if twin is node or twin not in order or order[twin] > order[node]:
            continue
        if twin.op == node.op and twin.target == node.target and twin.args == node.args and twin.kwargs == node.kwargs:
            if _same_grad_mode(gm, twin, node) and _unwritten(gm, order, twin, node):
                node.replace_all_uses_with(twin)
                return f"{node.name} -> {twin.name}"
            return None
    return None


def merge_duplicate_reductions(gm: fx.GraphModule, node: fx.Node, order: dict) -> str | None:
    """A `max`, `min`, `argmax`, `argmin`, `topk` or `sort` over one dim identical to an earlier one
    once their arguments are read by name, defaults filled and dims counted from 0
    (`torch.max(p, -1)` and `p.max(dim=-1)`: a router's argmax, made a max by `argmax_to_max`, and
    its own `max(p).values`), when both run under one grad mode (a max under `torch.no_grad` has no
    gradient for its values) and nothing writes into either result or what they read between the
    two: one node, so the ids and the weights are seen as one top-k's."""
    key = _reduction_key(node)
    if key is None:
        return None
    for twin in node.args[0].users:
        if twin is node or twin not in order or order[twin] > order[node] or _reduction_key(twin) != key:
            continue
        if _same_grad_mode(gm, twin, node) and _unwritten(gm, order, twin, node):
            node.replace_all_uses_with(twin)
            return f"{node.name} -> {twin.name}"
        return None
    return None


# each reduction's parameters in order, with the defaults of those that have one (no dim: not taken)
_REDUCTIONS = {"max": (("input", "dim", "keepdim"), {"keepdim": False}),
               "min": (("input", "dim", "keepdim"), {"keepdim": False}),
               "argmax": (("input", "dim", "keepdim"), {"keepdim": False}),
               "argmin": (("input", "dim", "keepdim"), {"keepdim": False}),
               "topk": (("input", "k", "dim", "largest", "sorted"), {"dim": -1, "largest": True, "sorted": True}),
               "sort": (("input", "dim", "descending"), {"dim": -1, "descending": False})}


def _reduction_key(node: fx.Node) -> tuple | None:
    """(name, every argument by name, the dim counted from 0) of a reduction over one dim, or None."""
    name = node.target if node.op == "call_method" else op_name(node.target) if node.op == "call_function" else None
    if name not in _REDUCTIONS or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    params, defaults = _REDUCTIONS[name]
    if len(node.args) > len(params) or node.kwargs.keys() - set(params[1:]):
        return None
    bound = dict(defaults, **dict(zip(params, node.args)), **node.kwargs)
    rank = len(shape_of(node.args[0]) or ())
    dim = bound.get("dim")
    if not is_int(dim) or rank == 0 or not -rank <= dim < rank or any(p not in bound for p in params):
        return None
    bound["dim"] = dim % rank
    return name, tuple(bound[p] for p in params)


def _same_grad_mode(gm: fx.GraphModule, first: fx.Node, second: fx.Node) -> bool:
    memo = gm.meta.setdefault(_PASS, {})  # a merging pass adds no switch: the modes found once
    if "grad_modes" not in memo:
        memo["grad_modes"] = grad_modes(gm.graph)
    return memo["grad_modes"].get(first) == memo["grad_modes"].get(second)


def _unwritten(gm: fx.GraphModule, order: dict, first: fx.Node, second: fx.Node) -> bool:
    """No node writes in place into the storage of `first` or `second` anywhere, nor into an input of
    theirs between the two (storages from the fake tensors, which views share)."""
    results = {storage_of(first), storage_of(second)} - {None}
    inputs = {storage_of(i) for i in second.all_input_nodes} - {None}
    memo = gm.meta.get(_PASS, {})  # this rule's pass merges reads and makes no writer: found once
    if "writers" not in memo:
        memo["writers"] = [(writer, storage_of(writer.args[0]) if writer.args and isinstance(writer.args[0], fx.Node)
                            else None) for writer in gm.graph.nodes
                           if writer.op in ("call_function", "call_method") and writes_in_place(writer)]
    for writer, ref in memo["writers"]:
        if ref is None:
            return False  # a write into something of unknown storage: assume the worst
        between = order.get(first, -1) < order.get(writer, -1) < order.get(second, -1)
        if ref in results or (between and ref in inputs):
            return False
    return True


# the scatter rules before any_hit_where_to_hit_where: row_scatter_add_to_index_add compares the
# sizes of the scattered rows and their indices as traced, which that rule's new torch.where would not share
RULES = [opaque_op_to_torch, same_device_move_to_self, merge_duplicate_reads, fresh_inplace_to_functional,
         unit_pieces_to_select, sorted_prefix_to_topk,
         argmax_to_max, amax_to_max_values, merge_duplicate_reductions, scattered_ones_to_one_hot, second_max_to_topk, slices_cat_to_whole,
         slot_one_hots_to_gate_matrix,
         one_hot_count_to_any_hit,
         gate_nonzero_to_any_hit, scale_after_row_writes_to_scaled_rows, masked_scatter_rows_to_index_add,
         nonzero_tuple_to_where, nonzero_columns_to_where,
         boolean_index_to_where, scatter_reduce_sum_to_scatter_add, row_scatter_add_to_index_add,
         # rows permuted by expert, put back: here for the loop rules after it, again below for
         # products respelled by then
         permuted_rows_put_back_to_rows, functional_row_writes_to_mask_writes,
         addmm_to_matmul_plus_bias, transpose_pair_to_base, elementwise_of_transpose_to_transpose, copied_rows_to_repeat, copies_added_back_to_sum,
         any_hit_where_to_hit_where, position_copy_to_mask_write, copies_at_slots_to_floor_div, slot_token_rows_to_repeat,
         tiled_rows_to_repeat,
         arange_mask_to_one_hot, masked_weight_to_gate_column, gate_rows_column_to_column_rows, gate_column_rows_to_weights,
         keepdim_reduction_to_plain, column_then_none_to_one_index, zeros_plus_value_to_value,
         add_of_rows_into_zeros_to_index_add,
         index_put_accumulate_to_index_add, mask_count_to_counts, cast_cumsum_to_dtype, argsort_to_sort, histogram_of_sorted_values,
         # a write put back into fresh rows now reads as a gather: in-place arithmetic on them again
         scatter_unsort_to_gather, fresh_inplace_to_functional, gathered_product_to_einsum, reshape_through_elementwise, reshape_chain_to_base,
         packed_linear_view_to_einsum, einsum_to_bmm, einsum_weighted_sum_to_product, einsum_outer_to_product,
         broadcast_matmul_to_bmm, permuted_rows_put_back_to_rows,
         # token-major products laid out expert-major leave transposes: moved past elementwise code
         # (one pass follows a chain), then collapsed in pairs
         elementwise_of_transpose_to_transpose, transpose_pair_to_base, gathered_outputs_to_gate_matrix,
         split_loop_to_grouped_mm]
