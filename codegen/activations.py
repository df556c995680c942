"""Expert activations: names, forward and derivative formulas, in pure torch.

Glossary (used across `codegen/`): T tokens, d hidden size, n expert intermediate size, E experts,
K experts per token, TK = T*K routed rows. H is the up-projection output (pre-activation): [TK, 2n]
for gated activations, [TK, n] otherwise. A = act(H) is [TK, n].

Gated activations read H as (gate, up). Hugging Face concatenates them (gate = H[:, :n],
up = H[:, n:]); gpt-oss interleaves them (gate = H[:, 0::2], up = H[:, 1::2]).
"""
from __future__ import annotations

import math

import torch

# name -> whether H carries a gate half. One table so the matcher, the op and the kernels agree.
GATED = {
    "swiglu": True,  # silu(g) * u                                   (Mixtral, Qwen, OLMoE, DeepSeek)
    "geglu": True,  # gelu_erf(g) * u
    "geglu_tanh": True,  # gelu_tanh(g) * u
    "swiglu_oai": True,  # gpt-oss: g'=min(g, limit), u'=clamp(u, +-limit), (u'+1) * g' * sigmoid(alpha g')
    "relu2": False,  # relu(h)^2                                       (Nemotron-H)
    "gelu": False,  # gelu_erf(h)
    "silu": False,  # silu(h)
    "swiglu_clamp": True,  # silu(min(g, limit)) * clamp(u, +-limit)       (DeepSeek-V4)
    # soft caps alpha (gate) and limit (up): alpha tanh(g / alpha) * sigmoid(g) * limit tanh(u / limit)   (Inkling2)
    "swiglu_softcap": True,
    "relu": False,  # relu(h)                                          (Switch Transformer, T5)
    "gelu_tanh": False,  # gelu_tanh(h)                                  (GPT-2-style MLPs)
    "reglu": True,  # relu(g) * u                                     (ReGLU experts; T5 v1.1's ReGLU variant)
}
ACTIVATIONS = tuple(GATED)


def check_activation(activation: str) -> None:
    if activation not in GATED:
        raise ValueError(f"unknown activation {activation!r}; supported: {', '.join(ACTIVATIONS)}")


def check_activation_params(activation: str, alpha: float, limit: float) -> None:
    """The activation's parameters: swiglu_softcap divides by both caps, which must be positive."""
    if activation == "swiglu_softcap" and not (alpha > 0 and limit > 0):
        raise ValueError(f"swiglu_softcap needs positive caps, got alpha (gate cap) {alpha} and limit (up cap) {limit}")


def split_gate_up(h: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) views of a gated H [rows, 2n]."""
    if interleaved:
        return h[..., 0::2], h[..., 1::2]
    n = h.shape[-1] // 2
    return h[..., :n], h[..., n:]


def merge_gate_up(dg: torch.Tensor, du: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Inverse of `split_gate_up`: [rows, n] x 2 -> [rows, 2n] in the same layout."""
    if interleaved:
        return torch.stack((dg, du), dim=-1).flatten(-2)
    return torch.cat((dg, du), dim=-1)


def _gelu_erf_and_grad(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cdf = 0.5 * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
    return x * cdf, cdf + x * pdf


def _gelu_tanh_and_grad(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = math.sqrt(2.0 / math.pi)
    inner = c * (x + 0.044715 * x**3)
    t = torch.tanh(inner)
    y = 0.5 * x * (1.0 + t)
    dy = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * x * x)
    return y, dy


def _silu_and_grad(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.sigmoid(x)
    return x * s, s * (1.0 + x * (1.0 - s))


def _unary_and_grad(name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if name in ("swiglu", "silu"):
        return _silu_and_grad(x)
    if name in ("geglu", "gelu"):
        return _gelu_erf_and_grad(x)
    if name in ("geglu_tanh", "gelu_tanh"):
        return _gelu_tanh_and_grad(x)
    if name == "relu2":
        r = torch.relu(x)
        return r * r, 2.0 * r
    if name in ("relu", "reglu"):  # torch's relu passes no gradient at 0
        return torch.relu(x), (x > 0).to(x.dtype)
    raise AssertionError(name)


def torch_activation(
    h: torch.Tensor, activation: str, interleaved: bool, alpha: float, limit: float
) -> torch.Tensor:
    """A = act(H), computed in H's dtype's float32 upcast and returned in H's dtype."""
    return torch_activation_and_grad(h, None, activation, interleaved, alpha, limit)[0]


def torch_activation_and_grad(
    h: torch.Tensor,
    grad_a: torch.Tensor | None,
    activation: str,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(A, dH) with A = act(H) and dH = act'(H) * dA. Math in at least float32."""
    check_activation(activation)
    out_dtype = h.dtype
    hf = h.float() if h.dtype in (torch.float16, torch.bfloat16) else h
    da = None if grad_a is None else grad_a.to(hf.dtype)
    if not GATED[activation]:
        a, dact = _unary_and_grad(activation, hf)
        dh = None if da is None else (dact * da).to(out_dtype)
        return a.to(out_dtype), dh
    g, u = split_gate_up(hf, interleaved)
    if activation == "swiglu_oai":
        gc = g.clamp(max=limit)
        uc = u.clamp(min=-limit, max=limit)
        s = torch.sigmoid(alpha * gc)
        glu = gc * s
        a = (uc + 1.0) * glu
        if da is None:
            return a.to(out_dtype), None
        # torch.clamp passes the gradient where the bound is not exceeded (bounds inclusive).
        dg = da * (uc + 1.0) * (s + alpha * gc * s * (1.0 - s)) * (g <= limit)
        du = da * glu * ((u >= -limit) & (u <= limit))
    elif activation == "swiglu_clamp":
        gc = g.clamp(max=limit)
        uc = u.clamp(min=-limit, max=limit)
        act_g, dact_g = _silu_and_grad(gc)
        a = act_g * uc
        if da is None:
            return a.to(out_dtype), None
        dg = da * uc * dact_g * (g <= limit)
        du = da * act_g * ((u >= -limit) & (u <= limit))
    elif activation == "swiglu_softcap":
        cg, cu = alpha * torch.tanh(g / alpha), limit * torch.tanh(u / limit)
        s = torch.sigmoid(g)
        a = cg * s * cu
        if da is None:
            return a.to(out_dtype), None
        dg = da * cu * s * ((1.0 - (cg / alpha) ** 2) + cg * (1.0 - s))
        du = da * cg * s * (1.0 - (cu / limit) ** 2)
    else:
        act_g, dact_g = _unary_and_grad(activation, g)
        a = act_g * u
        if da is None:
            return a.to(out_dtype), None
        dg = da * u * dact_g
        du = da * act_g
    return a.to(out_dtype), merge_gate_up(dg, du, interleaved).to(out_dtype)
