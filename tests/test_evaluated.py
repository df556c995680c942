"""The `evaluated` finder (`patterns.evaluated`): stacked experts no finder reads, rewritten only
where a hypothesis of the op's arguments evaluates equal to the region; lookalikes stay."""
from __future__ import annotations

import operator

import pytest
import torch

import moe_compiler.patterns.indices as indices
import moe_compiler.patterns.verify as verify

import moe_compiler

from .helpers import assert_close_to_eager
from .naive_models import (AssignedRowsSwitchMoE, CapacityDispatchMoE, MaskedRowsAddedMoE, CapacityListMoE, CapacityTop2MoE, EveryTokenListMoE, GatheredMoE,
                           GroupedTokensMoE, PermutedTop1MoE, SlotGatherMoE, SlotPriorityCapacityMoE,
                           SortedRowsGatheredMoE, StackedLoopMoE, TokenMajorMoE)
from .test_naive_patterns import FLAG, _check_gpu_bf16, _check_rewrite, _compile, _inputs, _out_and_grads, assert_left_alone


@pytest.mark.parametrize("bias", [True, False])
def test_switch_dispatch_that_cannot_drop_is_found_by_evaluation(bias):
    # [T, E, C] one-hot dispatch and combine, C = T: every token keeps its slot, so it is the op
    report = _check_rewrite(CapacityDispatchMoE(bias=bias), "evaluated", op="sonic::moe_experts")
    assert report.rewritten[0].details["verified"].startswith("evaluated equal"), str(report)


@pytest.mark.parametrize("make", [
    lambda: CapacityDispatchMoE(capacity="half"),
    lambda: CapacityDispatchMoE(capacity=2),  # 12 tokens, 4 experts of 2 slots: at least 4 tokens dropped
    lambda: CapacityDispatchMoE(capacity=2, bias=False, dispatch="positive"),
    # a dropped token keeps its input (transformers' Switch Transformers): that add stays in the graph
    lambda: CapacityDispatchMoE(capacity=2, dropped="passthrough"),
    lambda: CapacityDispatchMoE(capacity=2, bias="rows"),  # [E, 1, w] biases: the op reads their [E, w] views
], ids=["half", "two", "positive", "passthrough", "row-biases"])
def test_switch_dispatch_that_drops_tokens_is_found_with_its_kept_slots(make):
    """Slots past an expert's capacity add nothing: the region's own kept-slot values say which,
    and the op drops the others (the crowded routing drops tokens; so do these inputs)."""
    report = _check_rewrite(make(), "evaluated", op="sonic::moe_experts")
    assert "capacity dropped" in report.rewritten[0].details["layout"], str(report)


@pytest.mark.parametrize("masks,counts", [("expert", "int"), ("token", "int"), ("expert", "float")])
def test_gshard_top2_with_capacity_is_found_with_each_slots_kept_mask(masks, counts):
    """Second choices counted after every first choice: one kept mask per slot (24 slots, 16 places:
    at least 8 dropped on these inputs)."""
    report = _check_rewrite(CapacityTop2MoE(masks=masks, counts=counts), "evaluated", op="sonic::moe_experts")
    assert "capacity dropped" in report.rewritten[0].details["layout"], str(report)


@pytest.mark.parametrize("capacity,K", [(1, 2), (4, 2), (1, 1), (4, 1)], ids=["drops", "no-drop", "top1-drops", "top1"])
def test_tokens_kept_in_groups_are_found_with_each_groups_capacity(capacity, K):
    """[G, S] tokens never flattened: the op runs on their [T, .] views, each group's kept slots
    flattened as its ids are (3 groups of 4 tokens, 4K slots a group in 4C places: C = 1 drops at
    least 4 of 8 slots, or 0 to 3 of a top-1's 4, C = 4 none). The top-1 weighs by `amax` of the
    probabilities, read as the values of the argmax's max."""
    report = _check_rewrite(GroupedTokensMoE(capacity=capacity, K=K), "evaluated", op="sonic::moe_experts")
    assert ("capacity dropped" in report.rewritten[0].details["layout"]) == (capacity == 1), str(report)


def test_slot_priority_capacity_over_a_flat_buffer_is_found_with_its_flat_kept_slots():
    """Positions counted over the flattened slots, kept as one [T * K] flag: 24 slots, 16 places."""
    report = _check_rewrite(SlotPriorityCapacityMoE(), "evaluated", op="sonic::moe_experts_split")
    assert "capacity dropped" in report.rewritten[0].details["layout"], str(report)


@pytest.mark.parametrize("options", [
    dict(),  # GShard top-2, fairseq-style chunks zipped with the experts, DeepSpeed's [T, E] combine weights
    dict(K=1),  # DeepSpeed's top1gating
    dict(weights="columns"),  # one [T] weight per slot, the later one computed after the first is read
    dict(act="swiglu"),  # gate, up and down Linears
    dict(capacity=12),  # C = T: nothing to drop
], ids=["top2", "top1", "columns", "swiglu", "no-drop"])
def test_capacity_dispatch_into_module_list_experts_is_found_by_evaluation(options):
    """E experts' Linears on [E, C, d] buffers: their weights as per-expert lists, each expert's in
    the order read; the weights a [T, E] matrix read at the ids (filled outside them in the
    evaluation) or one column per slot; 24 slots in 16 places (K=1: 12 tokens in 16) on these inputs."""
    report = _check_rewrite(CapacityListMoE(**options), "evaluated", op="sonic::moe_experts_list")
    assert "per-expert list" in report.rewritten[0].details["layout"], str(report)


def test_module_list_experts_on_every_token_are_found_by_evaluation():
    """Each expert's Linears read every token (no rows dispatched), its weight summed over the slots:
    the Linears are found among what feeds the combine."""
    report = _check_rewrite(EveryTokenListMoE(), "evaluated", op="sonic::moe_experts_list")
    assert "per-expert list" in report.rewritten[0].details["layout"], str(report)


@pytest.mark.parametrize("capacity", [3, 16], ids=["drops", "no-drop"])
def test_rows_assigned_into_a_buffer_of_zeros_are_found_by_evaluation(capacity):
    """`out[sel] = expert(x[sel])` into zeros, scaled after the loop: the writes are followed to what
    reads the buffer after them, and run with the region; the argmax's `max` and the router's own
    `max(probs).values` are one node (`merge_duplicate_reductions`), so the weights are the max's."""
    report = _evaluated_equal_to_eager(AssignedRowsSwitchMoE(capacity=capacity), torch.randn(2, 16, 16),
                                       torch.randn(2, 16, 16))
    assert ("capacity dropped" in report.rewritten[0].details["layout"]) == (capacity == 3), str(report)


def _evaluated_equal_to_eager(model, x, cotangent, **flags):
    """fp32 training through backend="sonic": one region rewritten, by the evaluated finder, output
    and every gradient equal to eager; the report. `flags`: Dynamo's config while it runs (by
    default `capture_dynamic_output_shape_ops`)."""
    params = dict(model.named_parameters())
    with torch._dynamo.config.patch(**(flags or {FLAG: True})):
        eager = _out_and_grads(model, x, cotangent, params)
        with moe_compiler.capture() as report:
            got = _out_and_grads(_compile(model, "aot_eager"), x, cotangent, params)
    assert [r.idiom for r in report.rewritten] == ["evaluated"], str(report)
    assert_close_to_eager(got[0], eager[0], what="output")
    for name in eager[1]:
        assert_close_to_eager(got[1][name], eager[1][name], what=f"grad {name}")
    return report


def test_rows_added_in_place_into_a_returned_buffer_are_found_by_evaluation():
    """makeMoE's combine: `out[hit] += y` into zeros with a [B, S] mask, rows from the flat view; the
    buffer is the result (an in-place combine: `MoEMatch.accumulator`), read after the last write."""
    report = _evaluated_equal_to_eager(MaskedRowsAddedMoE(), torch.randn(2, 6, 16), torch.randn(2, 6, 16))
    assert "per-expert list" in report.rewritten[0].details["layout"], str(report)


def test_an_in_place_combine_read_half_way_stays(caplog):
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(MaskedRowsAddedMoE(read="between"), torch.randn(2, 6, 16), "no hypothesis", caplog)


@pytest.mark.parametrize("into,reason", [("input", "no hypothesis"), ("shared", "no hypothesis")])
def test_rows_assigned_into_a_buffer_read_elsewhere_or_not_of_zeros_stay(into, reason, caplog):
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(AssignedRowsSwitchMoE(into=into), torch.randn(2, 16, 16), reason, caplog)


def test_dispatch_by_positive_weights_is_found_where_the_weights_are_never_negative():
    # GShard's `dispatch = combine > 0`: the op's computation where gates are softmax probabilities,
    # which the region is then evaluated on (weights of one sign: `verify.nonnegative`)
    _check_rewrite(CapacityDispatchMoE(dispatch="positive"), "evaluated", op="sonic::moe_experts")


def test_nonnegative_weights_are_proven_from_the_ops_that_make_them():
    import torch.nn.functional as F

    from moe_compiler.patterns.verify import nonnegative

    def fn(x):
        w, ids = F.softmax(x, -1).topk(2, dim=-1)
        renormed = w / w.sum(-1, keepdim=True)
        scaled = torch.sigmoid(x).topk(2, dim=-1).values * 2.5
        raw = x.topk(2, dim=-1).values
        shifted = renormed - 0.1
        return renormed, scaled, raw, shifted, F.relu(x).max(-1).values + 1.0

    gm = torch.fx.symbolic_trace(fn)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert [nonnegative(n) for n in out] == [True, True, False, False, True]


def test_rows_permuted_by_expert_and_put_back_are_found_by_evaluation():
    # the canonical form drops the permutation (`permuted_rows_put_back_to_rows`); what is left, per-row
    # gathered weights of a top-1, is found by evaluation
    _check_rewrite(PermutedTop1MoE(), "evaluated", op="sonic::moe_experts_split")


def test_sorted_rows_put_back_and_scaled_in_place_are_found_by_evaluation():
    """DeepSeek-V2's moe_infer: the in-place scale of the put-back rows is functional (nothing else
    sees it), the put-back a gather through the inverse permutation, which the region fills."""
    _check_rewrite(SortedRowsGatheredMoE(), "evaluated", op="sonic::moe_experts_split")


@pytest.mark.parametrize("down", ["in_out", "out_in"])
def test_slot_loop_over_gathered_weights_is_found_by_evaluation(down):
    """out_in: the down weights stored the other way round from the first ones (megablocks' pair of
    [E, f, d] parameters), handed to the op as a transposed view."""
    report = _check_rewrite(SlotGatherMoE(down=down), "evaluated", op="sonic::moe_experts")
    assert ("other orientation" in report.rewritten[0].details["layout"]) == (down == "out_in"), str(report)


@pytest.mark.parametrize("make,refused", [
    # a view of the up projection's own [T, E, f] layout keeps that einsum as written: no bmm pair
    (lambda: TokenMajorMoE(view=True), "dense_bmm"),
    # outputs of buffers[e] stacked: the combine einsum is no gate-weighted sum over stacked outputs
    (lambda: CapacityListMoE(experts="index", act="swiglu"), "dense_experts"),
    # gathered weights whose down projection is stored the other way round: "two orientations"
    (lambda: GatheredMoE(gate_up="plain", down_orient="in_out"), "gathered_weights"),
    # an expert loop reading gate and up as column halves W[e, :, :n], W[e, :, n:] of one [E, d, 2n]
    # parameter (the op's concatenated, transposed w1), added into zeros: the loop finder takes rows only
    (lambda: StackedLoopMoE(orient="in_out", gate_up="halves"), "expert_loop"),
], ids=["token-major-view", "capacity-buffers-indexed", "gathered-down-swapped", "loop-column-halves"])
def test_a_layer_a_finder_refuses_is_found_by_evaluation(make, refused):
    """A finder refuses the layer and says so; evaluated on its own the region is the op's, and is
    rewritten."""
    report = _evaluated_equal_to_eager(make(), *_inputs())
    assert [r.idiom for r in report.rejected] == [refused], str(report)


@pytest.mark.parametrize("make,reason", [
    # the combine weighs dropped tokens too: they read their expert's last buffer row
    (lambda: CapacityDispatchMoE(capacity="half", dropped="misrouted"), "capacity-limited"),
    (lambda: CapacityTop2MoE(masks="token", combine="unmasked"), "capacity-limited"),
    # the probabilities weigh a dropped slot's token (at its expert's row 0): read outside the kept ids
    (lambda: CapacityListMoE(weights="dense"), "capacity-limited"),
    # expert e's output weighted by expert e + 1's weight
    (lambda: EveryTokenListMoE(combine="next_expert"), "no hypothesis"),
    # dropped slots' rows added into their expert's last row: the token kept there reads a sum
    (lambda: SlotPriorityCapacityMoE(spill=True), "capacity-limited"),
    # the rows scaled in place are read again: the write stays, and so does the layer
    (lambda: SortedRowsGatheredMoE(scaled="read_too"), "no hypothesis"),
    # expert e runs on expert e + 1's buffer
    (lambda: CapacityListMoE(experts="shifted"), "is not sum_e gates"),
    (lambda: CapacityListMoE(K=1, capacity=12, experts="shifted"), "is not sum_e gates"),
    # `combine > 0` over raw logits: a token with a negative gate is not dispatched
    (lambda: CapacityDispatchMoE(dispatch="positive", gate_from="logits"), "no hypothesis evaluated equal"),
    # slot k's output weighted by the other slot's weight
    (lambda: SlotGatherMoE(weights="swapped"), "no hypothesis evaluated equal"),
    # the gate clamped at 50: no probe value reaches it, so a plain SwiGLU would evaluate equal
    (lambda: SlotGatherMoE(clamp=50.0), "no hypothesis"),
])
def test_lookalikes_stay(make, reason, caplog):
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(make(), _inputs()[0], reason, caplog)


def test_a_region_too_large_to_evaluate_stays(caplog, monkeypatch):
    """No structural proof backs this finder: a region verify cannot evaluate is left alone."""
    monkeypatch.setitem(verify.MAX_FLOPS, "cpu", 1.0)
    monkeypatch.setitem(verify.MAX_BYTES, "cpu", 1)
    verify._cache.clear()
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(SlotGatherMoE(), _inputs()[0], "too large to evaluate", caplog)


@pytest.mark.gpu
@pytest.mark.parametrize("make", [lambda: CapacityDispatchMoE(capacity=2, bias="rows"), SlotGatherMoE, lambda: CapacityDispatchMoE(dispatch="positive"),
                                  lambda: CapacityDispatchMoE(capacity=2), CapacityTop2MoE, CapacityListMoE,
                                  lambda: CapacityListMoE(weights="columns", act="swiglu"), GroupedTokensMoE,
                                  SlotPriorityCapacityMoE, SortedRowsGatheredMoE, lambda: SlotGatherMoE(down="out_in"),
                                  lambda: GroupedTokensMoE(K=1), EveryTokenListMoE],
                         ids=["capacity-row-biases", "slots", "positive", "capacity-drops", "top2-capacity-drops", "list-capacity",
                              "list-columns", "grouped-tokens", "flat-slots", "sorted-rows", "down-swapped",
                              "grouped-top1", "every-token-list"])
def test_found_by_evaluation_gpu_bf16(make):
    _check_gpu_bf16(make, "evaluated")


@pytest.mark.gpu
@pytest.mark.parametrize("make", [AssignedRowsSwitchMoE, MaskedRowsAddedMoE], ids=["assigned", "added-in-place"])
def test_rows_written_into_a_buffer_of_zeros_gpu_bf16(make):
    _check_gpu_bf16(make, "evaluated", tokens=(2, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("make", [lambda: CapacityListMoE(d=1024, n=1024, E=8, K=2, capacity=640),
                                  lambda: SlotPriorityCapacityMoE(d=1024, n=512, E=8, K=2, capacity=640)],
                         ids=["list-capacity", "flat-slots"])
def test_a_region_too_large_for_the_cpu_is_evaluated_split_on_the_gpu(make):
    """Capacity at a model's size (4096 tokens, 8192 slots in 5120 places) in bf16 on CUDA: too
    large to evaluate on the CPU, so its routing part runs there and the rest on the GPU; found,
    dropped slots and all, and as close to the fp32 model as eager bf16 is."""
    torch.manual_seed(0)
    fp32 = make().cuda()
    bf16 = make().to("cuda", torch.bfloat16)
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in fp32.state_dict().items()})
    x, cotangent = torch.randn(4096, 1024, device="cuda"), torch.randn(4096, 1024, device="cuda")
    xb, cb = x.to(torch.bfloat16), cotangent.to(torch.bfloat16)
    verify._cache.clear()
    truth = _out_and_grads(fp32, x, cotangent, dict(fp32.named_parameters()))
    eager = _out_and_grads(bf16, xb, cb, dict(bf16.named_parameters()))
    with moe_compiler.capture() as report:
        got = _out_and_grads(_compile(bf16, "inductor"), xb, cb, dict(bf16.named_parameters()))
    assert [r.idiom for r in report.rewritten] == ["evaluated"], str(report)
    details = report.rewritten[0].details
    assert "the routing's part on the CPU" in details["verified"] and "capacity dropped" in details["layout"], str(report)
    assert_close_to_eager(got[0], eager[0], truth[0], torch.bfloat16, "output")
    for name in truth[1]:
        assert_close_to_eager(got[1][name], eager[1][name], truth[1][name], torch.bfloat16, f"grad {name}")


def test_a_region_computed_partly_under_no_grad_is_left_alone():
    """The first projections computed under torch.no_grad: eager trains no gate/up weight and no x
    through them, the op placed at the combine would. The switch is a node no value reads: the
    pass driver finds the region's values computed under two grad modes and leaves it alone."""
    import torch.nn.functional as F

    class HalfFrozen(SlotGatherMoE):
        def forward(self, x):
            _, w, ids = self.route(x)
            out = x.new_zeros(x.shape)
            for k in range(self.K):
                e = ids[:, k]
                with torch.no_grad():
                    g, u = torch.einsum("td,tdf->tf", x, self.w13[e]).chunk(2, dim=-1)
                out = out + w[:, k, None] * torch.einsum("tf,tfd->td", F.silu(g) * u, self.w2[e])
            return out

    model = HalfFrozen()
    x, _ = _inputs()
    with torch._dynamo.config.patch(**{FLAG: True}), moe_compiler.capture() as report:
        _compile(model, "aot_eager")(x.requires_grad_(True))
    assert not report.rewritten, str(report)
    assert any("computed under another grad mode" in r.reason for r in report.rejected), str(report)


def _split_always(monkeypatch):
    """Every guessed region split as a large one on a GPU is: its routing part on the CPU, the rest
    on the graph's device (here the CPU as well), each index that part reads checked first."""
    checked = []

    def spy(node, args, kwargs):
        checked.append(str(node.target))
        return check(node, args, kwargs)

    check = indices.check
    monkeypatch.setattr(indices, "check", spy)
    monkeypatch.setattr(verify, "placed", lambda match, on_cpu=False: verify._Region(match, split=True))
    verify._cache.clear()
    return checked


@pytest.mark.parametrize("make,op,reads", [
    (CapacityListMoE, "sonic::moe_experts_list", "einsum"),  # [T, E, C] masks from the ids, on the CPU
    (SlotPriorityCapacityMoE, "sonic::moe_experts_split", "index_add"),  # rows added at e * C + position
    (SortedRowsGatheredMoE, "sonic::moe_experts_split", "getitem"),  # rows gathered by the sorted order
], ids=["list-capacity", "flat-slots", "sorted-rows"])
def test_a_region_split_between_the_cpu_and_the_device_evaluates_as_one(monkeypatch, make, op, reads):
    """The split evaluation (what a region too large for the CPU gets on a GPU) finds what the
    whole one finds, and the device part's reads pass the index check."""
    checked = _split_always(monkeypatch)
    report = _check_rewrite(make(), "evaluated", op=op)
    assert "the routing's part on the CPU" in report.rewritten[0].details["verified"], str(report)
    assert any(reads in target for target in checked), sorted(set(checked))


@pytest.mark.parametrize("make,reason", [
    (lambda: CapacityDispatchMoE(capacity="half", dropped="misrouted"), "capacity-limited"),
    (lambda: CapacityTop2MoE(masks="token", combine="unmasked"), "capacity-limited"),
    (lambda: CapacityListMoE(weights="dense"), "capacity-limited"),
    (lambda: SlotPriorityCapacityMoE(spill=True), "capacity-limited"),
    (lambda: CapacityDispatchMoE(dispatch="positive", gate_from="logits"), "no hypothesis evaluated equal"),
    (lambda: SlotGatherMoE(weights="swapped"), "no hypothesis evaluated equal"),
], ids=["misrouted", "unmasked", "dense", "spill", "logits", "swapped"])
def test_a_split_region_that_differs_stays(monkeypatch, caplog, make, reason):
    _split_always(monkeypatch)
    with torch._dynamo.config.patch(**{FLAG: True}):
        assert_left_alone(make(), _inputs()[0], reason, caplog)


def _call(target, *args, method=False):
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(f"a{i}") if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
    node = graph.call_method(target, tuple(inputs)) if method else graph.call_function(target, tuple(inputs))
    return node, args


def test_indices_read_on_the_device_are_proven_in_range_first():
    t, idx = torch.zeros(4, 6), torch.tensor([0, 3, 1])
    ok = [_call("index_select", t, 1, torch.tensor([5, 0]), method=True), _call(torch.gather, t, 1, idx[None]),
          _call(operator.getitem, t, (slice(None), idx)), _call(operator.getitem, t, (Ellipsis, torch.tensor([-6]))),
          _call(operator.getitem, t, (None, idx)), _call(operator.getitem, t, torch.ones(4, dtype=torch.bool)),
          _call(operator.setitem, t, idx, 1.0), _call("index_add_", t, 0, idx, torch.ones(3, 6), method=True),
          _call(torch.nn.functional.embedding, idx, t), _call(torch.mul, t[:3, 0], idx), _call(torch.mul, t, t)]
    for node, args in ok:
        indices.check(node, args, {})
    out_of_range = [_call("index_select", t, 0, torch.tensor([4]), method=True),
                    _call(torch.gather, t, 0, torch.tensor([[-1]])),
                    _call(operator.getitem, t, (slice(None), torch.tensor([6]))),
                    _call(operator.getitem, t, (Ellipsis, torch.tensor([-7]))),
                    _call(operator.setitem, t, torch.tensor([4]), 1.0),
                    _call("scatter_add_", t, 1, torch.tensor([[6]]), torch.ones(1, 1), method=True),
                    _call(torch.nn.functional.embedding, torch.tensor([4]), t)]
    for node, args in out_of_range:
        with pytest.raises(IndexError):
            indices.check(node, args, {})
    unknown = [_call(torch.take, t, idx), _call(torch.bincount, idx),
               _call("index_select", t, 0, idx.to("meta"), method=True)]  # an index not computed on the CPU
    for node, args in unknown:
        with pytest.raises(indices.Unprovable):
            indices.check(node, args, {})
