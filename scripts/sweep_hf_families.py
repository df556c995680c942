"""Every MoE family transformers ships, tiny and random, through backend="sonic" on the CPU.

    python scripts/sweep_hf_families.py                      # every family below, ~16 minutes
    python scripts/sweep_hf_families.py mixtral granitemoe   # some

For families no issue names: a model (the causal LM, else that of a vision-language config's
language model, else that language model's base model under a fixed loss on its hidden states) is
built from its default config shrunk to toy sizes and two layers, of two different kinds where the config has several (dense and MoE, hash-routed and
top-k, linear and full attention; no downloads), one training step (loss + backward) runs eagerly and compiled (`sonic.compiler` =
aot_eager, so only our rewrite differs), and the loss and every gradient are compared. A family
whose compiled step differs from eager is re-run with `sonic.enabled=False`: if that differs too,
the model itself is not repeatable (PhiMoE samples its experts in training); if only the rewrite
differs, it is a wrong rewrite, the worst bug this project can have, and the exit code is 1; so
is a compiled step that fails only with the rewrite on. Families whose compiled step fails with the
rewrite off too (plain aot_eager cannot compile them) are listed as such.
Families whose toy config does not build or run eagerly are listed as such (the shrinking below
is generic, not every config accepts it); they say nothing about the backend. A config with sizes
per layer (Gemma 4) is made anew from the toy sizes; a language model no auto class lists is found
in its modeling module.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import subprocess
import sys

FAMILIES = (
    "afmoe aria axk1 axk2 bailing_hybrid beam cohere2_moe dbrx deepseek_ocr2 deepseek_v2 deepseek_v3 deepseek_v32 "
    "deepseek_v4 diffusion_gemma dots1 dots3_note ernie4_5_moe ernie4_5_vl_moe exaone_moe flex_olmo flint gemma4 "
    "glm4_moe glm4_moe_lite glm4v_moe glm5_next glm_moe_dsa gpt_oss granitemoe granitemoe_swa granitemoehybrid "
    "granitemoeshared hunyuan_v1_moe hy_v3 hy_v4 inkling inkling2 jamba jetmoe kimi_linear kolibri1 laguna lfm2_moe "
    "llama4_text longcat_flash mellum mimo_v2_flash minimax minimax_m2 minimax_m3_vl mistral4 mistral_large4 mixtral "
    "muse_spark nemotron_h olmoe openai_privacy_filter phimoe qwen2_moe qwen3_5_moe_text qwen3_moe qwen3_next "
    "qwen3_omni_moe qwen3_vl_moe qwen4_exp solar_open step3p7 unlimited_ocr zaya"
).split()

# Toy sizes for whichever of these fields a config has.
SMALL = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=128, num_experts=8, num_local_experts=8, n_routed_experts=8,
    num_experts_per_tok=2, moe_topk=2, top_k=2, max_position_embeddings=256, n_group=2, topk_group=1,
    first_k_dense_replace=0, shared_expert_intermediate_size=32, n_shared_experts=1, num_shared_experts=1,
    moe_num_experts=8, moe_k=2, num_dense_layers=0, use_cache=False, mamba_n_heads=8, mamba_d_head=16,
    top_k_experts=2, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,
)
# Families whose layer kinds or sizes come from fields the generic shrinking does not set (or sets
# wrong): two layers of two kinds, both with experts where the config allows (Jamba: Mamba then
# attention; LFM2-MoE's default config has no layer list). A dict updates the config's dict.
LAYOUT = dict(
    jamba=dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    lfm2_moe=dict(layer_types=["conv", "full_attention"]),
    # M-RoPE sections default to head_dim 128's; at head_dim 16 the rotary half is 4 (GLM-4.5V: partial
    # rotary 1/2) or 8 frequencies wide (ERNIE-4.5-VL: [h, w] pre-rotated, then t)
    glm4v_moe=dict(rope_parameters=dict(mrope_section=[2, 1, 1])),
    ernie4_5_vl_moe=dict(rope_parameters=dict(mrope_section=[3, 3, 2])),
    # Gemma 4: the head_dim of its full-attention layers is per layer, given as global_head_dim to the config
    # made anew (see _toy); its experts are off by default
    gemma4=dict(layer_types=["sliding_attention", "full_attention"], global_head_dim=32, enable_moe_block=True),
    diffusion_gemma=dict(layer_types=["sliding_attention", "full_attention"], global_head_dim=32),
    # Dots3-Note: latent attention whose sliding layers' sizes are per layer, given as swa_* to the config made
    # anew; as many kv heads as heads, head_dim = nope + rope, the indexer's head no narrower than rope
    dots3_note=dict(layer_types=["indexed_attention", "sliding_attention"], sliding_window=8, num_key_value_heads=4,
                    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
                    index_topk=8, index_head_dim=16, index_n_heads=2, shared_experts_intermediate_size=32,
                    swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=32, swa_kv_lora_rank=32,
                    swa_head_dim=16, swa_qk_nope_head_dim=8, swa_v_head_dim=16),
    # Qwen4-Exp's full-attention layers always index (QSA), with an indexer its default config leaves unset
    qwen4_exp=dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                   indexer_compress_ratio=4),
    deepseek_ocr2=dict(mlp_layer_types=["dense", "sparse"]),  # its default (None) builds no model
    # Flint's layers 0 and 1 are dense by default (mlp_only_layers=[0, 1]): a toy of two layers had no experts
    flint=dict(mlp_only_layers=[0]),
    # Step3.7 makes a sliding-window mask whatever its layers are, from a window it has none of by default
    step3p7=dict(sliding_window=8),
)
_TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # within the toy vocabulary
# Families whose sizes live under other names or in sub-configs, given when the config is made
# (DBRX: d_model / n_heads / ffn_config; its default clip_qkv=None fails in clamp, so one is set)
BUILD = dict(
    dbrx=dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=128,
              attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
              ffn_config=dict(hidden_size=64, ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2)),
)
# Families whose directory name is no model type (Inkling's are inkling_mm_model and inkling_text)
MODEL_TYPE = dict(inkling="inkling_text")
TOLERANCE = dict(loss=1e-4, grad=1e-3)  # fp32, relative: summation order only


def one(family: str, enabled: bool) -> dict:
    """Runs in a child process: {status, rewritten, loss_rel, grad_rel, routers, rejected}."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    import moe_compiler

    torch.manual_seed(0)
    try:
        model, has_lm_head = _toy(family)
    except Exception as exc:
        return dict(status="toy config does not build", detail=f"{type(exc).__name__}: {str(exc)[:120]}")
    ids = torch.randint(0, 128, (2, 16))
    probe = torch.randn(2, 16, SMALL["hidden_size"])  # a fixed loss on a base model's hidden states

    def step(m):
        model.zero_grad(set_to_none=True)
        if has_lm_head:
            loss = m(input_ids=ids, labels=ids).loss
        else:
            loss = (m(input_ids=ids).last_hidden_state * probe).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    try:
        loss, grads = step(model)
    except Exception as exc:
        return dict(status="toy config does not run eagerly", detail=f"{type(exc).__name__}: {str(exc)[:120]}")
    compiled = torch.compile(model, backend="sonic", options={"sonic.compiler": "aot_eager", "sonic.enabled": enabled})
    with moe_compiler.capture() as report:
        got_loss, got = step(compiled)
    # relative per parameter, except that a gradient which is round-off itself (a norm below 1e-6 of
    # the largest; DeepSeek-V4's hash-routed gate: both slots on one expert, renormalised to 1/2 each)
    # is measured against that floor: its own relative error is noise over noise
    floor = 1e-6 * max((g.norm().item() for g in grads.values()), default=0.0)
    grad_rel = 0.0
    for name, g in grads.items():
        h = got.get(name)
        grad_rel = max(grad_rel, math.inf if h is None else ((g - h).norm() / max(g.norm().item(), floor, 1e-30)).item())
    loss_rel = abs(loss - got_loss).item() / abs(loss).item()
    same = loss_rel <= TOLERANCE["loss"] and grad_rel <= TOLERANCE["grad"]
    return dict(status="equal" if same else "DIFFERS", rewritten=len(report.rewritten), loss_rel=loss_rel,
                grad_rel=grad_rel, routers=sorted({r.details.get("router", "") for r in report.rewritten}),
                rejected=sorted({r.reason[:240] for r in report.rejected}))


def _toy(family: str):
    """(model, has an LM head) of the family's default config shrunk to SMALL (+ LAYOUT), in train mode."""
    from transformers import AutoConfig

    try:
        from transformers.integrations.heterogeneity.configuration_utils import \
            AmbiguousGlobalPerLayerAttributeError as per_layer
    except ImportError:  # a transformers without per-layer configs
        per_layer = ()
    config = AutoConfig.for_model(MODEL_TYPE.get(family, family), **BUILD.get(family, {}))
    text = getattr(config, "text_config", None)
    if text is None:  # Qwen3-Omni: the language model is the thinker's
        text = getattr(getattr(config, "thinker_config", None), "text_config", None)
    target = text if text is not None and hasattr(text, "hidden_size") else config
    sizes, anew = {**SMALL, **LAYOUT.get(family, {})}, False
    try:
        for key, value in sizes.items():
            if hasattr(target, key):
                old = getattr(target, key)  # a size given per modality (ERNIE-4.5-VL: [text, vision]) in each;
                if isinstance(old, list) and isinstance(value, int):  # a dict of LAYOUT's (rope_parameters)
                    value = [value] * len(old)  # updates the config's
                setattr(target, key, {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value)
    except per_layer:  # a size that may vary per layer (Gemma 4's head_dim) is no global field to set: the
        # (text) config is made anew from the sizes it has fields for and LAYOUT's constructor arguments,
        # and built alone (a vision-language parent keeps its own, unshrunk, towers out of it)
        fields = {f.name for f in dataclasses.fields(target)}
        target = config = type(target)(**{k: v for k, v in sizes.items() if k in fields or k in LAYOUT.get(family, {})})
        anew = True
    for key, value in _TOKEN_IDS.items():
        if isinstance(getattr(target, key, None), int) and getattr(target, key) >= SMALL["vocab_size"]:
            setattr(target, key, value)
    if not anew:  # (one made anew is consistent as made)
        if getattr(target, "kv_lora_rank", None):  # multi-head latent attention: as many kv heads as heads,
            target.num_key_value_heads = target.num_attention_heads  # rotary width = head_dim's rotary part
            partial = (getattr(target, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
            target.head_dim = round(getattr(target, "qk_rope_head_dim", target.head_dim) / partial)  # (Mistral 4: 1/2)
        for key in ("layer_types", "mlp_layer_types", "layers_block_type"):
            kinds = getattr(target, key, None)
            settable = not isinstance(getattr(type(target), key, None), property)  # Jamba derives its own
            if isinstance(kinds, list) and kinds and settable:  # two layers, of two kinds where there are
                setattr(target, key, (list(dict.fromkeys(kinds)) + kinds)[:2])
    model, has_lm_head = _build(config, target)
    return model.float().train(), has_lm_head


def _build(config, text_config):
    """(model, has an LM head): the causal LM of the config, else of its language-model sub-config
    (vision-language and omni models), else that language model's base model (the text backbones
    of VL models have no causal-LM class of their own); the auto classes first, then the classes of
    the sub-config's own modeling module that take it (those the auto mappings do not list)."""
    from transformers import AutoModel, AutoModelForCausalLM

    last = None
    for make, cfg, lm in ((AutoModelForCausalLM.from_config, config, True),
                          (AutoModelForCausalLM.from_config, text_config, True),
                          (_own("ForCausalLM"), text_config, True), (AutoModel.from_config, text_config, False),
                          (_own("Model"), text_config, False)):
        try:
            return make(cfg), lm
        except ValueError as exc:
            if "Unrecognized configuration class" not in str(exc):
                raise
            last = exc
    raise last


def _own(suffix: str):
    """Builds a config with the model class of its modeling module named *suffix that takes that config."""
    from transformers import PreTrainedModel

    def make(config):
        module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
        for name, cls in vars(module).items():
            if (isinstance(cls, type) and issubclass(cls, PreTrainedModel) and name.endswith(suffix)
                    and not name.endswith("PreTrainedModel") and getattr(cls, "config_class", None) is type(config)):
                return cls._from_config(config)
        raise ValueError(f"Unrecognized configuration class {type(config)}: no {suffix} in {module.__name__}")
    return make


def run(family: str, enabled: bool = True) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import json, sys; sys.path.insert(0, {here!r}); import sweep_hf_families as s; "
            f"print(json.dumps(s.one({family!r}, {enabled})))")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    lines = child.stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        return dict(status="compiled step failed", detail=child.stderr.strip().splitlines()[-1:] or "")
    return json.loads(lines[-1])


# A step that fails with the rewrite on is re-run with it off: (its label when that run fails the
# same way, its label when it does not: the rewrite's fault)
_RECHECK = {
    "DIFFERS": ("differs without the rewrite too (model not repeatable)", "WRONG REWRITE"),
    "compiled step failed": ("torch.compile fails without the rewrite too",
                             "BACKEND FAILS (the compiled step runs without the rewrite)"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("families", nargs="*", help="model types to sweep (default: every family above)")
    families = ap.parse_args(argv).families or FAMILIES
    wrong = []
    for family in families:
        result = run(family)
        status = result["status"]
        if status in _RECHECK and (status != "DIFFERS" or result["rewritten"]):
            also, blame = _RECHECK[status]
            if run(family, enabled=False)["status"] == status:
                result["status"] = also
            else:
                result["status"] = blame
                wrong.append(family)
        if "rewritten" in result:
            print(f"{family:18s} {result['status']:10s} rewritten {result['rewritten']}  loss {result['loss_rel']:.1e}  "
                  f"grads {result['grad_rel']:.1e}  router {'; '.join(result['routers']) or '-'}"
                  + (f"  rejected: {'; '.join(result['rejected'])}" if result["rejected"] else ""), flush=True)
        else:
            print(f"{family:18s} {result['status']}: {result.get('detail', '')}", flush=True)
    print(f"{len(families)} families, wrong rewrites or backend failures: {wrong or 'none'}")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
