"""The Triton MoE kernels against the pure-torch twin and the float64 oracle.

CPU: the kernels run under TRITON_INTERPRET=1 (fp32/fp16, tiny shapes; bf16 is broken in the
interpreter). Triton reads the flag when a function is decorated, Triton's own `tl.cdiv`/`tl.sum`
included, i.e. when triton is first imported; in a shared pytest process another module may have
imported it already. So the interpreted tests run in a child pytest process started with the flag
(`test_interpreted_kernels_in_child_process`); in this process they skip, and nothing global changes.
Run them directly, one result per test:  TRITON_INTERPRET=1 pytest -m "not gpu" tests/test_kernels.py

GPU (`@pytest.mark.gpu`): bf16 at moderate shapes through `codegen.ops.moe_experts`, tolerance as
data: err(ours, fp64) <= 2 * err(torch bf16 oracle, fp64) + eps; plus no host sync, CUDA graph
capture, and no recompilation when only T changes.
"""
from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_compiler.codegen.activations import ACTIVATIONS, GATED
from moe_compiler.codegen.reference import torch_moe_experts, torch_moe_experts_fwd, torch_route

from .helpers import nan_filled_buffers, run_interpreted_child

_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # read once: this process is the child
_FLAGS = dict(activation="swiglu", interleaved=False, transposed=False, alpha=1.702, limit=7.0)
# float64-oracle relative error allowed for the interpreted kernels, per dtype. fp32: exact-order
# arithmetic differences only (interpreted fp32 tl.dot is exact). fp16: one fp16 rounding of H, A,
# Y, dH... each ~5e-4 relative, a few of them stacked.
_TOL = {torch.float32: 2e-5, torch.float16: 5e-3}


@pytest.fixture
def tm(monkeypatch):
    """`moe_compiler.codegen` with interpreted kernels (only in a process started with the flag). The
    weight gradients run our kernel unless a test pins another provider (`wgrad_choice`): a choice
    measured on the CPU's timings would make the tests' paths vary from run to run."""
    if not _INTERPRETING:
        pytest.skip("interpreted kernels run in the child process of test_interpreted_kernels_in_child_process")
    from moe_compiler import codegen
    from moe_compiler.codegen import wgrad_choice

    monkeypatch.setattr(wgrad_choice, "PINNED", "triton")

    assert codegen.launch.INTERPRETED, "TRITON_INTERPRET=1 was set but the kernels were compiled"
    return codegen


@pytest.mark.skipif(_INTERPRETING, reason="this is the child process")
def test_interpreted_kernels_in_child_process():
    counts = run_interpreted_child(__file__, timeout=900)
    assert counts.get("passed", 0) >= 20 and counts.get("skipped", 0) == 1, counts  # only the driver skips there


# ------------------------------------------------------------------------------------------- helpers


def _routing(T, E, K, gen, experts=None):
    """Random top-k ids (distinct per token) drawn from `experts` (default all E), and weights."""
    pool = torch.arange(E) if experts is None else torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:K]] for _ in range(T)]) if T else (
        torch.empty(0, K, dtype=torch.long))
    weights = torch.rand(T, K, generator=gen) + 0.1
    return ids, weights


def _make(T, d, n, E, K, dtype, *, activation="swiglu", transposed=False, bias=False, seed=0, experts=None,
          device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    w1_out = 2 * n if GATED[activation] else n
    x = torch.randn(T, d, generator=gen)
    w1 = torch.randn(E, w1_out, d, generator=gen) / d**0.5
    w2 = torch.randn(E, d, n, generator=gen) / n**0.5
    if transposed:
        w1, w2 = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    b1 = torch.randn(E, w1_out, generator=gen) * 0.1 if bias else None
    b2 = torch.randn(E, d, generator=gen) * 0.1 if bias else None
    ids, weights = _routing(T, E, K, gen, experts)
    go = torch.randn(T, d, generator=gen)
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)
    return dict(x=cast(x), topk_ids=ids.to(device), topk_weights=cast(weights), w1=cast(w1), w2=cast(w2),
                b1=cast(b1), b2=cast(b2)), cast(go)


def _oracle(inputs, go, flags):
    """float64 autograd of the simplest loop: (out, grads of x, weights, w1, w2, b1, b2)."""
    leaves = {k: (v.detach().double().requires_grad_() if v is not None and v.is_floating_point() else v)
              for k, v in inputs.items()}
    out = torch_moe_experts(**leaves, **flags)
    names = [k for k in ("x", "topk_weights", "w1", "w2", "b1", "b2") if leaves[k] is not None]
    grads = torch.autograd.grad(out, [leaves[k] for k in names], go.double(), allow_unused=True)
    return out.detach(), dict(zip(names, grads))


def _rel(a, b):
    a, b = a.double(), b.double()
    if b.numel() == 0:
        return 0.0
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _run_ours(tm, inputs, go, flags, save_h=True):
    # slot_token rides in inputs
    out, h, rows, offs = tm.forward.triton_moe_experts_fwd(**inputs, save_h=save_h, **flags)
    grads = tm.backward.triton_moe_experts_bwd(go, **inputs, h=h, sorted_rows=rows, expert_offsets=offs, **flags)
    return (out, h, rows, offs), grads


def _check_against_oracle(tm, inputs, go, flags, tol, save_h=True):
    (out, h, rows, offs), (dx, dw, dw1, dw2, db1, db2) = _run_ours(tm, inputs, go, flags, save_h)
    T, d = inputs["x"].shape
    E = inputs["w1"].shape[0]
    assert out.shape == (T, d) and out.dtype == inputs["x"].dtype
    assert rows.dtype == torch.int32 and offs.dtype == torch.int32 and offs.shape == (E + 1,)
    ref_rows, ref_offs = torch_route(inputs["topk_ids"], E)
    assert torch.equal(rows, ref_rows) and torch.equal(offs, ref_offs)
    if save_h:
        _, ref_h, _, _ = torch_moe_experts_fwd(**inputs, save_h=True, **flags)
        assert h.shape == ref_h.shape
        real = int(offs[-1])  # rows past the experts' are padding (slot form): never read
        assert _rel(h[:real], ref_h[:real]) <= tol
    else:
        assert h.shape[0] == 0
    ref_out, ref_grads = _oracle(inputs, go, flags)
    ours = dict(x=dx, topk_weights=dw, w1=dw1, w2=dw2, b1=db1, b2=db2)
    for t in [out, *[g for g in ours.values() if g is not None]]:
        assert torch.isfinite(t).all()
    assert _rel(out, ref_out) <= tol, _rel(out, ref_out)
    for name, ref in ref_grads.items():
        got = ours[name]
        assert got.shape == inputs[name].shape and got.dtype == inputs[name].dtype, name
        assert _rel(got, ref) <= tol, (name, _rel(got, ref))
    for name in ("b1", "b2"):
        assert (ours[name] is None) == (inputs[name] is None)


# ------------------------------------------------------------------------------- interpreted kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu_matches_oracle(tm, dtype):
    # T*K = 26 rows: not a multiple of the 16-row tile; d, n not multiples of the 16-wide tiles either
    inputs, go = _make(13, 40, 24, 4, 2, dtype)
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[dtype])


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_each_activation_and_layout(tm, activation):
    # cycle the layout flags through the activations so every flag meets a gated one
    i = ACTIVATIONS.index(activation)
    flags = dict(_FLAGS, activation=activation, interleaved=bool(i % 2), transposed=bool(i % 3 == 0), limit=1.0)
    inputs, go = _make(9, 32, 16, 3, 2, torch.float32, activation=activation, transposed=flags["transposed"],
                       bias=bool(i % 2 == 0), seed=i)
    _check_against_oracle(tm, inputs, go, flags, _TOL[torch.float32])


def test_biases_interleaved_transposed_fp16(tm):
    flags = dict(_FLAGS, activation="swiglu_oai", interleaved=True, transposed=True)
    inputs, go = _make(11, 32, 16, 4, 2, torch.float16, activation="swiglu_oai", transposed=True, bias=True)
    _check_against_oracle(tm, inputs, go, flags, _TOL[torch.float16])


def test_two_dot_gate_up_path(tm):
    # the interpreter's single config takes the fused gate/up dot; the autotuner may pick two dots
    saved = tm.launch._up.configs
    tm.launch._up.configs = [tm.launch._cfg("up", 16, 16, 16, 1, 1, fused=False)]
    tm.launch.forget_tuned_launches()
    try:
        for interleaved in (False, True):
            inputs, go = _make(13, 40, 24, 3, 2, torch.float32, bias=True, seed=int(interleaved))
            _check_against_oracle(tm, inputs, go, dict(_FLAGS, interleaved=interleaved), _TOL[torch.float32])
        assert tm.launch._up.best_config.kwargs["FUSED_GU"] is False
    finally:
        tm.launch._up.configs = saved
        tm.launch.forget_tuned_launches()


def test_tuned_launches_skip_the_autotuner(tm, monkeypatch):
    """After a key's first launch the GEMMs launch with the config the autotuner chose, without it;
    a new key goes through it again."""
    tuners = [getattr(tm.launch, name) for name in ("_up", "_scatter", "_dact", "_wgrad")]
    tm.launch.forget_tuned_launches()
    inputs, go = _make(11, 24, 16, 3, 2, torch.float32, seed=3)
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float32])
    entered = []
    for tuner in tuners:
        monkeypatch.setattr(tuner, "run", lambda *a, tuner=tuner, **k: entered.append(tuner) or tuner.fn.run(
            *a, **k, **tuner.configs[0].all_kwargs()))
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float32])  # same keys, another T is fine too
    _check_against_oracle(tm, *_make(29, 24, 16, 3, 2, torch.float32, seed=4), _FLAGS, _TOL[torch.float32])
    assert entered == []
    _check_against_oracle(tm, *_make(11, 40, 16, 3, 2, torch.float32, seed=5), _FLAGS, _TOL[torch.float32])
    assert set(map(id, entered)) == set(map(id, tuners))  # d = 40: every GEMM's key is new


_TMA_TUNERS = ("_up_tma", "_dact_tma", "_up_persistent", "_dact_persistent", "_scatter_tma", "_wgrad_tma")


def _record_calls(tm, monkeypatch):
    """The names of the TMA autotuners that launch from now on (the test's proof the path ran); each
    kernel's first launch of a key goes through its autotuner, so the tuned launches are forgotten."""
    tm.launch.forget_tuned_launches()
    ran = []
    for name in _TMA_TUNERS:
        tuner = getattr(tm.launch, name)

        def run(*args, _name=name, _run=tuner.run, **kwargs):
            ran.append(_name)
            return _run(*args, **kwargs)

        monkeypatch.setattr(tuner, "run", run)
    return ran


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per_tile"])
@pytest.mark.parametrize("layout", ["gated", "plain_bias", "transposed_bias", "one_expert", "empty_experts",
                                    "interleaved", "interleaved_transposed"])
def test_tma_paths_match_oracle(tm, layout, persistent, monkeypatch):
    """fp16 with 16-byte rows: every GEMM reads its stacked weights (and the scatter GEMM and the
    weight gradients their expert-ordered operand) through TMA descriptors, and each TMA kernel is
    seen to run: the up-projection and dA' GEMM as the persistent kernel or one program per tile
    (`PERSISTENT_UP`; a transposed concatenated W1, read in two dots, always the latter). Row counts
    are not tile multiples, so the persistent kernels' tiles run into the next expert and the
    weight gradients take their masked tail chunk."""
    act = "relu2" if layout == "plain_bias" else "swiglu"
    transposed = layout in ("transposed_bias", "interleaved_transposed")
    interleaved = layout.startswith("interleaved")  # one TMA tile holds the alternating gate/up rows
    experts = {"one_expert": [2], "empty_experts": [0, 3]}.get(layout)
    K = 1 if layout == "one_expert" else 2
    inputs, go = _make(21, 40, 24, 4, K, torch.float16, activation=act, transposed=transposed,
                       bias=layout in ("plain_bias", "transposed_bias", "interleaved"), experts=experts)
    monkeypatch.setattr(tm.launch, "PERSISTENT_UP", persistent)
    ran = _record_calls(tm, monkeypatch)
    flags = dict(_FLAGS, activation=act, transposed=transposed, interleaved=interleaved)
    _check_against_oracle(tm, inputs, go, flags, _TOL[torch.float16])
    up = "_up_persistent" if persistent and layout != "transposed_bias" else "_up_tma"
    assert sorted(set(ran)) == sorted({up, "_dact_persistent" if persistent else "_dact_tma", "_scatter_tma",
                                       "_wgrad_tma"})


def test_slot_order_switch(tm, monkeypatch):
    """SCATTER_TILES off (slot order wherever the scatter GEMM runs) gives the same results."""
    monkeypatch.setattr(tm.forward, "SCATTER_TILES", False)
    inputs, go = _make(13, 40, 24, 3, 2, torch.float16)
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float16])


def test_tma_off_for_what_it_cannot_read(tm, monkeypatch):
    """fp32, rows not a multiple of 16 bytes and USE_TMA=False take the pointer kernels, with the
    same results against the oracle."""
    ran = _record_calls(tm, monkeypatch)
    inputs, go = _make(13, 36, 18, 3, 2, torch.float16)  # 72-, 36- and 72-byte rows (d, n, 2n)
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float16])
    inputs, go = _make(13, 40, 24, 3, 2, torch.float32)
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float32])
    assert ran == []
    inputs, go = _make(13, 40, 24, 3, 2, torch.float16)
    monkeypatch.setattr(tm.launch, "USE_TMA", False)
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float16])
    assert ran == []


@pytest.mark.parametrize("bias", [False, True])
def test_up_projection_wide_dot(tm, bias, monkeypatch):
    """A concatenated gated W1 in nn.Linear's orientation goes through the [E, 2, n, d] descriptor
    (one dot on the gate and up tiles, W_DESC 3); transposed, interleaved or WIDE_UP off keep their
    own descriptors. Both ways agree with the oracle and with each other; the gate/up columns past
    n (n not a multiple of the tile) read as zeros within each half."""
    seen = []
    real = tm.launch._up_weight_desc

    def spy(*args):
        desc, kind = real(*args)
        seen.append(kind)
        return desc, kind

    monkeypatch.setattr(tm.forward, "_up_weight_desc", spy)  # where the up-projection looks it up
    monkeypatch.setattr(tm.launch, "WIDE_UP", tm.launch.WIDE_UP)  # restored after the test; set_wide_up switches it
    inputs, go = _make(21, 40, 24, 4, 2, torch.float16, bias=bias)  # n = 24: the second N tile is partial
    outs = {}
    for wide in (True, False):
        tm.launch.set_wide_up(wide)
        _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float16])
        outs[wide] = _run_ours(tm, inputs, go, _FLAGS)[0][0]
    assert seen[0] == 3 and seen[-1] == 1
    assert torch.allclose(outs[True].float(), outs[False].float(), rtol=1e-3, atol=1e-3)
    seen.clear()
    tm.launch.set_wide_up(True)
    transposed, _ = _make(21, 40, 24, 4, 2, torch.float16, transposed=True, seed=1)
    _check_against_oracle(tm, transposed, go, dict(_FLAGS, transposed=True), _TOL[torch.float16])
    _check_against_oracle(tm, inputs, go, dict(_FLAGS, interleaved=True), _TOL[torch.float16])
    assert 3 not in seen and 2 in seen and 1 in seen


def test_empty_experts(tm):
    inputs, go = _make(10, 32, 16, 6, 2, torch.float32, experts=[1, 4])  # experts 0, 2, 3, 5 get no rows
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float32])
    _, (_, _, dw1, dw2, _, _) = _run_ours(tm, inputs, go, _FLAGS)
    empty = [0, 2, 3, 5]
    assert torch.equal(dw1[empty], torch.zeros_like(dw1[empty]))  # written as exact zeros, not left unset
    assert torch.equal(dw2[empty], torch.zeros_like(dw2[empty]))


def test_all_tokens_on_one_expert_k1(tm):
    inputs, go = _make(21, 32, 16, 4, 1, torch.float32, experts=[2])  # 21 rows: two tiles, one partial
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float32])


def test_k_equals_e(tm):
    inputs, go = _make(7, 32, 16, 3, 3, torch.float16)
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float16])


def test_zero_tokens(tm):
    inputs, go = _make(0, 32, 16, 4, 2, torch.float32)
    (out, h, rows, offs), (dx, dw, dw1, dw2, _, _) = _run_ours(tm, inputs, go, _FLAGS)
    assert out.shape == (0, 32) and h.shape == (0, 32) and rows.shape == (0,)
    assert torch.equal(offs, torch.zeros(5, dtype=torch.int32))
    assert dx.shape == (0, 32) and dw.shape == (0, 2)
    assert torch.equal(dw1, torch.zeros_like(dw1)) and torch.equal(dw2, torch.zeros_like(dw2))


def test_non_contiguous_inputs(tm):
    inputs, go = _make(12, 32, 16, 4, 2, torch.float32, seed=3)
    wide = torch.randn(12, 80)
    wide[:, 7:39] = inputs["x"]
    inputs["x"] = wide[:, 7:39]  # row stride 80
    inputs["w1"] = inputs["w1"].transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2n, d] with d-stride 2n
    inputs["w2"] = inputs["w2"].transpose(0, 1).contiguous().transpose(0, 1)  # expert dim not outermost
    inputs["topk_weights"] = inputs["topk_weights"].t().contiguous().t()
    inputs["topk_ids"] = inputs["topk_ids"].t().contiguous().t()
    go = go.t().contiguous().t()
    assert not any(inputs[k].is_contiguous() for k in ("x", "w1", "w2", "topk_weights", "topk_ids"))
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float32])


def test_k1_routing_sliced_from_wider_tensors(tm):
    """K = 1 ids and weights taken as a column of [T, 2] tensors: their flat views are strided
    (reshape(-1) keeps stride 2), which the kernels must not read as contiguous."""
    inputs, go = _make(12, 32, 16, 4, 1, torch.float32, seed=4)
    for name, other in (("topk_ids", torch.zeros_like(inputs["topk_ids"])),
                        ("topk_weights", torch.full_like(inputs["topk_weights"], 7.0))):
        inputs[name] = torch.cat([inputs[name], other], 1)[:, :1]
        assert inputs[name].reshape(-1).stride() == (2,)
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float32])
    slots = dict(inputs, topk_ids=inputs["topk_ids"].reshape(-1), topk_weights=inputs["topk_weights"].reshape(-1),
                 slot_token=torch.stack([torch.arange(12), torch.zeros(12, dtype=torch.long)], 1)[:, 0])
    assert slots["slot_token"].stride() == (2,)
    _check_against_oracle(tm, slots, go, _FLAGS, _TOL[torch.float32])


def _slot_form(inputs, *, drop=(), mode=None, tile=4, seed=0):
    """The [T, K] routing of `inputs` as slots: rounded (`mode`), or flattened with slots `drop` padded."""
    from moe_compiler.codegen.token_rounding import round_routing

    ids, weights = inputs["topk_ids"], inputs["topk_weights"]
    T, K = ids.shape
    if mode is not None:
        E = inputs["w1"].shape[0]
        gen = torch.Generator().manual_seed(seed)
        probs = torch.rand(T, E, generator=gen).to(device=ids.device, dtype=weights.dtype)
        probs.scatter_(1, ids, 1.0 + weights)  # the top-k experts score highest, as a router's would
        slot_ids, slot_w, slot_token = round_routing(probs, ids, weights, tile=tile, mode=mode)
    else:
        slot_ids, slot_w = ids.reshape(-1).clone(), weights.reshape(-1)
        slot_ids[list(drop)] = -1
        slot_token = torch.arange(T * K, device=ids.device) // K
    return dict(inputs, topk_ids=slot_ids, topk_weights=slot_w.contiguous(), slot_token=slot_token)


@pytest.mark.parametrize("mode,dtype", [("up", torch.float32), ("down", torch.float16), ("nearest", torch.float32)])
def test_slot_form_token_rounding(tm, mode, dtype):
    # 29 tokens x 2 over 5 experts, rounded to tiles of 4: every expert moves, some pairs are padding
    inputs, go = _make(29, 32, 16, 5, 2, dtype, bias=mode == "nearest", seed=11)
    slots = _slot_form(inputs, mode=mode)
    assert (slots["topk_ids"] == -1).any() or mode == "down"
    _check_against_oracle(tm, slots, go, _FLAGS, _TOL[dtype])


def _rounding_case(T, E, K, seed, skew=False):
    """Router probabilities with no two equal in a column (fp64 softmax), top-k ids, fp16 weights."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen, dtype=torch.float64) * 3
    if skew:
        logits[:, 0] += 8  # expert 0 takes nearly every token
    probs = logits.softmax(-1).float()
    top, ids = probs.topk(K, dim=-1)
    return probs, ids, (top / top.sum(-1, keepdim=True)).half()


def _assert_rounding_kernels_match_reference(probs, ids, weights, tile, keep):
    """The kernels' slots (ids, weights, tokens) equal the torch reference's, in every mode."""
    from moe_compiler.codegen.token_rounding import (
        MODES,
        _round_routing_triton,
        _slots_of_mask,
        slot_capacity,
        token_rounding,
    )

    for mode in MODES:
        mask, w = token_rounding(probs, ids, weights, tile=tile, mode=mode, keep_every_token=keep)
        want = _slots_of_mask(mask, w, slot_capacity(*probs.shape, ids.shape[1], tile, mode))
        got = _round_routing_triton(probs, ids, weights, tile, mode, keep)
        for name, a, b in zip(("ids", "weights", "tokens"), got, want):
            assert torch.equal(a, b), (mode, name)


# (row chunk, list cap) of the select kernel: the defaults (at these T every expert's candidates are
# listed before the first radix pass), whole-row passes then a list of one chunk, and a list of
# several chunks
_SELECT_SIZES = [None, (16, 8), (8, 32)]


@contextlib.contextmanager
def _select_sizes(sizes):
    # the module (codegen's namespace binds its name to the function token_rounding)
    token_rounding = importlib.import_module("moe_compiler.codegen.token_rounding")
    if sizes is None:
        yield
    else:
        with mock.patch.multiple(token_rounding, _SELECT_BLOCK=sizes[0], _SELECT_CAP=sizes[1]):
            yield


@pytest.fixture(params=_SELECT_SIZES, ids=["default-select", "row-passes", "long-list"])
def select_sizes(request):
    with _select_sizes(request.param):
        yield


@pytest.mark.parametrize("T,E,K,tile,skew", [(37, 5, 2, 4, False), (300, 8, 2, 16, False), (64, 3, 3, 8, True),
                                             (129, 6, 1, 32, False), (150, 7, 7, 8, False), (1, 4, 1, 4, False)])
@pytest.mark.parametrize("keep", [True, False])
def test_rounding_kernels_match_reference(tm, select_sizes, T, E, K, tile, skew, keep):
    """The Triton rounding (CUDA's path) picks the same pairs and weights as the torch reference;
    K=1 with 32-row tiles and the skewed case make orphans that keep_every_token keeps."""
    _assert_rounding_kernels_match_reference(*_rounding_case(T, E, K, seed=T + E), tile, keep)


@pytest.mark.skipif(not _INTERPRETING, reason="interpreted kernels run in the child process")
@settings(max_examples=15)
@given(T=st.integers(1, 150), E=st.integers(2, 10), K=st.integers(1, 10), tile=st.sampled_from([2, 4, 8, 16, 32]),
       seed=st.integers(0, 2**16), skew=st.booleans(), keep=st.booleans(), select=st.sampled_from(_SELECT_SIZES))
def test_rounding_kernels_match_reference_anywhere(T, E, K, tile, seed, skew, keep, select):
    """Random shapes, tiles, skews and select-kernel sizes."""
    with _select_sizes(select):
        _assert_rounding_kernels_match_reference(*_rounding_case(T, E, min(K, E), seed=seed, skew=skew), tile, keep)


def test_rounding_kernels_layouts_ties_and_no_tokens(tm, select_sizes):
    from moe_compiler.codegen.token_rounding import _round_routing_triton, round_token_counts

    probs, ids, weights = _rounding_case(90, 6, 2, seed=3)
    want = _round_routing_triton(probs, ids, weights, 8, "nearest", True)
    strided = _round_routing_triton(probs.t().contiguous().t(), ids.int(), weights.t().contiguous().t(), 8,
                                    "nearest", True)  # column-major probs and weights, int32 ids
    assert all(torch.equal(a, b) for a, b in zip(strided, want))
    # all probabilities equal: ties go to the lower token, so each expert drops its first members
    T, E, tile = 45, 4, 4
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:2] for t in range(T)])
    flat = torch.full((T, E), 1.0 / E)
    slot_ids, _, slot_token = _round_routing_triton(flat, ids, torch.full((T, 2), 0.5), tile, "down", False)
    counts = torch.zeros(T, E, dtype=torch.bool).scatter_(1, ids, True)
    for e in range(E):
        members = counts[:, e].nonzero()[:, 0]
        kept = slot_token[slot_ids == e].long()
        n_keep = int(round_token_counts(counts[:, e].sum()[None], tile, "down", T))
        assert torch.equal(kept, members[len(members) - n_keep:]), e
    empty = _round_routing_triton(torch.empty(0, 4), torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2), 4,
                                  "up", True)
    assert [t.numel() for t in empty] == [0, 0, 0]


def test_slot_form_padding_anywhere(tm):
    # padding inside a token's slots, and token 3 with no expert at all (its output and dx are 0)
    inputs, go = _make(9, 32, 16, 4, 2, torch.float32, bias=True, seed=2)
    slots = _slot_form(inputs, drop=(1, 6, 7, 12))
    _check_against_oracle(tm, slots, go, _FLAGS, _TOL[torch.float32])
    (out, *_), (dx, dw, *_) = _run_ours(tm, slots, go, _FLAGS)
    assert torch.equal(out[3], torch.zeros_like(out[3])) and torch.equal(dx[3], torch.zeros_like(dx[3]))
    assert torch.equal(dw[[1, 6, 7, 12]], torch.zeros(4))


def test_slot_form_padding_rows_of_dh_and_a_are_zeros(tm):
    """dH and A' (expert order) hold zeros on the slot form's padding rows, past offsets[E], where
    the kernels' buffers start as NaN: the weight-gradient kernels reduce over boxes of expert-ordered
    rows, and a box that runs past the last expert's rows (the Gluon kernel's, for an expert with
    fewer rows than a box) must read zeros there, never unwritten memory (0 * NaN is NaN)."""
    inputs, go = _make(9, 32, 16, 4, 2, torch.float32, seed=3)
    slots = _slot_form(inputs, drop=(0, 5, 6, 11, 17))
    E, n = inputs["w1"].shape[0], inputs["w2"].shape[2]
    _, h, rows, offs = tm.forward.triton_moe_experts_fwd(**slots, save_h=True, **_FLAGS)
    real = int(offs[E])
    assert real < rows.numel(), "the routing has padding rows"
    h[real:] = float("nan")  # the forward leaves them unwritten
    W2 = tm.launch._stacked_banks(slots["w1"], slots["w2"], False)[1]
    row_token = tm.routing._row_token(slots["slot_token"], rows)
    with nan_filled_buffers():
        dh, a_scaled, _ = tm.backward.triton_moe_dact(go, W2, h, slots["topk_weights"], rows, offs, n=n, top_k=1,
                                                      row_token=row_token, **_FLAGS)
    assert dh[:real].isfinite().all() and a_scaled[:real].isfinite().all()
    assert torch.equal(dh[real:], torch.zeros_like(dh[real:])), "dH's padding rows"
    assert torch.equal(a_scaled[real:], torch.zeros_like(a_scaled[real:])), "A''s padding rows"


@pytest.mark.parametrize("form", ["topk", "slots"])
def test_router_weight_grad_stored_in_its_dtype(tm, form):
    """The activation-gradient pass sums dS in float32 and stores it in the dtype asked for (the
    router weights', where no bias term is added after): equal to the float32 dS rounded once, as a
    cast after it gave; the slot form's padding slots 0 (they are not written, so the buffer starts
    at 0 there, and only there)."""
    inputs, go = _make(9, 32, 16, 4, 2, torch.float16, seed=3)
    if form == "slots":
        inputs = _slot_form(inputs, drop=(1, 6, 7))
    _, h, rows, offs = tm.forward.triton_moe_experts_fwd(**inputs, save_h=True, **_FLAGS)
    r = tm.backward._bwd_routing(inputs["x"], inputs["topk_ids"], inputs["topk_weights"], rows, offs,
                                 inputs.get("slot_token"))
    _, W2 = tm.launch._stacked_banks(inputs["w1"], inputs["w2"], False)
    ds = {dtype: tm.backward.triton_moe_dact(go, W2, h, r.topk_weights.reshape(-1), n=16, ds_dtype=dtype,
                                             **r.kernel_args, **_FLAGS)[2] for dtype in (torch.float16, torch.float32)}
    assert ds[torch.float16].dtype == torch.float16 and ds[torch.float32].dtype == torch.float32
    assert torch.equal(ds[torch.float16], ds[torch.float32].to(torch.float16))
    if form == "slots":
        assert torch.equal(ds[torch.float32][[1, 6, 7]], torch.zeros(3))
    assert bool((ds[torch.float32] != 0).sum() >= ds[torch.float32].numel() - 3)


@pytest.mark.parametrize("bad", ["unsorted", "out_of_range"])
def test_slot_form_bad_tokens_raise(tm, bad):
    """The kernels rely on sorted, in-range slot tokens: a device-side assert, never a wrong answer."""
    inputs, _ = _make(6, 32, 16, 4, 2, torch.float32)
    slots = _slot_form(inputs, drop=())
    tok = slots["slot_token"].clone()
    if bad == "unsorted":
        tok[[2, 9]] = tok[[9, 2]]
    else:
        tok[-1] = 6  # a real slot pointing past the last token
    with pytest.raises(RuntimeError, match="slot_token must be nondecreasing"):
        tm.forward.triton_moe_experts_fwd(**dict(slots, slot_token=tok), save_h=True, **_FLAGS)


def test_slot_check_kernel_equals_reference(tm):
    """The one-launch check of the slot form's tokens agrees with `slot_tokens_ok` on valid and bad
    tokens, across the kernel's 1024-slot blocks (one program each; a fault in any block, the
    first, a middle or the last, clears the flag)."""
    from moe_compiler.codegen.kernels.routing import _slot_check_kernel
    from moe_compiler.codegen.reference import PAD, slot_tokens_ok

    T, S = 700, 2500
    ids = torch.randint(0, 8, (S,))
    ids[-40:] = PAD
    tok = torch.sort(torch.randint(0, T, (S,))).values
    tok[-40:] = T  # padding may carry T
    cases = {"valid": (ids, tok)}
    for name, where, value in [("unsorted at a block edge", 1024, 0), ("unsorted in a middle block", 1500, 0),
                               ("negative", 0, -1), ("real past T", S - 41, T), ("padding past T", S - 1, T + 5)]:
        bad = tok.clone()
        bad[where] = value
        cases[name] = (ids, bad)
    for name, (i, t) in cases.items():
        ok = torch.ones(1, dtype=torch.int32)
        _slot_check_kernel[(3,)](i, t, ok, S, T, PAD=PAD, BLOCK=1024)
        assert bool(ok[0]) == bool(slot_tokens_ok(i, t, T)), name
    assert not bool(slot_tokens_ok(*cases["negative"], T)) and bool(slot_tokens_ok(*cases["padding past T"], T))


def test_backward_recomputes_h_without_save_h(tm):
    inputs, go = _make(9, 32, 16, 4, 2, torch.float32, bias=True, seed=5)
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float32], save_h=False)


@pytest.fixture
def decode_everywhere(tm, monkeypatch):
    """Every forward without save_h takes the decode path (`tm.decode.decode_path`'s limits lifted);
    yields the list its calls are appended to."""
    monkeypatch.setattr(tm.decode, "DECODE_MAX_SLOTS", 10**6)
    monkeypatch.setattr(tm.decode, "DECODE_SLOTS_PER_EXPERT", float("inf"))
    calls, decode = [], tm.decode.triton_moe_decode
    # patched where the forward looks it up
    monkeypatch.setattr(tm.forward, "triton_moe_decode", lambda *a, **k: calls.append(a[0].shape) or decode(*a, **k))
    return calls


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_decode_path_matches_oracle(tm, decode_everywhere, activation):
    """The two-launch forward (no H kept) against the oracle, every activation, the layout flags and
    biases cycled through them, fp32 and fp16, slots sharing experts; the op still returns the
    routing, and the backward that recomputes H from it is right too."""
    i = ACTIVATIONS.index(activation)
    dtype = (torch.float32, torch.float16)[i % 2]
    flags = dict(_FLAGS, activation=activation, interleaved=bool(i % 2), transposed=bool(i % 3 == 0), limit=1.0)
    inputs, go = _make(7, 40, 24, 5, 3, dtype, activation=activation, transposed=flags["transposed"],
                       bias=bool(i % 2 == 0), seed=i)
    _check_against_oracle(tm, inputs, go, flags, _TOL[dtype], save_h=False)
    assert decode_everywhere == [(7, 40)]


def test_decode_path_strided_inputs_and_k1(tm, decode_everywhere):
    """x a column slice of a wider tensor, weights a column of a wider one (K = 1), W1 transposed
    in memory but not in its layout (strides, not a copy)."""
    inputs, go = _make(5, 32, 16, 4, 2, torch.float32, seed=3)
    wide = torch.randn(5, 48)
    wide[:, 8:40] = inputs["x"]
    inputs["x"] = wide[:, 8:40]
    inputs["w1"] = inputs["w1"].transpose(1, 2).contiguous().transpose(1, 2)
    inputs["topk_ids"], inputs["topk_weights"] = inputs["topk_ids"][:, :1], inputs["topk_weights"][:, 1:]
    _check_against_oracle(tm, inputs, go[:, :], _FLAGS, _TOL[torch.float32], save_h=False)
    assert len(decode_everywhere) == 1


@pytest.mark.parametrize("T,E,K,experts", [(9, 130, 3, [0, 1, 129]), (1, 3, 1, None), (21, 70, 3, [5, 6, 7, 69])])
def test_decode_path_ranks_like_route(tm, decode_everywhere, T, E, K, experts):
    """The routing the decode path returns (ranked in its first launch) is `torch_route`'s: slots
    piled on a few experts, ties in slot order, offsets across several BLOCK_E chunks of experts."""
    inputs, go = _make(T, 16, 8, E, K, torch.float32, experts=experts, seed=T)
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float32], save_h=False)
    assert len(decode_everywhere) == 1


@pytest.mark.parametrize("bad_id", [-1, 4])
def test_decode_path_bad_ids_fail(tm, decode_everywhere, monkeypatch, bad_id):
    """An id out of [0, E): IndexError up front on the CPU; and the kernel's own check, which is what
    runs on the GPU (clamped reads, then the device assert on its flag), fails too without it."""
    inputs, _ = _make(3, 16, 8, 4, 2, torch.float32, seed=1)
    inputs["topk_ids"][1, 0] = bad_id
    with pytest.raises(IndexError, match="out of range"):
        tm.forward.triton_moe_experts_fwd(**inputs, save_h=False, **_FLAGS)
    monkeypatch.setattr(tm.decode, "_check_ids_on_cpu", lambda ids, E: None)  # the decode path's own check
    with pytest.raises(RuntimeError, match="out of range"):
        tm.forward.triton_moe_experts_fwd(**inputs, save_h=False, **_FLAGS)
    assert len(decode_everywhere) == 2


def test_decode_path_rule(tm):
    """Few slots next to the experts, no H kept, [T, K] routing: only then."""
    assert tm.decode.decode_path(32, 128, False, None)
    assert not tm.decode.decode_path(32, 128, True, None)  # a backward will read H: the grouped path stores it
    assert not tm.decode.decode_path(32, 128, False, torch.zeros(32))  # the slot form (token rounding)
    assert not tm.decode.decode_path(0, 128, False, None)
    assert not tm.decode.decode_path(tm.decode.DECODE_MAX_SLOTS + 1, 10**6, False, None)
    assert tm.decode.decode_path(4, 8, False, None) and not tm.decode.decode_path(5, 8, False, None)  # slots <= E / 2


@pytest.mark.parametrize("order", list(itertools.permutations(("dw2", "dw1", "dx"))), ids="-".join)
def test_every_backward_order_matches_oracle(tm, order, monkeypatch):
    # the backward runs its weight gradients and dX~ in the order `backward_order` picks per shape:
    # every order must give the same gradients, with biases (both bias gradients) and torch's grouped
    # GEMM for the weight gradients too (its copy of the gathered operand)
    monkeypatch.setattr(tm.backward, "backward_order",
                        lambda **sizes: (order, tm.backward.backward_peak(order, **sizes)))
    inputs, go = _make(13, 32, 16, 4, 2, torch.float32, bias=True, seed=11)
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float32])
    from moe_compiler.codegen import wgrad_choice

    monkeypatch.setattr(wgrad_choice, "PINNED", "grouped_mm")
    inputs, go = _make(13, 32, 16, 4, 2, torch.float32, seed=12)
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float32])


@pytest.mark.parametrize("case", ["plain_fp32", "bias_transposed_fp16", "slot_form"])
def test_backward_parts_equal_the_one_op(tm, case):
    # the four parts `moe_compiler.grad_fold` splits the backward into (act, dW2, dW1, dX) give the
    # one op's gradients bit for bit; dX with a product term gets L @ R added before its rounding
    dtype = torch.float16 if "fp16" in case else torch.float32
    inputs, go = _make(21, 40, 16, 5, 2, dtype, bias="bias" in case, transposed="transposed" in case, seed=3)
    flags = dict(_FLAGS, transposed="transposed" in case)
    if case == "slot_form":
        inputs = _slot_form(inputs, mode="up")
    _, h, rows, offs = tm.forward.triton_moe_experts_fwd(**inputs, save_h=True, **flags)
    whole = tm.backward.triton_moe_experts_bwd(go, **inputs, h=h, sorted_rows=rows, expert_offsets=offs, **flags)
    part = lambda name, **kw: tm.backward.triton_moe_experts_bwd_part(name, **inputs, sorted_rows=rows,  # noqa: E731
                                                                      expert_offsets=offs, **flags, **kw)
    dh, a_scaled, ds = part("act", grad_out=go, h=h)
    (dw2, db2), (dw1, db1) = part("dw2", grad_out=go, a_scaled=a_scaled), part("dw1", dh=dh)
    dx = part("dx", dh=dh)
    for got, want in zip((dx, ds, dw1, dw2, db1, db2), whole):
        assert (got is None and want is None) or torch.equal(got, want)
    gen = torch.Generator().manual_seed(4)
    lhs = torch.randn(21, 19, generator=gen).to(dtype)
    rhs = torch.randn(40, 19, generator=gen).to(dtype).t()  # strided, as a weight's transpose is
    folded = part("dx", dh=dh, product=(lhs, rhs))
    want = dx.double() + lhs.double() @ rhs.double()
    assert folded.dtype == dtype and _rel(folded, want) <= _TOL[dtype], _rel(folded, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slots", [False, True])
@pytest.mark.parametrize("launch", [None, (16, 16, 16, 4, 1, False), (16, 32, 32, 4, 0, True)],
                         ids=["default", "walking-programs-chunked-R", "resident-R"])
@pytest.mark.parametrize("K", [1, 3, 8])
def test_gather_sum_with_a_product_term(tm, dtype, slots, launch, K):
    # out[t] = sum of token t's rows + L[t] @ R, T, d and J none a multiple of the blocks; programs
    # that walk several token blocks, R in chunks or resident, the dot before or after the rows;
    # K rows a token that fill the [K_POW2 * BLOCK_T] row tile, leave half of it padding, or one row
    T, d, J = 37, 40, 23
    gen = torch.Generator().manual_seed(9)
    y = torch.randn(T * K, d, generator=gen).to(dtype)
    lhs, rhs = torch.randn(T, J, generator=gen).to(dtype), torch.randn(J, d, generator=gen).to(dtype)
    ids = torch.zeros(T * K, dtype=torch.int64)
    arg = None
    if slots:  # the slot form: every 4th slot is padding and adds nothing
        ids[::4] = -1
        arg = (ids, tm.routing.token_offsets(torch.arange(T * K) // K, T))
    launch = None if launch is None else tm.forward.ProductLaunch(*launch)
    got = tm.forward.triton_moe_gather_sum(y, None, T, K, dtype, arg, product=(lhs, rhs), product_launch=launch)
    rows = torch.where((ids >= 0)[:, None], y.double(), 0.0).view(T, K, d).sum(1)
    want = rows + lhs.double() @ rhs.double()
    assert got.dtype == dtype and _rel(got, want) <= _TOL[dtype], _rel(got, want)
    with pytest.raises(ValueError, match="do not make"):
        tm.forward.triton_moe_gather_sum(y, None, T, K, dtype, arg, product=(lhs, rhs.float() if dtype != torch.float32
                                                                             else rhs.half()))


def _tile_rows_brute(sorted_rows, offsets, block_m):
    """Each slot's row in TILE order, by walking the experts (-1: padding slots past offsets[E])."""
    want = torch.full((sorted_rows.numel(),), -1, dtype=torch.int32)
    tiles_before = 0
    for e in range(offsets.numel() - 1):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        for r in range(lo, hi):
            want[int(sorted_rows[r])] = tiles_before * block_m + r - lo
        tiles_before += -(-(hi - lo) // block_m)
    return want


@pytest.mark.parametrize("E,TK,padded,block_m", [(5, 37, False, 16), (6, 0, False, 16), (64, 300, True, 16),
                                                 (3, 1100, False, 128), (200, 1024, True, 128)])
def test_tile_row_map_matches_brute_force(tm, E, TK, padded, block_m):
    """`gluon_scatter.slot_rows_in_tiles` (the oracle of the map the Gluon scatter GEMM writes):
    every slot's row of a TILE-order output (each expert's rows in whole tiles, empty experts
    taking none), -1 for the slot form's padding slots; uneven and empty experts."""
    from moe_compiler.codegen.kernels.gluon_scatter import slot_rows_in_tiles

    gen = torch.Generator().manual_seed(E + TK)
    ids = torch.multinomial(torch.rand(E, generator=gen) ** 4, TK, replacement=True, generator=gen) if TK else (
        torch.empty(0, dtype=torch.int64))
    if padded:
        ids[torch.rand(TK, generator=gen) < 0.3] = -1
    rows, offs = tm.routing.route(ids.view(-1, 1), E, padded=padded)
    got = slot_rows_in_tiles(rows, offs, block_m)
    assert got.dtype == torch.int32 and torch.equal(got, _tile_rows_brute(rows, offs, block_m))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", ["weights", "slots", "product", "product-slots", "product-walking"])
def test_gather_sum_through_a_row_map(tm, dtype, form):
    """The gather-sums read slot s's row at y[row_map[s]] (a TILE-order y) bit-equal to reading a
    slot-order y; every row no slot maps to holds NaN, so a wrong row shows. The product forms: the
    rows through the map tile a program loads one token block ahead (K = 3, not a power of two),
    also in programs that walk several blocks with the dot after the rows, and the slot form's."""
    from moe_compiler.codegen.kernels.gluon_scatter import slot_rows_in_tiles
    T, K, d, E = 37, 3, 40, 5
    gen = torch.Generator().manual_seed(11)
    y = torch.randn(T * K, d, generator=gen).to(dtype)
    ids = torch.randint(0, E, (T * K,), generator=gen)
    arg, s, product = None, torch.rand(T * K, generator=gen).to(dtype), None
    if form in ("slots", "product-slots"):  # every 4th slot is padding, never written or read
        ids[::4] = -1
        arg = (ids, tm.routing.token_offsets(torch.arange(T * K) // K, T))
    if form.startswith("product"):
        s, product = None, (torch.randn(T, 7, generator=gen).to(dtype), torch.randn(7, d, generator=gen).to(dtype))
    launch = tm.forward.ProductLaunch(16, 16, 16, 4, 1, False) if form == "product-walking" else None
    rows, offs = tm.routing.route(ids.view(-1, 1), E, padded=arg is not None)
    row_map = slot_rows_in_tiles(rows, offs, 16)
    y_tiles = torch.full(((T * K // 16 + E + 1) * 16, d), float("nan"), dtype=dtype)
    live = row_map >= 0
    y_tiles[row_map[live].long()] = y[live]
    want = tm.forward.triton_moe_gather_sum(y, s, T, K, dtype, arg, product=product, product_launch=launch)
    got = tm.forward.triton_moe_gather_sum(y_tiles, s, T, K, dtype, arg, product=product, row_map=row_map,
                                           product_launch=launch)
    assert torch.equal(got, want)


def test_deterministic(tm):
    inputs, go = _make(15, 32, 16, 4, 3, torch.float32, seed=7)
    first = _run_ours(tm, inputs, go, _FLAGS)
    second = _run_ours(tm, inputs, go, _FLAGS)
    for a, b in zip([*first[0], *first[1]], [*second[0], *second[1]]):
        assert (a is None and b is None) or torch.equal(a, b)


def test_out_of_range_expert_id_raises(tm):
    inputs, _ = _make(4, 32, 16, 4, 2, torch.float32)
    inputs["topk_ids"][1, 0] = 4
    with pytest.raises((RuntimeError, IndexError)):
        tm.forward.triton_moe_experts_fwd(**inputs, save_h=True, **_FLAGS)
    ids = torch.zeros(9000, 1, dtype=torch.long)  # the pieces path
    for bad in (64, -1):
        ids[4321] = bad
        with pytest.raises(IndexError):
            tm.routing.route(ids, 64)


@pytest.mark.parametrize("E,TK", [(1, 5), (6, 0), (6, 37), (64, 300), (200, 1024), (256, 1024), (256, 1025),
                                  (64, 9000), (128, 4096), (512, 3000), (1, 140000), (600, 700)])
@pytest.mark.parametrize("padded", [False, True])
def test_route_matches_torch_route(tm, E, TK, padded):
    """The three routing paths (one program up to 2**18 slot x bucket pairs; beyond, pieces of the
    slots in three launches up to 511 experts, else the torch sort) give the reference's stable
    order and offsets; padding slots (-1) sort last, uncounted."""
    gen = torch.Generator().manual_seed(E * 1000 + TK)
    ids = torch.randint(0, E, (TK,), generator=gen)
    if padded:
        ids[torch.rand(TK, generator=gen) < 0.3] = -1
    rows, offs = tm.routing.route(ids.view(-1, 1), E, padded=padded)
    ref_rows, ref_offs = torch_route(ids.view(-1, 1), E)
    assert rows.dtype == offs.dtype == torch.int32
    assert torch.equal(rows, ref_rows) and torch.equal(offs, ref_offs)


@pytest.mark.parametrize("E,TK,padded", [(300, 1100, True), (128, 2500, False)])
def test_route_pieces_rank_by_sort(tm, E, TK, padded, monkeypatch):
    """The piece kernels' placement as the GPU runs it (each piece sorted by bucket, `tl.sort`),
    which the other interpreted tests replace by one-hot ranks (the interpreter's sort is slow):
    a few pieces, uneven buckets, padding, the last piece partial."""
    monkeypatch.setattr(tm.routing, "ROUTE_BY_SORT", True)
    gen = torch.Generator().manual_seed(E + TK)
    ids = torch.multinomial(torch.rand(E, generator=gen) ** 4, TK, replacement=True, generator=gen)
    if padded:
        ids[torch.rand(TK, generator=gen) < 0.3] = -1
    buckets = max(2, 1 << (E + padded - 1).bit_length())
    chunk = tm.routing._route_chunk(TK, buckets)
    assert TK * buckets > tm.routing._SMALL_ROUTE_WORK and TK % chunk and TK > chunk
    rows, offs = tm.routing.route(ids.view(-1, 1), E, padded=padded)
    ref_rows, ref_offs = torch_route(ids.view(-1, 1), E)
    assert torch.equal(rows, ref_rows) and torch.equal(offs, ref_offs)


def test_small_route_block_rule(tm):
    """Where `route` runs the one-program kernel: on the GPU beside the piece kernels only for slots
    that fit one tile of <= 64 (a longer walk loses to the three piece launches); against the torch
    sort (> 512 buckets) and in the interpreter, up to _SMALL_ROUTE_WORK slot x bucket pairs."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    small = tm.routing._small_route_block
    assert small(16384, 8, cuda) is None and small(65, 128, cuda) is None
    assert small(4, 8, cuda) == small(64, 128, cuda) == 64
    assert small(32, 256, cuda) == 32 and small(33, 256, cuda) is None
    assert small(0, 64, cuda) == 64
    assert small(256, 1024, cuda) == 16 and small(257, 1024, cuda) is None
    assert small(16384, 8, cpu) == 1024 and small(32769, 8, cpu) is None


def test_supports_predicate(tm):
    inputs, _ = _make(4, 32, 16, 4, 2, torch.float32)
    assert tm.launch.supports(**inputs, **_FLAGS)
    assert not tm.launch.supports(**dict(inputs, x=inputs["x"].double()), **_FLAGS)
    assert not tm.launch.supports(**dict(inputs, w1=inputs["w1"].half()), **_FLAGS)
    assert not tm.launch.supports(**inputs, **dict(_FLAGS, activation="tanh"))


def test_pinned_config_parsing(tm):
    pinned = tm.launch._parse_pinned("up:128x64x32:4:3; *:64x64x64:4:2")
    assert pinned["up"] == (64, 64, 64, 4, 2)  # later entries win
    assert pinned["wgrad"] == (64, 64, 64, 4, 2)
    assert tm.launch._parse_pinned("dact:128x128x64:8:3") == {"dact": (128, 128, 64, 8, 3)}
    with pytest.raises(ValueError):
        tm.launch._parse_pinned("up:128x64:4:3")
    with pytest.raises(ValueError):
        tm.launch._parse_pinned("gemm:128x64x64:4:3")


def _as_lists(inputs, layout, seed=0):
    """Per-expert tensors (separate allocations, in shuffled order so some offsets are negative) holding
    the stacked weights of `inputs`; layout: separate (gate/up tensors), fused, interleaved, plain."""
    w1, w2 = inputs["w1"], inputs["w2"]
    E, n = w1.shape[0], w2.shape[2]
    order = torch.randperm(E, generator=torch.Generator().manual_seed(seed)).tolist()

    def split(parts):
        made = {e: parts(e).clone() for e in order}
        return [made[e] for e in range(E)]

    if layout == "separate":
        gate, up = split(lambda e: w1[e, :n]), split(lambda e: w1[e, n:])
    else:
        gate, up = split(lambda e: w1[e]), []
    return gate, up, split(lambda e: w2[e])


_LIST_LAYOUTS = {  # layout -> (activation, interleaved)
    "separate": ("swiglu", False),
    "fused": ("geglu", False),
    "interleaved": ("swiglu", True),
    "plain": ("relu2", False),
}


@pytest.mark.parametrize("layout,bias", [(layout, False) for layout in _LIST_LAYOUTS] + [("separate", True), ("plain", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_list_form_equals_stacked(tm, layout, bias, dtype, monkeypatch):
    """Per-expert tensors read through the offset table give exactly the stacked kernels' results,
    with the stacked biases of Linear experts too. The list form reads its weights by pointer loads,
    so the stacked run it is compared with bit for bit does too: in fp16 the stacked weights would
    otherwise take the TMA kernels, whose dots round one H element in 1248 differently in the
    interpreter (Triton 3.9, numpy 2.4); `test_tma_paths_match_oracle` checks those."""
    activation, interleaved = _LIST_LAYOUTS[layout]
    flags = dict(_FLAGS, activation=activation, interleaved=interleaved)
    inputs, go = _make(13, 40, 24, 4, 2, dtype, activation=activation, bias=bias, seed=5)
    gate, up, down = _as_lists(inputs, layout)
    routing = (inputs["x"], inputs["topk_ids"], inputs["topk_weights"])
    biases = (inputs["b1"], inputs["b2"])
    list_flags = {k: v for k, v in flags.items() if k != "transposed"}
    banks = tm.launch.list_banks(*routing, gate, up, down, *biases, **list_flags)
    assert banks is not None
    out, h, rows, offs = tm.forward.triton_moe_experts_list_fwd(*routing, gate, up, down, *biases, banks=banks,
                                                                save_h=True, **list_flags)
    grads = tm.backward.triton_moe_experts_list_bwd(go, *routing, gate, up, down, *biases, h, rows, offs, banks=banks,
                                                    **list_flags)
    with monkeypatch.context() as pointer_loads:
        pointer_loads.setattr(tm.launch, "USE_TMA", False)
        (want_out, want_h, _, _), want_grads = _run_ours(tm, inputs, go, flags)
    assert (grads[4] is None, grads[5] is None) == (not bias, not bias)
    for got, want in ((out, want_out), (h, want_h), *zip(grads, want_grads)):
        assert (got is None and want is None) or torch.equal(got, want)
    _check_against_oracle(tm, inputs, go, flags, _TOL[dtype])  # and the stacked run is right


@pytest.mark.parametrize("layout,bias", [("separate", False), ("plain", False), ("separate", True)])
def test_list_form_backward_parts_equal_the_one_op(tm, layout, bias):
    # the list form's four parts (`moe_compiler.grad_fold`'s split) give its one op's gradients bit
    # for bit, bias gradients included; its dX takes a product term as the stacked dX does
    activation, interleaved = _LIST_LAYOUTS[layout]
    list_flags = dict(activation=activation, interleaved=interleaved, alpha=_FLAGS["alpha"], limit=_FLAGS["limit"])
    inputs, go = _make(13, 40, 24, 4, 2, torch.float16, activation=activation, bias=bias, seed=6)
    lists = (*_as_lists(inputs, layout), inputs["b1"], inputs["b2"])
    routing = (inputs["x"], inputs["topk_ids"], inputs["topk_weights"])
    banks = tm.launch.list_banks(*routing, *lists, **list_flags)
    _, h, rows, offs = tm.forward.triton_moe_experts_list_fwd(*routing, *lists, banks=banks, save_h=True, **list_flags)
    whole = tm.backward.triton_moe_experts_list_bwd(go, *routing, *lists, h, rows, offs, banks=banks, **list_flags)
    part = lambda name, **kw: tm.backward.triton_moe_experts_list_bwd_part(  # noqa: E731
        name, *routing, *lists, rows, offs, banks=banks, **list_flags, **kw)
    dh, a_scaled, ds = part("act", grad_out=go, h=h)
    (dw1, db1), (dw2, db2) = part("dw1", dh=dh), part("dw2", grad_out=go, a_scaled=a_scaled)
    got = (part("dx", dh=dh), ds, dw1, dw2, db1, db2)
    assert (db1 is None, db2 is None) == (not bias, not bias)
    for g, want in zip(got, whole, strict=True):
        assert (g is None and want is None) or torch.equal(g, want)
    gen = torch.Generator().manual_seed(7)
    lhs, rhs = torch.randn(13, 5, generator=gen).half(), torch.randn(5, 40, generator=gen).half()
    folded = part("dx", dh=dh, product=(lhs, rhs))
    want = got[0].double() + lhs.double() @ rhs.double()
    assert _rel(folded, want) <= _TOL[torch.float16], _rel(folded, want)


@pytest.mark.parametrize("layout,bias", [(layout, False) for layout in _LIST_LAYOUTS] + [("separate", True)])
def test_decode_path_list_form(tm, decode_everywhere, layout, bias):
    """Per-expert tensors (the offset tables) through the decode path, against the oracle."""
    activation, interleaved = _LIST_LAYOUTS[layout]
    flags = dict(_FLAGS, activation=activation, interleaved=interleaved)
    inputs, go = _make(6, 40, 24, 4, 2, torch.float32, activation=activation, bias=bias, seed=7)
    gate, up, down = _as_lists(inputs, layout)
    routing = (inputs["x"], inputs["topk_ids"], inputs["topk_weights"])
    list_flags = {k: v for k, v in flags.items() if k != "transposed"}
    banks = tm.launch.list_banks(*routing, gate, up, down, inputs["b1"], inputs["b2"], **list_flags)
    out, h, rows, offs = tm.forward.triton_moe_experts_list_fwd(*routing, gate, up, down, inputs["b1"], inputs["b2"],
                                                                banks=banks, save_h=False, **list_flags)
    assert decode_everywhere == [(6, 40)] and h.shape[0] == 0
    want_rows, want_offs = torch_route(inputs["topk_ids"], 4)
    assert torch.equal(rows, want_rows) and torch.equal(offs, want_offs)
    ref_out, _ = _oracle(inputs, go, flags)
    assert _rel(out, ref_out) <= _TOL[torch.float32], _rel(out, ref_out)


def test_list_form_predicate(tm):
    inputs, _ = _make(5, 32, 16, 3, 2, torch.float32)
    gate, up, down = _as_lists(inputs, "separate")
    routing = (inputs["x"], inputs["topk_ids"], inputs["topk_weights"])
    flags = dict(activation="swiglu", interleaved=False)
    assert tm.launch.list_banks(*routing, gate, up, down, **flags) is not None
    # one expert laid out differently: expert 0's strides would read it wrongly, so not supported
    odd = gate[:1] + [gate[1].t().contiguous().t()] + gate[2:]
    assert tm.launch.list_banks(*routing, odd, up, down, **flags) is None
    assert tm.launch.list_banks(*routing, gate, up, [w.half() for w in down], **flags) is None
    # the cache is keyed on layouts too: the same addresses with other strides are not a hit
    assert tm.launch.list_banks(*routing, gate, up, down, **flags) is not None
    flipped = [w.t() for w in gate]  # same pointers, [d, n] views
    assert tm.launch.list_banks(*routing, flipped, up, down, **flags) is None


def _count_grouped_mm(monkeypatch):
    """The shapes of the `torch._grouped_mm` calls made from now on (one per weight or bias gradient)."""
    calls = []
    real = torch._grouped_mm

    def counted(a, b, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    return calls


@pytest.mark.parametrize("case,calls", [("plain_fp16", 2), ("transposed", 2), ("empty_experts", 2),
                                        ("k1_one_expert", 2), ("bias", 4), ("bias_fp32_router_weights", 2)])
def test_wgrad_through_grouped_mm(tm, case, calls, monkeypatch):
    """SONIC_MOE_WGRAD=grouped_mm: the weight gradients by torch._grouped_mm (its CPU fallback here)
    on operands gathered into expert order, against the oracle, and seen to run: once per weight
    gradient, once more per bias gradient; not for dW2 when its bias gradient would round float32
    router weights to the operands' fp16."""
    from moe_compiler.codegen import wgrad_choice

    monkeypatch.setattr(wgrad_choice, "PINNED", "grouped_mm")
    seen = _count_grouped_mm(monkeypatch)
    dtype = torch.float16 if case in ("plain_fp16", "bias_fp32_router_weights") else torch.float32
    transposed = case == "transposed"
    experts = {"empty_experts": [1, 4], "k1_one_expert": [2]}.get(case)
    K = 1 if case == "k1_one_expert" else 2
    inputs, go = _make(13, 40, 24, 6, K, dtype, transposed=transposed, bias=case.startswith("bias"), experts=experts)
    if case == "bias_fp32_router_weights":
        inputs["topk_weights"] = inputs["topk_weights"].float()
    flags = dict(_FLAGS, transposed=transposed)
    _check_against_oracle(tm, inputs, go, flags, _TOL[dtype])
    assert len(seen) == calls, seen
    if experts is not None:
        _, (_, _, dw1, dw2, _, _) = _run_ours(tm, inputs, go, flags)
        empty = [e for e in range(6) if e not in experts]
        assert torch.equal(dw1[empty], torch.zeros_like(dw1[empty]))
        assert torch.equal(dw2[empty], torch.zeros_like(dw2[empty]))


def test_wgrad_grouped_mm_only_where_it_can_write(tm, monkeypatch):
    """A weight that is not contiguous in its own layout keeps our kernel (which writes through any
    strides); the list form's stacked gradients are contiguous, so grouped_mm computes both."""
    from moe_compiler.codegen import wgrad_choice

    monkeypatch.setattr(wgrad_choice, "PINNED", "grouped_mm")
    calls = _count_grouped_mm(monkeypatch)
    inputs, go = _make(12, 32, 16, 4, 2, torch.float32, seed=3)
    inputs["w1"] = inputs["w1"].transpose(1, 2).contiguous().transpose(1, 2)
    _check_against_oracle(tm, inputs, go, _FLAGS, _TOL[torch.float32])
    assert len(calls) == 1  # dW2 only
    calls.clear()
    inputs, go = _make(13, 40, 24, 4, 2, torch.float32, seed=5)
    gate, up, down = _as_lists(inputs, "separate")
    routing = (inputs["x"], inputs["topk_ids"], inputs["topk_weights"])
    flags = {k: v for k, v in _FLAGS.items() if k != "transposed"}
    banks = tm.launch.list_banks(*routing, gate, up, down, **flags)
    out, h, rows, offs = tm.forward.triton_moe_experts_list_fwd(*routing, gate, up, down, banks=banks, save_h=True,
                                                                **flags)
    _, _, dw1, dw2, _, _ = tm.backward.triton_moe_experts_list_bwd(go, *routing, gate, up, down, None, None, h, rows,
                                                                   offs, banks=banks, **flags)
    assert len(calls) == 2
    _, ref = _oracle(inputs, go, _FLAGS)
    assert _rel(dw1, ref["w1"]) <= _TOL[torch.float32] and _rel(dw2, ref["w2"]) <= _TOL[torch.float32]


@pytest.mark.parametrize("mode,dtype,bias", [("up", torch.float32, False), ("down", torch.float16, False),
                                             ("nearest", torch.float32, True), ("padded", torch.float16, True)])
def test_wgrad_grouped_mm_slot_form(tm, mode, dtype, bias, monkeypatch):
    """The slot form through torch._grouped_mm: the gathered operand is copied by each row's token;
    the padding rows (sorted past offsets[E], their token possibly T) are read by no group, so the
    gradients match the oracle and every expert without a real row gets exact zeros."""
    from moe_compiler.codegen import wgrad_choice

    monkeypatch.setattr(wgrad_choice, "PINNED", "grouped_mm")
    calls = _count_grouped_mm(monkeypatch)
    inputs, go = _make(29, 32, 16, 6, 2, dtype, bias=bias, seed=12, experts=[0, 2, 3, 5])
    if mode == "padded":
        slots = _slot_form(inputs, drop=(0, 5, 6, 57))  # padding slots in the middle and at both ends
    else:
        slots = _slot_form(inputs, mode=mode)
    assert (slots["topk_ids"] == -1).any() or mode == "down"
    _check_against_oracle(tm, slots, go, _FLAGS, _TOL[dtype])
    assert len(calls) == (4 if bias else 2), calls
    _, (_, _, dw1, dw2, _, _) = _run_ours(tm, slots, go, _FLAGS)
    real = set(slots["topk_ids"].tolist()) - {-1}
    empty = [e for e in range(6) if e not in real]
    assert empty and torch.equal(dw1[empty], torch.zeros_like(dw1[empty]))
    assert torch.equal(dw2[empty], torch.zeros_like(dw2[empty]))


def test_wgrad_choice_measures_each_key_once(monkeypatch):
    """"auto": the first call at a key times every candidate and keeps the fastest; later calls
    reuse it untimed; an alternative that raises is never chosen, our kernel raising propagates; a
    pinned provider is not timed."""
    import time

    from moe_compiler.codegen import wgrad_choice

    monkeypatch.setattr(wgrad_choice, "PINNED", "auto")
    monkeypatch.setattr(wgrad_choice, "_CHOSEN", {})
    ran = []
    slow = lambda: ran.append("triton") or time.sleep(0.02)  # noqa: E731
    fast = lambda: ran.append("grouped_mm")  # noqa: E731
    assert wgrad_choice.choose(("a",), {"triton": slow, "grouped_mm": fast}, cuda=False) is fast
    assert ran.count("triton") >= 2 and ran.count("grouped_mm") >= 2  # a warm-up and timed runs of each
    ran.clear()
    assert wgrad_choice.choose(("a",), {"triton": slow, "grouped_mm": fast}, cuda=False) is fast
    assert ran == [] and wgrad_choice.chosen() == {("a",): "grouped_mm"}
    assert wgrad_choice.choose(("b",), {"triton": fast, "grouped_mm": slow}, cuda=False) is fast  # per key

    def broken():
        raise RuntimeError("grouped_mm: unsupported")

    assert wgrad_choice.choose(("c",), {"triton": slow, "grouped_mm": broken}, cuda=False) is slow
    with pytest.raises(RuntimeError, match="unsupported"):  # our kernel failing is an error, not a reason to switch
        wgrad_choice.choose(("c2",), {"triton": broken, "grouped_mm": fast}, cuda=False)
    assert wgrad_choice.choose(("d",), {"triton": slow}, cuda=False) is slow  # nothing to choose from
    monkeypatch.setattr(wgrad_choice, "PINNED", "triton")
    ran.clear()
    assert wgrad_choice.choose(("e",), {"triton": slow, "grouped_mm": fast}, cuda=False) is slow and ran == []
    assert ("d",) not in wgrad_choice.chosen() and ("e",) not in wgrad_choice.chosen()
    with pytest.raises(ValueError, match="SONIC_MOE_WGRAD"):
        wgrad_choice._pinned("cutlass")
    # the scatter GEMM's own pin (SONIC_MOE_SCATTER) overrides the weight gradients'
    assert wgrad_choice.choose(("f",), {"triton": slow, "gluon": fast}, cuda=False, pinned="gluon") is fast
    assert wgrad_choice.choose(("f",), {"triton": slow}, cuda=False, pinned="gluon") is slow  # where it cannot run
    with pytest.raises(ValueError, match="SONIC_MOE_SCATTER"):
        wgrad_choice._pinned("grouped_mm", "SONIC_MOE_SCATTER", wgrad_choice.SCATTER_PROVIDERS)


def test_backward_peak_counted_by_hand():
    from moe_compiler.codegen.backward import BACKWARD_STEPS, backward_order, backward_peak

    # A' 1, dH 2, dW1 4, dW2 1, dX~ rows 10, dx 1. BACKWARD_STEPS' order (dW2, dW1, dX~): dW2 holds
    # 3 + 1, then A' dies (3 live); dW1 3 + 4 (7 live); dX~ 7 + 10 + 1 = 18
    sizes = dict(a_scaled=1, dh=2, dw1=4, dw2=1, dx_rows=10, dx=1)
    assert backward_peak(BACKWARD_STEPS, **sizes) == 18
    # dX~ before dW1 keeps dW1 out of the big stage: dW2 4 (3 live); dX~ 3 + 11 = 14 (4 live); dW1 8
    assert backward_peak(("dw2", "dx", "dw1"), **sizes) == 14
    assert backward_order(**sizes) == (("dw2", "dx", "dw1"), 14)  # ties with dX~ first; dW2 stays first
    # Qwen3-like proportions with a copy of x for dW1 (torch's grouped GEMM): dW1 and dX~ before dW2,
    # so dH dies before dW2 is allocated. dW1 6 + 8 + 5 = 19 (14 live); dX~ 14 + 6 = 20 (15 - 4 = 11
    # live); dW2 15. In BACKWARD_STEPS' order: 10 (8 live); 8 + 13 = 21 (16 live); 16 + 6 = 22
    sizes = dict(a_scaled=2, dh=4, dw1=8, dw2=4, dx_rows=5, dx=1, dw1_copy=5)
    assert backward_peak(BACKWARD_STEPS, **sizes) == 22
    assert backward_order(**sizes) == (("dw1", "dx", "dw2"), 20)


# ---------------------------------------------------------------------------------------------- GPU


@pytest.fixture
def first_config_only():
    """Run the GPU correctness cases on each kernel's first (usually winning) config, unbenchmarked
    (float32 launches: the first float32 config).

    Autotuning every small test shape (~15 s per (d, n, E, K) key on a cold cache) would dominate the
    GPU test time; the benchmark checks the error of the autotuned configs at real shapes, and
    `test_gpu_new_t_does_not_recompile_or_retune` runs the real autotuner.
    """
    from moe_compiler import codegen

    tuners = (codegen.launch._up, codegen.launch._scatter, codegen.launch._dact, codegen.launch._wgrad,
              codegen.launch._up_tma, codegen.launch._scatter_tma, codegen.launch._dact_tma, codegen.launch._wgrad_tma,
              codegen.launch._up_persistent, codegen.launch._dact_persistent)
    saved = [(t.configs, dict(t.cache)) for t in tuners]
    for t in tuners:
        # the first config of each kind: the pointer tuners' pruning then leaves one per launch, a
        # float32 one for float32 operands (`codegen.launch._by_dot_precision`)
        first = {}
        for c in t.configs:
            first.setdefault(getattr(c, "ieee_dot", False), c)
        t.configs = list(first.values())
    codegen.launch.forget_tuned_launches()
    yield
    for t, (configs, cache) in zip(tuners, saved):
        t.configs = configs
        t.cache.clear()
        t.cache.update(cache)
    codegen.launch.forget_tuned_launches()


def _gpu_case(T, d, n, E, K, *, experts=None, seed=0, noncontig=False, rounding=None):
    inputs, go = _make(T, d, n, E, K, torch.bfloat16, experts=experts, seed=seed, device="cuda")
    if rounding is not None:
        from moe_compiler.codegen.token_rounding import M_TILE

        inputs = _slot_form(inputs, mode=rounding, tile=M_TILE, seed=seed)
    if noncontig:
        wide = torch.randn(T, d + 64, device="cuda", dtype=torch.bfloat16)
        wide[:, 32:32 + d] = inputs["x"]
        inputs["x"] = wide[:, 32:32 + d]
        inputs["w1"] = inputs["w1"].transpose(1, 2).contiguous().transpose(1, 2)
        inputs["topk_weights"] = inputs["topk_weights"].t().contiguous().t()
    return inputs, go


def _ops_fwd_bwd(inputs, go, flags):
    from moe_compiler.codegen.ops import moe_experts

    leaves = {k: (v.detach().clone().requires_grad_() if v is not None and v.is_floating_point() else v)
              for k, v in inputs.items()}
    if inputs["x"].stride(-1) != 1 or not inputs["x"].is_contiguous():
        leaves["x"] = inputs["x"].detach().requires_grad_()  # keep the strided view as the leaf
    out = moe_experts(**leaves, **flags)
    names = ["x", "topk_weights", "w1", "w2"]
    grads = torch.autograd.grad(out, [leaves[k] for k in names], go)
    return out, dict(zip(names, grads))


def _oracle_bf16(inputs, go, flags):
    leaves = {k: (v.detach().clone().requires_grad_() if v is not None and v.is_floating_point() else v)
              for k, v in inputs.items()}
    out = torch_moe_experts(**leaves, **flags)
    names = ["x", "topk_weights", "w1", "w2"]
    grads = torch.autograd.grad(out, [leaves[k] for k in names], go.to(out.dtype))
    return out, dict(zip(names, grads))


_GPU_CASES = {
    "moderate": dict(T=1000, d=512, n=256, E=8, K=2),
    "rounded_nearest": dict(T=1000, d=512, n=256, E=8, K=2, rounding="nearest"),  # slot form, 128-row tiles
    "rounded_up": dict(T=700, d=256, n=128, E=8, K=2, rounding="up"),
    "empty_experts": dict(T=300, d=256, n=128, E=8, K=2, experts=[0, 5, 6]),
    "one_expert_k1": dict(T=777, d=256, n=128, E=4, K=1, experts=[3]),
    "k_equals_e": dict(T=200, d=256, n=128, E=4, K=4),
    "non_contiguous": dict(T=513, d=256, n=128, E=8, K=2, noncontig=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(_GPU_CASES))
def test_gpu_bf16_matches_oracle(case, first_config_only):
    _check_gpu_case(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["moderate", "rounded_up", "empty_experts"])
def test_gpu_pointer_loads_match_oracle(case, first_config_only, monkeypatch):
    """The same cases with TMA off: the pointer-load kernels (what per-expert tensors, interleaved
    gate/up and misaligned weights use) against the oracle."""
    from moe_compiler import codegen

    monkeypatch.setattr(codegen.launch, "USE_TMA", False)
    _check_gpu_case(case)


def _check_gpu_case(case):
    """`case`: a name in _GPU_CASES, or a dict of `_gpu_case`'s arguments."""
    import moe_compiler.codegen.ops as ops

    inputs, go = _gpu_case(**(_GPU_CASES[case] if isinstance(case, str) else case))
    assert ops.runs_triton(inputs["x"]), "SONIC_MOE_KERNEL=reference would make this vacuous"
    routing = {k: v for k, v in inputs.items() if k != "slot_token"}  # supports() does not look at the form
    assert ops.supports(**routing, **_FLAGS)
    out, grads = _ops_fwd_bwd(inputs, go, _FLAGS)
    ref64_out, ref64_grads = _oracle(inputs, go, _FLAGS)
    bf_out, bf_grads = _oracle_bf16(inputs, go, _FLAGS)
    eps = 1e-3
    assert _rel(out, ref64_out) <= 2 * _rel(bf_out, ref64_out) + eps
    for name in grads:
        ours, base = _rel(grads[name], ref64_grads[name]), _rel(bf_grads[name], ref64_grads[name])
        assert ours <= 2 * base + eps, (name, ours, base)


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,K,layout", [(1, 64, 8, "concatenated"), (4, 64, 8, "interleaved"),
                                          (3, 32, 4, "transposed_bias"), (2, 16, 2, "relu2_bias")])
def test_gpu_decode_path_matches_oracle(T, E, K, layout, monkeypatch):
    """bf16 forwards under no_grad at decode sizes take the two-launch path through `moe_experts`:
    err(ours, fp64) <= 2 err(torch bf16, fp64) + eps, and close to the grouped path's output."""
    from moe_compiler import codegen
    from moe_compiler.codegen.ops import moe_experts

    activation = "relu2" if layout == "relu2_bias" else "swiglu"
    flags = dict(_FLAGS, activation=activation, interleaved=layout == "interleaved",
                 transposed=layout == "transposed_bias")
    inputs, go = _make(T, 512, 256, E, K, torch.bfloat16, activation=activation, transposed=flags["transposed"],
                       bias=layout.endswith("bias"), seed=T, device="cuda")
    calls, decode = [], codegen.decode.triton_moe_decode
    monkeypatch.setattr(codegen.forward, "triton_moe_decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    with torch.no_grad():
        out = moe_experts(**inputs, **flags)
        monkeypatch.setattr(codegen.decode, "DECODE_MAX_SLOTS", 0)
        grouped = moe_experts(**inputs, **flags)
    assert calls == [1]
    ref64, _ = _oracle(inputs, go, flags)
    leaves = dict(inputs)
    bf = torch_moe_experts(**leaves, **flags)
    assert _rel(out, ref64) <= 2 * _rel(bf, ref64) + 1e-3, (_rel(out, ref64), _rel(bf, ref64))
    assert _rel(out, grouped) <= 1e-2, _rel(out, grouped)


@pytest.mark.gpu
def test_gpu_decode_path_bad_ids_assert():
    """An out-of-range id through the decode path: a device-side assert (in a child process: it
    poisons the CUDA context), never a silent wrong expert or a read past the weights."""
    code = ("import torch; from moe_compiler import codegen; "
            "w1 = torch.randn(8, 64, 32, device='cuda', dtype=torch.bfloat16); "
            "w2 = torch.randn(8, 32, 32, device='cuda', dtype=torch.bfloat16); "
            "x = torch.randn(2, 32, device='cuda', dtype=torch.bfloat16); "
            "ids = torch.tensor([[0, 8], [1, 2]], device='cuda'); w = torch.ones(2, 2, device='cuda'); "
            "assert codegen.decode.decode_path(4, 8, False, None); "
            "codegen.forward.triton_moe_experts_fwd(x, ids, w, w1, w2, None, None, activation='swiglu', "
            "interleaved=False, "
            "transposed=False, alpha=1.702, limit=7.0, save_h=False); torch.cuda.synchronize()")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    said = child.stderr + child.stdout  # torch._assert_async's CUDA kernel may print its own generic text
    assert child.returncode != 0 and ("out of range" in said or "device-side assert" in said), child.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["separate", "interleaved"])
def test_gpu_decode_path_list_form(layout, monkeypatch):
    """bf16 per-expert tensors (an nn.ModuleList's Linears, read through the offset tables) at a decode
    size under no_grad: the decode path, equal to the grouped path's output to bf16 rounding."""
    from moe_compiler import codegen
    from moe_compiler.codegen.ops import moe_experts_list

    activation, interleaved = _LIST_LAYOUTS[layout]
    inputs, _ = _make(3, 512, 256, 32, 4, torch.bfloat16, activation=activation, seed=4, device="cuda")
    gate, up, down = _as_lists(inputs, layout)
    routing = (inputs["x"], inputs["topk_ids"], inputs["topk_weights"])
    calls, decode = [], codegen.decode.triton_moe_decode
    monkeypatch.setattr(codegen.forward, "triton_moe_decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    flags = dict(activation=activation, interleaved=interleaved)
    with torch.no_grad():
        out = moe_experts_list(*routing, gate, up, down, **flags)
        monkeypatch.setattr(codegen.decode, "DECODE_MAX_SLOTS", 0)
        grouped = moe_experts_list(*routing, gate, up, down, **flags)
    assert calls == [1]
    ref64, _ = _oracle(inputs, torch.zeros_like(inputs["x"]), dict(_FLAGS, **flags))
    assert _rel(out, ref64) <= 1e-2 and _rel(out, grouped) <= 1e-2, (_rel(out, ref64), _rel(out, grouped))


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [None, 3], ids=["sms", "3ctas"])
@pytest.mark.parametrize("case", ["moderate", "empty_experts", "one_expert_k1"])
def test_gpu_persistent_up_equals_per_tile(case, programs, first_config_only, monkeypatch):
    """bf16: the persistent up-projection (W1 concatenated and interleaved) and dA' GEMM give H, A,
    dH, A' and dS bit-equal to one program per tile (their first configs share the tile and the
    K order), on every SM and on 3 programs walking many tiles each across expert boundaries."""
    from moe_compiler import codegen

    if programs is not None:
        monkeypatch.setattr(codegen.launch, "_programs", lambda device: programs)
    monkeypatch.setattr(codegen.launch, "PERSISTENT_UP", codegen.launch.PERSISTENT_UP)  # restored after the test
    inputs, _ = _gpu_case(**_GPU_CASES[case])
    x, ids, w1, w2 = inputs["x"], inputs["topk_ids"], inputs["w1"], inputs["w2"]
    T, d = x.shape
    E, K, n = w1.shape[0], ids.shape[1], w2.shape[2]
    rows, offs = codegen.routing.route(ids.contiguous(), E)
    bank1, bank2 = codegen.launch._stacked_banks(w1, w2, False)
    s = torch.rand(T * K, device="cuda")
    dout = torch.randn_like(x)
    ran = {}
    for persistent in (True, False):
        codegen.launch.set_persistent_up(persistent)
        outs = []
        for interleaved in (False, True):
            outs += codegen.forward.triton_moe_up(x, bank1, None, rows, offs, n=n, top_k=K, activation="swiglu",
                                                  interleaved=interleaved, alpha=1.702, limit=7.0)
        outs += codegen.backward.triton_moe_dact(dout, bank2, outs[0], s, rows, offs, n=n, top_k=K, activation="swiglu",
                                                 interleaved=False, alpha=1.702, limit=7.0)
        ran[persistent] = outs
    for i, (a, b) in enumerate(zip(ran[True], ran[False])):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max().item())


@pytest.fixture
def gluon_pinned(monkeypatch):
    """The weight gradients and the scatter GEMMs through the Gluon kernels wherever they run;
    yields their calls: {"wgrad": [gather_lhs of each], "scatter": [w_layout of each], "out_tiles": [...]}."""
    from moe_compiler import codegen
    from moe_compiler.codegen import wgrad_choice

    if codegen.launch._gluon_module("gluon_wgrad", torch.empty(1, device="cuda")) is None:
        pytest.skip("no Gluon kernels here (they need Hopper and a checked Triton version)")
    from moe_compiler.codegen.kernels import gluon_scatter, gluon_wgrad

    calls = {"wgrad": [], "scatter": [], "out_tiles": []}
    wgrad, scatter = gluon_wgrad.gluon_wgrad, gluon_scatter.gluon_scatter_gemm
    monkeypatch.setattr(gluon_wgrad, "gluon_wgrad",
                        lambda *a, **k: calls["wgrad"].append(k["gather_lhs"]) or wgrad(*a, **k))
    monkeypatch.setattr(gluon_scatter, "gluon_scatter_gemm",
                        lambda *a, **k: calls["scatter"].append(a[2]) or calls["out_tiles"].append(k["out_tiles"])
                        or scatter(*a, **k))
    monkeypatch.setattr(wgrad_choice, "PINNED", "gluon")
    monkeypatch.setattr(wgrad_choice, "SCATTER_PINNED", "gluon")
    yield calls


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [True, False], ids=["tile_order", "slot_order"])
@pytest.mark.parametrize("case", list(_GPU_CASES))
def test_gpu_gluon_kernels_match_oracle(case, tiles, first_config_only, gluon_pinned, monkeypatch):
    from moe_compiler import codegen

    monkeypatch.setattr(codegen.forward, "SCATTER_TILES", tiles)
    _check_gpu_case(case)
    # both weight gradients, except where x is a strided view (dW1 then runs our Triton kernel),
    # and both scatter GEMMs: Y (W2 read k-contiguous, layout 1) and dX~ (W1 [E, 2n, d]: layout 2,
    # or 1 where the case lays W1 out transposed), into TILE order (read through the row map) or
    # slot order
    assert sorted(set(gluon_pinned["wgrad"])) == ([True] if case == "non_contiguous" else [False, True])
    assert gluon_pinned["scatter"] == ([1, 1] if case == "non_contiguous" else [1, 2]), gluon_pinned
    assert gluon_pinned["out_tiles"] == [tiles, tiles], gluon_pinned


@pytest.mark.gpu
def test_gpu_gluon_coop_scatter_in_the_op(gluon_pinned, first_config_only, monkeypatch):
    """The cooperative scatter tile through the op where it is offered (both reductions >= its
    minimum: Y's n and dX~'s 2n), with empty experts, against the oracle."""
    from moe_compiler.codegen import wgrad_choice
    from moe_compiler.codegen.kernels import gluon_scatter

    monkeypatch.setattr(wgrad_choice, "SCATTER_PINNED", "gluon-coop")
    coop = []
    run = gluon_scatter.gluon_scatter_gemm
    monkeypatch.setattr(gluon_scatter, "gluon_scatter_gemm", lambda *a, **k: coop.append(k.get("coop")) or run(*a, **k))
    _check_gpu_case(dict(T=300, d=256, n=gluon_scatter.COOP_MIN_K, E=8, K=2, experts=[0, 2, 3, 6, 7]))
    assert gluon_pinned["scatter"] == [1, 2] and coop == [True, True], (gluon_pinned, coop)


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["slot", "tiles", "tiles_padded"])
@pytest.mark.parametrize("tile", ["default", "coop:128x256x64x3", "coop:256x128x64x4", "coop:256x128x64x3"])
@pytest.mark.parametrize("w_layout", [1, 2])
@pytest.mark.parametrize("grid", [None, 2], ids=["sms", "2ctas"])
def test_gpu_gluon_scatter_tiles_match_reference(tile, w_layout, grid, order):
    """Each scatter tile on uneven experts (one empty, one shorter than a tile), k_dim and n_dim
    not multiples of the tile, a bias, into NaN (an unwritten row shows), against float32; on 2
    CTAs the ring wraps many times. TILE order (whole boxes by TMA): the row map the launch writes
    (over a buffer of garbage) equals `slot_rows_in_tiles`, and every slot's row read through it is
    bit-equal to the slot-order output; "tiles_padded": a fifth of the slots are the slot form's
    padding (id -1), never computed, mapped to -1. A tile whose ring and output boxes overflow
    shared memory is refused with a clear error."""
    from moe_compiler.codegen.kernels import gluon_scatter as gs
    from moe_compiler.codegen.launch import _gluon_module
    from moe_compiler.codegen.routing import route

    if _gluon_module("gluon_scatter", torch.empty(1, device="cuda")) is None:
        pytest.skip("no Gluon kernels here (they need Hopper and a checked Triton version)")
    cfg = gs.default_tile(w_layout) if tile == "default" else gs.ScatterTile.parse(tile)
    T, E, K, k_dim, n_dim = 300, 8, 2, 200, 328
    gen = torch.Generator().manual_seed(3)
    ids = torch.multinomial(torch.tensor([8.0, 1, 3, 0.5, 2, 0, 6, 1]).expand(T, E), K, generator=gen)
    padded = order == "tiles_padded"
    if padded:
        ids[torch.rand(T, K, generator=gen) < 0.2] = -1
    live = (ids.reshape(-1) >= 0).cuda()
    rows, offs = route(ids.cuda(), E, padded=padded)
    inp = torch.randn(T * K, k_dim, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(E, n_dim, k_dim, generator=gen) / k_dim**0.5).to("cuda", torch.bfloat16)
    if w_layout == 2:
        w = w.transpose(1, 2).contiguous()
    bias = (torch.randn(E, n_dim, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    out = torch.full((T * K, n_dim), float("nan"), device="cuda", dtype=torch.bfloat16)
    gs.gluon_scatter_gemm(inp, w, w_layout, bias, rows, offs, n_dim=n_dim, out=out, num_programs=grid,
                          **cfg.kwargs())
    if order != "slot":
        if cfg.shared_bytes(True) > gs.SHARED_LIMIT:
            with pytest.raises(ValueError, match="shared memory"):
                gs.gluon_scatter_gemm(inp, w, w_layout, bias, rows, offs, n_dim=n_dim, out_tiles=True, **cfg.kwargs())
            return
        tiled = torch.full((gs.tile_rows(T * K, E, cfg.block_m), n_dim), float("nan"), device="cuda",
                           dtype=torch.bfloat16)
        row_map = torch.full((T * K,), 7, device="cuda", dtype=torch.int32)
        gs.gluon_scatter_gemm(inp, w, w_layout, bias, rows, offs, n_dim=n_dim, out=tiled, num_programs=grid,
                              out_tiles=True, row_map=row_map, **cfg.kwargs())
        assert torch.equal(row_map, gs.slot_rows_in_tiles(rows, offs, cfg.block_m))
        assert torch.equal(row_map < 0, ~live)
        slot_out = out
        out = torch.where(live[:, None], tiled[row_map.clamp(min=0).long()], out)
        assert torch.equal(out[live], slot_out[live])
    ref = torch.empty(T * K, n_dim, device="cuda")
    off = offs.tolist()
    for e in range(E):
        b = w[e].float().t() if w_layout == 1 else w[e].float()
        ref[rows[off[e]:off[e + 1]].long()] = inp[off[e]:off[e + 1]].float() @ b + bias[e].float()
    assert off[6] == off[5] and 0 < off[4] - off[3] < cfg.block_m  # expert 5 empty, expert 3 short
    assert not out[live].isnan().any() and out[~live].isnan().all()  # padding slots: never written
    assert _rel(out[live], ref[live]) <= 4e-3, _rel(out[live], ref[live])


@pytest.mark.gpu
@pytest.mark.parametrize("gather_lhs", [False, True], ids=["dW1", "dW2"])
def test_gpu_gluon_wgrad_keeps_inf_in_its_expert(gather_lhs, gluon_pinned):
    """An inf in one expert's first expert-ordered row makes that expert's dW non-finite and no
    other's: the previous expert's last, partial chunk must not read it (an unshifted TMA box
    would). Experts of fewer than 64 rows have no room to shift (kernels/gluon_wgrad.py)."""
    from moe_compiler.codegen.kernels.gluon_wgrad import gluon_wgrad
    from moe_compiler.codegen.routing import route

    T, d, n, E, K = 1000, 256, 128, 8, 2
    gen = torch.Generator().manual_seed(7)
    ids, _ = _routing(T, E, K, gen)
    rows, offs = route(ids.cuda(), E)
    TK = T * K
    width = 2 * n if not gather_lhs else n
    dense = torch.randn(TK, width, generator=gen).to("cuda", torch.bfloat16)
    gathered = torch.randn(T, d, generator=gen).to("cuda", torch.bfloat16)
    counts = (offs[1:] - offs[:-1]).tolist()
    e = next(e for e in range(1, E) if counts[e - 1] % 64 and counts[e - 1] > 64 and counts[e])  # ends mid-chunk
    dense[int(offs[e])] = float("inf")
    lhs, rhs = (gathered, dense) if gather_lhs else (dense, gathered)
    P, Q = lhs.shape[1], rhs.shape[1]
    dw = torch.full((E, P, Q), float("nan"), dtype=torch.bfloat16, device="cuda")
    gluon_wgrad(lhs, rhs, gather_lhs=gather_lhs, sorted_rows=rows, offsets=offs, top_k=K, dw=dw,
                dw_strides=dw.stride())
    tokens = rows.long() // K
    for x in range(E):
        r = slice(int(offs[x]), int(offs[x + 1]))
        l_rows = lhs[tokens[r]] if gather_lhs else lhs[r]
        r_rows = rhs[r] if gather_lhs else rhs[tokens[r]]
        ref = l_rows.float().t() @ r_rows.float()
        if x == e:
            assert not torch.isfinite(dw[x]).all()
        else:
            assert torch.isfinite(dw[x]).all(), x
            assert _rel(dw[x], ref) <= 1e-2, (x, _rel(dw[x], ref))


def _backward_transient(T, d, n, E, K, seed):
    """(bytes the op's backward allocates beyond what it started with, at most, at once; its outputs),
    measured on a second call (the first tunes the kernels), our weight-gradient kernel pinned."""
    from moe_compiler.codegen.ops import moe_experts_backward_op, moe_experts_op

    inputs, go = _gpu_case(T, d, n, E, K, seed=seed)
    args = [inputs[k] for k in ("x", "topk_ids", "topk_weights", "w1", "w2", "b1", "b2")]
    flags = ["swiglu", False, False, 1.702, 7.0]
    out, h, rows, offs = moe_experts_op(*args, *flags, True)
    moe_experts_backward_op(go, *args, h, rows, offs, *flags)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = moe_experts_backward_op(go, *args, h, rows, offs, *flags)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, grads


@pytest.mark.gpu
def test_gpu_backward_transient_memory(first_config_only, monkeypatch):
    """The backward holds no more than dH and one [TK, n] buffer (dA', then A' written over it)
    besides its outputs. A shape with n >> d and few experts, where these dominate: a second
    [TK, n] buffer (A' beside dA') would exceed the bound by ~10 MB."""
    from moe_compiler.codegen import wgrad_choice

    monkeypatch.setattr(wgrad_choice, "PINNED", "triton")  # the CUTLASS path copies a gathered operand
    T, d, n, E, K = 4096, 128, 2048, 2, 1
    transient, grads = _backward_transient(T, d, n, E, K, seed=3)
    TK, b = T * K, 2
    outputs = sum(g.numel() * g.element_size() for g in grads if g is not None)
    bound = outputs + TK * 2 * n * b + TK * n * b + TK * 4 + (1 << 20)  # + dS and 1 MiB of slack
    assert transient <= bound, (transient / 2**20, bound / 2**20)


@pytest.mark.gpu
def test_gpu_backward_peak_follows_the_chosen_order(first_config_only, monkeypatch):
    """At 7b-like proportions (n << d, many experts) the backward runs dX~ before dW1: its transient
    memory stays within `backward_peak` of the chosen order (+ dS and 1 MiB), at least a dW1 below
    what the fixed order of earlier versions (dW2, dW1, dX~) held."""
    from moe_compiler import codegen
    from moe_compiler.codegen import wgrad_choice

    monkeypatch.setattr(wgrad_choice, "PINNED", "triton")
    T, d, n, E, K = 2048, 1536, 256, 16, 8
    transient, _ = _backward_transient(T, d, n, E, K, seed=4)
    TK, b = T * K, 2
    rows = codegen.backward.scatter_rows(TK, E, torch.empty(0, device="cuda"))  # dX~'s, TILE order where it may run
    sizes = dict(a_scaled=TK * n * b, dh=TK * 2 * n * b, dw1=E * 2 * n * d * b, dw2=E * d * n * b,
                 dx_rows=rows * d * b, dx=T * d * b)
    order, peak = codegen.backward.backward_order(**sizes)
    assert order.index("dx") < order.index("dw1"), order
    fixed = codegen.backward.backward_peak(codegen.backward.BACKWARD_STEPS, **sizes)
    assert fixed - peak >= sizes["dw1"]
    assert transient <= peak + TK * 4 + (1 << 20), (transient / 2**20, peak / 2**20)


@pytest.mark.gpu
def test_gpu_zero_tokens(first_config_only):
    from moe_compiler.codegen.ops import moe_experts

    inputs, _ = _gpu_case(0, 256, 128, 4, 2)
    x = inputs["x"].requires_grad_()
    out = moe_experts(**dict(inputs, x=x), **_FLAGS)
    assert out.shape == (0, 256)
    out.sum().backward()
    assert x.grad.shape == (0, 256)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["swiglu_oai", "swiglu_clamp", "swiglu_softcap"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_fp16_fp32(dtype, activation, first_config_only):
    # the clamped SwiGLUs with a low limit (many clamped elements): gpt-oss's with biases and
    # interleaved gate/up (pointer loads), DeepSeek-V4's concatenated (TMA in fp16); Inkling2's
    # soft-capped one with its up cap at the limit (1.0: most of up in tanh's bend)
    oai = activation == "swiglu_oai"
    flags = dict(_FLAGS, activation=activation, interleaved=oai, limit=1.0)
    inputs, go = _make(300, 256, 128, 8, 2, dtype, activation=activation, device="cuda", seed=11, bias=oai)
    from moe_compiler import codegen

    (out, *_), grads = _run_ours(codegen, inputs, go, flags)
    ref_out, ref_grads = _oracle(inputs, go, flags)
    # baseline: the torch oracle in the same dtype (elements near the clamp flip sides when H is rounded)
    leaves = {k: (v.detach().clone().requires_grad_() if v is not None and v.is_floating_point() else v)
              for k, v in inputs.items()}
    base_out = torch_moe_experts(**leaves, **flags)
    names = ("x", "topk_weights", "w1", "w2", "b1", "b2")[:6 if oai else 4]
    grads = grads[:len(names)]
    base_grads = torch.autograd.grad(base_out, [leaves[k] for k in names], go)
    eps = 1e-5 if dtype == torch.float32 else 1e-3
    assert _rel(out, ref_out) <= 2 * _rel(base_out, ref_out) + eps
    for name, g, b in zip(names, grads, base_grads):
        assert _rel(g, ref_grads[name]) <= 2 * _rel(b, ref_grads[name]) + eps, name


@pytest.mark.gpu
def test_gpu_route_paths_match_and_bad_ids_assert():
    from moe_compiler import codegen

    for E, TK, padded in [(8, 4, False), (128, 32, False), (256, 1024, True), (128, 2048, False), (64, 9000, True),
                          (128, 196608, False), (256, 131072, True), (1, 300000, False), (600, 50000, True)]:
        ids = torch.randint(0, E, (TK,), device="cuda")
        if padded:
            ids[torch.rand(TK, device="cuda") < 0.3] = -1
        rows, offs = codegen.routing.route(ids.view(-1, 1), E, padded=padded)
        ref_rows, ref_offs = torch_route(ids.view(-1, 1), E)
        assert torch.equal(rows, ref_rows) and torch.equal(offs, ref_offs), (E, TK, padded)
    # an out-of-range id in the one-program path: a device-side assert, never a silent wrong expert
    # (it poisons the CUDA context, hence a child process)
    for ids in ("torch.tensor([[0, 8]], device='cuda')",  # one program
                "torch.arange(9000, device='cuda').view(-1, 1) % 9"):  # pieces
        code = ("import torch; from moe_compiler import codegen; "
                f"codegen.routing.route({ids}, 8); torch.cuda.synchronize()")
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert child.returncode != 0 and "out of range" in child.stderr + child.stdout, child.stderr[-2000:]


def _without_host_sync(fn):
    """Run `fn` with torch's sync debug mode raising on any synchronizing CUDA call."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_gpu_no_host_sync_and_graph_capture(first_config_only):
    from moe_compiler.codegen.ops import moe_experts, moe_experts_op

    inputs, go = _gpu_case(640, 256, 128, 8, 2, seed=3)
    _ops_fwd_bwd(inputs, go, _FLAGS)  # warm: compile + autotune (these sync, once)
    _without_host_sync(lambda: _ops_fwd_bwd(inputs, go, _FLAGS))

    args = [inputs[k] for k in ("x", "topk_ids", "topk_weights", "w1", "w2", "b1", "b2")]
    flags = ["swiglu", False, False, 1.702, 7.0, True]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        moe_experts_op(*args, *flags)  # warm on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            captured = moe_experts_op(*args, *flags)
    torch.cuda.synchronize()
    # new routing in the same buffers: the replay must follow it (metadata built on the device)
    new_inputs, _ = _gpu_case(640, 256, 128, 8, 2, seed=4)
    inputs["topk_ids"].copy_(new_inputs["topk_ids"])
    inputs["topk_weights"].copy_(new_inputs["topk_weights"])
    graph.replay()
    torch.cuda.synchronize()
    expected = moe_experts(**inputs, **_FLAGS)
    assert torch.equal(captured[0], expected)


@pytest.mark.gpu
def test_gpu_token_rounding_is_sync_free_and_capturable(first_config_only):
    """round_routing + the slot-form op: no host sync, and a CUDA graph replay follows new routing."""
    from moe_compiler.codegen.ops import moe_experts
    from moe_compiler.codegen.token_rounding import round_routing

    inputs, go = _gpu_case(640, 256, 128, 8, 2, seed=3)
    probs = torch.rand(640, 8, device="cuda").softmax(-1)

    def step():
        slot_ids, slot_w, slot_token = round_routing(probs, inputs["topk_ids"], inputs["topk_weights"])
        return moe_experts(inputs["x"], slot_ids, slot_w, inputs["w1"], inputs["w2"], slot_token=slot_token)

    step()
    _without_host_sync(step)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
        with torch.cuda.graph(graph, stream=stream):
            captured = step()
    torch.cuda.synchronize()
    probs.copy_(torch.rand(640, 8, device="cuda").softmax(-1))
    new_inputs, _ = _gpu_case(640, 256, 128, 8, 2, seed=4)
    inputs["topk_ids"].copy_(new_inputs["topk_ids"])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, step())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["down", "up", "nearest"])
def test_gpu_rounding_kernels_match_reference(mode):
    """round_routing on CUDA (the Triton kernels) against the torch reference on the CPU, at 128-row
    tiles: the same slots and weights, and gradients of the probabilities and weights."""
    from moe_compiler.codegen.token_rounding import round_routing

    probs, ids, weights = _rounding_case(4096, 64, 4, seed=7)
    weights = weights.bfloat16()
    coef = None
    results = {}
    for device in ("cpu", "cuda"):
        p = probs.detach().to(device).requires_grad_()
        w = weights.detach().to(device).requires_grad_()
        slot_ids, slot_w, slot_token = round_routing(p, ids.to(device), w, mode=mode)
        if coef is None:
            coef = torch.randn(slot_w.shape, generator=torch.Generator().manual_seed(1))
        (slot_w.float() * coef.to(device)).sum().backward()
        results[device] = [t.cpu() for t in (slot_ids, slot_w, slot_token, p.grad, w.grad)]
    for name, a, b in zip(("ids", "weights", "tokens"), results["cuda"], results["cpu"]):
        assert torch.equal(a, b), name
    # the gradients through added pairs' scale sum over each token's added pairs, in atomic order on
    # CUDA: equal up to rounding (fp32 probabilities, bf16 weights)
    for name, a, b in zip(("d probs", "d weights"), results["cuda"][3:], results["cpu"][3:]):
        torch.testing.assert_close(a, b, rtol=1e-5 if a.dtype == torch.float32 else 1.6e-2, atol=1e-7, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("d,n,E,K", [(256, 128, 8, 2), (2048, 768, 64, 1)])
@pytest.mark.parametrize("scatter", ["auto", "gluon"])
def test_gpu_new_t_does_not_recompile_or_retune(d, n, E, K, scatter, monkeypatch):
    """After the first call, a new token count compiles no kernel and retunes nothing: every int
    argument that follows T (row and slot counts, the routing's piece count) is unspecialized, in the
    GEMMs, the routing kernels and the Gluon ones alike. Under expert parallelism the rows a rank
    receives change every step; a count that turns divisible by 16 must not compile a variant. The
    first T of each regime (the routing's one-program form below a few hundred slots, its pieces
    above) is not a multiple of 16; the next ones are, are odd, or are another even count."""
    import triton

    from moe_compiler import codegen

    monkeypatch.setattr(codegen.wgrad_choice, "SCATTER_PINNED", scatter)
    for T in (1000, 17):
        _ops_fwd_bwd(*_gpu_case(T, d, n, E, K, seed=T), _FLAGS)
    kernels = (codegen.launch._up, codegen.launch._scatter, codegen.launch._dact, codegen.launch._wgrad)
    tuned = [len(k.cache) for k in kernels]
    chosen = codegen.wgrad_choice.chosen()
    compiled = []

    def hook(**kw):  # Triton calls it before compiling a kernel it has not compiled for this key
        compiled.append(kw["fn"].name)
        return False

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", hook)
    for T in (1024, 1001, 4096, 2002, 32, 19):
        _ops_fwd_bwd(*_gpu_case(T, d, n, E, K, seed=T), _FLAGS)
    assert compiled == []
    assert [len(k.cache) for k in kernels] == tuned
    assert codegen.wgrad_choice.chosen() == chosen


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["separate", "fused"])
def test_gpu_list_form_equals_stacked_without_sync(layout, first_config_only):
    """bf16 through `codegen.ops`: per-expert tensors give the stacked op's exact outputs and gradients,
    and after the first call (address table built) fwd+bwd makes no host sync."""
    from moe_compiler.codegen.ops import moe_experts_list

    inputs, go = _gpu_case(700, 256, 128, 8, 2, seed=7)
    gate, up, down = _as_lists(inputs, layout, seed=7)
    want_out, want = _ops_fwd_bwd(inputs, go, _FLAGS)
    leaves = [t.detach().requires_grad_() for t in (inputs["x"], inputs["topk_weights"], *gate, *up, *down)]
    x, w, rest = leaves[0], leaves[1], leaves[2:]
    gate_l, up_l, down_l = rest[:8], rest[8:8 + len(up)], rest[8 + len(up):]

    def step():
        out = moe_experts_list(x, inputs["topk_ids"], w, gate_l, up_l, down_l)
        return out, torch.autograd.grad(out, leaves, go)

    out, grads = step()
    assert torch.equal(out, want_out)
    assert torch.equal(grads[0], want["x"]) and torch.equal(grads[1], want["topk_weights"])
    n = 128
    dw1 = torch.stack([torch.cat((g, u)) for g, u in zip(grads[2:10], grads[10:18])]) if up else torch.stack(grads[2:10])
    assert torch.equal(dw1, want["w1"]) and torch.equal(torch.stack(grads[-8:]), want["w2"])
    assert dw1.shape[1] == 2 * n
    _without_host_sync(step)


# ------------------------------------------------------------- GPU: weight gradients by torch._grouped_mm


@pytest.mark.gpu
@pytest.mark.parametrize("case,calls", [("moderate", 2), ("empty_experts", 2), ("one_expert_k1", 2),
                                        ("non_contiguous", 1), ("rounded_nearest", 2)])
def test_gpu_wgrad_grouped_mm_matches_oracle(case, calls, first_config_only, monkeypatch):
    """SONIC_MOE_WGRAD=grouped_mm on the GPU cases: CUTLASS's K-grouped GEMM (empty experts and
    all, and the slot form), as close to the float64 oracle as the bf16 oracle is; dW1 of a
    non-contiguous W1 keeps our kernel."""
    from moe_compiler.codegen import wgrad_choice

    monkeypatch.setattr(wgrad_choice, "PINNED", "grouped_mm")
    seen = _count_grouped_mm(monkeypatch)
    _check_gpu_case(case)
    assert len(seen) == calls, seen


@pytest.mark.gpu
def test_gpu_wgrad_auto_chooses_once_then_no_sync_and_capturable(first_config_only, monkeypatch):
    """"auto" measures the providers at a key's first call (weight gradients; the scatter GEMMs under
    keys of their own), reuses the choice with no host sync, and inside a CUDA-graph capture of a
    key it has not measured runs our kernel untimed."""
    from moe_compiler.codegen import wgrad_choice
    from moe_compiler.codegen.ops import moe_experts_backward_op, moe_experts_op

    monkeypatch.setattr(wgrad_choice, "PINNED", "auto")
    monkeypatch.setattr(wgrad_choice, "_CHOSEN", {})
    inputs, go = _gpu_case(2048, 512, 512, 8, 2, seed=7)
    _ops_fwd_bwd(inputs, go, _FLAGS)
    chosen = wgrad_choice.chosen()
    wgrads = [v for k, v in chosen.items() if k[0] != "scatter"]
    scatters = [v for k, v in chosen.items() if k[0] == "scatter"]
    assert len(wgrads) == 2 and set(wgrads) <= {"triton", "grouped_mm", "gluon"}, chosen
    assert len(scatters) == 2 and set(scatters) <= {"triton", "gluon"}, chosen  # Y and dX~
    for pinned in ("triton", "grouped_mm", "gluon"):  # every provider's results stand against the oracle
        monkeypatch.setattr(wgrad_choice, "PINNED", pinned)
        _, again = _ops_fwd_bwd(inputs, go, _FLAGS)
        _, ref = _oracle(inputs, go, _FLAGS)
        _, bf = _oracle_bf16(inputs, go, _FLAGS)
        for name in ("w1", "w2"):
            assert _rel(again[name], ref[name]) <= 2 * _rel(bf[name], ref[name]) + 1e-3, (pinned, name)
        _without_host_sync(lambda: _ops_fwd_bwd(inputs, go, _FLAGS))

    monkeypatch.setattr(wgrad_choice, "PINNED", "auto")
    monkeypatch.setattr(wgrad_choice, "_CHOSEN", {})
    args = [inputs[k] for k in ("x", "topk_ids", "topk_weights", "w1", "w2", "b1", "b2")]
    flags = ["swiglu", False, False, 1.702, 7.0]
    out, h, rows, offs = moe_experts_op(*args, *flags, True)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            captured = moe_experts_backward_op(go, *args, h, rows, offs, *flags)
    torch.cuda.synchronize()
    # nothing was timed inside the capture: only the forward's scatter GEMM (k_dim = n) was, before it
    assert [k[:2] for k in wgrad_choice.chosen()] == [("scatter", inputs["w2"].shape[2])], wgrad_choice.chosen()
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setattr(wgrad_choice, "PINNED", "triton")
    expected = moe_experts_backward_op(go, *args, h, rows, offs, *flags)
    assert torch.equal(captured[2], expected[2]) and torch.equal(captured[3], expected[3])


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("provider,calls", [("triton", 0), ("grouped_mm", 4)])
def test_gpu_gpt_oss_layout_with_biases(provider, calls, transposed, first_config_only, monkeypatch):
    """gpt-oss's experts (transposed, interleaved gate/up, biases, clamped SwiGLU; also untransposed)
    in bf16, the interleaved W1 through TMA: every gradient, biases included, as close to the
    float64 oracle as the bf16 oracle is, by either weight-gradient provider (bf16 router weights:
    grouped_mm takes both bias gradients too)."""
    from moe_compiler.codegen import wgrad_choice
    from moe_compiler.codegen.ops import moe_experts

    monkeypatch.setattr(wgrad_choice, "PINNED", provider)
    seen = _count_grouped_mm(monkeypatch)
    flags = dict(_FLAGS, activation="swiglu_oai", interleaved=True, transposed=transposed)
    inputs, go = _make(1000, 256, 128, 8, 2, torch.bfloat16, activation="swiglu_oai", transposed=transposed, bias=True,
                       device="cuda")
    names = ["x", "topk_weights", "w1", "w2", "b1", "b2"]

    def grads(fn, dtype=None):
        leaves = {k: (v.detach().to(dtype or v.dtype).requires_grad_() if v is not None and v.is_floating_point()
                      else v) for k, v in inputs.items()}
        out = fn(**leaves, **flags)
        return dict(zip(names, torch.autograd.grad(out, [leaves[k] for k in names], go.to(out.dtype))))

    ours, bf, ref = grads(moe_experts), grads(torch_moe_experts), grads(torch_moe_experts, torch.float64)
    for name in names:
        assert _rel(ours[name], ref[name]) <= 2 * _rel(bf[name], ref[name]) + 1e-3, name
    assert len(seen) == calls, seen


@pytest.mark.parametrize("dtype,bias,slots", [(torch.float16, False, False), (torch.float32, True, True)])
def test_planned_calls_replay_the_launches_equal_to_the_launchers(tm, monkeypatch, dtype, bias, slots):
    """`codegen.plans` over the forward and backward launchers: after a signature's recorded call,
    calls on new values (the same signature) replay its launches (TMA descriptors rebuilt over the
    new tensors, in fp16) and give the launchers' own results, bit for bit. The forward's check of
    CPU ids reads their values on the host, which no plan can repeat: it is left out here (the ids
    are valid by construction)."""
    from moe_compiler.codegen import plans

    monkeypatch.setattr(tm.routing, "_check_ids_on_cpu", lambda *a, **k: None)
    plans.forget()
    fwd = plans.planned(tm.forward.triton_moe_experts_fwd, cuda_only=False)
    bwd = plans.planned(tm.backward.triton_moe_experts_bwd, cuda_only=False)
    for seed in range(plans.RECORD_AT + 2):
        inputs, go = _make(9, 32, 16, 4, 2, dtype, bias=bias, seed=seed)
        if slots:
            inputs = _slot_form(inputs, drop=(1, 6, 7))
        kw = dict(inputs, save_h=True, **_FLAGS)
        got, want = fwd(**kw), tm.forward.triton_moe_experts_fwd(**kw)
        real = int(want[3][-1])  # H's rows past the real ones (the slot form's padding) are not written
        for a, b in zip((got[0], got[1][:real], *got[2:]), (want[0], want[1][:real], *want[2:])):
            assert torch.equal(a, b)
        routing = dict(h=want[1], sorted_rows=want[2], expert_offsets=want[3])
        grads = bwd(go, **inputs, **routing, **_FLAGS)
        for a, b in zip(grads, tm.backward.triton_moe_experts_bwd(go, **inputs, **routing, **_FLAGS)):
            assert (a is None and b is None) or torch.equal(a, b)
    assert plans.stats()["planned"] == 2, plans.stats()
    plans.forget()
