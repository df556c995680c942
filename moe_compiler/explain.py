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

    with capture() as report, torch.no_grad():
        torch.compile(model, backend=analyse)(*args, **kwargs)
    return report
