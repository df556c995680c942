"""`experts_implementation="sonic"` for transformers' decorated Experts classes.

transformers' eager experts loop (`for e in expert_hit`) can never be one graph, so the backend
never sees its weights. Registering our op in transformers' ExpertsInterface gives every decorated
family a path that calls `sonic::moe_experts` directly, in and out of `torch.compile`:

    import moe_compiler
    moe_compiler.register_hf_experts()
    model = AutoModelForCausalLM.from_config(config, experts_implementation="sonic")

Under an expert-parallel plan (`_is_expert_parallel`), the ids of other ranks' experts arrive as
the sentinel `num_experts`; those slots are dropped on the device (`codegen.ops.drop_slots_from`).
"""
from __future__ import annotations

import torch

from moe_compiler.codegen.activations import GATED
from moe_compiler.codegen.ops import drop_slots_from, moe_experts
from moe_compiler.patterns.activation_probe import name_activation

NAME = "sonic"


def _experts_spec(module) -> dict:
    """Activation and layout of a decorated Experts module, probed once and cached on it."""
    spec = getattr(module, "_sonic_spec", None)
    if spec is not None:
        return spec
    gated = getattr(module, "has_gate", True)
    w1 = module.gate_up_proj if gated else module.up_proj
    transposed = bool(getattr(module, "is_transposed", False))
    w1_out = w1.shape[2] if transposed else w1.shape[1]
    n = w1_out // 2 if gated else w1_out
    fn = module._apply_gate if gated else module.act_fn
    constants = [float(v) for v in vars(module).values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    named = name_activation(fn, w1_out, n, constants=constants)
    if isinstance(named, str):
        raise NotImplementedError(f"experts_implementation='sonic' on {type(module).__name__}: {named}")
    spec = {**named, "transposed": transposed}
    module._sonic_spec = spec
    return spec


def sonic_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """transformers' experts signature: hidden [T, d], top_k_index/top_k_weights [T, K] -> [T, d]."""
    if getattr(self, "has_post_expert_norm", False):
        raise NotImplementedError("experts_implementation='sonic' does not support post-expert norms yet")
    spec = _experts_spec(self)
    gated = getattr(self, "has_gate", True)
    w1 = self.gate_up_proj if gated else self.up_proj
    b1 = b2 = None
    if getattr(self, "has_bias", False):
        b1 = self.gate_up_proj_bias if gated else self.up_proj_bias
        b2 = self.down_proj_bias
    assert GATED[spec["activation"]] == gated
    routing = (top_k_index, top_k_weights)
    if getattr(self, "_is_expert_parallel", False):  # ids of other ranks' experts: the sentinel, this rank's count
        *routing, slot_token = drop_slots_from(top_k_index, top_k_weights, w1.shape[0])
        spec = {**spec, "slot_token": slot_token}
    out = moe_experts(hidden_states.to(w1.dtype), *routing, w1, self.down_proj, b1, b2, **spec)
    return out.to(hidden_states.dtype)


def register_hf_experts() -> None:
    """Add "sonic" to transformers' ExpertsInterface (idempotent). Needs transformers >= 5.17."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, sonic_experts_forward)
