"""What every pattern shares: the typed match, the rejection, graph helpers and the one rewrite.

A pattern module exposes `find(gm) -> list[MoEMatch | Rejection]`. Finding and checking never
mutate the graph; `rewrite(gm, match)` (here, shared by all idioms) replaces the match's anchor node
with one call of `codegen.moe_experts` and erases the nodes only the region used.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Iterable

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
    topk_weights: fx.Node  # [T, K] float
    w1: fx.Node  # [E, 2n, d] (or [E, d, 2n] when transposed)
    w2: fx.Node  # [E, d, n]  (or [E, n, d] when transposed)
    b1: fx.Node | None = None
    b2: fx.Node | None = None
    activation: str = "swiglu"
    interleaved: bool = False
    transposed: bool = False
    alpha: float = 1.702
    limit: float = 7.0
    shape: dict = dataclasses.field(default_factory=dict)  # T, d, n, E, K (T may be symbolic)
    dtype: torch.dtype | None = None
    router: str = "unknown"  # what produced topk_ids/weights, for the report
    shared_expert: str = "-"  # a dense expert beside the routed ones (stays in the graph), for the report

    def describe(self) -> dict:
        layout = ("interleaved" if self.interleaved else "concatenated") + (", transposed" if self.transposed else "")
        if self.b1 is not None or self.b2 is not None:
            layout += ", bias"
        return {
            "activation": self.activation,
            "layout": layout,
            "router": self.router,
            "shared": self.shared_expert,
            "dtype": str(self.dtype).replace("torch.", ""),
            **{k: str(v) for k, v in self.shape.items()},
        }


@dataclasses.dataclass
class Rejection:
    """A candidate region left untouched, with the reason."""

    idiom: str
    module: str
    reason: str


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


def module_class(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    cls = list(stack.values())[-1][1]
    return getattr(cls, "__name__", str(cls))


def describe_shared_expert(graph: fx.Graph, experts_module: str) -> str:
    """'-', 'plain' or 'sigmoid-gated': a shared_expert(s) sibling of the experts module in the graph."""
    parent = experts_module.rsplit(".", 1)[0]
    paths = {module_path(n) for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")}
    shared = [p for p in paths if p.startswith(parent + ".shared_expert")]
    if not shared:
        return "-"
    return "sigmoid-gated" if any(p.startswith(parent + ".shared_expert_gate") for p in shared) else "plain"


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


def getitem_of(node: Any, index: Any) -> fx.Node | None:
    """If `node` is `src[index]` (operator.getitem), return src."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem:
        if node.args[1] == index:
            return node.args[0]
    return None


def users_getitem(node: fx.Node, index: int) -> fx.Node | None:
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and user.args[1] == index:
            return user
    return None


def strip(node: Any, skip: Callable[[fx.Node], bool]) -> Any:
    """Follow first arguments back through nodes that `skip` says are transparent."""
    while isinstance(node, fx.Node) and skip(node):
        node = node.args[0]
    return node


def is_noop_cast(node: fx.Node) -> bool:
    """`.to(dtype)`/`.contiguous()` that keeps the dtype of its input (so it changes no value)."""
    if not is_call(node, "to", "contiguous", "type_as"):
        return False
    src, out = example_value(node.args[0]), example_value(node)
    return isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype == out.dtype


def shape_of(node: Any) -> tuple:
    val = example_value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def dtype_of(node: Any) -> torch.dtype | None:
    val = example_value(node)
    return val.dtype if isinstance(val, torch.Tensor) else None


def same_size(a: Any, b: Any) -> bool:
    """Size equality that is sound for symbolic sizes: equal only if provably equal."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(torch.sym_eq(a, b)) if hasattr(torch, "sym_eq") else a == b
    except Exception:  # an unprovable symbolic comparison is "not equal"
        return False


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


def is_inplace(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("_")
    if node.op == "call_function":
        name = op_name(node.target)
        return name in INPLACE_FNS or (name.endswith("_") and not name.startswith("_"))
    return False


def fake_mode_of(gm: fx.GraphModule):
    for node in gm.graph.nodes:
        val = example_value(node)
        if isinstance(val, torch.Tensor) and hasattr(val, "fake_mode"):
            return val.fake_mode
    return None


def rewrite(gm: fx.GraphModule, match: MoEMatch) -> fx.Node:
    """Replace `match.anchor` with one `moe_experts` call; erase what only the region used."""
    from codegen.ops import moe_experts

    graph = gm.graph
    kwargs = dict(
        activation=match.activation,
        interleaved=match.interleaved,
        transposed=match.transposed,
        alpha=float(match.alpha),
        limit=float(match.limit),
    )
    args = (match.x, match.topk_ids, match.topk_weights, match.w1, match.w2, match.b1, match.b2)
    with graph.inserting_before(match.anchor):
        call = graph.call_function(moe_experts, args, kwargs)
        result = call
        anchor_dtype = dtype_of(match.anchor)
        if anchor_dtype is not None and anchor_dtype != match.dtype:
            result = graph.call_method("to", (call, anchor_dtype))
    call.meta.update({k: v for k, v in match.anchor.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
    fake_mode = fake_mode_of(gm)
    if fake_mode is not None:
        with fake_mode:
            fake_args = [example_value(a) for a in args]
            val = moe_experts(*fake_args, **kwargs)
        call.meta["example_value"] = val
        if result is not call:
            result.meta["example_value"] = val.to(anchor_dtype)
    match.anchor.replace_all_uses_with(result)
    erase_dead(graph, match.region | {match.anchor})
    return call


def erase_dead(graph: fx.Graph, region: set[fx.Node]) -> None:
    """Erase region nodes nothing outside the erased set uses, in-place side users included.

    In-place nodes of the region (setitem on the inverse permutation, sentinel masked_fill_) have
    no users; they go when every node they mutate goes.
    """
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node not in region or node.op in ("placeholder", "output", "get_attr"):
                continue
            if node.users:
                continue
            if is_inplace(node) and node.args and isinstance(node.args[0], fx.Node) and node.args[0].users.keys() - {node}:
                continue  # still mutates a tensor someone reads
            graph.erase_node(node)
            region.discard(node)
            changed = True
