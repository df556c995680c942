"""Kernels, the `sonic::` ops that launch them, and their pure-torch reference. Knows nothing of FX."""
from .activations import ACTIVATIONS, GATED
from .ops import (
    moe_experts,
    moe_experts_backward_op,
    moe_experts_list,
    moe_experts_list_op,
    moe_experts_op,
)
from .reference import (
    torch_moe_experts,
    torch_moe_experts_bwd,
    torch_moe_experts_fwd,
    torch_route,
)
from .router import route, route_op, torch_router_bwd, torch_router_fwd
from .token_rounding import round_routing, token_rounding

__all__ = [
    "ACTIVATIONS",
    "GATED",
    "moe_experts",
    "moe_experts_backward_op",
    "moe_experts_list",
    "moe_experts_list_op",
    "moe_experts_op",
    "round_routing",
    "route",
    "route_op",
    "token_rounding",
    "torch_moe_experts",
    "torch_moe_experts_bwd",
    "torch_moe_experts_fwd",
    "torch_route",
    "torch_router_bwd",
    "torch_router_fwd",
]
