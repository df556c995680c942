"""Launch plans: a call of an op on the GPU replayed from a record of an earlier call's work.

    @planned
    def _moe_experts_fwd(x, topk_ids, ...): ...     # the op's implementation, unchanged

What the implementations decide on the host (which kernel, its config and grid, the weight-gradient
provider, buffer sizes, TMA descriptor boxes) depends only on the call's signature, never on tensor
values (the ops do not sync with the host):

  * each tensor argument's shape, strides, dtype, device, storage offset, and address modulo 16
    (the alignment Triton and the copy engine specialize on); the exact addresses (and storage
    offsets) of tensors passed in lists (the list form's offset tables are built from them);
  * the other arguments; the run-time switches (`_switches`); grad, inference-mode and autocast state;
  * `forget()`'s generation (called when a choice, tuning or switch changes).

So once a signature's first calls have compiled, tuned and timed what they needed, its
`RECORD_AT`-th call is recorded: every aten op it dispatches (allocations, views, small torch ops,
through a `TorchDispatchMode`) and every kernel launch (`codegen.direct_launch` hands each one over),
each tensor argument traced to an input, an earlier result, or a constant. Later calls with that
signature replay the record: the aten ops are called directly, each compiled kernel is launched
with the new tensors on the current stream, and none of the Python between them runs. Where Triton's
launcher has the shape `direct_launch.raw_launcher` knows (Triton 3.6 on CUDA), a replay calls the
kernel's C launch itself with its TMA descriptors' encodings, each kept per base address (a step
whose tensors come back at the addresses of an earlier call, as a training loop's do, encodes no
descriptor); otherwise the compiled kernel's launcher gets descriptors rebuilt over the new tensors.

A recording is dropped, and the signature runs as before, when the call: launches a kernel through
Triton's own path (compiling, autotuning, or any launch that does not come through direct_launch,
which `JITFunction.run` is watched for: `abort`), times candidates (`wgrad_choice`), reads a
tensor's value on the host (a scalar result, an op with a data-dependent shape, a host sync), draws
random numbers, or returns a tensor it did not make. No call is recorded during a CUDA-graph capture
(a replay is captured like any launch). Calls under another dispatch mode, with a launch hook set
(profilers), and on the CPU (where a tensor's values can be read without a dispatch) run the
implementation.

`ENABLED = False` (env SONIC_MOE_PLANS=0) runs every call through the implementation (A/B runs).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import threading
import warnings
import weakref
from typing import Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("moe_compiler")

ENABLED = os.environ.get("SONIC_MOE_PLANS", "1") != "0"
RECORD_AT = 3  # the call at a signature that is recorded; the first ones compile, tune, time and fill caches
_TRIES = 4  # recordings tried at a signature (from call RECORD_AT on) before it keeps running unplanned
_MAX_PLANS = 1024

_UNPLANNED = "unplanned"
_PLANS: dict[tuple, object] = {}  # signature -> call count (int), _Plan, or _UNPLANNED
_GENERATION = 0
_WHY: dict[str, str] = {}  # implementation name -> why the last of its signatures left unplanned was not recorded
_RECORDING: list = [None]  # the active _Recorder (one at a time, in one thread)
_REFUSED_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.nondeterministic_seeded)


def forget() -> None:
    """Drop every plan: the next calls run the implementations and record again. Called where what
    a call does changes without its signature changing (a switch flipped, choices or tunings reset)."""
    global _GENERATION
    _GENERATION += 1
    _PLANS.clear()
    _WHY.clear()


def stats() -> dict[str, int]:
    """How many signatures are planned, still counting calls, or left unplanned."""
    values = list(_PLANS.values())
    return dict(planned=sum(isinstance(v, _Plan) for v in values), counting=sum(isinstance(v, int) for v in values),
                unplanned=sum(v is _UNPLANNED for v in values))


def describe() -> dict[str, str]:
    """Each implementation's signatures by state: "2 planned, 1 at call 2, 1 unplanned (why)"."""
    states: dict[str, list[str]] = {}
    for (impl, _), value in _PLANS.items():
        state = "planned" if isinstance(value, _Plan) else "unplanned" if value is _UNPLANNED else f"at call {value}"
        states.setdefault(impl.__name__, []).append(state)
    out = {}
    for name, seen in states.items():
        parts = [f"{seen.count(s)} {s}" for s in dict.fromkeys(seen)]
        out[name] = ", ".join(parts) + (f" ({_WHY[name]})" if name in _WHY and "unplanned" in seen else "")
    return out


_SWITCH_MODULES: list = []


def _switches() -> tuple:
    """The run-time switches the implementations read (benchmarks flip them for A/B runs)."""
    if not _SWITCH_MODULES:
        from . import backward, direct_launch, forward, launch, router, wgrad_choice

        _SWITCH_MODULES.extend((forward, launch, direct_launch, wgrad_choice, router, backward))
    forward, launch, direct_launch, wgrad_choice, router, backward = _SWITCH_MODULES
    return (forward.SCATTER_TILES, forward.MAP_PREFETCH, launch.USE_TMA, launch.WIDE_UP, launch.PERSISTENT_UP,
            launch.GLUON_TRITON_VERSIONS, direct_launch.ENABLED, wgrad_choice.PINNED, wgrad_choice.SCATTER_PINNED,
            len(wgrad_choice._CHOSEN), router.NARROW_KEYS, backward.backward_order)


def _signature(args: tuple, kwargs: dict) -> tuple[tuple, list[Tensor]]:
    """(the call's signature, its tensors in a fixed order: top level, then inside lists, as slots
    0.. of a plan)."""
    key = [_GENERATION, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cuda"),
           torch.get_autocast_dtype("cuda"), *_switches()]
    tensors = []
    if kwargs:
        key.append(tuple(kwargs))
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            key.append((a.shape, a.stride(), a.dtype, a.get_device(), a.storage_offset(), a.data_ptr() % 16))
            tensors.append(a)
        elif isinstance(a, (list, tuple)):
            key.append(tuple((t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr(), t.storage_offset())
                             if isinstance(t, Tensor) else t for t in a))
            tensors.extend(t for t in a if isinstance(t, Tensor))
        else:
            key.append(a)
    return tuple(key), tensors


def planned(impl: Callable | None = None, *, cuda_only: bool = True):
    """Wrap an op implementation so that calls with a recorded signature replay its plan.
    `cuda_only`: plan only calls whose first tensor argument is on a CUDA device (tests plan CPU calls)."""
    if impl is None:
        return functools.partial(planned, cuda_only=cuda_only)

    @functools.wraps(impl)
    def call(*args, **kwargs):
        if not ENABLED or _RECORDING[0] is not None or torch._C._len_torch_dispatch_stack():
            return impl(*args, **kwargs)
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
        if first is None or (cuda_only and not first.is_cuda):
            return impl(*args, **kwargs)
        key, inputs = _signature(args, kwargs)
        key = (impl, key)
        state = _PLANS.get(key, 0)
        if isinstance(state, _Plan):
            if state.usable():
                return state.replay(inputs)
            return impl(*args, **kwargs)
        if state is _UNPLANNED:
            return impl(*args, **kwargs)
        state += 1
        if state < RECORD_AT or (first.is_cuda and torch.cuda.is_current_stream_capturing()):
            _PLANS[key] = state
            return impl(*args, **kwargs)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        recorder = _Recorder(inputs, sync_check=first.is_cuda)
        try:
            result = recorder.run(impl, args, kwargs)
            plan = recorder.plan(result)
        finally:
            recorder.close()
        if plan is not None:
            _PLANS[key] = plan
        elif state - RECORD_AT + 1 >= _TRIES:
            _PLANS[key] = _UNPLANNED
            _WHY[impl.__name__] = str(recorder.why)
            log.info("%s: no launch plan (%s); its calls run unplanned", impl.__name__, recorder.why)
        else:
            _PLANS[key] = state
        return result

    # the implementation's signature with its annotations evaluated where they were written: the
    # custom op infers its schema from them
    call.__signature__ = inspect.signature(impl, eval_str=True)
    return call


_HOOKED: list = []


def _hooked() -> bool:
    if not _HOOKED:
        from . import direct_launch

        _HOOKED.append(direct_launch.hooked)
    return _HOOKED[0]()


def abort(why: str) -> None:
    """Drop the recording in progress, if any (its call does work a plan cannot repeat)."""
    recorder = _RECORDING[0]
    if recorder is not None and recorder.why is None and recorder.thread == threading.get_ident() \
            and not recorder.depth:
        recorder.why = why


def recording() -> bool:
    return _RECORDING[0] is not None


def record_launch(launcher, kernel, grid: tuple[int, int, int], device: int, values: list) -> None:
    """`codegen.direct_launch`: `launcher`'s compiled `kernel` launched as `kernel.run(*grid, stream,
    ..., *values)`."""
    recorder = _RECORDING[0]
    if recorder is not None and recorder.thread == threading.get_ident():
        recorder.launch(launcher, kernel, grid, device, values)


def record_call(kernel, grid, args: tuple, kwargs: dict) -> None:
    """`codegen.direct_launch`: a launch through `kernel[grid](*args, **kwargs)` (the interpreter)."""
    recorder = _RECORDING[0]
    if recorder is not None and recorder.thread == threading.get_ident():
        recorder.call(kernel, grid, args, kwargs)


_OP, _LAUNCH, _CALL, _ALLOC, _VIEW, _RAW = 0, 1, 2, 3, 4, 5
# False: replays launch through the compiled kernel's launcher, never `direct_launch.raw_launcher`
# (benchmarks' A/B; read when a call is recorded)
RAW_LAUNCH = True
_ENCODINGS_KEPT = 8  # a descriptor's encodings kept per plan step (by base address), then started over
aten = torch.ops.aten
# allocations: replayed as `torch.empty_strided` of the recorded result's size, strides, dtype, device
_ALLOCATIONS = (aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
                aten.new_empty_strided.default, aten.empty_like.default)
# views of the same size, strides and offset (below autograd: the same tensor to every later use)
_ALIASES = (aten.detach.default, aten.alias.default)


class _Plan:
    """The record of one call: steps over slots (the inputs first, then every result)."""

    __slots__ = ("n_inputs", "n_slots", "steps", "result", "device", "kernels")

    def __init__(self, n_inputs, n_slots, steps, result, device, kernels):
        self.n_inputs, self.n_slots, self.steps, self.result = n_inputs, n_slots, steps, result
        self.device, self.kernels = device, kernels

    def usable(self) -> bool:
        """False while something a launch must honour is set: a launch hook (the profilers' launch
        metadata: Triton's own path then runs), a kernel's pre-run hook, another current device.
        A global a kernel read is checked when the plan is recorded (`direct_launch`), not at each
        replay: code that changes one afterwards calls `forget()`."""
        if _hooked():
            return False
        if self.device is not None and torch._C._cuda_getDevice() != self.device:
            return False
        for fn in self.kernels:
            if fn.pre_run_hooks:
                return False
        return True

    def replay(self, inputs: list[Tensor]):
        slots = inputs + [None] * (self.n_slots - len(inputs))
        stream = None
        for step in self.steps:
            kind = step[0]
            if kind == _VIEW:
                slots[step[5]] = slots[step[1]].as_strided(step[2], step[3], step[4])
            elif kind == _ALLOC:
                slots[step[5]] = torch.empty_strided(step[1], step[2], dtype=step[3], device=step[4])
            elif kind == _OP:
                _, func, args, fills, kwargs, kw_fills, outs = step
                if fills:
                    args = _filled(args, fills, slots)
                if kw_fills:
                    kwargs = dict(kwargs)
                    for name, s in kw_fills:
                        kwargs[name] = slots[s]
                out = func(*args, **kwargs)
                if type(outs) is int:
                    slots[outs] = out
                elif outs:
                    for s, o in zip(outs, out):
                        if s is not None:
                            slots[s] = o
            elif kind == _RAW:
                _, raw, g0, g1, g2, function, packed, values, fills, descs = step
                values = list(values)
                for i, s in fills:
                    values[i] = slots[s]
                for i, s, template, meta, encodings in descs:
                    base = slots[s]
                    encoded = encodings.get(base.data_ptr())
                    if encoded is None:
                        encoded = _encoded(raw, template, meta, base, encodings)
                    values[i] = encoded
                if stream is None:
                    stream = torch._C._cuda_getCurrentRawStream(self.device)
                raw.launch(g0, g1, g2, stream, function, raw.cooperative, raw.pdl, None, None, packed, None, None,
                           None, *values)
            elif kind == _LAUNCH:
                _, kernel, g0, g1, g2, values, fills, descs = step
                values = list(values)
                for i, s in fills:
                    values[i] = slots[s]
                for i, template, s in descs:
                    values[i] = _rebuilt(template, slots[s])
                if stream is None:
                    stream = torch._C._cuda_getCurrentRawStream(self.device)
                kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *values)
            else:
                _, kernel, grid, args, fills, descs, kwargs, kw_fills = step
                args = _filled(args, fills, slots)
                for i, template, s in descs:
                    args[i] = _rebuilt(template, slots[s])
                kwargs = dict(kwargs)
                for name, s in kw_fills:
                    kwargs[name] = slots[s]
                kernel[grid](*args, **kwargs)
        return _build(self.result, slots)


def _rebuilt(template, base: Tensor):
    """A TMA descriptor with `template`'s fields over `base` (no validation: the fields are the
    recorded call's, and `base` has the recorded tensor's shape, strides and alignment)."""
    desc = object.__new__(type(template))
    desc.__dict__.update(template.__dict__)
    desc.base = base
    return desc


def _encoded(raw, template, meta, base: Tensor, encodings: dict):
    """The CUtensorMap of `template`'s descriptor over `base`, kept in `encodings` by base address (the
    encoding is a function of the address and of fields the plan fixes)."""
    if len(encodings) >= _ENCODINGS_KEPT:
        encodings.clear()
    encoded = encodings[base.data_ptr()] = raw.expand(_rebuilt(template, base), meta)[0]
    return encoded


def _filled(template: list, fills: list, slots: list) -> list:
    args = list(template)
    for i, j, s in fills:
        if j < 0:
            args[i] = slots[s]
        else:
            if args[i] is template[i]:
                args[i] = list(template[i])
            args[i][j] = slots[s]
    return args


def _build(template, slots):
    kind, value = template
    if kind == "slot":
        return slots[value]
    if kind == "const":
        return value
    built = [_build(t, slots) for t in value]
    return tuple(built) if kind == "tuple" else built


class _TritonRunGuard:
    """While a call is recorded, `JITFunction.run` drops the recording: it is every Triton launch the
    recorder does not see (a compile, an autotuner's timing, direct_launch's fallbacks, a launch that
    does not come through direct_launch), and a plan would miss it. `launching()` marks
    direct_launch's own `kernel[grid]` calls, which it records. (Interpreted kernels do not run
    through `JITFunction.run`: `launch._launch` aborts its autotuning itself.)"""

    def __init__(self, recorder):
        self.original = None
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        original = JITFunction.run

        def run(fn, *args, **kwargs):
            if recorder.thread == threading.get_ident() and not recorder.launching and not recorder.depth:
                abort(f"{getattr(fn, '__name__', fn)} launched through JITFunction.run (compiled, tuned, or "
                      f"launched outside codegen.direct_launch)")
            return original(fn, *args, **kwargs)

        self.cls, self.original = JITFunction, original
        JITFunction.run = run

    def remove(self):
        if self.original is not None:
            self.cls.run = self.original


@contextlib.contextmanager
def launching():
    """`codegen.direct_launch`'s own `kernel[grid]` launch, which it hands to the recording."""
    recorder = _RECORDING[0]
    if recorder is None:
        yield
        return
    recorder.launching += 1
    try:
        yield
    finally:
        recorder.launching -= 1


def _integer_indexing(func, args) -> bool:
    """`t[index]` with integer index tensors: its shape follows the indices' shapes (only a boolean
    mask makes aten.index's shape depend on values, which its dynamic-shape tag is for)."""
    if func is not torch.ops.aten.index.Tensor:
        return False
    return all(i is None or not (i.dtype == torch.bool or i.dtype == torch.uint8) for i in args[1])


def _raw_step(kernel, grid, values: list, template: list, fills: tuple, descs: list) -> tuple | None:
    """The launch as a `_RAW` step (`direct_launch.RawLauncher`: the kernel's C launch with its
    descriptor arguments expanded), or None where the launcher has another shape or a descriptor's
    base is not traced (its encoding would hold a constant's address the step does not keep)."""
    from . import direct_launch

    raw = direct_launch.raw_launcher(kernel) if RAW_LAUNCH else None
    if raw is None or len(descs) != len(raw.metas) or any(i not in raw.metas for i, _, _ in descs):
        return None
    fill_of, desc_of = dict(fills), {i: (t, s) for i, t, s in descs}
    expanded, raw_fills, raw_descs = [], [], []
    for i, value in enumerate(values):
        if i in desc_of:
            t, s = desc_of[i]
            meta = raw.metas[i]
            encoded, *fields = raw.expand(value, meta)
            raw_descs.append((len(expanded), s, t, meta, {value.base.data_ptr(): encoded}))
            expanded.extend((None, *fields))
        elif i in fill_of:
            raw_fills.append((len(expanded), fill_of[i]))
            expanded.append(None)
        else:
            expanded.append(template[i])
    return (_RAW, raw, *grid, kernel.function, kernel.packed_metadata, tuple(expanded), tuple(raw_fills),
            tuple(raw_descs))


class _Recorder(TorchDispatchMode):
    """Records one call's aten ops and launches; `plan()` gives the _Plan, or None with `why` set."""

    def __init__(self, inputs: list[Tensor], sync_check: bool):
        super().__init__()
        self.slot_of = {id(t): i for i, t in enumerate(inputs)}
        # constants stay alive while recording (the plan holds them too); a traced result is forgotten
        # when it dies (`_trace`), so an id Python gives again never maps to its old slot, and the
        # recorded call frees its intermediates as an unrecorded one does
        self.keep = list(inputs)
        self.n_inputs = len(inputs)
        self.n_slots = len(inputs)
        self.steps: list[tuple] = []
        self.kernels: dict[int, tuple] = {}
        self.device = None
        self.why: str | None = None
        self.thread = threading.get_ident()
        self.sync_check = sync_check
        self.depth = 0
        self.launching = 0

    def run(self, impl, args, kwargs):
        _RECORDING[0] = self
        check_syncs = self.sync_check and torch.cuda.get_sync_debug_mode() == 0
        guard = _TritonRunGuard(self)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if check_syncs:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    with self:
                        return impl(*args, **kwargs)
                finally:
                    if check_syncs:
                        torch.cuda.set_sync_debug_mode("default")
                    syncs = ["synchronizing CUDA operation" in str(w.message) for w in caught]
                    if any(syncs):
                        abort("a host sync")
                    for w, sync in zip(caught, syncs):  # the call's warnings reach the caller as before,
                        if not (sync and check_syncs):  # but for the sync warnings of our own check
                            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        finally:
            guard.remove()
            _RECORDING[0] = None

    # ---------------------------------------------------------------- aten ops
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.depth += 1  # launches inside the op (a custom op's own kernels) belong to its step
        try:
            out = func(*args, **kwargs)
        finally:
            self.depth -= 1
        if self.why is None:
            self._record_op(func, args, kwargs, out)
        return out

    def _record_op(self, func, args, kwargs, out):
        if any(tag in func.tags for tag in _REFUSED_TAGS) and not _integer_indexing(func, args):
            self.why = f"{func} (data-dependent or random)"
            return
        if isinstance(out, Tensor) and self._shortcut(func, args, out):
            return
        arg_list, fills, descs = self._template(args)
        if descs:
            self.why = f"{func} took a TMA descriptor"
            return
        kw, kw_fills = {}, []
        for name, value in kwargs.items():
            if isinstance(value, Tensor):
                slot = self.slot_of.get(id(value))
                if slot is None:
                    kw[name] = value
                    self.keep.append(value)
                else:
                    kw_fills.append((name, slot))
            elif isinstance(value, (list, tuple)) and any(isinstance(t, Tensor) for t in value):
                self.why = f"{func}: a list of tensors as keyword {name}"
                return
            else:
                kw[name] = value
        if isinstance(out, Tensor):
            outs = self._new_slot(out)
        elif out is None:  # an op run for its effect (a device-side assert)
            outs = ()
        elif isinstance(out, (list, tuple)) and all(o is None or isinstance(o, Tensor) for o in out):
            outs = tuple(None if o is None else self._new_slot(o) for o in out)
        else:
            self.why = f"{func} returned {type(out).__name__} (a value read on the host)"
            return
        self.steps.append((_OP, func, arg_list, fills, kw, kw_fills, outs))

    def _shortcut(self, func, args, out: Tensor) -> bool:
        """Record an allocation, or a view of a traced tensor, without the op's dispatch: allocations
        replay as `empty_strided`, views as `as_strided` of the base's slot (absolute storage offsets:
        an input's is part of the signature), a detach or alias as the base itself."""
        if func in _ALLOCATIONS and not out.is_pinned():
            self.steps.append((_ALLOC, tuple(out.shape), out.stride(), out.dtype, out.device, self._new_slot(out)))
            return True
        base = args[0] if args and isinstance(args[0], Tensor) else None
        if base is None or not func.is_view or id(base) not in self.slot_of:
            return False
        if out.dtype != base.dtype or out.is_conj() or out.is_neg() or out.device != base.device:
            return False
        slot = self.slot_of[id(base)]
        if func in _ALIASES and (out.shape, out.stride(), out.storage_offset()) == (
                base.shape, base.stride(), base.storage_offset()):
            self._trace(out, slot)
            return True
        self.steps.append((_VIEW, slot, tuple(out.shape), out.stride(), out.storage_offset(), self._new_slot(out)))
        return True

    def _new_slot(self, t: Tensor) -> int:
        slot = self.n_slots
        self.n_slots += 1
        self._trace(t, slot)
        return slot

    def _trace(self, t: Tensor, slot: int) -> None:
        key = id(t)
        self.slot_of[key] = slot
        weakref.finalize(t, self._forget, key, slot)

    def close(self) -> None:
        """Let go of the recorded call's tensors (the traced results' finalizers outlive the recorder)."""
        self.keep.clear()
        self.slot_of.clear()
        self.steps = []

    def _forget(self, key: int, slot: int) -> None:
        if self.slot_of.get(key) == slot:
            del self.slot_of[key]

    def _template(self, args) -> tuple[list, list, list]:
        """(args with each traced tensor's place left empty for its slot, [(position, index in a list
        or -1, slot)], [(position, descriptor snapshot, slot of its base)]): a TMA descriptor over a
        traced tensor is rebuilt over that slot's tensor at each replay. A template holds constants
        only, never a tensor of the recorded call (a plan would keep it alive)."""
        template, fills, descs = list(args), [], []
        for i, a in enumerate(args):
            if isinstance(a, Tensor):
                slot = self.slot_of.get(id(a))
                if slot is None:
                    self.keep.append(a)  # a constant (made before the call, or by C++ without a dispatch)
                else:
                    template[i] = None
                    fills.append((i, -1, slot))
            elif isinstance(a, (list, tuple)) and any(isinstance(t, Tensor) for t in a):
                template[i] = list(a)
                for j, t in enumerate(a):
                    slot = self.slot_of.get(id(t)) if isinstance(t, Tensor) else None
                    if slot is not None:
                        template[i][j] = None
                        fills.append((i, j, slot))
                    elif isinstance(t, Tensor):
                        self.keep.append(t)
            elif hasattr(a, "block_shape") and isinstance(getattr(a, "base", None), Tensor):
                # the fields as they are at this launch (a config's pre-hook may set another box later)
                snapshot = object.__new__(type(a))
                snapshot.__dict__.update({k: list(v) if isinstance(v, list) else v for k, v in a.__dict__.items()})
                template[i] = snapshot
                slot = self.slot_of.get(id(a.base))
                if slot is None:
                    self.keep.append(a.base)
                else:
                    snapshot.base = None
                    descs.append((i, snapshot, slot))
        return template, fills, descs

    # ---------------------------------------------------------------- launches
    def launch(self, launcher, kernel, grid, device: int, values: list):
        if self.why is not None or self.depth:
            return
        if self.device is not None and device != self.device:
            self.why = "launches on two devices"
            return
        self.device = device
        template, fills, descs = self._template(values)
        if any(j >= 0 for _, j, _ in fills):
            self.why = "a list of tensors as a kernel argument"
            return
        self.kernels[id(launcher)] = (launcher.fn, launcher)
        fills = tuple((i, s) for i, _, s in fills)
        raw = _raw_step(kernel, grid, values, template, fills, descs)
        self.steps.append(raw or (_LAUNCH, kernel, *grid, tuple(template), fills, tuple(descs)))

    def call(self, kernel, grid, args, kwargs):
        if self.why is not None or self.depth:
            return
        # a grid function reads the launch's sizes and META alone: kept as it is
        template, fills, descs = self._template(args)
        kw, kw_fills = {}, []
        for name, value in kwargs.items():
            slot = self.slot_of.get(id(value)) if isinstance(value, Tensor) else None
            if slot is None:
                kw[name] = value
            else:
                kw_fills.append((name, slot))
        self.steps.append((_CALL, kernel, grid, template, fills, descs, kw, kw_fills))

    # ---------------------------------------------------------------- the plan
    def plan(self, result) -> _Plan | None:
        if self.why is not None:
            return None
        template = self._result(result)
        if template is None:
            return None
        return _Plan(self.n_inputs, self.n_slots, tuple(self.steps), template, self.device,
                     tuple(fn for fn, _ in self.kernels.values()))

    def _result(self, value):
        if isinstance(value, Tensor):
            slot = self.slot_of.get(id(value))
            if slot is None or slot < self.n_inputs:
                self.why = "a result that is an input or was not made by the call"
                return None
            return ("slot", slot)
        if isinstance(value, (list, tuple)):
            parts = [self._result(v) for v in value]
            if any(p is None for p in parts):
                return None
            return ("tuple" if isinstance(value, tuple) else "list", parts)
        return ("const", value)
