"""How the Triton MoE kernels are launched: configs and tuning, TMA descriptors, the experts' weights
as the kernels address them, and the one predicate of what the kernels take.

    runs_triton(t)              -> bool: calls on t's device go to the Triton kernels
    supports(...)               -> bool: the kernels handle this stacked-weights call
    list_banks(...)             -> the per-expert weights' Banks, or None: the predicate of the list form
    _launch(tuner, grid, ...)   -> a tuned kernel launched with the config its autotuner chose

Tuning. Each GEMM kernel autotunes over a small config set, keyed on the problem's (d, n, E, K)
dims and the tensors' dtypes (Triton adds those), never on T: the row count TK is a runtime int
marked do_not_specialize, so a new T neither recompiles nor retunes. `SONIC_MOE_TRITON_CONFIG`
pins one config per kernel, read once at import:

    SONIC_MOE_TRITON_CONFIG="up:128x128x64:8:3;scatter:128x128x64:8:3;dact:128x128x64:8:3;wgrad:128x128x64:8:3"

Each entry is `kernel:AxBxC:num_warps:num_stages`; kernel is one of up, scatter, dact (the dA' GEMM),
wgrad, or `*` for all. AxBxC is BLOCK_M x BLOCK_N x BLOCK_K for up/scatter/dact, and BLOCK_P x BLOCK_Q x BLOCK_M
(the two output tile sides, then the row chunk of the reduction) for wgrad. Under TRITON_INTERPRET=1
every kernel runs one small config (autotuning with several configs needs a GPU).

TMA. On Hopper, 16-bit stacked weights with 16-byte rows go through TMA descriptors: the scatter
GEMMs become the persistent `_scatter_gemm_tma_kernel`, the up-projection and the dA' GEMM the
persistent `_up_proj_persistent_kernel` (where one dot per K step takes the weight tile), the weight
gradients keep their structure with the expert-ordered operand landing by TMA. Gathered operands
stay pointer loads. Per-expert tensors (the list form) and misaligned rows use pointers.

Gluon. On Hopper with Triton 3.6, warp-specialized Gluon kernels (`kernels.gluon_wgrad`,
`kernels.gluon_scatter`) are candidates for the weight gradients and the TMA scatter GEMMs
(`_gluon_module`): `wgrad_choice` times them against the Triton kernels at each key's first call
and keeps the faster (SONIC_MOE_WGRAD, SONIC_MOE_SCATTER pin one).

`SONIC_MOE_KERNEL=reference` sends every call to the pure-torch reference (`codegen.reference`),
read once at import.
"""
from __future__ import annotations

import importlib
import logging
import os
from typing import NamedTuple

import torch
import triton
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from . import plans
from .activations import ACTIVATIONS, GATED
from .direct_launch import launch
from .ints import cdiv
from .kernels.backward import _wgrad_kernel
from .kernels.grouped_gemm import (
    _scatter_gemm_kernel,
    _scatter_gemm_tma_kernel,
    _up_proj_kernel,
    _up_proj_persistent_kernel,
)

log = logging.getLogger("moe_compiler")


# activation name -> the constexpr code of codegen/kernels/activation.py
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
assert tuple(_ACT_CODE) == ("swiglu", "geglu", "geglu_tanh", "swiglu_oai", "relu2", "gelu", "silu", "swiglu_clamp",
                           "swiglu_softcap", "relu", "gelu_tanh", "reglu")
_IDENTITY = 15  # internal code: the up-projection kernel as a plain gathered GEMM (dA')

# True when Triton was imported with TRITON_INTERPRET=1: kernels run on the CPU, on CPU tensors.
INTERPRETED = type(_up_proj_kernel).__name__ == "InterpretedFunction"

# `SONIC_MOE_KERNEL=reference`: every call takes the pure-torch reference (debugging, A/B checks).
FORCE_REFERENCE = os.environ.get("SONIC_MOE_KERNEL", "auto") == "reference"


def runs_triton(t: Tensor) -> bool:
    """Whether the ops send a call on `t`'s device to the Triton kernels (when `supports` agrees):
    CUDA, unless SONIC_MOE_KERNEL=reference. Interpreted kernels are called through the launchers."""
    return not FORCE_REFERENCE and t.device.type == "cuda"


# The M tile of every row-tiled GEMM on the GPU: the tile `sonic.token_rounding` rounds expert counts
# to, so a rounded expert fills its tiles exactly.
M_TILE = 128

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_EXPERTS = 4096  # the tile schedule scans all experts in registers (E_POW2-wide vectors)

_KERNEL_NAMES = ("up", "scatter", "dact", "wgrad")


def _cfg(kernel: str, a: int, b: int, c: int, warps: int, stages: int, fused: bool = False) -> triton.Config:
    if kernel == "wgrad":
        kw = dict(BLOCK_P=a, BLOCK_Q=b, BLOCK_M=c)
    else:
        kw = dict(BLOCK_M=a, BLOCK_N=b, BLOCK_K=c, GROUP_M=_GROUP_M)
    if kernel in ("up", "dact"):
        kw["FUSED_GU"] = fused
    return triton.Config(kw, num_warps=warps, num_stages=stages)


# M tiles walked together down each N tile (kernels.grouped_gemm._grouped_order): L2 reuse of the
# weight tiles when n is large (Mixtral's 14336), neutral when it is small.
_GROUP_M = 8

# Candidate configs for the H100 (bf16): 128-row tiles match the wgmma M of two warpgroups.
_GPU_CONFIGS = {
    # measured on the H100 at the 7B / Qwen3 / 30B shapes: 128x(2x128) tiles win; gate+up fused in one
    # dot wins at n=256, two dots at n=768/512 (within 5% of each other)
    "up": [(128, 128, 64, 8, 3, True), (128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4, True),
           (128, 64, 64, 4, 4)],
    "scatter": [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 256, 32, 8, 4), (128, 128, 64, 8, 3)],
    "dact": [(128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 4),
             (128, 64, 64, 4, 4)],
    "wgrad": [(128, 128, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3),
              (128, 128, 64, 4, 3)],
}
# IEEE float32 dots (float32 operands, `_dot_precision`) run on the CUDA cores, not as wgmma: the
# tiles above then spill ~2.7 KB a thread and each took 7-10 s to compile (sm90, Triton 3.6), so a
# float32 model's first call autotuned for minutes. These compile in 0.4-1.6 s, without spills.
_IEEE_GPU_CONFIGS = {
    "up": [(128, 64, 32, 8, 2), (128, 32, 32, 4, 2)],
    "scatter": [(128, 64, 32, 8, 2), (128, 32, 32, 4, 2)],
    "dact": [(128, 64, 32, 8, 2), (128, 32, 32, 4, 2)],
    "wgrad": [(64, 64, 32, 4, 2), (64, 32, 32, 4, 2)],
}
# Every row-tiled config uses M tiles of M_TILE rows.
assert all(c[0] == M_TILE for t in (_GPU_CONFIGS, _IEEE_GPU_CONFIGS) for k in ("up", "scatter", "dact") for c in t[k])
# The interpreter: one config, small tiles (tiny test shapes; ~0.25 GFLOP/s there).
_INTERPRETER_CONFIG = (16, 16, 16, 1, 1, True)


def _parse_pinned(spec: str) -> dict[str, tuple]:
    """`SONIC_MOE_TRITON_CONFIG` -> {kernel: (a, b, c, warps, stages)}; see the module docstring."""
    pinned = {}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        try:
            name, tile, warps, stages = entry.split(":")
            a, b, c = (int(v) for v in tile.lower().split("x"))
            cfg = (a, b, c, int(warps), int(stages))
        except ValueError as exc:
            raise ValueError(
                f"SONIC_MOE_TRITON_CONFIG entry {entry!r} is not kernel:AxBxC:num_warps:num_stages"
            ) from exc
        names = _KERNEL_NAMES if name == "*" else (name,)
        for n in names:
            if n not in _KERNEL_NAMES:
                raise ValueError(f"SONIC_MOE_TRITON_CONFIG: unknown kernel {n!r}; one of {_KERNEL_NAMES} or *")
            pinned[n] = cfg
    return pinned


_PINNED = _parse_pinned(os.environ.get("SONIC_MOE_TRITON_CONFIG", ""))


def _configs(kernel: str) -> list[triton.Config]:
    if INTERPRETED:
        return [_cfg(kernel, *_INTERPRETER_CONFIG)]
    if kernel in _PINNED:
        return [_cfg(kernel, *_PINNED[kernel], fused=True)]  # a pinned "up" config uses the fused gate/up dot
    return [_cfg(kernel, *c) for c in _GPU_CONFIGS[kernel]]


def _pointer_configs(kernel: str) -> list[triton.Config]:
    """The pointer-load kernels' configs: `_configs`, then on the GPU the IEEE float32 ones (marked
    `ieee_dot`); `_by_dot_precision` gives each launch one of the two sets. TMA kernels never see
    float32 (`_tma_operand`), so their configs derive from `_configs` alone."""
    configs = _configs(kernel)
    if INTERPRETED or kernel in _PINNED:
        return configs
    ieee = [_cfg(kernel, *c) for c in _IEEE_GPU_CONFIGS[kernel]]
    for c in ieee:
        c.ieee_dot = True
    return configs + ieee


def _by_dot_precision(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Autotuner pruning: the `ieee_dot` configs for a launch with DOT_PRECISION "ieee" (float32
    operands), the others for 16-bit ones; all of them where the set is empty (the interpreter's one
    config, a pinned one, tests that swap a tuner's configs)."""
    ieee = kwargs.get("DOT_PRECISION", named_args.get("DOT_PRECISION")) == "ieee"
    return [c for c in configs if getattr(c, "ieee_dot", False) == ieee] or configs


def _pointer_tuner(kernel: str, fn, key: list[str]):
    return triton.autotune(_pointer_configs(kernel), key=key,
                           prune_configs_by={"early_config_prune": _by_dot_precision})(fn)


# Autotune keys: the fixed problem dims only (never TK/T: a new batch size must not retune).
_up = _pointer_tuner("up", _up_proj_kernel, ["d", "n", "E", "top_k"])
_scatter = _pointer_tuner("scatter", _scatter_gemm_kernel, ["k_dim", "n_dim", "E"])
_dact = _pointer_tuner("dact", _up_proj_kernel, ["d", "n", "E", "top_k"])  # dA' GEMM
_wgrad = _pointer_tuner("wgrad", _wgrad_kernel, ["P", "Q", "E", "top_k"])


# ------------------------------------------------------------------------ TMA (the copy engine) paths
# Stacked 16-bit weights whose rows meet the copy engine's alignment are read through TMA
# descriptors: by the up-projection and dA' kernels (W_DESC), and by the persistent scatter GEMM
# (`_scatter_gemm_tma_kernel`, its A operand too). Gathered operands stay pointer loads. `USE_TMA`
# (env SONIC_MOE_TMA=0 turns it off at import; benchmarks flip it for A/B runs) selects them.
USE_TMA = os.environ.get("SONIC_MOE_TMA", "1") != "0"
# The up-projection of a concatenated gated W1 through one wide dot (`_up_weight_desc`); env
# SONIC_MOE_WIDE_UP=0 (or `set_wide_up`, which the benchmarks call for A/B runs) turns it off.
WIDE_UP = os.environ.get("SONIC_MOE_WIDE_UP", "1") != "0"
# The up-projection and the dA' GEMM through TMA in one dot per K step run as the persistent
# `_up_proj_persistent_kernel`; env SONIC_MOE_PERSISTENT_UP=0 (or `set_persistent_up`) keeps one
# program per tile.
PERSISTENT_UP = os.environ.get("SONIC_MOE_PERSISTENT_UP", "1") != "0"


def _w_block_hook(nargs):
    """Autotune pre-hook: give the weight descriptor the config's tile (see kernels `_w_tile`); an
    interleaved gated W1's tile is twice as wide (its gate and up rows alternate); a concatenated
    one's (W_DESC 3, `_up_weight_desc`) holds the gate and the up rows as a dim of 2."""
    bn, bk = nargs["BLOCK_N"], nargs["BLOCK_K"]
    if nargs.get("INTERLEAVED") and nargs.get("GATED"):
        bn *= 2
    desc = nargs["w_desc"] if "w_desc" in nargs else nargs["w1_ptr"]
    desc.block_shape = {1: [1, bn, bk], 2: [1, bk, bn], 3: [1, 2, bn, bk]}[nargs["W_DESC"]]
    if "in_desc" in nargs:
        nargs["in_desc"].block_shape = [nargs["BLOCK_M"], bk]


def _wgrad_block_hook(nargs):
    """Autotune pre-hook of the weight-gradient kernel: its expert-ordered operand's descriptor tile."""
    bm = nargs["BLOCK_M"]
    if nargs["LHS_DESC"]:
        nargs["lhs_ptr"].block_shape = [bm, nargs["BLOCK_P"]]
    if nargs["RHS_DESC"]:
        nargs["rhs_ptr"].block_shape = [bm, nargs["BLOCK_Q"]]


def _tma_configs(kernel: str) -> list[triton.Config]:
    """The kernel's configs as TMA configs: the block-shape hook, no fused gate/up dot (the copy
    engine lands gate and up tiles separately)."""
    hook = _wgrad_block_hook if kernel == "wgrad" else _w_block_hook
    configs, seen = [], set()
    for c in _configs(kernel):
        kw = dict(c.kwargs, **({"FUSED_GU": False} if "FUSED_GU" in c.kwargs else {}))
        key = (tuple(sorted(kw.items())), c.num_warps, c.num_stages)
        if key not in seen:
            seen.add(key)
            configs.append(triton.Config(kw, num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=hook))
    return configs


def _persistent_configs(kernel: str) -> list[triton.Config]:
    """The TMA configs of the up-projection or dA' GEMM for `_up_proj_persistent_kernel`, which has
    no pointer-load variants (FUSED_GU, False in every TMA config)."""
    return [triton.Config({k: v for k, v in c.kwargs.items() if k != "FUSED_GU"}, num_warps=c.num_warps,
                          num_stages=c.num_stages, pre_hook=c.pre_hook) for c in _tma_configs(kernel)]


_up_tma = triton.autotune(_tma_configs("up"), key=["d", "n", "E", "top_k"])(_up_proj_kernel)
_dact_tma = triton.autotune(_tma_configs("dact"), key=["d", "n", "E", "top_k"])(_up_proj_kernel)
_up_persistent = triton.autotune(_persistent_configs("up"), key=["d", "n", "E", "top_k"])(_up_proj_persistent_kernel)
_dact_persistent = triton.autotune(_persistent_configs("dact"), key=["d", "n", "E", "top_k"])(
    _up_proj_persistent_kernel)
_scatter_tma = triton.autotune(_tma_configs("scatter"), key=["k_dim", "n_dim", "E"])(_scatter_gemm_tma_kernel)
_wgrad_tma = triton.autotune(_tma_configs("wgrad"), key=["P", "Q", "E", "top_k"])(_wgrad_kernel)


# ------------------------------------------------------------------------ launches after tuning
# Triton's autotuner rebuilds dicts of every argument and a key holding every tensor's dtype at each
# call, ~30 us of Python on top of the kernel's own launch (measured on the CPU machine with the
# launch stubbed out): a fwd+bwd runs nine tuned launches, a decode step three per layer. `_launch`
# asks the autotuner once per key and then launches the kernel with the config it chose.
_TUNED: dict[tuple, tuple[triton.Config, dict]] = {}
_KEY_POSITIONS: dict[int, tuple[int, ...]] = {}


def _launch(tuner, grid, *args, **kwargs) -> None:
    """`tuner[grid](*args, **kwargs)`. Keyed like the autotuner (its key arguments' values and every
    tensor argument's dtype, and its config list), so each key gets the config the autotuner picked
    for it; its pre-hook (the TMA block shapes) still runs at every launch. Key arguments must be
    positional. Code that changes a tuner's configs in place calls `forget_tuned_launches()`."""
    positions = _KEY_POSITIONS.get(id(tuner))
    if positions is None:
        positions = _KEY_POSITIONS[id(tuner)] = tuple(tuner.arg_names.index(k) for k in tuner.keys)
    key = (id(tuner), id(tuner.configs), *(args[i] for i in positions),
           *(a.dtype for a in args if isinstance(a, Tensor)))
    tuned = _TUNED.get(key)
    if tuned is None:
        plans.abort("autotuning")
        tuner[grid](*args, **kwargs)
        config = getattr(tuner, "best_config", None)
        if config is not None:
            _TUNED[key] = (config, config.all_kwargs())
        return
    config, meta = tuned
    if config.pre_hook is not None:
        config.pre_hook({**dict(zip(tuner.arg_names, args)), **kwargs, **meta})
    launch(tuner.fn, grid, *args, **kwargs, **meta)


def forget_tuned_launches() -> None:
    """Send every launch through its autotuner again (tests that swap a tuner's configs)."""
    _TUNED.clear()
    plans.forget()


def set_persistent_up(persistent: bool) -> None:
    """Switch `PERSISTENT_UP` at run time (A/B runs in the benchmarks)."""
    global PERSISTENT_UP
    PERSISTENT_UP = persistent
    forget_tuned_launches()


def set_wide_up(wide: bool) -> None:
    """Switch `WIDE_UP` at run time. The up-projection's TMA autotuner keys on the problem's dims
    alone, so its configs are tuned again: neither path runs a config picked on the other."""
    global WIDE_UP
    WIDE_UP = wide
    _up_tma.cache.clear()
    forget_tuned_launches()


def _tma_operand(t: Tensor, dims: tuple[int, ...], strides: tuple[int, ...]) -> TensorDescriptor | None:
    """A TMA descriptor over `t`'s storage read as `dims` through `strides` (the last one 1), or None
    when the copy engine cannot address it (off CUDA and the interpreter, not 16-bit, misaligned,
    a zero-sized dim, a broadcast (stride 0) dim). The block shape is the autotune hook's to set."""
    if not USE_TMA or t.dtype not in (torch.float16, torch.bfloat16) or not (t.is_cuda or INTERPRETED):
        return None
    size = t.element_size()
    if strides[-1] != 1 or any(s <= 0 or s * size % 16 for s in strides[:-1]) or t.data_ptr() % 16 or min(dims) <= 0:
        return None
    if t.is_cuda and _major(t.device) < 9:
        return None
    return TensorDescriptor(t, list(dims), list(strides), [1] * (len(dims) - 1) + [16 // size])


def _weight_desc(bank: Bank, E: int, n_out: int, k_in: int, s_out: int, s_in: int) -> tuple[TensorDescriptor | None, int]:
    """(descriptor, W_DESC) for stacked weights read as B[e] [k_in, n_out] through (out, in) strides
    s_out / s_in; (None, 0) for per-expert tensors or a layout TMA cannot read."""
    if bank.table is not None:
        return None, 0
    se = bank.strides[0]
    if s_in == 1:
        desc = _tma_operand(bank.ptr, (E, n_out, k_in), (se, s_out, 1))
        return desc, 1 if desc is not None else 0
    if s_out == 1:
        desc = _tma_operand(bank.ptr, (E, k_in, n_out), (se, s_in, 1))
        return desc, 2 if desc is not None else 0
    return None, 0


def _up_weight_desc(bank: Bank, E: int, n: int, d: int, gated: bool,
                    interleaved: bool) -> tuple[TensorDescriptor | None, int]:
    """The up-projection's W1 descriptor. A concatenated gated W1 in nn.Linear's orientation is read
    as [E, 2, n, d] (W_DESC 3): one copy lands a gate tile and its up tile together and the kernel
    issues one dot of width 2*BLOCK_N, as for an interleaved W1. H100, `bench_up_proj.py`: 6-18%
    faster than two dots (7b-256 707 -> 634 us, Qwen3 1720 -> 1615, gpt-oss sizes 4508 -> 3804).
    Not for a transposed W1: its [E, d, 2, n] tile ran 1.25x slower than two dots at those shapes.
    `WIDE_UP` False: two dots on separate tiles (W_DESC 1 / 2)."""
    s_out, s_in = bank.strides[1:]
    if WIDE_UP and gated and not interleaved and bank.table is None and s_in == 1:
        desc = _tma_operand(bank.ptr, (E, 2, n, d), (bank.strides[0], n * s_out, s_out, 1))
        if desc is not None:
            return desc, 3
    return _weight_desc(bank, E, 2 * n if gated else n, d, s_out, s_in)


_SM_COUNT: dict[int, int] = {}
_MAJOR: dict[int, int] = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _major(device: torch.device) -> int:
    """The device's compute capability major (asked once per device: each call costs a few us)."""
    index = _device_index(device)
    if index not in _MAJOR:
        _MAJOR[index] = torch.cuda.get_device_capability(index)[0]
    return _MAJOR[index]


def _programs(device: torch.device) -> int:
    """Programs of a persistent kernel: one per SM (its tiles fill the SM's shared memory)."""
    if INTERPRETED:
        return 4
    index = _device_index(device)
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 tl.dot defaults to tf32 on the GPU (~3e-4 relative error); fp32 callers get IEEE fp32.
    return "ieee" if dtype == torch.float32 else "tf32"


class Bank(NamedTuple):
    """One projection's expert weights as the GEMM kernels address them.

    Stacked weights: `ptr` is the [E, ., .] tensor and expert e starts e * strides[0] elements in.
    Per-expert tensors (`codegen.ops.moe_experts_list`): `ptr` is expert 0's tensor and `table`
    (int64 [2E]) holds each expert's start, then the start of its up rows, as element offsets from
    it; strides[0] is unused. `strides` are (e, out, in) in nn.Linear's orientation: W1 [w1_out, d],
    W2 [d, n]. `split` > 0: the W1 rows from `split` on live in the up tensors (separate gate/up).
    """

    ptr: Tensor
    strides: tuple[int, int, int]
    table: Tensor | None = None
    split: int = 0
    align: int = 1  # every table entry is a multiple of this many elements (16 bytes when it can be)

    def kernel_args(self):
        """(pointer, table pointer, W_TABLE, W_ALIGN) for a kernel launch; the table argument is not
        read when there is none."""
        return self.ptr, self.ptr if self.table is None else self.table, self.table is not None, self.align


def _stacked_banks(w1: Tensor, w2: Tensor, transposed: bool) -> tuple[Bank, Bank]:
    s1, s2 = w1.stride(), w2.stride()
    if transposed:  # W1 [E, d, w1_out], W2 [E, n, d]
        return Bank(w1, (s1[0], s1[2], s1[1])), Bank(w2, (s2[0], s2[2], s2[1]))
    return Bank(w1, tuple(s1)), Bank(w2, tuple(s2))


def supports(x, topk_ids, topk_weights, w1, w2, b1, b2, *, activation, interleaved, transposed, alpha, limit) -> bool:
    """Whether the Triton kernels handle this call; anything else runs the pure-torch reference."""
    if activation not in _ACT_CODE:
        return False
    if not (x.is_cuda or (INTERPRETED and x.device.type == "cpu")):
        return False
    if x.dtype not in _SUPPORTED_DTYPES or w1.dtype != x.dtype or w2.dtype != x.dtype:
        return False
    if any(b is not None and b.dtype != x.dtype for b in (b1, b2)):
        return False
    if not topk_weights.dtype.is_floating_point or topk_weights.dtype == torch.float64:
        return False
    if topk_ids.dtype not in (torch.int32, torch.int64):
        return False
    E = w1.shape[0]
    return 0 < E <= _MAX_EXPERTS and topk_ids.numel() < 2**31


# Per-expert weights: (pointers, strides, sizes, dtypes of every tensor, layout flags) -> their two
# Banks, or None when the kernels cannot address them (a layout differing between experts).
# Weights keep their addresses from step to step (optimizers update them in place), so after the
# first step every call is a hit: ~0.1 ms of Python for 3 x 128 tensors, no host sync, no copy.
_LIST_BANKS: dict[tuple, tuple[Bank, Bank] | None] = {}
_MAX_LIST_BANKS = 256


def list_banks(x, topk_ids, topk_weights, w_gate, w_up, w_down, b1=None, b2=None, *, activation, interleaved, **_):
    """(W1, W2) Banks reading per-expert tensors in place, or None when the kernels do not take
    this call (then the reference runs). Every tensor of a list must share expert 0's shape and
    strides: the kernels address each expert with them. b1, b2: the stacked biases, if any."""
    tensors = (*w_gate, *w_up, *w_down)
    key = (activation, interleaved, len(w_gate), len(w_up), tuple(map(Tensor.data_ptr, tensors)),
           tuple(map(Tensor.stride, tensors)), tuple(map(Tensor.size, tensors)),
           tuple(t.dtype for t in tensors), w_gate[0].device if w_gate else None)
    if key in _LIST_BANKS:
        banks = _LIST_BANKS[key]
    else:
        banks = _build_list_banks(w_gate, w_up, w_down, activation=activation, interleaved=interleaved)
        if len(_LIST_BANKS) >= _MAX_LIST_BANKS:
            _LIST_BANKS.clear()
        _LIST_BANKS[key] = banks
    if banks is None or x.device != w_gate[0].device:
        return None
    E = len(w_gate)
    stand_in = (w_gate[0].expand(E, -1, -1), w_down[0].expand(E, -1, -1))  # [E, ., .] views, no copy
    ok = supports(x, topk_ids, topk_weights, *stand_in, b1, b2, activation=activation, interleaved=interleaved,
                  transposed=False, alpha=0.0, limit=0.0)
    return banks if ok else None


def _build_list_banks(w_gate, w_up, w_down, *, activation, interleaved) -> tuple[Bank, Bank] | None:
    if not w_gate or not w_down or len(w_down) != len(w_gate) or (w_up and len(w_up) != len(w_gate)):
        return None
    for group in (w_gate, w_up, w_down):
        if group and any(w.dtype != group[0].dtype or w.shape != group[0].shape or w.stride() != group[0].stride()
                         or w.device != group[0].device for w in group):
            return None
    if w_up and (w_up[0].stride() != w_gate[0].stride() or w_up[0].dtype != w_gate[0].dtype):
        return None
    size = w_gate[0].element_size()
    if any(t.data_ptr() % size for t in (*w_gate, *w_up, *w_down)):
        return None
    g = w_gate[0]
    if w_up:  # separate gate [n, d] and up [n, d] tensors: W1 rows n.. come from the up table
        table1, split = _offset_table(w_gate, w_up, 0), g.shape[0]
    else:  # one [w1_out, d] tensor per expert; a concatenated gated one has its up rows n further on
        shift = 0 if interleaved or not GATED[activation] else (g.shape[0] // 2) * g.stride(0)
        table1, split = _offset_table(w_gate, None, shift), 0
    table2 = _offset_table(w_down, None, 0)
    return (Bank(g, (0, *g.stride()), table1[0], split, table1[1]),
            Bank(w_down[0], (0, *w_down[0].stride()), table2[0], 0, table2[1]))


def _offset_table(first: list[Tensor], second: list[Tensor] | None, second_shift: int) -> tuple[Tensor, int]:
    """(int64 [2E] on the weights' device, the alignment of its entries in elements): the element
    offsets of each `first[e]` from first[0], then of each second[e] (or first[e] + second_shift
    elements when there is no second list). Copied from pinned memory without a host sync (the
    pinned allocator keeps the buffer until the copy ran)."""
    base = first[0]
    size, origin = base.element_size(), base.data_ptr()
    offs = [(t.data_ptr() - origin) // size for t in first]
    offs += [(t.data_ptr() - origin) // size for t in second] if second else [o + second_shift for o in offs]
    host = torch.tensor(offs, dtype=torch.int64)
    if base.is_cuda:
        host = host.pin_memory()
    vector = max(1, 16 // size)  # 16-byte alignment: the weight loads vectorise
    align = vector if origin % 16 == 0 and all(o % vector == 0 for o in offs) else 1
    return host.to(base.device, non_blocking=True), align


# ------------------------------------------------------------------------ grids


def _persistent_up(desc, w_desc: int, gated: bool, interleaved: bool) -> bool:
    """Whether the up-projection / dA' GEMM runs as `_up_proj_persistent_kernel`: weights by TMA in
    one dot per K step (not a concatenated gated W1 in two dots)."""
    return PERSISTENT_UP and desc is not None and (w_desc == 3 or not gated or interleaved)


def _tile_grid(TK: int, E: int, n: int):
    """One program per (M tile, N tile): the M tiles' upper bound cdiv(TK, BLOCK_M) + E (each expert's
    last tile may be partial) times the N tiles of n columns."""
    return lambda META: ((cdiv(TK, META["BLOCK_M"]) + E) * cdiv(n, META["BLOCK_N"]),)


def _persistent_grid(TK: int, E: int, n: int, device: torch.device):
    """One program per SM, or per (M tile, N tile) where there are fewer."""
    tiles = _tile_grid(TK, E, n)
    return lambda META: (min(tiles(META)[0], _programs(device)),)


# Triton versions the Gluon kernels (`kernels.gluon_wgrad`, `kernels.gluon_scatter`) were checked on
# (H100: results equal to the Triton kernels'). Gluon is experimental and its API and code
# generation change between releases; elsewhere they are not offered.
GLUON_TRITON_VERSIONS = ("3.6.",)
_GLUON: dict[str, object] = {}  # module name -> the module, or None where it cannot be used


def _gluon_module(name: str, t: Tensor):
    """`codegen.kernels.<name>` where its Gluon kernel can run on `t`'s device (Hopper, a checked
    Triton), else None. Imported at the first CUDA call."""
    if not t.is_cuda or INTERPRETED or _major(t.device) != 9:
        return None
    if name not in _GLUON:
        module = None
        if triton.__version__.startswith(GLUON_TRITON_VERSIONS):
            try:
                module = importlib.import_module(f"{__package__}.kernels.{name}")
            except Exception as exc:  # an import-time failure of the experimental dialect
                log.info("Gluon kernel %s unavailable: %s: %s", name, type(exc).__name__, exc)
        _GLUON[name] = module if module is not None and module.HAS_GLUON else None
    return _GLUON[name]


def _or(t: Tensor | None, other: Tensor) -> Tensor:
    """A pointer argument for an optional tensor (the kernel does not read it when absent)."""
    return other if t is None else t
