"""What the backend found: one record per MoE candidate, collected into a printable report."""
from __future__ import annotations

import contextlib
import dataclasses
import logging

log = logging.getLogger("moe_compiler")


@dataclasses.dataclass
class RegionRecord:
    graph: int  # which graph Dynamo handed over (0, 1, ... in compile order)
    idiom: str  # the pattern that looked at it
    module: str  # module path, e.g. "model.layers.0.mlp.experts"
    status: str  # "rewritten", "rejected" or "error"
    reason: str = ""  # why it was rejected or failed
    details: dict = dataclasses.field(default_factory=dict)  # activation, layout, router, dtype, T/d/n/E/K
    hint: bool = False  # a rejection whose reason says what the user can change: logged as a warning


@dataclasses.dataclass
class Report:
    records: list[RegionRecord] = dataclasses.field(default_factory=list)
    graphs: int = 0
    # Dynamo's graph breaks while the block traced, one line each (what broke, and where when Dynamo
    # says): a layer split across graphs, or a frame left to eager, is never seen whole by a finder
    graph_breaks: list[str] = dataclasses.field(default_factory=list)

    @property
    def rewritten(self) -> list[RegionRecord]:
        return [r for r in self.records if r.status == "rewritten"]

    @property
    def rejected(self) -> list[RegionRecord]:
        return [r for r in self.records if r.status != "rewritten"]

    def __str__(self) -> str:
        head = f"moe_compiler: {len(self.rewritten)} MoE region(s) rewritten, {len(self.rejected)} left untouched, {self.graphs} graph(s)"
        breaks = ""
        if self.graph_breaks:
            breaks = ("\n  Dynamo graph breaks (a layer split across graphs, or a frame left to eager, is not seen whole):"
                      + "".join(f"\n  - {b}" for b in self.graph_breaks))
        if not self.records:
            return head + "\n  (no MoE candidate found)" + breaks
        cols = ("graph", "module", "idiom", "status", "activation", "layout", "router", "shared", "dtype", "shape / reason")
        rows = []
        for r in self.records:
            det = r.details
            shape = " ".join(f"{k}={det[k]}" for k in ("T", "d", "n", "E", "K") if k in det)
            rows.append((
                str(r.graph), r.module, r.idiom, r.status, det.get("activation", "-"), det.get("layout", "-"),
                det.get("router", "-"), det.get("shared", "-"), det.get("dtype", "-"), r.reason or shape,
            ))
        if any(r.details.get("token_rounding", "off") != "off" for r in self.records):  # the option is on
            cols = (*cols[:-1], "token rounding", cols[-1])
            rows = [(*row[:-1], r.details.get("token_rounding", "-"), row[-1]) for r, row in zip(self.records, rows)]
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
        line = lambda vals: "  " + " | ".join(v.ljust(w) for v, w in zip(vals, widths))  # noqa: E731
        sep = "  " + "-+-".join("-" * w for w in widths)
        return "\n".join([head, line(cols), sep, *map(line, rows)]) + breaks

    __repr__ = __str__


_active: list[Report] = []


@contextlib.contextmanager
def capture():
    """Collect the records of every graph compiled inside the block, and Dynamo's graph breaks
    there: `with capture() as report:`."""
    from torch._dynamo.utils import counters

    report = Report()
    before = {key: dict(counters[key]) for key in _BREAK_COUNTERS}
    _active.append(report)
    try:
        yield report
    finally:
        _active.remove(report)
        lines: dict[str, str] = {}  # first line -> the fullest line with that start
        for key in _BREAK_COUNTERS:
            for reason, count in counters[key].items():
                if count > before[key].get(reason, 0):
                    head, line = _break_line(reason)
                    if len(line) > len(lines.get(head, "")):
                        lines[head] = line
        report.graph_breaks.extend(lines.values())
        if not any(_data_dependent(line) for line in report.graph_breaks):
            # a top-k returned from its graph with no data-dependent break in sight: a router on its own
            # (a sampler; a router whose experts another op runs), not one Dynamo compiled apart
            report.records = [r for r in report.records if APART not in r.reason]


APART = "its ids leave this graph"  # the start of `patterns.unmatched`'s note on a router compiled apart from its experts


_BREAK_COUNTERS = ("graph_break", "unimplemented")  # Dynamo's counters of graph-break reasons


def _break_line(reason: str) -> tuple[str, str]:
    """(first line, one line) of a Dynamo graph-break reason: its first line, and each 'frame skipped'
    context."""
    lines = [ln.strip() for ln in str(reason).splitlines() if ln.strip()]
    head = lines[0] if lines else str(reason)
    skipped = [ln.split("Developer debug context:", 1)[1].strip() for ln in lines
               if "Developer debug context:" in ln and "frame skipped" in ln]
    line = head + (f" ({'; '.join(skipped)})" if skipped else "")
    if "data-dependent" in head.lower():
        line += f": {_DATA_DEPENDENT}"
    return head, line


def _data_dependent(line: str) -> bool:
    """A break on a value only the data decides: a branch on it, or an op whose output size it sets."""
    return "data-dependent" in line.lower() or "dynamic shape operator" in line.lower()


_DATA_DEPENDENT = ("a Python branch on a tensor's value; in an expert loop usually one that skips an expert with no "
                   "tokens (`if idx.numel() == 0: continue`, `if mask.any():`), which can go: an expert run on zero "
                   "rows adds nothing")


def publish(records: list[RegionRecord]) -> None:
    for report in _active:
        report.graphs += 1
        report.records.extend(records)
    for r in records:
        where = f"graph {r.graph} {r.module} [{r.idiom}]"
        if r.status == "rewritten":
            log.info("rewrote MoE region %s: %s", where, r.details)
        elif r.status == "error":
            log.warning("pattern failed on %s, graph left untouched: %s", where, r.reason)
        elif r.hint:
            log.warning("%s: %s", where, r.reason)  # the user can fix this one: say it loudly
        else:
            log.debug("left MoE candidate %s untouched: %s", where, r.reason)
