"""The pass driver: every enabled pattern finds, checks and rewrites its MoE regions in one graph."""
from __future__ import annotations

import itertools
import logging

import torch.fx as fx

from patterns import hf_batched_mm, hf_eager_loop, hf_grouped_mm
from patterns.common import MoEMatch, Rejection, rewrite

from .diagnostics import RegionRecord, publish
from .options import SonicOptions

log = logging.getLogger("moe_compiler")

FINDERS = {
    "hf_grouped_mm": hf_grouped_mm.find,
    "hf_batched_mm": hf_batched_mm.find,
    "hf_eager_loop": hf_eager_loop.find,  # recognises only, to explain; never rewrites
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


def _find(name: str, gm: fx.GraphModule, graph_id: int, options: SonicOptions):
    """(matches, records) of one pattern; an exception inside it becomes an 'error' record."""
    try:
        found = FINDERS[name](gm)
    except Exception as exc:
        if not options.fallback:
            raise
        return [], [RegionRecord(graph_id, name, "<graph>", "error", f"{type(exc).__name__}: {exc}")]
    matches = [m for m in found if isinstance(m, MoEMatch)]
    records = [RegionRecord(graph_id, r.idiom, r.module, "rejected", r.reason) for r in found if isinstance(r, Rejection)]
    return matches, records


def run_passes(gm: fx.GraphModule, options: SonicOptions) -> list[RegionRecord]:
    """Rewrite `gm` in place; return (and publish) one record per candidate region.

    Find and check never mutate the graph, so a pattern that raises there only loses its own
    candidates. If a rewrite raises, the graph is restored to its state before the passes and
    compiled as it came (with `fallback`), so the user's step still runs.
    """
    graph_id = next(_graph_ids)
    records: list[RegionRecord] = []
    if not options.enabled:
        return records
    backup = _snapshot(gm)
    try:
        for name in options.patterns:
            matches, rejected = _find(name, gm, graph_id, options)
            records += rejected
            for match in matches:
                details = match.describe()
                rewrite(gm, match)
                records.append(RegionRecord(graph_id, match.idiom, match.module, "rewritten", details=details))
            if options.debug:
                gm.graph.lint()
        gm.recompile()
    except Exception as exc:
        if not options.fallback:
            raise
        gm.graph = backup
        gm.recompile()
        records = [RegionRecord(graph_id, "driver", "<graph>", "error", f"rewrite failed, {type(exc).__name__}: {exc}")]
    if not records:
        log.debug("graph %d: no MoE candidate among %d nodes", graph_id, len(gm.graph.nodes))
    publish(records)
    return records
