"""moe-compiler: `torch.compile(model, backend="sonic")` rewrites MoE experts into fused kernels.

Importing this package changes no global torch setting. The backend is registered through the
`torch_dynamo_backends` entry point, so `backend="sonic"` works without importing it.
"""
from .backend import sonic_backend
from .diagnostics import Report, capture
from .explain import explain
from .hf import register_hf_experts
from .options import SonicOptions

__all__ = ["sonic_backend", "explain", "register_hf_experts", "capture", "Report", "SonicOptions"]
__version__ = "0.1.0"
