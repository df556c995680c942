"""The hf_grouped_mm pattern on tiny Hugging Face MoE models: numerics, rewrite count, op executed."""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

import moe_compiler
from moe_compiler.testing import MODELS, count_moe_layers, tiny_moe_model

from .helpers import (
    assert_close_to_eager,
    compile_sonic,
    loss_and_grads,
    profiled_op_names,
)

CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _ids(model, T=12, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, T), generator=g)


def _check_model(name, dtype, device="cpu", compiler="aot_eager", implementation=None, checkpointing=False,
                 **overrides):
    def setup(model):
        if implementation:
            model.config._experts_implementation = implementation
        if checkpointing:
            model.gradient_checkpointing_enable()
            model.train()
        return model

    model = setup(tiny_moe_model(name, dtype, **overrides).to(device))
    ids = _ids(model).to(device)
    truth = None
    if dtype != torch.float32:
        fp32 = tiny_moe_model(name, torch.float32, **overrides).to(device)
        fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        truth = loss_and_grads(setup(fp32), ids)
    eager = loss_and_grads(model, ids)
    compiled = compile_sonic(model, compiler=compiler)
    with moe_compiler.capture() as report:
        got = loss_and_grads(compiled, ids)
    assert len(report.rewritten) == count_moe_layers(model), str(report)
    assert not report.rejected, str(report)
    assert_close_to_eager(got[0], eager[0], truth and truth[0], dtype, "logits")
    assert got[1].keys() == eager[1].keys()
    for pname in eager[1]:
        assert_close_to_eager(got[1][pname], eager[1][pname], truth and truth[1][pname], dtype, f"grad {pname}")
    names = profiled_op_names(lambda: compiled(ids))
    assert any(n.startswith("sonic::moe_experts") for n in names), sorted(names)[:20]
    return report


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_hf_model_matches_eager(name, dtype):
    _check_model(name, dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_hf_batched_mm_matches_eager(name, dtype):
    """transformers' batched_mm experts (generate()'s decode path on the GPU) map to the same op."""
    report = _check_model(name, dtype, implementation="batched_mm")
    assert {r.idiom for r in report.rewritten} == {"hf_batched_mm"}


@pytest.mark.parametrize("name, implementation", [("qwen3_moe", "grouped_mm"), ("qwen3_moe", "batched_mm"), ("llama4", None)])
def test_generate_greedy_tokens_identical(name, implementation):
    """Prefill and decode under backend="sonic" produce eager's greedy tokens (fp32)."""
    model = tiny_moe_model(name)
    if implementation:
        model.config._experts_implementation = implementation
    prompt = _ids(model, T=6, batch=1)
    want = model.generate(prompt, max_new_tokens=6, do_sample=False)
    model.forward = torch.compile(model.forward, backend="sonic", options={"sonic.compiler": "aot_eager", "sonic.fallback": False})
    with moe_compiler.capture() as report:
        got = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    assert report.rewritten and not report.rejected, str(report)
    # prefill, first decode, then one dynamic-shape decode graph: never one compile per token
    assert report.graphs <= 4, str(report)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_llama4_dense_experts_become_sparse(dtype):
    """Llama 4 runs every expert on every token (bmm), its router's sigmoid scores scaling the
    inputs: rewritten by `dense_bmm` into the op on the T*K routed rows."""
    report = _check_model("llama4", dtype)
    assert {r.idiom for r in report.rewritten} == {"dense_bmm"}, str(report)
    assert all("router-scaled inputs" in r.details["layout"] for r in report.rewritten), str(report)



@pytest.mark.parametrize("name, implementation, dtype", [
    ("qwen3_moe", None, "float32"),
    ("qwen3_moe", "batched_mm", "bfloat16 (autocast, from float32)"),
    ("llama4", None, "bfloat16 (autocast, from float32)"),
])
def test_autocast(name, implementation, dtype):
    """float32 weights under CPU autocast(bfloat16), the usual mixed-precision training. The op
    computes in the dtype eager's expert products have: float32 for grouped_mm (no autocast rule),
    bf16 for batched_mm and Llama 4's bmm (autocast lowers them). Logits and every gradient are as
    close to the float32 model as eager autocast's."""
    model = tiny_moe_model(name)
    if implementation:
        model.config._experts_implementation = implementation
    ids = _ids(model)
    truth = loss_and_grads(model, ids)
    compiled = compile_sonic(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = loss_and_grads(model, ids)
        with moe_compiler.capture() as report:
            got = loss_and_grads(compiled, ids)
    assert len(report.rewritten) == count_moe_layers(model) and not report.rejected, str(report)
    assert {r.details["dtype"] for r in report.rewritten} == {dtype}, str(report)
    assert_close_to_eager(got[0], eager[0], truth[0], torch.bfloat16, "logits")
    assert got[1].keys() == eager[1].keys()
    for pname in eager[1]:
        assert_close_to_eager(got[1][pname], eager[1][pname], truth[1][pname], torch.bfloat16, f"grad {pname}")


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_gradient_checkpointing(compiler):
    """`gradient_checkpointing_enable()`: Dynamo puts each decoder layer, its MoE included, in a
    checkpointed subgraph; the regions there are rewritten (the op runs, in the forward and again
    in the backward's recomputation) and the loss and every gradient equal eager's."""
    model = tiny_moe_model("qwen3_moe")
    model.gradient_checkpointing_enable()
    model.train()
    ids = _ids(model)
    eager = loss_and_grads(model, ids)
    compiled = compile_sonic(model, compiler=compiler)
    with moe_compiler.capture() as report:
        got = loss_and_grads(compiled, ids)
    assert len(report.rewritten) == count_moe_layers(model) and not report.rejected, str(report)
    assert_close_to_eager(got[0], eager[0], what="logits")
    assert got[1].keys() == eager[1].keys()
    for pname in eager[1]:
        assert_close_to_eager(got[1][pname], eager[1][pname], what=f"grad {pname}")
    with torch.profiler.profile() as prof:
        loss_and_grads(compiled, ids)
    calls = [e.name for e in prof.events() if e.name == "sonic::moe_experts"]
    assert len(calls) == 2 * count_moe_layers(model), calls  # forward, then the recomputed forward


@pytest.mark.parametrize("name", ["qwen3_moe"])
def test_hf_model_inductor(name):
    """The full path: rewrite, AOTAutograd, Inductor compiles the router glue."""
    _check_model(name, torch.float32, compiler="inductor")


def _check_expert_parallel_spelling(model):
    """Trace `model` with its experts' expert-parallel flag set (the sentinel nodes) and check that
    the compiled fp32 loss and every gradient equal eager's. Returns the rewrite report."""
    for module in model.modules():
        if hasattr(module, "_is_expert_parallel"):
            module._is_expert_parallel = True
    ids = _ids(model)
    eager = loss_and_grads(model, ids)
    with moe_compiler.capture() as report:
        got = loss_and_grads(compile_sonic(model, compiler="aot_eager"), ids)
    assert_close_to_eager(got[0], eager[0], what="logits")
    for pname in eager[1]:
        assert_close_to_eager(got[1][pname], eager[1][pname], what=pname)
    return report


def test_transformers_517_sentinel_spelling():
    """transformers 5.17 always emits the expert-parallel sentinel nodes (ge/clamp_/masked_fill);
    5.23 emits them only under expert parallelism. Setting the flag makes 5.23 trace the 5.17 graph."""
    report = _check_expert_parallel_spelling(tiny_moe_model("qwen3_moe"))
    assert len(report.rewritten) == 2, str(report)


def test_batched_mm_expert_parallel_spelling():
    """transformers 5.17's batched_mm always clamps the gathered ids (`ids.clamp(0, E-1)`); 5.23 does
    that, and masks the weights of sentinel ids, under expert parallelism. Both are absorbed."""
    model = tiny_moe_model("gpt_oss")
    model.config._experts_implementation = "batched_mm"
    report = _check_expert_parallel_spelling(model)
    assert len(report.rewritten) == 2 and {r.idiom for r in report.rewritten} == {"hf_batched_mm"}, str(report)


def test_fullgraph_whole_model():
    model = tiny_moe_model("olmoe")
    ids = _ids(model)
    compiled = torch.compile(model, backend="sonic", fullgraph=True, options={"sonic.compiler": "aot_eager"})
    with moe_compiler.capture() as report:
        got = compiled(ids).logits
    assert report.graphs == 1 and len(report.rewritten) == 2
    assert_close_to_eager(got, model(ids).logits, what="logits")


def test_dynamic_batch_no_extra_rewrite_failures():
    model = tiny_moe_model("qwen3_moe")
    compiled = compile_sonic(model, compiler="aot_eager")
    with moe_compiler.capture() as report:
        for T in (8, 12, 16):
            ids = _ids(model, T=T)
            with torch.no_grad():
                assert_close_to_eager(compiled(ids).logits, model(ids).logits, what=f"T={T}")
    assert report.records and all(r.status == "rewritten" for r in report.records), str(report)


def test_explain_reports_each_layer(caplog):
    model = tiny_moe_model("mixtral")
    with caplog.at_level(logging.INFO, logger="moe_compiler"):
        report = moe_compiler.explain(model, _ids(model))
    assert len(report.rewritten) == 2
    text = str(report)
    for expected in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts", "swiglu", "concatenated", "hf_grouped_mm"):
        assert expected in text, text
    assert "rewrote MoE region" in caplog.text
    # explain leaves the model as it was: eager still runs transformers' own experts
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
def test_hf_model_matches_eager_gpu_bf16(name):
    _check_model(name, torch.bfloat16, device="cuda", compiler="inductor")


@pytest.mark.gpu
def test_gradient_checkpointing_gpu_bf16():
    _check_model("qwen3_moe", torch.bfloat16, "cuda", "inductor", checkpointing=True)


@pytest.mark.gpu
def test_llama4_gpu_bf16():
    report = _check_model("llama4", torch.bfloat16, device="cuda", compiler="inductor")
    assert {r.idiom for r in report.rewritten} == {"dense_bmm"}, str(report)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_hf_batched_mm_gpu_bf16(name):
    _check_model(name, torch.bfloat16, device="cuda", compiler="inductor", implementation="batched_mm")


@pytest.mark.gpu
def test_hf_model_matches_eager_gpu_fp32():
    _check_model("qwen3_moe", torch.float32, device="cuda", compiler="inductor")
