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

`grouped_mm` is `torch._grouped_mm` / `F.grouped_mm` (bf16 under compile) or the opaque
`transformers::grouped_mm_fallback` (fp32/fp16). transformers 5.17 also inserts expert-parallel
sentinel nodes (`expert_ids_g >= E` masks, `clamp_`, `masked_fill(_)`); with ids in [0, E), which
top-k guarantees and the op checks, they change nothing and are absorbed into the region.

It becomes:

    out = moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                      activation=<probed>, interleaved=<probed>, transposed=<layout>)

The router glue that produced top_k_index/top_k_weights stays in the graph for Inductor.
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from codegen.activations import GATED

from .activation_probe import identify_activation
from .common import (
    MoEMatch,
    Rejection,
    arg,
    backward_slice,
    describe_shared_expert,
    dtype_of,
    example_value,
    getitem_of,
    is_call,
    is_inplace,
    is_noop_cast,
    module_class,
    module_path,
    same_size,
    shape_of,
    users_getitem,
)

IDIOM = "hf_grouped_mm"
GROUPED_MM = ("_grouped_mm", "grouped_mm", "transformers::grouped_mm_fallback")


class _NoMatch(Exception):
    """Raised inside the checker with the rejection reason."""


def _expect(cond, reason: str):
    if not cond:
        raise _NoMatch(reason)


def find(gm: fx.GraphModule) -> list[MoEMatch | Rejection]:
    calls_by_offsets: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if is_call(node, *GROUPED_MM):
            offs = arg(node, 2, "offs")
            calls_by_offsets[offs].append(node)
    results = []
    for offs, calls in calls_by_offsets.items():
        module = module_path(calls[0])
        try:
            results.append(_check(offs, calls))
        except _NoMatch as exc:
            results.append(Rejection(IDIOM, module, str(exc)))
    return results


class _Walk:
    """Records every node the checker validated; the region must consist of these alone."""

    def __init__(self, num_experts: int | None = None):
        self.seen: set[fx.Node] = set()
        self.num_experts = num_experts
        self.sorted_ids: fx.Node | None = None

    def mark(self, *nodes):
        for node in nodes:
            if isinstance(node, fx.Node):
                self.seen.add(node)

    def is_sentinel_mask(self, node: fx.Node) -> bool:
        """`t.masked_fill(mask, 0)` / `masked_fill_` with mask = (expert_ids_g >= E)[.unsqueeze(-1)]."""
        if not is_call(node, "masked_fill", "masked_fill_") or self.sorted_ids is None:
            return False
        mask, value = arg(node, 1, "mask"), arg(node, 2, "value")
        if value != 0:
            return False
        chain = [mask]
        if is_call(mask, "unsqueeze"):
            mask = mask.args[0]
            chain.append(mask)
        ok = is_call(mask, "ge", "__ge__") and mask.args[0] is self.sorted_ids and mask.args[1] == self.num_experts
        if ok:
            self.mark(node, *chain)
        return ok

    def is_harmless_inplace(self, node: fx.Node) -> bool:
        """In-place nodes of the region that change no value for ids in [0, E)."""
        if node in self.seen or self.is_sentinel_mask(node):
            return True
        clamp = (
            is_call(node, "clamp_")
            and node.args[0] is self.sorted_ids
            and arg(node, 1, "min") is None
            and arg(node, 2, "max") == self.num_experts - 1
        )
        if clamp:
            self.mark(node)
        return clamp

    def through(self, node):
        """Skip value-preserving nodes: no-op casts and sentinel masks (given valid ids)."""
        while isinstance(node, fx.Node) and (is_noop_cast(node) or self.is_sentinel_mask(node)):
            self.mark(node)
            node = node.args[0]
        return node

    def readers(self, node: fx.Node) -> list[fx.Node]:
        """Users of a value other than the region's own in-place nodes (bias add, sentinel masks)."""
        return [u for u in node.users if not (is_inplace(u) and (u in self.seen or self.is_sentinel_mask(u)))]

    def only_reader(self, node: fx.Node) -> fx.Node | None:
        users = self.readers(node)
        return users[0] if len(users) == 1 else None

    def forward(self, node: fx.Node) -> fx.Node:
        """Follow a value to its single consumer through value-preserving nodes."""
        while True:
            users = self.readers(node)
            if len(users) != 1:
                return node
            (user,) = users
            if is_noop_cast(user) or self.is_sentinel_mask(user):
                self.mark(user)
                node = user
            else:
                return node


def _weight_of(node, walk: _Walk) -> tuple[fx.Node, bool]:
    """(expert weight, stored transposed?) from grouped_mm's second argument."""
    if is_call(node, "transpose") and sorted(int(a) % 3 for a in node.args[1:3]) == [1, 2]:
        walk.mark(node)
        return node.args[0], False
    if is_call(node, "mT"):
        walk.mark(node)
        return node.args[0], False
    return node, True


def _expert_bias(mm: fx.Node, walk: _Walk) -> fx.Node | None:
    """The bias of `out.add_(bias[expert_ids_g])` right after a grouped_mm, if any.

    Dynamo keeps later reads on the grouped_mm node itself and orders them after the in-place add,
    so the add must come before every other reader of the output.
    """
    inplace = [u for u in mm.users if is_inplace(u) and not walk.is_sentinel_mask(u)]
    if not inplace:
        return None
    _expect(len(inplace) == 1 and is_call(inplace[0], "add_"), f"in-place {inplace[0].name} on a grouped_mm output is not an expert bias")
    add = inplace[0]
    gathered = add.args[1]
    _expect(len(add.args) == 2 and not add.kwargs, "expert bias add has an alpha")
    bias = getitem_of(gathered, walk.sorted_ids)
    _expect(bias is not None and len(shape_of(bias)) == 2, "grouped_mm output gets an addend that is not a per-expert bias")
    order = {node: i for i, node in enumerate(mm.graph.nodes)}
    _expect(all(order[add] < order[u] for u in mm.users if u is not add), "expert bias is added after the output is read")
    walk.mark(add, gathered)
    return bias


_ROUTER_OPS = ("sigmoid", "softmax", "topk")
_PROJECTIONS = ("linear", "matmul", "mm", "addmm")


def _describe_router(topk_ids: fx.Node, topk_weights: fx.Node) -> str:
    """'softmax->topk->renorm', 'topk->softmax', 'sigmoid->topk'...: the ops between the router's
    projection and the top-k outputs, in graph order. Descriptive only (the router stays as is)."""
    seen: set[fx.Node] = set()
    todo = [topk_ids, topk_weights]
    while todo and len(seen) < 64:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if not is_call(node, *_PROJECTIONS):
            todo.extend(node.all_input_nodes)
    order = {node: i for i, node in enumerate(topk_ids.graph.nodes)}
    ops = [name for node in sorted(seen, key=order.get) for name in _ROUTER_OPS if is_call(node, name)]
    kind = "->".join(dict.fromkeys(ops)) or "unknown"
    topk = [node for node in seen if is_call(node, "topk")]
    if topk and any(is_call(n, "div", "truediv", "itruediv") and order[n] > order[topk[0]] for n in seen):
        kind += "->renorm"
    return kind


def _check(offs: fx.Node, calls: list[fx.Node]) -> MoEMatch:
    _expect(len(calls) == 2, f"expected an up and a down grouped_mm sharing offsets, found {len(calls)}")
    up, down = calls
    walk = _Walk()
    walk.mark(up, down)

    # offsets = cumsum(histc(expert_ids_g, bins=E, min=0, max=E-1), dtype=int32)
    _expect(is_call(offs, "cumsum"), "grouped_mm offsets are not a cumsum of per-expert counts")
    hist = offs.args[0]
    _expect(is_call(hist, "histc", "bincount"), "per-expert counts are not a histc/bincount")
    walk.mark(offs, hist)
    if is_call(hist, "histc"):
        E = arg(hist, 1, "bins")
        lo, hi = arg(hist, 2, "min", 0), arg(hist, 3, "max", 0)
        _expect(isinstance(E, int) and lo == 0 and hi == E - 1, f"histc range ({lo}, {hi}) is not [0, bins-1]")
    else:
        E = arg(hist, 2, "minlength")
    counted = hist.args[0]
    while is_call(counted, "float", "int", "long", "to"):
        walk.mark(counted)
        counted = counted.args[0]
    sort = getitem_of(counted, 0)
    _expect(sort is not None and is_call(sort, "sort"), "counted ids are not the values of a sort")
    _expect(not arg(sort, 2, "descending", False), "expert ids sorted in descending order")
    walk.num_experts, walk.sorted_ids = E, counted
    perm = users_getitem(sort, 1)
    _expect(perm is not None, "the sort's permutation is unused")
    flat_ids = sort.args[0]
    _expect(is_call(flat_ids, "reshape", "view", "flatten"), "sorted ids are not the flattened top-k ids")
    topk_ids = flat_ids.args[0]
    _expect(len(shape_of(topk_ids)) == 2, "top-k ids are not [T, K]")
    T, K = shape_of(topk_ids)
    _expect(not dtype_of(topk_ids).is_floating_point, "expert ids are not integers")
    walk.mark(counted, sort, perm, flat_ids)

    # x_g = x[perm // K]
    gathered = walk.through(up.args[0])
    _expect(gathered.op == "call_function" and gathered.target is operator.getitem, "up-projection input is not a row gather")
    x, index = gathered.args
    _expect(
        is_call(index, "floordiv") and index.args[0] is perm and index.args[1] == K,
        "up-projection rows are not gathered by perm // K",
    )
    walk.mark(gathered, index)
    _expect(len(shape_of(x)) == 2 and same_size(shape_of(x)[0], T), "gathered hidden states are not [T, d]")
    d = shape_of(x)[1]

    # weights: W1 [E, 2n, d] via transpose (HF) or [E, d, 2n] as is (transposed layout)
    w1, transposed = _weight_of(up.args[1], walk)
    w2, transposed2 = _weight_of(down.args[1], walk)
    _expect(transposed == transposed2, "up and down weights use different layouts")
    _expect(arg(up, 3, "bias") is None and arg(down, 3, "bias") is None, "grouped_mm with bias is not matched")
    b1, b2 = (_expert_bias(mm, walk) for mm in (up, down))

    # activation between the two grouped mms
    h = walk.forward(up)
    a = walk.through(down.args[0])
    act = identify_activation(h, a)
    _expect(not isinstance(act, str), str(act))
    walk.mark(*backward_slice([a], stop={h}))

    # weighted = y * w_g[:, None];  w_g = topk_weights.reshape(-1)[perm]
    y = walk.forward(down)
    mul = walk.only_reader(y)
    _expect(mul is not None and is_call(mul, "mul", "__mul__"), "expert outputs are not scaled by the routing weights")
    other = mul.args[1] if mul.args[0] is y else mul.args[0]
    _expect(is_call(other, "unsqueeze", "view", "reshape", "__getitem__") or getitem_of(other, (slice(None), None)) is not None, "routing weight is not broadcast per row")
    w_g = other.args[0]
    _expect(getitem_of(w_g, perm) is not None, "routing weights are not permuted by perm")
    flat_w = w_g.args[0]
    _expect(is_call(flat_w, "reshape", "view", "flatten"), "routing weights are not the flattened top-k weights")
    topk_weights = flat_w.args[0]
    _expect(shape_of(topk_weights) == shape_of(topk_ids), "top-k weights and ids differ in shape")
    walk.mark(mul, other, w_g, flat_w)

    # unsorted = weighted[inv_perm];  inv_perm[perm] = arange(TK)
    weighted = walk.forward(mul)
    unsort = walk.only_reader(weighted)
    _expect(unsort is not None and unsort.op == "call_function" and unsort.target is operator.getitem, "weighted rows are not un-permuted")
    inv = unsort.args[1]
    _expect(is_call(inv, "empty_like") and inv.args[0] is perm, "inverse permutation is not built from perm")
    setters = [u for u in inv.users if u is not unsort]
    _expect(len(setters) == 1 and is_call(setters[0], "setitem"), "inverse permutation is not a single scatter")
    setter = setters[0]
    rng = setter.args[2]
    _expect(setter.args[1] is perm and is_call(rng, "arange"), "inverse permutation is not inv[perm] = arange")
    _expect(len(rng.args) == 1 and same_size(shape_of(rng)[0], shape_of(perm)[0]), "arange does not span all rows")
    walk.mark(unsort, inv, setter, rng)

    # out = unsorted.view(T, K, d).sum(1)
    view = walk.only_reader(unsort)
    _expect(view is not None and is_call(view, "view", "reshape"), "rows are not viewed as [T, K, d]")
    vshape = shape_of(view)
    _expect(len(vshape) == 3 and same_size(vshape[1], K) and same_size(vshape[0], T), "rows are not viewed as [T, K, d]")
    anchor = walk.only_reader(view)
    _expect(anchor is not None and is_call(anchor, "sum") and arg(anchor, 1, "dim") in (1, -2, (1,), [1]), "K rows are not summed per token")
    _expect(not arg(anchor, 2, "keepdim", False), "sum keeps the K dimension")
    walk.mark(view, anchor)

    # legality: dtypes and shapes the op takes
    x_dtype = dtype_of(x)
    _expect(x_dtype == dtype_of(w1) == dtype_of(w2), f"hidden states ({x_dtype}) and expert weights ({dtype_of(w1)}) differ in dtype")
    _expect(dtype_of(topk_weights) is not None and dtype_of(topk_weights).is_floating_point, "routing weights are not floating point")
    s1, s2 = shape_of(w1), shape_of(w2)
    _expect(len(s1) == 3 and len(s2) == 3 and s1[0] == E == s2[0], f"expert weights {s1} / {s2} do not hold E={E} experts")
    w1_out = s1[2] if transposed else s1[1]
    n = s2[1] if transposed else s2[2]
    w1_in = s1[1] if transposed else s1[2]
    w2_out = s2[2] if transposed else s2[1]
    _expect(w1_in == d and w2_out == d, f"expert weights {s1} / {s2} do not map d={d}")
    _expect(w1_out == (2 * n if GATED[act["activation"]] else n), f"up-projection width {w1_out} does not fit n={n}")

    # the region must be exactly what was validated (plus integer/shape glue)
    for bias, width, name in ((b1, w1_out, "up"), (b2, d, "down")):
        _expect(bias is None or shape_of(bias) == (E, width), f"{name} bias {shape_of(bias)} is not [E={E}, {width}]")
        _expect(bias is None or dtype_of(bias) == x_dtype, f"{name} bias dtype {dtype_of(bias)} differs from {x_dtype}")
    inputs = {x, topk_ids, topk_weights, w1, w2} | {b for b in (b1, b2) if b is not None}
    region = backward_slice([anchor], stop=inputs)
    for node in list(region):
        region |= {u for u in node.users if is_inplace(u) and walk.is_harmless_inplace(u)}
    unknown = [nd for nd in region if nd not in walk.seen and isinstance(example_value(nd), torch.Tensor)]
    _expect(not unknown, f"unrecognised node(s) in the region: {', '.join(nd.name for nd in unknown[:4])}")
    mutated = [u for node in region for u in node.users if is_inplace(u) and u not in region]
    _expect(not mutated, f"region tensor mutated outside it by {mutated[0].name if mutated else ''}")

    return MoEMatch(
        idiom=IDIOM,
        module=module_path(up),
        anchor=anchor,
        region=region,
        x=x,
        topk_ids=topk_ids,
        topk_weights=topk_weights,
        w1=w1,
        w2=w2,
        b1=b1,
        b2=b2,
        activation=act["activation"],
        interleaved=act["interleaved"],
        transposed=transposed,
        alpha=act["alpha"],
        limit=act["limit"],
        shape={"T": T, "d": d, "n": n, "E": E, "K": K},
        dtype=x_dtype,
        router=_describe_router(topk_ids, topk_weights) + (f" ({module_class(up)})" if module_class(up) else ""),
        shared_expert=describe_shared_expert(up.graph, module_path(up)),
    )
