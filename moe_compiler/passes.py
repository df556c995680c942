"""The pass driver: every enabled pattern finds, checks and rewrites its MoE regions in one graph."""
from __future__ import annotations

import itertools
import logging
import re

import torch
import torch.fx as fx

from moe_compiler.patterns import (
    dense_bmm,
    evaluated,
    dense_experts,
    expert_loop,
    gathered_weights,
    grouped_rows,
    hf_batched_mm,
    hf_eager_loop,
    hf_grouped_mm,
    repeat_loop,
    sorted_grouped_mm,
)
from moe_compiler.patterns.canonical import canonicalize
from moe_compiler.patterns.canonical_opaque import restore_opaque_ops
from moe_compiler.patterns.common import (MoEMatch, NoMatch, Rejection, check_grad_mode_unchanged, check_inputs_unmutated,
                                         grad_modes, rewrite, settle_autocast)
from moe_compiler.patterns.router_fusion import match_router, rewrite_router
from moe_compiler.patterns.unmatched import explain_unmatched
from moe_compiler.patterns.verify import verify

from .diagnostics import RegionRecord, publish
from .options import SonicOptions

log = logging.getLogger("moe_compiler")

FINDERS = {
    "hf_grouped_mm": hf_grouped_mm.find,
    "sorted_grouped_mm": sorted_grouped_mm.find,  # tokens sorted by expert, grouped_mm, scatter_add back (torchtitan)
    "grouped_rows": grouped_rows.find,  # grouped_mm experts over rows grouped upstream (after a dispatch)
    "hf_batched_mm": hf_batched_mm.find,
    "hf_eager_loop": hf_eager_loop.find,  # recognises only, to explain; never rewrites
    "expert_loop": expert_loop.find,  # nn.ModuleList experts looped over with torch.where + index_add
    "dense_experts": dense_experts.find,  # nn.ModuleList experts all run, combined by a [T, E] gate matrix
    "dense_bmm": dense_bmm.find,  # stacked experts all run as bmm (Llama 4), gated by a [T, E] matrix
    "repeat_loop": repeat_loop.find,  # ModuleList experts over x.repeat_interleave(K) rows (DeepSeek-MoE)
    "gathered_weights": gathered_weights.find,  # einsums on W[ids], stacked weights gathered per token (gpt-fast)
    "evaluated": evaluated.find,  # stacked experts no finder read, found by evaluating hypotheses (last)
}

_graph_ids = itertools.count()


def _snapshot(gm: fx.GraphModule) -> fx.Graph:
    """A copy of the graph to restore if a rewrite fails half-way (placeholders keep Dynamo's
    `_dynamo_source`, which AOTAutograd reads)."""
    copy = fx.Graph(owning_module=gm)
    env: dict[fx.Node, fx.Node] = {}
    copy.output(copy.graph_copy(gm.graph, env))
    for old, new in env.items():
        for attr, value in vars(old).items():
            if attr.startswith("_dynamo"):
                setattr(new, attr, value)
    return copy


def _restore(graphs: list[fx.GraphModule], backups: list[fx.Graph]) -> None:
    for g, backup in zip(graphs, backups):
        g.graph = backup


def _find(name: str, gm: fx.GraphModule, graph_id: int, options: SonicOptions):
    """(matches, records) of one pattern; an exception inside it becomes an 'error' record."""
    try:
        found = FINDERS[name](gm)
    except Exception as exc:
        if not options.fallback:
            raise
        return [], [RegionRecord(graph_id, name, "<graph>", "error", f"{type(exc).__name__}: {exc}")]
    matches, rejections = [], [r for r in found if isinstance(r, Rejection)]
    modes = None  # each node's grad mode, found once for the matches of this graph (the checks leave it as it is)
    for m in (m for m in found if isinstance(m, MoEMatch)):
        try:
            check_inputs_unmutated(m)
            modes = grad_modes(gm.graph) if modes is None else modes
            check_grad_mode_unchanged(m, modes)
            settle_autocast(m)
            # the evaluated finder's match is its own evaluation's outcome: checked on the CPU, as it was found
            found_by_evaluation = m.idiom == evaluated.IDIOM
            m.verified = verify(m, on_cpu=found_by_evaluation) if options.verify or found_by_evaluation else "off"
            matches.append(m)
        except NoMatch as why:
            rejections.append(Rejection(m.idiom, m.module, str(why)))
    records = [RegionRecord(graph_id, r.idiom, r.module, "rejected", r.reason, hint=r.hint) for r in rejections]
    return matches, records


def token_rounding_for(match: MoEMatch, options: SonicOptions) -> tuple[str | None, str]:
    """(mode or None, what the report says): rounding applies to training graphs only.

    A graph is a training graph when it is traced with grad enabled and the experts module is in
    train mode. Dynamo re-traces when either changes for Hugging Face models (it guards on grad
    mode always, and on `module.training` because their attention reads it).
    """
    mode = options.token_rounding
    if mode is None:
        return None, "off"
    if not torch.is_grad_enabled():
        return None, "off (traced without grad: inference)"
    training = _module_training(match.module_source)
    if training is False:
        return None, "off (module in eval mode)"
    if training is None:
        log.info("sonic.token_rounding: cannot read %s.training from the frame; grad is enabled, so rounding",
                 match.module)
    if match.sentinels is not None:
        return None, "off (expert-parallel sentinels: the slot form is taken by the dropped slots)"
    if match.group_offsets:
        return None, "off (rows grouped by expert upstream: no router in the region)"
    if match.slot_keep is not None:
        return None, "off (capacity-limited routing: the slot form is taken by the dropped slots)"
    if match.router_probs is None:
        log.warning("sonic.token_rounding: %s keeps plain top-k: its router does not rank by softmax/sigmoid "
                    "probabilities that the graph shows (%s)", match.module, match.router)
        return None, "off (router scores not visible)"
    return mode, mode


def router_outcome(gm: fx.GraphModule, call: fx.Node, match: MoEMatch, router: str, options: SonicOptions) -> str:
    """Fuse the router of a just-rewritten region (sonic.fuse_router); what the report says of it.

    The MoE rewrite stands whatever the check finds: an unrecognised router stays as it is, and so
    (with `fallback`) does one whose check raised; the check never edits the graph. An error in the
    edit itself goes to the driver, which restores the whole graph: never a half-fused router.
    """
    if not options.fuse_router:
        return router
    if match.gates:  # the op's weights are gathered from a [T, E] gate matrix: no router form to fuse
        return f"{router}, not fused: weights gathered from a [T, E] gate matrix"
    if match.group_offsets:  # the routing happened before the graph's rows: nothing to fuse
        return router
    try:
        found = match_router(call, (match.topk_ids, match.topk_weights) if match.input_scaled else None)
    except NoMatch as why:
        log.debug("router of %s not fused: %s", match.module, why)
        return f"{router}, not fused: {why}"
    except Exception as exc:
        if not options.fallback:
            raise
        log.warning("router fusion failed on %s, router left as it is: %s: %s", match.module, type(exc).__name__, exc)
        return f"{router}, not fused: {type(exc).__name__}"
    rewrite_router(gm, found)
    log.info("fused the router of %s: %s", match.module, found.form)
    return f"{found.form}, fused" + (router[router.index(" ("):] if " (" in router else "")


_SOURCE_STEP = re.compile(r"\.(\w+)|\[(\d+)\]|\['([^']*)'\]")


def _module_training(source: str) -> bool | None:
    """`module.training` of the module Dynamo names `source` (e.g. "L['self'].model.layers[0].mlp"),
    read from the frame being compiled; None when that frame or module cannot be resolved."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        root = re.match(r"L\['([^']+)'\]", source)
        if tx is None or root is None:
            return None
        obj = tx.f_locals[root.group(1)]
        for attr, index, key in _SOURCE_STEP.findall(source[root.end():]):
            obj = getattr(obj, attr) if attr else obj[int(index)] if index else obj[key]
        return bool(obj.training)
    except Exception:  # a private Dynamo detail moved, or the source is not a module path
        return None


def checkpoint_bodies(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The graphs of `gm`'s activation-checkpointed regions, nested ones included.

    Under `torch.utils.checkpoint` (Hugging Face's `gradient_checkpointing_enable()`), Dynamo puts
    each checkpointed call, a whole decoder layer with its MoE, in its own GraphModule. `gm` calls
    it through `torch.ops.higher_order.tag_activation_checkpoint(body, *inputs)`. Rewriting inside
    a body keeps its inputs and outputs. AOTAutograd then traces the op there like any other, and
    the backward recomputes the body's forward, the op included, as checkpointing means.
    """
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    bodies = []
    for node in gm.graph.nodes:
        if hop is not None and node.op == "call_function" and node.target is hop:
            body = node.args[0]
            if isinstance(body, fx.Node) and body.op == "get_attr":
                sub = gm.get_submodule(body.target)
                if isinstance(sub, fx.GraphModule) and sub not in bodies:
                    bodies += [sub, *checkpoint_bodies(sub)]
    return bodies


def run_passes(gm: fx.GraphModule, options: SonicOptions) -> list[RegionRecord]:
    """Rewrite `gm` (and its activation-checkpointed bodies) in place; return (and publish) one
    record per candidate region.

    Find and check never mutate a graph, so a pattern that raises there only loses its own
    candidates. If a rewrite raises, every graph is restored to its state before the passes and
    compiled as it came (with `fallback`), so the user's step still runs.
    """
    graph_id = next(_graph_ids)
    records: list[RegionRecord] = []
    if not options.enabled:
        return records
    graphs = [gm, *checkpoint_bodies(gm)]
    backups = [_snapshot(g) for g in graphs]
    try:
        canonical = [canonicalize(g) for g in graphs]
        for g, applied in zip(graphs, canonical):
            for line in applied:
                log.debug("graph %d: canonical form, %s", graph_id, line)
            if options.debug:
                g.graph.lint()
        for name in options.patterns:
            for g in graphs:
                matches, rejected = _find(name, g, graph_id, options)
                records += rejected
                for match in matches:
                    details = match.describe()
                    rounding, details["token_rounding"] = token_rounding_for(match, options)
                    call = rewrite(g, match, token_rounding=rounding)
                    details["router"] = router_outcome(g, call, match, details["router"], options)
                    records.append(RegionRecord(graph_id, match.idiom, match.module, "rewritten", details=details))
                if options.debug:
                    g.graph.lint()
        if "grouped_rows" not in options.patterns:  # say where the opt-in idiom would take experts left here
            records += [RegionRecord(graph_id, grouped_rows.IDIOM, m.module, "rejected", GROUPED_ROWS_HINT, hint=True)
                        for g in graphs for m in _found_only(grouped_rows.find, g)]
        # where a finder of its own spoke of the graph, its reasons are the ones to read: the
        # evaluated finder's rejections (no hypothesis equal) are dropped
        if any(r.idiom != evaluated.IDIOM for r in records):
            records = [r for r in records if not (r.idiom == evaluated.IDIOM and r.status == "rejected")]
        if all(r.idiom == evaluated.IDIOM and r.status == "rejected" for r in records):
            # no idiom found a candidate (the evaluated finder's hypotheses are none): say why of each
            # router that reaches expert weights, with what the evaluation found
            tried = {r.module: r.reason for r in records}
            unmatched = [RegionRecord(graph_id, r.idiom, r.module, "rejected",
                                      r.reason + (f"; {evaluated.IDIOM}: {tried[r.module]}" if r.module in tried else ""))
                         for g in graphs for r in explain_unmatched(g)]
            records = unmatched or records
        if any(canonical) and not any(r.status == "rewritten" for r in records):
            _restore(graphs, backups)  # no MoE rewritten: the graph leaves as Dynamo traced it
        else:
            for g in graphs:  # library ops no rewritten region took go back as they were
                restore_opaque_ops(g)
        for g in graphs:
            g.recompile()
    except Exception as exc:
        if not options.fallback:
            raise
        _restore(graphs, backups)
        for g in graphs:
            g.recompile()
        records = [RegionRecord(graph_id, "driver", "<graph>", "error", f"rewrite failed, {type(exc).__name__}: {exc}")]
    if not records:
        log.debug("graph %d: no MoE candidate among %d nodes", graph_id, len(gm.graph.nodes))
    if _ddp_split_active():
        for r in records:
            if r.status == "rejected":
                r.reason += DDP_HINT
                r.hint = True
    publish(records)
    return records


GROUPED_ROWS_HINT = ("experts over rows grouped by expert upstream (grouped_mm over offsets, no router in the "
                     "graph): the opt-in grouped_rows idiom rewrites them, which is exact but slower than torch's "
                     "grouped GEMM on the GPU; options={'sonic.patterns': moe_compiler.options.PATTERNS} turns it on")


def _found_only(find, gm: fx.GraphModule) -> list[MoEMatch]:
    """The structural matches of a finder (nothing verified, nothing rewritten); none if it raises."""
    try:
        return [m for m in find(gm) if isinstance(m, MoEMatch)]
    except Exception:  # an explanation only: a finder's bug must not fail the compile
        return []


DDP_HINT = (" (under DistributedDataParallel Dynamo splits the graph at gradient-bucket boundaries, which can cut an "
            "MoE region in two: set torch._dynamo.config.optimize_ddp = False to give the backend whole graphs)")


def _ddp_split_active() -> bool:
    """Whether this graph comes from Dynamo's DDPOptimizer, which splits a DDP module's graph at its
    gradient buckets and compiles each piece on its own (an expert weight larger than a bucket puts
    a split between the up and the down projection of that MoE)."""
    try:
        from torch._dynamo.utils import get_optimize_ddp_mode
        from torch.nn.parallel import DistributedDataParallel

        return get_optimize_ddp_mode() == "ddp_optimizer" and DistributedDataParallel._get_active_ddp_module() is not None
    except Exception:  # a private torch detail moved: no hint, nothing else changes
        return False
