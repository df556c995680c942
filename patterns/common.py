"""What every pattern shares: the typed match, the rejection, graph helpers and the one rewrite.

A pattern module exposes `find(gm) -> list[MoEMatch | Rejection]`. Finding and checking never
mutate the graph; `rewrite(gm, match)` (here, shared by all idioms) replaces the match's anchor node
with one call of `codegen.moe_experts` (stacked [E, ...] expert weights) or
`codegen.moe_experts_list` (per-expert weight lists, from an `nn.ModuleList`) and erases the nodes
only the region used.
"""
from __future__ import annotations

import contextlib

import dataclasses
import inspect
import operator
import re
import weakref
from typing import Any, Iterable

import torch
import torch.fx as fx


@dataclasses.dataclass
class MoEMatch:
    """One MoE experts region, checked and ready to rewrite."""

    idiom: str  # the pattern module that found it, e.g. "hf_grouped_mm"
    module: str  # the module path from nn_module_stack, e.g. "model.layers.0.mlp.experts"
    anchor: fx.Node  # the node whose value the fused op replaces ([T, d])
    region: set[fx.Node]  # every node the region computes (erased when nothing else uses them)
    x: fx.Node  # [T, d]
    topk_ids: fx.Node  # [T, K] integer
    topk_weights: fx.Node  # [T, K] float; with `gates`, the [T, E] gate matrix
    w1: fx.Node | None = None  # [E, 2n, d] (or [E, d, 2n] when transposed); None in the list form
    w2: fx.Node | None = None  # [E, d, n]  (or [E, n, d] when transposed); None in the list form
    # Gate and up as two stacked [E, n, d] parameters (w1 the gate): the rewrite hands the list op
    # their per-expert views W[e] (read where they lie, no copy), with w2's as the down projections.
    w_up: fx.Node | None = None
    # The combine adds the experts' rows into this [T, d] tensor (a shared expert's output) instead
    # of zeros: it stays in the graph and the rewrite adds the op's output to it.
    added_to: fx.Node | None = None
    b1: fx.Node | None = None
    b2: fx.Node | None = None
    activation: str = "swiglu"
    interleaved: bool = False
    transposed: bool = False
    # w2 stored in the other orientation than w1 (DBRX's [E, f, d] down weights beside [E, f, d] gate
    # and up ones): the rewrite hands the op `w2.transpose(1, 2)`, a view the kernels read through
    # its strides (no copy)
    w2_swapped: bool = False
    alpha: float = 1.702
    limit: float = 7.0
    shape: dict = dataclasses.field(default_factory=dict)  # T, d, n, E, K (T may be symbolic)
    dtype: torch.dtype | None = None  # what the op computes in (x's dtype, or autocast's: see `settle_autocast`)
    autocast_from: torch.dtype | None = None  # under autocast: the dtype the inputs are cast from
    router: str = "unknown"  # what produced topk_ids/weights, for the report
    shared_expert: str = "-"  # a dense expert beside the routed ones (stays in the graph), for the report
    # [T, E] router probabilities the top-k ranked (a softmax/sigmoid output), when the graph shows
    # them: what token rounding ranks tokens by. None: rounding is not offered for this region.
    router_probs: fx.Node | None = None
    module_source: str = ""  # the experts module as Dynamo's source, e.g. "L['self'].model.layers[0].mlp.experts"
    # The list form (an nn.ModuleList of experts): each expert's Linear weights as graph inputs,
    # (w_gate [E x [n or 2n, d]], w_up [] or [E x [n, d]], w_down [E x [d, n]]), never stacked.
    expert_lists: tuple[list[fx.Node], list[fx.Node], list[fx.Node]] | None = None
    # Their Linears' biases, (gate [E x [n or 2n]], up [] or [E x [n]], down [] or [E x [d]]), a list
    # empty where the experts have none; the rewrite stacks them into the op's b1, b2. None: no bias.
    expert_bias_lists: tuple[list[fx.Node], list[fx.Node], list[fx.Node]] | None = None
    # A combine accumulated in place (`out.index_add_(...)` per expert): the tensor whose reads
    # after the anchor (its last in-place add) become reads of the op's output.
    accumulator: fx.Node | None = None
    # topk_weights is a [T, E] gate matrix the checker proved zero outside topk_ids: the rewrite
    # gathers the op's [T, K] weights from it (a squashed gate such as Llama 4's holds them nowhere else)
    gates: bool = False
    # The gate matrix is not proven zero outside the top-k ids (a router's dense probabilities, which
    # the region masks itself): the evaluation fills it there too, so a region that reads it there
    # differs from the op, which reads it at the ids alone.
    gates_dense: bool = False
    # The weights scale each expert's INPUT, not its output (Llama 4): out[t] = sum_k f_e(w[t, k] x[t]).
    # The rewrite runs the op on the T*K scaled rows with unit weights and sums each token's K rows.
    input_scaled: bool = False
    # topk_ids / topk_weights are [T] (a top-1 `max` over the scores): the rewrite hands the op [T, 1]
    flat_top1: bool = False
    # x, the routing and the anchor keep two or more leading token dims ([B, S, d], [B, S, K]: code
    # that never flattens its tokens): the rewrite hands the op their [T, .] views and views the
    # output back as the anchor is shaped. shape["T"] is their product.
    token_dims: bool = False
    # What the region does with an id >= E (expert parallelism's sentinel for an expert on another
    # rank): "drop" (the slot adds nothing: the rewrite calls the op in the slot form with those
    # slots as padding), "clamp" (the slot runs expert E-1, as the region's clamp makes it: the op
    # gets the clamped ids). None: ids are a top-k over E, or an id out of range is the op's error.
    sentinels: str | None = None
    # The rows arrive grouped by expert (experts after a dispatch, no router in the region): topk_ids
    # is the [E] int32 offsets node grouped_mm reads (row r runs expert e where offs[e-1] <= r <
    # offs[e]; rows past offs[-1] are padding), topk_weights is None, T the rows and K 1. The
    # rewrite calls the op in the slot form, one slot per row (`codegen.ops.slots_from_offsets`).
    group_offsets: bool = False
    # Capacity-limited routing (GShard, Switch): a slot past its expert's capacity adds nothing. The
    # region's own nodes that say which slots are kept (nonzero: kept), as (node, kind) pairs: one
    # pair for every slot, or one per slot in slot order. kind "token": [T], each token's slots;
    # "slot": [T, K]; "flat": [T * K], the slots token by token; "expert": [T, E], read at the slot's id. The rewrite gives a dropped slot the id
    # E (`codegen.ops.kept_slot_ids`) and calls the op in the slot form, as for expert-parallel sentinels.
    slot_keep: tuple[tuple[fx.Node, str], ...] | None = None
    verified: str = "-"  # what verification by evaluation found (`patterns.verify`), for the report

    def op_inputs(self) -> list[fx.Node]:
        """The graph nodes the op reads: x, the routing, every weight and bias (lists included)."""
        inputs = [self.x, self.topk_ids, self.topk_weights, self.w1, self.w_up, self.w2, self.b1, self.b2]
        for group in (*(self.expert_lists or ()), *(self.expert_bias_lists or ())):
            inputs += list(group)
        return [node for node in inputs if isinstance(node, fx.Node)]

    def describe(self) -> dict:
        layout = ("interleaved" if self.interleaved else "concatenated") + (", transposed" if self.transposed else "")
        if self.expert_lists is not None:
            w_gate, w_up, _ = self.expert_lists
            gated = w_up or shape_of(w_gate[0])[0] == 2 * self.shape.get("n", -1)
            layout = "per-expert list" + (", separate gate/up" if w_up else f", fused gate/up {layout}" if gated else "")
        elif self.w_up is not None:
            layout = "separate gate/up (two stacked parameters" + (", transposed)" if self.transposed else ")")
        if self.w2_swapped:
            layout += ", down weights in the other orientation"
        if self.b1 is not None or self.b2 is not None or self.expert_bias_lists is not None:
            layout += ", bias"
        if self.input_scaled:
            layout += ", router-scaled inputs"
        if self.sentinels is not None:
            layout += ", ids >= E " + ("dropped" if self.sentinels == "drop" else "clamped to E-1") + " (expert parallel)"
        if self.group_offsets:
            layout += ", rows grouped by expert upstream (offsets)"
        if self.slot_keep is not None:
            layout += ", slots past an expert's capacity dropped"
        return {
            "activation": self.activation,
            "layout": layout,
            "router": self.router,
            "shared": self.shared_expert,
            "verified": self.verified,
            "dtype": _dtype_name(self.dtype) + (f" (autocast, from {_dtype_name(self.autocast_from)})"
                                                if self.autocast_from is not None else ""),
            **{k: str(v) for k, v in self.shape.items()},
        }


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).replace("torch.", "")


# Matrix products as they appear in a Dynamo graph (functions, methods, operator.matmul, ops)
PRODUCTS = ("linear", "mm", "bmm", "matmul", "__matmul__", "addmm", "baddbmm", "addbmm", "einsum", "_grouped_mm",
             "aten::_grouped_mm", "transformers::grouped_mm_fallback")


def settle_autocast(match: MoEMatch) -> None:
    """Under autocast, make the op compute in the dtype the experts' matrix products had.

    Dynamo traces under the ambient autocast state, so a product that autocast lowers (linear, mm,
    bmm, matmul; not `_grouped_mm`, which has no autocast rule) has a bfloat16 or float16 output
    from float32 operands in the graph. The op is not autocast-aware: left alone it would run those
    experts in float32 (on the GPU, float32 kernels many times slower than the eager bf16 step).
    So when every product of the region came out in one lower dtype, the op gets its inputs cast
    to that dtype (as autocast casts them for each product) and its output is cast back to the
    region's. Products in several dtypes (autocast on for some experts only) leave the region
    untouched. Without a dtype-lowering product nothing changes: `_grouped_mm` experts compute in
    float32 under autocast in eager too.
    """
    outs, lowered = set(), False
    for node in match.region | {match.anchor}:
        if not is_call(node, *PRODUCTS):
            continue
        out = dtype_of(node)
        operands = {dt for dt in map(dtype_of, node.all_input_nodes) if dt is not None and dt.is_floating_point}
        outs.add(out)
        lowered |= any(dt != out for dt in operands)
    if not lowered:
        return
    expect(len(outs) == 1, f"the experts' matrix products come out in several dtypes "
           f"({', '.join(sorted(map(_dtype_name, outs)))}): autocast is on for some of them only")
    dtype = outs.pop()
    expect(dtype in (torch.float16, torch.bfloat16), f"autocast computes the experts in {_dtype_name(dtype)}")
    if dtype != match.dtype:
        match.autocast_from, match.dtype = match.dtype, dtype


@dataclasses.dataclass
class Rejection:
    """A candidate region left untouched, with the reason."""

    idiom: str
    module: str
    reason: str
    hint: bool = False  # the reason tells the user what to change (logged as a warning, not at debug)


class NoMatch(Exception):
    """Raised inside the checker with the rejection reason."""


def expect(cond, reason: str):
    if not cond:
        raise NoMatch(reason)


class RegionWalk:
    """Records every node a checker validated (the region must consist of these alone) and knows
    which nodes change no value for ids in [0, E): no-op casts, expert-parallel sentinel masks."""

    def __init__(self, num_experts: int | None = None):
        self.seen: set[fx.Node] = set()
        self.num_experts = num_experts
        self.sorted_ids: fx.Node | None = None
        self.sentinel_masks: set[fx.Node] = set()

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
            self.sentinel_masks.add(node)
        return ok

    def masks_sentinel_rows(self, node: fx.Node) -> bool:
        """Whether the rows of `node` reach their single consumer through a sentinel mask: each row
        whose sorted id is >= E is zeroed there, whatever the experts computed for it."""
        while True:
            users = self.readers(node)
            if len(users) != 1:
                return False
            if self.is_sentinel_mask(users[0]):
                return True
            if not is_noop_cast(users[0]):
                return False
            node = users[0]

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


def expert_bias(mm: fx.Node, index: fx.Node, walk: RegionWalk) -> fx.Node | None:
    """The bias of `out.add_(bias[index])` right after an expert matmul, if any.

    Dynamo keeps later reads on the grouped_mm node itself and orders them after the in-place add,
    so the add must come before every other reader of the output.
    """
    inplace = [u for u in mm.users if is_inplace(u) and not walk.is_sentinel_mask(u)]
    if not inplace:
        return None
    expect(len(inplace) == 1 and is_call(inplace[0], "add_"), f"in-place {inplace[0].name} on a grouped_mm output is not an expert bias")
    add = inplace[0]
    gathered = add.args[1]
    expect(len(add.args) == 2 and not add.kwargs, "expert bias add has an alpha")
    bias = getitem_of(gathered, index)
    expect(bias is not None and len(shape_of(bias)) == 2, "grouped_mm output gets an addend that is not a per-expert bias")
    order = {node: i for i, node in enumerate(mm.graph.nodes)}
    expect(all(order[add] < order[u] for u in mm.users if u is not add), "expert bias is added after the output is read")
    walk.mark(add, gathered)
    return bias


_ROUTER_OPS = ("sigmoid", "softmax", "topk")
_PROJECTIONS = ("linear", "matmul", "mm", "addmm")


def describe_router(topk_ids: fx.Node, topk_weights: fx.Node) -> str:
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


def router_probs(topk_ids: fx.Node, T, E) -> fx.Node | None:
    """The [T, E] softmax/sigmoid output that a top-k over the last dim turned into `topk_ids`.

    Only that exact shape of router qualifies (softmax -> topk, sigmoid -> topk): a top-k over
    logits, biased or group-masked scores ranks by something else, and rounding by the wrong
    score would route differently from what the model's router means.
    """
    topk = topk_ids.args[0] if is_call(topk_ids, "getitem") and topk_ids.args[1] == 1 else None
    if not is_call(topk, "topk"):
        return None
    scores = arg(topk, 0, "input")
    dim = arg(topk, 2, "dim", -1)
    largest = arg(topk, 3, "largest", True)
    if not is_call(scores, "softmax", "sigmoid") or dim not in (-1, 1) or largest is not True:
        return None
    shape = shape_of(scores)
    return scores if len(shape) == 2 and same_size(shape[0], T) and same_size(shape[1], E) else None


def example_value(node: Any):
    """The fake tensor (or SymInt) Dynamo recorded for a node, or the literal itself."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def module_path(node: fx.Node) -> str:
    """'model.layers.0.mlp.experts' from Dynamo's nn_module_stack ("L['self'].model..." keys)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<graph>"
    path = list(stack.values())[-1][0]
    for prefix in ("L['self'].", "L['self']", "self."):
        if path.startswith(prefix):
            path = path[len(prefix):]
    return path or "<root>"


def module_source(node: fx.Node) -> str:
    """The innermost module of `node` as Dynamo names it: "L['self'].model.layers[0].mlp.experts"."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def module_class(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    cls = list(stack.values())[-1][1]
    return getattr(cls, "__name__", str(cls))


_PATHS: "weakref.WeakKeyDictionary[fx.Graph, tuple[int, set[str]]]" = weakref.WeakKeyDictionary()


def _module_paths(graph: fx.Graph) -> set[str]:
    """The module paths of the graph's calls, found once per graph and node count (the finders of a
    pass read an unchanged graph, once per region)."""
    known = _PATHS.get(graph)
    if known is None or known[0] != len(graph.nodes):
        paths = {module_path(n) for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")}
        _PATHS[graph] = known = (len(graph.nodes), paths)
    return known[1]


def describe_shared_expert(graph: fx.Graph, experts_module: str) -> str:
    """'-', 'plain' or 'sigmoid-gated': a shared_expert(s) sibling of the experts module in the graph."""
    parent = experts_module.rsplit(".", 1)[0]
    paths = _module_paths(graph)
    shared = [p for p in paths if p.startswith(parent + ".shared_expert")]
    if not shared:
        return "-"
    return "sigmoid-gated" if any(p.startswith(parent + ".shared_expert_gate") for p in shared) else "plain"


def einsum_parts(node: fx.Node) -> tuple[list[str], list, str] | None:
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


def call_sizes(node: fx.Node) -> tuple:
    """The sizes of `t.expand(...)` / `t.repeat(...)` / `t.view(...)`, given as arguments or as one tuple."""
    sizes = tuple(node.args[1:])
    return tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)) else sizes


def op_name(target: Any) -> str:
    """A stable name for a call target: 'transformers::grouped_mm_fallback', 'sort', 'view'..."""
    name = getattr(target, "_qualified_op_name", None)
    if name:
        return name
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return getattr(target, "__name__", str(target))


def is_call(node: Any, *names: str) -> bool:
    """A call_function or call_method node whose target's name is one of `names`."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    return (node.target if node.op == "call_method" else op_name(node.target)) in names


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def is_getitem(node: Any) -> bool:
    """`src[...]`: an operator.getitem call node."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem


def table_index(node: Any) -> tuple[fx.Node, fx.Node] | None:
    """(table, index) of `table[index]`, also spelt `table[index, ...]` or `table[index, :, :]` (as
    gpt-oss's reference code does), both nodes; else None."""
    if not (is_getitem(node) and len(node.args) == 2):
        return None
    table, index = node.args
    if isinstance(index, tuple):
        if not index or any(i is not Ellipsis and i != slice(None) for i in index[1:]):
            return None
        index = index[0]
    return (table, index) if isinstance(table, fx.Node) and isinstance(index, fx.Node) else None


def is_int(value: Any) -> bool:
    """A Python int constant (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def flattens_indices(user: fx.Node, node: fx.Node) -> bool:
    """`user` reads the [N, 1] nonzero indices `node` of a 1-D mask as one vector: `node.squeeze(-1)`
    (or `()`, `1`), `node.view(-1)`, `node.reshape(-1)` or `node.flatten()`."""
    if not (user.args and user.args[0] is node):
        return False
    return ((is_call(user, "squeeze") and user.args[1:] in ((), (-1,), (1,)) and not user.kwargs)
            or (is_call(user, "view", "reshape") and user.args[1:] in ((-1,), ((-1,),)))
            or (is_call(user, "flatten") and len(user.args) == 1 and not user.kwargs))


def unit_slice(index: Any) -> int | None:
    """e when `index` is the constant slice e:e+1 (no step, or 1): one column kept as a dim."""
    if isinstance(index, slice) and is_int(index.start) and index.stop == index.start + 1 and index.step in (None, 1):
        return index.start
    return None


def getitem_of(node: Any, index: Any) -> fx.Node | None:
    """If `node` is `src[index]` (operator.getitem), return src."""
    if is_getitem(node):
        if node.args[1] == index:
            return node.args[0]
    return None


def users_getitem(node: fx.Node, index: int) -> fx.Node | None:
    for user in node.users:
        if is_getitem(user) and user.args[1] == index:
            return user
    return None


def is_noop_cast(node: fx.Node) -> bool:
    """`.to(dtype)`/`.contiguous()` (`.float()`, `.bfloat16()`...) that keeps the dtype of its input
    (so it changes no value)."""
    if not is_call(node, "to", "contiguous", "type_as", "float", "half", "bfloat16", "double"):
        return False
    src, out = example_value(node.args[0]), example_value(node)
    return isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype == out.dtype


def shape_of(node: Any) -> tuple:
    val = example_value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


# Tensor methods that only change the dtype (`.type_as(other)` takes other's)
CAST_METHODS = ("to", "float", "half", "bfloat16", "type", "type_as")


def dtype_of(node: Any) -> torch.dtype | None:
    val = example_value(node)
    return val.dtype if isinstance(val, torch.Tensor) else None


def same_size(a: Any, b: Any) -> bool:
    """Size equality that is sound for symbolic sizes: equal only if provably equal."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(a == b)
    except Exception:  # an unprovable symbolic comparison is "not equal"
        return False


def same_shape(a: Any, b: Any) -> bool:
    """Two shapes (tuples of sizes) provably equal (`same_size` of each pair)."""
    return a is not None and b is not None and len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def backward_slice(outputs: Iterable[fx.Node], stop: set[fx.Node]) -> set[fx.Node]:
    """All nodes that `outputs` depend on, not walking past `stop` (stop nodes excluded)."""
    seen: set[fx.Node] = set()
    todo = [n for n in outputs if n not in stop]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for inp in node.all_input_nodes:
            if inp not in stop and inp not in seen:
                todo.append(inp)
    return seen


INPLACE_FNS = {"setitem"}
# Python's augmented assignments (`t += u`, `t *= 0.5`): Dynamo keeps them as operator.iadd & co.
AUGMENTED_FNS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand", "ior", "ixor",
                 "ilshift", "irshift"}


def is_inplace(node: fx.Node) -> bool:
    """An in-place method or function (`add_`, `setitem`): a node whose effect is its write. The
    augmented assignments are not among them: their result is the written tensor, and later code
    reads it through them (see `writes_in_place`)."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("_")
    if node.op == "call_function":
        name = op_name(node.target)
        return name in INPLACE_FNS or (name.endswith("_") and not name.startswith("_"))
    return False


def writes_in_place(node: fx.Node) -> bool:
    """Writes into the storage of its first argument: an in-place node, an augmented assignment on
    a tensor, which writes into it and every view sharing its storage (`rows = x.view(-1);
    rows *= 0.5` changes x), or a functional called with `inplace=True` (`F.relu(v, inplace=True)`,
    `F.dropout(v, p, training, True)`: what `nn.ReLU(inplace=True)` becomes)."""
    if node.op == "call_function" and op_name(node.target) in AUGMENTED_FNS:
        return bool(node.args) and isinstance(example_value(node.args[0]), torch.Tensor)
    return is_inplace(node) or _inplace_flag(node)


def _inplace_flag(node: fx.Node) -> bool:
    """A call_function whose `inplace` argument, by keyword or position, is True."""
    if node.op != "call_function":
        return False
    if node.kwargs.get("inplace") is True:
        return True
    signature = _signature(node.target)
    if signature is None or "inplace" not in signature.parameters:
        return False
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:
        return False
    return bound.arguments.get("inplace") is True


_SIGNATURES: dict = {}  # call target -> its inspect.Signature or None (parsing one takes ~0.5 ms)


def _signature(target) -> inspect.Signature | None:
    """`inspect.signature(target)`, remembered per target; None for builtins and C functions without one."""
    try:
        return _SIGNATURES[target]
    except KeyError:
        pass
    except TypeError:  # an unhashable target
        return _signature_uncached(target)
    _SIGNATURES[target] = found = _signature_uncached(target)
    return found


def _signature_uncached(target) -> inspect.Signature | None:
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


def fake_mode_of(gm: fx.GraphModule):
    for node in gm.graph.nodes:
        val = example_value(node)
        if isinstance(val, torch.Tensor) and hasattr(val, "fake_mode"):
            return val.fake_mode
    return None


SAVE_H_ARG = {"moe_experts": 12, "moe_experts_list": 12, "moe_experts_split": 13}  # where each op takes save_h


def _grad_flows(match: MoEMatch, *fakes) -> bool:
    """Whether a gradient can flow through the region: its traced result wants one (Dynamo traced it
    under the grad mode the region runs in, `no_grad` / `enable_grad` blocks included). Without that
    fake, the op's inputs and the grad mode at compile time decide (`needs_saved_h`). It decides the
    op's `save_h` and whether the call is the `nograd` overload."""
    from moe_compiler.codegen.ops import needs_saved_h

    result = example_value(match.anchor)
    if isinstance(result, torch.Tensor):
        return result.requires_grad
    return needs_saved_h(*fakes)


def rewrite(gm: fx.GraphModule, match: MoEMatch, token_rounding: str | None = None) -> fx.Node:
    """Replace `match.anchor` with one `sonic::moe_experts` call; erase what only the region used.

    The registered op itself goes into the graph (not a Python wrapper): AOTAutograd's cache only
    accepts op targets. Inputs are validated here, on the fake values, so a bad match fails at
    compile time (and the driver restores the graph) rather than in the user's step.

    `token_rounding` (a mode; needs `match.router_probs`) routes through `sonic::round_routing_slots`
    first and calls the op in the slot form. Where no gradient can flow through the region, the call is
    the op's `nograd` overload (`codegen.nograd`: the same op without its Python autograd layer).
    """
    from moe_compiler.codegen.nograd import overload
    from moe_compiler.codegen.ops import drop_slots_from, kept_slot_ids, slots_from_offsets, validate_moe_inputs
    from moe_compiler.codegen.token_rounding import M_TILE

    graph = gm.graph
    fake_mode = fake_mode_of(gm)
    inserted: list[fx.Node] = []

    def insert(target, args, kwargs=None):
        node = insert_call(gm, match.anchor, target, args, kwargs)
        inserted.append(node)
        return node

    def to(node, dtype):  # a `.to(dtype)` node, with its fake value
        with graph.inserting_before(match.anchor):
            out = graph.call_method("to", (node, dtype))
        inserted.append(out)
        if fake_mode is not None:
            out.meta["example_value"] = example_value(node).to(dtype)
        return out

    def cast(node):  # autocast (`settle_autocast`): the op's tensors in the dtype it computes in
        return node if node is None or dtype_of(node) == match.dtype else to(node, match.dtype)

    def experts(name, args):  # save_h says whether a gradient flows (`_grad_flows`); `nograd` where none does
        return insert(overload(name, args[SAVE_H_ARG[name]]), args)

    x, ids, weights, slot_token = match.x, match.topk_ids, match.topk_weights, None
    if match.token_dims:  # [B, S, .] -> [T, .]: views of the region's own inputs (no size baked in)
        x = insert(torch.flatten, (x, 0, -2))
        ids = insert(torch.flatten, (ids,) if match.flat_top1 else (ids, 0, -2))  # a top-1's [B, S] ids: [T]
        weights = insert(torch.flatten, (weights,) if match.flat_top1 and not match.gates else (weights, 0, -2))
    if match.flat_top1:  # [T] ids (and weights, unless a gate matrix holds them) as [T, 1]
        ids = insert(torch.unsqueeze, (ids, -1))
        weights = weights if match.gates else insert(torch.unsqueeze, (weights, -1))
    if match.gates:  # the [T, K] weights at the top-k ids of a gate matrix zero elsewhere
        weights = insert(torch.gather, (weights, 1, ids))
    if match.input_scaled:  # one row per (token, k): x[t] * w[t, k], through expert ids[t, k], weight 1
        if token_rounding is not None:
            raise ValueError("token rounding does not apply to experts whose inputs the router scales")
        x = insert(torch.mul, (insert(torch.unsqueeze, (x, 1)), insert(torch.unsqueeze, (weights, -1))))
        x = insert(torch.reshape, (x, (-1, match.shape["d"])))
        ids = insert(torch.reshape, (ids, (-1, 1)))
        weights = insert(torch.ones_like, (ids,), {"dtype": dtype_of(match.topk_weights)})
    x = cast(x)  # after the scaling, which the region computes before its products too
    if match.sentinels is not None and token_rounding is not None:
        raise ValueError("token rounding does not apply to routing with expert-parallel sentinels")
    if match.group_offsets:  # one slot per row, its expert from the offsets; rows past the last are padding
        if token_rounding is not None:
            raise ValueError("token rounding does not apply to rows grouped by expert upstream")
        ids, weights, slot_token = slots_from_offsets(x, ids, match.shape["E"], apply=insert)
    if match.slot_keep is not None:  # capacity: a slot the region does not keep becomes a sentinel, dropped below
        if token_rounding is not None:
            raise ValueError("token rounding does not apply to capacity-limited routing")
        ids = kept_slot_ids(ids, match.slot_keep, match.shape["E"], apply=insert, token_dims=match.token_dims)
    if match.sentinels == "drop" or match.slot_keep is not None:  # the slot form with the dropped slots as padding
        ids, weights, slot_token = drop_slots_from(ids, weights, match.shape["E"], K=shape_of(ids)[1], apply=insert)
    elif match.sentinels == "clamp":
        ids = insert(torch.clamp, (ids, 0, match.shape["E"] - 1))
    if token_rounding is not None:
        if match.router_probs is None:
            raise ValueError("token rounding needs the router probabilities, which this region does not show")
        rounded = insert(torch.ops.sonic.round_routing_slots.default,
                         (match.router_probs, ids, weights, M_TILE, token_rounding, True))
        ids, weights, slot_token = (insert(operator.getitem, (rounded, i)) for i in range(3))

    down = insert(torch.transpose, (match.w2, 1, 2)) if match.w2_swapped else match.w2
    if match.w_up is not None:  # two stacked parameters: the split op (the list form on their per-expert views)
        stacked = tuple(cast(t) for t in (match.w1, match.w_up, down))
        call = experts("moe_experts_split", _split_call_args(match, stacked, x, ids, weights, slot_token))
    elif match.expert_lists is None:
        b1, b2 = (insert(torch.squeeze, (b, 1)) if b is not None and len(shape_of(b)) == 3 else b  # [E, 1, w] -> [E, w]
                  for b in (match.b1, match.b2))
        w1, w2, b1, b2 = (cast(t) for t in (match.w1, down, b1, b2))
        fakes = [example_value(a) for a in (x, ids, weights, w1, w2, b1, b2)]
        validate_moe_inputs(*fakes, activation=match.activation, transposed=match.transposed,
                            slot_token=example_value(slot_token))
        save_h = _grad_flows(match, fakes[0], *fakes[2:])
        args = (
            x, ids, weights, w1, w2, b1, b2,
            match.activation, match.interleaved, match.transposed, float(match.alpha), float(match.limit), save_h,
            slot_token,
        )
        call = experts("moe_experts", args)
    else:
        lists = tuple([cast(w) for w in group] for group in match.expert_lists)
        b1, b2 = _stacked_list_biases(match.expert_bias_lists, insert)
        call = experts("moe_experts_list", _list_call_args(match, lists, cast(b1), cast(b2), x, ids, weights, slot_token))
    result = out = insert(operator.getitem, (call, 0))
    if match.input_scaled:  # [T*K, d] rows -> [T, d]
        rows = insert(torch.reshape, (out, (-1, match.shape["K"], match.shape["d"])))
        result = out = insert(torch.sum, (rows, 1))
    if match.token_dims:  # [T, d] -> the anchor's [B, S, d], which is x's shape
        result = out = insert(torch.Tensor.reshape_as, (out, match.x))
    anchor_dtype = dtype_of(match.anchor if match.accumulator is None else match.accumulator)
    if anchor_dtype is not None and anchor_dtype != match.dtype:
        result = to(out, anchor_dtype)
    if match.added_to is not None:  # the combine started from this tensor, not from zeros
        result = insert(torch.add, (match.added_to, result))
    for node in inserted:
        node.meta.update({k: v for k, v in match.anchor.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
    if match.accumulator is None:
        match.anchor.replace_all_uses_with(result)
    else:
        _replace_accumulator(graph, match, result)
    erase_dead(graph, match.region | {match.anchor})
    return call


def _stacked_list_biases(bias_lists, insert) -> tuple[fx.Node | None, fx.Node | None]:
    """(b1 [E, w1_out], b2 [E, d]) nodes stacking the list form's per-expert biases (gate then up
    for separate gate and up), None where there are none. A copy of E (w1_out + d) elements a call,
    1/d of the weights' size; autograd takes each bias its row of the stacked gradient."""
    if bias_lists is None:
        return None, None
    b_gate, b_up, b_down = bias_lists
    b1 = insert(torch.stack, (list(b_gate), 0)) if b_gate else None
    if b1 is not None and b_up:
        b1 = insert(torch.cat, ([b1, insert(torch.stack, (list(b_up), 0))], 1))
    b2 = insert(torch.stack, (list(b_down), 0)) if b_down else None
    return b1, b2


def _list_call_args(match: MoEMatch, lists, b1: fx.Node | None, b2: fx.Node | None, x: fx.Node, ids: fx.Node,
                    weights: fx.Node, slot_token: fx.Node | None) -> tuple:
    """`sonic::moe_experts_list` arguments, validated on the fake values (as the stacked form is);
    `lists`: the (gate, up, down) weight nodes of `match.expert_lists`, cast if autocast needs it;
    b1, b2: the stacked biases (`_stacked_list_biases`)."""
    from moe_compiler.codegen.ops import validate_moe_list_inputs

    w_gate, w_up, w_down = (list(group) for group in lists)
    fake = lambda nodes: [example_value(n) for n in nodes]  # noqa: E731
    rows, x, fake_weights = x, example_value(x), example_value(weights)
    fake_b1, fake_b2 = example_value(b1), example_value(b2)
    validate_moe_list_inputs(x, example_value(ids), fake_weights, fake(w_gate), fake(w_up), fake(w_down), fake_b1,
                             fake_b2, activation=match.activation, interleaved=match.interleaved,
                             slot_token=example_value(slot_token))
    save_h = _grad_flows(match, x, fake_weights, fake_b1, fake_b2, *fake(w_gate), *fake(w_up), *fake(w_down))
    return (
        rows, ids, weights, w_gate, w_up, w_down, b1, b2,
        match.activation, match.interleaved, float(match.alpha), float(match.limit), save_h, slot_token,
    )


def _split_call_args(match: MoEMatch, stacked, x: fx.Node, ids: fx.Node, weights: fx.Node,
                     slot_token: fx.Node | None) -> tuple:
    """`sonic::moe_experts_split` arguments: the stacked gate, up and down weights, validated as the
    list form validates their per-expert views."""
    from moe_compiler.codegen.ops import _expert_views, validate_moe_list_inputs

    views = [_expert_views(example_value(w), match.transposed) for w in stacked]
    fake_x, fake_weights = example_value(x), example_value(weights)
    validate_moe_list_inputs(fake_x, example_value(ids), fake_weights, *views, None, None,
                             activation=match.activation, interleaved=match.interleaved,
                             slot_token=example_value(slot_token))
    save_h = _grad_flows(match, fake_x, fake_weights, None, None, *(example_value(w) for w in stacked))
    return (x, ids, weights, *stacked, None, None, match.activation, match.interleaved, match.transposed,
            float(match.alpha), float(match.limit), save_h, slot_token)


def _replace_accumulator(graph: fx.Graph, match: MoEMatch, result: fx.Node) -> None:
    """An in-place combine: reads of the accumulator (or of its in-place adds' results) outside the
    region, all after the last add (the checker made sure), read the op's output instead; then the
    region's in-place adds go, last first, so the accumulator itself becomes dead."""
    acc, region = match.accumulator, match.region | {match.anchor}
    adds = [n for n in graph.nodes if n in region and is_inplace(n) and n.args[0] is acc]
    for alias in (acc, *adds):
        alias.replace_all_uses_with(result, delete_user_cb=lambda user: user not in region)
    for node in reversed(adds):
        if not node.users:
            graph.erase_node(node)
            match.region.discard(node)


ZEROS = ("zeros", "zeros_like", "new_zeros")  # a fresh tensor of zeros
_FRESH_BUFFERS = ("empty", "empty_like", "zeros", "zeros_like", "new_empty", "new_zeros")


def erase_dead(graph: fx.Graph, region: set[fx.Node]) -> None:
    """Erase region nodes nothing outside the erased set uses, in-place side users included.

    In-place nodes of the region (setitem on the inverse permutation, sentinel masked_fill_) have
    no users; they go when every node they mutate goes. Writes into a tensor the region made that
    nothing reads but other such writes (`y[flat == e] = ...` for every e, once the combine that read
    y is gone) go together.
    """

    def dead_write(node: fx.Node, target: fx.Node) -> bool:  # into a fresh buffer of the region: no alias outside
        return (node in region and target in region and is_call(target, *_FRESH_BUFFERS) and not node.users
                and is_inplace(node) and node.args[0] is target)

    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node not in region or node.op in ("placeholder", "output", "get_attr"):
                continue
            if node.users:
                continue
            if is_inplace(node) and node.args and isinstance(node.args[0], fx.Node):
                target = node.args[0]
                if any(u is not node and not dead_write(u, target) for u in target.users):
                    continue  # still mutates a tensor someone reads
            graph.erase_node(node)
            region.discard(node)
            changed = True


def scaled_by_routing_weights(y: fx.Node, walk: RegionWalk, topk_ids: fx.Node, perm: fx.Node | None = None):
    """(mul, topk_weights) for `y * w.reshape(-1)[perm].unsqueeze(-1)` (no `[perm]` when perm is None)."""
    mul = walk.only_reader(y)
    expect(mul is not None and is_call(mul, "mul", "__mul__"), "expert outputs are not scaled by the routing weights")
    other = mul.args[1] if mul.args[0] is y else mul.args[0]
    broadcast = is_call(other, "unsqueeze", "view", "reshape") or getitem_of(other, (slice(None), None)) is not None
    expect(broadcast and isinstance(other.args[0], fx.Node), "routing weight is not broadcast per row")
    flat_w = walk.through(other.args[0])
    walk.mark(mul, other)
    if perm is not None:
        expect(getitem_of(flat_w, perm) is not None, "routing weights are not permuted by perm")
        walk.mark(flat_w)
        flat_w = flat_w.args[0]
    expect(is_call(flat_w, "reshape", "view", "flatten"), "routing weights are not the flattened top-k weights")
    topk_weights = flat_w.args[0]
    expect(shape_of(topk_weights) == shape_of(topk_ids), "top-k weights and ids differ in shape")
    walk.mark(flat_w)
    return mul, topk_weights


def check_inverse_permutation(unsort: fx.Node, perm: fx.Node, walk: RegionWalk) -> None:
    """`rows[inv]` (the `unsort` node) reads rows back through perm's inverse: `inv =
    torch.empty_like(perm); inv[perm] = torch.arange(TK)`, one scatter over every row."""
    inv = unsort.args[1]
    expect(is_call(inv, "empty_like") and inv.args[0] is perm, "the rows are un-sorted by an index that is not perm's inverse")
    setters = [u for u in inv.users if u is not unsort]
    expect(len(setters) == 1 and is_call(setters[0], "setitem"), "the inverse permutation is not a single scatter")
    setter = setters[0]
    rng = setter.args[2]
    expect(setter.args[1] is perm and is_call(rng, "arange") and len(rng.args) == 1
           and same_size(shape_of(rng)[0], shape_of(perm)[0]), "the inverse permutation is not inv[perm] = arange(TK)")
    walk.mark(unsort, inv, setter, rng)


def summed_per_token(rows: fx.Node, walk: RegionWalk, T, K) -> fx.Node:
    """The `rows.view(T, K, d).sum(1)` node, [T, d]: the anchor the fused op replaces."""
    view = walk.only_reader(rows)
    expect(view is not None and is_call(view, "view", "reshape"), "rows are not viewed as [T, K, d]")
    vshape = shape_of(view)
    expect(len(vshape) == 3 and same_size(vshape[1], K) and same_size(vshape[0], T), "rows are not viewed as [T, K, d]")
    anchor = walk.only_reader(view)
    expect(anchor is not None and is_call(anchor, "sum") and arg(anchor, 1, "dim") in (1, -2, (1,), [1]), "K rows are not summed per token")
    expect(not arg(anchor, 2, "keepdim", False), "sum keeps the K dimension")
    walk.mark(view, anchor)
    return anchor


def check_stacked_biases(b1, b2, *, E, w1_out, d, x_dtype) -> None:
    """Stacked expert biases, where present: b1 [E, w1_out], b2 [E, d] (or [E, 1, width], each expert's
    bias kept as a row its [C, width] rows broadcast with: the op reads its [E, width] view), in the
    hidden states' dtype."""
    for bias, width, name in ((b1, w1_out, "up"), (b2, d, "down")):
        expect(bias is None or shape_of(bias) in ((E, width), (E, 1, width)),
               f"{name} bias {shape_of(bias)} is not [E={E}, {width}]")
        expect(bias is None or dtype_of(bias) == x_dtype, f"{name} bias dtype {dtype_of(bias)} differs from {x_dtype}")


def finish_match(idiom, site, walk, anchor, x, topk_ids, topk_weights, w1, w2, b1, b2, transposed, act, *, E, K, T, d,
                 w_up=None, added_to=None, group_offsets=False, token_dims=False, w2_swapped=False) -> MoEMatch:
    """Legality shared by every idiom (dtypes, shapes, a closed region), then the typed match.
    `w_up`: the up projection's own stacked parameter, shaped as w1 (the gate) then; `added_to`: see
    MoEMatch (outside the region); `group_offsets`: topk_ids is the rows' [E] group offsets and
    there are no weights (see MoEMatch); `token_dims`, `w2_swapped`: see MoEMatch."""
    from moe_compiler.codegen.activations import GATED

    x_dtype = dtype_of(x)
    expect(x_dtype == dtype_of(w1) == dtype_of(w2), f"hidden states ({x_dtype}) and expert weights ({dtype_of(w1)}) differ in dtype")
    if w_up is not None:
        expect(GATED[act["activation"]], "separate gate and up parameters need a gated activation")
        expect(shape_of(w_up) == shape_of(w1) and dtype_of(w_up) == x_dtype,
               f"up weights {shape_of(w_up)} ({dtype_of(w_up)}) are not shaped as the gate's {shape_of(w1)} ({x_dtype})")
        expect(b1 is None, "biases on separate stacked gate and up parameters are not supported")
    if group_offsets:
        expect(topk_weights is None and dtype_of(topk_ids) == torch.int32 and shape_of(topk_ids) == (E,),
               f"grouped_mm offsets are not [E={E}] int32")
    else:
        expect(dtype_of(topk_weights) is not None and dtype_of(topk_weights).is_floating_point,
               "routing weights are not floating point")
        expect(dtype_of(topk_ids) is not None and not dtype_of(topk_ids).is_floating_point, "expert ids are not integers")
    s1, s2 = shape_of(w1), shape_of(w2)
    expect(len(s1) == 3 and len(s2) == 3 and s1[0] == E == s2[0], f"expert weights {s1} / {s2} do not hold E={E} experts")
    w1_in, w1_out = (s1[1], s1[2]) if transposed else (s1[2], s1[1])
    w1_out *= 1 if w_up is None else 2
    n, w2_out = (s2[1], s2[2]) if transposed != w2_swapped else (s2[2], s2[1])
    expect(w1_in == d and w2_out == d, f"expert weights {s1} / {s2} do not map d={d}")
    expect(w1_out == (2 * n if GATED[act["activation"]] else n), f"up-projection width {w1_out} does not fit n={n}")
    check_stacked_biases(b1, b2, E=E, w1_out=w1_out, d=d, x_dtype=x_dtype)

    # the region must be exactly what was validated (plus integer/shape glue)
    inputs = {x, topk_ids, w1, w2} | {b for b in (topk_weights, b1, b2, w_up, added_to) if b is not None}
    region = backward_slice([anchor], stop=inputs)
    for node in list(region):
        region |= {u for u in node.users if is_inplace(u) and walk.is_harmless_inplace(u)}
    check_closed(region, walk)
    return MoEMatch(
        idiom=idiom,
        anchor=anchor,
        region=region,
        x=x,
        topk_ids=topk_ids,
        topk_weights=topk_weights,
        w1=w1,
        w2=w2,
        w_up=w_up,
        added_to=added_to,
        b1=b1,
        b2=b2,
        activation=act["activation"],
        interleaved=act["interleaved"],
        transposed=transposed,
        alpha=act["alpha"],
        limit=act["limit"],
        shape={"T": T, "d": d, "n": n, "E": E, "K": K},
        dtype=x_dtype,
        group_offsets=group_offsets,
        token_dims=token_dims,
        w2_swapped=w2_swapped,
        **site_fields(site, topk_ids, topk_weights, T, E, experts_module=module_path(site)),
    )


def grad_modes(graph: fx.Graph) -> dict[fx.Node, bool]:
    """Each node's grad mode: the graph starts in the mode it is compiled under, and each
    `torch.no_grad` / `set_grad_enabled` switch inside it (a node no value reads) sets the mode of
    the nodes after it."""
    mode, modes = torch.is_grad_enabled(), {}
    for node in graph.nodes:
        if is_call(node, "_set_grad_enabled", "set_grad_enabled") and node.args and isinstance(node.args[0], bool):
            mode = node.args[0]
        modes[node] = mode
    return modes


def check_grad_mode_unchanged(match: MoEMatch, modes: dict[fx.Node, bool] | None = None) -> None:
    """The op runs where the anchor stood, under the grad mode there; eager ran each region node
    under its own. A region whose float values were computed under another grad mode than the
    anchor's (`torch.no_grad`, `set_grad_enabled` inside the graph) would give the op gradients
    eager has not, or the reverse, so it is left alone. A switch around other code (a buffer updated
    under no_grad between the router and the experts) leaves the region's modes alone. `modes`:
    `grad_modes` of the match's graph, where the caller checks several matches of one graph."""
    modes = grad_modes(match.anchor.graph) if modes is None else modes
    other = next((n for n in match.region if n in modes and modes[n] != modes[match.anchor]
                  and isinstance(example_value(n), torch.Tensor) and example_value(n).is_floating_point()), None)
    expect(other is None, f"{other.name if other else ''} is computed under another grad mode than the region's end "
                          f"(torch.no_grad or set_grad_enabled inside it): the op would not compute the gradients "
                          f"eager computes")


def check_inputs_unmutated(match: MoEMatch) -> None:
    """The op reads its inputs where the anchor stood; eager read them where the region read them.
    A node outside the region that writes in place into an input's storage (x, the routing, a
    weight, or a view of one) after a region node has read that storage and before the anchor would
    make the two differ, so such a region is left alone. A write before the region's first read of
    that storage is seen by both (Qwen3's router divides its top-k values in place, `/=`, before the
    experts read them). Storage identity comes from the fake tensors, which share one storage
    between a tensor and its views."""
    watched = {ref: node for node in match.op_inputs() if (ref := storage_of(node)) is not None}
    region = match.region | {match.anchor}
    read: set = set()  # the watched storages a region node has read so far
    for node in match.anchor.graph.nodes:
        if node is match.anchor:
            return
        if node in region:
            read |= {ref for inp in node.all_input_nodes if (ref := storage_of(inp)) in watched}
            continue
        if not read:
            continue
        written = [node.kwargs["out"]] if isinstance(node.kwargs.get("out"), fx.Node) else []
        if writes_in_place(node) and node.args and isinstance(node.args[0], fx.Node):
            written.append(node.args[0])
        for target in written:
            ref = storage_of(target)
            expect(ref is not None, f"{node.name} writes in place into {target.name} inside the region, of no known storage")
            expect(ref not in read, f"{node.name} writes in place into {watched.get(ref, target).name} (or a view of it) "
                   f"inside the region, which the op would read only where the region ends")


def storage_of(node):
    """The storage of a node's fake tensor (views share their base's), or None for a non-tensor."""
    from torch.multiprocessing.reductions import StorageWeakRef

    value = example_value(node)
    return StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else None


def check_closed(region: set[fx.Node], walk: RegionWalk) -> None:
    """The region holds only nodes a checker validated, and nothing outside it mutates them."""
    unknown = [nd for nd in region if nd not in walk.seen and isinstance(example_value(nd), torch.Tensor)]
    expect(not unknown, f"unrecognised node(s) in the region: {', '.join(nd.name for nd in unknown[:4])}")
    mutated = [u for node in region for u in node.users if is_inplace(u) and u not in region and u.args and u.args[0] is node]
    expect(not mutated, f"region tensor mutated outside it by {mutated[0].name if mutated else ''}")


def site_fields(site: fx.Node, topk_ids: fx.Node, topk_weights: fx.Node, T, E, *, experts_module: str) -> dict:
    """The MoEMatch fields read off the region's site: module, router, shared expert, router probs."""
    cls = module_class(site)
    grouped = topk_weights is None  # rows grouped upstream: topk_ids are grouped_mm's offsets
    return dict(
        module=module_path(site),
        router=("none: rows grouped by expert upstream" if grouped else describe_router(topk_ids, topk_weights))
        + (f" ({cls})" if cls else ""),
        shared_expert=describe_shared_expert(site.graph, experts_module),
        router_probs=None if grouped else router_probs(topk_ids, T, E),
        module_source=module_source(site),
    )


def insert_call(gm: fx.GraphModule, before: fx.Node, target, args, kwargs=None, autocast=None) -> fx.Node:
    """A call_function node before `before`, with its fake value and `before`'s module metadata.
    `autocast`: the dtype of the autocast region the node runs in (its fake value is computed as
    autocast would compute it there), or None."""
    with gm.graph.inserting_before(before):
        node = gm.graph.call_function(target, args, kwargs or {})
    fake_mode = fake_mode_of(gm)
    if fake_mode is not None:
        fake_args, fake_kwargs = fx.node.map_arg(args, example_value), fx.node.map_arg(kwargs or {}, example_value)
        shape_env = fake_mode.shape_env
        # a data-dependent size (torch.where's) is a fresh symbol only this value carries: not one the
        # traced graph must bind
        quiet = shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else contextlib.nullcontext()
        with fake_mode, quiet:
            if autocast is None:
                node.meta["example_value"] = target(*fake_args, **fake_kwargs)
            else:
                device = next(a.device.type for a in fake_args if isinstance(a, torch.Tensor))
                with torch.autocast(device, dtype=autocast):
                    node.meta["example_value"] = target(*fake_args, **fake_kwargs)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in before.meta:
            node.meta[key] = before.meta[key]
    return node
