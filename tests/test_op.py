"""The `sonic::moe_experts` op on the CPU: contract (opcheck), reference vs the simplest loop, errors."""
from __future__ import annotations

import itertools

import pytest
import torch

from moe_compiler.codegen import GATED, moe_experts, moe_experts_op, torch_moe_experts


def make_inputs(T=9, d=8, n=6, E=4, K=2, dtype=torch.float64, activation="swiglu", transposed=False, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1_out = 2 * n if GATED[activation] else n
    randn = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    x = randn(T, d)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.long)
    w = torch.rand(T, K, generator=g, dtype=dtype)
    w1 = (randn(E, d, w1_out) if transposed else randn(E, w1_out, d)) * 0.5
    w2 = (randn(E, n, d) if transposed else randn(E, d, n)) * 0.5
    b1 = randn(E, w1_out) if bias else None
    b2 = randn(E, d) if bias else None
    return x, ids, w, w1, w2, b1, b2


@pytest.mark.parametrize(
    "activation,transposed,interleaved,bias",
    [(a, t, i, b) for a, t, i, b in itertools.product(GATED, (False, True), (False, True), (False, True)) if GATED[a] or not i],
)
def test_op_matches_autograd_loop(activation, transposed, interleaved, bias):
    x, ids, w, w1, w2, b1, b2 = make_inputs(activation=activation, transposed=transposed, bias=bias)
    leaves = [t.requires_grad_() for t in (x, w, w1, w2, b1, b2) if t is not None]
    flags = dict(activation=activation, transposed=transposed, interleaved=interleaved, limit=1.5)
    got = moe_experts(x, ids, w, w1, w2, b1, b2, **flags)
    want = torch_moe_experts(x, ids, w, w1, w2, b1, b2, **flags)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("case", ["plain", "bias_transposed", "empty_experts", "T0", "K_eq_E", "fp32_weights_bf16"])
def test_opcheck(case):
    kw = dict(dtype=torch.float32)
    if case == "bias_transposed":
        kw.update(bias=True, transposed=True)
    if case == "T0":
        kw.update(T=0)
    if case == "K_eq_E":
        kw.update(K=4)
    if case == "fp32_weights_bf16":
        kw.update(dtype=torch.bfloat16)
    x, ids, w, w1, w2, b1, b2 = make_inputs(**kw)
    if case == "empty_experts":
        ids = torch.zeros_like(ids)
        ids[:, 1] = 1  # experts 2, 3 get no token
    if case == "fp32_weights_bf16":
        w = w.float()
    for t in (x, w, w1, w2, b1, b2):
        if t is not None:
            t.requires_grad_()
    transposed = case == "bias_transposed"
    args = (x, ids, w, w1, w2, b1, b2, "swiglu", False, transposed, 1.702, 7.0, True)
    torch.library.opcheck(moe_experts_op, args)


def test_inference_skips_h_and_backward_recomputes():
    x, ids, w, w1, w2, *_ = make_inputs()
    with torch.no_grad():
        _, h, _, _ = moe_experts_op(x, ids, w, w1, w2, None, None, "swiglu", False, False, 1.702, 7.0, False)
    assert h.shape[0] == 0
    out, h_saved, rows, offs = moe_experts_op(x, ids, w, w1, w2, None, None, "swiglu", False, False, 1.702, 7.0, True)
    grads_saved = torch.ops.sonic.moe_experts_backward(torch.ones_like(out), x, ids, w, w1, w2, None, None, h_saved, rows, offs, "swiglu", False, False, 1.702, 7.0)
    grads_recomputed = torch.ops.sonic.moe_experts_backward(torch.ones_like(out), x, ids, w, w1, w2, None, None, h, rows, offs, "swiglu", False, False, 1.702, 7.0)
    for a, b in zip(grads_saved, grads_recomputed):
        torch.testing.assert_close(a, b)


def test_saved_h_takes_no_gradient():
    """H is the backward's saved activation, not a differentiable output: autograd must not build a
    zero gradient of its [TK, 2n] size at every backward."""
    x, ids, w, w1, w2, *_ = make_inputs()
    for t in (x, w, w1, w2):
        t.requires_grad_()
    out, h, _, _ = moe_experts_op(x, ids, w, w1, w2, None, None, "swiglu", False, False, 1.702, 7.0, True)
    assert out.requires_grad and not h.requires_grad
    grads = torch.autograd.grad(out.sum(), [x, w, w1, w2])
    want = torch.autograd.grad(torch_moe_experts(x, ids, w, w1, w2).sum(), [x, w, w1, w2])
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref)


def test_non_contiguous_inputs():
    x, ids, w, w1, w2, *_ = make_inputs()
    xt = x.t().contiguous().t()  # same values, column-major
    w1t = w1.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(moe_experts(xt, ids, w, w1t, w2), torch_moe_experts(x, ids, w, w1, w2))


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.update(ids=a["ids"] + 4), r"expert ids must lie in \[0, 4\)"),
        (lambda a: a.update(ids=a["ids"] - 1), r"expert ids must lie in \[0, 4\)"),
        (lambda a: a.update(x=a["x"][:, :5]), "do not fit layout"),
        (lambda a: a.update(w=a["w"][:, :1]), "must match topk_ids"),
        (lambda a: a.update(x=a["x"].float()), "must share a dtype"),
        (lambda a: a.update(ids=a["ids"].float()), "must be an integer tensor"),
        (lambda a: a.update(w1=a["w1"][:, :5]), "do not fit layout"),
    ],
)
def test_bad_input_is_a_clear_error(mutate, match):
    x, ids, w, w1, w2, *_ = make_inputs()
    a = dict(x=x, ids=ids, w=w, w1=w1, w2=w2)
    mutate(a)
    with pytest.raises((ValueError, IndexError), match=match):
        moe_experts(a["x"], a["ids"], a["w"], a["w1"], a["w2"])


def test_unknown_activation():
    x, ids, w, w1, w2, *_ = make_inputs()
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        moe_experts(x, ids, w, w1, w2, activation="swish")


def test_softcap_needs_positive_caps():
    x, ids, w, w1, w2, *_ = make_inputs()
    with pytest.raises(ValueError, match="positive caps"):
        moe_experts(x, ids, w, w1, w2, activation="swiglu_softcap", alpha=0.0)


# ------------------------------------------------------------------ the list form: per-expert tensors


def _lists(w1, w2, layout):
    n = w2.shape[2]
    if layout == "separate":
        return [w[:n].clone() for w in w1], [w[n:].clone() for w in w1], [w.clone() for w in w2]
    return [w.clone() for w in w1], [], [w.clone() for w in w2]


@pytest.mark.parametrize("layout,activation,interleaved,bias", [
    ("separate", "swiglu", False, False), ("fused", "swiglu_oai", True, False), ("fused", "geglu", False, False),
    ("plain", "gelu", False, False), ("separate", "swiglu", False, True), ("fused", "swiglu_oai", True, True),
    ("plain", "gelu", False, True),
])
def test_list_op_matches_autograd_loop(layout, activation, interleaved, bias):
    from moe_compiler.codegen import moe_experts_list

    x, ids, w, w1, w2, b1, b2 = make_inputs(activation=activation, bias=bias)
    gate, up, down = _lists(w1, w2, layout)
    leaves = [t.requires_grad_() for t in (x, w, *gate, *up, *down, b1, b2) if t is not None]
    flags = dict(activation=activation, interleaved=interleaved, limit=1.5)
    got = moe_experts_list(x, ids, w, gate, up, down, b1=b1, b2=b2, **flags)
    stacked = [x, w, torch.stack([torch.cat((g, u)) for g, u in zip(gate, up)]) if up else torch.stack(gate),
               torch.stack(down)]
    want = torch_moe_experts(stacked[0], ids, stacked[1], stacked[2], stacked[3], b1, b2, **flags)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("layout,bias", [("separate", False), ("fused", False), ("separate", True)])
def test_list_opcheck(layout, bias):
    from moe_compiler.codegen import moe_experts_list_op

    x, ids, w, w1, w2, b1, b2 = make_inputs(dtype=torch.float32, bias=bias)
    gate, up, down = _lists(w1, w2, layout)
    for t in (x, w, *gate, *up, *down, b1, b2):
        if t is not None:
            t.requires_grad_()
    torch.library.opcheck(moe_experts_list_op, (x, ids, w, gate, up, down, b1, b2, "swiglu", False, 1.702, 7.0, True))


@pytest.mark.parametrize("transposed", [False, True])
def test_split_op_matches_the_reference_and_its_gradients_are_the_stacked_ones(transposed):
    """`sonic::moe_experts_split`: gate and up as two stacked parameters ([E, n, d], or [E, d, n]
    with `transposed`), the value and every gradient of the stacked op on their concatenation;
    each stacked parameter's gradient comes back in its own layout."""
    from moe_compiler.codegen.ops import moe_experts_split_op

    x, ids, w, w1, w2, _, _ = make_inputs()
    n = w2.shape[2]
    gate, up = w1[:, :n].clone(), w1[:, n:].clone()
    down = w2.clone()
    if transposed:
        gate, up, down = (t.transpose(1, 2).contiguous() for t in (gate, up, down))
    leaves = [t.requires_grad_() for t in (x, w, gate, up, down)]
    got = moe_experts_split_op(x, ids, w, gate, up, down, None, None, "swiglu", False, transposed, 1.702, 7.0, True)[0]
    t = (lambda u: u.transpose(1, 2)) if transposed else (lambda u: u)
    want = torch_moe_experts(x, ids, w, torch.cat((t(gate), t(up)), 1), t(down), None, None, activation="swiglu")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(got)
    for name, a, b in zip(["x", "w", "gate", "up", "down"], torch.autograd.grad(got, leaves, grad),
                          torch.autograd.grad(want, leaves, grad)):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)
    x, w, gate, up, down = (t.detach().float().requires_grad_() for t in (x, w, gate, up, down))
    torch.library.opcheck(moe_experts_split_op, (x, ids, w, gate, up, down, None, None, "swiglu", False, transposed,
                                                 1.702, 7.0, True))


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a["gate"].pop(), "need E > 0 tensors"),
    (lambda a: a.update(gate=a["gate"][:1] + [a["gate"][1][:, :5]] + a["gate"][2:]), "of one shape"),
    (lambda a: a.update(down=[t.float() for t in a["down"]]), "one dtype"),
    (lambda a: a.update(up=[t[:3] for t in a["up"]]), "differ in shape"),
    (lambda a: a.update(x=a["x"][:, :5]), "do not fit layout"),
    (lambda a: a.update(b1=torch.zeros(4, 6, dtype=torch.float64)), r"b1 must be \[E, w1_out\] = \(4, 12\)"),
    (lambda a: a.update(b2=torch.zeros(4, 8, dtype=torch.float32)), "b2 must have x's dtype"),
])
def test_list_bad_input_is_a_clear_error(mutate, match):
    from moe_compiler.codegen import moe_experts_list

    x, ids, w, w1, w2, _, _ = make_inputs()
    gate, up, down = _lists(w1, w2, "separate")
    a = dict(x=x, gate=gate, up=up, down=down, b1=None, b2=None)
    mutate(a)
    with pytest.raises(ValueError, match=match):
        moe_experts_list(a["x"], ids, w, a["gate"], a["up"], a["down"], b1=a["b1"], b2=a["b2"])
