"""What the two `nn.ModuleList` idioms (expert_loop, dense_experts) share.

Experts written as modules reach the graph as plain `F.linear` calls on each expert's own weight
placeholders. One expert, from the rows it reads to its output [rows, d]:

    separate gate/up  y = linear(act(linear(rows, W1)) * linear(rows, W3), W2)   W1, W3 [n, d]; W2 [d, n]
    fused gate/up     y = linear(act(chunk(linear(rows, W13))), W2)               W13 [2n, d] (either layout)
    non-gated         y = linear(act(linear(rows, W1)), W2)                       W1 [n, d]

The activation is probed, never read off op names (`activation_probe`), and every expert must
probe to the same one. The routing must be a top-k over the last dim of [T, E] scores: that is
what makes the ids distinct per token and in [0, E), which the rewrite relies on.

`finish_list_match` is `common.finish_match` for the list form: `sonic::moe_experts_list` gets
the weight placeholders as they are (no stacking).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .activation_probe import identify_activation, identify_pair_activation
from .common import (
    MoEMatch,
    RegionWalk,
    arg,
    backward_slice,
    check_closed,
    dtype_of,
    expect,
    getitem_of,
    is_call,
    module_path,
    shape_of,
    site_fields,
)

_CAST_METHODS = ("to", "float", "half", "bfloat16", "double", "type_as", "contiguous")


@dataclasses.dataclass
class ExpertMLP:
    """One expert's projections, as graph inputs, and its probed activation."""

    rows: fx.Node  # what the expert reads: [rows, d]
    w_gate: fx.Node  # [n, d] (separate or non-gated) or [2n, d] (fused gate/up)
    w_up: fx.Node | None  # [n, d] when gate and up are separate Linears
    w_down: fx.Node  # [d, n]
    act: dict  # activation, interleaved, alpha, limit

    @property
    def layout(self) -> str:
        return "separate" if self.w_up is not None else "single"


def through_float_casts(node, walk: RegionWalk):
    """Skip `.to(<float dtype>)`, `.float()`... casts that keep a float tensor float: they round,
    never change what is computed."""
    while is_call(node, *_CAST_METHODS):
        src, out = dtype_of(node.args[0]), dtype_of(node)
        if src is None or out is None or not src.is_floating_point or not out.is_floating_point:
            break
        if node.target == "to" and any(isinstance(a, (str, torch.device)) for a in (*node.args[1:], *node.kwargs.values())):
            break  # a device move is not a cast
        walk.mark(node)
        node = node.args[0]
    return node


def is_weight(node) -> bool:
    """A graph input (a parameter Dynamo lifted, or a get_attr): read in place, never computed."""
    return isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr")


def _linear(node, what: str) -> tuple[fx.Node, fx.Node]:
    """(input, weight) of `F.linear(input, weight)`, rejecting biases and computed weights."""
    expect(is_call(node, "linear"), f"{what} is not an nn.Linear/F.linear call")
    bias = arg(node, 2, "bias")
    expect(bias is None, f"{what} has a bias: per-expert Linear biases are not supported yet")
    weight = arg(node, 1, "weight")
    expect(is_weight(weight) and len(shape_of(weight)) == 2, f"{what} weight is not a parameter of the expert")
    return arg(node, 0, "input"), weight


def expert_mlp(y: fx.Node, walk: RegionWalk, e: int) -> ExpertMLP:
    """The expert whose output is `y` ([rows, d], casts already skipped), checked."""
    what = f"expert {e}"
    a, w_down = _linear(y, f"{what}'s down projection")
    a = through_float_casts(a, walk)
    walk.mark(y)
    ups = _projections_before(a)
    expect(ups, f"{what} has no projection before its down projection")
    rows = {arg(n, 0, "input") for n in ups}
    expect(len(rows) == 1, f"{what}'s projections read different inputs")
    expect(len(ups) in (1, 2), f"{what} has {len(ups)} projections of its input; 1 (fused or non-gated) or 2 (gate, up) are matched")
    weights = [_linear(n, f"{what}'s up projection")[1] for n in ups]
    expect(a not in ups, f"{what} has no activation between its projections")
    if len(ups) == 1:
        act = identify_activation(ups[0], a)
        expect(not isinstance(act, str), f"{what}: {act}")
        w_gate, w_up = weights[0], None
    else:
        found = identify_pair_activation(ups[0], ups[1], a)
        expect(not isinstance(found, str), f"{what}: {found}")
        act, swapped = found
        w_gate, w_up = weights[::-1] if swapped else weights
    walk.mark(*ups, *backward_slice([a], stop=set(ups)))
    return ExpertMLP(rows.pop(), w_gate, w_up, w_down, act)


def _projections_before(a: fx.Node) -> list[fx.Node]:
    """The linear nodes A is computed from, in graph order (the walk stops at each of them)."""
    found, seen, todo = [], set(), [a]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if is_call(node, "linear"):
            found.append(node)
        else:
            todo.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(a.graph.nodes)}
    return sorted(found, key=order.get)


def same_experts(experts: list[ExpertMLP]) -> None:
    """Every expert has the layout and the activation of expert 0 (the op applies one to all)."""
    first = experts[0]
    for e, ex in enumerate(experts[1:], 1):
        expect(ex.layout == first.layout, f"expert {e} has a {ex.layout} gate/up layout, expert 0 a {first.layout} one")
        expect(ex.act == first.act, f"expert {e}'s activation ({ex.act['activation']}) differs from expert 0's ({first.act['activation']})")


def topk_routing(topk_ids: fx.Node, walk: RegionWalk) -> tuple[int, int]:
    """(E, K) of `torch.topk(scores [T, E], K, dim=-1).indices`: distinct ids in [0, E) per token."""
    topk = getitem_of(topk_ids, 1)
    expect(is_call(topk, "topk"), "expert ids are not the indices of a torch.topk")
    scores, K = arg(topk, 0, "input"), arg(topk, 1, "k")
    shape = shape_of(scores)
    expect(len(shape) == 2 and arg(topk, 2, "dim", -1) in (-1, 1), "top-k does not rank [T, E] scores over the experts")
    expect(isinstance(K, int) and isinstance(shape[1], int), "top-k width or expert count is not static")
    expect(shape_of(topk_ids) == (shape[0], K), f"top-k ids are not [T, K={K}]")
    return shape[1], K


def finish_list_match(idiom, site, walk, anchor, anchors, x, topk_ids, topk_weights, experts: list[ExpertMLP], *,
                      E, K, T, d, accumulator=None, extra_region=(), shape_only=()) -> MoEMatch:
    """Legality shared by the list idioms (dtypes, shapes, a closed region), then the typed match.

    `anchors` are the nodes whose backward slice is the region (every in-place add of a combine);
    `extra_region` are nodes nothing in that slice reads but that go with it (the runtime asserts
    Dynamo adds on `torch.where`'s sizes); `shape_only` are nodes that read their input only for
    its shape (`zeros_like`), so the region does not extend past them.
    """
    from codegen.activations import GATED

    same_experts(experts)
    act = experts[0].act
    x_dtype = dtype_of(x)
    expect(x_dtype is not None and x_dtype.is_floating_point, "hidden states are not floating point")
    expect(dtype_of(topk_weights) is not None and dtype_of(topk_weights).is_floating_point, "routing weights are not floating point")
    expect(dtype_of(topk_ids) is not None and not dtype_of(topk_ids).is_floating_point, "expert ids are not integers")
    expect(len(experts) == E, f"{len(experts)} experts for E={E}")
    w_down = shape_of(experts[0].w_down)
    expect(len(w_down) == 2 and w_down[0] == d, f"down projection {w_down} does not map to d={d}")
    n = w_down[1]
    gated = GATED[act["activation"]]
    want_gate = (n if (experts[0].w_up is not None or not gated) else 2 * n, d)
    for e, ex in enumerate(experts):
        for node, want, name in ((ex.w_gate, want_gate, "gate"), (ex.w_up, (n, d), "up"), (ex.w_down, (d, n), "down")):
            if node is None:
                continue
            expect(shape_of(node) == want, f"expert {e}'s {name} weight is {shape_of(node)}, not {want}")
            expect(dtype_of(node) == x_dtype, f"expert {e}'s {name} weight ({dtype_of(node)}) and the hidden states ({x_dtype}) differ in dtype")

    w_gate = [ex.w_gate for ex in experts]
    w_up = [ex.w_up for ex in experts] if experts[0].w_up is not None else []
    w_down = [ex.w_down for ex in experts]
    inputs = {x, topk_ids, topk_weights, *w_gate, *w_up, *w_down}
    stop = inputs | {inp for node in shape_only for inp in node.all_input_nodes}
    region = backward_slice(anchors, stop=stop) | set(extra_region)
    check_closed(region, walk)
    return MoEMatch(
        idiom=idiom,
        anchor=anchor,
        region=region,
        x=x,
        topk_ids=topk_ids,
        topk_weights=topk_weights,
        activation=act["activation"],
        interleaved=act["interleaved"],
        alpha=act["alpha"],
        limit=act["limit"],
        shape={"T": T, "d": d, "n": n, "E": E, "K": K},
        dtype=x_dtype,
        **site_fields(site, topk_ids, topk_weights, T, E, experts_module=module_path(site) + ".experts"),
        expert_lists=(w_gate, w_up, w_down),
        accumulator=accumulator,
    )
