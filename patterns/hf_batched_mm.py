"""transformers' `batched_mm` experts path: what `generate()` decodes with on the GPU.

Eager code it matches (transformers/integrations/moe.py, `batched_mm_experts_forward`), shapes:

    x_r = hidden_states.repeat_interleave(K, dim=0)                   # [TK, d]
    w = top_k_weights.reshape(-1); ids = top_k_index.reshape(-1)      # [TK]
    W = gate_up_proj[ids]                                             # [TK, 2n, d]  (a weight copy per row)
    h = torch.bmm(W, x_r.unsqueeze(-1)).squeeze(-1)   (+ bias[ids])   # [TK, 2n]
        transposed layout: torch.bmm(x_r.unsqueeze(1), W).squeeze(1)
    a = act(h)                                                        # [TK, n]
    y = torch.bmm(down_proj[ids], a.unsqueeze(-1)).squeeze(-1)  (+ bias[ids])   # [TK, d]
    out = (y * w.unsqueeze(-1)).view(T, K, d).sum(dim=1)              # [T, d]

It becomes the same `moe_experts` call as the grouped_mm path (its small-T regime), which reads
each expert's weights in place instead of gathering a [TK, 2n, d] copy of them.
transformers clamps the ids used for the weight gather (`ids.clamp(0, E - 1)`, for
expert-parallel sentinels: always in 5.17, under an expert-parallel plan from 5.20); for ids from
a top-k over the E experts in the graph that is the identity and is absorbed into the region.
Otherwise (a plan writes E, the sentinel, for the experts of other ranks) the match says what the
region does with an id >= E (`sentinels`): transformers >= 5.20 also masks those slots' weights to
0 (`w.masked_fill(ids >= E, 0)`), so they add nothing ("drop": the op computes no row for them; an
expert returning inf or nan on a sentinel slot's clamped row gives nan there, the op 0); 5.17 does
not, so a sentinel slot runs expert E-1 with its own weight ("clamp": the op gets the clamped ids;
transformers' router has zeroed those weights beforehand).
"""
from __future__ import annotations


import torch.fx as fx

from .activation_probe import identify_activation
from .common import (
    MoEMatch,
    NoMatch,
    RegionWalk,
    Rejection,
    arg,
    backward_slice,
    expect,
    expert_bias,
    finish_match,
    is_call,
    is_getitem,
    module_path,
    same_size,
    scaled_by_routing_weights,
    shape_of,
    summed_per_token,
)
from .module_list import ranked_over

IDIOM = "hf_batched_mm"


def find(gm: fx.GraphModule) -> list[MoEMatch | Rejection]:
    """Candidates: a bmm whose one operand is `W[flat_ids]` with W a 3-D expert tensor, and whose
    other operand is the repeated hidden states (the up projection)."""
    results = []
    for node in gm.graph.nodes:
        if not is_call(node, "bmm"):
            continue
        operands = _bmm_operands(node)
        if operands is None:
            continue
        weights, other, _ = operands
        if not is_call(_unsqueezed(other), "repeat_interleave"):
            continue  # a down projection, or not ours; its up projection is the candidate
        try:
            results.append(_check(node))
        except NoMatch as exc:
            results.append(Rejection(IDIOM, module_path(node), str(exc)))
    return results


def _unsqueezed(node):
    return node.args[0] if is_call(node, "unsqueeze") else node


def _bmm_operands(bmm: fx.Node):
    """(gathered expert weight W[ids], the row operand, transposed?) or None."""
    lhs, rhs = bmm.args[0], bmm.args[1]
    for weights, other, transposed in ((lhs, rhs, False), (rhs, lhs, True)):
        if is_getitem(weights):
            table, index = weights.args
            if isinstance(table, fx.Node) and isinstance(index, fx.Node) and len(shape_of(table)) == 3:
                return weights, other, transposed
    return None


def _projection(bmm: fx.Node, walk: RegionWalk, gather_ids: fx.Node, transposed: bool, what: str):
    """For `bmm(W[ids], v.unsqueeze(-1)).squeeze(-1)` (or the transposed form): (W, v, output, bias)."""
    operands = _bmm_operands(bmm)
    expect(operands is not None, f"{what} projection is not a bmm with per-row expert weights")
    gathered, vec, is_transposed = operands
    expect(is_transposed == transposed, f"{what} projection uses a different weight layout")
    table, index = gathered.args
    expect(index is gather_ids, f"{what} projection gathers weights with other ids")
    unsq_dim, sq_dim = (1, 1) if transposed else (-1, -1)
    expect(is_call(vec, "unsqueeze") and vec.args[1] % 3 == unsq_dim % 3, f"{what} projection input is not unsqueezed")
    squeeze = walk.only_reader(bmm)
    expect(squeeze is not None and is_call(squeeze, "squeeze") and squeeze.args[1] % 3 == sq_dim % 3, f"{what} projection output is not squeezed")
    walk.mark(bmm, gathered, vec, squeeze)
    bias = expert_bias(squeeze, gather_ids, walk)
    return table, vec.args[0], squeeze, bias


def _check(up_bmm: fx.Node) -> MoEMatch:
    walk = RegionWalk()
    gathered, _, transposed = _bmm_operands(up_bmm)
    gather_ids = flat_ids = gathered.args[1]
    E = shape_of(gathered.args[0])[0]
    if is_call(flat_ids, "clamp"):  # transformers 5.17: ids.clamp(0, E - 1), the identity for valid ids
        lo, hi = arg(flat_ids, 1, "min"), arg(flat_ids, 2, "max")
        expect(lo in (0, None) and hi == E - 1, f"expert ids clamped to ({lo}, {hi}), not [0, E-1]")
        walk.mark(flat_ids)
        flat_ids = flat_ids.args[0]
    expect(is_call(flat_ids, "reshape", "view", "flatten"), "expert weights are not gathered by the flattened top-k ids")
    walk.sorted_ids, walk.num_experts = flat_ids, E  # sentinel masks test these ids against E
    topk_ids = flat_ids.args[0]
    expect(len(shape_of(topk_ids)) == 2, "top-k ids are not [T, K]")
    T, K = shape_of(topk_ids)
    walk.mark(flat_ids)

    w1, x_rep, h, b1 = _projection(up_bmm, walk, gather_ids, transposed, "up")
    expect(is_call(x_rep, "repeat_interleave") and x_rep.args[1] == K and arg(x_rep, 2, "dim") == 0, "rows are not the hidden states repeated K times")
    x = x_rep.args[0]
    expect(len(shape_of(x)) == 2 and same_size(shape_of(x)[0], T), "repeated hidden states are not [T, d]")
    d = shape_of(x)[1]
    walk.mark(x_rep)

    # the activation feeds the down projection: a.unsqueeze(...) is its vector operand
    h = walk.forward(h)
    downs = [
        n for n in up_bmm.graph.nodes
        if is_call(n, "bmm") and n is not up_bmm and (ops := _bmm_operands(n)) is not None and ops[0].args[1] is gather_ids
    ]
    expect(len(downs) == 1, f"expected one down-projection bmm on the same ids, found {len(downs)}")
    w2, a, y, b2 = _projection(downs[0], walk, gather_ids, transposed, "down")
    a = walk.through(a)
    act = identify_activation(h, a)
    expect(not isinstance(act, str), str(act))
    walk.mark(*backward_slice([a], stop={h}))

    clamped = gather_ids is not flat_ids and arg(gather_ids, 1, "min") == 0  # into [0, E-1], as the op takes it
    masked = set(walk.sentinel_masks)
    mul, topk_weights = scaled_by_routing_weights(walk.forward(y), walk, topk_ids)
    weights_masked = bool(walk.sentinel_masks - masked)  # w.masked_fill(ids >= E, 0) on the way to the product
    anchor = summed_per_token(walk.forward(mul), walk, T, K)
    match = finish_match(
        IDIOM, up_bmm, walk, anchor, x, topk_ids, topk_weights, w1, w2, b1, b2, transposed, act, E=E, K=K, T=T, d=d
    )
    if (weights_masked or clamped) and not ranked_over(topk_ids, E):  # expert parallelism's sentinels
        match.sentinels = "drop" if weights_masked else "clamp"
    return match
