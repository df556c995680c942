"""moe_compiler.benchmarking, the benchmarks' shared timing and reporting: its CPU paths here, its GPU
timings under the `gpu` marker (their relations, never a speed)."""
from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import time

import pytest
import torch

from moe_compiler import benchmarking as bm

STEP_S, ZERO_S = 0.02, 0.1  # a step that sleeps 20 ms; a zero() that sleeps 100 ms, outside the timed span


class Sleeper:
    """A step and a zero() that sleep known times and count their calls."""

    def __init__(self):
        self.steps = self.zeros = 0

    def step(self):
        self.steps += 1
        time.sleep(STEP_S)

    def zero(self):
        self.zeros += 1
        time.sleep(ZERO_S)


# ------------------------------------------------------------------------------------------- timing


def test_interval_union_counts_overlaps_once_and_gaps_never():
    spans = [(20.0, 25.0), (0.0, 10.0), (2.0, 4.0), (8.0, 12.0), (25.0, 26.0), (30.0, 31.0)]  # unsorted
    assert bm.interval_union_us(spans) == 12.0 + 6.0 + 1.0  # [0, 12], [20, 26] (touching), [30, 31]
    assert bm.interval_union_us([(0.0, 10.0), (1.0, 2.0), (3.0, 4.0)]) == 10.0  # nested spans
    assert bm.interval_union_us([(5.0, 7.5)]) == 2.5
    assert bm.interval_union_us([]) == 0.0


@pytest.mark.parametrize("timer", [bm.wall_times_ms, bm.host_times_ms])
def test_cpu_step_times_are_the_step_alone(timer):
    """On the CPU both timers are perf_counter around each step: the 20 ms sleep, not zero()'s 100 ms;
    `warmup` steps run untimed before `iters` timed ones, each after a zero()."""
    s = Sleeper()
    times = timer(s.step, iters=3, warmup=2, zero=s.zero, device="cpu")
    assert len(times) == 3 and s.steps == 5 and s.zeros == 5
    assert all(STEP_S * 1e3 <= t < (STEP_S + ZERO_S) * 1e3 for t in times), times


def test_cpu_medians_and_step_times():
    s = Sleeper()
    for ms in (bm.wall_ms(s.step, iters=3, warmup=0, zero=s.zero, device="cpu"),
               bm.host_ms(s.step, iters=3, warmup=0, zero=s.zero, device="cpu")):
        assert STEP_S * 1e3 <= ms < (STEP_S + ZERO_S) * 1e3
    host, busy, wall = bm.step_times(s.step, s.zero, iters=3, warmup=0, device="cpu")
    assert busy is None  # no GPU to be busy
    assert STEP_S * 1e3 <= host < (STEP_S + ZERO_S) * 1e3 and STEP_S * 1e3 <= wall < (STEP_S + ZERO_S) * 1e3
    assert bm.busy_ms(s.step, s.zero, device="cpu") is None
    assert bm.count_host_syncs(s.step, device="cpu") is None


def test_cpu_enqueue_is_the_step_alone():
    """On the CPU the enqueue time is perf_counter around each step: the 20 ms sleep, not zero()'s."""
    s = Sleeper()
    ms = bm.enqueue_ms(s.step, iters=3, warmup=1, zero=s.zero, device="cpu")
    assert s.steps == 4 and s.zeros == 4
    assert STEP_S * 1e3 <= ms < (STEP_S + ZERO_S) * 1e3, ms


def test_host_profile_names_the_functions_the_host_spends_time_in(tmp_path):
    import pstats

    def busy_python_function():
        return sum(i * i for i in range(20_000))

    dump = tmp_path / "host.prof"
    text = bm.host_profile(busy_python_function, iters=3, rows=5, sort=("tottime", "cumulative"), device="cpu",
                           dump=str(dump))
    assert "busy_python_function" in text and text.count("Ordered by") == 2
    stats = pstats.Stats(str(dump)).stats  # the raw stats: the same calls, three timed after three warm-up
    assert sum(n for (_, _, name), (_, n, *_) in stats.items() if name == "busy_python_function") == 3


# ---------------------------------------------------------------------------------------- reporting


def test_format_table_cells_and_formats():
    text = bm.format_table(["name", "ms", "ratio", "n"], [["a", 1.23456, 0.5, 3], ["b", float("nan"), None, 12]],
                           {"ms": ".2f"})
    assert text.splitlines() == ["| name | ms | ratio | n |", "|---|---|---|---|",
                                 "| a | 1.23 | 0.5 | 3 |", "| b | - | - | 12 |"]
    with pytest.raises(ValueError, match="2 cells under 3 columns"):
        bm.format_table(["a", "b", "c"], [[1, 2]])


def test_print_table_prints_title_and_table(capsys):
    bm.print_table(["x", "y"], [[1, 2.5]], title="figures")
    assert capsys.readouterr().out == "\nfigures\n| x | y |\n|---|---|\n| 1 | 2.5 |\n"


def test_write_json_adds_command_environment_and_keeps_payload(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "deep" / "results.json"  # folders are made
    argv = ["--shapes", "a,b", "--note", "two words"]
    command = bm.command_line(argv, script=str(tmp_path / "benchmarks" / "bench_layer.py"))  # shown relative
    assert bm.write_json(path, {"results": [{"ms": 1.5, "dtype": torch.bfloat16}], "torch": "mine"},
                         command=command, device="cpu") == str(path)
    data = json.loads(path.read_text())
    assert shlex.split(data["command"]) == [sys.executable, "benchmarks/bench_layer.py", *argv]
    assert data["device"].startswith("cpu") and data["python"].count(".") == 2
    assert data["torch"] == "mine"  # a payload key wins over the environment's
    assert data["triton"] == bm.environment("cpu")["triton"]
    assert "transformers" in data and data["date"][:2] == "20"
    assert data["results"] == [{"ms": 1.5, "dtype": "torch.bfloat16"}]
    assert bm.environment("cpu")["torch"] == torch.__version__


def test_command_line_defaults_to_this_process(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/somewhere/bench.py", "--out", "x y"])
    assert shlex.split(bm.command_line()) == [sys.executable, "/somewhere/bench.py", "--out", "x y"]
    assert shlex.split(bm.command_line([], launcher=["torchrun", "--nproc-per-node", "2"]))[:3] == [
        "torchrun", "--nproc-per-node", "2"]


ROWS = [dict(shape="a", provider="ours", tflops=300.0), dict(shape="a", provider="sonic", tflops=310.0),
        dict(shape="b", provider="ours", tflops=None)]  # no figure: left out


def test_bar_chart_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plots" / "tflops.png"
    assert bm.bar_chart(path, ROWS, "tflops", ylabel="TFLOPS") is True
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    three = tmp_path / "three.png"
    assert bm.save_figure(three, lambda axes: [ax.plot([1, 2]) for ax in axes], panels=3, title="t") is True
    assert three.stat().st_size > 0


def test_charts_skip_quietly_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert bm.bar_chart(tmp_path / "tflops.png", ROWS, "tflops") is False
    assert bm.save_figure(tmp_path / "f.png", lambda ax: None) is False
    assert list(tmp_path.iterdir()) == []


def test_progress_printer_without_tqdm(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    update = bm.progress_printer(2)
    update("sonic", 0, loss=1.5)
    update("sonic", 1, loss=1.25, note="x")
    assert capsys.readouterr().out.splitlines() == ["   sonic step 1/2 loss 1.5000",
                                                    "   sonic step 2/2 loss 1.2500 note x"]


# ------------------------------------------------------------------------------------- command line


def test_add_common_args_defaults_aliases_and_lists(monkeypatch):
    monkeypatch.setenv("OUT", "/results")
    ap = bm.add_common_args(argparse.ArgumentParser(), out="bench_x", warmup=5, iters=30, rounds=1, seed=0,
                            device=True, shapes="7b-256,qwen3", providers="ours", iters_aliases=("--rep",))
    args = ap.parse_args([])
    assert (args.out, args.warmup, args.iters, args.rounds, args.seed) == ("/results/bench_x", 5, 30, 1, 0)
    assert args.shapes == ["7b-256", "qwen3"] and args.providers == ["ours"]
    assert args.device == ("cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(["--rep", "7", "--shapes", "tiny,,paper", "--providers", "a, b", "--device", "cpu"])
    assert args.iters == 7 and args.shapes == ["tiny", "paper"] and args.providers == ["a", "b"]
    monkeypatch.delenv("OUT")
    assert bm.add_common_args(argparse.ArgumentParser(), out="y").parse_args([]).out == "out/y"


def test_add_common_args_adds_only_the_flags_asked_for(capsys):
    ap = bm.add_common_args(argparse.ArgumentParser(), iters=10)
    assert vars(ap.parse_args([])) == {"iters": 10}
    for flag in ("--rounds", "--out", "--rep", "--device"):
        with pytest.raises(SystemExit):
            ap.parse_args([flag, "1"])
    capsys.readouterr()


def test_resolve_shapes_expands_groups_and_rejects_unknown_names():
    assert bm.resolve_shapes(["tiny", "paper"]) == ["tiny", *bm.SHAPE_GROUPS["paper"]]
    assert len(bm.SHAPE_GROUPS["paper"]) == 12 and "tiny" not in bm.SHAPE_GROUPS["all"]
    assert bm.resolve_shapes(["x"], {"x": (1, 2, 3, 4, 1)}) == ["x"]
    with pytest.raises(ValueError, match="unknown shape 'nope'"):
        bm.resolve_shapes(["tiny", "nope"])
    for T, d, n, E, K in bm.SHAPES.values():
        assert 0 < K <= E and T * K > 0 and d > 0 and n > 0


def test_a_shape_may_be_spelled_by_its_dims():
    assert bm.resolve_shapes(["4096x2048x768x128x8", "qwen3"]) == ["4096x2048x768x128x8", "qwen3"]
    assert bm.shape_dims("4096x2048x768x128x8") == (4096, 2048, 768, 128, 8)
    assert bm.shape_dims("qwen3") == bm.SHAPES["qwen3"]
    for bad in ("4096x2048x768x128", "4096x2048x768x128x0", "4096x2048x768x128xk"):
        with pytest.raises(ValueError, match="unknown shape"):
            bm.resolve_shapes([bad])
    with pytest.raises(ValueError, match="unknown shape"):  # only SHAPES' resolver reads dims
        bm.resolve_shapes(["4x4x4x4x1"], {"x": (1, 2, 3, 4, 1)})


def test_import_is_cheap_and_changes_no_global_setting():
    """Imported on its own (after moe_compiler), the module pulls in neither matplotlib, tqdm nor
    transformers, and leaves torch's global settings as they were."""
    code = """
import sys, torch, moe_compiler
def settings():
    import torch._dynamo
    c = torch._dynamo.config
    return (torch.get_default_dtype(), torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
            torch.are_deterministic_algorithms_enabled(), torch.get_num_threads(), c.recompile_limit, c.cache_size_limit, c.capture_dynamic_output_shape_ops,
            torch.is_grad_enabled())
before, modules = settings(), set(sys.modules)
import moe_compiler.benchmarking
assert settings() == before, (settings(), before)
new = {m.split(".")[0] for m in set(sys.modules) - modules}
assert not new & {"matplotlib", "tqdm", "transformers", "triton"}, new
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# -------------------------------------------------------------------------------------------- GPU


def _gpu_sleep(ms: float):
    torch.cuda._sleep(int(ms * bm._CYCLES_PER_MS))


@pytest.mark.gpu
def test_gpu_host_time_leaves_the_gpu_work_out():
    """A step that only enqueues 20+ ms of GPU work: its wall time holds that work, its host time
    does not, and its busy time does."""
    step = lambda: _gpu_sleep(20)  # noqa: E731  (at most 2 GHz: at least 20 ms)
    host, busy, wall = bm.step_times(step, iters=5, warmup=1)
    assert wall >= 15 and busy >= 15
    assert host < wall / 4


@pytest.mark.gpu
def test_gpu_host_time_of_a_syncing_step_is_refused():
    x = torch.ones(8, device="cuda")

    def step():
        _gpu_sleep(2)
        (x * 2).sum().item()  # waits for the GPU

    with pytest.raises(bm.WaitsOnGPU):
        bm.host_ms(step, iters=2, warmup=1)
    assert bm.step_times(step, iters=2, warmup=1).host_ms is None


@pytest.mark.gpu
def test_gpu_median_ms_times_about_iters_calls():
    calls = []
    x = torch.randn(1024, 1024, device="cuda")
    fn = lambda: calls.append(x @ x)  # noqa: E731
    bm.median_ms(fn, iters=40, warmup=5)
    repeats = len(calls) - (1 + 5) - (1 + 5) - 5  # less our warm call and estimate, do_bench's, its warm-up
    assert 20 <= repeats <= 80, len(calls)
    assert bm.graph_ms(lambda: x @ x, iters=10, warmup=2, calls=4) > 0
    assert math.isfinite(bm.busy_ms(lambda: x @ x, iters=3))
