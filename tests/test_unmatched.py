"""`explain` on graphs where no idiom found a candidate (`patterns.unmatched`): a router that reaches
expert weights is reported with the closest idiom, a capacity-limited router with the reason it is
left alone, and a top-k that feeds no experts with nothing."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import moe_compiler

T, d, n, E, K = 12, 16, 8, 4, 2


class CapacityTop1(nn.Module):
    """Switch-style top-1 routing with an expert capacity: tokens past it pass nothing."""

    def __init__(self, capacity=4):
        super().__init__()
        self.capacity = capacity
        self.gate = nn.Linear(d, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, n), nn.ReLU(), nn.Linear(n, d)) for _ in range(E))

    def forward(self, x):
        p, ids = self.gate(x).softmax(-1).max(-1)
        mask = F.one_hot(ids, E)
        position = torch.cumsum(mask, 0) * mask  # 1-based rank of each token within its expert
        kept = (position <= self.capacity).all(-1)
        out = torch.zeros_like(x)
        for e in range(E):
            chosen = (ids == e) & kept
            out[chosen] = self.experts[e](x[chosen]) * p[chosen, None]
        return out


class ConcatenatedLinearExperts(nn.Module):
    """Every expert on every token, the up projections as one Linear over all experts' weights
    (`F.linear(x, W.reshape(E * n, d)).view(T, E, n)`): a packed first projection, token-major."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(d, E, bias=False)
        self.w1, self.w3 = nn.Parameter(torch.randn(E, n, d)), nn.Parameter(torch.randn(E, n, d))
        self.w2 = nn.Parameter(torch.randn(E, d, n))

    def forward(self, x):
        w, ids = torch.topk(self.gate(x).softmax(-1), K)
        gates = torch.zeros(x.shape[0], E).scatter(1, ids, w)
        g = F.linear(x, self.w1.reshape(E * n, d)).view(-1, E, n)
        u = F.linear(x, self.w3.reshape(E * n, d)).view(-1, E, n)
        y = torch.einsum("ten,edn->ted", F.silu(g) * u, self.w2)
        return (gates.unsqueeze(-1) * y).sum(1)


class NormedTensordotExperts(nn.Module):
    """Every expert on every token through `torch.tensordot`, a layer norm between its projections:
    no finder reads tensordot, and no activation the op computes is a normalisation."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(d, E, bias=False)
        self.w1, self.w2 = nn.Parameter(torch.randn(E, n, d)), nn.Parameter(torch.randn(E, d, n))

    def forward(self, x):
        w, ids = torch.topk(self.gate(x).softmax(-1), K)
        gates = torch.zeros(x.shape[0], E).scatter(1, ids, w)
        h = F.layer_norm(torch.tensordot(x, self.w1, dims=([1], [2])), (n,))  # [T, E, n]
        y = torch.einsum("ten,edn->ted", h, self.w2)
        return (gates.unsqueeze(-1) * y).sum(1)


def _explain(model):
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        return moe_compiler.explain(model, torch.randn(T, d))


def test_a_capacity_limited_router_is_left_alone_with_its_reason():
    report = _explain(CapacityTop1())
    (record,) = report.records
    assert record.status == "rejected" and record.idiom == "unmatched"
    assert "capacity-limited" in record.reason and "left alone" in record.reason


def test_an_unrecognised_experts_layer_names_the_closest_idioms():
    (record,) = _explain(NormedTensordotExperts()).records
    assert record.idiom == "unmatched" and "E=4 experts" in record.reason, record.reason
    assert "w1" in record.reason and "tensordot" in record.reason and "dense_bmm" in record.reason, record.reason
    # the evaluated finder's hypotheses, none equal, are named with it
    assert "evaluated: no hypothesis evaluated equal" in record.reason, record.reason


def test_a_packed_token_major_layer_is_rewritten():
    """`ConcatenatedLinearExperts` reaches dense_bmm through the canonical forms: the packed Linear
    as an einsum over the stacked weights, the token-major products as bmms over E."""
    model = ConcatenatedLinearExperts()
    x = torch.randn(T, d)
    report = _explain(model)
    assert [(r.idiom, r.status) for r in report.records] == [("dense_bmm", "rewritten")], report.records
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = torch.compile(model, backend="sonic")(x)
    torch.testing.assert_close(got, model(x))


def test_a_top_k_that_feeds_no_experts_is_not_reported():
    class Sampler(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(d, 50)
            self.mlp = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))

        def forward(self, x):
            values, ids = torch.topk(self.head(self.mlp(x)), 5)
            return values.softmax(-1), ids

    report = _explain(Sampler())
    assert report.records == [] and "no MoE candidate found" in str(report)


def test_transformers_switch_router_is_named_capacity_limited():
    """Switch Transformers' top-1 router drops tokens past `expert_capacity`; its experts loop sits in
    another graph (a graph break), and the router's graph alone says why the layer is left alone."""
    from transformers import SwitchTransformersConfig
    from transformers.models.switch_transformers import modeling_switch_transformers as switch

    config = SwitchTransformersConfig(d_model=32, d_ff=64, num_experts=4, expert_capacity=4, num_layers=2,
                                      num_heads=4, d_kv=8)
    torch.manual_seed(0)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        report = moe_compiler.explain(switch.SwitchTransformersSparseMLP(config), torch.randn(2, 8, 32))
    assert not report.rewritten
    capacity = [r for r in report.records if r.idiom == "unmatched"]
    assert len(capacity) == 1 and "capacity-limited" in capacity[0].reason, str(report)


class SkipsIdleExperts(nn.Module):
    """A per-expert loop that skips an expert without tokens (`if rows.numel() == 0: continue`): a
    branch on a data-dependent size, so Dynamo cannot keep the loop in one graph."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(d, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, n), nn.SiLU(), nn.Linear(n, d)) for _ in range(E))

    def forward(self, x):
        w, ids = self.gate(x).softmax(-1).topk(K, -1)
        out = torch.zeros_like(x)
        for e in range(E):
            rows, slot = torch.where(ids == e)
            if rows.numel() == 0:
                continue
            out.index_add_(0, rows, self.experts[e](x[rows]) * w[rows, slot, None])
        return out


def test_explain_names_the_graph_break_that_hides_a_layer():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        report = moe_compiler.explain(SkipsIdleExperts(), torch.randn(T, d))
    assert not report.rewritten
    text = str(report)
    assert "Data-dependent branching" in text and "frame skipped: forward" in text, text


class SkipsIdleExpertsOwnRouter(SkipsIdleExperts):
    """The same loop behind a router module of its own (makeMoE's NoisyTopkRouter): Dynamo leaves the
    layer's frame to Python and compiles the router and each expert apart."""

    def __init__(self):
        super().__init__()
        self.router = Router()

    def forward(self, x):
        w, ids = self.router(x)
        out = torch.zeros_like(x)
        for e in range(E):
            mask = (ids == e).any(-1)
            if mask.any():
                out[mask] += self.experts[e](x[mask]) * (w * (ids == e)).sum(-1, keepdim=True)[mask]
        return out


class Router(nn.Module):
    def __init__(self, scores=E):
        super().__init__()
        self.gate = nn.Linear(d, scores, bias=False)

    def forward(self, x):
        return self.gate(x).softmax(-1).topk(K, -1)


@pytest.mark.parametrize("make", [SkipsIdleExperts, SkipsIdleExpertsOwnRouter])
def test_a_compiled_layer_split_by_a_branch_reports_the_break_and_what_to_change(make):
    """Under torch.compile too (not only `explain`): the break, why, and the branch to drop; a
    router compiled apart is named, its ids leaving its graph."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True), \
            moe_compiler.capture() as report:
        torch.compile(make(), backend="sonic")(torch.randn(T, d))
    text = str(report)
    assert not report.rewritten and "Data-dependent branching" in text and "an expert run on zero rows" in text, text
    routers = [r for r in report.rejected if "its ids leave this graph" in r.reason]
    assert len(routers) == (make is SkipsIdleExpertsOwnRouter), text


def test_a_top_k_over_a_vocabulary_returned_from_its_graph_is_no_router():
    """A graph break in sight, but 2048 scores: a vocabulary's top-k, not a router's."""
    class Sampling(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = Router(scores=2048)

        def forward(self, x):
            values, ids = self.router(x)
            torch._dynamo.graph_break()
            return values * 2, ids

    torch._dynamo.reset()
    with moe_compiler.capture() as report:
        torch.compile(Sampling(), backend="sonic")(torch.randn(T, d))
    assert report.graph_breaks and not report.records, str(report)


def test_explain_lists_no_graph_break_where_there_is_none():
    torch._dynamo.reset()
    report = moe_compiler.explain(ConcatenatedLinearExperts(), torch.randn(T, d))
    assert report.graphs == 1 and report.graph_breaks == [] and "graph breaks" not in str(report), str(report)
