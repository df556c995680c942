"""FSDP2 + backend="sonic" on the CPU: examples/fsdp_train.py under torchrun (2 gloo processes, tiny
Qwen3-MoE, fp32) against a single-process run of the same global batches."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from moe_compiler.testing import FP32_RTOL

pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS, STEPS = 2, 3


def run_fsdp_example(out: pathlib.Path) -> dict[str, dict]:
    # lr 5: the losses of this random-token data move by 1e-2..1e-1 a step, so a wrong gradient shows
    # far above FP32_RTOL (FSDP stepping with twice the gradient: 2.7e-1 off; the right one: 5e-8)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "examples" / "fsdp_train.py"), "--device", "cpu", "--model", "qwen3_moe", "--scale", "tiny",
        "--layers", str(LAYERS), "--steps", str(STEPS), "--batch", "4", "--lr", "5",
        "--providers", "eager,sonic", "--sonic-compiler", "aot_eager", "--out", str(out),
    ]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = json.loads((out / "qwen3_moe_tiny_fsdp2.json").read_text())["results"]
    return {r["provider"]: r for r in results}


def rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_fsdp2_sonic_matches_one_process(tmp_path):
    results = run_fsdp_example(tmp_path)
    eager, sonic = results["eager"], results["sonic"]

    # every rank compiled one decoder-layer graph without a break, rewrote its one MoE region, and
    # that graph served both layers: the op and its backward ran once per layer
    assert sonic["graphs"] == [1, 1] and sonic["graph_breaks"] == [0, 0]
    assert sonic["moe_regions_rewritten"] == [1, 1]
    for calls in sonic["sonic_op_calls"]:
        assert calls == {"sonic::moe_experts": LAYERS, "sonic::moe_experts_backward": LAYERS}
    assert eager["moe_regions_rewritten"] == [0, 0]
    assert all(n == 0 for calls in eager["sonic_op_calls"] for n in calls.values())

    # the ranks trained on different halves of each batch...
    rank0, rank1 = sonic["rank_losses"]
    assert rel_diff(rank0, rank1) > 100 * FP32_RTOL
    # ...and together equal one process on the whole batch at every step, while training moved the loss
    assert len(sonic["losses"]) == len(sonic["reference_losses"]) == STEPS
    assert rel_diff(sonic["losses"][-1:], sonic["losses"][:1]) > 100 * FP32_RTOL
    for result in (eager, sonic):
        assert result["max_rel_loss_diff"] <= FP32_RTOL, result["provider"]
    assert rel_diff(sonic["losses"], eager["losses"]) <= FP32_RTOL
