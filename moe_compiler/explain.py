"""`moe_compiler.explain(model, *args, **kwargs)`: what the backend would rewrite, and why not."""
from __future__ import annotations

import torch

from .diagnostics import Report, capture
from .options import SonicOptions
from .passes import run_passes


def explain(model, *args, options: dict | None = None, **kwargs) -> Report:
    """Trace `model(*args, **kwargs)` once with Dynamo, run the pattern passes on every graph and
    report each MoE region found, rewritten, or rejected with its reason.

    Nothing is compiled by Inductor and the model is not modified. Dynamo traces (and runs, under
    no_grad) one forward with a throw-away backend; its cache entry is keyed to that backend, so a
    later `torch.compile(model, backend="sonic")` compiles afresh.
    """
    from .options import split_options

    sonic_options = split_options(options)[0] if options else SonicOptions()

    def analyse(gm, example_inputs):
        run_passes(gm, sonic_options)
        return gm.forward

    from torch._dynamo.utils import counters

    before = {key: dict(counters[key]) for key in _BREAK_COUNTERS}
    with capture() as report, torch.no_grad():
        torch.compile(model, backend=analyse)(*args, **kwargs)
    lines: dict[str, str] = {}  # first line -> the fullest line with that start
    for key in _BREAK_COUNTERS:
        for reason, count in counters[key].items():
            if count > before[key].get(reason, 0):
                head, line = _break_line(reason)
                if len(line) > len(lines.get(head, "")):
                    lines[head] = line
    report.graph_breaks.extend(lines.values())
    return report


_BREAK_COUNTERS = ("graph_break", "unimplemented")  # Dynamo's counters of graph-break reasons


def _break_line(reason: str) -> tuple[str, str]:
    """(first line, one line) of a Dynamo graph-break reason: its first line, and each 'frame skipped'
    context."""
    lines = [ln.strip() for ln in str(reason).splitlines() if ln.strip()]
    head = lines[0] if lines else str(reason)
    skipped = [ln.split("Developer debug context:", 1)[1].strip() for ln in lines
               if "Developer debug context:" in ln and "frame skipped" in ln]
    return head, head + (f" ({'; '.join(skipped)})" if skipped else "")
