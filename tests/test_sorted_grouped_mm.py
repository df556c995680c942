"""The `sorted_grouped_mm` idiom: tokens sorted by expert (argsort/sort + histc), `torch._grouped_mm`
over the counts, and a scatter-add back to the tokens (torchtitan's MoE spelling).

`torch._grouped_mm` takes bf16 only under compile on the CPU, so every case runs in bf16 and is
compared as `_check_gpu_bf16` compares: outputs and every gradient as close to the fp32 model as
eager bf16 is, one region rewritten. The negative grid stays untouched with its reason.
"""
from __future__ import annotations


import pytest
import torch

import moe_compiler

from .naive_models import SortedGroupedMoE
from .test_naive_patterns import _check_gpu_bf16, _compile, _inputs, assert_left_alone

IDIOM = "sorted_grouped_mm"

VARIANTS = {
    "torchtitan": dict(score_before=True, combine="shared", casts=True),
    "scores-after-scatter_add": dict(),
    "fused-index-sort": dict(gate_up="fused", rows="index", sort="sort"),
    "inplace-scatter_add_": dict(combine="scatter_add_"),
    "index_add-scores-before": dict(combine="index_add", score_before=True),
    "K_eq_E": dict(K=4, gate_up="fused"),
    "cast-offsets": dict(offsets="cast"),  # counts.cumsum(0).to(torch.int32): a canonical form
    # rows un-sorted by a scatter into a [TK, d] buffer and summed per token (transformers' combine;
    # torchtitan 0.2's without its padding), gate and up as two grouped_mm
    "unsort-separate": dict(combine="unsort"),
    "unsort-separate-scores-before-index": dict(combine="unsort", score_before=True, rows="index"),
    # weighted after the unsort, per [T, K] slot
    "unsort-then-einsum": dict(combine="unsort_einsum"),
    "unsort-then-mul_sum-index": dict(combine="unsort_mul_sum", rows="index"),
    # transformers' layout (one fused gate_up, rows un-sorted back) with torchtitan's routing: counts
    # of the unsorted ids, rows by gather; hf_grouped_mm refuses those and hands the region over
    "unsort-fused": dict(combine="unsort", gate_up="fused"),
    "unsort-fused-then-einsum": dict(combine="unsort_einsum", gate_up="fused"),
    "unsort-fused-then-mul_sum-mask_counts-index": dict(combine="unsort_mul_sum", gate_up="fused", counts="mask_sum",
                                                        rows="index"),
    # torchtune's GroupedExperts: gate and up [E, d, n], down [E, n, d], handed to grouped_mm untransposed
    "in_out-separate": dict(orient="in_out", score_before=True),
    "in_out-fused": dict(orient="in_out", gate_up="fused"),
    # torchtitan 0.3's local path: counts from a routing mask, rows by x[tok], bf16 casts, the rows
    # scaled after the experts and added back by the library's own op
    "library-op-scatter_add": dict(combine="rows_scatter_add"),
    "torchtitan-0.3": dict(combine="rows_scatter_add", rows="index", counts="mask_sum", casts=True),
    "scatter_reduce-sum": dict(combine="scatter_reduce"),
}


# the experts as a for loop over the sorted rows split by `counts.tolist()` (a canonical form makes
# each projection's matmuls one grouped product); traced whole with capture_scalar_outputs
FOR_LOOPS = {
    "torchtitan-for-loop": dict(experts="for_loop", score_before=True, combine="shared"),
    "torchtune-for-loop": dict(experts="for_loop", orient="in_out", score_before=True),
    "for-loop-fused-scores-after": dict(experts="for_loop", gate_up="fused"),
}


@pytest.mark.parametrize("variant", FOR_LOOPS)
def test_experts_for_loop_over_split_rows_cpu_bf16(variant):
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        _check_gpu_bf16(lambda: SortedGroupedMoE(**FOR_LOOPS[variant]), IDIOM, "cpu", "aot_eager")


@pytest.mark.parametrize("variant", ["torchtitan-for-loop", "torchtune-for-loop"])
def test_experts_for_loop_in_float32_is_left_alone_with_the_reason(variant, caplog):
    """torch._grouped_mm computes in bf16 only, so a float32 loop over split rows keeps its loop, and
    the report says why instead of naming unrelated idioms (the routing scales these experts'
    inputs: no hypothesis of the evaluated finder either)."""
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        assert_left_alone(SortedGroupedMoE(**FOR_LOOPS[variant]), _inputs()[0],
                          "becomes torch._grouped_mm products (sorted_grouped_mm) only in bfloat16", caplog)


def test_experts_for_loop_in_float32_weighted_after_is_found_by_evaluation():
    """The float32 loop keeps no grouped_mm form, but weighted after the experts it computes the op:
    the evaluated finder's hypothesis evaluates equal, and the output and gradients are eager's."""
    from .test_evaluated import _evaluated_equal_to_eager

    _evaluated_equal_to_eager(SortedGroupedMoE(**FOR_LOOPS["for-loop-fused-scores-after"]), *_inputs(),
                              capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_sorted_grouped_mm_matches_eager_cpu_bf16(variant):
    _check_gpu_bf16(lambda: SortedGroupedMoE(**VARIANTS[variant]), IDIOM, "cpu", "aot_eager")


@pytest.mark.parametrize("combine", ["unsort_einsum", "unsort_mul_sum"])
def test_fused_experts_weighted_after_the_unsort_are_transformers_layout_cpu_bf16(combine):
    """x[perm // K], one fused gate_up, counts of the sorted ids, the un-sorted rows weighted per
    [T, K] slot: transformers' grouped_mm path with the weights applied after the unsort."""
    _check_gpu_bf16(lambda: SortedGroupedMoE(combine=combine, gate_up="fused", rows="index", sort="sort"),
                    "hf_grouped_mm", "cpu", "aot_eager")


def test_sorted_grouped_mm_inductor_cpu_bf16():
    _check_gpu_bf16(lambda: SortedGroupedMoE(**VARIANTS["torchtitan"]), IDIOM, "cpu", "inductor")


def test_torchtitan_03_counts_also_update_a_buffer_cpu_bf16():
    """torchtitan 0.3 in training adds the routing mask's counts into its `tokens_per_expert` buffer
    too: the region is rewritten, and the buffer gets the same counts as eager (the canonical
    counts stay in the graph for it, with a static shape)."""
    kwargs = dict(VARIANTS["torchtitan-0.3"], count_buffer=True)
    torch.manual_seed(0)
    eager = SortedGroupedMoE(**kwargs).to(torch.bfloat16)
    torch.manual_seed(0)
    model = SortedGroupedMoE(**kwargs).to(torch.bfloat16)
    x = _inputs()[0].to(torch.bfloat16)
    with moe_compiler.capture() as report:
        got = _compile(model)(x)
    assert [r.idiom for r in report.rewritten] == [IDIOM], str(report)
    want = eager(x)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert model.tokens_per_expert.sum() == x.shape[0] * 2
    assert torch.equal(model.tokens_per_expert, eager.tokens_per_expert)


def test_reported_layout():
    """torchtitan's layer: W1 and W3 separate, the weights on the inputs, its router fused."""
    model = SortedGroupedMoE(**VARIANTS["torchtitan"]).to(torch.bfloat16)
    x = _inputs()[0].to(torch.bfloat16)
    with torch.no_grad(), moe_compiler.capture() as report:
        _compile(model)(x)
    assert [r.idiom for r in report.rewritten] == [IDIOM], str(report)
    layout = "separate gate/up (two stacked parameters), router-scaled inputs"
    assert report.rewritten[0].details["layout"] == layout, str(report)
    # the router scales the op's rows, and is fused all the same
    assert report.rewritten[0].details["router"] == "softmax->topk->renorm, fused", str(report)


NEGATIVE = {
    "histc-range": (dict(histc_max=5), "does not give one bin per expert"),
    "tokens-of-other-K": (dict(tok_k=4), "rows are gathered by perm // 4 for K=2"),
    "scattered-by-perm": (dict(scatter_rows="perm"), "adds at other rows than the sorted tokens"),
    "descending-sort": (dict(descending=True), "not sorted ascending"),
    "descending-sort-values": (dict(descending=True, sort="sort"), "not sorted ascending"),
    # library ops that add back otherwise than a scatter_add: a gradient without src, each row's maximum
    "library-op-without-src-grad": (dict(combine="rows_scatter_add_no_src_grad"),
                                    "not scatter_add: its gradient of src differs on a probe"),
    "library-op-max": (dict(combine="rows_scatter_max"), "not scatter_add: its value differs on a probe"),
    # transformers' layout refused by both finders: the report gives both reasons
    "unsort-fused-histc-range": (dict(histc_max=5, gate_up="fused", combine="unsort"),
                                 "as sorted_grouped_mm: histc range (0, 5) does not give one bin per expert"),
    "unsort-fused-tokens-of-other-K": (dict(tok_k=4, gate_up="fused", combine="unsort_einsum"),
                                       "as sorted_grouped_mm: rows are gathered by perm // 4 for K=2"),
    "unsort-fused-descending": (dict(descending=True, gate_up="fused", combine="unsort"),
                                "as sorted_grouped_mm: expert ids are not sorted ascending"),
}


@pytest.mark.parametrize("case", NEGATIVE)
def test_sorted_grouped_mm_negative_untouched(case, caplog):
    kwargs, reason = NEGATIVE[case]
    assert_left_alone(SortedGroupedMoE(**kwargs).to(torch.bfloat16), _inputs()[0].to(torch.bfloat16), reason, caplog)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["torchtitan", "scores-after-scatter_add", "fused-index-sort", "in_out-separate",
                                     "unsort-fused-then-einsum"])
def test_sorted_grouped_mm_gpu_bf16(variant):
    _check_gpu_bf16(lambda: SortedGroupedMoE(**VARIANTS[variant]), IDIOM)
