"""The `grouped_rows` idiom: experts over rows that arrive grouped by expert (grouped_mm over offsets,
no router in the graph), as torchtitan's and torchtune's GroupedExperts run behind a dispatch.

The idiom is opt-in (`sonic.patterns` naming it; the tests pass every pattern).
`torch._grouped_mm` compiles in bf16 only on the CPU: every case runs in bf16 against the fp32 model,
as close to it as eager bf16 is. Rows past the last offset are padding: grouped_mm leaves them
unwritten, the op writes zeros there; only the rows of a group are compared with eager.
"""
from __future__ import annotations

import pytest
import torch

import moe_compiler
from moe_compiler.options import PATTERNS

from .helpers import assert_close_to_eager
from .naive_models import GroupedRowsExperts, SortedGroupedMoE
from .test_naive_patterns import _compile, _inputs
from .test_sorted_grouped_mm import NEGATIVE as SORTED_NEGATIVE

IDIOM = "grouped_rows"
R, D, E = 24, 16, 4

VARIANTS = {
    "torchtitan": dict(),  # w1, w3, w2 [E, out, in], transposed in each call
    "fused": dict(gate_up="fused"),
    "torchtune-in_out": dict(orient="in_out"),
    "in_out-fused": dict(orient="in_out", gate_up="fused"),
    "cast-offsets": dict(offsets="cast"),
    "fp32-params-bf16-casts": dict(casts=True),  # torchtitan 0.2.0: parameters in fp32, products in bf16
}

COUNTS = {  # rows per expert, R rows in all (padding past the last group where they sum to less)
    "full": [7, 5, 8, 4],
    "padded": [3, 6, 0, 9],  # 6 rows of padding
    "idle": [0, 12, 12, 0],
    "one-expert": [0, 0, 24, 0],
    "no-rows": [0, 0, 0, 0],
}


def _run(model, rows, counts, cotangent, params=None):
    rows = rows.detach().requires_grad_()
    out = model(rows, counts)
    params = dict(model.named_parameters()) if params is None else params
    grads = torch.autograd.grad((out.float() * cotangent.float()).sum(), [rows, *params.values()])
    return out.detach(), dict(zip(["rows", *params], grads))


def _check(kwargs, counts, compiler="aot_eager", device="cpu"):
    """(report, used rows): compiled bf16 against eager bf16 and the fp32 model, output and every
    gradient; the op's padding rows are zeros."""
    torch.manual_seed(0)
    model = GroupedRowsExperts(d=D, E=E, **kwargs).to(device)
    fp32 = GroupedRowsExperts(d=D, E=E, **dict(kwargs, casts=False)).to(device)
    fp32.load_state_dict(model.state_dict())
    if not kwargs.get("casts"):
        model = model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x, cot = torch.randn(R, D, generator=g).to(device), torch.randn(R, D, generator=g).to(device)
    low = torch.float32 if kwargs.get("casts") else torch.bfloat16
    counts = torch.tensor(counts, device=device)
    used = int(counts.sum())
    truth = _run(fp32, x, counts, cot)
    eager = _run(model, x.to(low), counts, cot.to(low))
    with moe_compiler.capture() as report:
        got = _run(_compile(model, compiler, patterns=PATTERNS), x.to(low), counts, cot.to(low), dict(model.named_parameters()))
    assert [r.idiom for r in report.rewritten] == [IDIOM], str(report)
    assert_close_to_eager(got[0][:used], eager[0][:used], truth[0][:used], torch.bfloat16, "output")
    assert torch.count_nonzero(got[0][used:]) == 0, "padding rows are not zeros"
    for name in truth[1]:
        g_, e_, t_ = (grads[1][name] for grads in (got, eager, truth))
        if name == "rows":
            g_, e_, t_ = g_[:used], e_[:used], t_[:used]
            assert torch.count_nonzero(got[1]["rows"][used:]) == 0, "padding rows have a gradient"
        assert_close_to_eager(g_, e_, t_, torch.bfloat16, f"grad {name}")
    return report


@pytest.mark.parametrize("variant", VARIANTS)
def test_grouped_rows_match_eager_cpu_bf16(variant):
    _check(VARIANTS[variant], COUNTS["padded"])


@pytest.mark.parametrize("counts", COUNTS)
def test_grouped_rows_any_counts_cpu_bf16(counts):
    """Idle experts, every row on one expert, padding, no row at all: the op's expert of each row
    and its padding agree with grouped_mm's groups."""
    _check(VARIANTS["torchtitan"], COUNTS[counts])


def test_grouped_rows_inductor_cpu_bf16():
    _check(VARIANTS["torchtitan"], COUNTS["full"], compiler="inductor")


def test_grouped_rows_report():
    report = _check(VARIANTS["torchtitan"], COUNTS["full"])
    details = report.rewritten[0].details
    assert details["layout"] == "separate gate/up (two stacked parameters), rows grouped by expert upstream (offsets)"
    assert details["router"].startswith("none: rows grouped by expert upstream"), details
    assert details["verified"] == "evaluated equal on 4 routings", details
    assert details["token_rounding"] == "off", details


class _UpReadsOtherRows(GroupedRowsExperts):
    """The up projection reads other rows than the gate: not the op's experts."""

    def forward(self, rows, counts):
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = torch.nn.functional.silu(self._mm(rows, self.w1, offs)) * self._mm(rows.flip(0), self.w3, offs)
        return self._mm(h, self.w2, offs)


class _RowsOutsideTheGroups(GroupedRowsExperts):
    """The down projection's rows are shifted by one against the groups the offsets give."""

    def forward(self, rows, counts):
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = torch.nn.functional.silu(self._mm(rows, self.w1, offs)) * self._mm(rows, self.w3, offs)
        return self._mm(h.roll(1, 0), self.w2, offs)


@pytest.mark.parametrize("make, reason", [
    (_UpReadsOtherRows, "the up projections read different rows"),
    (_RowsOutsideTheGroups, "roll"),
])
def test_grouped_rows_negative_untouched(make, reason):
    torch.manual_seed(0)
    model = make(d=D, E=E).to(torch.bfloat16)
    x = torch.randn(R, D, dtype=torch.bfloat16)
    counts = torch.tensor(COUNTS["full"])
    with torch.no_grad():
        want = model(x, counts)
        with moe_compiler.capture() as report:
            got = _compile(model, patterns=PATTERNS)(x, counts)
    assert not report.rewritten and report.rejected, str(report)
    assert any(reason in r.reason for r in report.rejected), str(report)
    assert torch.equal(got, want)


@pytest.mark.parametrize("case", ["histc-range", "scattered-by-perm", "library-op-max"])
def test_experts_of_a_layer_sorted_grouped_mm_leaves_alone(case):
    """A layer `sorted_grouped_mm` leaves alone (its routing or combine is not the op's) still has
    its experts rewritten here, the rest of the layer as written: the output is eager's."""
    kwargs, reason = SORTED_NEGATIVE[case]
    torch.manual_seed(0)
    model = SortedGroupedMoE(**kwargs).to(torch.bfloat16)
    x = _inputs()[0].to(torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        with moe_compiler.capture() as report:
            got = _compile(model, patterns=PATTERNS)(x)
    assert [r.idiom for r in report.rewritten] == [IDIOM], str(report)
    assert any(r.idiom == "sorted_grouped_mm" and reason in r.reason for r in report.rejected), str(report)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_grouped_rows_is_opt_in_and_the_report_says_how():
    """Without `sonic.patterns` naming it, rows grouped upstream keep torch's grouped GEMMs, and the
    report says which option would rewrite them (a warning)."""
    torch.manual_seed(0)
    model = GroupedRowsExperts(d=D, E=E).to(torch.bfloat16)
    x, counts = torch.randn(R, D, dtype=torch.bfloat16), torch.tensor(COUNTS["full"])
    with torch.no_grad(), moe_compiler.capture() as report:
        _compile(model)(x, counts)
    assert not report.rewritten, str(report)
    (hint,) = [r for r in report.rejected if r.idiom == IDIOM]
    assert hint.hint and "opt-in grouped_rows" in hint.reason and "moe_compiler.options.PATTERNS" in hint.reason


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["torchtitan", "fused", "torchtune-in_out"])
def test_grouped_rows_gpu_bf16(variant):
    _check(VARIANTS[variant], COUNTS["padded"], compiler="inductor", device="cuda")
