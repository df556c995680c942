"""The token-rounding benchmark and quality example run end to end on the CPU (smoke sizes)."""
from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))


def test_bench_token_rounding_tiny(tmp_path):
    import bench_token_rounding as bench

    from moe_compiler.codegen.token_rounding import M_TILE

    results = bench.main(["--shapes", "tiny", "--device", "cpu", "--iters", "3", "--warmup", "1", "--out", str(tmp_path)])
    by = {r["provider"]: r for r in results}
    assert list(by) == list(bench.PROVIDERS)
    T, _, _, E, K = bench.SHAPES["tiny"]
    topk, up, down, nearest = (by[p] for p in ("topk", "round-up", "round-down", "round-nearest"))
    for r in results:
        assert math.isfinite(r["fwdbwd_ms"]) and r["fwdbwd_ms"] > 0
        assert sum(r["counts"]) == r["pairs"] and len(r["counts"]) == E
        assert r["pad_rows"] == sum(-c % M_TILE for c in r["counts"])
    assert topk["pairs"] == T * K and topk["pad_rows"] > 0  # the tiny routing leaves partial tiles to round
    assert up["pairs"] > T * K and up["pad_rows"] == 0 and all(c % M_TILE == 0 for c in up["counts"])
    assert up["slots"] == up["capacity"] > T * K
    assert down["pairs"] < T * K
    # rounding down only removes pairs: a token kept by keep_every_token returns to one of its top-k experts
    assert all(c <= t for c, t in zip(down["counts"], topk["counts"]))
    assert nearest["counts"] != topk["counts"] and nearest["pad_rows"] < topk["pad_rows"]
    assert all(abs(c - t) <= M_TILE // 2 for c, t in zip(nearest["counts"], topk["counts"]))
    saved = json.loads((tmp_path / "token_rounding.json").read_text())
    assert [r["provider"] for r in saved["results"]] == list(by) and saved["tile"] == M_TILE


def test_token_rounding_quality_tiny(tmp_path):
    pytest.importorskip("transformers")
    import token_rounding_quality as quality

    results = quality.main(["--device", "cpu", "--steps", "3", "--tiny", "--sonic-compiler", "eager",
                            "--out", str(tmp_path)])
    by = {r["mode"]: r for r in results}
    assert list(by) == list(quality.MODES)
    layers = quality.SIZES["tiny"]["num_hidden_layers"]
    topk = by["topk"]
    assert topk["train_routing"] == {"off": layers}
    for mode, r in by.items():
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
        assert math.isfinite(r["final_train_loss"]) and math.isfinite(r["val_loss"])
        assert r["verdict"] in ("PASS", "FAIL", "BETTER")
        # evaluation routes plain top-k: the compiled eval graph equals the eager model (fp32)
        assert r["val_loss"] == pytest.approx(r["val_loss_eager"], rel=1e-5)
        assert sum(r["eval_routing"].values()) == layers and mode not in r["eval_routing"]
        if mode != "topk":
            assert r["train_routing"] == {mode: layers}, r["train_routing"]
            assert r["losses"][0] != topk["losses"][0]  # same weights and batch: only the routing differs
    saved = json.loads((tmp_path / "token_rounding_quality.json").read_text())
    assert [r["mode"] for r in saved["results"]] == list(by)
