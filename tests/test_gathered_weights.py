"""The `gathered_weights` idiom: `einsum` on `W[ids]` (stacked weights gathered per token by the
top-k ids) as gpt-fast's Mixtral, gpt-oss's reference MLPBlock (with gathered biases) and SGLang's
native fallback (`W13[ids]` cut into gate and up) write it, and the same products as batched
matmuls or bmm over `W[ids.reshape(-1)]`, rewritten into the op.

As in test_naive_patterns: outputs and every gradient equal eager in training and under no_grad,
one region rewritten, the expected op executed; the negative grid stays untouched with its reason
and equals eager.
"""
from __future__ import annotations


import pytest
import torch

import moe_compiler

from .helpers import assert_close_to_eager
from .naive_models import BatchedGatheredMoE, GatheredMoE, GptOssReferenceMoE
from .test_naive_patterns import (D, _check_autocast, _check_gpu_bf16, _check_rewrite, _compile, _inputs, assert_expert_views,
                                  assert_left_alone)

IDIOM = "gathered_weights"
SPLIT_OP, STACKED_OP = "sonic::moe_experts_split", "sonic::moe_experts"

VARIANTS = {  # kwargs, the op, the reported layout
    "gpt-fast": (dict(), SPLIT_OP, "separate gate/up (two stacked parameters)"),
    "separate-mul_sum-letters": (dict(combine="mul_sum", letters=True), SPLIT_OP, "separate gate/up (two stacked parameters)"),
    "separate-in_out": (dict(orient="in_out"), SPLIT_OP, "separate gate/up (two stacked parameters, transposed)"),
    "fused-out_in": (dict(gate_up="fused"), STACKED_OP, "concatenated"),
    "fused-in_out-w_first": (dict(gate_up="fused", orient="in_out", combine="einsum_w_first"), STACKED_OP,
                             "concatenated, transposed"),
    "plain-index_none_sum": (dict(gate_up="plain", combine="index_none_sum"), STACKED_OP, "concatenated"),
    "cut-sglang-native": (dict(gate_up="cut", combine="einsum"), STACKED_OP, "concatenated"),
    "cut-split-in_out-mul_sum": (dict(gate_up="cut-split", orient="in_out", combine="mul_sum"), STACKED_OP,
                                 "concatenated, transposed"),
    "cut-sections-letters": (dict(gate_up="cut-sections", letters=True), STACKED_OP, "concatenated"),
    "plain-in_out-letters-K_eq_E": (dict(gate_up="plain", orient="in_out", letters=True, K=4), STACKED_OP,
                                "concatenated, transposed"),
    # the same products as batched matmuls (`canonical_products.gathered_product_to_einsum`)
    "matmul": (dict(products="matmul"), SPLIT_OP, "separate gate/up (two stacked parameters)"),
    "matmul-plain-in_out": (dict(products="matmul", gate_up="plain", orient="in_out"), STACKED_OP,
                            "concatenated, transposed"),
    "bmm_flat-fused": (dict(products="bmm_flat", gate_up="fused"), STACKED_OP, "concatenated"),
    "bmm_flat_t-in_out-flat": (dict(products="bmm_flat_t", orient="in_out", combine="flat"), SPLIT_OP,
                               "separate gate/up (two stacked parameters, transposed)"),
    "bmm_flat_t-fused-flat": (dict(products="bmm_flat_t", gate_up="fused", combine="flat"), STACKED_OP, "concatenated"),
    "bmm_flat-fused-flat_down_bias": (dict(products="bmm_flat", gate_up="fused", flat_down_bias=True, combine="mul_sum"),
                                      STACKED_OP, "concatenated, bias"),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_gathered_weights_match_eager(variant):
    kwargs, op, layout = VARIANTS[variant]
    report = _check_rewrite(GatheredMoE(**kwargs), IDIOM, op=op)
    assert report.rewritten[0].details["layout"] == layout, str(report)


@pytest.mark.parametrize("variant", ["gpt-fast", "fused-in_out-w_first", "cut-sglang-native", "bmm_flat_t-fused-flat"])
def test_gathered_weights_inductor(variant):
    kwargs, op, _ = VARIANTS[variant]
    _check_rewrite(GatheredMoE(**kwargs), IDIOM, compiler="inductor", op=op)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_separate_weights_reach_the_list_op_as_views(compiler, monkeypatch):
    """Gate and up in two stacked parameters: the list op gets W[e] views, never a gathered or
    stacked copy of the weights."""
    import moe_compiler.codegen.ops as ops

    model = GatheredMoE(E=5)
    x, _ = _inputs()
    calls, real = [], ops.stack_expert_lists
    monkeypatch.setattr(ops, "stack_expert_lists", lambda *lists: calls.append(lists) or real(*lists))
    with torch.no_grad():
        _compile(model, compiler)(x)
    assert_expert_views(calls, (model.w1, model.w3, model.w2))


def test_gathered_weights_dynamic_batch():
    model = GatheredMoE()
    compiled = _compile(model)
    with torch.no_grad(), moe_compiler.capture() as report:
        for tokens in (8, 12, 5, 1):
            x = torch.randn(tokens, D)
            assert_close_to_eager(compiled(x), model(x), what=f"T={tokens}")
    assert report.records and all(r.status == "rewritten" for r in report.records), str(report)


def test_gathered_weights_autocast(monkeypatch):
    _check_autocast(monkeypatch, lambda: GatheredMoE(gate_up="fused"), IDIOM)


NEGATIVE = {
    "down-other-ids": (dict(down_ids="flipped"), "no down projection on weights gathered by the same ids"),
    "up-rows-differ": (dict(up_rows="scaled"), "not only the up-projection output"),
    "y-read-elsewhere": (dict(y_read=True), "read more than once"),
    "summed-over-d": (dict(sum_dim=2), "not summed over each token's K experts"),
    "gather-read-elsewhere": (dict(gather_read=True), "read more than once"),
    # x.repeat(K, 1): slot (t, k) multiplies row (t K + k) mod T, not x[t]
    "bmm-rows-tiled": (dict(products="bmm_tiled"), "none found its first projection in those forms"),
    "separate-gate-bias": (dict(gate_bias=True), "biases on separate stacked gate and up parameters"),
    "cut-up-first": (dict(gate_up="cut", cut_swapped=True), "[up | gate] in one parameter is not a layout"),
    "cut-half-read-elsewhere": (dict(gate_up="cut", cut_read=True), "is read twice"),
}


@pytest.mark.parametrize("case", NEGATIVE)
def test_gathered_weights_negative_untouched(case, caplog):
    kwargs, reason = NEGATIVE[case]
    assert_left_alone(GatheredMoE(**kwargs), _inputs()[0], reason, caplog)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["gpt-fast", "fused-in_out-w_first", "plain-index_none_sum",
                                     "cut-split-in_out-mul_sum", "matmul", "bmm_flat-fused", "bmm_flat_t-fused-flat",
                                     "bmm_flat-fused-flat_down_bias"])
def test_gathered_weights_gpu_bf16(variant):
    _check_gpu_bf16(lambda: GatheredMoE(**VARIANTS[variant][0]), IDIOM)


# -- gpt-oss's reference MLPBlock: interleaved W1 [E, 2n, d] and biases gathered per token --------

GPT_OSS = {  # kwargs of GptOssReferenceMoE
    "reference": dict(),  # y += B2[ids, ...]
    "down-bias-added-first": dict(down_bias="add"),  # B2[ids, :] + y
    "no-down-bias": dict(down_bias="none"),
}


@pytest.mark.parametrize("variant", GPT_OSS)
def test_gpt_oss_reference_matches_eager(variant):
    report = _check_rewrite(GptOssReferenceMoE(**GPT_OSS[variant]), IDIOM, op=STACKED_OP)
    record = report.rewritten[0]
    assert record.details["layout"] == "interleaved, bias" and record.details["activation"] == "swiglu_oai", str(report)


def test_gpt_oss_reference_inductor():
    _check_rewrite(GptOssReferenceMoE(), IDIOM, compiler="inductor", op=STACKED_OP)


GPT_OSS_NEGATIVE = {
    "bias-other-ids": (dict(bias_ids="flipped"), "is not gathered by the top-k ids"),
    "bias-read-elsewhere": (dict(bias_read=True), "is read more than once"),
}


@pytest.mark.parametrize("case", GPT_OSS_NEGATIVE)
def test_gpt_oss_reference_negative_untouched(case, caplog):
    kwargs, reason = GPT_OSS_NEGATIVE[case]
    assert_left_alone(GptOssReferenceMoE(**kwargs), _inputs()[0], reason, caplog)


@pytest.mark.gpu
def test_gpt_oss_reference_gpu_bf16():
    _check_gpu_bf16(GptOssReferenceMoE, IDIOM)


def test_gpt_oss_reference_autocast(monkeypatch):
    # float32 biases meet bf16 einsums under autocast (eager adds them in float32)
    _check_autocast(monkeypatch, GptOssReferenceMoE, IDIOM)


@pytest.mark.parametrize("kwargs", [dict(), dict(gate_up="fused", combine="mul_sum")], ids=["separate-einsum", "fused-mul_sum"])
def test_gathered_weights_on_unflattened_tokens_match_eager(kwargs):
    """[B, S, d] hidden states and [B, S, K] ids: the op runs on their [T, .] views."""
    from .test_canonical import _rewritten_and_equal

    torch.manual_seed(0)
    model, x = BatchedGatheredMoE(**kwargs), torch.randn(2, 6, D)
    assert [r.idiom for r in _rewritten_and_equal(model, x)] == [IDIOM]


@pytest.mark.gpu
def test_gathered_weights_on_unflattened_tokens_gpu_bf16():
    from .test_naive_patterns import _out_and_grads

    torch.manual_seed(0)
    fp32 = BatchedGatheredMoE().cuda()
    bf16 = BatchedGatheredMoE().cuda().to(torch.bfloat16)
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in fp32.state_dict().items()})
    x = torch.randn(2, 64, D, device="cuda")
    cotangent = torch.randn_like(x)
    xb, cb = x.to(torch.bfloat16), cotangent.to(torch.bfloat16)
    truth = _out_and_grads(fp32, x, cotangent, dict(fp32.named_parameters()))
    eager = _out_and_grads(bf16, xb, cb, dict(bf16.named_parameters()))
    with moe_compiler.capture() as report:
        got = _out_and_grads(_compile(bf16, "inductor"), xb, cb, dict(bf16.named_parameters()))
    assert [r.idiom for r in report.rewritten] == [IDIOM], str(report)
    assert_close_to_eager(got[0], eager[0], truth[0], torch.bfloat16, "output")
    for name in truth[1]:
        assert_close_to_eager(got[1][name], eager[1][name], truth[1][name], torch.bfloat16, f"grad {name}")
