"""transformers' default experts path (`experts_implementation="grouped_mm"`), transformers >= 5.17.

Eager code it matches (transformers/integrations/moe.py, `grouped_mm_experts_forward`), shapes:

    sample_weights = top_k_weights.reshape(-1)                    # [TK]
    expert_ids = top_k_index.reshape(-1)                          # [TK]
    expert_ids_g, perm = torch.sort(expert_ids)                   # [TK], [TK]
    x_g = hidden_states[perm // K]                                # [TK, d]
    w_g = sample_weights[perm]                                    # [TK]
    counts = torch.histc(expert_ids_g.float(), bins=E, min=0, max=E - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)      # [E]
    h = grouped_mm(x_g, gate_up_proj.transpose(-2, -1), offs=offsets)   # [TK, 2n]
    a = act_fn(gate) * up   (gate, up = h.chunk(2, -1))           # [TK, n]
    y = grouped_mm(a, down_proj.transpose(-2, -1), offs=offsets)  # [TK, d]
    weighted = y * w_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm); inv_perm[perm] = torch.arange(TK)
    out = weighted[inv_perm].view(T, K, d).sum(dim=1)             # [T, d]

The weights may also come after the unsort, per slot of the un-sorted, unweighted rows:
`out = torch.einsum("tkd,tk->td", y[inv_perm].view(T, K, d), top_k_weights)` (or the scaled sum
over K), the same sum.

`grouped_mm` is `torch._grouped_mm` / `F.grouped_mm` (bf16 under compile) or the opaque
`transformers::grouped_mm_fallback` (fp32/fp16). transformers 5.17 also inserts expert-parallel
sentinel nodes (`expert_ids_g >= E` masks, `clamp_`, `masked_fill(_)`; transformers >= 5.20 under
an expert-parallel plan only). With ids from a top-k over the E experts they change nothing and are
absorbed into the region. Where the ids come from elsewhere (an expert-parallel plan writes E, the
sentinel, for the experts of other ranks) and the down projection's rows pass through such a mask,
a slot with id >= E adds nothing: the match's `sentinels` is "drop" and the op runs in the slot form
with those slots as padding (no rows computed for them).

It becomes:

    out = moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                      activation=<probed>, interleaved=<probed>, transposed=<layout>)

The router glue that produced top_k_index/top_k_weights stays in the graph for Inductor.
"""
from __future__ import annotations

from collections import defaultdict

import torch.fx as fx

from .activation_probe import identify_activation
from .common import (
    MoEMatch,
    NoMatch,
    RegionWalk,
    Rejection,
    arg,
    backward_slice,
    check_inverse_permutation,
    dtype_of,
    expect,
    expert_bias,
    finish_match,
    getitem_of,
    is_call,
    is_getitem,
    module_path,
    same_size,
    scaled_by_routing_weights,
    shape_of,
    summed_per_token,
    users_getitem,
)
from .gathered_weights import weighted_sum_over_slots
from .module_list import ranked_over

IDIOM = "hf_grouped_mm"
GROUPED_MM = ("_grouped_mm", "grouped_mm", "transformers::grouped_mm_fallback")
SCATTERS = ("scatter_add", "scatter_add_", "index_add", "index_add_")  # sorted_grouped_mm's combines


def grouped_calls(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """The graph's grouped_mm calls, by the offsets they share (one MoE layer each)."""
    calls: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if is_call(node, *GROUPED_MM):
            calls[arg(node, 2, "offs")].append(node)
    return calls


def looks_scattered(calls: list[fx.Node]) -> bool:
    """The layer's rows go back to their tokens by a scatter/index add (`sorted_grouped_mm`), not by
    transformers' inverse permutation (this idiom): a scatter_add/index_add within a few
    nodes after the last grouped_mm."""
    frontier, seen = [calls[-1]], set()
    for _ in range(6):
        frontier = [u for node in frontier for u in node.users if u not in seen]
        seen.update(frontier)
        if any(is_call(u, *SCATTERS) for u in frontier):
            return True
    return False


def find(gm: fx.GraphModule) -> list[MoEMatch | Rejection]:
    results = []
    for offs, calls in grouped_calls(gm).items():
        if looks_scattered(calls) or len(calls) == 3:
            continue  # sorted_grouped_mm's (a scatter-add back to the tokens; separate gate and up projections)
        module = module_path(calls[0])
        try:
            results.append(_check(offs, calls))
        except NoMatch as exc:
            results.append(_as_sorted_grouped_mm(offs, calls, module, exc))
    return results


def _as_sorted_grouped_mm(offs: fx.Node, calls: list[fx.Node], module: str, why: NoMatch) -> MoEMatch | Rejection:
    """transformers' layout (one fused gate_up, rows un-sorted back) in another spelling of the
    routing, which this finder's checks refuse: the counts of the unsorted ids (`histc(max=E)`,
    `bincount`, a mask's column sums), rows by `gather` or `index_select` (torchtitan's). Those are
    `sorted_grouped_mm`'s checks, which take it; where they refuse it too, both reasons are given
    (one, where they are the same). Ids not from a top-k over the experts in the graph (an
    expert-parallel plan's remapped ids, whose sentinels only these checks read) are refused there."""
    from . import sorted_grouped_mm

    try:
        return sorted_grouped_mm.check(offs, calls)
    except NoMatch as other:
        same = str(other) == str(why)
        return Rejection(IDIOM, module, str(why) if same else f"{why} (as {sorted_grouped_mm.IDIOM}: {other})")


def _weight_of(node, walk: RegionWalk) -> tuple[fx.Node, bool]:
    """(expert weight, stored transposed?) from grouped_mm's second argument."""
    if is_call(node, "transpose") and sorted(int(a) % 3 for a in node.args[1:3]) == [1, 2]:
        walk.mark(node)
        return node.args[0], False
    if is_call(node, "mT"):
        walk.mark(node)
        return node.args[0], False
    return node, True


def unsorted_first(y: fx.Node) -> bool:
    """The expert rows' one reader un-sorts them (`y[inv]`, inv an `empty_like` filled by a scatter)."""
    readers = list(y.users)
    return len(readers) == 1 and is_getitem(readers[0]) and readers[0].args[0] is y and is_call(readers[0].args[1], "empty_like")


def weighted_after_unsort(y: fx.Node, perm: fx.Node, T, K: int, d, walk: RegionWalk) -> tuple[fx.Node, fx.Node]:
    """(anchor, [T, K] weights) of `einsum("tkd,tk->td", y[inv].view(T, K, d), w)` or
    `(y[inv].view(T, K, d) * w.unsqueeze(-1)).sum(1)`: slot t*K + k reads its row back, scaled by
    w[t, k], summed per token; the same sum as weighting the sorted rows first."""
    (unsort,) = y.users
    check_inverse_permutation(unsort, perm, walk)
    view = walk.only_reader(unsort)
    shape = shape_of(view) if view is not None else ()
    expect(is_call(view, "view", "reshape") and len(shape) == 3 and same_size(shape[0], T) and shape[1] == K,
           "un-sorted rows are not viewed as [T, K, d]")
    walk.mark(view)
    anchor, weights = weighted_sum_over_slots(view, T, K, d, walk)
    expect(shape_of(weights) == (T, K), "top-k weights are not [T, K]")
    return anchor, weights


def _check(offs: fx.Node, calls: list[fx.Node]) -> MoEMatch:
    expect(len(calls) == 2, f"expected an up and a down grouped_mm sharing offsets, found {len(calls)}")
    up, down = calls
    walk = RegionWalk()
    walk.mark(up, down)

    # offsets = cumsum(histc(expert_ids_g, bins=E, min=0, max=E-1), dtype=int32)
    expect(is_call(offs, "cumsum"), "grouped_mm offsets are not a cumsum of per-expert counts")
    hist = offs.args[0]
    expect(is_call(hist, "histc", "bincount"), "per-expert counts are not a histc/bincount")
    walk.mark(offs, hist)
    if is_call(hist, "histc"):
        E = arg(hist, 1, "bins")
        lo, hi = arg(hist, 2, "min", 0), arg(hist, 3, "max", 0)
        expect(isinstance(E, int) and lo == 0 and hi == E - 1, f"histc range ({lo}, {hi}) is not [0, bins-1]")
    else:
        E = arg(hist, 2, "minlength")
    counted = hist.args[0]
    while is_call(counted, "float", "int", "long", "to"):
        walk.mark(counted)
        counted = counted.args[0]
    sort = getitem_of(counted, 0)
    expect(sort is not None and is_call(sort, "sort"), "counted ids are not the values of a sort")
    expect(not arg(sort, 2, "descending", False), "expert ids sorted in descending order")
    walk.num_experts, walk.sorted_ids = E, counted
    perm = users_getitem(sort, 1)
    expect(perm is not None, "the sort's permutation is unused")
    flat_ids = sort.args[0]
    expect(is_call(flat_ids, "reshape", "view", "flatten"), "sorted ids are not the flattened top-k ids")
    topk_ids = flat_ids.args[0]
    expect(len(shape_of(topk_ids)) == 2, "top-k ids are not [T, K]")
    T, K = shape_of(topk_ids)
    expect(not dtype_of(topk_ids).is_floating_point, "expert ids are not integers")
    walk.mark(counted, sort, perm, flat_ids)

    # x_g = x[perm // K]
    gathered = walk.through(up.args[0])
    expect(is_getitem(gathered), "up-projection input is not a row gather")
    x, index = gathered.args
    expect(
        is_call(index, "floordiv") and index.args[0] is perm and index.args[1] == K,
        "up-projection rows are not gathered by perm // K",
    )
    walk.mark(gathered, index)
    expect(len(shape_of(x)) == 2 and same_size(shape_of(x)[0], T), "gathered hidden states are not [T, d]")
    d = shape_of(x)[1]

    # weights: W1 [E, 2n, d] via transpose (HF) or [E, d, 2n] as is (transposed layout)
    w1, transposed = _weight_of(up.args[1], walk)
    w2, transposed2 = _weight_of(down.args[1], walk)
    expect(transposed == transposed2, "up and down weights use different layouts")
    expect(arg(up, 3, "bias") is None and arg(down, 3, "bias") is None, "grouped_mm with bias is not matched")
    b1, b2 = (expert_bias(mm, walk.sorted_ids, walk) for mm in (up, down))

    # activation between the two grouped mms
    h = walk.forward(up)
    a = walk.through(down.args[0])
    act = identify_activation(h, a)
    expect(not isinstance(act, str), str(act))
    walk.mark(*backward_slice([a], stop={h}))

    y = walk.forward(down)
    if unsorted_first(y):  # the rows un-sorted, then their [T, K, d] weighted and summed over K
        anchor, topk_weights = weighted_after_unsort(y, perm, T, K, d, walk)
    else:
        # weighted = y * w_g[:, None];  w_g = topk_weights.reshape(-1)[perm]
        mul, topk_weights = scaled_by_routing_weights(y, walk, topk_ids, perm)

        # unsorted = weighted[inv_perm];  inv_perm[perm] = arange(TK)
        weighted = walk.forward(mul)
        unsort = walk.only_reader(weighted)
        expect(is_getitem(unsort), "weighted rows are not un-permuted")
        check_inverse_permutation(unsort, perm, walk)

        # out = unsorted.view(T, K, d).sum(1)
        anchor = summed_per_token(unsort, walk, T, K)
    match = finish_match(
        IDIOM, up, walk, anchor, x, topk_ids, topk_weights, w1, w2, b1, b2, transposed, act, E=E, K=K, T=T, d=d
    )
    if walk.masks_sentinel_rows(down) and not ranked_over(topk_ids, E):
        match.sentinels = "drop"  # expert parallelism: the region zeroes the rows of ids >= E, the op drops them
    return match
