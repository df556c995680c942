"""Why a router's experts were not rewritten when no idiom even found a candidate.

Runs on a graph where every finder came back empty. For each top-k (or max / argmax) over the last
dim of [..., E] router scores whose ids reach expert weights (a stacked [E, ., .] tensor, or Linear weights of at
least two experts) it reports one rejection naming the closest idiom and the first thing that
idiom looks for and did not find, so `explain` never says only "no MoE candidate found" about a
graph that holds an MoE. Descriptive only: nothing here edits the graph or decides a rewrite.

Capacity-limited routers (GShard, Switch, NLLB-MoE, st-moe) count each expert's tokens with a
running sum over the tokens and drop those past a capacity. The op drops such slots where the
evaluated finder proves the region equal to it with the region's own kept-slot values; a capacity
region no finder took is left alone, and the reason says so, also where a graph break leaves the
experts in another graph (transformers' Switch Transformers).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from moe_compiler.diagnostics import APART

from .common import Rejection, arg, dtype_of, getitem_of, is_call, module_path, shape_of, writes_in_place

IDIOM = "unmatched"
_MAX_EXPERTS = 1024  # a top-k over more scores than this is not taken for a router (a vocabulary's)
_SLICE_LIMIT = 4000  # nodes walked forward from the ids: a whole MoE layer, not a whole model
_COMPARE = ("lt", "le", "gt", "ge", "__lt__", "__le__", "__gt__", "__ge__")
_COMBINES = ("index_add", "index_add_", "scatter_add", "scatter_add_", "setitem", "index_put", "index_put_")


def explain_unmatched(gm: fx.GraphModule) -> list[Rejection]:
    out = []
    for ids, E, router in _routers(gm):
        reached = _forward(ids)
        scoring = set(_feeding([router])) | {router}  # what computed the scores: the router, not experts
        reached += [n for n in _feeding(reached) if n not in reached and n not in scoring]  # products it meets
        stacked = _stacked_weights(reached, E)
        linears = [n for n in reached if is_call(n, "linear")]
        feeds_experts = stacked or len({n.args[1] for n in linears if len(n.args) > 1}) >= 2
        if not feeds_experts and _capacity(reached) is None:
            if E <= _MAX_EXPERTS and any(u.op == "output" for n in (ids, *reached) for u in n.users):
                out.append(Rejection(IDIOM, module_path(router), _returned(router, E)))
            continue  # a top-k that feeds no experts (sampling, a metric); a capacity router is named anyway
        out.append(Rejection(IDIOM, module_path(router), _reason(router, reached, stacked, linears, E)))
    return out


def _routers(gm: fx.GraphModule):
    """(ids node, E, router node) of every top-k / max / argmax over the last dim of [T, E] scores."""
    for node in gm.graph.nodes:
        if is_call(node, "topk", "max"):
            ids = next((u for u in node.users if getitem_of(u, 1) is node), None)
            dim = arg(node, 2, "dim", -1) if is_call(node, "topk") else arg(node, 1, "dim")
        elif is_call(node, "argmax"):
            ids, dim = node, arg(node, 1, "dim")
        else:
            continue
        scores = shape_of(arg(node, 0, "input"))
        if ids is None or len(scores) < 2 or dim not in (-1, len(scores) - 1):
            continue
        E = scores[-1]
        if isinstance(E, int) and E >= 2:
            yield ids, E, node


def _forward(start: fx.Node) -> list[fx.Node]:
    """Nodes that read `start`, directly or not, in graph order (at most `_SLICE_LIMIT`); a write in
    place among them (`out[tok] = y`, `out.index_add_(0, tok, y)`) carries on to what reads the
    written tensor after it."""
    order: dict[fx.Node, int] = {}
    seen, todo = {start}, [start]
    while todo and len(seen) < _SLICE_LIMIT:
        node = todo.pop()
        readers = list(node.users)
        if node is not start and writes_in_place(node) and node.args and isinstance(node.args[0], fx.Node):
            order = order or {n: i for i, n in enumerate(start.graph.nodes)}
            readers += [u for u in node.args[0].users if order[u] > order[node]]
        for user in readers:
            if user not in seen and user.op != "output":
                seen.add(user)
                todo.append(user)
    order = order or {n: i for i, n in enumerate(start.graph.nodes)}
    return sorted(seen - {start}, key=order.__getitem__)


def _feeding(reached: list[fx.Node]) -> list[fx.Node]:
    """Nodes whose values the reached nodes read (at most `_SLICE_LIMIT`), graph inputs excluded."""
    seen: set[fx.Node] = set()
    todo = [i for n in reached for i in n.all_input_nodes]
    while todo and len(seen) < _SLICE_LIMIT:
        node = todo.pop()
        if node not in seen and node.op in ("call_function", "call_method"):
            seen.add(node)
            todo += node.all_input_nodes
    order = {n: i for i, n in enumerate(next(iter(reached)).graph.nodes)} if reached else {}
    return sorted(seen, key=order.__getitem__)


def _stacked_weights(reached: list[fx.Node], E: int) -> list[fx.Node]:
    """Graph inputs of shape [E, ., .] that the reached nodes read."""
    found = []
    for node in reached:
        for inp in node.all_input_nodes:
            shape = shape_of(inp)
            if inp.op in ("placeholder", "get_attr") and len(shape) == 3 and shape[0] == E and inp not in found:
                found.append(inp)
    return found


def _capacity(reached: list[fx.Node]) -> tuple[fx.Node, fx.Node] | None:
    """(cumsum, comparison) of a running count over the tokens (a dim before the last, the
    experts') compared with a bound."""
    for node in reached:
        if is_call(node, "cumsum") and counts_over_tokens(node):
            for user in _forward(node):
                if is_call(user, *_COMPARE):
                    return node, user
    return None


def counts_over_tokens(cumsum: fx.Node) -> bool:
    """Whether a cumsum runs over a dim before the last (the tokens, not the experts)."""
    dim, rank = arg(cumsum, 1, "dim"), len(shape_of(cumsum))
    return isinstance(dim, int) and rank >= 2 and dim % rank != rank - 1


def _returned(router: fx.Node, E: int) -> str:
    return (f"{router.name} picks among E={E} scores and {APART} with no expert reading them: "
            f"if they route tokens to experts, that code was traced apart from them (Dynamo compiled the "
            f"modules one by one after leaving the layer's own frame to Python, or a graph break split "
            f"it; the graph breaks are listed below). A branch on a tensor's value inside the expert loop "
            f"(`if idx.numel() == 0: continue`, `if mask.any():`) is the usual cause: an expert run on zero "
            f"rows adds nothing, so without the branch the layer traces as one graph")


def _reason(router: fx.Node, reached: list[fx.Node], stacked: list[fx.Node], linears: list[fx.Node], E: int) -> str:
    head = f"{router.name} picks among E={E} experts" + (" whose weights it reaches" if stacked or linears else "")
    capacity = _capacity(reached)
    if capacity is not None:
        return (f"{head}, but the routing is capacity-limited: a running count of each expert's tokens "
                f"({capacity[0].name}, a cumsum over the tokens) is compared with a bound ({capacity[1].name}), so "
                f"tokens past an expert's capacity are dropped; the op drops such slots only where the region "
                f"evaluates equal to it with the region's own kept-slot values (the evaluated finder), and none "
                f"did here, so the layer is left alone")
    ops = sorted({n.target if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
                  for n in reached if any(w in n.all_input_nodes for w in stacked)})
    if stacked:
        names = ", ".join(w.name for w in stacked[:3])
        loop = next((n for n in reached if is_call(n, "split") and dtype_of(n.args[0]) != torch.bfloat16
                     and isinstance(arg(n, 1, "split_size_or_sections"), (list, tuple))), None)
        if loop is not None:
            return (f"{head} ({names}); its experts run as a loop over rows split by per-expert counts "
                    f"({loop.name}), which becomes torch._grouped_mm products (sorted_grouped_mm) only in bfloat16, "
                    f"grouped_mm's dtype; these rows are {dtype_of(loop.args[0])}")
        if any(is_call(n, "_grouped_mm", "aten::_grouped_mm") for n in reached):
            return (f"{head} ({names}); closest idiom sorted_grouped_mm/hf_grouped_mm, which start from "
                    f"torch._grouped_mm calls sharing one offsets tensor: no pair of up and down projections here does")
        return (f"{head} ({names}, read by {', '.join(ops) or 'no product'}); closest idioms dense_bmm (torch.bmm "
                f"over the stacked weights of every expert, gated by a [T, E] matrix), gathered_weights (W[ids] "
                f"gathered per token into einsum/matmul) and hf_grouped_mm: none found its first projection in "
                f"those forms")
    combines = sorted({n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
                       for n in reached if is_call(n, *_COMBINES)})
    return (f"{head} ({len(linears)} Linear calls); closest idiom expert_loop, which starts from each expert's rows "
            f"`x[tok]` with tok from torch.where/nonzero of `ids == e` or a one_hot of the ids, added back with "
            f"index_add or `out[tok] += y` ({'combines here: ' + ', '.join(combines) if combines else 'no such combine here'}), "
            f"and dense_experts (every expert on every token, summed as gates[:, e] * expert_e(x)): neither found "
            f"its start")
