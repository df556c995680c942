"""The pass driver: every enabled pattern finds, checks and rewrites its MoE regions in one graph."""
from __future__ import annotations

import itertools
import logging

import torch.fx as fx

from patterns import hf_grouped_mm
from patterns.common import MoEMatch, Rejection, rewrite

from .diagnostics import RegionRecord, publish
from .options import SonicOptions

log = logging.getLogger("moe_compiler")

FINDERS = {
    "hf_grouped_mm": hf_grouped_mm.find,
}

_graph_ids = itertools.count()


def _snapshot(gm: fx.GraphModule) -> fx.Graph:
    copy = fx.Graph(owning_module=gm)
    out = copy.graph_copy(gm.graph, {})
    copy.output(out)
    return copy


def run_passes(gm: fx.GraphModule, options: SonicOptions) -> list[RegionRecord]:
    """Rewrite `gm` in place; return (and publish) one record per candidate region.

    Find and check never mutate the graph. If a rewrite raises, the graph is restored to its state
    before the passes and compiled as it came (with `fallback`), so the user's step still runs.
    """
    graph_id = next(_graph_ids)
    records: list[RegionRecord] = []
    if not options.enabled:
        return records
    backup = _snapshot(gm)
    try:
        for name in options.patterns:
            for item in FINDERS[name](gm):
                if isinstance(item, Rejection):
                    records.append(RegionRecord(graph_id, item.idiom, item.module, "rejected", item.reason))
                    continue
                assert isinstance(item, MoEMatch)
                details = item.describe()
                rewrite(gm, item)
                records.append(RegionRecord(graph_id, item.idiom, item.module, "rewritten", details=details))
            if options.debug:
                gm.graph.lint()
        gm.recompile()
    except Exception as exc:
        if not options.fallback:
            raise
        gm.graph = backup
        gm.recompile()
        records = [RegionRecord(graph_id, "driver", "<graph>", "error", f"{type(exc).__name__}: {exc}")]
    if not records:
        log.debug("graph %d: no MoE candidate among %d nodes", graph_id, len(gm.graph.nodes))
    publish(records)
    return records
