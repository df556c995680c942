"""`sonic::route`: a router's scores, top-k and weights in one op, with the analytic logits gradient.

    sonic::route(logits [T, E], bias? [E], k, score, topk_first, renorm, eps, scale, n_group,
                 topk_group, fill, compute_dtype, renorm_min=0.0)
        -> (topk_weights [T, k] compute_dtype, topk_ids [T, k] int64)

What it computes, in the model's own order and dtypes (D = compute_dtype, the dtype the model's
scores are in; `softmax(logits, dtype=torch.float)` on bf16 logits has D = float32):

    score -> top-k (topk_first=False):                       # Qwen, OLMoE, Mixtral, DeepSeek-V3
        s = softmax(logits.to(D), -1)  or  sigmoid(logits.to(D))          # [T, E]
        choice = s + bias                       (bias: selection only; weights read s)
        if n_group > 1:                         (group-limited, DeepSeek-V3)
            group score = sum of the top-2 choices of each of the n_group groups of E / n_group
            experts outside the topk_group best groups get choice = fill (HF uses -inf; some
            checkpoints' code 0.0: a fill above a kept expert's choice can be selected)
        ids = topk(choice, k).indices;  w = s.gather(-1, ids)
    top-k -> softmax (topk_first=True):                       # gpt-oss
        v, ids = topk(logits, k);  w = softmax(v.to(D), -1)
    then
        renorm:  w = w / (w.sum(-1, keepdim=True) + eps)       (eps = 0: no add, as the model)
                 or, renorm_min > 0, w / clamp(w.sum(-1, keepdim=True) + eps, min=renorm_min)  (ERNIE-4.5;
                 renorm_min = 0 is no clamp: the weights are >= 0, so their sum is)
        w = w * scale                                           (scale = 1: no multiply)

Ties in a top-k pick the lowest expert index (eager leaves tie order to the implementation); values
rank as torch.topk ranks them (-0.0 below +0.0, NaN above every number); ids come in descending
order of choice, which is what `sorted=True` gives and a valid `sorted=False` order. The gradient
reaches the logits only (the ids and the bias have none, as in eager, where only the selection
reads the bias); formulas in codegen/kernels/router.py (`_route_bwd_kernel`).

Implementations: the Triton kernels on CUDA (fp32/fp16/bf16 logits and D); the pure-torch
reference (`torch_router_fwd` / `torch_router_bwd`) everywhere else and as the test oracle.
`SONIC_MOE_KERNEL=reference` forces the reference on CUDA too.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import Tensor

from .direct_launch import launch
from .ints import cdiv, pow2
from .nograd import overload, register_nograd
from .plans import planned
from .launch import FORCE_REFERENCE

SCORES = ("softmax", "sigmoid")
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_TRITON_E = 4096  # one row's scores in registers; beyond that the reference runs
NARROW_KEYS = True  # int32 top-k keys where the ranked values are 16-bit (`_key_kind`); False: int64 always


def validate_route_args(logits, bias, k, score, topk_first, renorm, eps, scale, n_group, topk_group, fill,
                        compute_dtype, renorm_min=0.0) -> None:
    """Clear errors for every argument the op cannot take (shapes and flags only: no data read)."""
    def fail(msg):
        raise ValueError(f"sonic.route: {msg}")

    if logits.dim() != 2:
        fail(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point or not compute_dtype.is_floating_point:
        fail(f"logits ({logits.dtype}) and compute_dtype ({compute_dtype}) must be floating point")
    E = logits.shape[1]
    if score not in SCORES:
        fail(f"score must be one of {SCORES}, got {score!r}")
    if not 1 <= k <= E:
        fail(f"k must be in [1, E={E}], got {k}")
    if topk_first and (score != "softmax" or bias is not None or n_group != 1):
        fail("topk_first (top-k of the logits, then softmax over the k) takes no sigmoid, bias or groups")
    if bias is not None:
        if bias.shape != (E,) or not bias.dtype.is_floating_point:
            fail(f"bias must be a floating-point [E={E}] tensor, got {tuple(bias.shape)} {bias.dtype}")
        if torch.promote_types(bias.dtype, compute_dtype) != compute_dtype:
            fail(f"bias ({bias.dtype}) would promote the {compute_dtype} scores it is added to")
    if n_group < 1 or E % n_group != 0:
        fail(f"n_group must be >= 1 and divide E={E}, got {n_group}")
    if n_group > 1 and (not 1 <= topk_group <= n_group or E // n_group < 2):
        fail(f"group-limited top-k needs 1 <= topk_group <= n_group and >= 2 experts per group, got "
             f"topk_group={topk_group}, n_group={n_group}, E={E}")
    if not renorm and (eps != 0.0 or renorm_min != 0.0):
        fail("eps and renorm_min are the renormalisation's; they must be 0 without renorm")
    if not (math.isfinite(renorm_min) and renorm_min >= 0.0):
        fail(f"renorm_min must be finite and >= 0, got {renorm_min}")
    if not (math.isfinite(scale) and math.isfinite(eps)) or math.isnan(fill):
        fail(f"scale and eps must be finite and fill not NaN, got {scale}, {eps}, {fill}")


def torch_router_fwd(logits, bias, k, score, topk_first, renorm, eps, scale, n_group, topk_group, fill,
                     compute_dtype, renorm_min=0.0) -> tuple[Tensor, Tensor]:
    """The reference: the eager model's own ops, in its order and dtypes."""
    if topk_first:
        values, ids = torch.topk(logits, k, dim=-1)
        w = torch.softmax(values.to(compute_dtype), dim=-1)
    else:
        x = logits.to(compute_dtype)
        s = torch.softmax(x, dim=-1) if score == "softmax" else torch.sigmoid(x)
        choice = s if bias is None else s + bias
        if n_group > 1:
            T, E = choice.shape
            group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, topk_group, dim=-1)[1]
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            keep = group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
            choice = choice.masked_fill(~keep, fill)
        ids = torch.topk(choice, k, dim=-1)[1]
        w = s.gather(1, ids)
    if renorm:
        den = w.sum(dim=-1, keepdim=True)
        den = den + eps if eps != 0.0 else den
        w = w / (torch.clamp(den, min=renorm_min) if renorm_min != 0.0 else den)
    if scale != 1.0:
        w = w * scale
    return w, ids


def torch_router_bwd(grad_w, logits, ids, k, score, topk_first, renorm, eps, scale, compute_dtype,
                     renorm_min=0.0) -> Tensor:
    """d loss / d logits from d loss / d topk_weights (the formulas of `_route_bwd_kernel`), in fp32
    (fp64 for fp64 inputs) from the forward's values as the model's dtype holds them."""
    acc = torch.promote_types(compute_dtype, torch.float32)
    x = logits.to(compute_dtype)
    if topk_first:
        b = torch.softmax(x.gather(1, ids), dim=-1).to(acc)
    else:
        s = torch.softmax(x, dim=-1) if score == "softmax" else torch.sigmoid(x)
        b = s.gather(1, ids).to(acc)
    g = grad_w.to(acc) * scale
    if renorm:
        den = b.sum(-1, keepdim=True) + eps
        # the sum's own gradient passes where the clamp does (den >= renorm_min, as torch.clamp's)
        through = (den >= renorm_min).to(acc) if renorm_min != 0.0 else 1.0
        den = torch.clamp(den, min=renorm_min) if renorm_min != 0.0 else den
        g = (g - through * (g * (b / den)).sum(-1, keepdim=True)) / den
    if topk_first:
        g = b * (g - (g * b).sum(-1, keepdim=True))
    grad = torch.zeros(logits.shape, dtype=acc, device=logits.device).scatter(1, ids, g)
    if not topk_first:
        s = s.to(acc)
        grad = s * (grad - (grad * s).sum(-1, keepdim=True)) if score == "softmax" else grad * s * (1 - s)
    return grad.to(compute_dtype).to(logits.dtype)


def _tl_dtype(dtype):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def _key_kind(logits, compute_dtype, topk_first, n_group, fill, narrow_keys=True) -> int:
    """`_order_keys`' KEYS for a call: 16-bit keys (int32 with the column) where every value the
    kernel ranks is exactly a bf16 or fp16, int64 keys otherwise. top-k first ranks the logits as
    they are; score first ranks the scores (plus bias) rounded to compute_dtype, and with groups the
    fill too, which must then be exact in that dtype."""
    return _key_kind_of(logits.dtype, compute_dtype, topk_first, n_group, fill, narrow_keys)


@functools.lru_cache(maxsize=256)  # a few router forms a model; a call's host time matters at decode sizes
def _key_kind_of(logits_dtype, compute_dtype, topk_first, n_group, fill, narrow_keys) -> int:
    from .kernels import router as kr

    ranked = logits_dtype if topk_first else compute_dtype
    if not narrow_keys or ranked not in (torch.bfloat16, torch.float16):
        return kr.KEYS_FP32.value
    if not topk_first and n_group > 1 and torch.tensor(fill, dtype=ranked).item() != fill:
        return kr.KEYS_FP32.value
    return (kr.KEYS_BF16 if ranked == torch.bfloat16 else kr.KEYS_FP16).value


def _blocks(T, E, k, block_t, num_warps, forward=True, gathered=False):
    """(BLOCK_T, BLOCK_E, BLOCK_K, grid, num_warps) of a launch. The forward, up to E = 128: 2048
    scores a program, 8 a thread; otherwise 4096 scores a program on 4 warps. On the H100
    (benchmarks/kernels/bench_router.py, bf16 logits, CUDA graphs), T = 24576, E = 128, k = 8: the forward
    took 11.4 us with 8 scores a thread against 17.2 with 32 (4096 on 4 warps). At E = 256, k = 16,
    every forward launch from 8 to 32 scores a thread was within 7% (67-72 us). Below E = 128 the
    forward takes the same 8 a thread, not measured there.

    The backward: 4096 scores a program on 4 warps where it loads whole rows and reduces over them
    (softmax first; the kernel that did so for every form took 19.8 us with 8 scores a thread
    against 16.3 with 32). Where it only gathers the k selected logits (`gathered`: top-k first,
    sigmoid) it is a memory pass: up to E = 128, 2048 scores a program on 2 warps, 6.6 and 10.2 us
    at T = 24576 and 40960 (k = 8, top-k first) against 7.7 and 11.6 with 4096 on 4, the best of
    BLOCK_T 16-128 x 2-8 warps (`bench_router.py --blocks 16,32,64,128 --warps 2,4,8`)."""
    BLOCK_E = pow2(E)
    narrow = BLOCK_E <= 128 and (forward or gathered)
    BLOCK_T = block_t or max(1, min(64, (2048 if narrow else 4096) // BLOCK_E))
    if num_warps is None:
        if not narrow:
            num_warps = 4
        else:
            num_warps = max(1, min(8, BLOCK_T * BLOCK_E // 256)) if forward else 2
    return BLOCK_T, BLOCK_E, pow2(k), cdiv(T, BLOCK_T), num_warps


def triton_router_fwd(logits, bias, k, score, topk_first, renorm, eps, scale, n_group, topk_group, fill,
                      compute_dtype, renorm_min=0.0, *, block_t: int | None = None, narrow_keys: bool | None = None,
                      num_warps: int | None = None) -> tuple[Tensor, Tensor]:
    """The forward kernel's launch. `narrow_keys=False` (default: `NARROW_KEYS`) keeps int64 keys
    where int32 ones would do (for A/B tests and timings: the two give the same ids and weights)."""
    from .kernels.router import _route_fwd_kernel

    logits = logits.contiguous()
    T, E = logits.shape
    w = logits.new_empty(T, k, dtype=compute_dtype)
    ids = logits.new_empty(T, k, dtype=torch.int64)
    BLOCK_T, BLOCK_E, BLOCK_K, grid, num_warps = _blocks(T, E, k, block_t, num_warps)
    if grid == 0:
        return w, ids
    launch(_route_fwd_kernel, (grid,),
        logits, logits if bias is None else bias.contiguous(), w, ids, T, E,
        logits.stride(0), w.stride(0), ids.stride(0), float(eps), float(scale), float(fill),
        _in_dtype(renorm_min, compute_dtype),
        K=k, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_K=BLOCK_K, SOFTMAX=score == "softmax",
        TOPK_FIRST=topk_first, RENORM=renorm, CLAMP=renorm_min != 0.0, HAS_BIAS=bias is not None, N_GROUP=n_group,
        TOPK_GROUP=topk_group, GROUP_SIZE=E // n_group, BLOCK_G=pow2(n_group),
        COMPUTE=_tl_dtype(compute_dtype), ROUND=compute_dtype != torch.float32,
        KEYS=_key_kind(logits, compute_dtype, topk_first, n_group, fill, NARROW_KEYS if narrow_keys is None else narrow_keys),
        num_warps=num_warps,
    )
    return w, ids


def triton_router_bwd(grad_w, logits, ids, k, score, topk_first, renorm, eps, scale, compute_dtype, renorm_min=0.0,
                      *, block_t: int | None = None, num_warps: int | None = None) -> Tensor:
    from .kernels.router import _route_bwd_kernel

    logits, ids, grad_w = logits.contiguous(), ids.contiguous(), grad_w.contiguous()
    T, E = logits.shape
    grad = torch.empty_like(logits)
    BLOCK_T, BLOCK_E, BLOCK_K, grid, num_warps = _blocks(T, E, k, block_t, num_warps, forward=False,
                                                         gathered=topk_first or score == "sigmoid")
    if grid == 0:
        return grad
    launch(_route_bwd_kernel, (grid,),
        grad_w, logits, ids, grad, T, E,
        grad_w.stride(0), logits.stride(0), ids.stride(0), grad.stride(0), float(eps), float(scale),
        float(renorm_min),
        K=k, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_K=BLOCK_K, SOFTMAX=score == "softmax",
        TOPK_FIRST=topk_first, RENORM=renorm, CLAMP=renorm_min != 0.0, COMPUTE=_tl_dtype(compute_dtype),
        ROUND=compute_dtype != torch.float32, num_warps=num_warps,
    )
    return grad


@functools.lru_cache(maxsize=256)  # a tensor round trip on the host: once per (value, dtype), not per call
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype`, as torch.clamp(t, min=value) compares a `dtype` tensor with it."""
    return float(torch.tensor(value, dtype=torch.float64).to(dtype))


def _use_triton(logits: Tensor, compute_dtype: torch.dtype) -> bool:
    return (not FORCE_REFERENCE and logits.device.type == "cuda" and logits.dtype in _TRITON_DTYPES
            and compute_dtype in _TRITON_DTYPES and logits.shape[1] <= _MAX_TRITON_E)


@planned
def _route_fwd(
    logits: Tensor,
    bias: Optional[Tensor],
    k: int,
    score: str,
    topk_first: bool,
    renorm: bool,
    eps: float,
    scale: float,
    n_group: int,
    topk_group: int,
    fill: float,
    compute_dtype: torch.dtype,
    renorm_min: float = 0.0,
) -> tuple[Tensor, Tensor]:
    args = (logits, bias, k, score, topk_first, renorm, eps, scale, n_group, topk_group, fill, compute_dtype,
            renorm_min)
    validate_route_args(*args)
    if _use_triton(logits, compute_dtype):
        return triton_router_fwd(*args)
    w, ids = torch_router_fwd(*args)
    return w.contiguous(), ids.contiguous()


route_op = torch.library.custom_op("sonic::route", _route_fwd, mutates_args=())


@route_op.register_fake
def _route_fake(logits, bias, k, score, topk_first, renorm, eps, scale, n_group, topk_group, fill, compute_dtype,
                renorm_min=0.0):
    validate_route_args(logits, bias, k, score, topk_first, renorm, eps, scale, n_group, topk_group, fill,
                        compute_dtype, renorm_min)
    T = logits.shape[0]
    return logits.new_empty(T, k, dtype=compute_dtype), logits.new_empty(T, k, dtype=torch.int64)


register_nograd("route", _route_fwd, _route_fake)


@planned
def _route_backward(
    grad_w: Tensor,
    logits: Tensor,
    ids: Tensor,
    k: int,
    score: str,
    topk_first: bool,
    renorm: bool,
    eps: float,
    scale: float,
    compute_dtype: torch.dtype,
    renorm_min: float = 0.0,
) -> Tensor:
    args = (grad_w, logits, ids, k, score, topk_first, renorm, eps, scale, compute_dtype, renorm_min)
    if _use_triton(logits, compute_dtype):
        return triton_router_bwd(*args)
    return torch_router_bwd(*args).contiguous()


route_backward_op = torch.library.custom_op("sonic::route_backward", _route_backward, mutates_args=())


@route_backward_op.register_fake
def _route_backward_fake(grad_w, logits, ids, k, score, topk_first, renorm, eps, scale, compute_dtype, renorm_min=0.0):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


register_nograd("route_backward", _route_backward, _route_backward_fake)


def _setup_context(ctx, inputs, output):
    logits, _bias, k, score, topk_first, renorm, eps, scale, _g, _tg, _fill, compute_dtype, renorm_min = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.flags = (k, score, topk_first, renorm, eps, scale, compute_dtype, renorm_min)


def _backward(ctx, grad_w, _grad_ids):
    logits, ids = ctx.saved_tensors
    grad = None
    if grad_w is not None and ctx.needs_input_grad[0]:
        grad = route_backward_op(grad_w, logits, ids, *ctx.flags)
    return (grad,) + (None,) * 12


route_op.register_autograd(_backward, setup_context=_setup_context)


def route(
    logits: Tensor,
    k: int,
    *,
    score: str = "softmax",
    topk_first: bool = False,
    renorm: bool = False,
    eps: float = 0.0,
    scale: float = 1.0,
    bias: Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    fill: float = float("-inf"),
    compute_dtype: torch.dtype | None = None,
    renorm_min: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """(topk_weights [T, k], topk_ids [T, k] int64) of a router, fused (see the module docstring).

        w, ids = route(logits, 2, renorm=True, compute_dtype=torch.float32)     # Qwen3-MoE, Mixtral
        w, ids = route(logits, 4, topk_first=True)                               # gpt-oss
        w, ids = route(logits, 8, score="sigmoid", bias=b, n_group=8, topk_group=4,
                       renorm=True, eps=1e-20, scale=2.5)                        # DeepSeek-V3
        w, ids = route(logits, 8, bias=b, renorm=True, renorm_min=1e-12,
                       compute_dtype=torch.float32)                              # ERNIE-4.5
    """
    compute_dtype = compute_dtype or logits.dtype
    args = (logits, bias, int(k), score, bool(topk_first), bool(renorm), float(eps), float(scale), int(n_group),
            int(topk_group), float(fill), compute_dtype, float(renorm_min))
    validate_route_args(*args)
    return overload("route", torch.is_grad_enabled() and logits.requires_grad)(*args)
