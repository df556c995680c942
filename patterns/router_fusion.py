"""Router fusion: the router in front of a rewritten MoE becomes one `sonic::route` call.

Runs after `common.rewrite`, on the `sonic::moe_experts[_list]` node it inserted: walks back from
the op's topk_ids / topk_weights to the router logits, checks every node on the way, and replaces
them with one call. What it matches (L: [T, E] logits, any spelling: F.softmax / torch.softmax /
.softmax, dim=-1 or 1, `/=` or `/`, `.sum(-1, keepdim=True)`, an optional float cast of L):

    # softmax -> top-k (-> renormalise) (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral)
    p = F.softmax(L, dim=-1, dtype=torch.float)            # or softmax(L.float(), -1), or sigmoid(L)
    w, ids = torch.topk(p, K, dim=-1)                      # [T, K]
    w /= w.sum(dim=-1, keepdim=True)                       # optional; `+ eps` in the denominator too, or
                                                           # a clamp(min=m) around it (ERNIE-4.5)
    w = w * scale                                          # optional Python constant

    # top-k -> softmax (gpt-oss)
    v, ids = torch.topk(L, K, dim=-1)
    w = F.softmax(v, dim=1, dtype=v.dtype)

    # sigmoid + correction bias, group-limited top-k (DeepSeek-V3)
    s = L.sigmoid()                                        # [T, E]
    c = s + bias                                           # [E], selection only
    g = c.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)                 # [T, G]
    gi = torch.topk(g, k=topk_group, dim=-1, sorted=False)[1]
    m = torch.zeros_like(g); m.scatter_(1, gi, 1)
    m = m.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    c = c.masked_fill(~m.bool(), fill)                     # optional group part; fill as written
    ids = torch.topk(c, k=K, dim=-1, sorted=False)[1]
    w = s.gather(1, ids)
    w /= w.sum(dim=-1, keepdim=True) + 1e-20               # optional
    w = w * routed_scaling_factor                          # optional

and becomes `w, ids = sonic::route(L, bias, K, ...)` (a cast of w after the router, e.g.
`.to(L.dtype)`, stays where it is). Weights multiplied by a tensor after all that (Gemma 4:
`w * per_expert_scale[ids]`) keep the product in the graph, on the fused w and ids. Anything else
is left as it is, with the reason: a node of another kind, dim, k, largest=False, keepdim, a tensor
scale inside the router, or an intermediate (the probabilities, the top-k values...) that something
outside the router also reads (an aux loss, token rounding).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator

import torch
import torch.fx as fx

from .common import (
    CAST_METHODS,
    NoMatch,
    arg,
    dtype_of,
    erase_dead,
    example_value,
    expect,
    fake_mode_of,
    is_call,
    is_getitem,
    is_inplace,
    shape_of,
)

_FLOAT_OF = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class RouterMatch:
    """A checked router: the `sonic::route` arguments, the nodes it replaces and its two outputs."""

    logits: fx.Node
    weights: fx.Node  # the node whose value topk_weights is (before any cast left in the graph)
    ids: fx.Node
    region: set[fx.Node]
    args: dict  # route_op's keyword arguments except logits
    form: str  # "softmax->topk->renorm", ...


def fuse_router(gm: fx.GraphModule, call: fx.Node) -> tuple[bool, str]:
    """(True, form) after replacing the router of `call` with `sonic::route`; (False, reason) when it
    is left as it is. Checking never mutates the graph; the rewrite only runs on a full match."""
    try:
        match = match_router(call)
    except NoMatch as why:
        return False, str(why)
    rewrite_router(gm, match)
    return True, match.form


def match_router(call: fx.Node, routing: tuple[fx.Node, fx.Node] | None = None) -> RouterMatch:
    """The router of a sonic MoE call. `routing`: the router's [T, K] (ids, weights) when the call's
    own are not them (an input-scaled call: rows x[t] * w[t, k] with unit weights)."""
    expect(is_call(call, "sonic::moe_experts", "sonic::moe_experts_list", "sonic::moe_experts_split"),
           f"{call.name} is not a sonic MoE call")
    ids, weights = call.args[1], call.args[2]
    slot_form = call.args[-1]  # slot_token, last in every form
    expect(not is_call(_src(ids), "sonic::round_routing_slots"),
           "token rounding reads the router probabilities (sonic::round_routing_slots)")
    expect(slot_form is None, "the call takes the slot form (slots dropped: an expert-parallel plan's sentinels, or a capacity)")
    if routing is not None:
        ids, weights = routing
    while _cast_dtype(weights) is not None:  # casts after the router stay in the graph
        weights = weights.args[0]
    walk = _Walk()
    try:
        weights_node, args, form = walk.weights(weights, ids)
    except NoMatch as why:  # the weights times a tensor the op does not compute: fuse the router before it
        walk, (weights_node, args, form), factor = _before_tensor_factor(weights, ids, why)
        form += f" * {_factor_name(factor, ids)} (kept)"
    T, K = shape_of(ids)
    E = shape_of(args["logits"])[1] if len(shape_of(args["logits"])) == 2 else None
    expect(isinstance(E, int) and isinstance(K, int), "router shapes are not static [T, E] / [T, K]")
    expect(args["k"] == K, f"top-k k={args['k']} differs from the ids' K={K}")
    expect(shape_of(weights_node) == shape_of(ids), "router weights and ids differ in shape")
    expect(dtype_of(weights_node) == args["compute_dtype"],
           f"router weights ({dtype_of(weights_node)}) are not in the dtype of the scores ({args['compute_dtype']})")
    walk.check_closed(outputs={weights_node, ids})
    logits = args.pop("logits")
    try:  # the op's own argument checks, on the fake values (k <= E, groups dividing E, bias...)
        from moe_compiler.codegen.router import validate_route_args

        validate_route_args(example_value(logits), example_value(args["bias"]), args["k"], args["score"],
                            args["topk_first"], args["renorm"], args["eps"], args["scale"], args["n_group"],
                            args["topk_group"], args["fill"], args["compute_dtype"], args["renorm_min"])
    except ValueError as err:
        raise NoMatch(str(err)) from None
    return RouterMatch(logits, weights_node, ids, walk.region, args, form)


def _before_tensor_factor(weights: fx.Node, ids: fx.Node, why: NoMatch):
    """(walk, walk.weights(...), factor) when `weights` is `w * factor`, `w` a router's weights
    and `factor` a tensor (Gemma 4's `* per_expert_scale[ids]`): the router up to `w` is fused and
    the product stays in the graph, reading the fused weights and ids. Only the out-of-place product
    (an in-place one would write into the op's output). Raises `why` when it is not that."""
    if not (is_call(weights, "mul") and len(weights.args) == 2 and not weights.kwargs
            and all(isinstance(a, fx.Node) for a in weights.args)):
        raise why
    for inner, factor in (weights.args, weights.args[::-1]):
        while _cast_dtype(inner) is not None:
            inner = inner.args[0]
        walk = _Walk()
        try:
            return walk, walk.weights(inner, ids), factor
        except NoMatch:
            continue
    raise why


def _factor_name(factor: fx.Node, ids: fx.Node) -> str:
    """The report's name of a kept factor: `per_expert_scale[ids]` for a parameter indexed by the
    ids (Dynamo's `l_self_modules_router_parameters_per_expert_scale_` shortened), else the node's."""
    src = _src(factor) if factor.args[1:2] == (ids,) else None
    if src is None:
        return factor.name
    name = str(src.target if src.op == "get_attr" else src.name)
    for mark in ("_parameters_", "_buffers_", "."):
        name = name.rsplit(mark, 1)[-1]
    return f"{name.strip('_')}[ids]"


def rewrite_router(gm: fx.GraphModule, match: RouterMatch) -> fx.Node:
    """Insert `sonic::route`, point every reader of the router's weights and ids at it, erase the
    router's nodes. Every fallible step (fake values, argument checks) runs before the first edit."""
    from moe_compiler.codegen.nograd import overload
    from moe_compiler.codegen.router import route_op  # noqa: F401  (registers sonic::route)

    graph = gm.graph
    a = match.args
    args = (match.logits, a["bias"], a["k"], a["score"], a["topk_first"], a["renorm"], a["eps"], a["scale"],
            a["n_group"], a["topk_group"], a["fill"], a["compute_dtype"], a["renorm_min"])
    # the `nograd` overload where the router's traced weights show that no gradient flows through them (as
    # `patterns.common._grad_flows` decides for the experts); without that fake, the default overload
    weights = example_value(match.weights)
    op = overload("route", not isinstance(weights, torch.Tensor) or weights.requires_grad)
    fake_mode = fake_mode_of(gm)
    fake = None
    if fake_mode is not None:
        with fake_mode:
            fake = op(*fx.node.map_arg(args, example_value))
    order = {node: i for i, node in enumerate(graph.nodes)}
    where = min(match.region, key=order.get)
    if a["bias"] is not None and order[a["bias"]] >= order[where]:
        where = a["bias"].next
    meta = {k: v for k, v in match.weights.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")}
    with graph.inserting_before(where):
        route = graph.call_function(op, args)
        new_w = graph.call_function(operator.getitem, (route, 0))
        new_ids = graph.call_function(operator.getitem, (route, 1))
    for i, node in enumerate((route, new_w, new_ids)):
        node.meta.update(meta)
        if fake is not None:
            node.meta["example_value"] = fake if i == 0 else fake[i - 1]
    match.weights.replace_all_uses_with(new_w)
    match.ids.replace_all_uses_with(new_ids)
    erase_dead(graph, match.region | _dead_readers(match.region))
    alive = set(graph.nodes)
    left = [n.name for n in match.region if n in alive]
    if left:
        raise RuntimeError(f"router fusion left router nodes in the graph: {left}")
    return route


# --- the checker -----------------------------------------------------------------------------------


def _src(node):
    return node.args[0] if is_getitem(node) else None


def _cast_dtype(node) -> torch.dtype | None:
    """The float dtype of a pure dtype cast (`.float()`, `.to(torch.float32)`, `.type(dtype)`,
    `.type_as(other)`), else None."""
    if not is_call(node, *CAST_METHODS) or node.op != "call_method":
        return None
    out = dtype_of(node)
    if node.target in _FLOAT_OF:
        ok = len(node.args) == 1 and not node.kwargs
    elif node.target == "type_as":  # .type_as(other): other's dtype, read from the node's own value
        ok = len(node.args) == 2 and isinstance(node.args[1], fx.Node) and not node.kwargs
    else:
        rest = list(node.args[1:]) + list(node.kwargs.values())
        ok = len(rest) == 1 and isinstance(rest[0], torch.dtype) and set(node.kwargs) <= {"dtype"}
    return out if ok and out is not None and out.is_floating_point else None


def _exact_cast(src: torch.dtype | None, dst: torch.dtype) -> bool:
    """The cast changes no value (same dtype, or a float widening): the op may cast for it."""
    return src is not None and src.is_floating_point and (
        src == dst or dst == torch.float64 or (dst == torch.float32 and src in (torch.float16, torch.bfloat16)))


def _int_dim(value, ndim: int, want: int) -> bool:
    """`value` (an int or a 1-tuple) names dim `want` of an ndim-D tensor."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    return isinstance(value, int) and not isinstance(value, bool) and value % ndim == want % ndim


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class _Walk:
    """Parses the router backwards from its outputs; every node it accepts joins `region`."""

    def __init__(self):
        self.region: set[fx.Node] = set()

    def take(self, *nodes):
        self.region.update(n for n in nodes if isinstance(n, fx.Node))

    def weights(self, w: fx.Node, ids: fx.Node) -> tuple[fx.Node, dict, str]:
        out, args, steps = w, dict(scale=1.0, renorm=False, eps=0.0, renorm_min=0.0, bias=None, n_group=1,
                                   topk_group=1, fill=float("-inf")), []
        if is_call(w, "mul", "imul", "mul_"):
            a, b = w.args[0], w.args[1] if len(w.args) > 1 else None
            const, node = (a, b) if _number(a) else (b, a)
            expect(len(w.args) == 2 and not w.kwargs and isinstance(node, fx.Node),
                   f"routing weights are scaled by {w.target} with extra arguments")
            expect(_number(const), f"routing weights are scaled by a tensor ({_describe(const)}), not a constant")
            args["scale"] = float(const)
            self.take(w)
            w = node
            steps.append("scale")
        w = self.identity_casts(w)
        if is_call(w, "truediv", "itruediv", "div", "div_"):
            w = self.renorm(w, args)
            steps.insert(0, "renorm")
            w = self.identity_casts(w)
        if is_call(w, "softmax"):  # top-k -> softmax
            v, dim, dtype = self.softmax(w)
            expect(_int_dim(dim, 2, 1), f"softmax of the top-k values over dim {dim}, not the k dim")
            topk = self.topk(v, 0, ids)
            logits = self.logits(topk.args[0] if topk.args else topk.kwargs["input"])
            args.update(logits=logits, k=self.k_of(topk), score="softmax", topk_first=True,
                        compute_dtype=dtype_of(w))
            self.take(w, v)
            return out, args, "->".join(["topk", "softmax", *steps])
        if _src(w) is not None and is_call(_src(w), "topk"):  # score -> top-k, weights = top-k values
            topk = self.topk(w, 0, ids)
            scores = topk.args[0] if topk.args else topk.kwargs["input"]
            score, logits = self.score(scores)
            args.update(logits=logits, k=self.k_of(topk), score=score, topk_first=False, compute_dtype=dtype_of(scores))
            return out, args, "->".join([score, "topk", *steps])
        if is_call(w, "gather"):  # selection by other scores (bias, groups), weights gathered
            # gather(scores, dim, index), positionally or by keyword (LFM2-MoE: dim=1, index=ids)
            expect(len(w.args) + len(w.kwargs) == 3 and set(w.kwargs) <= {"input", "dim", "index"},
                   "gather with unexpected arguments")
            scores, dim, index = (arg(w, 0, "input"), arg(w, 1, "dim"), arg(w, 2, "index"))
            expect(index is ids and _int_dim(dim, 2, 1),
                   "the routing weights gather something else than the scores at the top-k ids")
            score, logits = self.score(scores)
            topk = self.topk(ids, 1, ids)
            choice = topk.args[0] if topk.args else topk.kwargs["input"]
            desc = self.choice(choice, scores, args)
            args.update(logits=logits, k=self.k_of(topk), score=score, topk_first=False, compute_dtype=dtype_of(scores))
            self.take(w)
            return out, args, "->".join([score + desc, "topk", "gather", *steps])
        raise NoMatch(f"routing weights come from {_describe(w)}, not a recognised router")

    def identity_casts(self, w: fx.Node) -> fx.Node:
        """Casts to the dtype their input already has (LFM2-MoE's `gather(...).type_as(logits)` of
        same-dtype scores) change no value: they join the router. Any other cast inside it does not
        match (the router op computes in one dtype)."""
        while (dtype := _cast_dtype(w)) is not None and dtype == dtype_of(w.args[0]):
            self.take(w)
            w = w.args[0]
        return w

    def renorm(self, div: fx.Node, args: dict) -> fx.Node:
        expect(len(div.args) == 2 and not div.kwargs, f"division {div.name} has a rounding mode or extra arguments")
        num, den = div.args
        expect(isinstance(num, fx.Node) and isinstance(den, fx.Node), "routing weights are divided by a constant")
        eps, renorm_min = 0.0, 0.0
        if is_call(den, "clamp", "clamp_min"):  # ERNIE-4.5: w / clamp(w.sum(-1, keepdim=True), min=norm_min)
            renorm_min = self.clamp_min(den)
            self.take(den)
            den = den.args[0]
        if is_call(den, "add", "iadd"):
            a, b = den.args[0], den.args[1] if len(den.args) > 1 else None
            const, node = (a, b) if _number(a) else (b, a)
            expect(_number(const) and isinstance(node, fx.Node) and len(den.args) == 2 and not den.kwargs,
                   "the renormalisation's denominator adds something other than a constant eps")
            eps = float(const)
            self.take(den)
            den = node
        expect(is_call(den, "sum") and arg(den, 0, "input") is num,
               f"routing weights are divided by {_describe(den)}, not by their own sum")
        dim, keepdim = arg(den, 1, "dim"), arg(den, 2, "keepdim", False)
        expect(_int_dim(dim, 2, 1), f"renormalisation sums over dim {dim}, not the k dim")
        expect(keepdim is True, "renormalisation sum without keepdim=True (it would broadcast across tokens)")
        expect(len(den.args) + len(den.kwargs) <= 3 and "dtype" not in den.kwargs, "renormalisation sum with a dtype")
        args.update(renorm=True, eps=eps, renorm_min=renorm_min)
        self.take(div, den)
        return num

    @staticmethod
    def clamp_min(node: fx.Node) -> float:
        """m of `clamp(x, min=m)` / `clamp_min(x, m)` around the renormalisation's sum: a number >= 0
        and no max (a max, or a tensor bound, would change weights the op does not)."""
        if is_call(node, "clamp_min"):
            low, high = arg(node, 1, "min"), None
            expect(len(node.args) + len(node.kwargs) == 2, f"{node.name}: clamp_min with extra arguments")
        else:
            low, high = arg(node, 1, "min"), arg(node, 2, "max")
            expect(len(node.args) + len(node.kwargs) <= 3, f"{node.name}: clamp with extra arguments")
        expect(isinstance(node.args[0], fx.Node), f"{node.name}: clamp of a constant")
        expect(high is None, "the renormalisation's denominator is clamped from above")
        expect(_number(low) and math.isfinite(float(low)) and float(low) >= 0.0,
               f"the renormalisation's denominator is clamped by {_describe(low)}, not a number >= 0")
        return float(low)

    def softmax(self, node: fx.Node):
        """(input, dim, dtype) of a softmax over an explicit dim (F.softmax, torch.softmax, .softmax)."""
        expect(len(node.args) <= 2 and set(node.kwargs) <= {"dim", "dtype", "_stacklevel"},
               f"softmax {node.name} with unexpected arguments")
        dim = arg(node, 1, "dim")
        expect(dim is not None, "softmax without an explicit dim")
        return arg(node, 0, "input"), dim, node.kwargs.get("dtype")

    def score(self, node: fx.Node) -> tuple[str, fx.Node]:
        """('softmax' | 'sigmoid', logits) of the [T, E] scores node."""
        expect(len(shape_of(node)) == 2, f"router scores {_describe(node)} are not [T, E]")
        if is_call(node, "softmax"):
            x, dim, _ = self.softmax(node)
            expect(_int_dim(dim, 2, 1), f"softmax over dim {dim}, not the experts")
            kind = "softmax"
        elif is_call(node, "sigmoid"):
            expect(len(node.args) == 1 and not node.kwargs, "sigmoid with extra arguments")
            x, kind = node.args[0], "sigmoid"
        else:
            raise NoMatch(f"router scores come from {_describe(node)}, not a softmax or sigmoid")
        self.take(node)
        return kind, self.logits(x)

    def logits(self, x) -> fx.Node:
        """The logits, through one float cast that only the router reads (the op casts instead)."""
        expect(isinstance(x, fx.Node) and len(shape_of(x)) == 2, "router logits are not a [T, E] tensor")
        if _cast_dtype(x) is not None and len(x.users) == 1 and _exact_cast(dtype_of(x.args[0]), dtype_of(x)):
            self.take(x)
            x = x.args[0]
        return x

    def topk(self, out: fx.Node, index: int, ids: fx.Node) -> fx.Node:
        """The topk node whose output `index` is `out`, checked: largest along the last dim, its
        indices being the op's ids."""
        topk = _src(out)
        expect(is_call(topk, "topk") and out.args[1] == index, f"{_describe(out)} is not a top-k output")
        expect(_src(ids) is topk and ids.args[1] == 1, "the top-k weights and the ids come from different top-k calls")
        x = arg(topk, 0, "input")
        ndim = len(shape_of(x))
        expect(_int_dim(arg(topk, 2, "dim", -1), ndim, ndim - 1), f"top-k over dim {arg(topk, 2, 'dim', -1)}, not the experts")
        expect(arg(topk, 3, "largest", True) is True, "top-k with largest=False")
        expect(len(topk.args) + len(topk.kwargs) <= 5 and "out" not in topk.kwargs, "top-k with unexpected arguments")
        expect(isinstance(self.k_of(topk), int), "top-k k is not a constant")
        self.take(topk, out, ids)
        return topk

    @staticmethod
    def k_of(topk: fx.Node):
        return arg(topk, 1, "k")

    def choice(self, choice: fx.Node, scores: fx.Node, args: dict) -> str:
        """What the top-k ranks: scores [+ bias] [group-masked]. Returns the form's suffix."""
        desc = ""
        if is_call(choice, "masked_fill"):
            desc = self.groups(choice, scores, args)
            choice = choice.args[0]
        if choice is not scores:
            expect(is_call(choice, "add") and len(choice.args) == 2 and not choice.kwargs,
                   f"the top-k ranks {_describe(choice)}, not the scores plus a bias")
            a, b = choice.args
            bias = b if a is scores else a if b is scores else None
            row = _row_of(bias)
            if row is not None and shape_of(row) == shape_of(scores)[1:]:
                self.take(bias)
                bias = row  # bias.unsqueeze(0) (DeepSeek-V3's spelling): the same [E] vector on every row
            expect(isinstance(bias, fx.Node) and shape_of(bias) == shape_of(scores)[1:],
                   "the top-k ranks the scores plus something that is not an [E] bias")
            expect(dtype_of(choice) == dtype_of(scores), f"the bias ({dtype_of(bias)}) promotes the scores' dtype")
            args["bias"] = bias
            self.take(choice)
            desc = "+bias" + desc
        return desc

    def groups(self, fill_node: fx.Node, scores: fx.Node, args: dict) -> str:
        """DeepSeek-V3's group-limited mask: experts outside the topk_group best groups get `fill`."""
        expect(len(fill_node.args) + len(fill_node.kwargs) == 3, "masked_fill with unexpected arguments")
        choice, mask, fill = fill_node.args[0], arg(fill_node, 1, "mask"), arg(fill_node, 2, "value")
        expect(_number(fill), f"masked scores are filled with a tensor ({_describe(fill)})")
        T, E = shape_of(choice)
        if is_call(mask, "invert", "logical_not", "bitwise_not", "__invert__"):
            inner = mask.args[0]
            self.take(mask)
            if (is_call(inner, "bool") and len(inner.args) == 1) or (is_call(inner, "to") and inner.args[1:] == (torch.bool,)):
                self.take(inner)
                inner = inner.args[0]
            else:
                expect(dtype_of(inner) == torch.bool, "the group mask is not negated as a bool tensor")
            flat = inner
        else:
            raise NoMatch(f"the masked_fill mask is {_describe(mask)}, not ~group_mask.bool()")
        expect(is_call(flat, "reshape", "view") and shape_of(flat) == (T, E), "the group mask is not reshaped to [T, E]")
        expanded = flat.args[0]
        expect(is_call(expanded, "expand") and len(shape_of(expanded)) == 3, "the group mask is not expanded per expert")
        _, G, size = shape_of(expanded)
        expect(isinstance(G, int) and G * size == E, "the group mask's groups do not tile the experts")
        unsq = expanded.args[0]
        expect(is_call(unsq, "unsqueeze") and _int_dim(arg(unsq, 1, "dim"), 3, 2), "the group mask is not unsqueezed last")
        group_mask = unsq.args[0]
        expect(is_call(group_mask, "zeros_like"), "the group mask does not start as zeros_like(group scores)")
        group_scores = arg(group_mask, 0, "input")
        scatters = [u for u in group_mask.users if u is not unsq]
        expect(len(scatters) == 1 and is_call(scatters[0], "scatter_"), "the group mask is not filled by one scatter_")
        scatter = scatters[0]
        order = {n: i for i, n in enumerate(scatter.graph.nodes)}
        expect(order[scatter] < order[unsq], "the group mask is read before it is filled")
        expect(len(scatter.args) == 4 and not scatter.kwargs and _int_dim(scatter.args[1], 2, 1)
               and scatter.args[3] in (1, 1.0, True), "the group mask is not scatter_(1, group_idx, 1)")
        group_idx = scatter.args[2]
        group_topk = self.topk(group_idx, 1, group_idx)
        expect(arg(group_topk, 0, "input") is group_scores, "the kept groups are not the top-k of the group scores")
        topk_group = self.k_of(group_topk)
        # group score = sum of the two largest choices of each group
        expect(is_call(group_scores, "sum") and arg(group_scores, 2, "keepdim", False) is False
               and _int_dim(arg(group_scores, 1, "dim"), 3, 2) and len(group_scores.args) + len(group_scores.kwargs) <= 3,
               f"the group score is {_describe(group_scores)}, not the sum of the top-2 scores of each group")
        top2_values = group_scores.args[0]
        top2 = _src(top2_values)
        expect(is_call(top2, "topk") and top2_values.args[1] == 0 and self.k_of(top2) == 2,
               "the group score is not the sum of the top-2 scores of each group")
        expect(_int_dim(arg(top2, 2, "dim", -1), 3, 2) and arg(top2, 3, "largest", True) is True,
               "the group score's top-2 is not the largest along the experts of a group")
        grouped = arg(top2, 0, "input")
        expect(is_call(grouped, "view", "reshape") and grouped.args[0] is choice and shape_of(grouped) == (T, G, size),
               "the group score does not read the choice scores viewed as [T, groups, experts per group]")
        expect(isinstance(topk_group, int) and 1 <= topk_group <= G, f"topk_group={topk_group} does not fit {G} groups")
        self.take(fill_node, flat, expanded, unsq, group_mask, scatter, group_idx, group_topk, group_scores, top2_values,
                  top2, grouped)
        args.update(n_group=G, topk_group=topk_group, fill=float(fill))
        return f"->group-top{topk_group}/{G}"

    def check_closed(self, outputs: set[fx.Node]) -> None:
        """Nothing outside the router reads an intermediate (only the outputs are read outside)."""
        dead = _dead_readers(self.region)
        for node in self.region - outputs:
            outside = [u for u in node.users if u not in self.region and u not in dead]
            expect(not outside, f"{_describe(node)} is also read outside the router (by {outside[0].name if outside else ''})")
        for node in self.region:
            writers = [u for u in node.users if is_inplace(u) and u not in self.region]
            expect(not writers, f"{_describe(node)} is mutated outside the router")


def _dead_readers(region: set[fx.Node]) -> set[fx.Node]:
    """Readers of the region that compute nothing anyone uses (left behind by an earlier rewrite)."""
    dead: set[fx.Node] = set()

    def is_dead(node: fx.Node, depth=0) -> bool:
        if node in dead:
            return True
        if node in region or node.op not in ("call_function", "call_method") or is_inplace(node) or depth > 16:
            return False
        if node.op == "call_function" and node.is_impure():
            return False
        if all(is_dead(u, depth + 1) for u in node.users):
            dead.add(node)
            return True
        return False

    for node in region:
        for user in node.users:
            is_dead(user)
    return dead


def _row_of(node) -> fx.Node | None:
    """v when `node` is an [E] vector v made a [1, E] row: `v.unsqueeze(0)`, `v[None]`,
    `v[None, :]`, `v.view(1, -1)` or `v.reshape(1, -1)`."""
    if not isinstance(node, fx.Node) or not isinstance(node.args[0] if node.args else None, fx.Node):
        return None
    v = node.args[0]
    if len(shape_of(v) or ()) != 1:
        return None
    if is_call(node, "unsqueeze") and len(node.args) == 2 and node.args[1] == 0 and not node.kwargs:
        return v
    if is_getitem(node) and node.args[1] in ((None,), None, (None, slice(None))):
        return v
    if is_call(node, "view", "reshape") and node.args[1:] in ((1, -1), ((1, -1),), (1, shape_of(v)[0]), ((1, shape_of(v)[0]),)):
        return v
    return None

def _describe(node) -> str:
    if not isinstance(node, fx.Node):
        return repr(node)
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.name} ({target})"
