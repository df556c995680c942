"""The MoE layers of training libraries, as their users run them, through backend="sonic": output and
every gradient equal eager, one region rewritten per layer, the sonic op executed.

Each library is a test-only dependency, installed without its own dependencies (`pip install
--no-deps`, pinned in .ci/run and the README's test command); where importing the package pulls in
heavy modules, the module file that holds its MoE layer is imported on its own, as a user of only
that layer would. A missing library fails its tests rather than skipping them.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

import pytest
import torch

import moe_compiler

from .helpers import assert_close_to_eager, profiled_op_names

FLAG = "capture_dynamic_output_shape_ops"


def _litgpt():
    """litgpt's `model` module, without litgpt/__init__ (which imports lightning and its trainers)."""
    if "litgpt.model" not in sys.modules:
        spec = importlib.util.find_spec("litgpt")  # the README's test command installs it
        assert spec is not None, "litgpt is not installed: pip install --no-deps litgpt==0.5.13"
        package = types.ModuleType("litgpt")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules.setdefault("litgpt", package)
        scripts = types.ModuleType("litgpt.scripts")
        scripts.__path__ = [str(pathlib.Path(package.__path__[0]) / "scripts")]
        sys.modules.setdefault("litgpt.scripts", scripts)
        convert = types.ModuleType("litgpt.scripts.convert_hf_checkpoint")
        convert.qkv_reassemble = None  # imported by litgpt.model, used only by its GPT loader
        sys.modules.setdefault(convert.__name__, convert)
    from litgpt import config, model

    return config, model


LITGPT = {  # Config fields beyond the shared tiny ones; each is a MoE block litgpt's model zoo builds
    "plain": dict(),
    "biased": dict(bias=True),
    "shared-expert": dict(n_shared_expert=1),
    "grouped-router-scaled": dict(n_expert_groups=2, n_topk_groups=1, n_topk_scores_per_group=2, norm_topk_prob=True,
                                  routed_scaling_factor=2.5),
}


def _out_and_grads(model, x, cotangent, params):
    x = x.detach().requires_grad_()
    out = model(x)
    grads = torch.autograd.grad((out * cotangent).sum(), [x, *params.values()], allow_unused=True)
    return out.detach(), {name: g for name, g in zip(["x", *params], grads) if g is not None}


def _check_layer(layer, x, op: str, idiom: str, dtype=torch.float32):
    cotangent = torch.randn_like(x)
    compiled = torch.compile(layer, backend="sonic", options={"sonic.fallback": False,
                                                             "sonic.compiler": "aot_eager" if x.device.type == "cpu"
                                                             else "inductor"})
    with torch._dynamo.config.patch(**{FLAG: True}):
        params = dict(layer.named_parameters())
        eager = _out_and_grads(layer, x, cotangent, params)
        with moe_compiler.capture() as report:
            got = _out_and_grads(compiled, x, cotangent, params)
        names = profiled_op_names(lambda: compiled(x))
    truth = None
    if dtype != torch.float32:
        reference = _to_float32(layer)
        truth = _out_and_grads(reference, x.float(), cotangent.float(), dict(reference.named_parameters()))
    assert [r.idiom for r in report.rewritten] == [idiom] and not report.rejected, str(report)
    assert_close_to_eager(got[0], eager[0], truth and truth[0], dtype, what="output")
    assert got[1].keys() == eager[1].keys()
    for name in eager[1]:
        assert_close_to_eager(got[1][name], eager[1][name], truth and truth[1][name], dtype, what=f"grad {name}")
    assert op in names, sorted(n for n in names if "::" in n)[:20]


def _to_float32(layer):
    import copy

    return copy.deepcopy(layer).float()


def _litgpt_layer(variant: str, dtype=torch.float32, device="cpu"):
    config, model = _litgpt()
    fields = dict(n_embd=32, n_expert=4, n_expert_per_token=2, moe_intermediate_size=16, mlp_class_name="LLaMAMoE",
                  padded_vocab_size=64, n_layer=1, n_head=4, bias=False)
    fields.update(LITGPT[variant])
    torch.manual_seed(0)
    layer = model.LLaMAMoE(config.Config(**fields))
    with torch.no_grad():  # litgpt leaves initialisation to its GPT (the grouped router's weight is torch.empty)
        for param in layer.parameters():
            param.normal_(std=fields["n_embd"] ** -0.5)
    return layer.to(device, dtype)


@pytest.mark.parametrize("variant", LITGPT)
def test_litgpt_llama_moe(variant):
    layer = _litgpt_layer(variant)
    _check_layer(layer, torch.randn(2, 6, 32), "sonic::moe_experts_list", "expert_loop")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", LITGPT)
def test_gpu_litgpt_llama_moe_bf16(variant):
    layer = _litgpt_layer(variant, torch.bfloat16, "cuda")
    x = torch.randn(2, 64, 32, device="cuda", dtype=torch.bfloat16)
    _check_layer(layer, x, "sonic::moe_experts_list", "expert_loop", torch.bfloat16)


def test_peft_lora_on_fused_expert_weights():
    """peft's LoRA on the experts' fused parameters (`target_parameters`), the common way to fine-tune
    Qwen3-MoE: the experts stay rewritten, the loss and every LoRA gradient equal eager."""
    import peft  # the README's test command installs it: pip install --no-deps peft==0.21.2 accelerate==1.15.0 psutil
    from moe_compiler.testing import tiny_moe_model

    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_moe_model("qwen3_moe"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    for name, param in model.named_parameters():  # LoRA's B starts at zero: give it values, so its path counts
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    ids = torch.randint(0, 100, (2, 8))

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager = loss_and_grads(model)
    compiled = torch.compile(model, backend="sonic", options={"sonic.compiler": "aot_eager", "sonic.fallback": False})
    with moe_compiler.capture() as report:
        got = loss_and_grads(compiled)
    assert len(report.rewritten) == 2 and all(r.idiom == "hf_grouped_mm" for r in report.rewritten), str(report)
    assert_close_to_eager(got[0], eager[0], what="loss")
    assert got[1].keys() == eager[1].keys() and len(eager[1]) == 8  # A and B of 2 parameters x 2 layers
    for name in eager[1]:
        assert_close_to_eager(got[1][name], eager[1][name], what=f"grad {name}")
    assert "sonic::moe_experts" in profiled_op_names(lambda: compiled(ids))
