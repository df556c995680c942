"""Look-alikes and unsupported variants: left untouched, reason logged, results equal eager."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import moe_compiler
from moe_compiler.testing import tiny_moe_model

from .helpers import assert_close_to_eager, compile_sonic

pytest.importorskip("transformers")


class DenseMLP(nn.Module):
    def __init__(self, d=16, n=32):
        super().__init__()
        self.up = nn.Linear(d, 2 * n)
        self.down = nn.Linear(n, d)

    def forward(self, x):
        g, u = self.up(x).chunk(2, -1)
        return self.down(nn.functional.silu(g) * u)


class SortedGroupedLookalike(nn.Module):
    """Sorts, gathers, histc/cumsum offsets and two grouped matmuls, like an MoE, but averages the
    K rows instead of weighting them by router scores: not an MoE the op computes."""

    def __init__(self, d=16, n=8, E=4, K=2):
        super().__init__()
        self.E, self.K = E, K
        self.w1 = nn.Parameter(torch.randn(E, 2 * n, d) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, d, n) * 0.1)
        self.router = nn.Linear(d, E)

    def forward(self, x):
        T, d = x.shape
        ids = self.router(x).topk(self.K, dim=-1).indices
        ids_g, perm = torch.sort(ids.reshape(-1))
        xg = x[perm // self.K]
        offs = torch.cumsum(torch.histc(ids_g.float(), bins=self.E, min=0, max=self.E - 1), 0, dtype=torch.int32)
        h = torch.ops.transformers.grouped_mm_fallback(xg, self.w1.transpose(-2, -1), offs=offs)
        g, u = h.chunk(2, -1)
        y = torch.ops.transformers.grouped_mm_fallback(nn.functional.silu(g) * u, self.w2.transpose(-2, -1), offs=offs)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
        return y[inv].view(T, self.K, d).mean(1)


def _run(model, x):
    eager = model(x)
    compiled = compile_sonic(model, compiler="aot_eager")
    with moe_compiler.capture() as report:
        got = compiled(x)
    assert_close_to_eager(got, eager, what="output")
    return report


def test_dense_mlp_untouched(caplog):
    with caplog.at_level(logging.DEBUG, logger="moe_compiler"):
        report = _run(DenseMLP(), torch.randn(6, 16))
    assert not report.records
    assert "no MoE candidate" in caplog.text


def test_grouped_mm_lookalike_rejected(caplog):
    import transformers.integrations.moe  # noqa: F401  registers transformers::grouped_mm_fallback

    with caplog.at_level(logging.DEBUG, logger="moe_compiler"):
        report = _run(SortedGroupedLookalike(), torch.randn(6, 16))
    # torch 2.11 + transformers 5.17 split this frame in two (their fallback op is not traceable
    # there); every candidate must still be rejected for the same reason.
    assert report.rejected and not report.rewritten, str(report)
    layers = [r for r in report.rejected if r.idiom != "grouped_rows"]
    assert layers and all("not scaled by the routing weights" in r.reason for r in layers), str(report)
    # its experts over the sorted rows are the op's: the opt-in idiom that would rewrite them alone is named
    assert all("opt-in grouped_rows" in r.reason for r in report.rejected if r.idiom == "grouped_rows"), str(report)
    assert "untouched" in caplog.text and "routing weights" in caplog.text


def test_unsupported_activation_rejected(caplog):
    model = tiny_moe_model("qwen3_moe", hidden_act="tanh")
    ids = torch.randint(0, 128, (2, 8))
    eager = model(ids).logits
    with caplog.at_level(logging.DEBUG, logger="moe_compiler"):
        with moe_compiler.capture() as report:
            got = compile_sonic(model, compiler="aot_eager")(ids).logits
    assert not report.rewritten, str(report)
    # both layers are rejected for their activation; torch 2.11 + transformers 5.17 also retry the
    # frame from inner modules (their fallback op does not trace there), adding records for partial
    # regions whose paths start lower and whose reasons differ
    whole = {f"model.layers.{i}.mlp.experts" for i in range(2)}
    assert whole <= {r.module for r in report.rejected}, str(report)
    assert all("unsupported activation" in r.reason for r in report.rejected if r.module in whole), str(report)
    assert "unsupported activation" in caplog.text
    assert_close_to_eager(got, eager, what="logits")


def test_probe_crosses_every_clamp_it_sees():
    """An activation with a clamp beyond the usual probe range is not taken for its unclamped twin
    (that would compute wrong values once H passes the bound); DeepSeek-V4's form is named with its
    limit; a clamp with a bound it cannot name is rejected."""
    from moe_compiler.patterns.activation_probe import name_activation

    n = 8

    def gated(fn):
        return lambda h: fn(h[:, :n], h[:, n:])

    far = name_activation(gated(lambda g, u: nn.functional.silu(g.clamp(max=100.0)) * u), 2 * n, n, constants=[100.0])
    assert isinstance(far, str) and "unsupported activation" in far, far
    v4 = name_activation(gated(lambda g, u: nn.functional.silu(g.clamp(max=10.0)) * u.clamp(-10.0, 10.0)),
                         2 * n, n, constants=[10.0])
    assert v4 == {"activation": "swiglu_clamp", "interleaved": False, "alpha": 1.702, "limit": 10.0}
    skew = name_activation(gated(lambda g, u: nn.functional.silu(g.clamp(max=10.0)) * u.clamp(-9.0, 9.0)),
                           2 * n, n, constants=[10.0, 9.0])
    assert isinstance(skew, str), skew
    plain = name_activation(gated(lambda g, u: nn.functional.silu(g) * u), 2 * n, n, constants=[2048.0])
    assert plain["activation"] == "swiglu"  # large unrelated constants only widen the probe


def test_probe_names_soft_capped_swiglu():
    """Inkling2's SwiGLU soft-caps the gate's linear factor and up (not the sigmoid's input): named
    swiglu_softcap with (gate cap, up cap) read from the sub-graph's constants, in that order; caps
    swapped, or the sigmoid seeing the capped gate, are other functions and are rejected."""
    from moe_compiler.patterns.activation_probe import name_activation

    n = 8

    def cap(t, c):
        return torch.tanh(t / c) * c

    def gated(fn):
        return lambda h: fn(h[:, :n], h[:, n:])

    ok = name_activation(gated(lambda g, u: cap(g, 4.0) * torch.sigmoid(g) * cap(u, 25.0)), 2 * n, n, constants=[4.0, 25.0])
    assert ok == {"activation": "swiglu_softcap", "interleaved": False, "alpha": 4.0, "limit": 25.0}, ok
    inner = name_activation(gated(lambda g, u: nn.functional.silu(cap(g, 4.0)) * cap(u, 25.0)), 2 * n, n, constants=[4.0, 25.0])
    assert isinstance(inner, str) and "unsupported activation" in inner, inner


def test_probe_tolerance_follows_every_narrowing_cast():
    """An activation sub-graph that narrows by `.type_as(other)` is compared at that dtype's
    round-off, as one narrowing by `.to(dtype)` is (not at float64's, which would reject it)."""
    import torch.fx as fx

    from moe_compiler.patterns.activation_probe import _tolerance

    graph = fx.Graph()
    h, other = graph.placeholder("h"), graph.placeholder("other")
    h.meta["example_value"] = torch.empty(2, dtype=torch.float64)
    other.meta["example_value"] = torch.empty(2, dtype=torch.bfloat16)
    casts = [graph.call_method("type_as", (h, other)), graph.call_method("to", (h, torch.bfloat16))]
    for cast in casts:
        cast.meta["example_value"] = torch.empty(2, dtype=torch.bfloat16)
        assert _tolerance({h, cast}) == 4 * torch.finfo(torch.bfloat16).eps, cast.target
    assert _tolerance({h}) == 1e-10


def test_gelu_experts_are_geglu():
    """Not a negative: a different activation is probed and named, not assumed to be SwiGLU."""
    model = tiny_moe_model("qwen3_moe", hidden_act="gelu")
    ids = torch.randint(0, 128, (2, 8))
    eager = model(ids).logits
    with moe_compiler.capture() as report:
        got = compile_sonic(model, compiler="aot_eager")(ids).logits
    assert [r.details["activation"] for r in report.rewritten] == ["geglu", "geglu"], str(report)
    assert_close_to_eager(got, eager, what="logits")


def test_pattern_exception_falls_back(monkeypatch, caplog):
    """A bug inside a pattern costs the rewrite, never the user's step."""
    from moe_compiler import passes

    def broken(gm):
        raise RuntimeError("boom")

    monkeypatch.setitem(passes.FINDERS, "hf_grouped_mm", broken)
    model = tiny_moe_model("olmoe")
    ids = torch.randint(0, 128, (2, 8))
    compiled = torch.compile(model, backend="sonic", options={"sonic.compiler": "aot_eager"})
    with caplog.at_level(logging.WARNING, logger="moe_compiler"), moe_compiler.capture() as report:
        got = compiled(ids).logits
    assert report.records[0].status == "error" and "boom" in report.records[0].reason
    assert "graph left untouched" in caplog.text
    assert_close_to_eager(got, model(ids).logits, what="logits")


def test_rewrite_exception_restores_graph(monkeypatch, caplog):
    """A rewrite that fails half-way restores the original graph before compiling it."""
    from moe_compiler import passes
    from moe_compiler.patterns import common

    def broken_rewrite(gm, match, **kwargs):
        common.rewrite(gm, match, **kwargs)
        raise RuntimeError("rewrite exploded")

    monkeypatch.setattr(passes, "rewrite", broken_rewrite)
    model = tiny_moe_model("mixtral")
    ids = torch.randint(0, 128, (2, 8))
    compiled = torch.compile(model, backend="sonic", options={"sonic.compiler": "aot_eager"})
    with caplog.at_level(logging.WARNING, logger="moe_compiler"), moe_compiler.capture() as report:
        names_ok = compiled(ids).logits
    assert report.records[0].status == "error" and "rewrite exploded" in report.records[0].reason
    assert_close_to_eager(names_ok, model(ids).logits, what="logits")


def test_eager_experts_loop_gets_a_hint(caplog):
    """transformers' eager loop never becomes one graph: left alone, with a warning that says what to do."""
    model = tiny_moe_model("qwen3_moe")
    model.config._experts_implementation = "eager"
    ids = torch.randint(0, 128, (2, 8))
    with caplog.at_level(logging.WARNING, logger="moe_compiler"):
        report = _run(lambda t: model(t).logits, ids)
    assert not report.rewritten
    hints = [r for r in report.rejected if r.idiom == "hf_eager_loop"]
    assert hints and "'sonic'" in hints[0].reason and "register_hf_experts" in hints[0].reason, str(report)
    assert "register_hf_experts" in caplog.text


def test_a_region_that_switches_grad_mode_is_left_alone():
    """An experts loop whose first projections run under torch.no_grad: eager trains no w1/w3 and no
    x through them; the op, placed at the combine, would. The region is left alone with the reason,
    and the step (output and every gradient) is eager's."""
    import torch.nn.functional as F

    from .naive_models import LoopMoE

    torch.manual_seed(0)
    layer = LoopMoE(d=16, n=8, E=4, K=2)

    def fwd(x):
        _, w, ids = layer.route(x)
        out = torch.zeros_like(x)
        for e in range(layer.E):
            tok, k = torch.where(ids == e)
            expert = layer.experts[e]
            with torch.no_grad():
                h = F.silu(expert.w1(x[tok])) * expert.w3(x[tok])
            out.index_add_(0, tok, expert.w2(h) * w[tok, k, None])
        return out

    x = torch.randn(12, 16)

    def step(fn):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = fn(xi)
        out.sum().backward()
        return out.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()}

    want = step(fwd)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), moe_compiler.capture() as report:
        got = step(torch.compile(fwd, backend="sonic", options={"sonic.compiler": "aot_eager"}))
    assert not report.rewritten and any("under another grad mode" in r.reason for r in report.rejected), str(report)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    for name, grad in want[2].items():
        assert (got[2][name] is None) == (grad is None), name
        if grad is not None:
            torch.testing.assert_close(got[2][name], grad)
