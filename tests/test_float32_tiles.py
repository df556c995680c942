"""The float32 (IEEE dot) tiles of the pointer-load GEMMs (`codegen.launch._IEEE_GPU_CONFIGS`): float32
launches tune over them alone, and they compile for sm90 without a GPU and without register
spills. The wgmma tiles the 16-bit launches tune over spill ~2.7 KB a thread as IEEE float32 dots
and took 7-10 s each to compile, which made a float32 model's first call on the GPU autotune for
minutes (docs/BENCHMARKS.md)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "kernels"))

from bench_up_proj import compile_sm90, up_compile_args  # noqa: E402
from gluon_bench_common import ptxas_usage  # noqa: E402

from moe_compiler import codegen  # noqa: E402
from moe_compiler.codegen.kernels.backward import _wgrad_kernel  # noqa: E402
from moe_compiler.codegen.kernels.grouped_gemm import _scatter_gemm_kernel, _up_proj_kernel  # noqa: E402

T, D, N, E, K = 24576, 1536, 256, 128, 8  # the 7b-256 layer
H100_SHARED = 232448

pytestmark = pytest.mark.skipif(codegen.launch.INTERPRETED, reason="the GPU's config tables (TRITON_INTERPRET=1 is set)")


def test_float32_launches_tune_over_their_own_configs():
    """The pointer-load GEMMs autotune float32 (IEEE dot) launches over small CUDA-core tiles and
    16-bit ones over the wgmma tiles: Triton's own pruning step gives each launch one set."""
    def tiles(configs, name):
        names = ("BLOCK_P", "BLOCK_Q", "BLOCK_M") if name == "wgrad" else ("BLOCK_M", "BLOCK_N", "BLOCK_K")
        return [(*(c.kwargs[k] for k in names), c.num_warps, c.num_stages) for c in configs]

    for name in ("up", "scatter", "dact", "wgrad"):
        tuner = getattr(codegen.launch, "_" + name)
        tuner.nargs = {}
        ieee = tuner.prune_configs({"DOT_PRECISION": "ieee"})
        tf32 = tuner.prune_configs({"DOT_PRECISION": "tf32"})
        assert tiles(ieee, name) == codegen.launch._IEEE_GPU_CONFIGS[name], name
        assert tiles(tf32, name) == [c[:5] for c in codegen.launch._GPU_CONFIGS[name]], name
    # a set with no config of the launch's kind (the interpreter's, a pin, a test's swap) is kept
    one = [codegen.launch._cfg("up", 16, 16, 16, 1, 1)]
    assert codegen.launch._by_dot_precision(one, {}, DOT_PRECISION="ieee") == one
    assert codegen.launch._by_dot_precision(one, {}, DOT_PRECISION="tf32") == one


def _launch_args(kernel: str, config: tuple) -> tuple:
    """(fn, runtime argument types or example values, constexprs) of a float32 launch at one tile."""
    a, b, c = config[:3]
    if kernel in ("up", "dact"):
        args, flags = up_compile_args(T, D, N, E, K, gated=kernel == "up", dtype="fp32")
        flags = dict(flags, W_DESC=0, W_TABLE=False, W_ALIGN=1, FUSED_GU=False)
        return _up_proj_kernel, dict(args, w1_ptr="*fp32"), dict(flags, BLOCK_M=a, BLOCK_N=b, BLOCK_K=c, GROUP_M=8)
    if kernel == "scatter":
        args = dict(in_ptr="*fp32", w_ptr="*fp32", bias_ptr="*fp32", sorted_rows_ptr="*i32", offsets_ptr="*i32",
                    out_ptr="*fp32", w_table_ptr="*i64", TK=T * K, k_dim=N, n_dim=D, E=E, k_split=1,
                    stride_w_e=N * D, stride_w_k=1, stride_w_n=N, stride_bias_e=0)
        flags = dict(HAS_BIAS=False, E_POW2=E, W_TABLE=False, SPLIT_K=False, W_ALIGN=1)
        return _scatter_gemm_kernel, args, dict(flags, BLOCK_M=a, BLOCK_N=b, BLOCK_K=c, GROUP_M=8)
    args = dict(lhs_ptr="*fp32", rhs_ptr="*fp32", s_ptr="*fp32", sorted_rows_ptr="*i32", row_token_ptr="*i32",
                offsets_ptr="*i32", dw_ptr="*fp32", db_ptr="*fp32", TK=T * K, P=D, Q=2 * N, E=E,
                stride_lhs_r=D, stride_lhs_c=1, stride_rhs_r=2 * N, stride_rhs_c=1,
                stride_dw_e=2 * N * D, stride_dw_p=1, stride_dw_q=D)
    flags = dict(top_k=K, GATHER_LHS=True, GATHER_RHS=False, BIAS_GRAD=False, BIAS_SCALED=False, TOKEN_MAP=False)
    return _wgrad_kernel, args, dict(flags, BLOCK_P=a, BLOCK_Q=b, BLOCK_M=c)


@pytest.mark.parametrize("kernel,config", [(k, c) for k, cs in codegen.launch._IEEE_GPU_CONFIGS.items() for c in cs],
                         ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_float32_tile_compiles_for_sm90_without_spills(kernel, config):
    fn, args, constexprs = _launch_args(kernel, config)
    compiled = compile_sm90(fn, args, dict(constexprs, DOT_PRECISION="ieee"), num_warps=config[3],
                            num_stages=config[4])
    usage = ptxas_usage(compiled)
    spills = re.search(r"spills (\d+)/(\d+) B", usage)
    assert spills is not None, usage
    assert spills.groups() == ("0", "0"), usage
    assert compiled.metadata.shared <= H100_SHARED, usage
