"""bench_layer's summary of alternated rounds, on synthetic results (no GPU needed)."""
from __future__ import annotations

import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_bench_layer_summary_medians_and_ratios(tmp_path):
    """bench_layer's --rounds summary: each provider's median over its rounds, and the ratio of its
    medians to the baseline's at the same shape (none where the baseline did not run there)."""
    import bench_layer

    def row(shape, prov, rnd, eager, graph=None):
        r = dict(shape=shape, provider=prov, round=rnd, fwdbwd_tflops=eager, peak_gib=1.0, act_gib=0.25)
        if graph is not None:
            r["graph_fwdbwd_tflops"] = graph
        return r

    results = [row("a", "sonic", 0, 300, 390), row("a", "ours", 0, 330, 380),
               row("a", "sonic", 1, 320, 394), row("a", "ours", 1, 310, 384),
               row("a", "sonic", 2, 280, 392), row("a", "ours", 2, 360, 386),
               row("b", "ours", 0, 100)]
    summary = bench_layer.summarize(results, "sonic")
    by = {(r["shape"], r["provider"]): r for r in summary}
    assert list(by) == [("a", "sonic"), ("a", "ours"), ("b", "ours")]
    sonic, ours, alone = by["a", "sonic"], by["a", "ours"], by["b", "ours"]
    assert sonic["rounds"] == ours["rounds"] == 3 and alone["rounds"] == 1
    assert sonic["graph_fwdbwd_tflops"] == 392 and ours["graph_fwdbwd_tflops"] == 384
    assert ours["fwdbwd_tflops"] == 330 and ours["graph_fwdbwd_tflops_all"] == [380, 384, 386]
    assert math.isclose(ours["graph_fwdbwd_ratio"], 384 / 392) and math.isclose(ours["fwdbwd_ratio"], 330 / 300)
    assert sonic["graph_fwdbwd_ratio"] == 1.0
    assert "fwdbwd_ratio" not in alone and "graph_fwdbwd_tflops" not in alone
    bench_layer.print_summary(summary, "sonic")  # the table prints with a missing graph figure too
    bench_layer.plot(summary, str(tmp_path))  # one bar per (shape, provider): the medians
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "tflops.png").stat().st_size > 0


def test_bench_layer_busy_time_union_and_ratio(capsys):
    """--kernel-time: overlapping device intervals count once, gaps not at all; the busy figure gets
    its own median and ratio to the baseline (Liger, which has no CUDA-graph figure)."""
    import bench_layer

    from moe_compiler.benchmarking import interval_union_us

    spans = [(0.0, 10.0), (2.0, 4.0), (8.0, 12.0), (20.0, 25.0), (25.0, 26.0), (30.0, 31.0)]
    assert interval_union_us(spans) == 12.0 + 6.0 + 1.0
    assert interval_union_us([(5.0, 7.5)]) == 2.5

    results = [dict(shape="a", provider="liger", round=0, fwdbwd_tflops=200, busy_fwdbwd_tflops=250, peak_gib=1.4,
                    act_gib=0.3),
               dict(shape="a", provider="ours", round=0, fwdbwd_tflops=280, busy_fwdbwd_tflops=400,
                    graph_fwdbwd_tflops=390, peak_gib=1.0, act_gib=0.27)]
    by = {r["provider"]: r for r in bench_layer.summarize(results, "liger")}
    assert math.isclose(by["ours"]["busy_fwdbwd_ratio"], 400 / 250)
    assert math.isclose(by["ours"]["fwdbwd_ratio"], 280 / 200)
    assert "graph_fwdbwd_ratio" not in by["ours"]  # the baseline has no graph figure to divide by
    bench_layer.print_summary(list(by.values()), "liger")
    table = capsys.readouterr().out
    assert "GPU busy" in table and "1.600" in table


def test_bench_step_runs_on_the_cpu(tmp_path):
    """bench_step's smoke run: the compiled block's step timed (wall only on the CPU), the table and
    results.json written."""
    import json

    import bench_step

    bench_step.main(["--shapes", "tiny", "--device", "cpu", "--iters", "2", "--providers", "sonic",
                     "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    (row,) = results["results"]
    assert row["provider"] == "sonic" and row["shape"] == "tiny" and row["wall_ms"] > 0 and row["busy_ms"] is None
    assert row["plans"] == dict(planned=0, counting=0, unplanned=0)  # CPU calls are not planned
