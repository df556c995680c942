"""Timing and reporting shared by the benchmarks, probes and examples: one front door for measuring.

A *step* launches one unit of work (a layer's fwd+bwd, a kernel call, a training step) and returns
without synchronizing; `zero`, where taken, runs before every step outside the timed span (it drops
`.grad`, so that nothing accumulates). Figures are ms of one step:

    wall_ms     CUDA events around each normally launched step, median (perf_counter on the CPU):
                what a caller waits for, gaps where the GPU waits for the host included
    host_ms     perf_counter around the host's enqueueing of a step while the GPU is kept busy ahead
                by `torch.cuda._sleep`, median: the launches' and Python's cost alone
    enqueue_ms  perf_counter around a step started on an idle GPU, until the host returns, median:
                host_ms plus any wait on the GPU inside (syncs, or a collective's host side), for steps
                a GPU sleep cannot run ahead of (ranks of a distributed step)
    busy_ms     the union of the GPU's kernel, copy and fill intervals (torch.profiler), per step
    graph_ms    the step replayed from a CUDA graph: GPU time without the host's launch cost
    median_ms   `triton.testing.do_bench`'s median over about `iters` calls (L2 cleared before each)
    step_times  host, busy and wall ms of a normally launched step, in one call

Reporting: `print_table`, `write_json` (with the command line, device, versions and date),
`bar_chart` / `save_figure` (a PNG when matplotlib imports), `progress_printer`, and `SHAPES`, the
layer sizes the benchmarks share. `add_common_args` adds the flags every benchmark spells the same.
Importing this module imports torch and the standard library only and changes no global setting.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

import torch

# name -> (T, d, n, E, K): tokens, hidden, expert intermediate, experts, top-k. The SonicMoE paper's
# twelve H100 shapes; Qwen3-30B-A3B, OLMoE-1B-7B, Mixtral-8x7B and gpt-oss-20b layers; a smoke size.
SHAPES = {
    "1.4b-256": (40960, 768, 256, 128, 8), "1.4b-512": (40960, 768, 512, 64, 4), "1.4b-1024": (40960, 768, 1024, 32, 2),
    "7b-256": (24576, 1536, 256, 128, 8), "7b-512": (24576, 1536, 512, 64, 4), "7b-1024": (24576, 1536, 1024, 32, 2),
    "30b-256": (32768, 4096, 256, 256, 16), "30b-512": (32768, 4096, 512, 128, 8),
    "30b-1024": (32768, 4096, 1024, 64, 4),
    "120b-512": (32768, 4096, 512, 256, 16), "120b-1024": (32768, 4096, 1024, 128, 8),
    "120b-2048": (32768, 4096, 2048, 64, 4),
    "qwen3": (16384, 2048, 768, 128, 8), "olmoe": (16384, 2048, 1024, 64, 8), "mixtral": (8192, 4096, 14336, 8, 2),
    "gpt-oss": (16384, 2880, 2880, 32, 4), "tiny": (2048, 512, 256, 16, 4),
}
SHAPE_GROUPS = {"paper": [k for k in SHAPES if k[0].isdigit()], "all": [k for k in SHAPES if k != "tiny"]}
# torch.cuda._sleep counts SM clock cycles: at 2 GHz or less (H100 and H200 boost to 1.98) this many last >= 1 ms
_CYCLES_PER_MS = 2_000_000


class StepTimes(NamedTuple):
    host_ms: float | None  # None: the step waits on the GPU inside (WaitsOnGPU)
    busy_ms: float | None  # None on the CPU
    wall_ms: float


class WaitsOnGPU(RuntimeError):
    """The step syncs with the GPU inside (`.item()`), so its host time cannot be told apart."""


def _device(device=None) -> torch.device:
    return torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")


def _nothing():
    pass


def sync(device=None) -> None:
    """Wait for the GPU where `device` (default: the GPU if there is one) is a CUDA device."""
    if _device(device).type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------- timing


def wall_times_ms(step: Callable, iters: int = 30, warmup: int = 5, zero: Callable | None = None,
                  device=None) -> list[float]:
    """ms of each of `iters` normally launched steps after `warmup` untimed ones: a CUDA event pair
    around each step and one sync after the last (perf_counter around each step on the CPU)."""
    zero, dev = zero or _nothing, _device(device)
    for _ in range(warmup):
        zero()
        step()
    sync(dev)
    if dev.type != "cuda":
        times = []
        for _ in range(iters):
            zero()
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        zero()
        start.record()
        step()
        end.record()
    events[-1][1].synchronize()
    return [start.elapsed_time(end) for start, end in events]


def wall_ms(step: Callable, iters: int = 30, warmup: int = 5, zero: Callable | None = None, device=None) -> float:
    return statistics.median(wall_times_ms(step, iters, warmup, zero, device))


def host_times_ms(step: Callable, iters: int = 10, warmup: int = 3, zero: Callable | None = None,
                  device=None) -> list[float]:
    """ms the host takes to enqueue each of `iters` steps, each behind its own GPU sleep that lasts
    past the host's return, so that the host never waits on the GPU. A sample whose sleep ended first
    is taken again behind a sleep twice as long; a step that outlasts four raises WaitsOnGPU. On
    the CPU, the wall times."""
    dev = _device(device)
    if dev.type != "cuda":
        return wall_times_ms(step, iters, warmup, zero, dev)
    zero = zero or _nothing
    for _ in range(max(1, warmup)):
        zero()
        step()
    torch.cuda.synchronize()
    zero()
    t0 = time.perf_counter()
    step()
    first_ms = (time.perf_counter() - t0) * 1e3  # an upper bound: it may include waits on the GPU
    torch.cuda.synchronize()
    times = []
    while len(times) < iters:
        for ahead_ms in [(2 * first_ms + 1) * k for k in (1, 2, 4, 8)]:
            zero()
            torch.cuda._sleep(int(ahead_ms * _CYCLES_PER_MS))
            asleep = torch.cuda.Event()
            asleep.record()
            t0 = time.perf_counter()
            step()
            ms = (time.perf_counter() - t0) * 1e3
            woke = asleep.query()  # the sleep was over before the host returned: it may have waited
            torch.cuda.synchronize()
            if not woke:
                times.append(ms)
                break
        else:
            raise WaitsOnGPU(f"the step outlasted a GPU sleep of {ahead_ms:.1f} ms: it waits on the GPU")
    return times


def host_ms(step: Callable, iters: int = 10, warmup: int = 3, zero: Callable | None = None, device=None) -> float:
    return statistics.median(host_times_ms(step, iters, warmup, zero, device))


def enqueue_ms(step: Callable, iters: int = 10, warmup: int = 3, zero: Callable | None = None,
               device=None) -> float:
    """Median ms from starting a step on an idle GPU until the host returns from it. Without a sync
    inside the step this is its host time (the GPU runs behind the launches, unless the step
    launches more than the driver's queue holds); with one, the host's waits as well. Unlike `host_ms` it needs no GPU sleep ahead, so every rank of a distributed step
    can take it. On the CPU, the wall times."""
    dev = _device(device)
    zero = zero or _nothing
    for _ in range(max(1, warmup)):
        zero()
        step()
    times = []
    for _ in range(iters):
        sync(dev)
        zero()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    sync(dev)
    return statistics.median(times)


def interval_union_us(spans: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals: overlaps count once, gaps not at all."""
    total, cur = 0.0, None
    for start, end in sorted(spans):
        if cur is not None and start <= cur[1]:
            cur[1] = max(cur[1], end)
        else:
            total += cur[1] - cur[0] if cur else 0.0
            cur = [start, end]
    return total + (cur[1] - cur[0] if cur else 0.0)


def busy_ms(step: Callable, zero: Callable | None = None, iters: int = 5, device=None) -> float | None:
    """ms of GPU busy time per step: the union of the device's activity intervals (kernels, copies,
    fills) over `iters` profiled steps, divided by `iters`. Work overlapping on two streams counts
    once; gaps where the GPU waits for the host are left out. None on the CPU."""
    if _device(device).type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    zero = zero or _nothing
    zero()
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            zero()
            step()
        torch.cuda.synchronize()
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not spans:
        raise RuntimeError("the profiler saw no GPU activity")
    return interval_union_us(spans) / iters * 1e-3


def graphed(step: Callable, zero: Callable | None = None, calls: int = 1) -> Callable:
    """`calls` runs of `step` captured in one CUDA graph (after three warm-up steps on a side stream),
    as the graph's replay. Gradients the steps write are the graph's own tensors."""
    zero = zero or _nothing
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            zero()
            step()
    torch.cuda.current_stream().wait_stream(side)
    zero()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    return graph.replay


def median_ms(fn: Callable, iters: int = 100, warmup: int = 10, grad_to_none: Sequence[torch.Tensor] | None = None
              ) -> float:
    """do_bench's median ms of `fn` over about `iters` timed calls after about `warmup` others.
    do_bench takes budgets in ms and divides them by its estimate of a call (5 calls, each after an
    L2 clear); estimating a call the same way first makes the counts hold from 5 us to 50 ms."""
    from triton import runtime
    from triton.testing import do_bench

    def drop_grads():
        for t in grad_to_none or ():
            t.grad = None

    fn()
    torch.cuda.synchronize()
    driver = runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()
    clear = getattr(driver, "clear_cache", None) or (lambda c: c.zero_())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    drop_grads()
    start.record()
    for _ in range(5):
        clear(cache)
        fn()
    end.record()
    torch.cuda.synchronize()
    del cache
    drop_grads()
    one = max(start.elapsed_time(end) / 5, 1e-4)
    return do_bench(fn, warmup=warmup * one, rep=iters * one, grad_to_none=grad_to_none, return_mode="median")


def graph_ms(step: Callable, zero: Callable | None = None, iters: int = 100, warmup: int = 10, calls: int = 1) -> float:
    """`median_ms` of a CUDA graph of `calls` steps, divided by `calls` (many calls a graph amortize
    the replay's own launch where a step takes a few us)."""
    return median_ms(graphed(step, zero, calls), iters, warmup) / calls


def step_times(step: Callable, zero: Callable | None = None, iters: int = 20, warmup: int = 3,
               device=None) -> StepTimes:
    """Host, GPU-busy and wall ms of a normally launched step. wall near host: the step is bound by
    its launches; wall near busy: by the GPU; wall above both: by syncs or gaps between them."""
    wall = wall_ms(step, iters, warmup, zero, device)
    try:
        host = host_ms(step, iters, warmup, zero, device)
    except WaitsOnGPU:
        host = None
    return StepTimes(host, busy_ms(step, zero, min(iters, 10), device), wall)


def count_host_syncs(step: Callable, device=None) -> int | None:
    """Synchronizing CUDA calls in one step (`torch.cuda.set_sync_debug_mode`); None on the CPU."""
    import warnings

    if _device(device).type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # the detector's own warning only: the first set_sync_debug_mode also warns that it is a prototype
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def host_profile(step: Callable, zero: Callable | None = None, iters: int = 10, rows: int = 25,
                 sort: Sequence[str] = ("tottime",), device=None, dump: str | None = None) -> str:
    """pstats text of `iters` steps under cProfile (which slows them), one table per key of `sort`;
    on the GPU they run behind a one-second GPU sleep, so that the host does not wait inside them.
    `dump`: also write the raw stats there (`python -m pstats`, snakeviz)."""
    import cProfile
    import io
    import pstats

    zero, dev = zero or _nothing, _device(device)
    for _ in range(3):
        zero()
        step()
    sync(dev)
    prof = cProfile.Profile()
    if dev.type == "cuda":
        torch.cuda._sleep(1000 * _CYCLES_PER_MS)
    prof.enable()
    for _ in range(iters):
        zero()
        step()
    prof.disable()
    sync(dev)
    if dump:
        prof.dump_stats(dump)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    for key in sort:
        stats.sort_stats(key).print_stats(rows)
    return out.getvalue()


# ---------------------------------------------------------------------------------------- reporting


def _cell(value, spec: str | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, str):
        return value
    return format(value, spec) if spec else format(value, ".4g") if isinstance(value, float) else str(value)


def format_table(columns: Sequence[str], rows: Iterable[Sequence], formats: Mapping[str, str] | None = None) -> str:
    """A markdown table. A cell is a str (kept), None or NaN ("-"), or a value formatted by
    `formats[column]` (".2f"), else a float to 4 significant digits and anything else by str()."""
    specs = [(formats or {}).get(c) for c in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"a row of {len(row)} cells under {len(columns)} columns: {row}")
        lines.append("| " + " | ".join(_cell(v, s) for v, s in zip(row, specs)) + " |")
    return "\n".join(lines)


def print_table(columns: Sequence[str], rows: Iterable[Sequence], formats: Mapping[str, str] | None = None,
                title: str | None = None) -> None:
    print("\n" + (f"{title}\n" if title else "") + format_table(columns, rows, formats), flush=True)


def command_line(argv: Sequence[str] | None = None, script: str | None = None,
                 launcher: Sequence[str] | None = None) -> str:
    """The shell-quoted command that reproduces this run: `launcher` (default: this interpreter),
    `script` (default: sys.argv[0]; relative to the working directory where it lies below it) and
    `argv` (default: sys.argv[1:])."""
    script = os.path.abspath(script or sys.argv[0])
    if not os.path.relpath(script).startswith(".."):
        script = os.path.relpath(script)
    launcher = [sys.executable] if launcher is None else list(launcher)
    return shlex.join([*launcher, script, *(sys.argv[1:] if argv is None else argv)])


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device=None) -> dict:
    """Device name, torch / triton / transformers versions (from package metadata: nothing is
    imported; None where not installed), Python version and the UTC date."""
    dev = _device(device)
    return {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.machine()})",
            "torch": torch.__version__, "triton": _version("triton"), "transformers": _version("transformers"),
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _jsonable(value):
    if isinstance(value, (torch.dtype, torch.device, os.PathLike)):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable: {value!r}")


def _parent_made(path) -> str:
    folder = os.path.dirname(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)
    return os.fspath(path)


def write_json(path, payload: Mapping, *, command: str | None = None, device=None) -> str:
    """`payload` in `path` (folders made), after "command" (default `command_line()`) and the
    `environment(device)` fields (a payload key wins); dtypes, devices and paths as strings."""
    with open(_parent_made(path), "w") as f:
        json.dump({"command": command or command_line(), **environment(device), **payload}, f, indent=1,
                  default=_jsonable)
    return os.fspath(path)


def save_figure(path, draw: Callable, *, panels: int = 1, size: tuple[float, float] | None = None,
                title: str | None = None, **subplot_kw) -> bool:
    """A PNG at `path` of `panels` axes side by side, filled by `draw(axes)` (one Axes, or a list);
    False, and no file, when matplotlib does not import."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display; only matplotlib's own state changes
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, panels, figsize=size or (5.0 * panels, 4.0), squeeze=False, **subplot_kw)
    draw(axes[0][0] if panels == 1 else list(axes[0]))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(_parent_made(path), dpi=120)
    plt.close(fig)
    return True


def bar_chart(path, rows: Sequence[Mapping], value: str, *, group: str = "shape", series: str = "provider",
              ylabel: str | None = None, title: str | None = None) -> bool:
    """Grouped bars of `row[value]`: a group per `row[group]`, a bar per `row[series]` (first-seen
    order; rows without the value left out). A PNG at `path`, or False without matplotlib."""
    rows = [r for r in rows if r.get(value) is not None]
    groups, names = list(dict.fromkeys(r[group] for r in rows)), list(dict.fromkeys(r[series] for r in rows))
    width = 0.8 / max(1, len(names))

    def draw(ax):
        for i, name in enumerate(names):
            bars = [(j + i * width, r[value]) for j, g in enumerate(groups) for r in rows
                    if r[group] == g and r[series] == name]
            ax.bar([x for x, _ in bars], [y for _, y in bars], width=width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups, rotation=30)
        ax.set_ylabel(ylabel or value)
        ax.legend()

    size = (max(6.0, 1.2 * len(groups) * math.sqrt(max(1, len(names)))), 4.0)
    return save_figure(path, draw, size=size, title=title)


def progress_printer(total: int) -> Callable:
    """`update(label, step, **values)` after each of `total` steps of a run named `label`: a tqdm bar
    per label where tqdm imports, else a line per step ("   sonic step 3/6 loss 2.1234")."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    bars = {}

    def update(label, step, **values):
        shown = {k: f"{v:.4f}" if isinstance(v, float) else v for k, v in values.items()}
        if tqdm is None:
            print(f"{label:>8} step {step + 1}/{total}" + "".join(f" {k} {v}" for k, v in shown.items()), flush=True)
            return
        bar = bars.setdefault(label, tqdm(total=total, desc=f"{label:>8}", file=sys.stdout, leave=True))
        bar.set_postfix(**shown)
        bar.update(1)
        if step + 1 == total:
            bar.close()

    return update


# ------------------------------------------------------------------------------------- command line


def comma_list(text: str) -> list[str]:
    """'a,b,,c' -> ['a', 'b', 'c']: the argparse type of every comma-list flag."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _spelled_dims(name: str) -> tuple[int, ...] | None:
    """(T, d, n, E, K) from a name spelled "TxdxnxExK" (4096x2048x768x128x8), else None."""
    parts = name.split("x")
    if len(parts) == 5 and all(p.isdigit() and int(p) > 0 for p in parts):
        return tuple(int(p) for p in parts)
    return None


def shape_dims(name: str) -> tuple[int, ...]:
    """(T, d, n, E, K) of a `SHAPES` name or of one spelled "TxdxnxExK"."""
    return _spelled_dims(name) or SHAPES[name]


def resolve_shapes(names: Iterable[str], table: Mapping = SHAPES, groups: Mapping | None = None) -> list[str]:
    """Shape names, group names expanded (`SHAPE_GROUPS` for `SHAPES`); ValueError on an unknown one.
    With `SHAPES` a shape may also be spelled "TxdxnxExK" (read by `shape_dims`)."""
    groups = SHAPE_GROUPS if groups is None and table is SHAPES else groups or {}
    out = [shape for name in names for shape in groups.get(name, [name])]
    unknown = [shape for shape in out if shape not in table and not (table is SHAPES and _spelled_dims(shape))]
    if unknown:
        raise ValueError(f"unknown shape {unknown[0]!r}; choose from {sorted(table)}"
                         + (f" or {sorted(groups)}" if groups else ""))
    return out


def add_common_args(parser: argparse.ArgumentParser, *, out: str | None = None, warmup: int | None = None,
                    iters: int | None = None, rounds: int | None = None, seed: int | None = None,
                    device: bool = False, shapes: str | None = None, providers: str | None = None,
                    shapes_help: str | None = None, providers_help: str | None = None,
                    iters_aliases: Sequence[str] = (), iters_help: str | None = None) -> argparse.ArgumentParser:
    """The flags every benchmark shares, each added where its default is given: --out DIR (default
    $OUT/<out>, else out/<out>), --warmup N (untimed calls), --iters N (timed calls; `iters_aliases`
    keeps a script's older spellings such as --rep), --rounds R, --seed S, --device cuda|cpu (where
    `device`), and --shapes / --providers as comma lists."""
    add = parser.add_argument
    if out is not None:
        add("--out", default=os.path.join(os.environ.get("OUT") or "out", out),
            help=f"results folder (default: $OUT/{out}, or out/{out} without $OUT)")
    if warmup is not None:
        add("--warmup", type=int, default=warmup, help="untimed calls before each figure")
    if iters is not None:
        add("--iters", *iters_aliases, dest="iters", type=int, default=iters,
            help=iters_help or "timed calls per figure (the median is reported)")
    if rounds is not None:
        add("--rounds", type=int, default=rounds,
            help="take the measurement this many times over, in turn; figures are medians across rounds")
    if seed is not None:
        add("--seed", type=int, default=seed, help="random seed of the inputs")
    if device:
        add("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    if shapes is not None:
        add("--shapes", type=comma_list, default=shapes, help=shapes_help or "comma list of shapes")
    if providers is not None:
        add("--providers", type=comma_list, default=providers, help=providers_help or "comma list of providers")
    return parser
