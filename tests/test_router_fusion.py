"""Router fusion: the `sonic::route` op (reference, analytic backward, Triton kernels) and the pass
that puts it in place of the routers of Hugging Face families and naive MoE code.

The op: the analytic backward vs autograd through the reference (float64), opcheck, errors. The
kernels run under TRITON_INTERPRET=1 in a child process (as in test_kernels.py, fp32/fp16), and in
bf16 on the GPU (`gpu` marker). The pass: per family, loss and every gradient vs eager, the rewrite
count, the report saying "fused", and `sonic::route` executed, in training and under no_grad; then
a grid of look-alikes that must stay unfused, each with its reason.
"""
from __future__ import annotations

import os
import re
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

import moe_compiler
from moe_compiler.codegen.kernels.router import KEYS_BF16, KEYS_FP16, KEYS_FP32, _key_value, _order_keys
from moe_compiler.codegen.router import route, route_op, torch_router_bwd, torch_router_fwd

from .helpers import (
    assert_close_to_eager,
    compile_sonic,
    loss_and_grads,
    profiled_op_names,
    run_interpreted_child,
)

_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # read once: this process is the child
ROUTE = "sonic::route"

# (name, k, route() keywords, bias): every router form the pass produces, plus edge cases
FORMS = [
    ("softmax-topk", 3, dict(), False),
    ("softmax-topk-renorm", 2, dict(renorm=True), False),
    ("topk-softmax", 2, dict(topk_first=True), False),
    ("sigmoid-topk-scale", 2, dict(score="sigmoid", scale=2.5), False),
    ("sigmoid-bias-group-renorm-scale", 3, dict(score="sigmoid", n_group=3, topk_group=2, renorm=True, eps=1e-20,
                                                scale=2.5), True),
    ("sigmoid-bias-group-fill0", 2, dict(score="sigmoid", n_group=3, topk_group=1, fill=0.0), True),
    ("sigmoid-bias-renorm-scale", 2, dict(score="sigmoid", renorm=True, eps=1e-6, scale=2.5), True),  # LFM2-MoE
    ("k1", 1, dict(renorm=True), False),
    ("k=E", 6, dict(renorm=True, scale=0.5), False),
    # ERNIE-4.5's w / clamp(sum, min): bounds the tests' sums reach, so rows on both sides of the clamp
    ("softmax-bias-renorm-clamp", 2, dict(renorm=True, renorm_min=0.6), True),
    ("sigmoid-renorm-clamp-scale", 2, dict(score="sigmoid", renorm=True, renorm_min=1.35, scale=2.0), False),
]


def _args(E, k, kw, bias, dtype, compute_dtype=None):
    full = dict(score="softmax", topk_first=False, renorm=False, eps=0.0, scale=1.0, n_group=1, topk_group=1,
                fill=float("-inf"), renorm_min=0.0)
    full.update(kw)
    b = torch.linspace(-0.1, 0.1, E, dtype=dtype) if bias else None
    return (b, k, full["score"], full["topk_first"], full["renorm"], full["eps"], full["scale"], full["n_group"],
            full["topk_group"], full["fill"], compute_dtype or dtype, full["renorm_min"])


def _bwd_args(args):
    b, k, score, topk_first, renorm, eps, scale, *_, compute_dtype, renorm_min = args
    return (k, score, topk_first, renorm, eps, scale, compute_dtype, renorm_min)


def _canonical(w, ids):
    """Weights and ids ordered by expert id (a sorted=False top-k may list them in any order)."""
    ids_sorted, order = ids.sort(-1)
    return w.gather(-1, order), ids_sorted


# --- the op -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,k,kw,bias", FORMS, ids=[f[0] for f in FORMS])
def test_analytic_backward_matches_autograd(name, k, kw, bias):
    """torch_router_bwd (the formulas the kernel implements) == autograd through the reference, fp64."""
    torch.manual_seed(0)
    logits = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    args = _args(6, k, kw, bias, torch.float64)
    w, ids = torch_router_fwd(logits, *args)
    if kw.get("renorm_min"):  # the clamp binds on some rows and not on others
        s = torch.softmax(logits, -1) if kw.get("score", "softmax") == "softmax" else torch.sigmoid(logits)
        sums = s.gather(1, ids).sum(-1)
        assert (sums < kw["renorm_min"]).any() and (sums > kw["renorm_min"]).any(), sums
    g = torch.randn_like(w)
    (want,) = torch.autograd.grad(w, logits, g)
    got = torch_router_bwd(g, logits.detach(), ids, *_bwd_args(args))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name,k,kw,bias", FORMS, ids=[f[0] for f in FORMS])
def test_op_gradcheck(name, k, kw, bias):
    """The op's autograd (route_backward) passes torch.autograd.gradcheck in fp64."""
    torch.manual_seed(1)
    logits = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    args = _args(6, k, kw, bias, torch.float64)
    torch.autograd.gradcheck(lambda x: route_op(x, *args)[0], (logits,))


def test_compute_dtype_and_output_dtype():
    """softmax(bf16 logits, dtype=float32) -> fp32 weights; the logits' grad comes back in bf16."""
    torch.manual_seed(2)
    logits = torch.randn(9, 8).bfloat16().requires_grad_()
    w, ids = route(logits, 2, renorm=True, compute_dtype=torch.float32)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    ew, eids = torch.topk(probs, 2, dim=-1)
    ew = ew / ew.sum(-1, keepdim=True)
    assert w.dtype == torch.float32 and torch.equal(ids, eids)
    torch.testing.assert_close(w, ew)
    g = torch.randn_like(w)
    (got,) = torch.autograd.grad(w, logits, g)
    (want,) = torch.autograd.grad(ew, logits, g)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name,k,kw,bias", [FORMS[1], FORMS[2], FORMS[4]], ids=[FORMS[i][0] for i in (1, 2, 4)])
def test_opcheck(name, k, kw, bias):
    torch.manual_seed(3)
    logits = torch.randn(5, 6, requires_grad=True)
    torch.library.opcheck(route_op, (logits, *_args(6, k, kw, bias, torch.float32)))


BAD = {
    "k>E": (dict(k=7), "k must be in"),
    "k=0": (dict(k=0), "k must be in"),
    "3-D logits": (dict(logits=torch.randn(2, 3, 6)), "must be [T, E]"),
    "int logits": (dict(logits=torch.zeros(3, 6, dtype=torch.int64)), "floating point"),
    "bias shape": (dict(score="sigmoid", bias=torch.zeros(5)), "bias must be"),
    "bias promotes": (dict(score="sigmoid", bias=torch.zeros(6, dtype=torch.float64)), "would promote"),
    "n_group divides": (dict(score="sigmoid", n_group=4, topk_group=1), "divide E"),
    "topk_group": (dict(score="sigmoid", n_group=3, topk_group=4), "topk_group"),
    "one expert per group": (dict(score="sigmoid", n_group=6, topk_group=2), ">= 2 experts per group"),
    "topk_first sigmoid": (dict(topk_first=True, score="sigmoid"), "topk_first"),
    "score": (dict(score="relu"), "score must be"),
    "eps without renorm": (dict(eps=1e-6), "without renorm"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_errors(case):
    kw, message = BAD[case]
    kw = dict(kw)
    logits = kw.pop("logits", torch.randn(3, 6))
    k = kw.pop("k", 2)
    with pytest.raises(ValueError, match=re.escape(message)):
        route(logits, k, **kw)


# --- the kernels -------------------------------------------------------------------------------------


@pytest.fixture
def kernels():
    """codegen.router's Triton launchers with interpreted kernels (only in the child process)."""
    if not _INTERPRETING:
        pytest.skip("interpreted kernels run in the child process of test_router_kernels_in_child_process")
    from moe_compiler.codegen import router

    return router


@pytest.mark.skipif(_INTERPRETING, reason="this is the child process")
def test_router_kernels_in_child_process():
    counts = run_interpreted_child(__file__, "-k", "interpreted", timeout=600)
    assert counts.get("passed", 0) >= 16, counts


# fp32: summation order only. fp16: the kernel rounds where the model's fp16 tensors round, but
# exp and sums differ in the last bit.
_KTOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=1e-3)}


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=str)
@pytest.mark.parametrize("name,k,kw,bias", FORMS, ids=[f[0] for f in FORMS])
def test_interpreted_kernel_matches_reference(kernels, name, k, kw, bias, dtype):
    """T=7 with 4-token blocks (a partial block), E=6 (not a power of two), k=1 and k=E among FORMS."""
    torch.manual_seed(4)
    logits = torch.randn(7, 6).to(dtype)
    args = _args(6, k, kw, bias, dtype)
    want = _canonical(*torch_router_fwd(logits, *args))
    got = _canonical(*kernels.triton_router_fwd(logits, *args, block_t=4))
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0].float(), want[0].float(), **_KTOL[dtype])
    _, ids = torch_router_fwd(logits, *args)
    g = torch.randn(7, k).to(dtype)
    want_grad = torch_router_bwd(g, logits, ids, *_bwd_args(args))
    got_grad = kernels.triton_router_bwd(g, logits, ids, *_bwd_args(args), block_t=4)
    assert got_grad.dtype == logits.dtype
    torch.testing.assert_close(got_grad.float(), want_grad.float(), **_KTOL[dtype])


def test_interpreted_kernel_upcast_and_large_block(kernels):
    """fp16 logits scored in fp32 (softmax(dtype=float)), the default block size, T=0."""
    torch.manual_seed(5)
    logits = torch.randn(37, 10).half()
    args = _args(10, 4, dict(renorm=True), False, torch.float16, compute_dtype=torch.float32)
    want, got = torch_router_fwd(logits, *args), kernels.triton_router_fwd(logits, *args)
    assert got[0].dtype == torch.float32 and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])
    empty = kernels.triton_router_fwd(logits[:0], *args)
    assert empty[0].shape == (0, 4) and empty[1].shape == (0, 4)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=str)
def test_interpreted_kernel_ranks_special_values_as_torch_topk(kernels, dtype):
    """The kernel's top-k order: equal values lowest expert first; -0.0 below +0.0; NaN of either
    sign above every number; infinities and subnormals in their place. torch.topk picks the same
    sets except where equal values straddle the k-th place (row 3: its own tie order). fp16 logits
    (16-bit keys) round row 5 to [inf, inf, -0.0, 0.0, 0, -0.0]: the same picks."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[nan, 1, nan, 2, -inf, 0], [-0.0, 0.0, -1, -2, -3, -4], [1, 3, 3, 0, 3, -1],
                           [-inf, -inf, -5, -inf, -inf, -inf], [5, -nan, 1, 2, 3, 4],
                           [inf, 1e30, -1e-45, 1e-45, 0, -0.0]]).to(dtype)
    want_ids = torch.tensor([[0, 2, 3], [1, 0, 2], [1, 2, 4], [2, 0, 1], [1, 0, 5], [0, 1, 3]])
    args = _args(6, 3, dict(topk_first=True), False, dtype)
    w, ids = kernels.triton_router_fwd(logits, *args, block_t=4)
    assert torch.equal(ids, want_ids)
    rows = [0, 1, 2, 4, 5] if dtype == torch.float32 else [0, 1, 2, 4]  # fp16 row 5: 0.0 twice at the cut
    ref_w, ref_ids = _canonical(*torch_router_fwd(logits[rows], *args))
    got_w, got_ids = _canonical(w[rows], ids[rows])
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, equal_nan=True)


@pytest.mark.parametrize("name,k,kw,bias", FORMS, ids=[f[0] for f in FORMS])
def test_interpreted_backward_with_nan_logits_as_reference(kernels, name, k, kw, bias):
    """NaN logits, one a row (selected: top-k ranks NaN above every number) and five in a row (more than
    k: some left out; sigmoid(NaN) and a softmax over a NaN are NaN): the backward's every
    column (the unselected ones, stored first, and the k selected ones over them) equals the
    reference's, NaN where its is NaN; where the unselected columns' gradient is 0 by the formula (top-k
    first, sigmoid), a zero where its is a zero (after softmax -> top-k with renorm, it is -p times a
    sum that is 0 up to rounding, which two summation orders round differently)."""
    torch.manual_seed(11)
    E = 6
    k = E if name == "k=E" else k
    logits = torch.randn(9, E)
    logits[1, 4] = float("nan")
    logits[6, 0] = float("nan")
    logits[3, 1:] = float("nan")  # more NaNs than k: top-k ranks them first, and leaves some out
    args = _args(E, k, kw, bias, torch.float32)
    _, ids = torch_router_fwd(logits, *args)
    g = torch.randn(9, k)
    want = torch_router_bwd(g, logits, ids, *_bwd_args(args))
    got = kernels.triton_router_bwd(g, logits, ids, *_bwd_args(args), block_t=4)
    assert torch.equal(got.isnan(), want.isnan())
    if kw.get("topk_first") or kw.get("score") == "sigmoid":
        assert torch.equal(got == 0, want == 0)
    torch.testing.assert_close(got, want, equal_nan=True, **_KTOL[torch.float32])


@triton.jit
def _keys_kernel(x_ptr, y_ptr, key_ptr, N: tl.constexpr, KEYS: tl.constexpr):
    """For a row of N floats: key = `_order_keys(x)`, y = `_key_value(key)`."""
    cols = tl.arange(0, N)
    x = tl.load(x_ptr + cols)
    keys = _order_keys(x[None, :], cols, N, N, KEYS)
    tl.store(key_ptr + cols, tl.reshape(keys, [N]).to(tl.int64))
    tl.store(y_ptr + cols, tl.reshape(_key_value(keys, KEYS), [N]))


_NARROW = {"fp32": (KEYS_FP32, torch.float32), "bf16": (KEYS_BF16, torch.bfloat16), "fp16": (KEYS_FP16, torch.float16)}


def _key_probe(dtype):
    """1024 floats exactly representable in dtype (held as fp32): signed zeros, subnormals,
    infinities, NaN of both signs, random magnitudes and repeats (equal values)."""
    torch.manual_seed(9)
    tiny = torch.finfo(dtype).smallest_normal
    special = torch.tensor([0.0, -0.0, tiny / 4, -tiny / 4, tiny, -torch.finfo(dtype).max, float("inf"),
                            -float("inf"), 1.0, -2.0, float("nan"), -float("nan")])
    x = torch.cat([special, torch.randn(500) * 10.0 ** torch.randint(-30, 30, (500,)).float()]).to(dtype).float()
    return torch.cat([x, x[torch.randint(0, x.numel(), (1024 - x.numel(),))]])


def _run_keys(x, keys_kind):
    y, key = torch.empty_like(x), torch.empty(x.shape, dtype=torch.int64)
    _keys_kernel[(1,)](x, y, key, N=x.numel(), KEYS=keys_kind)
    return y, key


@pytest.mark.parametrize("dtype", _NARROW, ids=str)
def test_interpreted_key_value_inverts_order_keys(kernels, dtype):
    """The forward reads a picked value back from its `_order_keys` key (no second reduction): that
    must give the value's own bits for every float the keys hold (signed zeros, subnormals,
    infinities, random magnitudes), and NaN for NaN. The weights' tolerance could not tell a flipped
    last bit. bf16 and fp16: 16-bit keys of values exact in that dtype (the values held as fp32)."""
    keys_kind, narrow = _NARROW[dtype]
    x = _key_probe(narrow)
    y, _ = _run_keys(x, keys_kind)
    nan = x.isnan()
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y[~nan].view(torch.int32), x[~nan].view(torch.int32))


@pytest.mark.parametrize("dtype", ("bf16", "fp16"))
def test_interpreted_narrow_keys_rank_as_wide_keys(kernels, dtype):
    """16-bit keys order exactly as the fp32 (int64) keys do on values exact in that dtype: the
    same descending order of all 1024 columns, equal values by the lowest column, NaN first."""
    keys_kind, narrow = _NARROW[dtype]
    x = _key_probe(narrow)
    _, narrow_keys = _run_keys(x, keys_kind)
    _, wide_keys = _run_keys(x, KEYS_FP32)
    assert narrow_keys.unique().numel() == x.numel()
    assert torch.equal(narrow_keys.argsort(descending=True), wide_keys.argsort(descending=True))


@pytest.mark.parametrize("name,k,kw,bias", FORMS, ids=[f[0] for f in FORMS])
def test_interpreted_narrow_keys_equal_wide_keys(kernels, name, k, kw, bias):
    """The fp16 forward with 16-bit keys gives the bit-exact ids and weights of int64 keys, on logits
    with many equal values, signed zeros, infinities and NaN (fp16 scores, and fp16 logits ranked
    as they are for top-k first)."""
    torch.manual_seed(11)
    logits = (torch.randint(-3, 4, (21, 6)).float() * 0.5).half()
    logits[2, 1] = logits[7, 4] = float("nan")
    logits[3, 0], logits[5, 2], logits[9, 5] = -0.0, float("inf"), -float("inf")
    args = _args(6, k, kw, bias, torch.float16)
    narrow = kernels.triton_router_fwd(logits, *args, block_t=4)
    wide = kernels.triton_router_fwd(logits, *args, block_t=4, narrow_keys=False)
    assert torch.equal(narrow[1], wide[1])
    assert torch.equal(narrow[0].view(torch.int16), wide[0].view(torch.int16))


def _assert_kernel_as_torch(kernels, logits, args):
    """The kernel's selection equals torch's (ids compared as sets), weights NaN where torch's are."""
    want_w, want_ids = _canonical(*torch_router_fwd(logits, *args))
    got_w, got_ids = _canonical(*kernels.triton_router_fwd(logits, *args, block_t=4))
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, equal_nan=True)


@pytest.mark.parametrize("k, topk_group", [(2, 1), (3, 2)])
def test_interpreted_group_limited_ranks_as_torch_topk(kernels, k, topk_group):
    """DeepSeek-V3's group-limited top-k (3 groups of 2) with NaN and infinite logits: a NaN choice
    makes its group's top-2 sum NaN, which torch.topk ranks above every group score (rows 0, 2);
    sigmoid(+-inf) are 1 and 0 (row 1). No equal values straddle a cut."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[0.1, 0.2, nan, -5, 3, 2], [inf, -inf, 0, 1, -inf, -inf], [-1, nan, 5, 4, 2, 1],
                           [0.5, -2, 1, 2, 3, -3]])
    args = _args(6, k, dict(score="sigmoid", n_group=3, topk_group=topk_group), False, torch.float32)
    _assert_kernel_as_torch(kernels, logits, args)


def test_interpreted_many_groups_rank_nan_as_torch_topk(kernels):
    """More than 32 groups (34 of 2): the kernel's per-group NaN check instead of its bit flags."""
    torch.manual_seed(8)
    logits = torch.randn(5, 68)
    logits[1, 40] = logits[3, 7] = float("nan")
    args = _args(68, 4, dict(score="sigmoid", n_group=34, topk_group=3, renorm=True), True, torch.float32)
    _assert_kernel_as_torch(kernels, logits, args)


@pytest.mark.gpu
@pytest.mark.parametrize("name,k,kw,bias", FORMS, ids=[f[0] for f in FORMS])
def test_kernel_gpu_bf16(name, k, kw, bias):
    """bf16 on the GPU: the Triton kernels vs the reference run by torch in bf16 on the same device."""
    from moe_compiler.codegen.router import triton_router_bwd, triton_router_fwd

    torch.manual_seed(6)
    E = 6 if name == "k=E" else 72  # E = 72: not a power of two, 3 groups of 24
    k = E if name == "k=E" else k
    logits = torch.randn(1000, E, device="cuda").bfloat16()
    args = _args(E, k, kw, bias, torch.bfloat16)
    args = (None if args[0] is None else args[0].cuda(), *args[1:])
    want = _canonical(*torch_router_fwd(logits, *args))
    got = _canonical(*triton_router_fwd(logits, *args))
    mismatch = (got[1] != want[1]).any(-1).float().mean().item()
    assert mismatch < 0.01, f"{mismatch:.2%} of the rows select other experts (bf16 ties only)"
    same = (got[1] == want[1]).all(-1)
    torch.testing.assert_close(got[0][same].float(), want[0][same].float(), rtol=1.6e-2, atol=1e-3)
    _, ids = torch_router_fwd(logits, *args)
    g = torch.randn(1000, k, device="cuda").bfloat16()
    want_grad = torch_router_bwd(g, logits, ids, *_bwd_args(args)).float()
    got_grad = triton_router_bwd(g, logits, ids, *_bwd_args(args)).float()
    assert (got_grad - want_grad).norm() <= 2e-2 * want_grad.norm() + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("name,k,kw,bias", FORMS, ids=[f[0] for f in FORMS])
def test_kernel_gpu_bf16_narrow_keys_equal_wide_keys(name, k, kw, bias):
    """bf16 logits on the GPU (top-k first ranks them in bf16; the rest score in bf16): 16-bit keys
    give the bit-exact ids and weights of int64 keys, with many equal logits, NaN and infinities."""
    from moe_compiler.codegen.router import triton_router_fwd

    torch.manual_seed(12)
    E = 6 if name == "k=E" else 96  # 3 groups of 32, padded to 128 columns
    k = E if name == "k=E" else k
    logits = (torch.randn(4099, E, device="cuda") * 4).round().div(4).bfloat16()  # quarters: ties in most rows
    logits[::97, 1] = float("nan")
    logits[::89, 2], logits[::83, 3], logits[::79, 4] = float("inf"), -float("inf"), -0.0
    args = _args(E, k, kw, bias, torch.bfloat16)
    args = (None if args[0] is None else args[0].cuda(), *args[1:])
    narrow = triton_router_fwd(logits, *args)
    wide = triton_router_fwd(logits, *args, narrow_keys=False)
    assert torch.equal(narrow[1], wide[1])
    assert torch.equal(narrow[0].view(torch.int16), wide[0].view(torch.int16))


# --- the pass on Hugging Face families -----------------------------------------------------------------

FUSED_FORMS = {
    "qwen3_moe": "softmax->topk->renorm, fused",
    "qwen2_moe": "softmax->topk, fused",
    "olmoe": "softmax->topk, fused",
    "mixtral": "softmax->topk->renorm, fused",
    "gpt_oss": "topk->softmax, fused",
    "deepseek_v3": "sigmoid+bias->group-top1/2->topk->gather->renorm->scale, fused",
}


def _tiny(name, dtype=torch.float32, **overrides):
    from moe_compiler.testing import tiny_moe_model

    return tiny_moe_model(name, dtype, num_hidden_layers=1, **overrides)


def _ids(model, T=10, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, T), generator=g)


def _check_fused(model, expect_router, compiler="aot_eager", dtype=torch.float32, truth=None, fused=True, **options):
    """Training and no_grad equal eager; one rewrite per MoE layer; the router column says
    `expect_router`; sonic::route runs (or, when not fused, does not)."""
    from moe_compiler.testing import count_moe_layers

    ids = _ids(model).to(next(model.parameters()).device)
    eager = loss_and_grads(model, ids)
    compiled = compile_sonic(model, compiler=compiler, **options)
    with moe_compiler.capture() as report:
        got = loss_and_grads(compiled, ids)
    layers = count_moe_layers(model)
    assert len(report.rewritten) == layers and not report.rejected, str(report)
    routers = {r.details["router"] for r in report.rewritten}
    assert all(expect_router in r for r in routers), str(report)
    assert_close_to_eager(got[0], eager[0], truth and truth[0], dtype, "logits")
    assert got[1].keys() == eager[1].keys()
    for pname in eager[1]:
        assert_close_to_eager(got[1][pname], eager[1][pname], truth and truth[1][pname], dtype, f"grad {pname}")
    with torch.no_grad(), moe_compiler.capture() as inference:
        out = compiled(ids).logits
        names = profiled_op_names(lambda: compiled(ids))
    assert len(inference.rewritten) == layers and all(expect_router in r.details["router"] for r in inference.rewritten)
    assert_close_to_eager(out, eager[0], truth and truth[0], dtype, "no_grad logits")
    assert any(n.startswith("sonic::moe_experts") for n in names)
    assert (ROUTE in names) == fused, sorted(names)
    return report


@pytest.mark.parametrize("name", list(FUSED_FORMS))
def test_hf_router_fused(name):
    _check_fused(_tiny(name), FUSED_FORMS[name])


def test_hf_router_fused_inductor():
    """DeepSeek-V3 (bias, groups, eps, scale) through AOTAutograd and Inductor."""
    _check_fused(_tiny("deepseek_v3"), FUSED_FORMS["deepseek_v3"], compiler="inductor")


def _check_fused_bf16(name, device="cpu", compiler="aot_eager"):
    """A bf16 model judged against its fp32 twin (as test_hf_grouped_mm does)."""
    model = _tiny(name, torch.bfloat16).to(device)
    fp32 = _tiny(name).to(device)
    fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    truth = loss_and_grads(fp32, _ids(fp32).to(device))
    _check_fused(model, FUSED_FORMS[name], compiler=compiler, dtype=torch.bfloat16, truth=truth)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_hf_router_fused_bf16_cpu(name):
    """bf16 weights: Qwen3 scores in fp32 (softmax dtype=torch.float) and the `.to(bf16)` of the
    weights stays after the op; gpt-oss's softmax over its top-k runs in bf16; DeepSeek-V3 routes in
    fp32 with a bf16 correction bias."""
    _check_fused_bf16(name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FUSED_FORMS))
def test_hf_router_fused_gpu_bf16(name):
    """Every family in bf16 on the GPU through Inductor: the Triton router kernels in the model."""
    _check_fused_bf16(name, device="cuda", compiler="inductor")


def _tiny_family(family, config_cls, model_cls, init, **config):
    """A small float32 causal LM of a family the testing helpers do not build (skipped where this
    transformers has none), seeded, with `init(name, param)` applied to each parameter."""
    tf = pytest.importorskip("transformers")
    if not hasattr(tf, config_cls):
        pytest.skip(f"transformers {tf.__version__} has no {family}")
    torch.manual_seed(0)
    model = getattr(tf, model_cls)(getattr(tf, config_cls)(**config)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            init(name, p)
    return model


def _tiny_gemma4():
    """A two-layer Gemma 4 text model with its MoE block on, per-expert scales away from 1."""
    def init(name, p):
        if name.endswith("per_expert_scale"):
            p.uniform_(0.5, 1.5)

    return _tiny_family(
        "Gemma 4", "Gemma4TextConfig", "Gemma4ForCausalLM", init,
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=16, vocab_size=128, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention"])


def test_gemma4_router_fused_before_its_per_expert_scale():
    """Gemma 4's router renormalises its top-k weights, then multiplies them by a learned
    per_expert_scale[ids]: the router up to the renormalisation is fused, the product stays in the
    graph on the fused weights and ids, and every gradient (per_expert_scale's included) equals eager."""
    _check_fused(_tiny_gemma4(), "softmax->topk->renorm * per_expert_scale[ids] (kept), fused")


def _tiny_ernie(norm_min):
    """A two-layer ERNIE-4.5-MoE (softmax scores, a correction bias for the choice, weights divided by
    clamp(sum, min=moe_norm_min)), its bias away from 0."""
    def init(name, p):
        if name.endswith("e_score_correction_bias"):
            p.uniform_(-0.05, 0.05)
        if name.endswith("gate.weight"):
            p.normal_(0.0, 0.2)  # top-2 sums spread over ~0.4-0.9

    return _tiny_family(
        "ERNIE-4.5-MoE", "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", init,
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, moe_intermediate_size=32, moe_k=2, moe_num_experts=8,
        moe_num_shared_experts=1, moe_layer_start_index=0, moe_norm_min=norm_min)


@pytest.mark.parametrize("norm_min", [1e-12, 0.7], ids=["as-shipped", "clamp-active"])
def test_ernie_router_fused_with_its_clamped_renorm(norm_min):
    """ERNIE-4.5 divides its routing weights by clamp(sum, min=moe_norm_min): fused, with the clamp.
    As shipped (1e-12) the clamp never binds; at 0.7 it binds for some tokens and not for others
    (checked), and the loss and every gradient still equal eager."""
    model = _tiny_ernie(norm_min)
    if norm_min == 0.7:
        sums = []
        def hook(mod, args, out):  # out: (router logits, clamped weights, ids); the sums before the clamp
            sums.append(torch.softmax(out[0], -1).gather(-1, out[2]).sum(-1))

        handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
        with torch.no_grad():
            model(_ids(model))
        for h in handles:
            h.remove()
        sums = torch.cat(sums)
        assert (sums < norm_min).any() and (sums > norm_min).any(), sums
    _check_fused(model, "softmax+bias->topk->gather->renorm, fused")


def test_granitemoe_router_through_type_as():
    """A family the other tests do not build (Granite-MoE: `softmax(topk(logits.float()).values)
    .type_as(hidden)`): the `.type_as` cast after the router stays, the router fuses."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GraniteMoeConfig(
        hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _check_fused(model, "topk->softmax, fused (GraniteMoeExperts)")


def test_fuse_router_off_keeps_the_router():
    model = _tiny("qwen3_moe")
    report = _check_fused(model, "softmax->topk->renorm (Qwen3MoeExperts)", fused=False, fuse_router=False)
    assert all("fused" not in r.details["router"] for r in report.rewritten), str(report)


def test_explain_says_fused():
    model = _tiny("mixtral")
    text = str(moe_compiler.explain(model, _ids(model)))
    assert "softmax->topk->renorm, fused (MixtralExperts)" in text, text


def test_token_rounding_keeps_the_router():
    """Token rounding reads the router probabilities: the router stays, with that reason."""
    model = _tiny("qwen3_moe")
    ids = _ids(model)
    compiled = compile_sonic(model, compiler="aot_eager", token_rounding="nearest")
    with moe_compiler.capture() as report:
        loss_and_grads(compiled, ids)
    (record,) = report.rewritten
    assert "not fused: token rounding reads the router probabilities" in record.details["router"], str(report)
    assert ROUTE not in profiled_op_names(lambda: compiled(ids, labels=ids).loss.backward())


# --- DeepSeek-style group routers written differently --------------------------------------------------


def _deepseek_forward(group_score="top2", fill=float("-inf"), bias_row=None):
    """DeepseekV3TopkRouter.forward with the group score, the mask fill and the bias's spelling as
    knobs (bias_row: "unsqueeze", "none_index" or "view" make the [E] bias a [1, E] row first)."""
    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        scores = router_logits.sigmoid()
        bias = self.e_score_correction_bias
        if bias_row == "unsqueeze":
            bias = bias.unsqueeze(0)
        elif bias_row == "none_index":
            bias = bias[None, :]
        elif bias_row == "view":
            bias = bias.view(1, -1)
        choice = scores + bias
        grouped = choice.view(-1, self.num_group, self.num_experts // self.num_group)
        if group_score == "top2":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        elif group_score == "top3":
            group_scores = grouped.topk(3, dim=-1)[0].sum(dim=-1)
        else:  # "max"
            group_scores = grouped.amax(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group)
                      .reshape(-1, self.num_experts))
        choice = choice.masked_fill(~score_mask.bool(), fill)
        topk_indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_indices)
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return router_logits, topk_weights * self.routed_scaling_factor, topk_indices
    return forward


def _deepseek_with(forward):
    model = _tiny("deepseek_v3")
    for module in model.modules():
        if type(module).__name__ == "DeepseekV3TopkRouter":
            module.forward = types.MethodType(forward, module)
            module.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, module.num_experts))
    return model


def test_group_router_fill_zero_fused():
    """Older DeepSeek code fills masked experts with 0.0: fused with fill=0.0 (a bias keeps the
    choices apart, so no tie decides the result)."""
    _check_fused(_deepseek_with(_deepseek_forward(fill=0.0)), "group-top1/2->topk->gather->renorm->scale, fused")


@pytest.mark.parametrize("bias_row", ["unsqueeze", "none_index", "view"])
def test_group_router_with_its_bias_as_a_row_fused(bias_row):
    """`scores + bias.unsqueeze(0)` (DeepSeek-V3's reference code) is the [E] bias added to every row."""
    _check_fused(_deepseek_with(_deepseek_forward(bias_row=bias_row)),
                 "sigmoid+bias->group-top1/2->topk->gather->renorm->scale, fused")


@pytest.mark.parametrize("group_score", ["top3", "max"])
def test_group_score_not_top2_sum_unfused(group_score):
    _check_fused(_deepseek_with(_deepseek_forward(group_score)), "not fused: the group score", fused=False)


# --- naive MoE code, and the negative grid ---------------------------------------------------------------

T_NAIVE, D_NAIVE = 12, 16


def _naive_check(model, expect_router, loop=False, fused=True):
    """Output, input grad and every parameter grad vs eager, in training and under no_grad; one
    rewrite; the router column; whether sonic::route ran."""
    g = torch.Generator().manual_seed(0)
    x, cot = torch.randn(T_NAIVE, D_NAIVE, generator=g), torch.randn(T_NAIVE, D_NAIVE, generator=g)
    params = dict(model.named_parameters())

    def run(fn):
        xr = x.clone().requires_grad_()
        out = fn(xr)
        grads = torch.autograd.grad((out * cot).sum(), [xr, *params.values()], allow_unused=True)
        return out.detach(), grads

    compiled = torch.compile(model, backend="sonic", options={"sonic.compiler": "aot_eager", "sonic.fallback": False})
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=loop):
        eager = run(model)
        with moe_compiler.capture() as report:
            got = run(compiled)
        with torch.no_grad(), moe_compiler.capture() as inference:
            out = compiled(x)
            names = profiled_op_names(lambda: compiled(x))
    assert len(report.rewritten) == 1 and not report.rejected, str(report)
    assert expect_router in report.rewritten[0].details["router"], str(report)
    assert expect_router in inference.rewritten[0].details["router"], str(inference)
    assert_close_to_eager(got[0], eager[0], what="output")
    assert_close_to_eager(out, eager[0], what="no_grad output")
    for name, a, b in zip(["x", *params], got[1], eager[1]):
        assert (a is None) == (b is None), name
        if a is not None:
            assert_close_to_eager(a, b, what=f"grad {name}")
    assert (ROUTE in names) == fused, sorted(n for n in names if "::" in n)
    return report


def test_naive_loop_router_fused():
    from .naive_models import LoopMoE

    torch.manual_seed(0)
    _naive_check(LoopMoE(), "softmax->topk->renorm, fused", loop=True)


def test_naive_dense_router_fused():
    from .naive_models import DenseMoE

    torch.manual_seed(0)
    _naive_check(DenseMoE(gates="one_hot"), "softmax->topk->renorm, fused")


class RoutedDense(nn.Module):
    """Dense all-experts MoE (one_hot gates) whose router is a knob: `router(self, x) -> (w, ids, extra)`,
    `extra` added to the output (an aux-loss-like read of router intermediates, or 0)."""

    def __init__(self, router, d=D_NAIVE, n=8, E=4, K=2):
        super().__init__()
        from .naive_models import make_experts

        self.gate = nn.Linear(d, E, bias=False)
        self.experts = make_experts("gated", d, n, E)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.per_expert = nn.Parameter(torch.linspace(0.5, 1.5, E))  # Gemma 4's per_expert_scale
        self.register_buffer("bias", torch.linspace(-0.1, 0.1, E))  # a correction bias for the choice
        self.router, self.E, self.K = router, E, K

    def forward(self, x):
        w, ids, extra = self.router(self, x)
        gates = (F.one_hot(ids, self.E) * w.unsqueeze(-1)).sum(1).to(x.dtype)
        outs = torch.stack([expert(x) for expert in self.experts], dim=1)
        return (gates.unsqueeze(-1) * outs).sum(1) + extra


def _softmax_topk(m, x, *, dim=-1, largest=True):
    probs = torch.softmax(m.gate(x), dim=dim)
    w, ids = probs.topk(m.K, dim=-1, largest=largest)
    return probs, w, ids


POSITIVE = {
    # method spellings, dim=1 on 2-D, `/` of a keepdim sum, scale by a Python constant
    "method-dim1-scale": (lambda m, x: (lambda p, w, i: (w / w.sum(1, keepdim=True) * 2.0, i, 0))(
        *_softmax_topk(m, x, dim=1)), "softmax->topk->renorm->scale, fused"),
    "sigmoid-topk": (lambda m, x: (lambda v, i: (v, i, 0))(*torch.topk(torch.sigmoid(m.gate(x)), m.K, dim=-1)),
                     "sigmoid->topk, fused"),
    "float-cast-logits": (lambda m, x: (lambda v, i: (F.softmax(v, dim=-1), i, 0))(
        *m.gate(x).float().topk(m.K, dim=-1)), "topk->softmax, fused"),
    # the logits may be computed any way: a temperature on part of them is the router's input
    "partial-temperature-on-logits": (lambda m, x: (lambda logits: (lambda v, i: (v, i, 0))(
        *torch.topk(torch.cat([logits[:, :2] / 2.0, logits[:, 2:]], -1).softmax(-1), m.K, dim=-1)))(m.gate(x)),
        "softmax->topk, fused"),
    # a cast to the dtype the weights already have, inside the router (LFM2-MoE's `.type_as(logits)`)
    "identity-cast-then-renorm": (lambda m, x: (lambda logits: (lambda v, i: (
        _renorm(v.type_as(logits)), i, 0))(*logits.softmax(-1).topk(m.K, dim=-1)))(m.gate(x)),
        "softmax->topk->renorm, fused"),
    "lfm2-keyword-gather": (lambda m, x: _lfm2_router(m, x), "topk->gather->renorm->scale, fused"),
    # weights times a tensor after the router (Gemma 4: renormalised, then * per_expert_scale[ids]):
    # the router before the product is fused, the product stays on the fused weights and ids
    "per-expert-scale-kept": (lambda m, x: (lambda p, w, i: (_renorm(w) * m.per_expert[i], i, 0))(
        *_softmax_topk(m, x)), "softmax->topk->renorm * per_expert[ids] (kept), fused"),
    "scalar-tensor-scale-kept": (lambda m, x: (lambda p, w, i: (m.scale * w, i, 0))(*_softmax_topk(m, x)),
                                 "softmax->topk * "),
    # ERNIE-4.5: biased choice, unbiased weights, divided by clamp(sum, min); and a clamp_min that
    # binds (the top-2 of 4 sum to 0.5-1) on some tokens
    "ernie-clamp-renorm": (lambda m, x: _ernie_router(m, x, 1e-12), "softmax+bias->topk->gather->renorm, fused"),
    "clamp-min-binding": (lambda m, x: (lambda p, w, i: (w / w.sum(-1, keepdim=True).clamp_min(0.7), i, 0))(
        *_softmax_topk(m, x)), "softmax->topk->renorm, fused"),
}


def _ernie_router(m, x, norm_min):
    probs = F.softmax(m.gate(x), dim=1, dtype=torch.float)
    _, ids = torch.topk(probs + m.bias, m.K, dim=-1)
    w = torch.gather(probs, dim=-1, index=ids)
    return w / torch.clamp(w.sum(dim=-1, keepdim=True), min=norm_min), ids, 0


def _lfm2_router(m, x):
    """LFM2-MoE's router: choose by biased sigmoid scores, gather the unbiased ones by keyword."""
    logits = m.gate(x)
    probs = logits.sigmoid()
    _, ids = torch.topk(probs + m.bias, k=m.K, dim=-1)
    w = torch.gather(probs, dim=1, index=ids).type_as(logits)
    return _renorm(w) * 2.5, ids, 0


def _renorm(w):
    return w / (w.sum(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("case", POSITIVE)
def test_naive_router_spellings_fused(case):
    torch.manual_seed(0)
    router, form = POSITIVE[case]
    _naive_check(RoutedDense(router), form)


def _probs_also_read(m, x):
    probs, w, ids = _softmax_topk(m, x)
    return w, ids, probs.mean() * 0.1  # an aux loss reads the probabilities


def _partial_temperature_on_probs(m, x):
    probs = torch.softmax(m.gate(x), dim=-1)
    probs = torch.cat([probs[:, :2] / 2.0, probs[:, 2:]], -1)  # an op the router op does not compute
    w, ids = probs.topk(m.K, dim=-1)
    return w, ids, 0


NEGATIVE = {
    "probs-used-elsewhere": (_probs_also_read, "is also read outside the router"),
    "largest-false": (lambda m, x: (*_softmax_topk(m, x, largest=False)[1:], 0), "largest=False"),
    "softmax-dim0": (lambda m, x: (*_softmax_topk(m, x, dim=0)[1:], 0), "softmax over dim 0"),
    "renorm-dim0": (lambda m, x: (lambda p, w, i: (w / w.sum(0, keepdim=True), i, 0))(*_softmax_topk(m, x)),
                    "renormalisation sums over dim 0"),
    "renorm-whole-tensor": (lambda m, x: (lambda p, w, i: (w / w.sum(), i, 0))(*_softmax_topk(m, x)),
                            "renormalisation sums over dim None"),
    # a tensor factor that reads the probabilities, or one applied in place: the router stays
    "factor-reads-probs": (lambda m, x: (lambda p, w, i: (w * p.amax(-1, keepdim=True), i, 0))(*_softmax_topk(m, x)),
                           "is also read outside the router"),
    "in-place-tensor-scale": (lambda m, x: (lambda p, w, i: (w.mul_(m.per_expert[i]), i, 0))(*_softmax_topk(m, x)),
                              "scaled by a tensor"),
    "tensor-scale-inside": (lambda m, x: (lambda p, w, i: (_renorm(w * m.per_expert[i]), i, 0))(*_softmax_topk(m, x)),
                            "routing weights come from mul (mul), not a recognised router"),
    "unknown-op-in-chain": (_partial_temperature_on_probs, "not a softmax or sigmoid"),
    # a cast that changes the dtype inside the router: the op computes in one dtype
    "narrowing-cast-then-renorm": (lambda m, x: (lambda p, w, i: (_renorm(w.half()).float(), i, 0))(
        *_softmax_topk(m, x)), "not a recognised router"),
    # a clamp the op does not compute: from above, or by a tensor
    "renorm-clamp-max": (lambda m, x: (lambda p, w, i: (w / w.sum(-1, keepdim=True).clamp(0.1, 0.9), i, 0))(
        *_softmax_topk(m, x)), "clamped from above"),
    "renorm-clamp-tensor": (lambda m, x: (lambda p, w, i: (w / torch.clamp(w.sum(-1, keepdim=True), min=m.scale * 0.4),
                                                           i, 0))(*_softmax_topk(m, x)), "not a number >= 0"),
}


@pytest.mark.parametrize("case", NEGATIVE)
def test_lookalike_routers_stay(case):
    """Each look-alike: the MoE is still rewritten, the router stays, the report says why."""
    torch.manual_seed(0)
    router, reason = NEGATIVE[case]
    report = _naive_check(RoutedDense(router), reason, fused=False)
    assert ", not fused: " in report.rewritten[0].details["router"]


def test_fusion_error_keeps_the_moe_rewrite(monkeypatch):
    """An exception inside the router check (with fallback) leaves the router as it is; the MoE
    rewrite stands and the report names the error."""
    import moe_compiler.passes as passes

    def broken(call, routing=None):
        raise RuntimeError("boom")

    monkeypatch.setattr(passes, "match_router", broken)
    report = _olmoe_step_matches_eager()
    (record,) = report.rewritten
    assert record.details["router"].endswith("not fused: RuntimeError"), str(report)


def test_error_in_the_router_edit_restores_the_whole_graph(monkeypatch):
    """An exception while editing the graph for the router is never half-applied: the driver
    restores the graph as it came (no MoE rewrite either) and the step still runs."""
    import moe_compiler.passes as passes

    def broken(gm, found):
        raise RuntimeError("boom")

    monkeypatch.setattr(passes, "rewrite_router", broken)
    report = _olmoe_step_matches_eager()
    assert not report.rewritten and any("rewrite failed" in r.reason for r in report.records), str(report)


def _olmoe_step_matches_eager():
    """Compile a tiny OLMoE with sonic, check its logits against eager, return the report."""
    model = _tiny("olmoe")
    ids = _ids(model)
    compiled = torch.compile(model, backend="sonic", options={"sonic.compiler": "aot_eager"})
    with moe_compiler.capture() as report:
        got = compiled(ids).logits
    assert_close_to_eager(got, model(ids).logits, what="logits")
    return report
