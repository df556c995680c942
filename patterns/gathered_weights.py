"""Experts whose weights are gathered per token by the top-k ids: gpt-fast's Mixtral
(`ConditionalFeedForward`), torchao's MoE examples and the code bases that copied them.

Eager code it matches, shapes (T tokens, d hidden, n expert width, E experts, K top-k):

    w, ids = torch.topk(scores, K, dim=-1)                         # [T, K]
    g = torch.einsum("ti,taoi->tao", x, W1[ids])                    # W1 [E, n, d]: W1[ids] is [T, K, n, d]
    u = torch.einsum("ti,taoi->tao", x, W3[ids])                    # (or one W13 [E, 2n, d], chunked)
    y = torch.einsum("tao,taio->tai", act(g) * u, W2[ids])          # W2 [E, d, n]; y [T, K, d]
    out = torch.einsum("tai,ta->ti", y, w)                          # or (y * w.unsqueeze(-1)).sum(1)

any einsum letters, either operand order, and the weights in either orientation ([E, out, in] as
above, or [E, in, out]: "ti,taio->tao"). Every (t, k) pair is expert ids[t, k] on x[t], so
`out[t] = sum_k w[t, k] * expert_{ids[t, k]}(x[t])`: the op's contract. The gathers copy
T K (2n d + n d) weight elements a step (at T = 4096, K = 2 a layer of Mixtral's size gathers ~2.9 TB in bf16);
the op reads each expert's weights in place.

It becomes `sonic::moe_experts` for gate and up in one parameter (or a non-gated expert), and
`sonic::moe_experts_list` on the per-expert views `W[e]` when they are two parameters (as
`expert_loop` does for stacked slices). Checked, not guessed: the ids are a top-k's [T, K]
indices over the E experts the weights hold; every projection gathers with those ids; the up
projections read one [T, d] x; the activation is probed (`activation_probe`); the down projection
reads the activation and nothing else; the combine sums each token's K rows scaled by [T, K]
weights. Other spellings on gathered weights (matmul, bmm of 4-D gathers) are left alone with
that reason.
"""
from __future__ import annotations

import operator
import re

import torch.fx as fx

from .activation_probe import identify_activation, identify_pair_activation
from .common import (
    MoEMatch,
    NoMatch,
    RegionWalk,
    Rejection,
    backward_slice,
    expect,
    finish_match,
    getitem_of,
    is_call,
    module_path,
    same_size,
    shape_of,
)
from .dense_experts import sums_dim
from .module_list import topk_routing
from .repeat_loop import _broadcast_weights

IDIOM = "gathered_weights"


def find(gm: fx.GraphModule) -> list[MoEMatch | Rejection]:
    """Candidates: the up projections, einsums of a [T, d] x with `W[ids]` ([E, ., .] weights
    gathered by [T, K] integer ids), grouped by (ids, x); any other reader of such a gather in a
    group of its own is a rejection, so `explain` shows it."""
    groups: dict[tuple[fx.Node, fx.Node], list[fx.Node]] = {}
    others: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if not _is_weight_gather(node):
            continue
        for user in node.users:
            parts = _einsum_parts(user) if is_call(user, "einsum") else None
            if parts is None:
                others.setdefault(node.args[1], user)
                continue
            rows = parts[1][1 - parts[1].index(node)] if node in parts[1] else None
            if isinstance(rows, fx.Node) and len(shape_of(rows)) == 2:
                groups.setdefault((node.args[1], rows), []).append(user)
    results: list[MoEMatch | Rejection] = []
    for (ids, x), ups in groups.items():
        try:
            results.append(_check(ids, x, ups))
        except NoMatch as exc:
            results.append(Rejection(IDIOM, module_path(ups[0]), str(exc)))
    seen_ids = {ids for ids, _ in groups}
    for ids, user in others.items():
        if ids not in seen_ids:
            results.append(Rejection(IDIOM, module_path(user), f"expert weights gathered by top-k ids are read by "
                                     f"{user.name}, not by an einsum with the hidden states"))
    return results


def _is_weight_gather(node: fx.Node) -> bool:
    """`W[ids]`: a 3-D tensor indexed along its first dim by a top-k's [T, K] indices (an index of
    another origin, a position table's say, is no expert choice)."""
    if not (node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2):
        return False
    table, index = node.args
    if not (isinstance(table, fx.Node) and isinstance(index, fx.Node)):
        return False
    return len(shape_of(table)) == 3 and len(shape_of(index)) == 2 and is_call(getitem_of(index, 1), "topk")


def _einsum_parts(node: fx.Node) -> tuple[list[str], list, str] | None:
    """(input specs, operands, output spec) of a two-operand einsum with an explicit output, or None."""
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or len(operands) != 2 or node.kwargs:
        return None
    spec = re.fullmatch(r"([a-zA-Z]+),([a-zA-Z]+)->([a-zA-Z]*)", equation.replace(" ", ""))
    if spec is None:
        return None
    ins, out = [spec.group(1), spec.group(2)], spec.group(3)
    if any(len(set(s)) != len(s) for s in (*ins, out)):
        return None  # a repeated letter (a diagonal) is not a product of these shapes
    return ins, operands, out


def _projection(einsum: fx.Node, ids: fx.Node, rows_rank: int, what: str) -> tuple[fx.Node, fx.Node, bool]:
    """(the gather W[ids], rows, transposed) of `einsum(rows, W[ids])` computing out[t, k, o] = sum_i rows[t, (k,) i] *
    W[ids[t, k]][o, i] (transposed: W[.][i, o]); rows is [T, d] (rows_rank 2) or [T, K, n] (3)."""
    parts = _einsum_parts(einsum)
    expect(parts is not None, f"{what} projection {einsum.name} is not a two-operand einsum with an explicit output")
    ins, operands, out = parts
    gathers = [i for i, op in enumerate(operands) if isinstance(op, fx.Node) and _is_weight_gather(op) and op.args[1] is ids]
    expect(len(gathers) == 1, f"{what} projection {einsum.name} does not read one weight gathered by the top-k ids")
    wi = gathers[0]
    w_spec, r_spec, rows = ins[wi], ins[1 - wi], operands[1 - wi]
    expect(len(w_spec) == 4 and len(out) == 3, f"{what} projection einsum {einsum.args[0]!r} is not [T, K, out] from [T, K, ., .] weights")
    t, k, p, q = w_spec
    o = out[2]
    expect(out[:2] == t + k and o in (p, q), f"{what} projection einsum {einsum.args[0]!r} does not keep (token, k, out)")
    i = q if o == p else p
    want = t + i if rows_rank == 2 else t + k + i
    expect(r_spec == want and len(shape_of(rows)) == rows_rank,
           f"{what} projection einsum {einsum.args[0]!r} does not contract the rows' last dim with the weights' other")
    return operands[wi], rows, o == q


def _check(ids: fx.Node, x: fx.Node, ups: list[fx.Node]) -> MoEMatch:
    walk = RegionWalk()
    E, K = topk_routing(ids, walk)
    expect(len(shape_of(x)) == 2, "hidden states are not [T, d]")
    T, d = shape_of(x)
    expect(same_size(T, shape_of(ids)[0]), "hidden states are not [T, d] for the routed T")
    expect(len(ups) in (1, 2), f"{len(ups)} projections of the hidden states on gathered weights, not one or two")
    projections = [_projection(up, ids, 2, "up") for up in ups]
    expect(all(rows is x for _, rows, _ in projections), "the up projections read different rows")
    transposed = {p[2] for p in projections}
    expect(len(transposed) == 1, "gate and up are gathered in two orientations")
    (transposed,) = transposed

    down = _down_projection(ups, ids)
    down_gather, a, down_transposed = _projection(down, ids, 3, "down")
    expect(down_transposed == transposed, "the up and down weights are gathered in two orientations")
    for einsum, gather in zip((*ups, down), (*(p[0] for p in projections), down_gather)):
        expect(len(gather.users) == 1, f"the gathered weight {gather.name} is read more than once")
        walk.mark(einsum, gather)
    if len(ups) == 1:
        act = identify_activation(ups[0], a)
        expect(not isinstance(act, str), str(act))
        w1, w_up = projections[0][0].args[0], None
        walk.mark(*backward_slice([a], stop={ups[0]}))
    else:
        found = identify_pair_activation(ups[0], ups[1], a)
        expect(not isinstance(found, str), str(found))
        act, swapped = found
        gate, up = (projections[1], projections[0]) if swapped else (projections[0], projections[1])
        w1, w_up = gate[0].args[0], up[0].args[0]
        expect(not transposed, f"gate and up are two stacked parameters ({w1.name}, {w_up.name}) in [E, in, out]: "
               f"the list op takes [out, in] slices; keep gate and up in one [E, d, 2n] parameter, or store them as [E, n, d]")
        walk.mark(*backward_slice([a], stop=set(ups)))
    anchor, weights = _combine(down, T, K, d, walk)
    expect(shape_of(weights) == shape_of(ids), "top-k weights and ids differ in shape")
    expect(shape_of(w1)[0] == E, f"the weights hold {shape_of(w1)[0]} experts, the router ranks E={E}")
    return finish_match(IDIOM, ups[0], walk, anchor, x, ids, weights, w1, down_gather.args[0], None, None, transposed, act,
                        E=E, K=K, T=T, d=d, w_up=w_up)


def _down_projection(ups: list[fx.Node], ids: fx.Node) -> fx.Node:
    """The down einsum: the first einsum on weights gathered by the same ids that reads
    what the up projections compute."""
    reached = set(ups)
    graph = ups[0].graph
    for node in graph.nodes:
        if node in reached or any(inp in reached for inp in node.all_input_nodes):
            reached.add(node)
            if node not in ups and is_call(node, "einsum"):
                parts = _einsum_parts(node)
                if parts and any(isinstance(op, fx.Node) and _is_weight_gather(op) and op.args[1] is ids for op in parts[1]):
                    return node
    raise NoMatch("no down projection on weights gathered by the same ids reads the up projections")


def _combine(y: fx.Node, T, K: int, d, walk: RegionWalk) -> tuple[fx.Node, fx.Node]:
    """(the [T, d] anchor, the [T, K] weights) of `einsum("tkd,tk->td", y, w)` (any letters, either
    order) or `(y * w.unsqueeze(-1)).sum(1)` (w[..., None], w.view(T, K, 1); casts allowed)."""
    shape = shape_of(y)
    expect(len(shape) == 3 and same_size(shape[0], T) and shape[1] == K and same_size(shape[2], d),
           f"the expert outputs are {shape}, not [T, K={K}, d]")
    reader = walk.forward(y)
    user = walk.only_reader(reader)
    expect(user is not None, f"the expert outputs {y.name} are read more than once, not only by the combine")
    if is_call(user, "einsum"):
        parts = _einsum_parts(user)
        expect(parts is not None and reader in parts[1], f"the combine einsum {user.name} is not a two-operand product")
        ins, operands, out = parts
        yi = parts[1].index(reader)
        t, k, j = ins[yi] if len(ins[yi]) == 3 else ("", "", "")
        ok = len({t, k, j}) == 3 and ins[1 - yi] == t + k and out == t + j
        expect(ok, f"the combine einsum {user.args[0]!r} is not sum_k y[t, k, d] * w[t, k]")
        walk.mark(user)
        return user, operands[1 - yi]  # as the combine reads it, casts included: the op's input
    expect(is_call(user, "mul", "__mul__") and len(user.args) == 2 and not user.kwargs,
           "the expert outputs are not scaled by the routing weights")
    weights = _broadcast_weights(user.args[1] if user.args[0] is reader else user.args[0], walk)
    expect(weights is not None and len(shape_of(weights)) == 2,
           "the expert outputs are not scaled by [T, K] weights broadcast over d")
    total = walk.only_reader(user)
    expect(is_call(total, "sum") and sums_dim(total, (1, -2)) and len(total.args) <= 3 and set(total.kwargs) <= {"dim", "keepdim"},
           "the scaled expert outputs are not summed over each token's K experts")
    walk.mark(user, total)
    return total, weights
