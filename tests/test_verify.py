"""Verification by evaluation (`patterns.verify`): a region is rewritten only if it computes the op's
value on every routing; each routing catches what only it exposes; the driver refuses a finder's
wrong proposal.

The regions here are written as plain functions over (x, ids, w, w1, w2), or (x, offs, w1, w2) for
rows grouped upstream, traced by Dynamo and handed to `verify` as matches, so that a mutation can
sit anywhere, including where no finder looks.
"""
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from moe_compiler.patterns import verify as verify_module
from moe_compiler.patterns.common import MoEMatch, NoMatch
from moe_compiler.patterns.verify import ROUTINGS, _routing, verify

T, d, n, E, K = 12, 8, 6, 5, 2


def dense_moe(x, ids, w, w1, w2):
    """Every expert on every token, each token's weight of expert e as (w * (ids == e)).sum(-1)."""
    out = torch.zeros_like(x)
    for e in range(E):
        gate, up = (x @ w1[e].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].t()
        out = out + (w * (ids == e)).sum(-1, keepdim=True) * y
    return out


def counts(ids):
    return torch.bincount(ids.flatten(), minlength=E)


MUTANTS = {  # name: (region, the routing that must catch it, or None for the first one)
    "gelu instead of silu": (lambda x, ids, w, w1, w2: _act_mutant(x, ids, w, w1, w2), "random"),
    "one weight column for every k": (lambda x, ids, w, w1, w2: dense_moe(x, ids, w[:, :1].expand(-1, K), w1, w2),
                                      "random"),
    "wrong only when an expert is idle": (lambda x, ids, w, w1, w2: dense_moe(x, ids, w, w1, w2)
                                          + x * (counts(ids) == 0).any(), "idle"),
    "wrong only when one expert takes every token": (lambda x, ids, w, w1, w2: dense_moe(x, ids, w, w1, w2)
                                                     + x * (counts(ids).max() == T), "crowded"),
    "wrong only on descending ids with tied weights": (lambda x, ids, w, w1, w2: dense_moe(x, ids, w, w1, w2)
                                                       + x * (ids[:, 0] > ids[:, 1]).all(), "ordered"),
}


def _act_mutant(x, ids, w, w1, w2):
    out = torch.zeros_like(x)
    for e in range(E):
        gate, up = (x @ w1[e].t()).chunk(2, dim=-1)
        out = out + (w * (ids == e)).sum(-1, keepdim=True) * ((F.gelu(gate) * up) @ w2[e].t())
    return out


def traced_match(fn, dtype=torch.float32) -> MoEMatch:
    """`fn` traced by Dynamo, as a match whose region is every node between its five inputs and its output."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    args = (torch.randn(T, d, dtype=dtype), torch.randint(0, E, (T, K)), torch.rand(T, K, dtype=dtype),
            torch.randn(E, 2 * n, d, dtype=dtype), torch.randn(E, d, n, dtype=dtype))
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    (gm,) = graphs
    inputs = {node.name: node for node in gm.graph.nodes if node.op == "placeholder"}
    x, ids, w, w1, w2 = (inputs[f"l_{name}_"] for name in ("x", "ids", "w", "w1", "w2"))
    anchor = next(node for node in gm.graph.nodes if node.op == "output").args[0]
    anchor = anchor[0] if isinstance(anchor, (tuple, list)) else anchor
    region = {node for node in gm.graph.nodes if node.op in ("call_function", "call_method")} - {anchor}
    return MoEMatch(idiom="test", module="test", anchor=anchor, region=region, x=x, topk_ids=ids, topk_weights=w,
                    w1=w1, w2=w2, shape={"T": T, "d": d, "n": n, "E": E, "K": K}, dtype=dtype)


@pytest.fixture(autouse=True)
def fresh_cache():
    verify_module._cache.clear()
    yield
    verify_module._cache.clear()


def test_a_region_that_computes_the_op_verifies():
    assert verify(traced_match(dense_moe)) == f"evaluated equal on {len(ROUTINGS)} routings"


def test_float_casts_evaluate_as_float64():
    """A region that rounds through bfloat16 computes the op's value: the rounding is dtype policy."""
    def rounded(x, ids, w, w1, w2):
        return dense_moe(x.bfloat16().float(), ids, w.to(torch.bfloat16).float(), w1, w2)

    assert verify(traced_match(rounded)).startswith("evaluated equal")


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_region_that_differs_in_one_place_is_refused_by_its_routing(name):
    fn, routing = MUTANTS[name]
    with pytest.raises(NoMatch, match=f"region differs: {routing} routing"):
        verify(traced_match(fn))


def test_routings_have_the_properties_they_promise():
    g = torch.Generator().manual_seed(1)
    for routing in ROUTINGS:
        ids, w = _routing(routing, 40, 3, 6, g)
        assert ids.shape == (40, 3) and ids.min() >= 0 and ids.max() < 6
        assert all(len(set(row.tolist())) == 3 for row in ids), f"{routing}: ids repeat within a token"
        if routing == "idle":
            assert not ((ids == 0) | (ids == 5)).any()
        if routing == "crowded":
            assert (ids == 3).any(1).all()
        if routing == "ordered":
            assert (ids[:, :-1] > ids[:, 1:]).all() and (w == w[0, 0]).all()


def test_a_region_that_cannot_run_on_its_own_is_refused(monkeypatch):
    match = traced_match(dense_moe)
    broken = next(node for node in match.region if node.target is F.silu)
    broken.target = lambda *a: (_ for _ in ()).throw(RuntimeError("no kernel"))
    with pytest.raises(NoMatch, match="cannot be evaluated on its own"):
        verify(match)


def test_deterministic_mode_is_kept_and_restored():
    """Under torch.use_deterministic_algorithms(True) the evaluation runs (CUDA's index_add would
    raise there), and the user's setting is back afterwards."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert verify(traced_match(dense_moe)).startswith("evaluated equal")
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_region_over_the_cost_cap_keeps_the_structural_proof(monkeypatch):
    monkeypatch.setitem(verify_module.MAX_FLOPS, "cpu", 1.0)
    assert verify(traced_match(dense_moe)).startswith("structural only")


def test_identical_regions_are_evaluated_once(monkeypatch):
    calls = []
    real = verify_module._Region.evaluate
    monkeypatch.setattr(verify_module._Region, "evaluate", lambda self: calls.append(1) or real(self))
    verify(traced_match(dense_moe))
    torch._dynamo.reset()
    verify(traced_match(dense_moe))
    assert len(calls) == 1


class TopKLoop(torch.nn.Module):
    """A Mixtral-style expert loop the `expert_loop` finder rewrites."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(d, E, bias=False)
        self.w1 = torch.nn.ModuleList(torch.nn.Linear(d, n, bias=False) for _ in range(E))
        self.w3 = torch.nn.ModuleList(torch.nn.Linear(d, n, bias=False) for _ in range(E))
        self.w2 = torch.nn.ModuleList(torch.nn.Linear(n, d, bias=False) for _ in range(E))

    def forward(self, x):
        w, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        for e in range(E):
            k, tok = torch.where(mask[e])
            y = self.w2[e](F.silu(self.w1[e](x[tok])) * self.w3[e](x[tok]))
            out.index_add_(0, tok, y * w[tok, k, None])
        return out


def test_the_driver_refuses_a_finders_wrong_proposal(monkeypatch):
    """A finder that misreads the activation proposes a wrong rewrite; evaluation refuses it and the
    compiled module stays equal to eager."""
    from moe_compiler import passes
    from moe_compiler.diagnostics import capture

    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    real = passes.FINDERS["expert_loop"]

    def misreading(gm: fx.GraphModule):
        found = real(gm)
        for m in found:
            if isinstance(m, MoEMatch):
                m.activation = "geglu"
        return found

    monkeypatch.setitem(passes.FINDERS, "expert_loop", misreading)
    torch.manual_seed(0)
    model, x = TopKLoop(), torch.randn(T, d)
    try:
        compiled = torch.compile(model, backend="sonic", options={"sonic.compiler": "eager", "sonic.fallback": False})
        with capture() as report:
            torch.testing.assert_close(compiled(x), model(x))
    finally:
        torch._dynamo.config.capture_dynamic_output_shape_ops = False
    (record,) = [r for r in report.records if r.idiom == "expert_loop"]
    assert record.status == "rejected" and "evaluated against the op, the region differs" in record.reason


def test_bench_verify_smoke(tmp_path):
    """benchmarks/bench_verify.py at a tiny shape on the CPU: both rows, the region rewritten, verified."""
    import json
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_verify

    bench_verify.main(["--shapes", "tiny", "--device", "cpu", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "verify.json").read_text())["rows"]
    assert [(r["verify"], r["rewritten"]) for r in rows] == [(True, 1), (False, 1)]
    assert rows[0]["outcome"] == f"evaluated equal on {len(ROUTINGS)} routings" and rows[1]["outcome"] == "-"


_HELD_OUT_LAYER = """
import torch
import torch.nn as nn

IS_MOE = True
DESCRIPTION = "a top-2 loop over experts"


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(4))

    def forward(self, x):
        w, ids = self.router(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e in range(4):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


def make():
    torch.manual_seed(0)
    return Layer(), torch.randn(6, 8)
"""


def test_bench_heldout_smoke(tmp_path):
    """benchmarks/bench_heldout.py on two layers it writes: a top-2 loop rewritten, equal to eager."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_heldout

    (tmp_path / "a01_loop.py").write_text(_HELD_OUT_LAYER)
    line = bench_heldout.check(str(tmp_path / "a01_loop.py"))
    assert line.split()[:3] == ["OK", "a01_loop", "rewritten=1"], line
    errors = [float(part.split("=")[1]) for part in line.split() if part.startswith(("out=", "grad="))]
    assert len(errors) == 2 and max(errors) < 1e-5, line


def grouped_rows(x, offs, w1, w2):
    """The experts over rows grouped by expert (grouped_mm's offsets), as `grouped_rows` finds them."""
    g, u = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs=offs)


def _group_sizes(offs):
    return torch.diff(offs, prepend=torch.zeros_like(offs[:1]))


GROUPED_MUTANTS = {  # name: (region, the offsets routing that must catch it)
    "a padding row written": (lambda x, offs, w1, w2: grouped_rows(x, offs, w1, w2)
                              + x * (torch.arange(x.shape[0]) >= offs[-1]).unsqueeze(1), "random"),
    "wrong only when an expert is idle": (lambda x, offs, w1, w2: grouped_rows(x, offs, w1, w2)
                                          + x * (_group_sizes(offs) == 0).any(), "idle"),
    "wrong only when one expert takes every row": (lambda x, offs, w1, w2: grouped_rows(x, offs, w1, w2)
                                                   + x * (_group_sizes(offs).max() == x.shape[0]), "crowded"),
    "gate and up swapped": (lambda x, offs, w1, w2: _swapped(x, offs, w1, w2), "random"),
}


def _swapped(x, offs, w1, w2):
    g, u = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(u) * g, w2.transpose(-2, -1), offs=offs)


def traced_grouped_match(fn) -> MoEMatch:
    """`fn` over (x, offs, w1, w2) traced by Dynamo in bf16 (grouped_mm traces in bf16 only on the
    CPU), as a grouped-rows match: the offsets in place of the ids, no weights."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    R, dg, ng = 3 * T, 16, 8  # grouped_mm wants 16-byte strides
    args = (torch.randn(R, dg, dtype=torch.bfloat16), torch.tensor([4, 9, 9, 20, 30], dtype=torch.int32),
            torch.randn(E, 2 * ng, dg, dtype=torch.bfloat16), torch.randn(E, dg, ng, dtype=torch.bfloat16))
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    (gm,) = graphs
    inputs = {node.name: node for node in gm.graph.nodes if node.op == "placeholder"}
    x, offs, w1, w2 = (inputs[f"l_{name}_"] for name in ("x", "offs", "w1", "w2"))
    anchor = next(node for node in gm.graph.nodes if node.op == "output").args[0]
    anchor = anchor[0] if isinstance(anchor, (tuple, list)) else anchor
    region = {node for node in gm.graph.nodes if node.op in ("call_function", "call_method")} - {anchor}
    return MoEMatch(idiom="test", module="test", anchor=anchor, region=region, x=x, topk_ids=offs, topk_weights=None,
                    w1=w1, w2=w2, shape={"T": R, "d": dg, "n": ng, "E": E, "K": 1}, dtype=torch.bfloat16,
                    group_offsets=True)


def test_experts_over_grouped_rows_verify():
    assert verify(traced_grouped_match(grouped_rows)) == f"evaluated equal on {len(ROUTINGS)} routings"


@pytest.mark.parametrize("name", list(GROUPED_MUTANTS))
def test_grouped_rows_that_differ_in_one_place_are_refused_by_their_routing(name):
    fn, routing = GROUPED_MUTANTS[name]
    with pytest.raises(NoMatch, match=f"region differs: {routing} routing"):
        verify(traced_grouped_match(fn))
