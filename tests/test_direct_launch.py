"""`codegen.direct_launch.launch`: a cached launch runs the variant Triton's own path would run.

Each case launches a kernel whose result shows which specialization ran (pointer alignment, an int
argument equal to 1 or divisible by 16, a constexpr, the options), through `launch` and through
`kernel[grid]`, and compares both against torch. The second launch of a key must not go through
`JITFunction.run`, and a launch hook must send it back there. GPU only: without the CUDA driver
(TRITON_INTERPRET=1) `launch` is `kernel[grid]`, checked on the CPU by the last test.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch
import triton
import triton.language as tl

from moe_compiler.codegen.direct_launch import launch

gpu = pytest.mark.gpu


@triton.jit
def _scaled_add_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, NEGATE: tl.constexpr):
    """out[i] = alpha * x[i] + y[i] (negated when NEGATE), i < n; grid (cdiv(n, BLOCK),)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = alpha * tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask)
    if NEGATE:
        v = -v
    tl.store(out_ptr + offs, v, mask=mask)


def _expected(x, y, n, alpha, negate):
    v = alpha * x[:n] + y[:n]
    return -v if negate else v


def _run(via_launch: bool, x, y, n, alpha, block=64, negate=False, grid=None, **options):
    out = torch.full_like(x, float("nan"))
    grid = grid or (triton.cdiv(n, block),)
    if via_launch:
        launch(_scaled_add_kernel, grid, x, y, out, n, alpha, BLOCK=block, NEGATE=negate, **options)
    else:
        _scaled_add_kernel[grid](x, y, out, n, alpha, BLOCK=block, NEGATE=negate, **options)
    return out


@gpu
@pytest.mark.parametrize("offset", [0, 1, 8], ids=["aligned", "off-by-4-bytes", "off-by-32-bytes"])
@pytest.mark.parametrize("n", [1, 16, 37, 1024])
def test_each_specialization_runs_its_own_variant(offset, n):
    base = torch.randn(2048, device="cuda")
    x, y = base[offset:offset + 1024], torch.randn(1024, device="cuda")
    for negate in (False, True):
        for _ in range(3):  # first: through run; then the cached variant
            got = _run(True, x, y, n, 0.5, negate=negate)
            torch.testing.assert_close(got[:n], _expected(x, y, n, 0.5, negate), rtol=0, atol=0)
            assert got[n:].isnan().all(), "wrote past n"
        torch.testing.assert_close(got, _run(False, x, y, n, 0.5, negate=negate), rtol=0, atol=0, equal_nan=True)


@gpu
def test_a_seen_key_skips_run_and_a_new_key_takes_it():
    x, y = torch.randn(256, device="cuda"), torch.randn(256, device="cuda")
    _run(True, x, y, 200, 2.0, num_warps=2)
    real_run = _scaled_add_kernel.run
    with mock.patch.object(_scaled_add_kernel, "run", wraps=real_run) as run:
        for n in (200, 201, 203):  # one specialization: not 1, not divisible by 16
            torch.testing.assert_close(_run(True, x, y, n, 2.0, num_warps=2)[:n], _expected(x, y, n, 2.0, False))
        assert run.call_count == 0
        _run(True, x, y, 208, 2.0, num_warps=2)  # divisible by 16: another variant
        _run(True, x, y, 200, 2.0, num_warps=4)  # another option
        _run(True, x[1:], y[1:], 200, 2.0, num_warps=2)  # misaligned pointers
        assert run.call_count == 3


@gpu
def test_a_callable_grid_sees_the_constexprs():
    x, y = torch.randn(300, device="cuda"), torch.randn(300, device="cuda")
    seen = []

    def grid(meta):
        seen.append(meta["BLOCK"])
        return (triton.cdiv(meta["n"], meta["BLOCK"]),)

    for _ in range(2):
        torch.testing.assert_close(_run(True, x, y, 300, 1.5, block=128, grid=grid), _expected(x, y, 300, 1.5, False))
    assert seen == [128, 128]


@gpu
def test_a_launch_hook_sends_launches_through_run():
    from triton import knobs

    x, y = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")
    _run(True, x, y, 64, 1.0)
    names = []

    def hook(metadata):
        names.append(metadata.data["name"] if hasattr(metadata, "data") else metadata)

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        _run(True, x, y, 64, 1.0)
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = None
    assert len(names) == 1


def test_without_the_cuda_driver_launch_is_the_kernels_own_launch():
    kernel = mock.MagicMock()
    launch(kernel, (3,), 1, 2, FLAG=True)
    kernel.__getitem__.assert_called_once_with((3,))
    kernel.__getitem__.return_value.assert_called_once_with(1, 2, FLAG=True)
