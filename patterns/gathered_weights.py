"""Experts whose weights are gathered per token by the top-k ids: gpt-fast's Mixtral
(`ConditionalFeedForward`), gpt-oss's reference `MLPBlock`, torchao's MoE examples and the code
bases that copied them.

Eager code it matches, shapes (T tokens, d hidden, n expert width, E experts, K top-k):

    w, ids = torch.topk(scores, K, dim=-1)                         # [T, K]
    g = torch.einsum("ti,taoi->tao", x, W1[ids])                    # W1 [E, n, d]: W1[ids] is [T, K, n, d]
    u = torch.einsum("ti,taoi->tao", x, W3[ids])                    # (or one W13 [E, 2n, d], chunked)
    y = torch.einsum("tao,taio->tai", act(g) * u, W2[ids])          # W2 [E, d, n]; y [T, K, d]
    out = torch.einsum("tai,ta->ti", y, w)                          # or (y * w.unsqueeze(-1)).sum(1)

any einsum letters, either operand order, the tokens also as two leading dims that are never
flattened (x [B, S, d], ids [B, S, K]: "bsd,bskod->bsko"; `MoEMatch.token_dims`), and the weights in either orientation ([E, out, in] as
above, or [E, in, out]: "ti,taio->tao"), with stacked biases gathered the same way and added to
a projection's output (`einsum(...) + B1[ids, ...]`, `y += B2[ids, ...]`: gpt-oss). Every (t, k)
pair is expert ids[t, k] on x[t], so `out[t] = sum_k w[t, k] * expert_{ids[t, k]}(x[t])`: the op's
contract. The gathers copy T K (2n d + n d) weight elements a step (at T = 4096, K = 2 a layer of
Mixtral's size gathers ~2.9 TB in bf16); the op reads each expert's weights in place.

It becomes `sonic::moe_experts` for gate and up in one parameter (or a non-gated expert), and
`sonic::moe_experts_list` on the per-expert views `W[e]` when they are two parameters (as
`expert_loop` does for stacked slices). Checked, not guessed: the ids are a top-k's [T, K]
indices over the E experts the weights hold; every projection gathers with those ids; the up
projections read one [T, d] x; the activation is probed (`activation_probe`); the down projection
reads the activation and nothing else; the combine sums each token's K rows scaled by [T, K]
weights. Matmul and bmm spellings of these products (`x[:, None, None, :] @ W[ids]`, bmm over
`W[ids.reshape(-1)]`) reach this finder as einsums (`canonical_products.gathered_product_to_einsum`);
other readers of a gathered weight are left alone with that reason.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch.fx as fx

from .activation_probe import identify_activation, identify_pair_activation
from .common import (
    MoEMatch,
    NoMatch,
    RegionWalk,
    Rejection,
    arg,
    backward_slice,
    einsum_parts,
    expect,
    finish_match,
    getitem_of,
    is_call,
    is_getitem,
    module_path,
    same_size,
    shape_of,
    table_index,
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
        ids = _gather_ids(node)
        halves = _halves(node)
        for operand in (halves[2] if halves else [node]):
            for user in operand.users:
                parts = einsum_parts(user) if is_call(user, "einsum") else None
                if parts is None:
                    others.setdefault(ids, user)
                    continue
                rows = parts[1][1 - parts[1].index(operand)] if operand in parts[1] else None
                if isinstance(rows, fx.Node) and len(shape_of(rows)) == len(shape_of(ids)):  # [T, d] (or [B, S, d])
                    groups.setdefault((ids, rows), []).append(user)
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


def _gather_index(node: fx.Node, rank: int) -> fx.Node | None:
    """The [T, K] (or [B, S, K]) index of `table[index]` (`common.table_index`) on a rank-`rank`
    table, else None."""
    found = table_index(node)
    if found is None:
        return None
    table, index = found
    return index if len(shape_of(table)) == rank and len(shape_of(index)) >= 2 else None


def _gather_ids(node: fx.Node, rank: int = 3) -> fx.Node | None:
    """The ids of `table[ids]` (`_gather_index`) when they are a top-k's indices (an index of
    another origin, a position table's say, is no expert choice); else None."""
    index = _gather_index(node, rank)
    return index if index is not None and is_call(getitem_of(index, 1), "topk") else None


def _is_weight_gather(node: fx.Node) -> bool:
    """`W[ids]`: stacked [E, ., .] weights gathered by a top-k's ids (`_gather_ids`)."""
    return _gather_ids(node) is not None


def _halves(gather: fx.Node) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """(the split, its dim (non-negative), [half 0, half 1]) when the gather's one reader cuts it in two
    equal halves, `W13[ids].chunk(2, dim)`, `.split(m, dim)` or `.split([m, m], dim)` (SGLang's and
    vLLM's native MoE fallback: gate and up in one parameter, gathered then cut), each half read;
    else None."""
    if len(gather.users) != 1:
        return None
    (cut,) = gather.users
    if is_call(cut, "chunk"):
        ok, dim = arg(cut, 1, "chunks") == 2, arg(cut, 2, "dim", 0)
    elif is_call(cut, "split"):
        dim = arg(cut, 2, "dim", 0)
        size = arg(cut, 1, "split_size_or_sections", arg(cut, 1, "split_size"))
        half, odd = divmod(shape_of(gather)[dim], 2) if isinstance(dim, int) else (None, 1)
        ok = not odd and (size == half or (isinstance(size, (list, tuple)) and list(size) == [half, half]))
    else:
        return None
    parts = {u.args[1]: u for u in cut.users if is_getitem(u)}
    if not (ok and isinstance(dim, int) and len(cut.users) == 2 and set(parts) == {0, 1}):
        return None
    return cut, dim % len(shape_of(gather)), [parts[0], parts[1]]


def _weight_operand(op, ids: fx.Node) -> tuple[fx.Node, int | None] | None:
    """(the gather W[ids], None) for W[ids] itself, (the gather, 0 or 1) for a half of it
    (`_halves`), else None."""
    if not isinstance(op, fx.Node):
        return None
    if _gather_ids(op) is ids:
        return op, None
    cut = op.args[0] if is_getitem(op) else None
    gather = cut.args[0] if isinstance(cut, fx.Node) and cut.args else None
    if isinstance(gather, fx.Node) and _gather_ids(gather) is ids and (halves := _halves(gather)) and op in halves[2]:
        return gather, halves[2].index(op)
    return None


def _biased(out: fx.Node, ids: fx.Node, walk: RegionWalk) -> tuple[fx.Node, fx.Node | None]:
    """(the projection's value, its [E, width] bias or None): `out + B[ids]` (either order, `+=`
    too: gpt-oss's reference code) when that add is the projection's one reader and the gathered
    bias is read by it alone; else (out, None)."""
    if len(out.users) != 1:
        return out, None
    (user,) = out.users
    if not (is_call(user, "add", "iadd", "__add__") and len(user.args) == 2 and not user.kwargs):
        return out, None
    other = user.args[1] if user.args[0] is out else user.args[0]
    index = _gather_index(other, rank=2) if isinstance(other, fx.Node) else None
    if index is None:
        return out, None
    expect(index is ids, f"the bias {other.name} added to {out.name} is not gathered by the top-k ids")
    expect(len(other.users) == 1, f"the gathered bias {other.name} is read more than once")
    walk.mark(user, other)
    return user, other.args[0]


class Projection(NamedTuple):
    gather: fx.Node  # W[ids]
    half: int | None  # which half of W[ids] the einsum reads (`_halves`), None: all of it
    rows: fx.Node
    transposed: bool  # W [E, in, out]


def _projection(einsum: fx.Node, ids: fx.Node, per_slot: bool, what: str) -> Projection:
    """`einsum(rows, W[ids])` computing out[t, k, o] = sum_i rows[t, (k,) i] * W[ids[t, k]][o, i]
    (transposed: W[.][i, o]), on W[ids] or a half of it cut along o; rows is [T, d] or, `per_slot`,
    [T, K, n]. The tokens may take two or more leading dims, as the ids do ([B, S, K]: "bsd,bskod->bsko")."""
    parts = einsum_parts(einsum)
    expect(parts is not None, f"{what} projection {einsum.name} is not a two-operand einsum with an explicit output")
    ins, operands, out = parts
    found = [_weight_operand(op, ids) for op in operands]
    gathers = [i for i, f in enumerate(found) if f is not None]
    expect(len(gathers) == 1, f"{what} projection {einsum.name} does not read one weight gathered by the top-k ids")
    wi = gathers[0]
    gather, half = found[wi]
    w_spec, r_spec, rows = ins[wi], ins[1 - wi], operands[1 - wi]
    lead = len(shape_of(ids)) - 1  # the tokens' dims
    expect(len(w_spec) == lead + 3 and len(out) == lead + 2,
           f"{what} projection einsum {einsum.args[0]!r} is not [T, K, out] from [T, K, ., .] weights")
    t, k, p, q = w_spec[:lead], w_spec[lead], w_spec[lead + 1], w_spec[lead + 2]
    o = out[-1]
    expect(out[:-1] == t + k and o in (p, q), f"{what} projection einsum {einsum.args[0]!r} does not keep (token, k, out)")
    i = q if o == p else p
    want = t + k + i if per_slot else t + i
    expect(r_spec == want and len(shape_of(rows)) == len(want),
           f"{what} projection einsum {einsum.args[0]!r} does not contract the rows' last dim with the weights' other")
    expect(half is None or _halves(gather)[1] == w_spec.index(o),
           f"{what} projection {einsum.name} reads a half of {gather.name} cut along its input dim, not its output dim")
    return Projection(gather, half, rows, o == q)


def _check(ids: fx.Node, x: fx.Node, ups: list[fx.Node]) -> MoEMatch:
    walk = RegionWalk()
    lead = shape_of(ids)[:-1]  # the tokens' dims: [T], or [B, S] in code that never flattens them
    E, K = topk_routing(ids, walk, token_dims=len(lead))
    expect(len(shape_of(x)) == len(lead) + 1, "hidden states are not [T, d]")
    d = shape_of(x)[-1]
    expect(all(same_size(a, b) for a, b in zip(shape_of(x), lead)), "hidden states are not [T, d] for the routed T")
    T = math.prod(lead)
    expect(len(ups) in (1, 2), f"{len(ups)} projections of the hidden states on gathered weights, not one or two")
    projections = [_projection(up, ids, False, "up") for up in ups]
    expect(all(p.rows is x for p in projections), "the up projections read different rows")
    transposed = {p.transposed for p in projections}
    expect(len(transposed) == 1, "gate and up are gathered in two orientations")
    (transposed,) = transposed
    cut = {p.gather for p in projections if p.half is not None}
    expect(not cut or (len(ups) == 2 and {p.half for p in projections} == {0, 1} and len(cut) == 1),
           "an up projection reads a half of its gathered weights, but gate and up are not its two halves")

    down = _down_projection(ups, ids)
    down_p = _projection(down, ids, True, "down")
    a = down_p.rows
    expect(down_p.transposed == transposed, "the up and down weights are gathered in two orientations")
    expect(down_p.half is None, f"the down projection reads a half of {down_p.gather.name}")
    for einsum, gather in zip((*ups, down), (*(p.gather for p in projections), down_p.gather)):
        expect(len(gather.users) == 1, f"the gathered weight {gather.name} is read more than once")
        walk.mark(einsum, gather)
    for gather in cut:
        split, _, halves = _halves(gather)
        expect(all(len(half.users) == 1 for half in halves), f"a half of the gathered weight {gather.name} is read twice")
        walk.mark(split, *halves)
    if len(ups) == 1:
        h, b1 = _biased(ups[0], ids, walk)
        act = identify_activation(h, a)
        expect(not isinstance(act, str), str(act))
        w1, w_up = projections[0].gather.args[0], None
        walk.mark(*backward_slice([a], stop={h}))
    else:
        b1 = None
        expect(all(_biased(up, ids, RegionWalk())[1] is None for up in ups),
               "biases on separate stacked gate and up parameters are not supported")
        found = identify_pair_activation(ups[0], ups[1], a)
        expect(not isinstance(found, str), str(found))
        act, swapped = found
        gate, up = (projections[1], projections[0]) if swapped else (projections[0], projections[1])
        if cut:  # W13[ids] cut in two: one [E, 2n, d] parameter, gate first
            expect(gate.half == 0, f"the gate is the second half of {gate.gather.args[0].name}: "
                   "[up | gate] in one parameter is not a layout the op takes")
            w1, w_up = gate.gather.args[0], None
        else:
            w1, w_up = gate.gather.args[0], up.gather.args[0]
        walk.mark(*backward_slice([a], stop=set(ups)))
    y, b2 = _biased(down, ids, walk)
    anchor, weights = weighted_sum_over_slots(y, lead, K, d, walk)
    expect(shape_of(weights) == shape_of(ids), "top-k weights and ids differ in shape")
    expect(shape_of(w1)[0] == E, f"the weights hold {shape_of(w1)[0]} experts, the router ranks E={E}")
    return finish_match(IDIOM, ups[0], walk, anchor, x, ids, weights, w1, down_p.gather.args[0], b1, b2, transposed, act,
                        E=E, K=K, T=T, d=d, w_up=w_up, token_dims=len(lead) > 1)


def _down_projection(ups: list[fx.Node], ids: fx.Node) -> fx.Node:
    """The down einsum: the first einsum on weights gathered by the same ids that reads
    what the up projections compute."""
    reached = set(ups)
    graph = ups[0].graph
    for node in graph.nodes:
        if node in reached or any(inp in reached for inp in node.all_input_nodes):
            reached.add(node)
            if node not in ups and is_call(node, "einsum"):
                parts = einsum_parts(node)
                if parts and any(_weight_operand(op, ids) is not None for op in parts[1]):
                    return node
    raise NoMatch("no down projection on weights gathered by the same ids reads the up projections")


def weighted_sum_over_slots(y: fx.Node, T, K: int, d, walk: RegionWalk) -> tuple[fx.Node, fx.Node]:
    """(the [T, d] anchor, the [T, K] weights) of `einsum("tkd,tk->td", y, w)` (any letters, either
    order) or `(y * w.unsqueeze(-1)).sum(1)` (w[..., None], w.view(T, K, 1); casts allowed). `T`: the
    token count, or a tuple of the tokens' dims ([B, S]: y [B, S, K, d], summed over dim 2)."""
    lead = tuple(T) if isinstance(T, tuple) else (T,)
    shape = shape_of(y)
    expect(len(shape) == len(lead) + 2 and all(same_size(a, b) for a, b in zip(shape, lead)) and shape[-2] == K
           and same_size(shape[-1], d), f"the expert outputs are {shape}, not [T, K={K}, d]")
    reader = walk.forward(y)
    user = walk.only_reader(reader)
    expect(user is not None, f"the expert outputs {y.name} are read more than once, not only by the combine")
    if is_call(user, "einsum"):
        parts = einsum_parts(user)
        expect(parts is not None and reader in parts[1], f"the combine einsum {user.name} is not a two-operand product")
        ins, operands, out = parts
        yi = parts[1].index(reader)
        spec = ins[yi]
        t, k, j = (spec[:-2], spec[-2], spec[-1]) if len(spec) == len(lead) + 2 else ("", "", "")
        ok = len(spec) == len(lead) + 2 and ins[1 - yi] == t + k and out == t + j
        expect(ok, f"the combine einsum {user.args[0]!r} is not sum_k y[t, k, d] * w[t, k]")
        walk.mark(user)
        return user, operands[1 - yi]  # as the combine reads it, casts included: the op's input
    expect(is_call(user, "mul", "__mul__") and len(user.args) == 2 and not user.kwargs,
           "the expert outputs are not scaled by the routing weights")
    weights = _broadcast_weights(user.args[1] if user.args[0] is reader else user.args[0], walk)
    expect(weights is not None and len(shape_of(weights)) == len(lead) + 1,
           "the expert outputs are not scaled by [T, K] weights broadcast over d")
    total = walk.only_reader(user)
    expect(is_call(total, "sum") and sums_dim(total, (len(lead), -2)) and len(total.args) <= 3
           and set(total.kwargs) <= {"dim", "keepdim"},
           "the scaled expert outputs are not summed over each token's K experts")
    walk.mark(user, total)
    return total, weights
