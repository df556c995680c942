"""Tiny random Hugging Face MoE models built from their config classes (no downloads).

Shared by the quickstart and the tests. Sizes are small enough for the CPU, and every family keeps
its own router and expert code paths (transformers' default `grouped_mm` experts).
"""
from __future__ import annotations

import torch

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _config(cls, per_layer=None, **fields):
    """A config maker: `cls(**fields, **overrides)`. The overrides go to the constructor, so fields it
    derives from them (Llama 4's per-layer `no_rope_layers` from `num_hidden_layers`) follow.
    `per_layer` {field: value}: a field holding one value per layer, that value for every layer
    unless the overrides give the field."""
    def make(**overrides):
        kwargs = fields | overrides
        for key, value in (per_layer or {}).items():
            kwargs.setdefault(key, [value] * kwargs["num_hidden_layers"])
        return cls(**kwargs)

    return make


def _configs():
    import transformers as tf

    return {
        "qwen3_moe": _config(tf.Qwen3MoeConfig,
            **COMMON, head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
        ),
        "olmoe": _config(tf.OlmoeConfig,
            **COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2, eos_token_id=None,
            pad_token_id=None, bos_token_id=None,
        ),
        "mixtral": _config(tf.MixtralConfig,
            **COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        ),
        # transposed [E, d, 2n] weights, interleaved gate/up, biases, clamped SwiGLU, router bias
        "gpt_oss": _config(tf.GptOssConfig,
            **COMMON, head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
            per_layer={"layer_types": "full_attention"},
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        # sigmoid-gated shared expert beside the routed experts
        "qwen2_moe": _config(tf.Qwen2MoeConfig,
            **COMMON, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
        ),
        # sigmoid scores + correction bias, group-limited top-k, routed scaling, shared experts
        "deepseek_v3": _config(tf.DeepseekV3Config,
            **{**COMMON, "num_key_value_heads": 4},  # MLA: as many kv heads as heads (torch 2.11's SDPA fake rejects GQA here)
            intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=0, routed_scaling_factor=2.5,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        ),
        # every expert on every token as bmm, the router's sigmoid scores scaling the expert inputs;
        # top-1 as Llama 4 Scout and Maverick route
        "llama4": _config(tf.Llama4TextConfig,
            **COMMON, head_dim=16, intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4,
            num_experts_per_tok=1, interleave_moe_layer_step=1,
        ),
    }


MODELS = ("qwen3_moe", "olmoe", "mixtral", "gpt_oss", "qwen2_moe", "deepseek_v3")
ALL_MODELS = MODELS


def tiny_moe_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A random-weight causal LM of family `name`, with its config's fields overridden."""
    import transformers as tf

    config = _configs()[name](**overrides)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).to(dtype)
    return model


def count_moe_layers(model) -> int:
    return sum(1 for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj"))


# Relative-norm tolerance when the compiled model runs in the same dtype as its eager twin and both
# are compared directly (fp32: only summation order differs). Lower precisions are judged against
# an fp32 copy of the model instead: err(sonic) <= LOW_PRECISION_FACTOR * err(eager) + floor.
FP32_RTOL = 2e-5
LOW_PRECISION_FACTOR = 2.0
LOW_PRECISION_FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def closeness(got, eager, truth=None, dtype=torch.float32) -> tuple[bool, str]:
    """(ok, explanation): fp32 compares with eager directly; fp16/bf16 must be as close to the fp32
    truth as eager itself is (up to LOW_PRECISION_FACTOR and a floor)."""
    if truth is None or dtype == torch.float32:
        err = rel_err(got, eager)
        return err <= FP32_RTOL, f"rel err {err:.2e} vs eager (bound {FP32_RTOL:.0e})"
    ours, theirs = rel_err(got, truth), rel_err(eager, truth)
    bound = LOW_PRECISION_FACTOR * theirs + LOW_PRECISION_FLOOR[dtype]
    return ours <= bound, f"err(sonic, fp32)={ours:.2e}, err(eager, fp32)={theirs:.2e} (bound {bound:.2e})"
