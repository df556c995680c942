"""`moe_compiler.grad_fold`: x's gradient through the router added inside the experts' dX gather-sum.

CPU tests compile with Inductor over the reference ops (float64, so the fold's one rounding and
autograd's two agree to ~1e-12); the GPU test runs the Triton kernels in bf16 against float64.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from moe_compiler.codegen.ops import moe_experts, moe_experts_list
from moe_compiler.codegen.router import route as sonic_route

from .helpers import profiled_op_names

T, D, N, E, K = 48, 32, 16, 8, 2
_FOLDED = "folded into the dX gather-sum"


@pytest.fixture(autouse=True)
def no_compile_caches():
    """The pass logs what it folds when it runs; a warm FX graph or autograd cache skips it."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def _params(dtype, device="cpu", seed=0, router_bias=False, d=D, n=N):
    gen = torch.Generator().manual_seed(seed)
    p = dict(wr=torch.randn(E, d, generator=gen), w1=torch.randn(E, 2 * n, d, generator=gen) / d**0.5,
             w2=torch.randn(E, d, n, generator=gen) / n**0.5, shared=torch.randn(d, d, generator=gen) / d**0.5)
    if router_bias:
        p["br"] = torch.randn(E, generator=gen)
    return {k: v.to(device=device, dtype=dtype).requires_grad_() for k, v in p.items()}


def _x(shape, dtype, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()


def topk_softmax_layer(x, p):
    """The router as a model writes it (top-k of the logits, softmax over the kept values)."""
    logits = x @ p["wr"].t()
    vals, ids = torch.topk(logits, K, dim=-1)
    return moe_experts(x, ids, torch.softmax(vals, dim=-1), p["w1"], p["w2"])


def fused_router_layer(x, p):
    """What backend="sonic" makes of a router: `sonic::route` on the logits (router with a bias)."""
    logits = F.linear(x, p["wr"], p["br"])
    w, ids = sonic_route(logits, K, topk_first=False, compute_dtype=torch.float32)
    return moe_experts(x, ids, w.to(x.dtype), p["w1"], p["w2"])


def batched_layer(x, p):
    """x [B, S, d], flattened for the router and the experts and the result viewed back."""
    flat = x.view(-1, x.shape[-1])
    return topk_softmax_layer(flat, p).view(x.shape)


def shared_expert_layer(x, p):
    """x also read by a shared expert: three terms of x's gradient."""
    return topk_softmax_layer(x, p) + F.silu(x @ p["shared"])


def float_router_layer(x, p):
    """The router in float64 on a float32 x (as DeepSeek-V3 runs its gate in float32): no fold."""
    logits = x.double() @ p["wr"].double().t()
    vals, ids = torch.topk(logits, K, dim=-1)
    return moe_experts(x, ids, torch.softmax(vals, dim=-1).to(x.dtype), p["w1"], p["w2"])


def list_layer(x, p):
    """Per-expert weights (an nn.ModuleList's Linears) through the list form of the op."""
    logits = x @ p["wr"].t()
    vals, ids = torch.topk(logits, K, dim=-1)
    experts = range(len([k for k in p if k.startswith("gate.")]))
    return moe_experts_list(x, ids, torch.softmax(vals, dim=-1), [p[f"gate.{e}"] for e in experts],
                            [p[f"up.{e}"] for e in experts], [p[f"down.{e}"] for e in experts],
                            b1=p.get("b1"), b2=p.get("b2"))


def _list_params(dtype, device="cpu", bias=False, **kw):
    p = _params(dtype, device, **kw)
    w1, w2 = p.pop("w1").detach(), p.pop("w2").detach()
    del p["shared"]
    n = w2.shape[2]
    for e in range(E):
        p.update({f"gate.{e}": w1[e, :n].clone().requires_grad_(), f"up.{e}": w1[e, n:].clone().requires_grad_(),
                  f"down.{e}": w2[e].clone().requires_grad_()})
    if bias:  # the stacked biases the rewrite gives the list op
        gen = torch.Generator().manual_seed(3)
        p["b1"] = (torch.randn(E, w1.shape[1], generator=gen) * 0.1).to(device, dtype).requires_grad_()
        p["b2"] = (torch.randn(E, w2.shape[1], generator=gen) * 0.1).to(device, dtype).requires_grad_()
    return p


def _grads(fn, x, p, compiled, fold=True):
    x, p = x.detach().clone().requires_grad_(), {k: v.detach().clone().requires_grad_() for k, v in p.items()}
    if compiled:
        fn = torch.compile(fn, backend="sonic", options={"sonic.fallback": False, "sonic.fold_input_grad": fold})
    out = fn(x, p)
    gen = torch.Generator().manual_seed(2)
    out.backward(torch.randn(out.shape, generator=gen).to(out))
    return out.detach(), {"x": x.grad, **{k: v.grad for k, v in p.items() if v.grad is not None}}


def _assert_close(got, want, tol):
    for name in want[1]:
        err = ((got[1][name] - want[1][name]).norm() / want[1][name].norm()).item()
        assert err <= tol, (name, err)
    assert ((got[0] - want[0]).norm() / want[0].norm()).item() <= tol


@pytest.mark.parametrize("layer,shape,params", [
    (topk_softmax_layer, (T, D), {}),
    (fused_router_layer, (T, D), {"router_bias": True}),
    (batched_layer, (3, T // 3, D), {}),
    (shared_expert_layer, (T, D), {}),
], ids=["topk-softmax", "sonic-route-bias", "batched", "shared-expert"])
def test_fold_matches_eager(layer, shape, params, caplog):
    x, p = _x(shape, torch.float64), _params(torch.float64, **params)
    with caplog.at_level(logging.INFO, logger="moe_compiler"):
        got = _grads(layer, x, p, compiled=True)
    assert _FOLDED in caplog.text
    _assert_close(got, _grads(layer, x, p, compiled=False), 1e-12)


@pytest.mark.parametrize("bias", [False, True])
def test_fold_of_the_list_form(bias, caplog):
    # per-expert weights: the list form's backward split into its own four parts, the router's term
    # folded into its dX; every expert tensor's gradient (and the biases') as eager's
    x, p = _x((T, D), torch.float64), _list_params(torch.float64, bias=bias)
    with caplog.at_level(logging.INFO, logger="moe_compiler"):
        got = _grads(list_layer, x, p, compiled=True)
    assert _FOLDED in caplog.text
    want = _grads(list_layer, x, p, compiled=False)
    assert set(want[1]) == set(p) | {"x"}
    _assert_close(got, want, 1e-12)


def test_fold_with_dynamic_token_count(caplog):
    # dynamic=True: T is a symbol in the backward graph; the fold proves its shapes without a guard
    p = _params(torch.float64)
    fn = torch.compile(topk_softmax_layer, backend="sonic", dynamic=True, options={"sonic.fallback": False})
    with caplog.at_level(logging.INFO, logger="moe_compiler"):
        for tokens in (T, T + 13):
            x = _x((tokens, D), torch.float64, seed=tokens)
            got = _grads(fn, x, p, compiled=False)  # fn is compiled already
            _assert_close(got, _grads(topk_softmax_layer, x, p, compiled=False), 1e-12)
    assert _FOLDED in caplog.text


def test_fold_runs_the_split_backward():
    x, p = _x((T, D), torch.float64), _params(torch.float64)
    names = {}
    for fold in (True, False):
        torch._dynamo.reset()
        fn = torch.compile(topk_softmax_layer, backend="sonic", options={"sonic.fold_input_grad": fold})
        xx = x.detach().clone().requires_grad_()
        fn(xx, p).sum().backward()  # compile outside the profile
        names[fold] = profiled_op_names(lambda: fn(xx, p).sum().backward())
    parts = {f"sonic::moe_experts_backward_{part}" for part in ("act", "dw2", "dw1", "dx")}
    assert parts <= names[True] and "sonic::moe_experts_backward" not in names[True]
    assert not parts & names[False] and "sonic::moe_experts_backward" in names[False]


def test_fold_runs_the_list_forms_split_backward():
    x, p = _x((T, D), torch.float64), _list_params(torch.float64)
    fn = torch.compile(list_layer, backend="sonic")
    xx = x.detach().clone().requires_grad_()
    fn(xx, p).sum().backward()
    names = profiled_op_names(lambda: fn(xx, p).sum().backward())
    parts = {f"sonic::moe_experts_list_backward_{part}" for part in ("act", "dw2", "dw1", "dx")}
    assert parts <= names and "sonic::moe_experts_list_backward" not in names


def test_mixed_dtypes_are_left_alone(caplog):
    x, p = _x((T, D), torch.float32), _params(torch.float32)
    with caplog.at_level(logging.INFO, logger="moe_compiler"):
        got = _grads(float_router_layer, x, p, compiled=True)
    # the float64 term reaches x's float32 gradient through a cast: left as autograd adds it
    assert "not folded (x's other gradient term is prims.convert_element_type" in caplog.text
    assert _FOLDED not in caplog.text
    _assert_close(got, _grads(float_router_layer, x, p, compiled=False), 1e-5)


def detached_router_layer(x, p):
    """Routing weights detached (no gradient reaches the router): x's gradient is the op's dx alone."""
    logits = x @ p["wr"].t()
    vals, ids = torch.topk(logits, K, dim=-1)
    return moe_experts(x, ids, torch.softmax(vals, dim=-1).detach(), p["w1"], p["w2"])


def test_no_other_term_is_left_alone(caplog):
    # dx goes straight to the graph's output: nothing to fold (this crashed the compile, walking past the output)
    x, p = _x((T, D), torch.float64), _params(torch.float64)
    with caplog.at_level(logging.INFO, logger="moe_compiler"):
        got = _grads(detached_router_layer, x, p, compiled=True)
    assert "not folded (dx goes to output" in caplog.text and _FOLDED not in caplog.text
    _assert_close(got, _grads(detached_router_layer, x, p, compiled=False), 1e-12)


def test_fold_off_keeps_autograd_sum(caplog):
    x, p = _x((T, D), torch.float64), _params(torch.float64)
    with caplog.at_level(logging.INFO, logger="moe_compiler"):
        got = _grads(topk_softmax_layer, x, p, compiled=True, fold=False)
    assert _FOLDED not in caplog.text
    _assert_close(got, _grads(topk_softmax_layer, x, p, compiled=False), 1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("layer,params", [(topk_softmax_layer, {}), (fused_router_layer, {"router_bias": True})],
                         ids=["topk-softmax", "sonic-route-bias"])
def test_gpu_fold_bf16(layer, params, caplog):
    # bf16 on the Triton kernels: the folded step's error against float64 is no worse than the
    # unfolded compiled step's (the fold rounds x's gradient once, autograd twice)
    _check_gpu_fold(layer, _params(torch.bfloat16, "cuda", d=256, n=128, **params), caplog)


def _check_gpu_fold(layer, p, caplog):
    x = _x((4096, 256), torch.bfloat16, "cuda")
    truth = _grads(layer, x.double(), {k: v.double() for k, v in p.items()}, compiled=False)
    with caplog.at_level(logging.INFO, logger="moe_compiler"):
        folded = _grads(layer, x, p, compiled=True)
    assert _FOLDED in caplog.text
    torch._dynamo.reset()
    plain = _grads(layer, x, p, compiled=True, fold=False)
    for name, want in truth[1].items():
        err = lambda g: ((g[1][name].double() - want).norm() / want.norm()).item()  # noqa: E731
        assert err(folded) <= 1.05 * err(plain) + 1e-3, (name, err(folded), err(plain))


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_fold_bf16_list_form(bias, caplog):
    # the list form's split parts on the Triton kernels (per-expert tensors read in place), bf16
    _check_gpu_fold(list_layer, _list_params(torch.bfloat16, "cuda", d=256, n=128, bias=bias), caplog)


@pytest.mark.gpu
@pytest.mark.parametrize("slots,mapped", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["dense", "slots", "dense-row-map", "slots-row-map"])
@pytest.mark.parametrize("d,J,K", [(1536, 128, 4), (768, 64, 4), (200, 300, 4), (1536, 32, 2), (640, 64, 3),
                                   (1536, 128, 8), (1000, 256, 16), (512, 64, 32)])
def test_gpu_gather_sum_product_kernel(slots, mapped, d, J, K):
    # the launcher's default launch in bf16: R resident (J <= 128) or in chunks (J > 128), d not a
    # multiple of the block, each K of the launch table (K = 3: a token block's row tile padded to
    # 4); against float32 sums of the same bf16 rows. mapped: each slot's row read through a row map
    # (a random permutation into a larger buffer whose other rows are NaN), as the TILE-order dX~ is
    # read (with [T, K] routing the kernel loads the map a block ahead)
    from moe_compiler import codegen

    T = 3000
    gen = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(T * K, d, device="cuda", generator=gen).bfloat16()
    lhs = torch.randn(T, J, device="cuda", generator=gen).bfloat16()
    rhs = torch.randn(d, J, device="cuda", generator=gen).bfloat16().t()
    ids = torch.zeros(T * K, dtype=torch.int64, device="cuda")
    arg = None
    if slots:
        ids[::3] = -1
        arg = (ids, codegen.routing.token_offsets(torch.arange(T * K, device="cuda") // K, T))
    y_in, row_map = y, None
    if mapped:
        row_map = torch.randperm(T * K + 500, device="cuda", generator=gen)[:T * K].to(torch.int32)
        y_in = torch.full((T * K + 500, d), float("nan"), dtype=y.dtype, device="cuda")
        y_in[row_map.long()] = y
        if slots:
            row_map[::3] = -1  # padding slots are never read
    got = codegen.forward.triton_moe_gather_sum(y_in, None, T, K, torch.bfloat16, arg, product=(lhs, rhs),
                                                row_map=row_map).float()
    rows = torch.where((ids >= 0)[:, None], y.float(), 0.0).view(T, K, d).sum(1)
    want = rows + lhs.float() @ rhs.float()
    # one bf16 rounding of the float32 result (2^-8 relative), on top of float32 sums in either order
    assert ((got - want).abs() <= want.abs() * 2**-8 + 1e-2).all(), (got - want).abs().max()
