"""Hypothesis properties of the `sonic::moe_experts` op on the CPU: outputs and every gradient agree
with the fp64 oracle (`codegen.reference.torch_moe_experts`, the simplest loop, differentiated by
plain autograd) over random sizes, dtypes, routings, layouts, activations and memory layouts.

What is drawn (see `moe_cases`):
    sizes       T in {0, 1, 2..24}, d in 1..16, n in 1..12, E in 1..6, K in 1..E
    dtypes      float64, float32, bfloat16, float16 (CPU matmul supports all four);
                router weights in x's dtype or float32 (Mixtral/DeepSeek pass fp32 weights)
    routing     distinct top-k ids; random ids with duplicates inside a row; every slot on one
                expert; one hot expert in slot 0 of every row; only the lower half of the experts
                used (empty experts); ids as int64 or int32
    weights     random positive, all equal (1/K), equal within each row, signed, some exactly 0
    layouts     every activation in codegen.activations.GATED; HF [E, 2n, d] / gpt-oss transposed
                [E, d, 2n]; concatenated / interleaved gate-up (gated only); with / without biases;
                gpt-oss clamp limit 7 (default) or 0.75 (clamps often), alpha 1.702 or 1
    memory      any subset of x, ids, router weights, w1, w2, b1, b2 given as a strided view

Tolerances are data (TOLERANCES below). fp64: elementwise, only summation order differs between
the op and the oracle. Lower precisions: the op must be as close to the fp64 oracle as the same
oracle run in that dtype is, up to a factor 2 and a per-dtype floor:

    rel_err(op, oracle_fp64) <= 2 * rel_err(oracle_dtype, oracle_fp64) + FLOOR[dtype]

The factor 2 allows a different (not worse in kind) rounding order; the floor covers draws where
the dtype oracle happens to be (near) exact, e.g. T=0/1 or d=1, and is about one to eight units of
roundoff of the dtype: fp32 1e-6 (eps 1.2e-7), fp16 2e-3 (eps 9.8e-4), bf16 1e-2 (eps 7.8e-3), the
last two being the model-level floors of `moe_compiler.testing.LOW_PRECISION_FLOOR`.

Profile: the shared one from conftest ("ci": derandomized, deadline off, 25 examples; "dev":
random, 50). Only `max_examples` is scaled per test, as a multiple of the profile's.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_compiler.codegen import ACTIVATIONS, GATED, moe_experts, torch_moe_experts
from moe_compiler.testing import LOW_PRECISION_FLOOR, rel_err

FP64_RTOL = FP64_ATOL = 1e-10
FLOOR = {torch.float32: 1e-6, **LOW_PRECISION_FLOOR}
FACTOR = 2.0
DELTA = 1e-6  # relative input perturbation (fp64) that estimates each tensor's condition number
PROBES = 4  # random perturbation directions per estimate (the largest response is kept)
TOLERANCES = {"fp64": dict(rtol=FP64_RTOL, atol=FP64_ATOL), "factor": FACTOR, "floor": FLOOR, "delta": DELTA}

LOW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROUTINGS = ("topk", "duplicates", "one_expert", "hot_expert", "skewed")
WEIGHTINGS = ("random", "equal", "row_equal", "signed", "zeros")
STRIDABLE = ("x", "ids", "w", "w1", "w2", "b1", "b2")
GRAD_NAMES = ("x", "w", "w1", "w2", "b1", "b2")

_BASE = settings.default.max_examples  # the loaded profile's count (conftest runs first)


@dataclasses.dataclass(frozen=True)
class Case:
    T: int
    d: int
    n: int
    E: int
    K: int
    dtype: torch.dtype
    w_dtype: torch.dtype
    ids_dtype: torch.dtype
    activation: str
    interleaved: bool
    transposed: bool
    bias: bool
    routing: str
    weighting: str
    strided: frozenset
    limit: float
    alpha: float
    seed: int

    @property
    def flags(self) -> dict:
        return dict(
            activation=self.activation, interleaved=self.interleaved, transposed=self.transposed,
            alpha=self.alpha, limit=self.limit,
        )


@st.composite
def moe_cases(draw, dtypes=(torch.float64,)):
    dtype = draw(st.sampled_from(dtypes))
    E = draw(st.integers(1, 6))
    activation = draw(st.sampled_from(ACTIVATIONS))
    return Case(
        T=draw(st.one_of(st.just(0), st.just(1), st.integers(2, 24))),
        d=draw(st.integers(1, 16)),
        n=draw(st.integers(1, 12)),
        E=E,
        K=draw(st.integers(1, E)),
        dtype=dtype,
        w_dtype=dtype if dtype == torch.float64 else draw(st.sampled_from((dtype, torch.float32))),
        ids_dtype=draw(st.sampled_from((torch.int64, torch.int32))),
        activation=activation,
        interleaved=GATED[activation] and draw(st.booleans()),
        transposed=draw(st.booleans()),
        bias=draw(st.booleans()),
        routing=draw(st.sampled_from(ROUTINGS)),
        weighting=draw(st.sampled_from(WEIGHTINGS)),
        strided=draw(st.frozensets(st.sampled_from(STRIDABLE))),
        limit=draw(st.sampled_from((7.0, 0.75))),
        alpha=draw(st.sampled_from((1.702, 1.0))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def routing_ids(case: Case, g: torch.Generator) -> torch.Tensor:
    """[T, K] expert ids in [0, E) following `case.routing`."""
    T, E, K = case.T, case.E, case.K
    if T == 0:
        return torch.empty(0, K, dtype=torch.int64)
    if case.routing == "topk":  # what a router's top-k gives: distinct ids per row
        return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if case.routing == "duplicates":  # the same expert twice in a row is legal input for the op
        ids = torch.randint(0, E, (T, K), generator=g)
        if K > 1:
            ids[::2, 1] = ids[::2, 0]
        return ids
    if case.routing == "one_expert":  # every slot of every token on one expert, the rest empty
        return torch.full((T, K), int(torch.randint(0, E, (1,), generator=g)), dtype=torch.int64)
    if case.routing == "hot_expert":  # expert 0 gets every token, the others share the rest
        rest = torch.stack([torch.randperm(E - 1, generator=g)[: K - 1] + 1 for _ in range(T)])
        return torch.cat([torch.zeros(T, 1, dtype=torch.int64), rest], 1)
    # skewed: only the lower half of the experts is used (the upper half is empty), with repeats
    used = max(1, E // 2)
    return torch.randint(0, used, (T, K), generator=g)


def router_weights(case: Case, g: torch.Generator) -> torch.Tensor:
    T, K = case.T, case.K
    if case.weighting == "equal":
        w = torch.full((T, K), 1.0 / K, dtype=torch.float64)
    elif case.weighting == "row_equal":
        w = torch.rand(T, 1, generator=g, dtype=torch.float64).expand(T, K).clone()
    elif case.weighting == "signed":
        w = torch.randn(T, K, generator=g, dtype=torch.float64)
    elif case.weighting == "zeros":
        w = torch.rand(T, K, generator=g, dtype=torch.float64)
        w[::3] = 0.0
    else:
        w = torch.rand(T, K, generator=g, dtype=torch.float64) + 0.05
    return w.to(case.w_dtype)


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every dim strided by 2) of a larger buffer."""
    buf = torch.zeros([2 * s for s in t.shape], dtype=t.dtype)
    view = buf[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    return view


def make_inputs(case: Case) -> dict:
    """The op's inputs in the case's dtypes and memory layouts (values are dtype-rounded first)."""
    g = torch.Generator().manual_seed(case.seed)
    T, d, n, E = case.T, case.d, case.n, case.E
    w1_out = 2 * n if GATED[case.activation] else n

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(case.dtype)

    t = dict(
        x=randn(T, d),
        ids=routing_ids(case, g).to(case.ids_dtype),
        w=router_weights(case, g),
        w1=randn(*((E, d, w1_out) if case.transposed else (E, w1_out, d)), scale=d**-0.5),
        w2=randn(*((E, n, d) if case.transposed else (E, d, n)), scale=n**-0.5),
        b1=randn(E, w1_out, scale=0.5) if case.bias else None,
        b2=randn(E, d, scale=0.5) if case.bias else None,
    )
    for name in case.strided:
        if t[name] is not None:
            t[name] = strided(t[name])
    return t


def _grads(out, leaves: dict, grad_out) -> dict:
    names = [k for k in GRAD_NAMES if leaves.get(k) is not None]
    if not out.requires_grad:  # the oracle with no token routed anywhere (T=0) builds no graph
        return {k: torch.zeros_like(leaves[k]) for k in names}
    grads = torch.autograd.grad(
        out, [leaves[k] for k in names], grad_out, allow_unused=True, materialize_grads=True
    )
    return dict(zip(names, grads))


def run(fn, inputs: dict, grad_out: torch.Tensor, flags: dict, dtype=None):
    """(out, {name: grad}) of fn on fresh leaves (cast to `dtype` if given, keeping their values)."""
    leaves = {}
    for k, v in inputs.items():
        if v is None or k == "ids":
            leaves[k] = v
            continue
        v = v.detach()
        leaves[k] = (v.to(dtype) if dtype is not None else v).requires_grad_()
    out = fn(leaves["x"], leaves["ids"], leaves["w"], leaves["w1"], leaves["w2"], leaves["b1"], leaves["b2"], **flags)
    return out.detach(), _grads(out, leaves, grad_out.to(out.dtype))


def op_and_oracles(case: Case):
    inputs = make_inputs(case)
    g = torch.Generator().manual_seed(case.seed + 1)
    grad_out = torch.randn(case.T, case.d, generator=g, dtype=torch.float64).to(case.dtype)
    got = run(moe_experts, inputs, grad_out, case.flags)
    truth = run(torch_moe_experts, inputs, grad_out, case.flags, dtype=torch.float64)
    return inputs, got, truth, grad_out


def assert_matches_fp64(case: Case, got, truth):
    out, grads = got
    want_out, want_grads = truth
    assert out.dtype == case.dtype and out.shape == (case.T, case.d)
    torch.testing.assert_close(out, want_out, **TOLERANCES["fp64"], msg=lambda m: f"out: {m}\n{case}")
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], **TOLERANCES["fp64"], msg=lambda m: f"d{name}: {m}\n{case}")


def condition_numbers(inputs: dict, grad_out: torch.Tensor, flags: dict, truth) -> dict:
    """Relative condition number of the output and of each gradient, estimated in fp64 by
    perturbing every floating input (and grad_out) by a relative DELTA with random signs r:
    kappa = max over PROBES draws of ||f(in * (1 + DELTA r)) - f(in)|| / (DELTA ||f(in)||), >= 1.

    A sum of terms that cancel (a d=1 input gradient, a K=1 router-weight gradient) has a truth
    much smaller than its terms; any implementation that rounds its terms to the dtype then has a
    relative error of about eps * kappa, and the oracle run in the dtype may be luckier than that.
    """
    g = torch.Generator().manual_seed(12345)

    def shake(t):
        if t is None or not t.is_floating_point():
            return t
        signs = torch.randint(0, 2, t.shape, generator=g, dtype=torch.float64) * 2 - 1
        return t.double() * (1 + DELTA * signs)

    kappa = dict.fromkeys(["out"] + [f"d{k}" for k in truth[1]], 1.0)
    for _ in range(PROBES):  # the largest of a few random directions: closer to the worst case
        moved = run(torch_moe_experts, {k: shake(v) for k, v in inputs.items()}, shake(grad_out), flags, dtype=torch.float64)
        kappa["out"] = max(kappa["out"], rel_err(moved[0], truth[0]) / DELTA)
        for k in truth[1]:
            kappa[f"d{k}"] = max(kappa[f"d{k}"], rel_err(moved[1][k], truth[1][k]) / DELTA)
    return kappa


def assert_within_oracle_error(case: Case, got, truth, baseline, kappa):
    """err(op, fp64) <= FACTOR * err(oracle in the dtype, fp64) + FLOOR[dtype] * kappa, for the
    output and every gradient (kappa: the tensor's condition number, 1 when well conditioned)."""
    floor = FLOOR[case.dtype]
    pairs = [("out", got[0], truth[0], baseline[0])]
    pairs += [(f"d{k}", got[1][k], truth[1][k], baseline[1][k]) for k in got[1]]
    for name, ours, want, theirs in pairs:
        assert ours.dtype == theirs.dtype, (name, ours.dtype, theirs.dtype)
        assert ours.shape == want.shape, (name, ours.shape, want.shape)
        e_ours, e_base = rel_err(ours, want), rel_err(theirs, want)
        bound = FACTOR * e_base + floor * kappa[name]
        assert e_ours <= bound, (
            f"{name}: err(op, fp64)={e_ours:.3e} > {bound:.3e} (oracle {e_base:.3e}, kappa {kappa[name]:.3g})\n{case}"
        )


# ---------------------------------------------------------------------------------------------


@settings(max_examples=16 * _BASE)
@given(case=moe_cases((torch.float64,)))
def test_fp64_matches_oracle(case):
    """fp64: output and the gradients of x, router weights, w1, w2, b1, b2 equal the autograd
    loop's elementwise (1e-10), for every routing, layout, activation and memory layout drawn."""
    _, got, truth, _ = op_and_oracles(case)
    assert_matches_fp64(case, got, truth)


@settings(max_examples=16 * _BASE)
@given(case=moe_cases(LOW_DTYPES))
def test_low_precision_within_oracle_error(case):
    """fp32/bf16/fp16: the op is as close to the fp64 oracle as the oracle itself run in that
    dtype is (factor 2 plus a per-dtype floor), for the output and every gradient."""
    inputs, got, truth, grad_out = op_and_oracles(case)
    baseline = run(torch_moe_experts, inputs, grad_out, case.flags)
    kappa = condition_numbers(inputs, grad_out, case.flags, truth)
    assert_within_oracle_error(case, got, truth, baseline, kappa)


@settings(max_examples=4 * _BASE)
@given(case=moe_cases((torch.float64,)), data=st.data())
def test_tokens_are_independent(case, data):
    """Token t's output depends on its own row only: the op over any split of the batch, and over
    the tokens in another order with each row's K slots permuted, equals the op over the batch."""
    t = make_inputs(case)
    args = lambda sel, slots=slice(None): (  # noqa: E731
        t["x"][sel], t["ids"][sel][:, slots], t["w"][sel][:, slots], t["w1"], t["w2"], t["b1"], t["b2"]
    )
    whole = moe_experts(*args(slice(None)), **case.flags)
    cut = data.draw(st.integers(0, case.T), label="cut")
    parts = torch.cat([moe_experts(*args(slice(0, cut)), **case.flags), moe_experts(*args(slice(cut, None)), **case.flags)])
    torch.testing.assert_close(parts, whole, **TOLERANCES["fp64"])
    perm = torch.tensor(data.draw(st.permutations(range(case.T)), label="token order"), dtype=torch.long)
    slots = torch.tensor(data.draw(st.permutations(range(case.K)), label="slot order"), dtype=torch.long)
    shuffled = moe_experts(*args(perm, slots), **case.flags)
    torch.testing.assert_close(shuffled, whole[perm], **TOLERANCES["fp64"])


def test_cases_cover_the_space():
    """The strategy can reach every routing, weighting, activation and the degenerate sizes
    (a guard against a strategy edit that silently stops drawing a category)."""
    seen = dict(routing=set(), weighting=set(), activation=set(), T=set(), K_eq_E=False, interleaved=False)

    @settings(max_examples=300)
    @given(case=moe_cases(LOW_DTYPES + (torch.float64,)))
    def collect(case):
        seen["routing"].add(case.routing)
        seen["weighting"].add(case.weighting)
        seen["activation"].add(case.activation)
        seen["T"].add(min(case.T, 2))
        seen["K_eq_E"] |= case.K == case.E
        seen["interleaved"] |= case.interleaved

    collect()
    assert seen["routing"] == set(ROUTINGS) and seen["weighting"] == set(WEIGHTINGS)
    assert seen["activation"] == set(ACTIVATIONS) and seen["T"] == {0, 1, 2}
    assert seen["K_eq_E"] and seen["interleaved"]


@pytest.mark.parametrize("routing", ROUTINGS)
def test_routing_generators_do_what_they_say(routing):
    """The degenerate routings really are degenerate (empty experts, one expert, duplicates)."""
    case = Case(
        T=12, d=4, n=3, E=5, K=3, dtype=torch.float64, w_dtype=torch.float64, ids_dtype=torch.int64,
        activation="swiglu", interleaved=False, transposed=False, bias=False, routing=routing,
        weighting="random", strided=frozenset(STRIDABLE), limit=7.0, alpha=1.702, seed=3,
    )
    t = make_inputs(case)
    ids = t["ids"]
    assert ids.shape == (12, 3) and int(ids.min()) >= 0 and int(ids.max()) < 5
    assert all(not v.is_contiguous() for v in t.values() if v is not None and v.numel() > 1)
    per_row_distinct = [len(set(r.tolist())) for r in ids]
    counts = torch.bincount(ids.reshape(-1), minlength=5)
    if routing == "topk":
        assert per_row_distinct == [3] * 12
    elif routing == "duplicates":
        assert min(per_row_distinct) < 3
    elif routing == "one_expert":
        assert int((counts > 0).sum()) == 1
    elif routing == "hot_expert":
        assert (ids[:, 0] == 0).all() and int(counts[0]) == 12
    else:
        assert int(counts[2:].sum()) == 0  # experts 2..4 are empty
