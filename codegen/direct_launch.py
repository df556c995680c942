"""Launch a compiled Triton (or Gluon) kernel without `JITFunction.run`'s per-call Python.

    launch(kernel, grid, *args, **kwargs)   == kernel[grid](*args, **kwargs)

`JITFunction.run` binds the arguments, formats a string key of their specialization and the
options, looks the compiled kernel up, checks the globals the kernel read, builds launch metadata
and only then calls the compiled launcher. `launch` keeps one table per kernel from an exact key
(the constexpr values, the options, and each runtime argument's specialization as Triton's own
`native_specialize_impl` computes it: dtype, 16-byte alignment, ints equal to 1 or divisible by 16)
to the `CompiledKernel` that `run` returned for it, and calls that kernel's launcher directly. A key
not seen yet goes through `run` (which compiles, and launches); so does every call while a launch
hook is set (the profilers' launch metadata) and after a global a kernel read has changed (`run`
then raises its error). Off the CUDA driver (TRITON_INTERPRET=1) `launch` is `kernel[grid](...)`.

Measured (docs/DESIGN.md, "Where host time goes"): `JITFunction.run` took 118 us a launch under
cProfile in a compiled 7b-256 fwd+bwd step (H200, 2026-11-28), 14 launches a step; side by side
on an H100 the step's host time was 4.37 ms with `launch` against 4.58 through `kernel[grid]`
(medians of 2 rounds, inside the round-to-round spread).
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch

from . import plans

try:
    from triton import knobs as _knobs
    from triton._C.libtriton import native_specialize_impl as _specialize
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:  # another Triton: every launch goes through kernel[grid]
    _knobs = _specialize = _JITFunction = None

_MISSING = object()

# False: every launch is `kernel[grid](...)` (A/B runs: benchmarks/bench_layer.py's
# "ours-compiled-triton-launch").
ENABLED = True


class _Launcher:
    """One kernel's compiled variants by exact key, and what binding its arguments needs."""

    def __init__(self, fn):
        self.fn = fn
        params = fn.params
        self.names = fn.arg_names
        self.index = {name: i for i, name in enumerate(self.names)}
        self.defaults = [p.default for p in fn.signature.parameters.values()]
        self.constexprs = [i for i, p in enumerate(params) if p.is_constexpr]
        # (position, is_const, specialize, align): the binder's arguments to native_specialize_impl
        self.runtime = [(i, p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
                        for i, p in enumerate(params) if not p.is_constexpr]
        # annotated runtime arguments get a specialization the binder spells differently: not taken here
        self.usable = not any(p.annotation_type for p in params if not p.is_constexpr)
        self.kernels: dict[tuple, object] = {}

    def bind(self, args: tuple, kwargs: dict) -> list:
        values = list(args)
        for name in self.names[len(args):]:
            value = kwargs.get(name, _MISSING)
            if value is _MISSING:
                value = self.defaults[self.index[name]]
            values.append(value)
        return values

    def __call__(self, grid, args: tuple, kwargs: dict) -> None:
        fn = self.fn
        if not self.usable or fn.pre_run_hooks or hooked():
            fn.run(*args, grid=grid, warmup=False, **kwargs)
            return
        runtime = _knobs.runtime
        device = torch._C._cuda_getDevice()
        backend = fn.device_caches[device][3]
        values = self.bind(args, kwargs)
        options = tuple((k, v) for k, v in kwargs.items() if k not in self.index)
        key = (device, options, runtime.debug, _knobs.compilation.instrumentation_mode,
               *(values[i] for i in self.constexprs),
               *(_specialize(backend, values[i], const, spec, align) for i, const, spec, align in self.runtime))
        try:
            kernel = self.kernels.get(key)
        except TypeError:  # an unhashable constexpr: Triton's own path
            fn.run(*args, grid=grid, warmup=False, **kwargs)
            return
        if kernel is None or self.globals_changed():
            kernel = fn.run(*args, grid=grid, warmup=False, **kwargs)
            if kernel is not None:
                self.kernels[key] = kernel
            return
        if callable(grid):
            grid = grid(dict(zip(self.names, values)))
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *values)
        if plans.recording():
            plans.record_launch(self, kernel, (grid[0], g1, g2), device, values)

    def globals_changed(self) -> bool:
        for (name, _), (value, scope) in self.fn.used_global_vals.items():
            if scope.get(name, _MISSING) != value:
                return True
        return False


def _hooked(hook) -> bool:
    """A launch hook is set: a callable, or a HookChain (Triton >= 3.5) holding one."""
    return hook is not None and bool(getattr(hook, "calls", True))


def hooked() -> bool:
    """A launch enter or exit hook is set (the profilers' launch metadata): launches take `run`."""
    if _knobs is None:
        return False
    runtime = _knobs.runtime
    return _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook)


_LAUNCHERS: dict[int, tuple[object, Callable | None]] = {}


def _launcher_for(kernel) -> Callable | None:
    entry = _LAUNCHERS.get(id(kernel))
    if entry is None or entry[0] is not kernel:
        usable = _JITFunction is not None and isinstance(kernel, _JITFunction) and hasattr(kernel, "device_caches")
        entry = _LAUNCHERS[id(kernel)] = (kernel, _Launcher(kernel) if usable else None)
    return entry[1]


def launch(kernel, grid, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`, through the cached compiled kernel when its key was seen."""
    launcher = _launcher_for(kernel) if ENABLED else None
    if launcher is None:
        if plans.recording():
            with plans.launching():
                kernel[grid](*args, **kwargs)
            plans.record_call(kernel, grid, args, kwargs)
        else:
            kernel[grid](*args, **kwargs)
    else:
        launcher(grid, args, kwargs)


class RawLauncher:
    """A compiled kernel's C launch function, called as Triton's `CudaLauncher` calls it, with each
    host TMA descriptor argument already expanded (Triton 3.6's `make_tensordesc_arg`: the encoded
    CUtensorMap, then the descriptor's shape and strides).

    Launch plans (`codegen.plans`) replay a launch through it: what `CudaLauncher.__call__` and its
    descriptor wrapper do at every call (a scratch-size check, one Python pass over the arguments,
    one `cuTensorMapEncodeTiled` per descriptor) is done once, and a descriptor's encoding is kept
    per base address, since its other fields are fixed by the plan."""

    __slots__ = ("launch", "cooperative", "pdl", "metas", "expand")

    def __init__(self, launch, cooperative, pdl, metas: dict, expand):
        self.launch, self.cooperative, self.pdl, self.metas, self.expand = launch, cooperative, pdl, metas, expand


def raw_launcher(kernel) -> RawLauncher | None:
    """The raw launch of a compiled `kernel` (a `CompiledKernel`) where its launcher has the shape of
    Triton 3.6's `CudaLauncher`: no global or profile scratch memory, and host descriptors (if any)
    expanded by a wrapper whose closure holds the C launch, the descriptor positions and their
    metadata. None otherwise (another Triton, another backend, scratch memory): the caller launches
    through `kernel.run`."""
    try:
        runner = kernel.run
    except Exception:  # noqa: BLE001 - a kernel that failed to load raises here; its launch reports it
        return None
    needed = ("launch", "global_scratch_size", "profile_scratch_size", "launch_cooperative_grid", "launch_pdl")
    if not all(hasattr(runner, name) for name in needed):
        return None
    if runner.global_scratch_size or runner.profile_scratch_size:
        return None
    launch, metas, expand = runner.launch, {}, None
    if not inspect.isbuiltin(launch):
        code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
        if code is None or closure is None:
            return None
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure)))
        if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
            return None
        expand = launch.__globals__.get("make_tensordesc_arg")
        if expand is None or len(inspect.signature(expand).parameters) != 2:
            return None
        indices, meta = sorted(cells["tensordesc_indices"]), cells["tensordesc_meta"]
        if len(indices) != len(meta) or any(m is None for m in meta) or not inspect.isbuiltin(cells["launcher"]):
            return None
        metas, launch = dict(zip(indices, meta)), cells["launcher"]
    return RawLauncher(launch, runner.launch_cooperative_grid, runner.launch_pdl, metas, expand)
