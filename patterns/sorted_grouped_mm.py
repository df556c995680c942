"""Tokens sorted by expert, `torch._grouped_mm` over the per-expert counts, and a scatter-add back:
the spelling of torchtitan's MoE (before its padding wrapper) and of the MoE code that copied it.

Eager code it matches, shapes (T tokens, d hidden, n expert width, E experts, K top-k):

    w, ids = torch.topk(scores, K, dim=-1)                                 # [T, K]
    counts = torch.histc(ids.view(-1), bins=E, min=0, max=E)               # (or max=E-1, bincount, casts)
    perm = torch.argsort(ids.view(-1), stable=True)                        # (or torch.sort(...)[1])
    tok = perm // K                                                        # [TK]: slot -> token
    rows = torch.gather(x, 0, tok.reshape(-1, 1).expand(-1, d))           # (or x[tok], index_select)
    rows = (rows.float() * w.view(-1)[perm].reshape(-1, 1)).to(x.dtype)   # either here ...
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = F.silu(grouped_mm(rows, W1.transpose(-2, -1), offs=offs)) * grouped_mm(rows, W3.transpose(-2, -1), offs=offs)
    y = grouped_mm(h, W2.transpose(-2, -1), offs=offs)                     # (or one W13, chunked)
    y = (y.float() * w.view(-1)[perm].reshape(-1, 1)).to(x.dtype)         # ... or here
    out = torch.zeros_like(x).scatter_add(0, tok.reshape(-1, 1).expand(-1, d), y)   # (or index_add, in place,
                                                                           #  or into a shared expert's output)

The rows may also go back un-sorted first (`u[perm] = y`, or a gather through the inverse
permutation) and be weighted per [T, K] slot after (`torch.einsum("tkd,tk->td", u.view(T, K, d), w)`).

Slot s of the sorted order is token perm[s] // K with expert ids.view(-1)[perm[s]]; ascending
expert order with the histogram's counts makes grouped_mm run expert e on exactly its slots, and
the scatter-add sums each token's K rows: `out[t] = sum_k w[t, k] * expert_{ids[t, k]}(x[t])`
(weights on the inputs: `sum_k expert(w[t, k] x[t])`, the op on the T K scaled rows). Any
permutation that sorts the ids ascending gives the same sum, so a stable sort is not required.

It becomes `sonic::moe_experts` (one W13), or `sonic::moe_experts_list` on the per-expert views of
W1 and W3; a shared expert's output that the scatter-add starts from stays in the graph and is
added to the op's output. transformers' own grouped_mm path (one W13, an inverse permutation and a
view(T, K, d).sum(1)) is `hf_grouped_mm`; `looks_scattered` tells the two apart. That layout in
this idiom's spelling of the routing, which `hf_grouped_mm` refuses, comes here through `check`.
"""
from __future__ import annotations

import torch.fx as fx

from .activation_probe import identify_activation, identify_pair_activation
from .canonical_opaque import refusal
from .common import (
    ZEROS,
    MoEMatch,
    NoMatch,
    RegionWalk,
    Rejection,
    arg,
    backward_slice,
    check_inverse_permutation,
    dtype_of,
    expect,
    finish_match,
    getitem_of,
    is_call,
    is_getitem,
    is_noop_cast,
    module_path,
    same_size,
    shape_of,
    summed_per_token,
)
from .hf_grouped_mm import (SCATTERS, _weight_of as _grouped_weight, grouped_calls, looks_scattered, unsorted_first,
                            weighted_after_unsort)
from .module_list import through_float_casts, topk_routing

IDIOM = "sorted_grouped_mm"
_INT_CASTS = ("float", "int", "long", "to", "double")


def find(gm: fx.GraphModule) -> list[MoEMatch | Rejection]:
    results = []
    for offs, calls in grouped_calls(gm).items():
        if not looks_scattered(calls) and len(calls) != 3:
            continue  # hf_grouped_mm's (an up and a down projection un-sorted by the inverse permutation)
        try:
            results.append(check(offs, calls))
        except NoMatch as exc:
            results.append(Rejection(IDIOM, module_path(calls[0]), str(exc)))
    return results


def _through_int_casts(node, walk: RegionWalk):
    while is_call(node, *_INT_CASTS) and len(node.args) <= 2 and not node.kwargs:
        walk.mark(node)
        node = node.args[0]
    return node


def _flat_topk(node, walk: RegionWalk) -> fx.Node:
    """ids of `ids.view(-1)` / reshape(-1) / flatten() with ids a top-k's [T, K] indices."""
    expect(is_call(node, "view", "reshape", "flatten") and len(shape_of(node)) == 1,
           f"{getattr(node, 'name', node)} is not the flattened top-k ids")
    ids = node.args[0]
    expect(is_call(getitem_of(ids, 1), "topk") and len(shape_of(ids)) == 2, "sorted ids are not a top-k's [T, K] indices")
    walk.mark(node)
    return ids


def _counts(offs: fx.Node, walk: RegionWalk) -> tuple[int, fx.Node]:
    """(E, the counted ids) of `cumsum(histc(ids, bins=E, min=0, max=E or E-1), dtype=int32)`, of
    bincount(ids, minlength=E), or of a routing mask's counts in canonical form (`mask_count_to_counts`)."""
    expect(is_call(offs, "cumsum") and arg(offs, 1, "dim") in (0, -1), "grouped_mm offsets are not a cumsum of per-expert counts")
    hist = offs.args[0]
    expect(is_call(hist, "histc", "bincount", "scatter_add"), "per-expert counts are not a histc/bincount")
    walk.mark(offs, hist)
    if is_call(hist, "scatter_add"):  # zeros(E).scatter_add(0, ids, ones_like(ids)): a routing mask's sum, canonical
        base, dim, index, ones = (arg(hist, i, name) for i, name in enumerate(("input", "dim", "index", "src")))
        E = shape_of(base)[0] if len(shape_of(base)) == 1 else None
        expect(is_call(base, "zeros") and dim == 0 and isinstance(E, int) and is_call(ones, "ones_like")
               and ones.args[0] is index, "per-expert counts are not a histc/bincount")
        walk.mark(base, ones)
        return E, index
    if is_call(hist, "histc"):
        E, lo, hi = arg(hist, 1, "bins"), arg(hist, 2, "min", 0), arg(hist, 3, "max", 0)
        expect(isinstance(E, int) and lo == 0 and hi in (E - 1, E), f"histc range ({lo}, {hi}) does not give one bin per expert")
    else:
        E = arg(hist, 2, "minlength")
        expect(isinstance(E, int) and arg(hist, 1, "weights") is None, "bincount has weights or no static minlength")
    return E, _through_int_casts(hist.args[0], walk)


def _sort_perm(counted: fx.Node, perm: fx.Node, walk: RegionWalk) -> fx.Node:
    """The [T, K] top-k ids, given that `perm` is an ascending sort's permutation of their flattened
    view (`argsort`, or `sort(...)[1]`) and `counted` is that view, or the sort's values."""
    sort = perm if is_call(perm, "argsort") else getitem_of(perm, 1)
    expect(is_call(sort, "argsort", "sort"), "the rows are not permuted by a sort of the expert ids")
    expect(arg(sort, 1, "dim", -1) in (0, -1) and not arg(sort, 2, "descending", False)
           and not sort.kwargs.get("descending", False), "expert ids are not sorted ascending")
    ids = _flat_topk(sort.args[0], walk)
    values = getitem_of(counted, 0)
    if values is not None:
        expect(values is sort, "the counts are of another sort's values")
        walk.mark(counted)
    else:
        expect(_flat_topk(counted, walk) is ids, "the sort and the counts read different ids")
    walk.mark(sort, perm)
    return ids


def _expanded(index) -> tuple[fx.Node, list[fx.Node]] | None:
    """(tok, the index glue) of `tok.reshape(-1, 1).expand(-1, w)` (view, unsqueeze(1), expand_as
    alike): every column of row s reads token tok[s]."""
    if not is_call(index, "expand", "expand_as") or len(shape_of(index)) != 2:
        return None
    col = index.args[0]
    ok = (is_call(col, "reshape", "view") and shape_of(col)[1:] == (1,)) or (is_call(col, "unsqueeze") and arg(col, 1, "dim") in (1, -1))
    return (col.args[0], [index, col]) if ok else None


def _row_gather(node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(x, tok, the index glue) of `x[tok]`, `index_select(x, 0, tok)` or `gather(x, 0,
    tok.reshape(-1, 1).expand(-1, d))` over all of x's d columns; None for anything else."""
    if is_getitem(node) and isinstance(node.args[1], fx.Node):
        return node.args[0], node.args[1], []
    if is_call(node, "index_select") and arg(node, 1, "dim") in (0, -2):
        return node.args[0], arg(node, 2, "index"), []
    if is_call(node, "gather") and arg(node, 1, "dim") in (0, -2):
        x, found = node.args[0], _expanded(arg(node, 2, "index"))
        if found is not None and len(shape_of(x)) == 2 and same_size(shape_of(arg(node, 2, "index"))[1], shape_of(x)[1]):
            return x, *found
    return None


def _sorted_weights(scale, perm: fx.Node, walk: RegionWalk) -> fx.Node:
    """topk_weights of `w.view(-1)[perm].reshape(-1, 1)` (unsqueeze(-1), [:, None]; casts allowed)."""
    scale = through_float_casts(scale, walk)
    broadcast = (is_call(scale, "unsqueeze") and arg(scale, 1, "dim") in (1, -1)) or \
        (is_call(scale, "reshape", "view") and len(shape_of(scale)) == 2 and shape_of(scale)[1] == 1) or \
        getitem_of(scale, (slice(None), None)) is not None
    expect(broadcast, "the rows are not scaled by per-slot weights broadcast over d")
    picked = through_float_casts(scale.args[0], walk)
    expect(getitem_of(picked, perm) is not None, "the rows' weights are not the routing weights in sorted order")
    flat = picked.args[0]
    expect(is_call(flat, "view", "reshape", "flatten") and len(shape_of(flat)) == 1, "the rows' weights are not the flattened top-k weights")
    walk.mark(scale, picked, flat)
    return flat.args[0]


def _scaled(node: fx.Node, perm: fx.Node, walk: RegionWalk) -> tuple[fx.Node, fx.Node] | None:
    """(the rows, topk_weights) of `rows * w_sorted` (either order, float casts around), or None."""
    if not (is_call(node, "mul", "__mul__") and len(node.args) == 2 and not node.kwargs):
        return None
    for rows, scale in (node.args, node.args[::-1]):
        try:
            inner = RegionWalk()
            weights = _sorted_weights(scale, perm, inner)
        except NoMatch:
            continue
        walk.seen |= inner.seen
        walk.mark(node)
        return rows, weights
    return None


def _weight_of(node, walk: RegionWalk) -> tuple[fx.Node, bool]:
    """hf_grouped_mm's (expert weight, stored transposed?), no-op casts on either side skipped."""
    weight, transposed = _grouped_weight(walk.through(node), walk)
    return walk.through(weight), transposed


def grouped_input(calls: list[fx.Node], walk: RegionWalk) -> fx.Node:
    """The rows every up projection of grouped_mm calls sharing offsets reads (no-op casts skipped),
    none of the calls with a bias; the calls marked into `walk`."""
    expect(all(arg(c, 3, "bias") is None for c in calls), "grouped_mm with bias is not matched")
    walk.mark(*calls)
    rows = {walk.through(u.args[0]) for u in calls[:-1]}
    expect(len(rows) == 1, "the up projections read different rows")
    return rows.pop()


def grouped_experts(calls: list[fx.Node], walk: RegionWalk) -> tuple[fx.Node, fx.Node | None, fx.Node, bool, dict]:
    """(w1, w_up, w2, transposed, activation) of an up and a down grouped_mm (w1 gate and up
    together, w_up None) or two ups and a down (w1 the gate, w_up the up) sharing offsets, with the
    activation between them identified by probing; the nodes in between marked into `walk`."""
    *ups, down = calls
    layouts = [_weight_of(c.args[1], walk) for c in calls]
    expect(len({t for _, t in layouts}) == 1, "up and down weights use different layouts")
    transposed = layouts[0][1]
    w2 = layouts[-1][0]
    a = walk.through(down.args[0])
    if len(ups) == 1:
        h = walk.forward(ups[0])
        act = identify_activation(h, a)
        expect(not isinstance(act, str), str(act))
        w1, w_up = layouts[0][0], None
        walk.mark(*backward_slice([a], stop={h}))
    else:
        hs = tuple(walk.forward(u) for u in ups)
        found = identify_pair_activation(hs[0], hs[1], a)
        expect(not isinstance(found, str), str(found))
        act, swapped = found
        w1, w_up = (layouts[1][0], layouts[0][0]) if swapped else (layouts[0][0], layouts[1][0])
        walk.mark(*backward_slice([a], stop=set(hs)))
    return w1, w_up, w2, transposed, act


def check(offs: fx.Node, calls: list[fx.Node]) -> MoEMatch:
    walk = RegionWalk()
    expect(len(calls) in (2, 3), f"expected two or three grouped_mm calls sharing offsets, found {len(calls)}")
    *ups, down = calls
    rows = grouped_input(calls, walk)
    E, counted = _counts(offs, walk)

    # rows = x[perm // K], maybe scaled by the sorted weights first
    inner = through_float_casts(rows, walk)
    sources = [a for a in inner.args if isinstance(a, fx.Node)] if is_call(inner, "mul", "__mul__") else [inner]
    toks = [g[1] for src in sources if (g := _row_gather(through_float_casts(src, RegionWalk()))) is not None
            and is_call(g[1], "floordiv") and len(g[1].args) == 2 and isinstance(g[1].args[1], int)]
    expect(len(toks) == 1, "up-projection rows are not gathered by perm // K")
    (tok,) = toks
    perm, K = tok.args
    topk_ids = _sort_perm(counted, perm, walk)
    ranked, _ = topk_routing(topk_ids, walk)
    expect(ranked == E, f"the counts have {E} bins, the router ranks E={ranked} experts")
    T = shape_of(topk_ids)[0]
    expect(K == shape_of(topk_ids)[1], f"rows are gathered by perm // {K} for K={shape_of(topk_ids)[1]}")
    walk.mark(tok)

    scaled = _scaled(inner, perm, walk)
    input_scaled = scaled is not None
    gathered = through_float_casts(scaled[0], walk) if input_scaled else inner
    expect(len(shape_of(gathered)) == 2, "gathered rows are not [TK, d]")
    d = shape_of(gathered)[1]
    found = _row_gather(gathered)
    expect(found is not None and found[1] is tok, "up-projection rows are not gathered by the sorted tokens")
    x, _, glue = found
    walk.mark(gathered, *glue)
    expect(len(shape_of(x)) == 2 and same_size(shape_of(x)[0], T) and same_size(shape_of(x)[1], d),
           "gathered hidden states are not [T, d] (every column of each token)")

    w1, w_up, w2, transposed, act = grouped_experts(calls, walk)

    # y, scaled by the sorted weights unless the inputs were, then scattered back to the tokens
    y = _forward_float_casts(walk.forward(down), walk)
    if not input_scaled and unsorted_first(y):  # un-sorted, then weighted per [T, K] slot and summed
        (anchor, topk_weights), added_to, acc = weighted_after_unsort(y, perm, T, K, d, walk), None, None
    else:
        if input_scaled:
            topk_weights = scaled[1]
            src = y
        else:
            mul = walk.only_reader(y)
            found = _scaled(mul, perm, walk) if mul is not None else None
            expect(found is not None and found[0] is y, "expert outputs are not scaled by the routing weights")
            topk_weights = found[1]
            src = mul
        src = _forward_float_casts(src, walk)
        reader = walk.only_reader(src)
        if reader is not None and is_getitem(reader):
            anchor, added_to, acc = _unsorted_back(src, perm, T, K, walk), None, None
        else:
            anchor, added_to, acc = _scatter_back(src, tok, T, d, walk)
    expect(shape_of(topk_weights) == shape_of(topk_ids), "top-k weights and ids differ in shape")
    expect(dtype_of(anchor) == dtype_of(x), f"the combine is in {dtype_of(anchor)}, the hidden states in {dtype_of(x)}")
    match = finish_match(IDIOM, ups[0], walk, anchor, x, topk_ids, topk_weights, w1, w2, None, None, transposed, act,
                         E=E, K=K, T=T, d=d, w_up=w_up, added_to=added_to)
    match.input_scaled, match.accumulator = input_scaled, acc
    return match


def _forward_float_casts(node: fx.Node, walk: RegionWalk) -> fx.Node:
    """Follow `node` through its single float-to-float cast readers (`.to(x.dtype)` after the scaling)."""
    while True:
        user = walk.only_reader(node)
        if user is None or not (is_noop_cast(user) or (is_call(user, "to", "float", "half", "bfloat16", "type_as")
                                                        and dtype_of(user) is not None and dtype_of(user).is_floating_point
                                                        and not any(isinstance(a, str) for a in user.args[1:]))):
            return node
        walk.mark(user)
        node = user


def _unsorted_back(src: fx.Node, perm: fx.Node, T, K, walk: RegionWalk) -> fx.Node:
    """The anchor of the combine `src[inv].view(T, K, d).sum(1)` with `inv = torch.empty_like(perm);
    inv[perm] = torch.arange(TK)`: slot t*K + k reads its row back, and each token sums its K rows
    (transformers' combine; `out[perm] = src` reaches this form as a canonical one)."""
    unsort = walk.only_reader(src)
    check_inverse_permutation(unsort, perm, walk)
    return summed_per_token(unsort, walk, T, K)


def _scatter_back(src: fx.Node, tok: fx.Node, T, d, walk: RegionWalk) -> tuple[fx.Node, fx.Node | None, fx.Node | None]:
    """(anchor, added_to, accumulator) of the combine `base.scatter_add(0, tok.reshape(-1, 1).expand(-1, d),
    src)` or `base.index_add(0, tok, src)`: base a fresh zeros [T, d] (nothing to add), a tensor the
    op's output is added to (a shared expert's output: added_to), or, in place, a fresh zeros that is
    read only after the add (accumulator)."""
    add = walk.only_reader(src)
    expect(add is not None and is_call(add, *SCATTERS) and arg(add, 3, "src" if "scatter" in str(add.target) else "source") is src,
           "expert rows are not scatter-added back to their tokens" + refusal(add))
    expect(arg(add, 1, "dim") in (0, -2), f"{add.name} adds along dim {arg(add, 1, 'dim')}, not the token dim")
    index = arg(add, 2, "index")
    if is_call(add, "index_add", "index_add_"):
        expect(index is tok and arg(add, 4, "alpha", 1) == 1, f"{add.name} adds at other rows than the sorted tokens, or scaled")
    else:
        found = _expanded(index)
        expect(found is not None and found[0] is tok and same_size(shape_of(index)[1], d),
               f"{add.name} adds at other rows than the sorted tokens")
        walk.mark(*found[1])
    base = add.args[0]
    expect(len(shape_of(base)) == 2 and same_size(shape_of(base)[0], T) and same_size(shape_of(base)[1], d),
           f"the combine adds into {shape_of(base)}, not [T, d]")
    walk.mark(add)
    fresh = is_call(base, *ZEROS)
    inplace = str(add.target).endswith("_")
    if inplace:
        expect(fresh, f"{add.name} adds in place into {base.name}, not a fresh zeros")
        order = {n: i for i, n in enumerate(add.graph.nodes)}
        early = [u for u in base.users if u is not add and order[u] < order[add]]
        expect(not early, f"the accumulator {base.name} is read before the add (by {early[0].name if early else ''})")
        walk.mark(base)
        return add, None, base
    if fresh and len(base.users) == 1:
        walk.mark(base)
        return add, None, None
    expect(dtype_of(base) == dtype_of(add), "the combine's base and result differ in dtype")
    return add, base, None
