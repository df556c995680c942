"""Launch plans (`codegen.plans`): a call recorded once replays equal to the implementation, for every
later call of its signature, and only then.

CPU: toy implementations planned with `cuda_only=False` (aten ops only; the interpreted kernels'
launches are planned in tests/test_kernels.py). GPU: the ops' own calls, planned against unplanned,
and a planned step captured in a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

from moe_compiler.codegen import plans


@pytest.fixture(autouse=True)
def fresh_plans():
    plans.forget()
    yield
    plans.forget()


def _toy(x, w, idx, scale: float, flag: bool):
    """Allocations, views, an in-place write, a gather and a list-taking op, as the launchers make them."""
    out = x.new_empty(x.shape[0], w.shape[1])
    torch.mm(x, w, out=out)
    rows = out.reshape(-1, 2)
    picked = x.index_select(0, idx)
    both = torch.cat([picked, x[: idx.numel()]], 1)
    if flag:
        out.mul_(scale)
    return out, (rows.sum(1), None), both.t().contiguous(), scale


def _inputs(seed, T=8, d=4, n=6):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, d, generator=g), torch.randn(d, n, generator=g),
            torch.randint(0, T, (3,), generator=g), 0.5, True)


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b)
        for u, v in zip(a, b):
            _equal(u, v)
    else:
        assert a == b


def test_a_recorded_call_replays_equal_to_the_implementation_on_new_values():
    toy = plans.planned(_toy, cuda_only=False)
    for seed in range(plans.RECORD_AT):
        _equal(toy(*_inputs(seed)), _toy(*_inputs(seed)))
    assert plans.stats() == dict(planned=1, counting=0, unplanned=0)
    calls = []
    spy = plans.planned(lambda *a: calls.append(1) or _toy(*a), cuda_only=False)
    for seed in range(plans.RECORD_AT + 3):
        _equal(spy(*_inputs(100 + seed)), _toy(*_inputs(100 + seed)))
    assert len(calls) == plans.RECORD_AT  # the later calls never ran the implementation
    for seed in range(5):
        _equal(toy(*_inputs(200 + seed)), _toy(*_inputs(200 + seed)))


def _views(x):
    """Views of an input (with a storage offset) and of a new tensor, a detach, an in-place write
    through a view: replayed as `as_strided` over the new tensors, with absolute storage offsets."""
    y = x.detach()[1:].t()
    z = torch.empty(2, x.shape[0], x.shape[1])
    z[1].copy_(x)
    z[0].fill_(2.0)
    return (y * 3).contiguous(), z.select(0, 1).transpose(0, 1) + 1, z.view(-1)[:5].clone()


def test_views_replay_over_the_new_tensors():
    planned = plans.planned(_views, cuda_only=False)
    for i in range(plans.RECORD_AT + 4):
        base = torch.randn(40)
        x = base[3:].view(37)[:35].view(7, 5)  # storage offset 3
        _equal(planned(x), _views(x))
    assert plans.stats()["planned"] == 1


def test_replayed_results_are_fresh_tensors():
    toy = plans.planned(_toy, cuda_only=False)
    for seed in range(plans.RECORD_AT):
        toy(*_inputs(seed))
    first = toy(*_inputs(7))
    second = toy(*_inputs(8))
    assert first[0].data_ptr() != second[0].data_ptr()
    _equal(first, _toy(*_inputs(7)))


@pytest.mark.parametrize("change", ["shape", "strides", "offset", "alignment", "scalar", "flag", "dtype"])
def test_a_call_of_another_signature_runs_the_implementation(change):
    calls = []

    def counted(*a):
        calls.append(1)
        return _toy(*a)

    toy = plans.planned(counted, cuda_only=False)
    for seed in range(plans.RECORD_AT + 1):
        toy(*_inputs(seed))
    assert len(calls) == plans.RECORD_AT
    x, w, idx, scale, flag = _inputs(9)
    if change == "shape":
        x = torch.randn(10, 4)
    elif change == "strides":
        x = torch.randn(4, 8).t()
    elif change == "offset":
        x = torch.randn(9, 4)[1:]
    elif change == "alignment":  # the same storage offset, the base 4 bytes off 16-byte alignment
        base = torch.randn(8 * 4 + 1)
        x = base[1:] if base.data_ptr() % 16 == 0 else base[:-1]
        x = x.view(8, 4)
    elif change == "scalar":
        scale = 3.0
    elif change == "flag":
        flag = False
    else:
        x, w = x.double(), w.double()
    _equal(toy(x, w, idx, scale, flag), _toy(x, w, idx, scale, flag))
    assert len(calls) == plans.RECORD_AT + 1


def _reads_a_value(x):
    n = int(x.abs().sum() > 1)  # a host read: the shape below depends on the value
    return x.new_zeros(n + 1)


def _nonzero(x):
    return x.nonzero()


def _returns_its_input(x):
    return x


def _random(x):
    return x + torch.rand_like(x)


@pytest.mark.parametrize("impl", [_reads_a_value, _nonzero, _returns_its_input, _random])
def test_a_call_a_plan_cannot_repeat_stays_unplanned(impl):
    planned = plans.planned(impl, cuda_only=False)
    for i in range(plans.RECORD_AT + plans._TRIES + 2):
        x = torch.full((3,), 0.1 * i)
        got, want = planned(x), impl(x)
        if impl is not _random:
            _equal(got, want)
    assert plans.stats() == dict(planned=0, counting=0, unplanned=1)


def test_describe_names_each_implementation_its_states_and_why_it_stayed_unplanned():
    """What the distributed examples print per rank: planned signatures, ones still counting calls,
    and the reason a signature stayed unplanned."""
    toy, nonzero = plans.planned(_toy, cuda_only=False), plans.planned(_nonzero, cuda_only=False)
    for _ in range(plans.RECORD_AT + 1):
        toy(*_inputs(0))
    toy(*_inputs(0, T=5))  # another signature, called once
    for i in range(plans.RECORD_AT + plans._TRIES + 2):
        nonzero(torch.full((3,), 0.1 * i))
    got = plans.describe()
    assert got["_toy"] == "1 planned, 1 at call 1", got
    assert got["_nonzero"].startswith("1 unplanned (") and "nonzero" in got["_nonzero"], got


def test_aborted_recordings_are_retried_then_given_up():
    state = {"abort": True}

    def impl(x):
        if state["abort"]:
            plans.abort("still tuning")
        return x * 2

    planned = plans.planned(impl, cuda_only=False)
    for _ in range(plans.RECORD_AT):
        planned(torch.ones(2))
    assert plans.stats()["counting"] == 1
    state["abort"] = False
    planned(torch.ones(2))
    assert plans.stats()["planned"] == 1
    _equal(planned(torch.full((2,), 3.0)), torch.full((2,), 6.0))


def _recorded_add_one():
    """(a planned x + 1 whose plan is recorded and replayed once, the list its implementation's calls append to)."""
    calls = []

    def impl(x):
        calls.append(1)
        return x + 1

    planned = plans.planned(impl, cuda_only=False)
    for _ in range(plans.RECORD_AT + 1):
        planned(torch.ones(2))
    assert len(calls) == plans.RECORD_AT
    return planned, calls


def test_forget_and_disabling_run_the_implementation():
    planned, calls = _recorded_add_one()
    plans.forget()
    planned(torch.ones(2))
    assert len(calls) == plans.RECORD_AT + 1
    for _ in range(plans.RECORD_AT):
        planned(torch.ones(2))
    before = len(calls)
    plans.ENABLED = False
    try:
        planned(torch.ones(2))
    finally:
        plans.ENABLED = True
    assert len(calls) == before + 1


def test_a_flipped_switch_is_another_signature(monkeypatch):
    from moe_compiler.codegen import forward

    planned, calls = _recorded_add_one()
    monkeypatch.setattr(forward, "SCATTER_TILES", not forward.SCATTER_TILES)
    planned(torch.ones(2))
    assert len(calls) == plans.RECORD_AT + 1


def test_cuda_only_plans_leave_cpu_calls_alone():
    planned = plans.planned(_toy)
    for seed in range(plans.RECORD_AT + 2):
        planned(*_inputs(seed))
    assert plans.stats() == dict(planned=0, counting=0, unplanned=0)


def test_the_ops_keep_their_schemas():
    import moe_compiler.codegen.ops  # noqa: F401  (registers the ops)

    schema = str(torch.ops.sonic.moe_experts.default._schema)
    assert schema.startswith("sonic::moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w1")
    assert "Tensor[] w_gate" in str(torch.ops.sonic.moe_experts_list.nograd._schema)


# ------------------------------------------------------------------------------------------- GPU


def _gpu_layer(T=512, d=256, n=128, E=8, K=2, seed=0, form="stacked"):
    """A router and experts on CUDA (bf16), the experts stacked or as per-expert lists, [T, K]
    routing or the slot form with slots of other experts dropped (expert parallelism)."""
    from moe_compiler.codegen.ops import drop_slots_from, moe_experts, moe_experts_list
    from moe_compiler.codegen.router import route

    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    params = dict(router=torch.randn(E, d, generator=g, **bf) / d**0.5,
                  w1=torch.randn(E, 2 * n, d, generator=g, **bf) / d**0.5,
                  w2=torch.randn(E, d, n, generator=g, **bf) / n**0.5)
    for p in params.values():
        p.requires_grad_()

    def step(x):
        w, ids = route(x @ params["router"].t(), K)
        if form == "list":
            gate_up = list(params["w1"].unbind(0))
            return moe_experts_list(x, ids, w.to(x.dtype), gate_up, [], list(params["w2"].unbind(0)))
        if form == "slots":
            ids, w, tok = drop_slots_from(ids, w, E // 2)
            return moe_experts(x, ids, w.to(x.dtype), params["w1"][: E // 2], params["w2"][: E // 2], slot_token=tok)
        return moe_experts(x, ids, w.to(x.dtype), params["w1"], params["w2"])

    return params, step


def _run_steps(params, step, xs, dy):
    results = []
    for x in xs:
        x = x.detach().requires_grad_()
        out = step(x)
        out.backward(dy)
        results.append((out.detach(), x.grad, *(p.grad for p in params.values())))
        for p in params.values():
            p.grad = None
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["stacked", "list", "slots"])
def test_planned_op_calls_equal_unplanned_ones_gpu(form):
    """The ops' calls (router, experts, backward) replayed from plans give bit-equal outputs and
    gradients to the same calls run through the implementations, on inputs of one signature."""
    params, step = _gpu_layer(form=form)
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(512, 256, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(plans.RECORD_AT + 3)]
    dy = torch.randn(512, 256, generator=g, device="cuda", dtype=torch.bfloat16)
    planned = _run_steps(params, step, xs, dy)
    assert plans.stats()["planned"] >= 3, plans.stats()  # router, experts, their backwards
    plans.ENABLED = False
    try:
        unplanned = _run_steps(params, step, xs, dy)
    finally:
        plans.ENABLED = True
    for got, want in zip(planned, unplanned):
        _equal(got, want)


@pytest.mark.gpu
def test_raw_launches_equal_unplanned_ones_with_descriptors_encoded_again_or_kept_gpu():
    """On Triton 3.6, replays call the kernels' C launch (`direct_launch.raw_launcher`) with TMA
    descriptor encodings kept per base address: bit-equal to unplanned calls when every encoding is
    made again (new addresses) and when they are reused."""
    import triton

    from moe_compiler.codegen import launch

    if not triton.__version__.startswith("3.6") or not launch.USE_TMA:
        pytest.skip("the raw launch is taken with Triton 3.6's launcher and TMA descriptors")
    params, step = _gpu_layer()
    g = torch.Generator(device="cuda").manual_seed(3)
    xs = [torch.randn(512, 256, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(plans.RECORD_AT + 1)]
    dy = torch.randn(512, 256, generator=g, device="cuda", dtype=torch.bfloat16)
    _run_steps(params, step, xs, dy)
    steps = [st for p in plans._PLANS.values() if isinstance(p, plans._Plan) for st in p.steps]
    raw = [st for st in steps if st[0] == plans._RAW]
    assert raw and not any(st[0] == plans._LAUNCH for st in steps), [st[0] for st in steps]
    encodings = [d[4] for st in raw for d in st[9]]
    assert encodings, "no replayed launch took a TMA descriptor"
    new = [torch.randn(512, 256, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for e in encodings:
        e.clear()
    encoded_again = _run_steps(params, step, new, dy)
    assert all(e for e in encodings)
    kept = _run_steps(params, step, new, dy)
    plans.ENABLED = False
    try:
        unplanned = _run_steps(params, step, new, dy)
    finally:
        plans.ENABLED = True
    _equal(encoded_again, unplanned)
    _equal(kept, unplanned)


@pytest.mark.gpu
def test_a_planned_compiled_step_replays_from_a_cuda_graph_gpu():
    """Replayed plans are capturable: a compiled Qwen3-MoE block's fwd+bwd, captured after its op
    calls were planned (`graphed` warms it up on a side stream, then captures), replayed on new
    values in the static input, gives the gradients of the same step run unplanned."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from moe_compiler.benchmarking import graphed

    from .helpers import compile_sonic

    config = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"  # a model's default; a lone block has none set
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():  # transformers 5 leaves the experts empty
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    block = block.cuda().to(torch.bfloat16)
    compiled = compile_sonic(block)
    g = torch.Generator(device="cuda").manual_seed(2)
    x, fresh, dy = (torch.randn(1, 512, 256, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    x.requires_grad_()
    leaves = [x, *block.parameters()]

    def zero():
        for t in leaves:
            t.grad = None

    def step():
        compiled(x).backward(dy)

    for _ in range(plans.RECORD_AT + 2):  # the first backward's choices make the later calls' signature
        zero()
        step()
    assert plans.stats()["planned"] >= 4, plans.stats()
    replay = graphed(step, zero)
    with torch.no_grad():
        x.copy_(fresh)
    replay()
    torch.cuda.synchronize()
    got = [t.grad.clone() for t in leaves]
    plans.ENABLED = False
    try:
        zero()
        step()
    finally:
        plans.ENABLED = True
    _equal(got, [t.grad for t in leaves])


def test_a_triton_launch_outside_direct_launch_keeps_a_call_unplanned():
    """A Triton kernel launched by `kernel[grid]` (not through `codegen.direct_launch`) would be
    missing from a record: the recording is dropped, and the call keeps running its implementation."""
    import triton
    from triton.runtime.jit import JITFunction

    if not isinstance(_never_launched(triton), JITFunction):
        pytest.skip("an interpreted Triton: kernels are not JITFunctions here")
    kernel = _never_launched(triton)

    def impl(x):
        try:
            kernel[(1,)](x)  # no driver on the CPU: it raises after the guard has seen it
        except Exception:
            pass
        return x + 1

    planned = plans.planned(impl, cuda_only=False)
    for _ in range(plans.RECORD_AT + plans._TRIES + 1):
        _equal(planned(torch.ones(2)), torch.full((2,), 2.0))
    assert plans.stats() == dict(planned=0, counting=0, unplanned=1)


_KERNEL: list = []


def _never_launched(triton):
    if not _KERNEL:
        @triton.jit
        def never_launched(x_ptr):
            pass

        _KERNEL.append(never_launched)
    return _KERNEL[0]


def test_a_recorded_call_frees_its_intermediates_as_it_goes():
    """The recording does not keep the call's dead intermediates alive (its peak memory stays the
    implementation's), and a result it traced then lost is not confused with a later tensor."""
    import weakref

    alive = []

    def impl(x):
        a = x * 2
        dead = weakref.ref(a)
        b = a + 1
        del a
        alive.append(dead() is not None)
        c = torch.tensor([3.0])  # made by C++ without a dispatch of its own: a constant, whatever its id
        return b * c

    planned = plans.planned(impl, cuda_only=False)
    for i in range(plans.RECORD_AT + 2):
        x = torch.full((2,), float(i))
        _equal(planned(x), (x * 2 + 1) * 3)
    assert plans.stats()["planned"] == 1
    assert alive == [False] * plans.RECORD_AT  # the recorded (third) call freed `a` too


def test_a_plan_holds_no_tensor_of_the_recorded_call():
    """Once the caller drops the recorded call's results, none of that call's tensors (inputs,
    intermediates, results, a descriptor's base) stays alive in the plan."""
    import gc
    import weakref

    made = []

    def impl(x):
        a = x * 2
        out = torch.cat([a, x]).add_(1)
        made.extend(weakref.ref(t) for t in (x, a, out))
        return out, a.sum()

    planned = plans.planned(impl, cuda_only=False)
    for i in range(plans.RECORD_AT):
        planned(torch.full((3,), float(i)))
    gc.collect()
    assert plans.stats()["planned"] == 1
    assert all(r() is None for r in made), [r() for r in made]
    _equal(planned(torch.ones(3)), (torch.cat([torch.full((3,), 2.0), torch.ones(3)]) + 1, torch.tensor(6.0)))
