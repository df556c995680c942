"""MoE code that no finder reads, found by what it computes: the last finder, and the one that
reads no spelling at all.

For each top-k (or max) over [T, E] router scores whose ids reach two or three stacked [E, ., .]
weights and that no finder took, it forms hypotheses of what the code computes and keeps the
first that evaluation confirms:

    x        the [T, d] hidden states the router reads, which the expert code reads as well
    weights  a [T, K] float tensor computed from the router's values ([T] for a top-1)
    experts  which stacked weight is the first projection (gate and up: two of one shape), which
             the down projection, in which orientation, with [E, width] biases where their widths fit
    act      every activation the op computes of that width (the gated ones both concatenated and
             interleaved; gpt-oss's with the region's own numbers as alpha and limit)
    anchor   a node of x's shape that depends on every stacked weight: the first whose value the op
             computes

The region is everything between those inputs and the anchor. It must write nothing in place, read
nothing else, keep what the experts compute to itself (a value read elsewhere would stay and be
computed twice), hold no threshold on float values that random inputs may never cross (a clamp,
a comparison with a number other than 0: a clamp at 7.0 would pass for a plain SwiGLU where no
probe value reaches 7) and no op whose gradient need not be its value's derivative (a library op,
a detach: the evaluation compares values only), and `verify` must evaluate it (float64, random and adversarial routings: an idle
expert, every token on one expert, tied weights) equal to the op's reference for one hypothesis.
Nothing structural is trusted: a hypothesis is only a guess at the op's arguments, and the
evaluation decides. It runs on the CPU whatever the graph's device: a wrong guess may index out of
range, which the CPU reports as an error and a CUDA kernel as a device-side assert that ends the
process's use of the GPU. A region too large to evaluate is left alone. Capacity-limited routing that
really drops tokens differs from the op on the crowded routing and stays as written.
"""
from __future__ import annotations

import itertools

import torch
import torch.fx as fx

from moe_compiler.codegen.activations import GATED

from .common import (MoEMatch, NoMatch, RegionWalk, Rejection, backward_slice, dtype_of, expect, finish_match,
                     is_call, module_path, op_name, same_size, shape_of, writes_in_place)
from .unmatched import _feeding, _forward, _routers

IDIOM = "evaluated"
_MAX_CANDIDATES = 4  # of x, of the weights, of the anchors: hypotheses stay in the hundreds


def find(gm: fx.GraphModule) -> list[MoEMatch | Rejection]:
    results: list[MoEMatch | Rejection] = []
    # a region computed under torch.no_grad shows no trace of it in its own nodes (the switch is a
    # node no value reads): the pass driver's `check_grad_mode_unchanged` leaves such a match alone
    for ids, E, router in _routers(gm):
        reached = _forward(ids)
        if any(str(n.target).startswith("sonic.") for n in reached):
            continue  # another finder rewrote these experts
        scoring = set(_feeding([router])) | {router}
        products = reached + [n for n in _feeding(reached) if n not in reached and n not in scoring]
        params = _params(products, E)
        if len([p for p in params if len(shape_of(p)) == 3]) not in (2, 3):
            continue  # not stacked experts (a ModuleList's Linears, or no experts at all): other finders' business
        try:
            results.append(_search(router, ids, E, reached, scoring, params))
        except NoMatch as exc:
            results.append(Rejection(IDIOM, module_path(router), str(exc)))
    return results


def _params(nodes: list[fx.Node], E: int) -> list[fx.Node]:
    """Graph inputs of shape [E, ., .] or [E, .] that the nodes read, in graph order."""
    found = []
    for node in nodes:
        for inp in node.all_input_nodes:
            shape = shape_of(inp)
            if inp.op in ("placeholder", "get_attr") and len(shape) in (2, 3) and shape[0] == E and inp not in found:
                found.append(inp)
    return found


def _search(router: fx.Node, ids: fx.Node, E: int, reached: list[fx.Node], scoring: set[fx.Node],
            params: list[fx.Node]) -> MoEMatch:
    from .verify import first_equal, verify

    top1 = len(shape_of(ids)) == 1
    expect(len(shape_of(ids)) in (1, 2) and dtype_of(ids) in (torch.int32, torch.int64), "the ids are not [T, K] or [T]")
    T, K = shape_of(ids)[0], 1 if top1 else shape_of(ids)[1]
    stacked = [p for p in params if len(shape_of(p)) == 3]
    biases = [p for p in params if len(shape_of(p)) == 2]
    xs = _hidden_states(scoring, reached, T)
    expect(xs, "no [T, d] hidden states read by both the router and the experts")
    forward = {p: set(_forward(p)) for p in stacked}  # what each stacked weight reaches, for every hypothesis
    weights = _weights(router, ids, forward, T, K, top1)
    expect(weights, f"no [T, {K}] float weights computed from the router's values")
    tried, unevaluated = 0, None
    for x in xs:
        d = shape_of(x)[1]
        anchors = _anchors(reached, x, forward)
        for w, anchor, (w1, w_up, w2, transposed) in itertools.product(weights, anchors, _roles(stacked, d)):
            for (b1, b2), acts in _hypotheses(w1, w_up, w2, transposed, d, biases, anchor):
                tried += len(acts)
                match = _match(router, anchor, x, ids, w, w1, w_up, w2, b1, b2, transposed, acts[0], E=E, K=K, T=T,
                               d=d, top1=top1, forward=forward)
                if match is None:
                    continue
                # the region runs once; each activation's op is compared with it (on the CPU: see above)
                found = first_equal(match, acts, on_cpu=True)  # each act: the MoEMatch fields it sets
                if isinstance(found, dict):
                    outcome = verify(match, on_cpu=True)  # the winner's record, as every finder's
                    match.verified = f"found by evaluation: {outcome}"
                    return match
                if found.startswith("too large"):
                    unevaluated = found
    if unevaluated is not None:
        raise NoMatch(f"the region is {unevaluated}, and this finder has no structural proof to rest on: left alone")
    expect(tried, "no hypothesis fits the shapes: no x-shaped node computed from every stacked weight with "
                  "weights' widths the op takes")
    raise NoMatch(f"no hypothesis evaluated equal to the op ({tried} tried: hidden states, routing weights, expert "
                  f"weights' roles and orientations, activations, outputs)")


def _hidden_states(scoring: set[fx.Node], reached: list[fx.Node], T) -> list[fx.Node]:
    """[T, d] float tensors the router's scores are computed from (graph inputs too) that the expert
    side (what the ids reach, and what that reads, less the router) reads as well."""
    expert_side = (set(reached) | set(_feeding(reached))) - scoring
    read = {i for n in expert_side for i in n.all_input_nodes}
    routed = scoring | {i for n in scoring for i in n.all_input_nodes}
    graph = next(iter(scoring)).graph
    found = [n for n in graph.nodes if n in read and n in routed and len(shape_of(n)) == 2
             and same_size(shape_of(n)[0], T) and dtype_of(n) is not None and dtype_of(n).is_floating_point]
    return found[:_MAX_CANDIDATES]


def _weights(router: fx.Node, ids: fx.Node, forward: dict, T, K: int, top1: bool) -> list[fx.Node]:
    """[T, K] (top-1: [T]) float nodes computed from the router's outputs and from no expert weight
    (`forward`: what each stacked weight reaches), the latest first (renormalised weights come after
    the raw top-k values)."""
    expert_side = set().union(*forward.values())
    want = [(T,)] if top1 else [(T, K)]
    found = [n for n in _forward(router) if n not in expert_side and n is not ids
             and any(len(shape_of(n)) == len(s) and all(same_size(a, b) for a, b in zip(shape_of(n), s)) for s in want)
             and dtype_of(n) is not None and dtype_of(n).is_floating_point]
    return found[::-1][:_MAX_CANDIDATES]


def _anchors(reached: list[fx.Node], x: fx.Node, forward: dict) -> list[fx.Node]:
    """Nodes of x's shape computed from every stacked weight (`forward`: what each reaches), the
    latest first (a sum built up over slots or experts is complete at its last step; a node past the
    MoE, a residual add, fails the evaluation and costs one try)."""
    on_all = set.intersection(*forward.values())
    sx = shape_of(x)
    found = []
    for node in reached:
        shape = shape_of(node)
        if node not in on_all or not shape or dtype_of(node) is None or not dtype_of(node).is_floating_point:
            continue
        if len(shape) == 2 and same_size(shape[0], sx[0]) and shape[1] == sx[1]:
            found.append(node)
    return found[::-1][:2 * _MAX_CANDIDATES]


def _roles(stacked: list[fx.Node], d: int):
    """(w1, w_up or None, w2, transposed) of the stacked weights: w1 [E, w1_out, d] (transposed:
    [E, d, w1_out]) and w2 [E, d, n] ([E, n, d]) in one orientation."""
    for order in itertools.permutations(stacked):
        if len(order) == 2:
            (w1, w2), w_up = order, None
        else:
            w1, w_up, w2 = order
            if shape_of(w1) != shape_of(w_up):
                continue
        s1, s2 = shape_of(w1), shape_of(w2)
        for transposed in (False, True):
            w1_in, w2_out = (s1[1], s2[2]) if transposed else (s1[2], s2[1])
            if w1_in == d and w2_out == d:
                yield w1, w_up, w2, transposed


def _hypotheses(w1, w_up, w2, transposed: bool, d: int, biases: list[fx.Node], anchor: fx.Node):
    """((b1, b2), [activation dicts]) for the weights' widths: gated activations where the first
    projection is twice the down projection's input, the others where they are equal."""
    s1, s2 = shape_of(w1), shape_of(w2)
    w1_out = (s1[2] if transposed else s1[1]) * (2 if w_up is not None else 1)
    n = s2[1] if transposed else s2[2]
    if w1_out == 2 * n:
        names = [(a, inter) for a in GATED if GATED[a] and a not in ("swiglu_clamp", "swiglu_softcap")
                 for inter in ((False,) if w_up is not None else (False, True))]
    elif w1_out == n and w_up is None:
        names = [(a, False) for a in GATED if not GATED[a]]
    else:
        return
    numbers = _numbers(anchor)
    acts = []
    for activation, interleaved in names:
        pairs = [(1.702, 7.0)]
        if activation == "swiglu_oai":
            pairs += [(a, lim) for a in numbers for lim in numbers if a != lim][:8]
        acts += [dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit) for alpha, limit in pairs]
    up_biases = [None] + [b for b in biases if shape_of(b)[1] == w1_out and w_up is None]
    down_biases = [None] + [b for b in biases if shape_of(b)[1] == d]
    for b1, b2 in itertools.product(up_biases, down_biases):
        yield (b1, b2), acts


def _numbers(anchor: fx.Node) -> list[float]:
    """Float literals the code before the anchor uses (gpt-oss's alpha and clamp limit among them)."""
    found = []
    for node in anchor.graph.nodes:
        for a in (*node.args, *node.kwargs.values()):
            if isinstance(a, float) and a > 0 and a not in found:
                found.append(a)
        if node is anchor:
            break
    return found[:6]


_CLAMPS = ("clamp", "clamp_", "clamp_min", "clamp_max", "clip", "hardtanh", "threshold", "nan_to_num", "minimum",
           "maximum", "fmin", "fmax", "isinf", "isnan", "isfinite")
_COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__")


_GRADIENT_EDITS = ("detach", "detach_", "requires_grad_", "_set_grad_enabled", "set_grad_enabled", "no_grad",
                   "enable_grad", "inference_mode", "stop_gradient")


def _own_gradient(nodes: set[fx.Node]) -> fx.Node | None:
    """A node whose gradient need not be the derivative of its value: a library's own op (a
    namespace but aten's or prims'), a higher-order op (an autograd.Function, a checkpoint), a
    detach or a grad-mode switch. The evaluation compares values only, so a region holding one is
    no hypothesis: its training step could differ from the op's."""
    for node in nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        target = node.target
        name = op_name(target) if node.op == "call_function" else target
        library = isinstance(target, torch._ops.HigherOrderOperator) or (
            isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
            and not name.startswith(("aten::", "prims::")))
        if name in _GRADIENT_EDITS or library:
            return node
    return None


def _untested_threshold(nodes: set[fx.Node]) -> fx.Node | None:
    """A node whose float result turns on a threshold random inputs may never cross: a clamp, a
    min/max or a nan/inf test of float values, or a comparison of float values with anything but
    0 (relu-like zeros are crossed by every random input). The evaluation cannot vouch for such a
    region (a clamp at 7.0 passes for a plain SwiGLU where no value reaches 7), so it is no
    hypothesis; comparisons of integers (positions, counts, ids) are what the routings exercise."""
    for node in nodes:
        floats = [a for a in node.all_input_nodes if dtype_of(a) is not None and dtype_of(a).is_floating_point]
        if not floats:
            continue
        if is_call(node, *_CLAMPS):
            numbers = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, (int, float))]
            if not numbers or any(v != 0 for v in numbers) or len(floats) > 1:
                return node
        if is_call(node, *_COMPARISONS):
            others = [a for a in node.args if not (isinstance(a, fx.Node) and a in floats)]
            if len(floats) > 1 or any(not isinstance(a, (int, float)) or a != 0 for a in others):
                return node
    return None


def _match(router, anchor, x, ids, w, w1, w_up, w2, b1, b2, transposed, act, *, E, K, T, d, top1,
           forward: dict) -> MoEMatch | None:
    """The MoEMatch of one hypothesis, or None where it is not even well formed (shapes, dtypes, a
    region that writes in place or reads past its inputs is settled by the evaluation)."""
    inputs = {x, ids, w, w1, w2} | {b for b in (b1, b2, w_up) if b is not None}
    region = backward_slice([anchor], stop=inputs)
    if not region or any(writes_in_place(n) for n in region | {anchor}) or not inputs - {x} <= {
            i for n in region | {anchor} for i in n.all_input_nodes}:
        return None  # a hypothesis whose inputs the region does not all read is not the op's
    if _untested_threshold(region | {anchor}) is not None or _own_gradient(region | {anchor}) is not None:
        return None
    # what the experts compute must be read by the region alone: else it stays in the graph for its
    # other reader, and the op would compute the experts a second time
    computed = set().union(*(forward[p] for p in (w1, w_up, w2) if p is not None))
    if any(u not in region for n in (region & computed) - {anchor} for u in n.users):
        return None
    walk = RegionWalk()
    walk.mark(*region, anchor)
    try:
        match = finish_match(IDIOM, router, walk, anchor, x, ids, w, w1, w2, b1, b2, transposed, act, E=E, K=K, T=T,
                             d=d, w_up=w_up)
    except NoMatch:
        return None
    match.flat_top1 = top1
    return match
