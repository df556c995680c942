"""The idioms users write themselves: `expert_loop`, `dense_experts` (nn.ModuleList experts) and
`dense_bmm` (stacked experts all run as bmm, Llama 4's spelling).

Each rewrite test checks, in training and under no_grad: outputs and every gradient (router,
experts, input) equal eager, exactly one region rewritten by the expected idiom, and
`sonic::moe_experts_list` executed (`sonic::moe_experts` for stacked [E, ., .] parameters sliced
per expert, `sonic::moe_experts_split` where gate and up are two of them). The negative grid must stay untouched, with its reason logged,
and still equal eager. The loop needs `capture_dynamic_output_shape_ops`, patched per test here.
"""
from __future__ import annotations

import logging
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import moe_compiler
from moe_compiler.backend import sonic_backend
from moe_compiler.testing import FP32_RTOL

from .helpers import assert_close_to_eager, profiled_op_names
from .naive_models import (ArgmaxTop2MoE, SparseMixerMoE, SortedMaskLoopMoE, AnyHitLoopMoE, MembershipLoopMoE, ScaledAfterLoopMoE, BatchedDenseMoE, BatchedGatheredMoE, BmmMoE, DeepSeekRefMoE, DenseMoE,
                           DispatchCombineMoE, GptOssDenseMoE, LoopMoE, PerKLoopMoE, RepeatLoopMoE, SplitLoopMoE,
                           OneHotTop1MoE, OwnMatmulExpertsMoE, StackedColumnsMoE, StackedLoopMoE, SwitchLoopMoE, TiledBmmMoE, TokenMajorMoE)

FLAG = "capture_dynamic_output_shape_ops"
OP = "sonic::moe_experts_list"
T, D = 12, 16


def _inputs(dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    cotangent = torch.randn(T, D, generator=g)
    return x.to(device, dtype), cotangent.to(device, dtype)


def _compile(model, compiler="aot_eager", **options):
    """`options`: more sonic options by their names without the prefix (patterns=...)."""
    extra = {f"sonic.{k}": v for k, v in options.items()}
    return torch.compile(model, backend="sonic", options={"sonic.compiler": compiler, "sonic.fallback": False, **extra})


def _out_and_grads(model, x, cotangent, params):
    """Output and the gradients of <out, cotangent> w.r.t. x and every parameter (unused: zeros)."""
    x = x.detach().requires_grad_()
    out = model(x)
    grads = torch.autograd.grad((out * cotangent).sum(), [x, *params.values()], allow_unused=True)
    names = ["x", *params]
    return out.detach(), {n: torch.zeros_like(p) if g is None else g for n, g, p in zip(names, grads, [x, *params.values()])}


def _check_rewrite(model, idiom, compiler="aot_eager", op=OP):
    """fp32 training and inference through backend="sonic" equal eager; one region of `idiom`; `op` runs."""
    x, cotangent = _inputs()
    params = dict(model.named_parameters())
    compiled = _compile(model, compiler)
    with torch._dynamo.config.patch(**{FLAG: True}):
        eager = _out_and_grads(model, x, cotangent, params)
        with moe_compiler.capture() as report:
            got = _out_and_grads(compiled, x, cotangent, params)
        _assert_one_rewrite(report, idiom)
        assert_close_to_eager(got[0], eager[0], what="output")
        assert got[1].keys() == eager[1].keys() and "gate.weight" in got[1]
        for name in eager[1]:
            assert_close_to_eager(got[1][name], eager[1][name], what=f"grad {name}")

        with torch.no_grad(), moe_compiler.capture() as inference_report:
            inference = compiled(x)
        _assert_one_rewrite(inference_report, idiom)
        assert_close_to_eager(inference, eager[0], what="no_grad output")
        with torch.no_grad():
            names = profiled_op_names(lambda: compiled(x))
    others = {OP, "sonic::moe_experts", "sonic::moe_experts_split"} - {op}
    assert op in names and not others & set(names), sorted(n for n in names if "::" in n)[:20]
    return report


def _assert_one_rewrite(report, idiom):
    assert [r.idiom for r in report.rewritten] == [idiom], str(report)
    assert not report.rejected, str(report)


LOOP_VARIANTS = {
    "one_hot-index_none-inplace": dict(),
    "eq-unsqueeze-functional-zeros": dict(where="eq", scale="unsqueeze", combine="functional", acc="zeros"),
    "nonzero-slice": dict(where="nonzero", scale="slice"),
    "cast-scale-up-first": dict(scale="cast", experts="gated_up_first"),
    "fused-chunk": dict(experts="fused"),
    "reglu": dict(acts=[F.relu] * 4),  # relu(g) * u experts
    "fused-slicing-eq": dict(experts="fused_slice", where="eq"),
    "non-gated-gelu": dict(experts="plain"),
    "non-gated-relu2-functional": dict(experts="plain_relu2", combine="functional"),
    # nn.Linear's default: every projection biased; the down projection alone
    "bias-gated": dict(bias=True),
    "bias-fused-eq": dict(experts="fused", where="eq", bias=True),
    "bias-non-gated": dict(experts="plain", bias=True),
    "bias-down-only": dict(bias="down"),
    # out[tok] += y (Mistral's reference moe.py), out[tok] = out[tok] + y
    "eq-setitem_iadd": dict(where="eq", combine="setitem_iadd"),
    "setitem_add-bias": dict(combine="setitem_add", bias=True),
    "none_reshape-rows": dict(rows="none_reshape", acc="zeros"),  # transformers 4.x's Mixtral block
    # top-1 by probs.max(dim=-1, keepdim=True): [T, 1] ids and weights, a top-k of 1
    "max_keepdim-eq-assign": dict(top1_keepdim=True, where="eq", combine="assign"),
    "max_keepdim-one_hot-bias": dict(top1_keepdim=True, bias=True),
    # nonzero's [N, 2] index pairs read by columns; rows added by index_put or a row-broadcast scatter_add
    "nonzero_columns-index_put": dict(where="nonzero_columns", combine="index_put"),
    "argwhere_unbind-scatter_add-bias": dict(where="argwhere_unbind", combine="scatter_add", bias=True),
    "eq-scatter_add_functional": dict(where="eq", combine="scatter_add_functional"),
    # an expert's weights selected by its [T, K] boolean mask (`w[ids == e]`); GPT-2-style GELU(tanh) experts
    "eq-bool_mask": dict(where="eq", scale="bool_mask"),
    "eq-bool_mask_none-gelu_tanh-bias": dict(where="eq", scale="bool_mask_none", experts="plain_gelu_tanh", bias=True),
}

DENSE_VARIANTS = {
    "scatter-stack_sum": dict(),
    "scatter_-einsum": dict(gates="scatter_", combine="einsum"),
    "one_hot-slices": dict(gates="one_hot", combine="slices"),
    "fused-one_hot-stack_sum": dict(experts="fused", gates="one_hot"),
    "non-gated-einsum": dict(experts="plain", combine="einsum"),
    "scatter_-builtin_sum": dict(gates="scatter_", combine="builtin_sum"),
    "softmax_neg_inf-stack_sum": dict(gates="softmax_neg_inf"),
    "bias-scatter-stack_sum": dict(bias=True),
    "bias-fused-one_hot-slices": dict(experts="fused", gates="one_hot", combine="slices", bias=True),
    "shared-slices": dict(combine="shared_slices"),
    "zeros-slices": dict(combine="zeros_slices", gates="one_hot"),
    "where_columns-fused-bias": dict(combine="where_columns", experts="fused", bias=True),
    "first_einsum": dict(combine="first_einsum"),
    "first_sum-one_hot-bias": dict(combine="first_sum", gates="one_hot", bias=True),
    "last_sum-fused": dict(combine="last_sum", experts="fused"),
    "last_einsum-plain": dict(combine="last_einsum", experts="plain"),
    "slot_where": dict(combine="slot_where"),
    "slot_where-fused-bias-top3": dict(combine="slot_where", experts="fused", bias=True, K=3),
}

BMM_VARIANTS = {
    "llama4": dict(),
    "llama4-top2": dict(K=2),
    "expand-out_in-softmax_neg_inf": dict(rows="expand", orient="out_in", gates="softmax_neg_inf", K=2),
    "index_none-gelu": dict(rows="index_none", act="gelu", K=2),
    "output-expand-zeros_scatter": dict(rows="expand", gate_on="output", gates="zeros_scatter", K=2),
    "output-repeat-sigmoid_neg_inf": dict(gate_on="output", K=2),
    "separate-gate-up": dict(gate_up="separate", K=2),
    "separate-gate-up-out_in-output": dict(gate_up="separate", orient="out_in", rows="expand", gate_on="output",
                                           gates="zeros_scatter", K=2),
    "einsum": dict(spelling="einsum", K=2),
    "einsum-output-out_in": dict(spelling="einsum", gate_on="output", orient="out_in", gates="zeros_scatter", K=2),
    "einsum-separate-gate-up-output": dict(spelling="einsum", gate_up="separate", gate_on="output",
                                           gates="softmax_neg_inf", K=2),
    "einsum-gelu": dict(spelling="einsum", act="gelu", gate_on="output", K=2),
    "matmul-separate-gate-up-output": dict(spelling="matmul", gate_up="separate", gate_on="output",
                                           gates="zeros_scatter", K=2),
    "matmul-out_in-input": dict(spelling="matmul", orient="out_in", K=2),
}


@pytest.mark.parametrize("variant", LOOP_VARIANTS)
def test_expert_loop_matches_eager(variant):
    report = _check_rewrite(LoopMoE(**LOOP_VARIANTS[variant]), "expert_loop")
    layout = report.rewritten[0].details["layout"]
    assert layout.startswith("per-expert list"), layout


PER_K_VARIANTS = {
    "k_outer-where-index_none": dict(),
    "e_outer-nonzero-slice-setitem_iadd": dict(order="e_outer", where="nonzero", scale="slice", combine="setitem_iadd"),
    "mask-unsqueeze-top3": dict(where="mask", scale="unsqueeze", combine="setitem_iadd", K=3),
    "mask-setitem_iadd-fused-bias": dict(where="mask", combine="setitem_iadd", experts="fused", bias=True),
    "mask-slice-setitem_iadd_inline": dict(where="mask", scale="slice", combine="setitem_iadd_inline", experts="plain",
                                           bias=True),
    "where-setitem_iadd_inline": dict(combine="setitem_iadd_inline"),
    "non-gated-e_outer-where": dict(experts="plain", order="e_outer"),
    "nonzero_squeeze": dict(where="nonzero_squeeze"),
    "nonzero_flatten-e_outer-setitem_iadd": dict(where="nonzero_flatten", order="e_outer", combine="setitem_iadd"),
    # a top-1 of topk: the [T, 1] weights read at the rows, w.index_select(0, tok) (= w[tok, 0:1])
    "top1-rows-nonzero_squeeze": dict(K=1, scale="rows", where="nonzero_squeeze"),
}


ANY_HIT_VARIANTS = {
    "mask": dict(),
    "where-index_add-bias": dict(rows="where", bias=True),
    "nonzero-iadd-fused": dict(rows="nonzero", experts="fused"),
    "mask-top3": dict(K=3),
    "where-scatter_add": dict(rows="where-scatter_add"),
    "nonzero_tuple-scatter_add": dict(rows="nonzero_tuple-scatter_add"),
    "where-scatter_add-rows_coef": dict(rows="where-scatter_add", coef="rows"),
    "where-rows_coef": dict(rows="where", coef="rows", experts="plain"),
    "masked_scatter-fused-top3": dict(rows="masked_scatter", experts="fused", K=3),
}


def test_phimoe_sparsemixer_top2_by_two_kept_maxes_matches_eager():
    """Two maxes with keepdim, the first scattered to -inf before the second, ids concatenated: a top-2."""
    _check_rewrite(SparseMixerMoE(), "expert_loop")


def test_a_second_max_over_unmasked_scores_stays(caplog):
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(SparseMixerMoE(masking="none"), _inputs()[0], "topk", caplog)


@pytest.mark.gpu
def test_phimoe_sparsemixer_gpu_bf16():
    _check_gpu_bf16(SparseMixerMoE, "expert_loop")


@pytest.mark.parametrize("variant", ANY_HIT_VARIANTS)
def test_expert_loop_over_tokens_holding_the_expert_anywhere_matches_eager(variant):
    # sel = (ids == e).any(-1) and (w * (ids == e)).sum(-1): torch.where(ids == e) and w[tok, k] in canonical form
    _check_rewrite(AnyHitLoopMoE(**ANY_HIT_VARIANTS[variant]), "expert_loop")


MEMBERSHIP_VARIANTS = {
    "count-one_hot-rows_column": dict(),
    "count_after-scatter-rows_int": dict(rows="count_after", gates="scatter", weight="rows_int"),
    "eq_count-one_hot-index_select": dict(rows="eq_count", weight="index_select"),
    "any-scatter-rows_column-addmm": dict(rows="any", gates="scatter", experts="addmm"),
    "gate-softmax_neg_inf-index_select": dict(rows="gate", gates="softmax_neg_inf", weight="index_select"),
    "gate-one_hot-rows_column-addmm": dict(rows="gate", experts="addmm"),
    "gate-scatter-rows_int-top3": dict(rows="gate", gates="scatter", weight="rows_int", K=3),
}


@pytest.mark.parametrize("variant", MEMBERSHIP_VARIANTS)
def test_expert_loop_over_counted_or_gated_members_matches_eager(variant):
    # an expert's tokens as a count of its one_hot slots or its gate column's nonzeros, its weights
    # read from a [T, E] gate matrix at (rows, column): torch.where(ids == e) and w[tok, k] in canonical form
    # (addmm experts: stacked [E, in, out] gate and down parameters, no up: the stacked op on them)
    op = "sonic::moe_experts" if "addmm" in variant else OP
    _check_rewrite(MembershipLoopMoE(**MEMBERSHIP_VARIANTS[variant]), "expert_loop", op=op)


SCALED_AFTER_VARIANTS = {
    "mask-view": dict(),
    "where-unsqueeze": dict(write="where", scale="unsqueeze"),
    "index_add_-none-gated": dict(write="index_add_", scale="none", experts="gated"),
    "index_add-view": dict(write="index_add"),
}


@pytest.mark.parametrize("variant", SCALED_AFTER_VARIANTS)
def test_expert_loop_top1_scaled_after_the_loop_matches_eager(variant):
    # out[m] = expert(x[m]) for every expert, then out * p[:, None]: each expert's rows scaled by p[tok]
    _check_rewrite(ScaledAfterLoopMoE(**SCALED_AFTER_VARIANTS[variant]), "expert_loop")


@pytest.mark.parametrize("variant", PER_K_VARIANTS)
def test_expert_loop_per_column_matches_eager(variant):
    # for k in range(K): for e in range(E): rows where ids[:, k] == e, scaled by w[:, k]: every
    # (token, k) slot once, the op's sum
    _check_rewrite(PerKLoopMoE(**PER_K_VARIANTS[variant]), "expert_loop")


REPEAT_VARIANTS = {
    "deepseek-moe": dict(),  # its modeling code's training path, as published
    "function-shared-mask-zeros": dict(spelling="function"),
    "fused-bias": dict(experts="fused", bias=True),
    "non-gated-top3": dict(experts="plain", K=3),
    "int32-ids-function": dict(ids_int32=True, spelling="function"),
    "assign-zeros-scatter_add": dict(spelling="assign", K=3),
    "assign-flat-weights-index_add": dict(spelling="assign_flat"),
    "tile-view_repeat": dict(tile="view_repeat"),  # vLLM's reference: x.view(T, 1, d).repeat(1, K, 1)
    "tile-unsqueeze_expand-top3": dict(tile="unsqueeze_expand", K=3),
    # slots written by index_copy_ at their positions, tokens read at position // K: the repeat, spelled out
    "slots-index_copy-top3": dict(spelling="slots", K=3),
    "slots-index_copy-fused-bias": dict(spelling="slots", experts="fused", bias=True),
}


@pytest.mark.parametrize("variant", REPEAT_VARIANTS)
def test_repeat_loop_matches_eager(variant):
    report = _check_rewrite(RepeatLoopMoE(**REPEAT_VARIANTS[variant]), "repeat_loop")
    layout = report.rewritten[0].details["layout"]
    assert layout.startswith("per-expert list"), layout


@pytest.mark.parametrize("T,E,K,unused", [(1, 4, 2, False), (5, 3, 3, False), (9, 6, 2, True)],
                         ids=["one-token", "k-equals-e", "expert-never-chosen"])
def test_repeat_loop_edge_routings(T, E, K, unused):
    # one token (most experts' masks all False), every expert on every token (K = E), and an expert
    # no token picks; against eager, outputs and every gradient. (Not K = 1: the renormalised top-1
    # weight is 1, the gate's gradient 0, and eager's rounding noise around it no reference.)
    model = RepeatLoopMoE(E=E, K=K)
    g = torch.Generator().manual_seed(T)
    x, cotangent = (torch.randn(T, D, generator=g) for _ in range(2))
    if unused:  # positive rows against a gate row of -10s: expert 0 scores far below every other
        x = x.abs()
        with torch.no_grad():
            model.gate.weight[0] = -10.0
    params = dict(model.named_parameters())
    with torch._dynamo.config.patch(**{FLAG: True}):
        eager = _out_and_grads(model, x, cotangent, params)
        if unused:
            assert not (model.route(x)[2] == 0).any()
        with moe_compiler.capture() as report:
            got = _out_and_grads(_compile(model), x, cotangent, params)
    _assert_one_rewrite(report, "repeat_loop")
    assert_close_to_eager(got[0], eager[0], what="output")
    for name in eager[1]:
        assert_close_to_eager(got[1][name], eager[1][name], what=f"grad {name}")


def test_repeat_loop_transposed_ids_is_no_candidate():
    # flat = ids.t().reshape(-1) puts slot k*T + t where the repeated rows hold token t*K + k's
    # copy: not the loop's pairing, and not a flattened top-k index tensor, so not a candidate
    model = RepeatLoopMoE(transposed_ids=True)
    x, _ = _inputs()
    with torch._dynamo.config.patch(**{FLAG: True}), torch.no_grad(), moe_compiler.capture() as report:
        got = _compile(model)(x)
        want = model(x)
    assert not report.rewritten, str(report)
    assert_close_to_eager(got, want, what="output")


SWITCH_VARIANTS = {
    "assign-eq-relu": dict(experts="plain_relu"),
    "mask-assign": dict(where="mask"),  # out[m] = expert(x[m]) * p[m].unsqueeze(-1), m = ids == e
    "mask-iadd-gated": dict(where="mask", combine="iadd", scale="unsqueeze", experts="gated"),
    "assign-eq": dict(),
    "assign_slice-nonzero-rows_slice": dict(combine="assign_slice", where="nonzero", rows="slice"),
    "iadd-unsqueeze-gated": dict(combine="iadd", scale="unsqueeze", experts="gated"),
    "index_add-fused-no_bias": dict(combine="index_add", experts="fused", bias=False),
    # max(keepdim=True) then ids[:, 0] and p[:, 0]: the per-column form of a top-1 (K = 1)
    "keepdim-column-eq": dict(keepdim=True),
    "keepdim-column-mask-iadd": dict(keepdim=True, where="mask", combine="iadd"),
}


def test_deepseek_reference_loop_matches_eager():
    # DeepSeek-V3's reference model.py (less its bincount skip), copied widely: rewritten, its
    # gathered-weights router fused, the shared expert left beside it
    report = _check_rewrite(DeepSeekRefMoE(), "expert_loop")
    assert report.rewritten[0].details["router"].startswith("softmax->topk->gather, fused"), str(report)


@pytest.mark.parametrize("variant", SWITCH_VARIANTS)
def test_expert_loop_top1_max_matches_eager(variant):
    # Switch-style top-1: [T] ids and weights from max(dim=-1), handed to the op as [T, 1]
    _check_rewrite(SwitchLoopMoE(**SWITCH_VARIANTS[variant]), "expert_loop")


@pytest.mark.parametrize("variant", DENSE_VARIANTS)
def test_dense_experts_matches_eager(variant):
    _check_rewrite(DenseMoE(**DENSE_VARIANTS[variant]), "dense_experts")


@pytest.mark.parametrize("variant", BMM_VARIANTS)
def test_dense_bmm_matches_eager(variant):
    separate = BMM_VARIANTS[variant].get("gate_up") == "separate"  # the split op: the list form on each expert's views
    op = "sonic::moe_experts_split" if separate else "sonic::moe_experts"
    report = _check_rewrite(BmmMoE(**BMM_VARIANTS[variant]), "dense_bmm", op=op)
    layout = report.rewritten[0].details["layout"]
    assert ("router-scaled inputs" in layout) == (BMM_VARIANTS[variant].get("gate_on", "input") == "input"), layout



# transformers 4.5x's Llama 4 (`TiledBmmMoE`): rows by a tiled arange, added back by it, transposed scores
TILED_VARIANTS = {
    "llama4-4.5x": dict(),
    "top2-index_select-index_add_": dict(K=2, rows="index_select", combine="index_add_"),
    "getitem-scatter_add-zeros": dict(rows="getitem", combine="scatter_add", shared=False, K=2),
    "repeat-tile": dict(tile="repeat", K=2),
}


@pytest.mark.parametrize("variant", TILED_VARIANTS)
def test_dense_bmm_tiled_rows_match_eager(variant):
    report = _check_rewrite(TiledBmmMoE(**TILED_VARIANTS[variant]), "dense_bmm", op="sonic::moe_experts")
    assert "router-scaled inputs" in report.rewritten[0].details["layout"], str(report)


def test_dense_bmm_with_biases_gated_on_the_outputs_matches_eager():
    """transformers 4.5x's gpt-oss training path: stacked biases, interleaved clamped SwiGLU."""
    report = _check_rewrite(GptOssDenseMoE(), "dense_bmm", op="sonic::moe_experts")
    details = report.rewritten[0].details
    assert details["activation"] == "swiglu_oai" and "bias" in details["layout"], str(report)


def test_dense_bmm_with_biases_scaled_on_the_inputs_stays(caplog):
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(GptOssDenseMoE(gate_on="input"), _inputs()[0], "maps its zero row to its biases", caplog)


def test_dense_bmm_dispatch_and_combine_matches_eager():
    """Rows masked by the 0/1 dispatch matrix of the top-k ids, outputs weighted by the combine matrix."""
    report = _check_rewrite(DispatchCombineMoE(), "dense_bmm", op="sonic::moe_experts")
    assert "router-scaled inputs" not in report.rewritten[0].details["layout"], str(report)


def test_dense_bmm_dispatch_of_fewer_experts_than_combine_stays(caplog):
    """A dispatch mask of the top-1 under a top-2 combine: the second expert reads zero rows."""
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(DispatchCombineMoE(dispatch_k=1), _inputs()[0], "not the 0/1 indicator", caplog)


def test_dense_bmm_rows_of_other_tokens_stay(caplog):
    """arange(T) rolled by one reads every token's neighbour: no rule makes it x.repeat(E, 1)."""
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(TiledBmmMoE(tile="shifted"), _inputs()[0], "none found its first projection", caplog)

# every expert computed token-major ([T, E, .] einsums), weighted by a gate matrix or read at the top-k
TOKEN_MAJOR_VARIANTS = {
    "separate-gates_einsum": dict(),
    "separate-gates_product-out_in": dict(combine="gates_product", orient="out_in"),
    "fused-gather_index": dict(gate_up="fused", combine="gather_index"),
    "plain-gather-out_in": dict(gate_up="plain", combine="gather", orient="out_in"),
    # nn.Linear(d, E * f) packs the first projections [E, f, d]; the down weights in the same
    # orientation, or in the other ([E, f, d] read as [E, in, out]: the packed view handed over transposed)
    "packed-gather_index-out_in": dict(gate_up="packed", combine="gather_index", orient="out_in"),
    "packed-gates_product-mixed": dict(gate_up="packed", combine="gates_product"),
}


@pytest.mark.parametrize("variant", TOKEN_MAJOR_VARIANTS)
def test_dense_bmm_token_major_matches_eager(variant):
    separate = TOKEN_MAJOR_VARIANTS[variant].get("gate_up", "separate") == "separate"
    _check_rewrite(TokenMajorMoE(**TOKEN_MAJOR_VARIANTS[variant]), "dense_bmm",
                   op="sonic::moe_experts_split" if separate else "sonic::moe_experts")


@pytest.mark.parametrize("selection", ["sort", "argsort"])
@pytest.mark.parametrize("model,idiom", [(LoopMoE, "expert_loop"), (TokenMajorMoE, "dense_bmm")])
def test_top_k_taken_from_a_descending_sort_matches_eager(selection, model, idiom):
    layer = model(K=2) if model is TokenMajorMoE else model(d=16, n=8, E=4, K=2)
    layer.selection = selection  # the first K of sort(descending=True), or of argsort with the weights gathered
    _check_rewrite(layer, idiom, op="sonic::moe_experts_split" if model is TokenMajorMoE else OP)


def test_dense_bmm_token_major_outputs_of_other_tokens_stay(caplog):
    """The outputs read at the next token's ids: no gate matrix, no sum over the experts."""
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(TokenMajorMoE(combine="gather_other"), _inputs()[0], "not a sum over the experts", caplog)


def test_dense_bmm_is_sparse():
    """The rewrite runs each expert on its top-k rows only: the op sees T*K rows, not E*T."""
    model = BmmMoE(E=8, K=1)
    x, _ = _inputs()
    compiled = _compile(model)
    with torch.no_grad():
        with moe_compiler.capture() as report:
            compiled(x)
        names = profiled_op_names(lambda: compiled(x))
    assert report.rewritten[0].details["K"] == "1" and report.rewritten[0].details["E"] == "8", str(report)
    assert "sonic::moe_experts" in names and "aten::bmm" not in names, sorted(n for n in names if "::" in n)


def test_dense_bmm_layers_in_one_graph():
    """Two layers, the second reading the first's output out of place: each up projection finds its
    own down projection, not the next layer's bmm (which its output also reaches)."""
    class TwoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = BmmMoE(K=2), BmmMoE(K=2)

        def forward(self, x):
            h = x + self.first(x)
            return h + self.second(h)

    torch.manual_seed(0)
    model = TwoLayers()
    x, cotangent = _inputs()
    params = dict(model.named_parameters())
    eager = _out_and_grads(model, x, cotangent, params)
    with moe_compiler.capture() as report:
        got = _out_and_grads(_compile(model), x, cotangent, params)
    assert [r.idiom for r in report.rewritten] == ["dense_bmm", "dense_bmm"] and not report.rejected, str(report)
    assert_close_to_eager(got[0], eager[0], what="output")
    for name in eager[1]:
        assert_close_to_eager(got[1][name], eager[1][name], what=f"grad {name}")


def test_dense_bmm_no_token_rounding_on_scaled_inputs():
    """Rounding would add rows whose weight means nothing to an input-scaled expert: it stays off."""
    model = BmmMoE(K=2)
    x, _ = _inputs()
    compiled = torch.compile(model, backend="sonic", options={"sonic.compiler": "aot_eager", "sonic.fallback": False,
                                                              "sonic.token_rounding": "nearest"})
    with moe_compiler.capture() as report:
        got = compiled(x)
    assert report.rewritten and report.rewritten[0].details.get("token_rounding", "off").startswith("off"), str(report)
    assert_close_to_eager(got.detach(), model(x).detach(), what="output")


@pytest.mark.parametrize("model,kwargs", [(LoopMoE, {}), (DenseMoE, {}), (LoopMoE, dict(bias=True, combine="setitem_iadd")),
                                          (RepeatLoopMoE, dict(bias=True))],
                         ids=["expert_loop", "dense_experts", "expert_loop-bias-setitem", "repeat_loop-bias"])
def test_inductor(model, kwargs):
    """The full path: the unbacked sizes of torch.where (or of boolean-mask rows) go with the region,
    Inductor compiles the rest (and the stacking of the Linears' biases)."""
    idiom = {LoopMoE: "expert_loop", DenseMoE: "dense_experts", RepeatLoopMoE: "repeat_loop"}[model]
    _check_rewrite(model(**kwargs), idiom, compiler="inductor")


def test_layouts_reported():
    cases = {"gated": "per-expert list, separate gate/up", "fused": "per-expert list, fused gate/up concatenated",
             "plain": "per-expert list"}
    x, _ = _inputs()
    for experts, layout in cases.items():
        torch._dynamo.reset()
        with torch._dynamo.config.patch(**{FLAG: True}), torch.no_grad(), moe_compiler.capture() as report:
            _compile(LoopMoE(experts=experts))(x)
        assert [r.details["layout"] for r in report.rewritten] == [layout], str(report)
        assert report.rewritten[0].details["activation"] == {"gated": "swiglu", "fused": "swiglu", "plain": "gelu"}[experts]


@pytest.mark.parametrize("model", [LoopMoE, lambda: LoopMoE(combine="setitem_iadd"), lambda: SwitchLoopMoE(where="mask"),
                                   RepeatLoopMoE, lambda: RepeatLoopMoE(spelling="function")],
                         ids=["index_add", "setitem", "top1-boolean-mask", "repeat", "repeat-function"])
def test_region_erased_with_its_asserts(model):
    """No torch.where, index_add, setitem, boolean-mask gather, runtime assert, repeated rows or
    expert Linear survives the rewrite; the router does."""
    graphs = []

    def backend(gm, example_inputs):
        compiled = sonic_backend(gm, example_inputs, options={"sonic.compiler": "eager", "sonic.fallback": False})
        graphs.append(gm.graph)
        return compiled

    model = model()
    x, _ = _inputs()
    with torch._dynamo.config.patch(**{FLAG: True}), torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        assert_close_to_eager(got, model(x), what="output")
    (graph,) = graphs
    targets = [str(n.target) for n in graph.nodes if n.op in ("call_function", "call_method")]
    assert sum("moe_experts_list" in t for t in targets) == 1, targets
    for gone in ("where", "index_add", "setitem", "_assert_scalar", "sym_size", "one_hot", "nonzero", "repeat_interleave",
                 "empty_like", "zeros_like"):
        assert not any(gone in t for t in targets), (gone, targets)
    assert not any(n.target is operator.getitem and n.args[0].name == "l_x_" for n in graph.nodes
                   if n.op == "call_function"), targets  # no x[tok] / x[m] rows gathered
    assert sum("linear" in t for t in targets) == 1, targets  # the router's gate


def test_dynamic_batch():
    """A second batch size re-traces with a symbolic T (and unbacked where sizes): still rewritten."""
    model = LoopMoE()
    compiled = _compile(model)
    with torch._dynamo.config.patch(**{FLAG: True}), torch.no_grad(), moe_compiler.capture() as report:
        for tokens in (8, 12, 5):
            x = torch.randn(tokens, D)
            assert_close_to_eager(compiled(x), model(x), what=f"T={tokens}")
    assert report.records and all(r.status == "rewritten" for r in report.records), str(report)


@pytest.mark.parametrize("variant", ["llama4", "expand-out_in-softmax_neg_inf"])
def test_dense_bmm_dynamic_batch(variant):
    """Llama 4's spelling with a symbolic T (the repeat, views and gate column sized by it)."""
    model = BmmMoE(**BMM_VARIANTS[variant])
    compiled = _compile(model)
    with torch.no_grad(), moe_compiler.capture() as report:
        for tokens in (8, 12, 5):
            x = torch.randn(tokens, D)
            assert_close_to_eager(compiled(x), model(x), what=f"T={tokens}")
    assert report.records and all(r.status == "rewritten" for r in report.records), str(report)
    assert report.graphs == 2, str(report)  # a static graph, then one symbolic in T


def _rounded_twin(model, x, mode):
    """The oracle for token rounding: the model's router, round_routing, then the op in eager."""
    from moe_compiler.codegen.ops import moe_experts_list
    from moe_compiler.codegen.token_rounding import round_routing

    probs, w, ids = model.route(x)
    slot_ids, slot_w, slot_token = round_routing(probs, ids, w, mode=mode)
    experts = model.experts
    return moe_experts_list(x, slot_ids, slot_w, [e.w1.weight for e in experts], [e.w3.weight for e in experts],
                            [e.w2.weight for e in experts], slot_token=slot_token)


def test_token_rounding_routes_through_slots():
    """sonic.token_rounding in a training graph: the list op takes the rounded slot form; output and
    gradients equal the eager round_routing twin, and differ from plain top-k."""
    model, mode = LoopMoE(), "nearest"
    g = torch.Generator().manual_seed(0)
    x, cotangent = torch.randn(40, D, generator=g), torch.randn(40, D, generator=g)
    params = dict(model.named_parameters())
    compiled = torch.compile(model, backend="sonic", options={
        "sonic.compiler": "aot_eager", "sonic.fallback": False, "sonic.token_rounding": mode})

    class Twin(torch.nn.Module):
        def forward(self, t):
            return _rounded_twin(model, t, mode)

    want = _out_and_grads(Twin(), x, cotangent, params)
    with torch._dynamo.config.patch(**{FLAG: True}):
        with moe_compiler.capture() as report:
            got = _out_and_grads(compiled, x, cotangent, params)
        plain = model(x).detach()
    assert [r.details["token_rounding"] for r in report.rewritten] == [mode], str(report)
    assert_close_to_eager(got[0], want[0], what="output")
    for name in want[1]:
        assert_close_to_eager(got[1][name], want[1][name], what=f"grad {name}")
    assert (got[0] - plain).norm() / plain.norm() > 1e-3  # rounding to 128-row tiles moved tokens


# Stacked [E, ., .] parameters sliced per expert (W[e]): the stacked op on the parameters, or the
# list op on the slices when gate and up are two parameters. Shapes [E, out, in] unless "in_out".
STACKED_VARIANTS = {
    "T-separate": (dict(), OP, "per-expert list, separate gate/up"),
    "linear-separate": (dict(orient="linear"), OP, "per-expert list, separate gate/up"),
    "T-fused": (dict(gate_up="fused"), "sonic::moe_experts", "concatenated"),
    "linear-plain": (dict(orient="linear", gate_up="plain"), "sonic::moe_experts", "concatenated"),
    "in_out-fused": (dict(orient="in_out", gate_up="fused"), "sonic::moe_experts", "concatenated, transposed"),
    # [E, in, out] gate and up: the split op (the list form on each slice's .t(): views, no copy)
    "in_out-separate": (dict(orient="in_out"), "sonic::moe_experts_split",
                        "separate gate/up (two stacked parameters, transposed)"),
    # d == n: [E, in, out] and [E, out, in] have one shape; only the graph's (absent) transpose tells
    "in_out-plain-square": (dict(n=D, orient="in_out", gate_up="plain"), "sonic::moe_experts", "concatenated, transposed"),
    "T-fused-square": (dict(n=D // 2, gate_up="fused"), "sonic::moe_experts", "concatenated"),
    # F.linear(h, W[e], B[e]): B itself to the stacked op; the separate form's slices stacked for the list op
    "linear-plain-bias": (dict(orient="linear", gate_up="plain", bias=True), "sonic::moe_experts", "concatenated, bias"),
    "linear-fused-bias": (dict(orient="linear", gate_up="fused", bias=True), "sonic::moe_experts", "concatenated, bias"),
    "linear-separate-bias": (dict(orient="linear", bias=True), OP, "per-expert list, separate gate/up, bias"),
    # biases added after the product, h @ W[e] + B[e], and rows read by index_select
    "in_out-plain-bias-added": (dict(orient="in_out", gate_up="plain", bias=True), "sonic::moe_experts",
                                "concatenated, transposed, bias"),
    "T-fused-bias-added": (dict(gate_up="fused", bias=True), "sonic::moe_experts", "concatenated, bias"),
    "in_out-fused-index_select": (dict(orient="in_out", gate_up="fused", rows="index_select"), "sonic::moe_experts",
                                  "concatenated, transposed"),
    # a fused [E, 2n, d] read in halves W[e, :n], W[e][n:]: the list op on those views (either half the gate)
    "linear-halves": (dict(orient="linear", gate_up="halves"), OP, "per-expert list, separate gate/up"),
    "T-halves_swapped": (dict(gate_up="halves_swapped"), OP, "per-expert list, separate gate/up"),
    "linear-halves-bias": (dict(orient="linear", gate_up="halves", bias=True), OP,
                           "per-expert list, separate gate/up, bias"),
    # one 2-D [E * out, in] parameter per projection viewed as [E, out, in] where an expert reads it (DBRX's)
    "T-separate-packed": (dict(packed=True), OP, "per-expert list, separate gate/up"),
    # the packed views cut into one piece per expert before the loop (`chunk(E, 0)[e].squeeze(0)`, `unbind(0)[e]`)
    "T-separate-packed-chunk": (dict(packed="chunk"), OP, "per-expert list, separate gate/up"),
    "linear-fused-packed-unbind": (dict(orient="linear", gate_up="fused", packed="unbind"), "sonic::moe_experts",
                                   "concatenated"),
    # the down weights in the other orientation (DBRX's storage): the op reads w2.transpose(1, 2), a view
    "T-separate-packed-down-in_out": (dict(packed=True, down_orient="in_out"), "sonic::moe_experts_split",
                                      "separate gate/up (two stacked parameters), down weights in the other orientation"),
    "in_out-plain-square-down-T": (dict(n=D, orient="in_out", gate_up="plain", down_orient="T"), "sonic::moe_experts",
                                   "concatenated, transposed, down weights in the other orientation"),
    "linear-fused-bias-down-in_out": (dict(orient="linear", gate_up="fused", bias=True, down_orient="in_out"),
                                      "sonic::moe_experts", "concatenated, down weights in the other orientation, bias"),
    "linear-plain-packed-once": (dict(orient="linear", gate_up="plain", packed="once"), "sonic::moe_experts",
                                 "concatenated"),
    "in_out-fused-packed": (dict(orient="in_out", gate_up="fused", packed=True), "sonic::moe_experts",
                            "concatenated, transposed"),
}


@pytest.mark.parametrize("variant", STACKED_VARIANTS)
def test_expert_loop_stacked_matches_eager(variant):
    kwargs, op, layout = STACKED_VARIANTS[variant]
    model = StackedLoopMoE(**kwargs)
    report = _check_rewrite(model, "expert_loop", op=op)
    assert report.rewritten[0].details["layout"] == layout, str(report)
    assert {"w1", "w2"} <= set(dict(model.named_parameters()))  # the stacked params' grads were compared


@pytest.mark.parametrize("variant", ["T-separate", "in_out-fused"])
def test_expert_loop_stacked_inductor(variant):
    kwargs, op, _ = STACKED_VARIANTS[variant]
    _check_rewrite(StackedLoopMoE(**kwargs), "expert_loop", compiler="inductor", op=op)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_stacked_slices_reach_the_list_op_as_views(compiler, monkeypatch):
    """Gate and up in two stacked parameters: the list op gets the slices W[e] themselves, views
    into the parameters (each expert where it lies), never a stacked or transposed copy."""
    import moe_compiler.codegen.ops as ops

    model = StackedLoopMoE()
    x, _ = _inputs()
    calls, real = [], ops.stack_expert_lists
    monkeypatch.setattr(ops, "stack_expert_lists", lambda *lists: calls.append(lists) or real(*lists))
    with torch._dynamo.config.patch(**{FLAG: True}), torch.no_grad():
        _compile(model, compiler)(x)
    assert_expert_views(calls, (model.w1, model.w3, model.w2))


def assert_expert_views(calls, params):
    """One list-op call got, for each stacked parameter, its E slices W[e] themselves (no copy)."""
    assert len(calls) == 1, len(calls)
    for group, param in zip(calls[0], params, strict=True):
        assert len(group) == param.shape[0]
        for e, w in enumerate(group):
            assert w.data_ptr() == param[e].data_ptr() and w.stride() == param[e].stride() and w.shape == param[e].shape


@pytest.mark.parametrize("case", ["x", "x-view", "x-view-augmented", "x-view-relu-inplace", "weights", "repeat-x"])
def test_input_written_inside_the_region_is_untouched(case, caplog):
    # the op reads x, the routing and the weights where the region ends; eager read them where each
    # expert did: a write in place into one of them (or a view of one) in between must leave the
    # region alone (under no_grad, where autograd does not refuse the write itself)
    if case == "repeat-x":
        model = _RepeatWritesX()
    else:
        model = LoopMoE(mutate_input=case)
    x, _ = _inputs()
    with torch._dynamo.config.patch(**{FLAG: True}), torch.no_grad():
        want = model(x.clone())
        with caplog.at_level(logging.DEBUG, logger="moe_compiler"), moe_compiler.capture() as report:
            got = _compile(model)(x.clone())
    assert not report.rewritten and report.rejected, str(report)
    assert any("writes in place into" in r.reason for r in report.rejected), str(report)
    assert_close_to_eager(got, want, what="output")


class _RepeatWritesX(RepeatLoopMoE):
    """`RepeatLoopMoE` with x halved in place after the loop, before the combine."""

    def forward(self, x):
        _, w, ids = self.route(x)
        flat = ids.view(-1)
        xr = x.repeat_interleave(self.K, dim=0)
        y = torch.empty_like(xr)
        for e in range(self.E):
            y[flat == e] = self.experts[e](xr[flat == e])
        x.mul_(0.5)
        return (y.view(*w.shape, -1) * w.unsqueeze(-1)).sum(dim=1) + x


# -- negative grid: untouched, reason logged, equal to eager -------------------------------------

NEGATIVE = {
    "subset-of-experts": (lambda: LoopMoE(experts_used=[0, 1, 3]), "not every expert"),
    "repeat-rows-added-back-tiled": (lambda: RepeatLoopMoE(spelling="assign_tiled"), "not [T, K=2, d]"),
    "dense-sum-with-two-other-terms": (lambda: DenseMoE(combine="two_extra_slices"), "at most one other term"),
    "expert-visited-twice": (lambda: LoopMoE(experts_used=[0, 1, 2, 3, 1]), "added twice"),
    "spare-expert": (lambda: LoopMoE(spare_experts=1), "num_classes=5 but the router ranks E=4"),
    "one-expert-other-activation": (lambda: LoopMoE(acts=[F.silu, F.silu, F.gelu, F.silu]), "expert 2's activation (geglu) differs"),
    "bias-on-gate-only": (lambda: LoopMoE(bias="gate"), "has a bias on one of its gate and up projections only"),
    "bias-on-some-experts": (lambda: LoopMoE(bias=[True, True, False, True]), "expert 2 has biases on (up, down) = (False, False)"),
    "dense-bias-on-some-experts": (lambda: DenseMoE(bias=[False, True, True, True]), "expert 1 has biases on"),
    "stacked-next-bias-slice": (lambda: StackedLoopMoE(orient="linear", gate_up="plain", bias="next"), "is not the slice B[0]"),
    "stacked-next-bias-added": (lambda: StackedLoopMoE(orient="in_out", gate_up="plain", bias="next"), "is not the slice B[0]"),
    "unscaled": (lambda: LoopMoE(scale="none"), "not scaled by the routing weights"),
    "setitem-rows-read-elsewhere": (lambda: LoopMoE(combine="setitem_iadd_read"), "that are read elsewhere too"),
    "assign-with-top2": (lambda: LoopMoE(where="eq", combine="assign"), "while each token has K=2 experts"),
    "accumulator-read-in-loop": (lambda: LoopMoE(read_inside=True), "read inside the loop"),
    "stacked-next-slice": (lambda: StackedLoopMoE(index="next"), "reads l_self_parameters_w1_[1], not slice 0"),
    "stacked-shuffled-slices": (lambda: StackedLoopMoE(index="shuffled", gate_up="fused"), "not slice 0 of its stacked weight"),
    "stacked-expert-visited-twice": (lambda: StackedLoopMoE(experts_used=[0, 1, 2, 3, 1]), "added twice"),
    "stacked-subset": (lambda: StackedLoopMoE(experts_used=[0, 1, 3]), "not every expert"),
    # d == n: the down weight has w1's [E, out, in] shape but is read as [in, out]; the shapes cannot tell
    "stacked-weight-modified-in-loop": (lambda: StackedLoopMoE(mutate=True), "is modified in the graph"),
    # one packed [E * out, in] parameter viewed per expert and written in the loop: each expert's view
    # is its own node (the write between them keeps them apart), so they are not one stacked weight
    "stacked-packed-modified-in-loop": (lambda: StackedLoopMoE(packed=True, mutate=True),
                                        "from different stacked parameters"),
    # DBRX's layout: packed gate and up read as [out, in], the packed down as [in, out]
    "dense-softmax-gates": (lambda: DenseMoE(gates="probs"), "not provably zero outside the top-k"),
    "dense-softmax-gate-columns": (lambda: DenseMoE(gates="probs", combine="slices"), "not provably zero outside the top-k"),
    "dense-mixed-activations": (lambda: DenseMoE(combine="einsum", acts=[F.silu, F.gelu, F.silu, F.silu]), "expert 1's activation"),
    "bmm-dense-sigmoid-gates": (lambda: BmmMoE(gates="probs"), "not provably zero outside the top-k"),
    "bmm-large-negative-fill": (lambda: BmmMoE(gates="big_neg"), "not provably zero outside the top-k"),
    "bmm-untransposed-gate-column": (lambda: BmmMoE(column="untransposed"), "not taken from the gate matrix transposed"),
    "bmm-up-bias": (lambda: BmmMoE(bias=True), "an unchosen expert maps its zero row to its biases"),
    "bmm-ungated": (lambda: BmmMoE(gate_on="none"), "the experts are not gated"),
    "bmm-gated-twice": (lambda: BmmMoE(gate_on="both"), "gated on both"),
    # zeros_like: the rows of the expert left out stay defined in eager
    "per-k-weight-column-shifted": (lambda: PerKLoopMoE(weight_shift=1), "(the weights' column 0, as its mask's)"),
    "per-k-column-missing": (lambda: PerKLoopMoE(K=3, columns=[0, 2]), "not each of the K=3 columns"),
    "per-k-column-twice": (lambda: PerKLoopMoE(columns=[0, 1, 1]), "added twice for column 1"),
    "per-k-and-whole-mask": (lambda: PerKLoopMoE(whole_too=0), "mixes per-column masks"),
    "per-k-other-experts-for-a-column": (lambda: PerKLoopMoE(twin_for=1), "runs on different weights for different columns"),
    "repeat-subset": (lambda: RepeatLoopMoE(spelling="function", experts_used=[0, 1, 3]), "not every expert"),
    "repeat-reads-other-rows": (lambda: RepeatLoopMoE(read_flipped=True), "does not read the repeated rows"),
    # x.repeat(K, 1): row r is token r mod T, not the token of slot r
    "repeat-tiled-rows": (lambda: RepeatLoopMoE(tile="tiled"), "repeat_interleave'd hidden states"),
    "repeat-rows-returned": (lambda: RepeatLoopMoE(y_read=True), "read 2 times besides the loop's writes"),
    "repeat-sum-over-d": (lambda: RepeatLoopMoE(sum_dim=2), "not summed over each token's K experts"),
    "repeat-other-activation": (lambda: RepeatLoopMoE(acts=[F.silu, F.gelu, F.silu, F.silu]), "activation"),
    "dense-slot-other-weight": (lambda: DenseMoE(combine="slot_where_other_weight"), "is weighted by slot 1's weight"),
    "dense-slot-other-expert": (lambda: DenseMoE(combine="slot_where_other_expert"), "by other weights than in slot 0"),
    # [d, n] parameters of each expert's own: the op takes [out, in] weights
    "dense-own-matmul-params": (OwnMatmulExpertsMoE, "a matmul plus a bias that is not a slice B[e]"),
}


class PackedViewedOnceMoE(nn.Module):
    """Packed [E * out, in] parameters viewed once as [E, out, in] before the loop, the packed down
    parameter scaled in place after expert 1 (`mutate`): the later experts read other weights."""

    def __init__(self, mutate, d=16, n=8, E=4):
        super().__init__()
        self.E, self.mutate = E, mutate
        self.gate = nn.Linear(d, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E * n, d) / d ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E * d, n) / n ** 0.5)

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(2, dim=-1)
        W1, W2 = self.w1.view(self.E, -1, x.shape[1]), self.w2.view(self.E, x.shape[1], -1)
        out = torch.zeros_like(x)
        for e in range(self.E):
            tok, k = torch.where(ids == e)
            out.index_add_(0, tok, (F.gelu(x[tok] @ W1[e].T) @ W2[e].T) * w[tok, k, None])
            if self.mutate and e == 1:
                with torch.no_grad():
                    self.w2.mul_(0.5)
        return out


@pytest.mark.parametrize("mutate", [False, True])
def test_a_packed_parameter_written_through_another_view_is_not_read_once(mutate):
    # the write is on the parameter, the experts read a view of it: found from the parameter itself
    x = _inputs()[0]
    with torch._dynamo.config.patch(**{FLAG: True}):
        report = moe_compiler.explain(PackedViewedOnceMoE(mutate), x)
    if mutate:
        assert not report.rewritten and any("is modified in the graph (by mul_)" in r.reason for r in report.rejected), str(report)
    else:
        assert [r.idiom for r in report.rewritten] == ["expert_loop"], str(report)


def assert_left_alone(model, x, reason, caplog, **options):
    """Compiled under no_grad: no region rewritten, one rejected with `reason` (logged as untouched),
    and the output still eager's. `options` as `_compile` takes them."""
    with torch.no_grad():
        want = model(x)
        with caplog.at_level(logging.DEBUG, logger="moe_compiler"), moe_compiler.capture() as report:
            got = _compile(model, **options)(x)
    assert not report.rewritten and report.rejected, str(report)
    assert any(reason in r.reason for r in report.rejected), str(report)
    assert "untouched" in caplog.text and reason in caplog.text
    assert_close_to_eager(got, want, what="output")


@pytest.mark.parametrize("case", NEGATIVE)
def test_negative_untouched(case, caplog):
    make, reason = NEGATIVE[case]
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(make(), _inputs()[0], reason, caplog)


@pytest.mark.parametrize("ids,combine", [("argmax", "slices"), ("max", "stack_first")])
def test_dense_experts_of_one_hot_top1_rows_match_eager(ids, combine):
    _check_rewrite(OneHotTop1MoE(ids=ids, combine=combine), "dense_experts")


@pytest.mark.parametrize("column,experts", [("masked_fill", "plain"), ("mul", "gated")])
def test_dense_experts_of_stacked_parameter_slices_match_eager(column, experts):
    op = "sonic::moe_experts_split" if experts == "gated" else "sonic::moe_experts"
    _check_rewrite(StackedColumnsMoE(column=column, experts=experts), "dense_experts", op=op)


def test_dense_experts_reading_another_experts_slice_are_left_alone(caplog):
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(StackedColumnsMoE(shift=1), _inputs()[0], "is not the slice B[1]", caplog)


def test_dense_experts_whose_gated_slices_belong_to_other_experts_are_left_alone(caplog):
    # no biases to compare: the gate W_gate[e] and up W_up[e + 1] read different experts' slices
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(StackedColumnsMoE(shift=1, experts="gated"), _inputs()[0], "not slice 0 of its stacked weight", caplog)


def test_one_hot_rows_of_ids_the_router_did_not_pick_are_left_alone(caplog):
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(OneHotTop1MoE(ids="shifted"), _inputs()[0], "not the indices of a torch.topk", caplog)


def test_experts_stacked_first_weighted_by_untransposed_gates_are_left_alone(caplog):
    # with T == E tokens `gates.unsqueeze(-1)` broadcasts against the [E, T, d] stack: out[t] =
    # sum_e gates[e, t] * outs[e, t], which weights token t by another token's gates
    x = _inputs()[0][:4]
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(DenseMoE(E=4, combine="first_untransposed"), x, "no transposed [T, E] gate matrix", caplog)


class _TokenSetitem(torch.nn.Module):
    """`emb[ids == image_token] = proj(features)`: a boolean-mask setitem outside any MoE."""

    def __init__(self):
        super().__init__()
        self.emb, self.proj = torch.nn.Embedding(10, D), torch.nn.Linear(D, D)

    def forward(self, ids, features):
        e = self.emb(ids)
        e[ids == 3] = self.proj(features)
        e[torch.where(ids == 4)[0]] = 2 * self.proj(features)
        return e


def test_setitem_off_a_routers_ids_is_no_candidate():
    # the setitem spellings of the loop are candidates only on the indices output of a topk or a
    # max (or a column of them): a token-id setitem outside any MoE is left as it is, nothing reported
    model, inputs = _TokenSetitem(), (torch.tensor([1, 3, 4, 3, 2, 4]), torch.randn(2, D))
    with torch._dynamo.config.patch(**{FLAG: True}), torch.no_grad(), moe_compiler.capture() as report:
        got = _compile(model)(*inputs)
        want = model(*inputs)
    assert not report.rewritten and not report.rejected, str(report)
    assert_close_to_eager(got, want, what="output")


@pytest.mark.parametrize("model", [SplitLoopMoE, lambda: LoopMoE(where="eq")], ids=["one_hot-returned", "eq-returned"])
def test_flag_off_gives_the_hint(model, caplog):
    """Without the flag the loop graph-breaks; the mask fragment that reaches the backend says what to set."""
    model = model()
    x, _ = _inputs()
    assert not torch._dynamo.config.capture_dynamic_output_shape_ops  # the package never sets it
    with caplog.at_level(logging.WARNING, logger="moe_compiler"), moe_compiler.capture() as report:
        got = _compile(model)(x)
    assert not report.rewritten, str(report)
    hints = [r for r in report.rejected if r.idiom == "expert_loop"]
    assert hints and all(f"{FLAG} = True" in r.reason for r in hints), str(report)
    assert f"{FLAG} = True" in caplog.text
    assert_close_to_eager(got, model(x), what="output")


def test_flag_on_no_hint_for_returned_mask():
    """With the flag set, a returned mask is somebody's output, not a loop fragment: no hint."""
    x, _ = _inputs()
    with torch._dynamo.config.patch(**{FLAG: True}), torch.no_grad(), moe_compiler.capture() as report:
        _compile(lambda t: F.one_hot(t.argmax(-1), 16))(x)
    assert not report.records, str(report)


def test_tolerance_is_tight():
    """The comparisons above are not vacuous: an expert left out moves the output past the bound."""
    model = LoopMoE()
    x, _ = _inputs()
    with torch._dynamo.config.patch(**{FLAG: True}), torch.no_grad():
        full = model(x)
        model.experts_used = [0, 1, 2]
        partial = model(x)
    assert (full - partial).norm() / full.norm() > 100 * FP32_RTOL


# -- autocast ------------------------------------------------------------------------------------


def _record_op_dtypes(monkeypatch) -> list:
    """The dtype of x at each `sonic::moe_experts*` forward from now on (both ops ask
    `codegen.ops.runs_triton(x)` for their kernels first, on every device)."""
    from moe_compiler.codegen import ops

    seen, runs_triton = [], ops.runs_triton
    monkeypatch.setattr(ops, "runs_triton", lambda x: seen.append(x.dtype) or runs_triton(x))
    return seen


class _Float32Expert(torch.nn.Module):
    """An expert that opts out of autocast: its products stay float32 while the others' are bf16."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            return self.inner(x.float())


# one model per idiom and weight form, for the autocast and checkpointing tests
IDIOM_CASES = {
    "loop-list": (lambda: LoopMoE(), "expert_loop"),
    "dense-list": (lambda: DenseMoE(experts="fused"), "dense_experts"),
    "dense-list-einsum": (lambda: DenseMoE(experts="fused", combine="einsum"), "dense_experts"),
    "bmm-stacked": (lambda: BmmMoE(K=2), "dense_bmm"),
    "bmm-einsum": (lambda: BmmMoE(K=2, spelling="einsum"), "dense_bmm"),
    "bmm-matmul": (lambda: BmmMoE(K=2, spelling="matmul", orient="out_in"), "dense_bmm"),
    "loop-stacked-plain": (lambda: StackedLoopMoE(orient="linear", gate_up="plain"), "expert_loop"),
    "repeat-list": (lambda: RepeatLoopMoE(), "repeat_loop"),
}


def _check_autocast(monkeypatch, make, idiom, device="cpu", compiler="aot_eager"):
    """float32 parameters under autocast(bfloat16): the experts' products are bf16 in eager, so the
    op runs on bf16 inputs (seen at the call, and reported), returns the dtype the region returned,
    and is as close to the float32 model as eager autocast is, gradients included."""
    torch.manual_seed(0)
    model = make().to(device)
    x, cotangent = _inputs(torch.float32, device)
    params = dict(model.named_parameters())
    with torch._dynamo.config.patch(**{FLAG: True}):
        truth = _out_and_grads(model, x, cotangent, params)
        compiled = _compile(model, compiler)
        with torch.autocast(device, dtype=torch.bfloat16):
            eager = _out_and_grads(model, x, cotangent, params)
            with moe_compiler.capture() as report:
                got = _out_and_grads(compiled, x, cotangent, params)
            seen = _record_op_dtypes(monkeypatch)
            with torch.no_grad():
                compiled(x)
    _assert_one_rewrite(report, idiom)
    assert report.rewritten[0].details["dtype"] == "bfloat16 (autocast, from float32)", str(report)
    assert seen == [torch.bfloat16], seen
    assert got[0].dtype == eager[0].dtype  # float32 from an index_add into x's dtype, bf16 from bmm sums
    assert_close_to_eager(got[0], eager[0], truth[0], torch.bfloat16, "output")
    for name in truth[1]:
        assert got[1][name].dtype == truth[1][name].dtype, name
        assert_close_to_eager(got[1][name], eager[1][name], truth[1][name], torch.bfloat16, f"grad {name}")


# the repeat loop cannot run under autocast in eager: its `y[flat == e] = ...` (index_put) into the
# float32 y refuses the experts' bf16 outputs
@pytest.mark.parametrize("case", [c for c in IDIOM_CASES if c != "repeat-list"])
def test_autocast_runs_the_op_in_the_autocast_dtype(case, monkeypatch):
    _check_autocast(monkeypatch, *IDIOM_CASES[case])


def test_autocast_on_some_experts_only_is_untouched():
    """One expert opts out of autocast: its products stay float32 while the others' are bf16. One op
    cannot honour both, so the region stays as it is, with the reason, and still equals eager."""
    model = LoopMoE()
    model.experts[0] = _Float32Expert(model.experts[0])
    x, _ = _inputs()
    with torch._dynamo.config.patch(**{FLAG: True}), torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model(x)
        with moe_compiler.capture() as report:
            got = _compile(model)(x)
    assert not report.rewritten and len(report.rejected) == 1, str(report)
    assert "several dtypes (bfloat16, float32)" in report.rejected[0].reason
    assert torch.equal(got, eager)


# -- activation checkpointing ----------------------------------------------------------------------


class _Checkpointed(torch.nn.Module):
    """The MoE block under `torch.utils.checkpoint`: Dynamo traces it into its own subgraph."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.parametrize("case", ["bmm-stacked", "dense-list", "loop-list", "repeat-list"])
def test_checkpointed_block_is_rewritten(case):
    make, idiom = IDIOM_CASES[case]
    model = _Checkpointed(make())
    x, cotangent = _inputs()
    params = dict(model.named_parameters())
    with torch._dynamo.config.patch(**{FLAG: True}):
        eager = _out_and_grads(model, x, cotangent, params)
        with moe_compiler.capture() as report:
            got = _out_and_grads(_compile(model), x, cotangent, params)
    _assert_one_rewrite(report, idiom)
    assert_close_to_eager(got[0], eager[0], what="output")
    for name in eager[1]:
        assert_close_to_eager(got[1][name], eager[1][name], what=f"grad {name}")


# -- bf16 on the GPU -----------------------------------------------------------------------------


def _check_gpu_bf16(make, idiom, device="cuda", compiler="inductor", tokens=None):
    """bf16 on CUDA through Inductor (or `compiler` on `device`): as close to the fp32 model as eager
    bf16 is. `tokens`: the leading dims of x ([T] by default)."""
    torch.manual_seed(0)
    fp32 = make().to(device)
    bf16 = make().to(device, torch.bfloat16)
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in fp32.state_dict().items()})
    x, cotangent = _inputs(torch.float32, device)
    if tokens is not None:
        x, cotangent = (torch.randn(*tokens, D, generator=torch.Generator().manual_seed(i)).to(device) for i in (0, 1))
    xb, cb = x.to(torch.bfloat16), cotangent.to(torch.bfloat16)
    with torch._dynamo.config.patch(**{FLAG: True}):
        truth = _out_and_grads(fp32, x, cotangent, dict(fp32.named_parameters()))
        eager = _out_and_grads(bf16, xb, cb, dict(bf16.named_parameters()))
        with moe_compiler.capture() as report:
            got = _out_and_grads(_compile(bf16, compiler), xb, cb, dict(bf16.named_parameters()))
    _assert_one_rewrite(report, idiom)
    assert_close_to_eager(got[0], eager[0], truth[0], torch.bfloat16, "output")
    for name in truth[1]:
        assert_close_to_eager(got[1][name], eager[1][name], truth[1][name], torch.bfloat16, f"grad {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["one_hot-index_none-inplace", "eq-unsqueeze-functional-zeros", "fused-chunk", "reglu",
                                     "bias-gated", "bias-non-gated", "eq-setitem_iadd", "none_reshape-rows",
                                     "nonzero_columns-index_put", "argwhere_unbind-scatter_add-bias",
                                     "eq-bool_mask_none-gelu_tanh-bias"])
def test_expert_loop_gpu_bf16(variant):
    _check_gpu_bf16(lambda: LoopMoE(**LOOP_VARIANTS[variant]), "expert_loop")


@pytest.mark.gpu
@pytest.mark.parametrize("combine,one_hot", [("loop", "functional"), ("dense", "functional"), ("loop", "scatter")])
def test_top2_by_two_argmaxes_gpu_bf16(combine, one_hot):
    # in bf16 the first argmax is over the logits: a bf16 softmax's rounding would tie experts the logits order
    idiom = "dense_experts" if combine == "dense" else "expert_loop"
    _check_gpu_bf16(lambda: ArgmaxTop2MoE(first="logits", combine=combine, one_hot=one_hot), idiom)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["deepseek-moe", "fused-bias", "assign-zeros-scatter_add", "slots-index_copy-top3", "tile-view_repeat"])
def test_repeat_loop_gpu_bf16(variant):
    _check_gpu_bf16(lambda: RepeatLoopMoE(**REPEAT_VARIANTS[variant]), "repeat_loop")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["assign-eq-relu", "iadd-unsqueeze-gated", "mask-assign"])
def test_expert_loop_top1_max_gpu_bf16(variant):
    _check_gpu_bf16(lambda: SwitchLoopMoE(**SWITCH_VARIANTS[variant]), "expert_loop")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["k_outer-where-index_none", "e_outer-nonzero-slice-setitem_iadd",
                                     "mask-setitem_iadd-fused-bias", "nonzero_squeeze", "top1-rows-nonzero_squeeze"])
def test_expert_loop_per_column_gpu_bf16(variant):
    _check_gpu_bf16(lambda: PerKLoopMoE(**PER_K_VARIANTS[variant]), "expert_loop")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["mask", "nonzero-iadd-fused", "masked_scatter-fused-top3", "nonzero_tuple-scatter_add"])
def test_expert_loop_any_hit_gpu_bf16(variant):
    _check_gpu_bf16(lambda: AnyHitLoopMoE(**ANY_HIT_VARIANTS[variant]), "expert_loop")



@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["count-one_hot-rows_column", "gate-softmax_neg_inf-index_select",
                                     "any-scatter-rows_column-addmm"])
def test_expert_loop_counted_or_gated_members_gpu_bf16(variant):
    _check_gpu_bf16(lambda: MembershipLoopMoE(**MEMBERSHIP_VARIANTS[variant]), "expert_loop")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["mask-view", "index_add-view"])
def test_expert_loop_top1_scaled_after_the_loop_gpu_bf16(variant):
    _check_gpu_bf16(lambda: ScaledAfterLoopMoE(**SCALED_AFTER_VARIANTS[variant]), "expert_loop")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["keepdim-column-eq"])
def test_expert_loop_top1_keepdim_column_gpu_bf16(variant):
    _check_gpu_bf16(lambda: SwitchLoopMoE(**SWITCH_VARIANTS[variant]), "expert_loop")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["scatter-stack_sum", "one_hot-slices", "softmax_neg_inf-stack_sum",
                                     "bias-scatter-stack_sum", "shared-slices", "where_columns-fused-bias",
                                     "first_einsum", "first_sum-one_hot-bias", "last_sum-fused", "slot_where"])
def test_dense_experts_gpu_bf16(variant):
    _check_gpu_bf16(lambda: DenseMoE(**DENSE_VARIANTS[variant]), "dense_experts")


@pytest.mark.gpu
@pytest.mark.parametrize("column,experts", [("masked_fill", "plain"), ("mul", "gated")])
def test_dense_experts_of_stacked_parameter_slices_gpu_bf16(column, experts):
    _check_gpu_bf16(lambda: StackedColumnsMoE(column=column, experts=experts), "dense_experts")


@pytest.mark.gpu
@pytest.mark.parametrize("ids,combine", [("argmax", "slices"), ("max", "stack_first")])
def test_dense_experts_of_one_hot_top1_rows_gpu_bf16(ids, combine):
    _check_gpu_bf16(lambda: OneHotTop1MoE(ids=ids, combine=combine), "dense_experts")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["llama4", "llama4-top2", "output-expand-zeros_scatter"])
def test_dense_bmm_gpu_bf16(variant):
    _check_gpu_bf16(lambda: BmmMoE(**BMM_VARIANTS[variant]), "dense_bmm")



@pytest.mark.gpu
@pytest.mark.parametrize("variant", TOKEN_MAJOR_VARIANTS)
def test_dense_bmm_token_major_gpu_bf16(variant):
    _check_gpu_bf16(lambda: TokenMajorMoE(**TOKEN_MAJOR_VARIANTS[variant]), "dense_bmm")


@pytest.mark.gpu
@pytest.mark.parametrize("selection", ["sort", "argsort"])
def test_top_k_taken_from_a_descending_sort_gpu_bf16(selection):
    def make():
        layer = LoopMoE(d=16, n=8, E=4, K=2)
        layer.selection = selection
        return layer

    _check_gpu_bf16(make, "expert_loop")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["llama4-4.5x", "top2-index_select-index_add_"])
def test_dense_bmm_tiled_rows_gpu_bf16(variant):
    _check_gpu_bf16(lambda: TiledBmmMoE(**TILED_VARIANTS[variant]), "dense_bmm")


@pytest.mark.gpu
def test_dense_bmm_biases_gpu_bf16():
    _check_gpu_bf16(GptOssDenseMoE, "dense_bmm")


@pytest.mark.gpu
def test_dense_bmm_dispatch_and_combine_gpu_bf16():
    _check_gpu_bf16(DispatchCombineMoE, "dense_bmm")


def test_dense_bmm_dispatch_and_combine_cpu_bf16():
    """bf16 on the CPU: the combine einsum stays as written (canonical_products) and is read as it is."""
    _check_gpu_bf16(DispatchCombineMoE, "dense_bmm", "cpu", "aot_eager")

@pytest.mark.gpu
@pytest.mark.parametrize("case", ["loop-list", "bmm-stacked"])
def test_autocast_gpu(case, monkeypatch):
    _check_autocast(monkeypatch, *IDIOM_CASES[case], device="cuda", compiler="inductor")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["T-separate", "in_out-fused", "linear-plain", "linear-fused-bias",
                                     "linear-separate-bias", "linear-halves", "T-separate-packed",
                                     "T-separate-packed-down-in_out", "in_out-plain-square-down-T",
                                     "linear-fused-bias-down-in_out"])
def test_expert_loop_stacked_gpu_bf16(variant):
    _check_gpu_bf16(lambda: StackedLoopMoE(**STACKED_VARIANTS[variant][0]), "expert_loop")


@pytest.mark.parametrize("variant", ["T-separate", "in_out-fused"])
def test_expert_loop_stacked_cpu_bf16(variant):
    """bf16 on the CPU (the reference op), aot_eager: as close to the fp32 model as eager bf16 is."""
    _check_gpu_bf16(lambda: StackedLoopMoE(**STACKED_VARIANTS[variant][0]), "expert_loop", "cpu", "aot_eager")


# -- hidden states never flattened: [B, S, d] ---------------------------------------------------

BATCHED_VARIANTS = {
    "scatter-slices": dict(),
    "one_hot-stack_sum": dict(gates="one_hot", combine="stack_sum"),
    "scatter-einsum": dict(combine="einsum"),
    "shared-slices": dict(combine="shared_slices", K=1),
}


@pytest.mark.parametrize("variant", BATCHED_VARIANTS)
def test_dense_experts_on_unflattened_tokens_match_eager(variant):
    from .test_canonical import _rewritten_and_equal

    torch.manual_seed(0)
    model, x = BatchedDenseMoE(**BATCHED_VARIANTS[variant]), torch.randn(2, 6, D)
    assert [r.idiom for r in _rewritten_and_equal(model, x)] == ["dense_experts"]
    compiled = _compile(model)
    with torch.no_grad():
        assert OP in profiled_op_names(lambda: compiled(x))


def test_gate_columns_of_sequence_positions_stay(caplog):
    """gates[:, e:e+1] of [B, S, E] gates is position e of each sequence: no expert's column (d = E
    here, so that the [B, 1, E] rows broadcast over the experts' [B, S, d] outputs)."""
    torch.manual_seed(0)
    model, x = BatchedDenseMoE(d=8, E=8, combine="colon_slices"), torch.randn(2, 8, 8)
    with torch.no_grad():
        want = model(x)
        with caplog.at_level(logging.DEBUG, logger="moe_compiler"), moe_compiler.capture() as report:
            got = _compile(model)(x)
    assert not report.rewritten, str(report)
    assert_close_to_eager(got, want, what="output")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["scatter-slices", "one_hot-stack_sum"])
def test_dense_experts_on_unflattened_tokens_gpu_bf16(variant):
    _check_gpu_bf16(lambda: BatchedDenseMoE(**BATCHED_VARIANTS[variant]), "dense_experts")


@pytest.mark.parametrize("make", [BatchedDenseMoE, BatchedGatheredMoE],
                         ids=["dense", "gathered"])
def test_unflattened_tokens_at_new_sequence_lengths(make):
    """A second sequence length recompiles with a symbolic S: the op's [T, .] views and the output's
    view back take no size from the first call."""
    torch.manual_seed(0)
    model = make()
    compiled = _compile(model)
    rewritten = []
    for S in (6, 9, 13):
        x = torch.randn(2, S, D)
        with moe_compiler.capture() as report:
            got = compiled(x)
        rewritten += report.rewritten
        assert_close_to_eager(got, model(x), what=f"S={S}")
    assert len(rewritten) == 2, rewritten  # the static first call, then the symbolic one


@pytest.mark.parametrize("make", [lambda: RepeatLoopMoE(spelling="assign"), lambda: TiledBmmMoE(K=2)],
                         ids=["repeat-interleaved-arange", "tiled-arange"])
def test_rows_copied_by_an_arange_at_new_token_counts(make):
    """A second token count recompiles with a symbolic T: arange(T)'s length is read as its symbol,
    and the copies' views take no size from the first call."""
    torch.manual_seed(0)
    model = make()
    compiled = _compile(model)
    rewritten = []
    with torch._dynamo.config.patch(**{FLAG: True}):
        for T in (12, 17, 23):
            x = torch.randn(T, D)
            with moe_compiler.capture() as report:
                got = compiled(x)
            rewritten += report.rewritten
            assert not report.rejected, str(report)
            assert_close_to_eager(got, model(x), what=f"T={T}")
    assert len(rewritten) == 2, rewritten  # the static first call, then the symbolic one


@pytest.mark.parametrize("mask,first,combine,one_hot", [("masked_fill", "probs", "loop", "functional"),
                                                        ("where", "logits", "loop", "functional"),
                                                        ("scatter", "probs", "dense", "functional"),
                                                        ("masked_fill", "logits", "dense", "functional"),
                                                        ("masked_fill", "probs", "loop", "scatter")])
def test_top2_by_two_argmaxes_matches_eager(mask, first, combine, one_hot):
    # fairseq's top2gating: argmax, the second argmax with the first masked to -inf, a combine matrix
    # of the two one_hots (F.one_hot or fairseq's own, ones scattered into zeros); read as one top-2
    idiom = "dense_experts" if combine == "dense" else "expert_loop"
    _check_rewrite(ArgmaxTop2MoE(mask=mask, first=first, combine=combine, one_hot=one_hot), idiom)


@pytest.mark.parametrize("kwargs,reason", [
    (dict(mask="unmasked"), "rows are not selected by mask[e] or ids == e"),  # the first expert twice
    (dict(first="other"), "rows are not selected by mask[e] or ids == e"),  # another router's argmax masked
    (dict(weights="shifted"), "rows are not selected by mask[e] or ids == e"),  # combine > 0 of signed weights
    (dict(mask="unmasked", combine="dense"), "is not provably zero outside the top-k"),
    (dict(first="other", combine="dense"), "is not provably zero outside the top-k")])
def test_two_argmaxes_that_are_not_a_top2_stay(kwargs, reason, caplog):
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(ArgmaxTop2MoE(**kwargs), _inputs()[0], reason, caplog)


def test_top2_by_two_argmaxes_with_signed_weights_in_a_dense_combine_matches_eager():
    _check_rewrite(ArgmaxTop2MoE(weights="shifted", combine="dense"), "dense_experts")


@pytest.mark.parametrize("kwargs", [dict(), dict(loop="index_copy", experts="packed"), dict(loop="index_put", read="gather"),
                                    dict(K=3, loop="index_copy", read="gather", experts="packed")],
                         ids=["setitem-list", "index_copy-packed", "index_put-gather", "top3-index_copy-gather-packed"])
def test_a_loop_over_sorted_slots_matches_eager(kwargs):
    # slots sorted by expert and put back at perm // K: run unsorted, then read as DeepSeek-MoE's repeat loop
    _check_rewrite(SortedMaskLoopMoE(**kwargs), "repeat_loop",
                   op="sonic::moe_experts" if kwargs.get("experts") == "packed" else OP)


def test_a_loop_over_sorted_slots_masked_by_unsorted_ids_is_left_alone(caplog):
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(SortedMaskLoopMoE(masks="unsorted"), _inputs()[0], "", caplog)


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [dict(), dict(loop="index_copy", experts="packed")], ids=["setitem-list", "index_copy-packed"])
def test_a_loop_over_sorted_slots_gpu_bf16(kwargs):
    _check_gpu_bf16(lambda: SortedMaskLoopMoE(**kwargs), "repeat_loop")
