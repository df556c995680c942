"""Launchers for the Triton MoE kernels, and the two entry points `codegen.ops` calls on CUDA.

    supports(...)               -> bool: the one predicate for what the kernels handle
    list_banks(...)             -> the per-expert weights' Banks, or None: the predicate of the list form
    triton_moe_experts_list_fwd / _bwd: the list form's entry points
    triton_moe_experts_fwd(...) -> (out [T, d], H [TK, w1_out] or [0, w1_out], sorted_rows [TK], offsets [E+1])
    triton_moe_experts_bwd(...) -> (dx, d_topk_weights, dw1, dw2, db1 | None, db2 | None)
    triton_moe_experts_bwd_part(part, ...) -> one of its four parts (the split ops of `codegen.ops`)

Notation as in `codegen.activations`. Rows r = 0..TK-1 are in expert order (stable: token order
inside an expert); `sorted_rows[r]` is the flat slot t*K + k of row r; `expert_offsets` [E+1] is the
exclusive prefix of the per-expert counts. H (saved for the backward) is in expert order.

Forward:  route (a Triton counting sort: one program for small batches, three launches over pieces of the
          slots for larger ones up to 511 experts, else a torch sort; no host sync) -> _up_proj_kernel (gather x, H and A = act(H))
          -> _scatter_gemm_kernel (Y = A W2^T + b2, stored in slot order; the Gluon kernel's in TILE order,
          `SCATTER_TILES`) -> _gather_sum_kernel (out). A forward that keeps no H (inference) with few slots
          (`decode_path`) instead runs `kernels.decode`: two launches, the first ranking the slots itself.
Backward: _up_proj_kernel as a gathered GEMM (dA' = gather(dO) W2) -> _act_grad_kernel (dS, dH,
          A' = s A) -> then, in the order `backward_order` finds holds the fewest bytes at once:
          _wgrad_kernel for dW2 and for dW1 (and the biases; or torch._grouped_mm where `wgrad_choice`
          measured it faster), _scatter_gemm_kernel (dX~ = dH W1, slot order) -> _gather_sum_kernel (dX).
          Compiled graphs may run it as four ops (`triton_moe_experts_bwd_part`: act, dw2, dw1, dx;
          `moe_compiler.grad_fold`), dX's gather-sum then adding the router's [T, E] @ [E, d] term
          (_gather_sum_product_kernel).
On Hopper, 16-bit stacked weights with 16-byte rows go through TMA descriptors (see "TMA paths"
below): the scatter GEMMs become the persistent `_scatter_gemm_tma_kernel`, the up-projection and
the dA' GEMM the persistent `_up_proj_persistent_kernel` (where one dot per K step takes the weight
tile), the weight gradients keep their structure with the expert-ordered operand landing by TMA.
Gathered operands stay pointer loads. Per-expert tensors (the list form) and misaligned rows use
pointers. On Hopper with Triton
3.6, warp-specialized Gluon kernels (`kernels.gluon_wgrad`, `kernels.gluon_scatter`) are candidates
for the weight gradients and the TMA scatter GEMMs: `wgrad_choice` times them against the Triton
kernels at each key's first call and keeps the faster (SONIC_MOE_WGRAD, SONIC_MOE_SCATTER pin one).

Tuning. Each GEMM kernel autotunes over a small config set, keyed on the problem's (d, n, E, K)
dims and the tensors' dtypes (Triton adds those), never on T: the row count TK is a runtime int
marked do_not_specialize, so a new T neither recompiles nor retunes. `SONIC_MOE_TRITON_CONFIG`
pins one config per kernel, read once at import:

    SONIC_MOE_TRITON_CONFIG="up:128x128x64:8:3;scatter:128x128x64:8:3;dact:128x128x64:8:3;wgrad:128x128x64:8:3"

Each entry is `kernel:AxBxC:num_warps:num_stages`; kernel is one of up, scatter, dact (the dA' GEMM),
wgrad, or `*` for all. AxBxC is BLOCK_M x BLOCK_N x BLOCK_K for up/scatter/dact, and BLOCK_P x BLOCK_Q x BLOCK_M
(the two output tile sides, then the row chunk of the reduction) for wgrad. Under TRITON_INTERPRET=1
every kernel runs one small config (autotuning with several configs needs a GPU).
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
from itertools import permutations
from typing import NamedTuple

import torch
import triton
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from .activations import ACTIVATIONS, GATED
from .ints import cdiv, pow2
from .kernels.backward import _act_grad_kernel, _wgrad_kernel
from .kernels.combine import _gather_sum_kernel, _gather_sum_product_kernel
from .kernels.decode import _decode_down_kernel, _decode_up_kernel
from .kernels.grouped_gemm import (
    _scatter_gemm_kernel,
    _scatter_gemm_tma_kernel,
    _up_proj_kernel,
    _up_proj_persistent_kernel,
)
from .kernels.routing import (
    _route_count_kernel,
    _route_place_kernel,
    _route_prefix_kernel,
    _route_small_kernel,
    _slot_check_kernel,
    e_pow2,
)
from . import wgrad_choice
from .reference import PAD, tokens_of_slots
from .token_rounding import M_TILE

log = logging.getLogger("moe_compiler")

# activation name -> the constexpr code of codegen/kernels/activation.py
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
assert tuple(_ACT_CODE) == ("swiglu", "geglu", "geglu_tanh", "swiglu_oai", "relu2", "gelu", "silu", "swiglu_clamp",
                           "swiglu_softcap", "relu")
_IDENTITY = 15  # internal code: the up-projection kernel as a plain gathered GEMM (dA')

# True when Triton was imported with TRITON_INTERPRET=1: kernels run on the CPU, on CPU tensors.
INTERPRETED = type(_up_proj_kernel).__name__ == "InterpretedFunction"

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
# Every row-tiled kernel uses M tiles of token_rounding.M_TILE rows: the tile `sonic.token_rounding`
# rounds expert counts to, so a rounded expert fills its tiles exactly.
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
# The Gluon scatter GEMMs (Y, dX~) store TILE order (`gluon_scatter_gemm(out_tiles=True)`: every M
# tile's rows as whole boxes by TMA, no scattered row stores), and the gather-sums read each slot's
# row through the map that the same launch writes (`gluon_scatter_gemm(row_map=...)`); env
# SONIC_MOE_SCATTER_TILES=0 (or `set_scatter_tiles`) keeps slot order.
SCATTER_TILES = os.environ.get("SONIC_MOE_SCATTER_TILES", "1") != "0"
# The product gather-sum (dX with the router's term folded in) loads the next token block's row-map
# entries while it sums the current block's rows ([T, K] routing through a row map); False loads each
# block's entries just before its rows (A/B runs).
MAP_PREFETCH = True


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
        tuner[grid](*args, **kwargs)
        config = getattr(tuner, "best_config", None)
        if config is not None:
            _TUNED[key] = (config, config.all_kwargs())
        return
    config, meta = tuned
    if config.pre_hook is not None:
        config.pre_hook({**dict(zip(tuner.arg_names, args)), **kwargs, **meta})
    tuner.fn.run(*args, grid=grid, warmup=False, **kwargs, **meta)


def forget_tuned_launches() -> None:
    """Send every launch through its autotuner again (tests that swap a tuner's configs)."""
    _TUNED.clear()


def set_persistent_up(persistent: bool) -> None:
    """Switch `PERSISTENT_UP` at run time (A/B runs in the benchmarks)."""
    global PERSISTENT_UP
    PERSISTENT_UP = persistent
    forget_tuned_launches()


def set_scatter_tiles(tiles: bool) -> None:
    """Switch `SCATTER_TILES` at run time (A/B runs; the scatter GEMM's choice keys on it)."""
    global SCATTER_TILES
    SCATTER_TILES = tiles


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


# The one-program routing kernel scans [BLOCK, buckets] tiles: up to this many slot x bucket pairs
# (TK <= 1024 at 256 experts: decode and small prefills), where one launch beats the sort path's ten
# (more than 511 experts, and the interpreter), and up to BLOCK slots where the piece kernels would
# take it (`_small_route_block`).
_SMALL_ROUTE_WORK = 2**18
_SMALL_ROUTE_MAX_BLOCK = 64


def _small_route_block(TK: int, buckets: int, device: torch.device) -> int | None:
    """BLOCK of the one-program routing kernel where `route` runs it, else None.

    On the GPU beside the piece kernels, one program only for slots that fit one [BLOCK, buckets]
    tile, BLOCK <= 64: its time grows with the tile's length in slots more than with its size, and
    a walk over several tiles loses to the three piece launches. H100, `bench_route.py --small`, GPU
    us a call from CUDA graphs; one program with BLOCK 8192 // buckets up to 1024 (before) / up to
    64 (now) / the piece kernels:
        E=8:   TK=4 24.5 / 3.7 / 5.5,  TK=64 25.0 / 4.1 / 6.0,  TK=256 25.0 / 10.5 / 6.0,  TK=16384 364 / 545 / 6.4
        E=16:  TK=4 23.3 / 5.4 / 6.1,  TK=64 23.8 / 5.1 / 5.8,  TK=16384 697 / 859 / 6.7
        E=64:  TK=4 10.5 / 6.9 / 6.2,  TK=64 10.5 / 6.9 / 6.2,  TK=256 19.5 / 21.3 / 6.2
        E=128: TK=4 5.7 / 5.7 / 6.2,   TK=64 5.8 / 5.8 / 6.3,   TK=256 17.0 / 17.0 / 6.4
        E=256: TK=32 5.8 / 5.9 / 6.9,  TK=64 9.2 / 9.2 / 6.9
    The host pays for each launch (one program 27-55 us a call, the pieces 88-253 here), so one
    launch stays the choice where it fits (E=64's +0.7 us on the GPU included), where the
    alternative is the torch sort's dozen (more than `_PIECES_MAX_BUCKETS` buckets), and in the
    interpreter, where it is also the faster one."""
    if device.type != "cuda" or buckets > _PIECES_MAX_BUCKETS:
        return max(16, min(1024, 8192 // buckets)) if TK * buckets <= _SMALL_ROUTE_WORK else None
    block = max(16, min(_SMALL_ROUTE_MAX_BLOCK, 8192 // buckets))
    return block if TK <= block else None


# Up to this many buckets (E <= 512, or E < 512 with padding), larger batches route in three launches
# over pieces of the slots (`_route_pieces`); beyond, the [BLOCK, buckets] tiles grow too wide and the
# torch sort runs.
_PIECES_MAX_BUCKETS = 512
# The placement ranks a piece's slots by `tl.sort` on the GPU; the interpreter's sort is too slow for
# the tests' sizes (seconds a piece), so it ranks them as the one-program kernel does.
ROUTE_BY_SORT = not INTERPRETED


def _route_pieces(flat: Tensor, E: int, padded: bool, buckets: int) -> tuple[Tensor, Tensor]:
    """`route` by the three piece kernels of `kernels.routing`: bucket counts per piece of the
    slots, their prefix over the pieces, each slot's row."""
    TK = flat.numel()
    chunk = _route_chunk(TK, buckets)
    pieces = cdiv(TK, chunk)
    counts = torch.empty(2, buckets, pieces, dtype=torch.int32, device=flat.device)  # counts, starts
    sorted_rows = torch.empty(TK, dtype=torch.int32, device=flat.device)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=flat.device)
    meta = dict(PADDED=padded, B_POW2=buckets, CHUNK=chunk, num_warps=4 if chunk <= 1024 else 8)
    _route_count_kernel[(pieces,)](flat, counts[0], counts[1], TK, E, pieces, **meta)
    _route_prefix_kernel[(buckets,)](counts[0], counts[1], offsets, pieces, E, BLOCK_P=1024, num_warps=4)
    _route_place_kernel[(pieces,)](flat, counts[1], offsets, sorted_rows, TK, E, pieces, SORT=ROUTE_BY_SORT,
                                   BLOCK=max(16, min(1024, 8192 // buckets)), **meta)
    return sorted_rows, offsets


def _route_chunk(TK: int, buckets: int) -> int:
    """CHUNK, the slots of a piece (a power of two: one sorted tile per program): about TK x buckets
    / 65536 slots, 256 to 512. Past 512, sorting the longer tiles costs more than the fewer pieces
    save, now that the prefix kernel's work no longer grows with the pieces (H100, `bench_route.py
    --chunks 128,256,512,1024,2048 --cases paper`, GPU us a call from CUDA graphs, by chunk:
    E=128 TK=196608: 13.6, 13.3, 20.3, 26.4 for 256-2048; E=128 TK=327680: 18.4, 17.4, 26.4, 42.9;
    E=256 TK=524288: 35.9, 29.3, 36.4, 45.6; E=64 TK=163840: 10.5, 11.5, 19.1, 25.6; E=32 TK=81920:
    8.1, 9.6, 14.5, 25.6; 128-slot pieces lost everywhere)."""
    return min(512, max(256, pow2(cdiv(TK * buckets, 65536))))


def route_buckets(E: int, padded: bool = False) -> int:
    """The routing kernels' bucket count: the experts, and the padding slots' bucket E in the slot
    form, rounded up to a power of two (>= 2). 128 experts take 128 buckets, not 256: the piece
    kernels' work grows with slots x buckets."""
    return max(2, pow2(E + padded))


def _check_ids_on_cpu(topk_ids: Tensor, E: int, padded: bool = False) -> None:
    """The interpreter runs the kernels on CPU tensors and skips their device asserts: there an id
    outside [0, E) (-1 allowed when `padded`) raises IndexError up front (a CPU check costs no sync)."""
    if topk_ids.device.type != "cpu" or not topk_ids.numel():
        return
    valid = (topk_ids >= 0) & (topk_ids < E) | ((topk_ids == -1) if padded else False)
    if not bool(valid.all()):
        raise IndexError(f"expert id out of range [0, {E}) in topk_ids")


def route(topk_ids: Tensor, E: int, padded: bool = False) -> tuple[Tensor, Tensor]:
    """(sorted_rows int32 [TK], expert_offsets int32 [E+1]) on the device, with no host sync.

    Same contract as `codegen.reference.torch_route`. `padded` (the slot form): id -1 is a padding
    slot, sorted after every expert and not counted. Any other id outside [0, E) fails a device-side
    assert (an IndexError-like RuntimeError on the CPU): never a silent wrong expert.
    """
    flat = topk_ids.reshape(-1).contiguous()  # the kernels index it densely
    TK = flat.numel()
    buckets = route_buckets(E, padded)
    small = _small_route_block(TK, buckets, flat.device)
    if small or buckets <= _PIECES_MAX_BUCKETS:
        _check_ids_on_cpu(flat, E, padded)
    if small:
        sorted_rows = torch.empty(TK, dtype=torch.int32, device=flat.device)
        offsets = torch.empty(E + 1, dtype=torch.int32, device=flat.device)
        _route_small_kernel[(1,)](flat, sorted_rows, offsets, TK, E, PADDED=padded, B_POW2=buckets,
                                  BLOCK=small, num_warps=4)
        return sorted_rows, offsets
    if buckets <= _PIECES_MAX_BUCKETS:
        return _route_pieces(flat, E, padded, buckets)
    if padded:
        flat = torch.where(flat == -1, E, flat)
    # 16-bit keys: the radix sort makes 2 passes instead of 8 (59 -> ~15 us at TK = 196608 on the H100)
    keys = flat.to(torch.int16) if E < 2**15 else flat
    sorted_rows = torch.sort(keys, stable=True).indices.to(torch.int32)
    counts = torch.zeros(E + padded, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones(flat.shape, dtype=torch.int32, device=flat.device))
    offsets = torch.zeros(E + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(counts[:E], 0)
    return sorted_rows, offsets


def token_offsets(slot_token: Tensor, T: int) -> Tensor:
    """int32 [T+1]: the first slot of each token (slot_token is nondecreasing), on the device."""
    wanted = torch.arange(T + 1, dtype=slot_token.dtype, device=slot_token.device)
    return torch.searchsorted(slot_token, wanted, out_int32=True)


# ----------------------------------------------------------------------------------------- launchers


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


def triton_moe_up(x, w1: Bank, b1, sorted_rows, offsets, *, n, top_k, activation, interleaved, alpha, limit,
                  store_h=True, store_a=True, row_token=None, **_):
    """H [TK, w1_out] (or [0, w1_out]) and A [TK, n] (or [0, n]) in expert order."""
    T, d = x.shape
    E = offsets.numel() - 1
    TK = sorted_rows.numel()
    gated = GATED[activation]
    w1_out = 2 * n if gated else n
    h = x.new_empty(TK if store_h else 0, w1_out)
    a = x.new_empty(TK if store_a else 0, n)
    if TK == 0 or not (store_h or store_a):
        return h, a
    b1c = b1.contiguous() if b1 is not None else x
    w_ptr, w_table, has_table, align = w1.kernel_args()
    desc, w_desc = _up_weight_desc(w1, E, n, d, gated, interleaved)
    flags = dict(ACTIVATION=_ACT_CODE[activation], GATED=gated, INTERLEAVED=bool(interleaved and gated),
                 HAS_B1=b1 is not None, STORE_H=store_h, STORE_A=store_a, E_POW2=e_pow2(E),
                 TOKEN_MAP=row_token is not None)
    if _persistent_up(desc, w_desc, gated, interleaved):
        _launch(
            _up_persistent, _persistent_grid(TK, E, n, x.device),
            x, desc, b1c, sorted_rows, _or(row_token, sorted_rows), offsets, h, a,
            TK, d, n, E, top_k,
            x.stride(0), x.stride(1),
            w1_out if b1 is not None else 0, 1,
            float(alpha), float(limit),
            W_DESC=w_desc, **flags,
        )
        return h, a
    kernel = _up_tma if desc is not None else _up
    _launch(
        kernel, _tile_grid(TK, E, n),
        x, _or(desc, w_ptr), b1c, sorted_rows, _or(row_token, sorted_rows), offsets, h, a, w_table,
        TK, d, n, E, top_k,
        x.stride(0), x.stride(1),
        *w1.strides,
        w1_out if b1 is not None else 0, 1,
        float(alpha), float(limit),
        DOT_PRECISION=_dot_precision(x.dtype), W_TABLE=has_table, W_ALIGN=align, W_DESC=w_desc, **flags,
    )
    return h, a


def _gluon_scatter(gluon, tile, out_tiles: bool, inp, w_view, w_desc, bias, sorted_rows, offsets, *, n_dim,
                   num_programs) -> tuple[Tensor, Tensor | None]:
    """(out, row_map) of the Gluon scatter GEMM: TILE order and the map from slots to its rows
    (written by the same launch), or slot order and None."""
    row_map = torch.empty_like(sorted_rows) if out_tiles else None
    out = gluon.gluon_scatter_gemm(inp, w_view, w_desc, bias, sorted_rows, offsets, n_dim=n_dim,
                                   num_programs=num_programs, out_tiles=out_tiles, row_map=row_map, **tile.kwargs())
    return out, row_map


def triton_moe_scatter_gemm(inp, w: Bank, w_strides, bias, sorted_rows, offsets, *, n_dim, split=0, row_map=False):
    """out [TK, n_dim] in SLOT order: out[sorted_rows[r]] = inp[r] @ B[e] (+ bias[e]).

    w_strides = (e, k, n) strides reading the expert weight as B[e] [k_dim, n_dim]; `split` > 0:
    rows k >= split of B[e] come from the bank's up table (W1 as separate gate/up tensors).
    `row_map`: returns (out, row_map) instead, where the Gluon kernel, if chosen, stores out in
    TILE order (with `SCATTER_TILES`), slot s's product at row row_map[s] (the kernel writes the map); a
    row_map of None: slot order.
    """
    TK, k_dim = inp.shape
    E = offsets.numel() - 1
    tiles = row_map and SCATTER_TILES
    if TK == 0:
        out = inp.new_empty(TK, n_dim)
        return (out, None) if row_map else out
    biasc = bias.contiguous() if bias is not None else inp
    if split == 0:
        w_d, w_desc = _weight_desc(w, E, n_dim, k_dim, w_strides[2], w_strides[1])
        in_d = _tma_operand(inp, tuple(inp.shape), tuple(inp.stride())) if w_d is not None else None
        if in_d is not None:
            def triton_kernel():
                out = inp.new_empty(TK, n_dim)
                _launch(
                    _scatter_tma, _persistent_grid(TK, E, n_dim, inp.device),
                    in_d, w_d, biasc, sorted_rows, offsets, out,
                    TK, k_dim, n_dim, E, n_dim,
                    HAS_BIAS=bias is not None, E_POW2=e_pow2(E), W_DESC=w_desc,
                )
                return out, None

            candidates = {"triton": triton_kernel}
            gluon = _gluon_module("gluon_scatter", inp)
            if gluon is not None:
                # the stacked weight as the Gluon kernel's descriptor reads it (`_weight_desc`'s dims)
                dims = (E, n_dim, k_dim) if w_desc == 1 else (E, k_dim, n_dim)
                strides = (w.strides[0], w_strides[2] if w_desc == 1 else w_strides[1], 1)
                w_view = w.ptr.as_strided(dims, strides)
                b = biasc if bias is not None else None
                if gluon.supports(inp, w_view, w_desc, b, n_dim=n_dim) is None:
                    for name, tile in gluon.candidate_tiles(w_desc, k_dim, out_tiles=tiles).items():
                        out_tiles = tiles and tile.shared_bytes(True) <= gluon.SHARED_LIMIT
                        candidates[name] = functools.partial(
                            _gluon_scatter, gluon, tile, out_tiles, inp, w_view, w_desc, b, sorted_rows, offsets,
                            n_dim=n_dim, num_programs=_programs(inp.device))
            key = ("scatter", k_dim, n_dim, E, w_desc, bias is not None, inp.dtype, tiles)
            out, rows = wgrad_choice.choose(key, candidates, cuda=True, pinned=wgrad_choice.SCATTER_PINNED)()
            return (out, rows) if row_map else out
    out = inp.new_empty(TK, n_dim)
    w_ptr, w_table, has_table, align = w.kernel_args()
    _launch(
        _scatter, _tile_grid(TK, E, n_dim),
        inp, w_ptr, biasc, sorted_rows, offsets, out, w_table,
        TK, k_dim, n_dim, E, split,
        *w_strides, n_dim,
        HAS_BIAS=bias is not None, E_POW2=e_pow2(E), DOT_PRECISION=_dot_precision(inp.dtype),
        W_TABLE=has_table, SPLIT_K=split > 0, W_ALIGN=align,
    )
    return (out, None) if row_map else out


def gather_sum_blocks(d: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_D) of the gather-sum over rows of width d."""
    if INTERPRETED:
        return 2, min(16, pow2(d))
    lowbit = d & -d  # widest power-of-two block that tiles d exactly (no half-empty last block)
    return 4, min(1024, lowbit if lowbit >= 128 else pow2(d))


def act_grad_blocks(n: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of the activation-gradient pass over rows of n columns: 1024-element tiles
    (4 rows at n >= 256), 213 against 226 us for 2048 at the 7b-256 shape, H100
    (`scripts/probe_memory_passes.py`); 2.85 TB/s, as the gather-sums move theirs."""
    block_c = min(256, pow2(n))
    if INTERPRETED:
        return 4, min(block_c, 16)
    return max(1, 1024 // block_c), block_c


class ProductLaunch(NamedTuple):
    """How `_gather_sum_product_kernel` is launched (`scripts/probe_memory_passes.py` measures them)."""

    block_t: int
    block_d: int
    block_j: int  # the dot's inner chunk; R stays resident when J fits in one
    warps: int
    waves: int  # token-block programs per column: enough for `waves` per SM, each walking several blocks; 0: one block each
    product_first: bool  # the dot before the row loads

    def grid(self, T: int, d: int, sms: int) -> tuple[int, int]:
        blocks, cols = cdiv(T, self.block_t), cdiv(d, self.block_d)
        return (blocks if self.waves == 0 else max(1, min(blocks, cdiv(self.waves * sms, cols))), cols)


def gather_sum_product_launch(d: int, J: int, K: int) -> ProductLaunch:
    """The product gather-sum's launch at row width d, inner size J and K rows a token (8 warps, R
    resident up to J = 128, the rows loaded before the dot). A token block's K rows arrive in one
    [K * BLOCK_T, BLOCK_D] load, so the block's shape follows K. Measured on the H100 through a
    TILE-order row map (docs/BENCHMARKS.md, thirty-second session; `scripts/probe_memory_passes.py
    --passes "dx + router" --row-map` sweeps the same launches), the best of 12 launches at each
    shape but OLMoE (J = 64: 211.8 us at BLOCK_D 128, 217.5 at 256) (us, against the gather-sum alone):
    K = 2, 7b-1024: (32, 128, 4 waves) 86.8 / 84.2;  K = 4, 7b-512: (16, 128, 4 waves) 136.9 / 135.8;
    K = 8, 7b-256 / 1.4b-256 / Qwen3 / 30b-512: (16, 256, 4 waves) 250.6 / 214.5 / 223.7 / 838.1
    against 239.0 / 202.9 / 212.0 / 812.9;  K = 16, 30b-256: (32, 128, one block a program) 1797.5
    / 1549.8."""
    block_j = max(16, min(128, pow2(J)))
    if INTERPRETED:
        return ProductLaunch(16, min(16, pow2(d)), min(block_j, 16), 4, 0, True)
    k_pow2 = max(2, pow2(K))
    # past K = 16 (not measured), the block keeps K = 16's 64 Ki elements of rows
    block_t, block_d, waves = {2: (32, 128, 4), 4: (16, 128, 4), 8: (16, 256, 4), 16: (32, 128, 0)}.get(
        k_pow2, (16, max(16, 4096 // k_pow2), 0))
    return ProductLaunch(block_t, max(16, min(block_d, pow2(d))), block_j, 8, waves, False)  # tl.dot: N >= 16


def triton_moe_gather_sum(y: Tensor, s: Tensor | None, T: int, top_k: int, out_dtype: torch.dtype,
                          slots: tuple[Tensor, Tensor] | None = None,
                          product: tuple[Tensor, Tensor] | None = None, launch: ProductLaunch | None = None,
                          row_map: Tensor | None = None) -> Tensor:
    """out [T, d] = sum_k (s[t, k]) y[t*K + k] (+ L[t] @ R), float32 accumulation; y [T*K, d] in slot order,
    or, given row_map [TK] (`triton_moe_scatter_gemm(row_map=True)`), slot j's row at y[row_map[j]].

    slots = (ids [TK], token_offsets [T+1]) for the slot form: token t sums its real slots in
    [token_offsets[t], token_offsets[t+1]). product = (L [T, J], R [J, d]), both of one float dtype,
    any strides, and no weights: a dense term added in float32 before the result is rounded (x's
    gradient through the router, folded in by `moe_compiler.grad_fold`); `launch` overrides how.
    """
    d = y.shape[1]
    out = torch.empty(T, d, dtype=out_dtype, device=y.device)
    if T == 0 or d == 0:
        return out
    ids, offs = slots if slots is not None else (y, y)
    K = top_k if slots is None else 1
    if product is None:
        block_t, block_d = gather_sum_blocks(d)
        grid = (cdiv(T, block_t), cdiv(d, block_d))
        _gather_sum_kernel[grid](y, _or(s, y), ids, offs, _or(row_map, ids), out, T, d, TOP_K=K,
                                 HAS_WEIGHTS=s is not None, SLOTS=slots is not None, ROW_MAP=row_map is not None,
                                 BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
        return out
    lhs, rhs = product
    J = lhs.shape[1]
    if s is not None or lhs.shape != (T, J) or rhs.shape != (J, d) or lhs.dtype != rhs.dtype:
        raise ValueError(f"gather-sum product: L {tuple(lhs.shape)} {lhs.dtype} and R {tuple(rhs.shape)} {rhs.dtype} "
                         f"do not make a [{T}, {d}] term (or weights were given)")
    lp = launch or gather_sum_product_launch(d, J, K)
    _gather_sum_product_kernel[lp.grid(T, d, _programs(y.device))](
        y, ids, offs, _or(row_map, ids), lhs, rhs, out, T, d, J, lhs.stride(0), lhs.stride(1), rhs.stride(0),
        rhs.stride(1), TOP_K=K, SLOTS=slots is not None, ROW_MAP=row_map is not None, BLOCK_T=lp.block_t,
        BLOCK_D=lp.block_d, BLOCK_J=lp.block_j,
        R_RESIDENT=J <= lp.block_j, PRODUCT_FIRST=lp.product_first, DOT_PRECISION=_dot_precision(lhs.dtype),
        K_POW2=max(2, pow2(K)), PREFETCH=MAP_PREFETCH and row_map is not None and slots is None,
        num_warps=lp.warps,
    )
    return out


def triton_moe_dact(grad_out, w2: Bank, h, s_flat, sorted_rows, offsets, *, n, top_k, activation, interleaved,
                    alpha, limit, row_token=None, ds_dtype=torch.float32, **_):
    """(dH [TK, w1_out], A' = s A [TK, n], dS [TK] in slot order) from dA' = gather(dO) W2.

    dS is summed in float32 and stored in `ds_dtype`, rounded once: the router weights' own dtype
    where nothing is added to it, which spares the backward a cast of [TK] (and its launch)."""
    T, d = grad_out.shape
    E = offsets.numel() - 1
    TK = sorted_rows.numel()
    # every slot of [T, K] routing is some expert's row; the slot form's padding slots are not, and stay 0
    ds = (torch.zeros if row_token is not None else torch.empty)(TK, dtype=ds_dtype, device=h.device)
    if TK == 0:
        return torch.empty_like(h), h.new_empty(TK, n), ds
    # dA' [TK, n] = gather(dO) @ W2[e]: the up-projection kernel with W2 read as (e, out=n, in=d)
    da = h.new_empty(TK, n)
    sw = w2.strides  # (e, d, n)
    w_ptr, w_table, has_table, align = w2.kernel_args()
    desc, w_desc = _weight_desc(w2, E, n, d, sw[2], sw[1])
    flags = dict(ACTIVATION=_IDENTITY, GATED=False, INTERLEAVED=False, HAS_B1=False, STORE_H=False, STORE_A=True,
                 E_POW2=e_pow2(E), TOKEN_MAP=row_token is not None, W_DESC=w_desc)
    if _persistent_up(desc, w_desc, False, False):
        _launch(
            _dact_persistent, _persistent_grid(TK, E, n, h.device),
            grad_out, desc, grad_out, sorted_rows, _or(row_token, sorted_rows), offsets, da, da,
            TK, d, n, E, top_k,
            grad_out.stride(0), grad_out.stride(1),
            0, 0,
            0.0, 0.0,
            **flags,
        )
    else:
        _launch(
            _dact_tma if desc is not None else _dact, _tile_grid(TK, E, n),
            grad_out, _or(desc, w_ptr), grad_out, sorted_rows, _or(row_token, sorted_rows), offsets, da, da, w_table,
            TK, d, n, E, top_k,
            grad_out.stride(0), grad_out.stride(1),
            sw[0], sw[2], sw[1],
            0, 0,
            0.0, 0.0,
            DOT_PRECISION=_dot_precision(h.dtype), W_TABLE=has_table, W_ALIGN=align, **flags,
        )
    gated = GATED[activation]
    block_r, block_c = act_grad_blocks(n)
    dh = torch.empty_like(h)
    # A' overwrites dA' in place (the kernel's barrier orders each tile's loads before its stores),
    # and dA' is not needed afterwards: one [TK, n] buffer less while dH and A' are live
    a_scaled = da
    _act_grad_kernel[(cdiv(TK, block_r),)](
        da, h, s_flat, sorted_rows, offsets, dh, a_scaled, ds,
        TK, n, E, float(alpha), float(limit),
        ACTIVATION=_ACT_CODE[activation], GATED=gated, INTERLEAVED=bool(interleaved and gated),
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
    )
    return dh, a_scaled, ds


def triton_moe_wgrad(lhs, rhs, *, gather_lhs, gather_rhs, sorted_rows, offsets, top_k, dw, dw_strides,
                     db=None, s_flat=None, row_token=None):
    """dW[e] [P, Q] = sum over expert e's rows of Lhs[r]^T Rhs[r], written into `dw` via (e, p, q) strides.

    A gathered operand is [T, .] read at each row's token; the other is [TK, .] in expert order.
    db [E, P] (optional) gets the column sums of Lhs, weighted by s_flat when given.
    """
    P, Q = lhs.shape[1], rhs.shape[1]
    E = offsets.numel() - 1
    TK = sorted_rows.numel()
    grid = lambda META: (E * cdiv(P, META["BLOCK_P"]) * cdiv(Q, META["BLOCK_Q"]),)
    # the expert-ordered operand (never the gathered one) through TMA when it can be
    lhs_d = None if gather_lhs else _tma_operand(lhs, tuple(lhs.shape), tuple(lhs.stride()))
    rhs_d = None if gather_rhs else _tma_operand(rhs, tuple(rhs.shape), tuple(rhs.stride()))
    kernel = _wgrad_tma if lhs_d is not None or rhs_d is not None else _wgrad
    _launch(
        kernel, grid,
        _or(lhs_d, lhs), _or(rhs_d, rhs), _or(s_flat, lhs), sorted_rows, _or(row_token, sorted_rows), offsets, dw,
        db if db is not None else dw,
        TK, P, Q, E, top_k,
        lhs.stride(0), lhs.stride(1), rhs.stride(0), rhs.stride(1),
        *dw_strides,
        GATHER_LHS=gather_lhs, GATHER_RHS=gather_rhs, BIAS_GRAD=db is not None,
        BIAS_SCALED=s_flat is not None, DOT_PRECISION=_dot_precision(lhs.dtype),
        TOKEN_MAP=row_token is not None, LHS_DESC=lhs_d is not None, RHS_DESC=rhs_d is not None,
    )
    return dw


class GradBuffer(NamedTuple):
    """Where a weight gradient goes: a tensor like `like` (shape, dtype, strides of `empty_like`; a
    meta tensor stands for one with no storage yet), read by the kernels as [E, P, Q] through its
    (e, out, in) strides: its own, or its last two swapped for a transposed weight ([E, in, out])."""

    like: Tensor
    transposed: bool

    def empty(self, device: torch.device) -> tuple[Tensor, tuple[int, int, int]]:
        """(a fresh gradient tensor, its (e, p, q) strides)."""
        dw = torch.empty_like(self.like, device=device)
        s = dw.stride()
        return dw, ((s[0], s[2], s[1]) if self.transposed else s)


def _weight_grad(lhs, rhs, out: GradBuffer, *, gather_lhs, gather_rhs, sorted_rows, offsets, top_k, row_token=None,
                 db=None, s_flat=None) -> Tensor:
    """dW[e] = sum over expert e's rows of Lhs[r]^T Rhs[r], laid out as `out` says, by our kernel
    (`triton_moe_wgrad`) or torch's grouped GEMM, whichever `wgrad_choice` measured faster here."""

    def triton_kernel():
        dw, strides = out.empty(lhs.device)
        return triton_moe_wgrad(lhs, rhs, gather_lhs=gather_lhs, gather_rhs=gather_rhs, sorted_rows=sorted_rows,
                                offsets=offsets, top_k=top_k, dw=dw, dw_strides=strides, db=db, s_flat=s_flat,
                                row_token=row_token)

    candidates = {"triton": triton_kernel}
    gluon = _gluon_wgrad(lhs, rhs, out, gather_lhs=gather_lhs, db=db)
    if gluon is not None:
        def gluon_kernel():
            dw, strides = out.empty(lhs.device)
            return gluon.gluon_wgrad(lhs, rhs, gather_lhs=gather_lhs, sorted_rows=sorted_rows, offsets=offsets,
                                     top_k=top_k, dw=dw, dw_strides=strides, row_token=row_token,
                                     num_programs=_programs(lhs.device))

        candidates["gluon"] = gluon_kernel
    if _grouped_mm_usable(lhs, rhs, out, db=db, s_flat=s_flat):
        candidates["grouped_mm"] = lambda: wgrad_choice.grouped_mm_wgrad(
            lhs, rhs, gather_lhs=gather_lhs, gather_rhs=gather_rhs, sorted_rows=sorted_rows, offsets=offsets,
            top_k=top_k, transposed=out.transposed, row_token=row_token, db=db, bias_scale=s_flat)
    key = _wgrad_key(lhs, rhs, out, gather_lhs=gather_lhs, offsets=offsets, top_k=top_k, row_token=row_token, db=db)
    return wgrad_choice.choose(key, candidates, cuda=lhs.is_cuda)()


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


def _gluon_wgrad(lhs, rhs, out: GradBuffer, *, gather_lhs, db):
    """`kernels.gluon_wgrad` where it can compute this weight gradient (Hopper, a checked Triton,
    16-bit contiguous operands, no bias gradient), else None."""
    module = None if db is not None else _gluon_module("gluon_wgrad", lhs)
    if module is None or module.supports(lhs, rhs, gather_lhs=gather_lhs, dw=out.like) is not None:
        return None
    return module


def _grouped_mm_usable(lhs, rhs, out: GradBuffer, *, db, s_flat) -> bool:
    return wgrad_choice.usable(lhs, rhs, out.like, bias_scale=s_flat, bias_grad=db is not None,
                               interpreted=INTERPRETED, major=_major(lhs.device) if lhs.is_cuda else 0)


def _wgrad_key(lhs, rhs, out: GradBuffer, *, gather_lhs, offsets, top_k, row_token, db) -> tuple:
    """`wgrad_choice`'s key: the problem's dims and layout, never the row count."""
    return (lhs.shape[1], rhs.shape[1], offsets.numel() - 1, top_k, row_token is not None, gather_lhs, out.transposed,
            db is not None, lhs.dtype, lhs.device.type)


def _wgrad_copy_bytes(lhs, rhs, out: GradBuffer, *, gather_lhs, offsets, top_k, row_token, db, s_flat, **_) -> int:
    """Bytes of the gathered operand's expert-order copy the weight gradient will make: torch's
    grouped GEMM needs one ([TK, Q or P]); our kernel reads it in place."""
    if not _grouped_mm_usable(lhs, rhs, out, db=db, s_flat=s_flat):
        return 0
    key = _wgrad_key(lhs, rhs, out, gather_lhs=gather_lhs, offsets=offsets, top_k=top_k, row_token=row_token, db=db)
    if wgrad_choice.expected(key, ("triton", "grouped_mm")) != "grouped_mm":
        return 0
    gathered = lhs if gather_lhs else rhs
    return (rhs if gather_lhs else lhs).shape[0] * gathered.shape[1] * gathered.element_size()


BACKWARD_STEPS = ("dw2", "dw1", "dx")


def _dh_last(order: tuple[str, ...]) -> int:
    """The step of `order` after which dH is dead: the later of its readers, dW1 and dX~."""
    return max(order.index("dw1"), order.index("dx"))


def backward_peak(order: tuple[str, ...], *, a_scaled: int, dh: int, dw1: int, dw2: int, dx_rows: int, dx: int,
                  dw1_copy: int = 0, dw2_copy: int = 0) -> int:
    """The most bytes the backward's three products hold at once when run in `order` (a permutation
    of BACKWARD_STEPS), counted from the activation gradient's outputs A' and dH:

        "dw2": dW2 from gather(dO) and A' (A' dies after it); holds dw2_copy while it runs
        "dw1": dW1 from dH and gather(x); holds dw1_copy while it runs
        "dx":  dX~ rows [TK, d] from dH, then their gather-sum into dx [T, d] (the rows die)

    dH dies after the later of "dw1" and "dx". Buffers held throughout (x, dO, H) are the same in
    every order and left out."""
    live, peak = a_scaled + dh, 0
    dh_last = _dh_last(order)
    for i, step in enumerate(order):
        if step == "dw2":
            peak = max(peak, live + dw2 + dw2_copy)
            live += dw2 - a_scaled
        elif step == "dw1":
            peak = max(peak, live + dw1 + dw1_copy)
            live += dw1
        else:
            peak = max(peak, live + dx_rows + dx)
            live += dx
        if i == dh_last:
            live -= dh
    return peak


def backward_order(**sizes: int) -> tuple[tuple[str, ...], int]:
    """(order, peak): the order of the backward's three products with the lowest `backward_peak`
    at these sizes (ties keep BACKWARD_STEPS' order). It depends on the shape: at (T, d, n, E, K) =
    (24576, 1536, 256, 128, 8), "dx" before "dw1" keeps dW1 out of the dX~ stage (0.98 against
    1.18 GB); at Qwen3-30B-A3B's sizes, dW1 and dX~ before dW2 free dH before dW2 is allocated."""
    orders = sorted(permutations(BACKWARD_STEPS), key=lambda order: order != BACKWARD_STEPS)
    return min(((order, backward_peak(order, **sizes)) for order in orders), key=lambda item: item[1])


# -------------------------------------------------------------------------------------- entry points


def _or(t: Tensor | None, other: Tensor) -> Tensor:
    """A pointer argument for an optional tensor (the kernel does not read it when absent)."""
    return other if t is None else t


def _slot_routing(topk_ids, slot_token, T, check=True):
    """(K or 1, gather-sum slots argument or None) for [T, K] routing or the slot form. `check`
    (the forward; the backward gets the same tensors back): a device-side assert, no host sync, so
    unsorted or out-of-range tokens fail loudly, never silently."""
    if slot_token is None:
        return topk_ids.shape[1], None
    if check and slot_token.numel():
        ok = torch.ones(1, dtype=torch.int32, device=slot_token.device)
        S = slot_token.numel()
        _slot_check_kernel[(cdiv(S, 1024),)](topk_ids.reshape(-1), slot_token.reshape(-1), ok, S, T, PAD=PAD,
                                             BLOCK=1024, num_warps=4)
        torch._assert_async(ok, "sonic.moe_experts: slot_token must be nondecreasing with real slots' tokens in "
                            "[0, T)")
    return 1, (topk_ids, token_offsets(slot_token, T))


def _row_token(slot_token, sorted_rows):
    """int32 [TK]: the token of each expert-ordered row (slot form), or None for [T, K] routing."""
    return None if slot_token is None else slot_token.reshape(-1)[sorted_rows.long()].to(torch.int32)


def triton_moe_experts_fwd(x, topk_ids, topk_weights, w1, w2, b1, b2, *, activation, interleaved, transposed,
                           alpha, limit, save_h, slot_token=None):
    W1, W2 = _stacked_banks(w1, w2, transposed)
    n = w2.shape[1] if transposed else w2.shape[2]
    return _forward(x, topk_ids, topk_weights, W1, W2, b1, b2, n=n, activation=activation, interleaved=interleaved,
                    alpha=alpha, limit=limit, save_h=save_h, slot_token=slot_token)


def triton_moe_experts_bwd(grad_out, x, topk_ids, topk_weights, w1, w2, b1, b2, h, sorted_rows, expert_offsets, *,
                           activation, interleaved, transposed, alpha, limit, slot_token=None):
    W1, W2 = _stacked_banks(w1, w2, transposed)
    n = w2.shape[1] if transposed else w2.shape[2]
    # dW in the weights' own layout (the kernels write it through (e, out, in) strides)
    return _backward(grad_out, x, topk_ids, topk_weights, W1, W2, b1, b2, h, sorted_rows, expert_offsets,
                     dw1=GradBuffer(w1, transposed), dw2=GradBuffer(w2, transposed), n=n, activation=activation,
                     interleaved=interleaved, alpha=alpha, limit=limit, slot_token=slot_token)


def triton_moe_experts_list_fwd(x, topk_ids, topk_weights, w_gate, w_up, w_down, b1=None, b2=None, *, banks,
                                activation, interleaved, alpha, limit, save_h, slot_token=None):
    """`sonic::moe_experts_list` on CUDA: the same kernels, reading each expert's tensors in place
    (`banks` from `list_banks`); b1, b2 stacked, as the stacked form takes them."""
    W1, W2 = banks
    return _forward(x, topk_ids, topk_weights, W1, W2, b1, b2, n=w_down[0].shape[1], activation=activation,
                    interleaved=interleaved, alpha=alpha, limit=limit, save_h=save_h, slot_token=slot_token)


def triton_moe_experts_list_bwd(grad_out, x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, h, sorted_rows,
                                expert_offsets, *, banks, activation, interleaved, alpha, limit, slot_token=None):
    """-> (dx, d_topk_weights, dW1 [E, w1_out, d], dW2 [E, d, n], db1 | None, db2 | None): weight
    gradients stacked (fresh tensors; `codegen.ops` hands each expert a view of its slice)."""
    gated = GATED[activation]
    W1, W2 = banks
    E, n, d = len(w_gate), w_down[0].shape[1], x.shape[1]
    shape = lambda *size: torch.empty(size, dtype=x.dtype, device="meta")  # noqa: E731
    return _backward(grad_out, x, topk_ids, topk_weights, W1, W2, b1, b2, h, sorted_rows, expert_offsets,
                     dw1=GradBuffer(shape(E, 2 * n if gated else n, d), False), dw2=GradBuffer(shape(E, d, n), False),
                     n=n, activation=activation, interleaved=interleaved, alpha=alpha, limit=limit,
                     slot_token=slot_token)


def _dense_routing(topk_ids, topk_weights, slot_token):
    """The routing tensors with contiguous storage: the kernels read them through flat views, and
    a column sliced from a wider tensor (K = 1) has a strided one."""
    return topk_ids.contiguous(), topk_weights.contiguous(), None if slot_token is None else slot_token.contiguous()


def _forward(x, topk_ids, topk_weights, W1: Bank, W2: Bank, b1, b2, *, n, activation, interleaved, alpha, limit,
             save_h, slot_token):
    topk_ids, topk_weights, slot_token = _dense_routing(topk_ids, topk_weights, slot_token)
    T, d = x.shape
    E = W1.table.numel() // 2 if W1.table is not None else W1.ptr.shape[0]
    K, slots = _slot_routing(topk_ids, slot_token, T)
    flags = dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    if decode_path(topk_ids.numel(), E, save_h, slot_token):
        out, sorted_rows, offsets = triton_moe_decode(x, topk_ids, topk_weights, W1, W2, b1, b2, n=n, E=E, **flags)
        return out, x.new_empty(0, _w1_out(n, activation)), sorted_rows, offsets
    sorted_rows, offsets = route(topk_ids, E, padded=slot_token is not None)
    h, a = triton_moe_up(x, W1, b1, sorted_rows, offsets, n=n, top_k=K, store_h=save_h,
                         row_token=_row_token(slot_token, sorted_rows), **flags)
    sw = W2.strides  # (e, d, n); the down-projection reads B[e] = W2[e]^T [n, d]
    y, y_rows = triton_moe_scatter_gemm(a, W2, (sw[0], sw[2], sw[1]), b2, sorted_rows, offsets, n_dim=d,
                                        row_map=True)
    del a
    out = triton_moe_gather_sum(y, topk_weights.reshape(-1), T, K, x.dtype, slots, row_map=y_rows)
    return out, h, sorted_rows, offsets


# The decode path (`kernels.decode`): a forward that keeps no H, with at most DECODE_MAX_SLOTS slots
# and at most DECODE_SLOTS_PER_EXPERT slots per expert (two slots on one expert read its weights
# twice), runs in two launches: no TMA descriptors, no expert-ordered rows, no padded tiles. The
# routing is still computed (the first launch ranks the slots): the op returns it, and a backward
# that recomputes H (save_h False) reads it. SONIC_MOE_DECODE_MAX_SLOTS=0 turns the path off.
DECODE_MAX_SLOTS = int(os.environ.get("SONIC_MOE_DECODE_MAX_SLOTS", "64"))
DECODE_SLOTS_PER_EXPERT = 0.5
_DECODE_RANK_SLOTS = 128  # the first launch ranks all pairs of slots in one [TK, TK] tile: at most this
# The reduction chunk of each decode kernel (d for the up-projection, n for the down-projection) and
# their warps.
DECODE_CHUNK_UP, DECODE_CHUNK_DOWN, DECODE_WARPS = 256, 256, 8


def decode_path(TK: int, E: int, save_h: bool, slot_token: Tensor | None) -> bool:
    """Whether a forward of TK slots over E experts runs `triton_moe_decode`."""
    return (not save_h and slot_token is None and 0 < TK <= min(DECODE_MAX_SLOTS, _DECODE_RANK_SLOTS)
            and TK <= DECODE_SLOTS_PER_EXPERT * E)


def _w1_out(n: int, activation: str) -> int:
    return 2 * n if GATED[activation] else n


def _decode_blocks(parallel: int, width: int) -> int:
    """The widest block of `width` columns (16..64) that still gives ~2 programs per SM."""
    block = 64
    while block > 16 and parallel * cdiv(width, block) < 264:
        block //= 2
    return block


def triton_moe_decode(x, topk_ids, topk_weights, W1: Bank, W2: Bank, b1, b2, *, n, E, activation, interleaved,
                      alpha, limit) -> tuple[Tensor, Tensor, Tensor]:
    """(out [T, d], sorted_rows, offsets) of [T, K] routing through `kernels.decode`: A [TK, n] per
    slot, then each token's weighted sum of its K down-projections (see the kernels' docstring for
    the numerics); the routing as `route` gives it, ranked by the first launch."""
    T, d = x.shape
    K = topk_ids.shape[1]
    TK = T * K
    gated = GATED[activation]
    _check_ids_on_cpu(topk_ids, E)
    sorted_rows = torch.empty(TK, dtype=torch.int32, device=x.device)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=x.device)
    ok = torch.empty(1, dtype=torch.int32, device=x.device)
    a = x.new_empty(TK, n)
    w1_ptr, w1_table, w1_has_table, w1_align = W1.kernel_args()
    b1c = b1.contiguous() if b1 is not None else x
    block_n = _decode_blocks(TK, n)
    _decode_up_kernel[(TK, cdiv(n, block_n))](
        x, topk_ids, w1_ptr, w1_table, b1c, a, sorted_rows, offsets, ok, TK, d, n, E, x.stride(0), x.stride(1),
        *W1.strides,
        _w1_out(n, activation) if b1 is not None else 0, 1, float(alpha), float(limit),
        TOP_K=K, ACTIVATION=_ACT_CODE[activation], GATED=gated, INTERLEAVED=bool(interleaved and gated),
        HAS_B1=b1 is not None, W_TABLE=w1_has_table, W_ALIGN=w1_align, BLOCK_N=block_n,
        BLOCK_D=DECODE_CHUNK_UP, BLOCK_S=max(16, pow2(TK)), BLOCK_E=64, num_warps=DECODE_WARPS,
    )
    # no host sync: a bad id fails here on the device, as the routing kernels' asserts do
    torch._assert_async(ok, f"sonic.moe_experts: expert id out of range [0, {E}) in topk_ids")
    out = torch.empty(T, d, dtype=x.dtype, device=x.device)
    w2_ptr, w2_table, w2_has_table, w2_align = W2.kernel_args()
    b2c = b2.contiguous() if b2 is not None else x
    block_d = _decode_blocks(T, d)
    _decode_down_kernel[(T, cdiv(d, block_d))](
        a, topk_ids, topk_weights, w2_ptr, w2_table, b2c, out, d, n, E, *W2.strides, d if b2 is not None else 0, 1,
        TOP_K=K, HAS_B2=b2 is not None, W_TABLE=w2_has_table, W_ALIGN=w2_align, BLOCK_D=block_d,
        BLOCK_N=DECODE_CHUNK_DOWN, num_warps=DECODE_WARPS,
    )
    return out, sorted_rows, offsets


class _BwdRouting(NamedTuple):
    """What every part of the backward reads of the routing."""

    topk_ids: Tensor  # contiguous
    topk_weights: Tensor  # contiguous
    slot_token: Tensor | None
    K: int  # K of [T, K] routing, 1 in the slot form
    slots: tuple[Tensor, Tensor] | None  # the gather-sum's slot form argument
    kernel_args: dict  # sorted_rows, offsets, top_k, row_token: the kernels' routing keywords


def _bwd_routing(x, topk_ids, topk_weights, sorted_rows, expert_offsets, slot_token) -> _BwdRouting:
    topk_ids, topk_weights, slot_token = _dense_routing(topk_ids, topk_weights, slot_token)
    K, slots = _slot_routing(topk_ids, slot_token, x.shape[0], check=False)  # checked by the forward
    row_token = _row_token(slot_token, sorted_rows)
    args = dict(sorted_rows=sorted_rows, offsets=expert_offsets, top_k=K, row_token=row_token)
    return _BwdRouting(topk_ids, topk_weights, slot_token, K, slots, args)


def _bwd_act(r: _BwdRouting, grad_out, x, W1: Bank, W2: Bank, b1, b2, h, *, n, **flags):
    """(dH [TK, w1_out], A' = s A [TK, n], dS [TK] in slot order, <dO, b2> included): dS in the router
    weights' dtype, or float32 where <dO, b2> is added to it."""
    T, E = x.shape[0], r.kernel_args["offsets"].numel() - 1
    if h.numel() == 0 and r.topk_ids.numel() > 0:  # the forward ran without save_h: recompute H (A is not needed)
        h, _ = triton_moe_up(x, W1, b1, n=n, store_a=False, **r.kernel_args, **flags)
    ds_dtype = r.topk_weights.dtype if b2 is None else torch.float32
    dh, a_scaled, ds = triton_moe_dact(grad_out, W2, h, r.topk_weights.reshape(-1), n=n, ds_dtype=ds_dtype,
                                       **r.kernel_args, **flags)
    if b2 is not None:  # dS also gets <dO[t], b2[e]>: one [T, E] product, read at each slot's (token, expert)
        dob2 = (grad_out.float() @ b2.float().t()).reshape(-1)
        tok = tokens_of_slots(r.topk_ids, r.slot_token).clamp(max=T - 1)  # padding slots may carry T
        ids = r.topk_ids.reshape(-1).long()
        ds = ds + torch.where(ids >= 0, dob2[tok * E + ids.clamp(min=0)], 0.0)
    return dh, a_scaled, ds


def _bias_grad(b: Tensor | None) -> Tensor | None:
    return None if b is None else torch.empty(b.shape, dtype=b.dtype, device=b.device)


def _bwd_dw2(r: _BwdRouting, grad_out, a_scaled, dw2: GradBuffer, b2) -> tuple[Tensor, Tensor | None]:
    """(dW2 [E, P=d, Q=n] laid out as `dw2` says, db2) from gather(dO) and A'."""
    db2 = _bias_grad(b2)
    dw = _weight_grad(grad_out, a_scaled, dw2, gather_lhs=True, gather_rhs=False, db=db2,
                      s_flat=r.topk_weights.reshape(-1), **r.kernel_args)
    return dw, db2


def _bwd_dw1(r: _BwdRouting, dh, x, dw1: GradBuffer, b1) -> tuple[Tensor, Tensor | None]:
    """(dW1 [E, P=w1_out, Q=d] laid out as `dw1` says, db1) from dH and gather(x)."""
    db1 = _bias_grad(b1)
    return _weight_grad(dh, x, dw1, gather_lhs=False, gather_rhs=True, db=db1, **r.kernel_args), db1


def _bwd_dx(r: _BwdRouting, dh, x, W1: Bank, product=None) -> Tensor:
    """dX: dX~ = dH @ B[e] with B[e] = W1[e] [w1_out, d], in slot order (or TILE order, `SCATTER_TILES`);
    then each token's K rows summed (with the `product` term, when given, added in the same pass)."""
    T, d = x.shape
    kw = r.kernel_args
    dx_rows, rows = triton_moe_scatter_gemm(dh, W1, W1.strides, None, kw["sorted_rows"], kw["offsets"], n_dim=d,
                                            split=W1.split, row_map=True)
    return triton_moe_gather_sum(dx_rows, None, T, r.K, x.dtype, r.slots, product=product, row_map=rows)


def scatter_rows(TK: int, E: int, t: Tensor) -> int:
    """Rows the scatter GEMMs' output (Y, dX~) may take on `t`'s device: TK in slot order; in TILE
    order (`SCATTER_TILES`, where the Gluon kernel can run) up to cdiv(TK, 128) + E whole 128-row
    tiles (`gluon_scatter.tile_rows`), whichever kernel `wgrad_choice` then picks."""
    gluon = _gluon_module("gluon_scatter", t) if SCATTER_TILES else None
    return TK if gluon is None else gluon.tile_rows(TK, E, M_TILE)


def backward_sizes(*, T: int, d: int, TK: int, w1_out: int, n: int, elem: int, dw1: int, dw2: int,
                   dx_rows: int | None = None) -> dict[str, int]:
    """The byte sizes `backward_order` weighs (without the grouped-GEMM copies): activations of
    `elem` bytes, dw1 and dw2 in bytes; dX~ of `dx_rows` rows (`scatter_rows`; default TK)."""
    return dict(a_scaled=TK * n * elem, dh=TK * w1_out * elem, dx_rows=(TK if dx_rows is None else dx_rows) * d * elem,
                dx=T * d * elem, dw1=dw1, dw2=dw2)


def _bwd_sizes(x, dh, a_scaled, dw1: GradBuffer, dw2: GradBuffer) -> dict[str, int]:
    T, d = x.shape
    TK = dh.shape[0]
    bytes_of = lambda t: t.numel() * t.element_size()  # noqa: E731
    return backward_sizes(T=T, d=d, TK=TK, w1_out=dh.shape[1], n=a_scaled.shape[1], elem=x.element_size(),
                          dw1=bytes_of(dw1.like), dw2=bytes_of(dw2.like),
                          dx_rows=scatter_rows(TK, dw1.like.shape[0], dh))


def _backward(grad_out, x, topk_ids, topk_weights, W1: Bank, W2: Bank, b1, b2, h, sorted_rows, expert_offsets, *,
              dw1: GradBuffer, dw2: GradBuffer, n, activation, interleaved, alpha, limit, slot_token):
    """(dx, d_topk_weights, dW1, dW2, db1, db2); each dW is laid out as its GradBuffer says."""
    r = _bwd_routing(x, topk_ids, topk_weights, sorted_rows, expert_offsets, slot_token)
    flags = dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    grad_out = grad_out.to(x.dtype)
    dh, a_scaled, ds = _bwd_act(r, grad_out, x, W1, W2, b1, b2, h, n=n, **flags)
    del h
    wgrad2 = dict(gather_lhs=True, gather_rhs=False, db=b2, s_flat=r.topk_weights.reshape(-1))
    wgrad1 = dict(gather_lhs=False, gather_rhs=True, db=b1)
    order, _ = backward_order(**_bwd_sizes(x, dh, a_scaled, dw1, dw2),
                              dw1_copy=_wgrad_copy_bytes(dh, x, dw1, **wgrad1, s_flat=None, **r.kernel_args),
                              dw2_copy=_wgrad_copy_bytes(grad_out, a_scaled, dw2, **wgrad2, **r.kernel_args))
    dh_last = _dh_last(order)
    grads = {}
    for i, step in enumerate(order):
        if step == "dw2":
            grads[step] = _bwd_dw2(r, grad_out, a_scaled, dw2, b2)
            a_scaled = None
        elif step == "dw1":
            grads[step] = _bwd_dw1(r, dh, x, dw1, b1)
        else:
            grads[step] = _bwd_dx(r, dh, x, W1)
        if i == dh_last:
            dh = None
    (dw1, db1), (dw2, db2), dx = grads["dw1"], grads["dw2"], grads["dx"]
    return dx, ds.view(r.topk_weights.shape).to(r.topk_weights.dtype), dw1, dw2, db1, db2


def triton_moe_experts_bwd_part(part: str, x, topk_ids, topk_weights, w1, w2, b1, b2, sorted_rows, expert_offsets,
                                *, activation, interleaved, transposed, alpha, limit, slot_token=None, **tensors):
    """One part of `triton_moe_experts_bwd`, as `codegen.ops`' split backward ops run them:

        "act" (grad_out, h) -> (dH, A', d_topk_weights)   "dw2" (grad_out, a_scaled) -> (dW2, db2 | None)
        "dw1" (dh) -> (dW1, db1 | None)                    "dx" (dh, product) -> dx
    """
    W1, W2 = _stacked_banks(w1, w2, transposed)
    n = w2.shape[1] if transposed else w2.shape[2]
    flags = dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    return _bwd_part(part, x, topk_ids, topk_weights, W1, W2, b1, b2, sorted_rows, expert_offsets, slot_token,
                     GradBuffer(w1, transposed), GradBuffer(w2, transposed), n=n, flags=flags, **tensors)


def triton_moe_experts_list_bwd_part(part: str, x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2,
                                     sorted_rows, expert_offsets, *, banks, activation, interleaved, alpha, limit,
                                     slot_token=None, **tensors):
    """`triton_moe_experts_bwd_part` for per-expert weights (`list_banks`): the weight gradients come
    stacked, dW1 [E, w1_out, d] and dW2 [E, d, n] (as `triton_moe_experts_list_bwd` gives them), in
    (dw, db | None) pairs."""
    E, (d, n) = len(w_gate), w_down[0].shape
    w1_out = w_gate[0].shape[0] + (w_up[0].shape[0] if w_up else 0)
    meta = lambda *size: torch.empty(size, dtype=x.dtype, device="meta")  # noqa: E731
    flags = dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    return _bwd_part(part, x, topk_ids, topk_weights, *banks, b1, b2, sorted_rows, expert_offsets, slot_token,
                     GradBuffer(meta(E, w1_out, d), False), GradBuffer(meta(E, d, n), False), n=n, flags=flags,
                     **tensors)


def _bwd_part(part, x, topk_ids, topk_weights, W1: Bank, W2: Bank, b1, b2, sorted_rows, expert_offsets, slot_token,
              dw1: GradBuffer, dw2: GradBuffer, *, n, flags, grad_out=None, h=None, dh=None, a_scaled=None,
              product=None):
    r = _bwd_routing(x, topk_ids, topk_weights, sorted_rows, expert_offsets, slot_token)
    if part == "act":
        dh, a_scaled, ds = _bwd_act(r, grad_out.to(x.dtype), x, W1, W2, b1, b2, h, n=n, **flags)
        return dh, a_scaled, ds.view(r.topk_weights.shape).to(r.topk_weights.dtype)
    if part == "dw2":
        return _bwd_dw2(r, grad_out.to(x.dtype), a_scaled, dw2, b2)
    if part == "dw1":
        return _bwd_dw1(r, dh, x, dw1, b1)
    if part == "dx":
        return _bwd_dx(r, dh, x, W1, product)
    raise ValueError(f"unknown backward part {part!r}")
