"""The `evaluated` finder (`patterns.evaluated`): stacked experts no finder reads, rewritten only
where a hypothesis of the op's arguments evaluates equal to the region; lookalikes stay."""
from __future__ import annotations

import pytest
import torch

import moe_compiler.patterns.verify as verify

from .naive_models import CapacityDispatchMoE, SlotGatherMoE
from .test_naive_patterns import FLAG, _check_gpu_bf16, _check_rewrite, _inputs, assert_left_alone


@pytest.mark.parametrize("bias", [True, False])
def test_switch_dispatch_that_cannot_drop_is_found_by_evaluation(bias):
    # [T, E, C] one-hot dispatch and combine, C = T: every token keeps its slot, so it is the op
    report = _check_rewrite(CapacityDispatchMoE(bias=bias), "evaluated", op="sonic::moe_experts")
    assert report.rewritten[0].details["verified"].startswith("evaluated equal"), str(report)


def test_slot_loop_over_gathered_weights_is_found_by_evaluation():
    _check_rewrite(SlotGatherMoE(), "evaluated", op="sonic::moe_experts")


@pytest.mark.parametrize("make,reason", [
    # half the tokens' capacity: the crowded routing drops tokens the op computes
    (lambda: CapacityDispatchMoE(capacity="half"), "no hypothesis evaluated equal"),
    # slot k's output weighted by the other slot's weight
    (lambda: SlotGatherMoE(weights="swapped"), "no hypothesis evaluated equal"),
])
def test_lookalikes_stay(make, reason, caplog):
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(make(), _inputs()[0], reason, caplog)


def test_a_region_too_large_to_evaluate_stays(caplog, monkeypatch):
    """No structural proof backs this finder: a region verify cannot evaluate is left alone."""
    monkeypatch.setitem(verify.MAX_FLOPS, "cpu", 1.0)
    monkeypatch.setitem(verify.MAX_BYTES, "cpu", 1)
    verify._cache.clear()
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(SlotGatherMoE(), _inputs()[0], "too large to evaluate", caplog)


@pytest.mark.gpu
@pytest.mark.parametrize("make", [CapacityDispatchMoE, SlotGatherMoE])
def test_found_by_evaluation_gpu_bf16(make):
    _check_gpu_bf16(make, "evaluated")
