"""What the Gluon (sm90) kernels share: `gluon_wgrad` (the weight gradient) and `gluon_scatter` (the
scatter GEMM).

  * the guarded import of Gluon and its Hopper ops. Gluon (`triton.experimental.gluon`) is
    experimental, written against Triton 3.6: importing this module never fails, whatever Triton is
    installed. `HAS_GLUON` says whether the kernels can be built, `GLUON_IMPORT_ERROR` why not; without
    Gluon the imported names (`gluon`, `gl`, `mbarrier`, ...) and the layouts below are None.
  * the `@gluon.constexpr_function` layouts both kernels use: `copy_layout` (16-byte pointer copies of
    a 16-bit tile) and `wgmma_acc_layout` (a wgmma accumulator).
  * `compile_for_sm90`: a kernel compiled for sm90 on the CPU (no GPU), its arguments specialized as
    the launcher's would be; `bf16_desc_type` names a TMA descriptor argument's type for it.
"""
from __future__ import annotations

import triton

from ..launch import _major

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
    GLUON_IMPORT_ERROR = None
except Exception as exc:  # noqa: BLE001 - no Gluon (older Triton), no Hopper ops, or a Gluon that fails to import
    HAS_GLUON = False
    GLUON_IMPORT_ERROR = exc
    gluon = gl = async_copy = fence_async_shared = mbarrier = tma = None
    warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None


if HAS_GLUON:

    @gluon.constexpr_function
    def copy_layout(rows, cols, num_warps):
        """A [rows, cols] 16-bit tile, 8 contiguous columns (16 bytes) per thread, a row's threads adjacent."""
        per_row = min(32, cols // 8)
        return gl.BlockedLayout([1, 8], [32 // per_row, per_row], [num_warps, 1], [1, 0])

    @gluon.constexpr_function
    def wgmma_acc_layout(block_n, num_warps):
        """wgmma accumulator [., block_n]: the warps stacked along its rows (16 each), one instruction
        as wide as the tile (N = block_n)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_n, 16])

else:
    copy_layout = wgmma_acc_layout = None


_LAYOUTS: dict[tuple, object] = {}


def is_sm90(t) -> bool:
    """t lives on a Hopper (sm90) GPU (`launch._major`: each device's capability asked once)."""
    return t.is_cuda and _major(t.device) == 9


def shared_layout(block: list[int], dtype):
    """`gl.NVMMASharedLayout.get_default_for(block, dtype)`, built once per (block, dtype): the
    launchers build two or three a launch, ~25 us each under cProfile (H200, 2026-11-28)."""
    key = (*block, str(dtype))
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(list(block), dtype)
    return layout


def bf16_desc_type(block: list[int]) -> str:
    """The signature type of a TMA descriptor over a bf16 tensor, box `block`, in the default NVMMA
    shared layout (the one the launchers build)."""
    layout = shared_layout(block, gl.bfloat16)
    return f"tensordesc<bf16[{', '.join(map(str, block))}],{layout!r}>"


def compile_for_sm90(fn, signature: dict, constexprs: dict, divisible: list[str], *, num_warps: int, maxnreg: int,
                     capability: int = 90):
    """Compile the Gluon kernel `fn` for sm`capability` without a GPU (triton.compile on a GPUTarget);
    returns the CompiledKernel (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata.shared`).

    signature: the type of each runtime argument ("*bf16", "i32", `bf16_desc_type(...)`); constexprs:
    the value of each constexpr argument; divisible: the arguments specialized as multiples of 16 (as
    the launcher's would be)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    signature = {k: signature[k] for k in fn.arg_names}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in divisible}
    src = GluonASTSource(fn, signature, constexprs, attrs)
    options = dict(num_warps=num_warps, maxnreg=maxnreg)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
