"""The weight gradients through torch's CUTLASS grouped GEMM, and the measured choice among the
providers of a weight gradient (and, with the same mechanism, of the scatter GEMM).

dW[e] = Lhs_e^T Rhs_e, summed over expert e's rows, is the K-grouped form of `torch._grouped_mm`
(2D x 2D with `offs`: one [P, Q] product per group of rows). Our Triton kernel
(`kernels.backward._wgrad_kernel`) reads the gathered operand (x for dW1, dO for dW2) in place;
`_grouped_mm` needs it in expert order first, a [TK, Q or P] copy. Which is faster depends on the
shape (H100, `benchmarks/kernels/bench_wgrad.py`, the gather not counted): CUTLASS takes 0.59-0.94x our
time at Mixtral's and gpt-oss's sizes, 0.72-0.91x at the fine-grained ones, where the copy it needs
(one read and one write of [TK, d]) costs about as much as it saves. So neither is picked by a
rule: the first call at a key times every candidate on that call's own inputs, gather included, and
keeps the fastest, as Triton's autotuner does for a config. The key holds the problem's dims, never T.
On Hopper a third candidate is our warp-specialized Gluon kernel (`kernels.gluon_wgrad`), where
`codegen.backward` finds it usable.

    SONIC_MOE_WGRAD=auto        (default) measure once per key
    SONIC_MOE_WGRAD=triton      always our kernel
    SONIC_MOE_WGRAD=grouped_mm  torch._grouped_mm wherever it can run (see `usable`), else our kernel
    SONIC_MOE_WGRAD=gluon       the Gluon kernel wherever it can run, else our kernel

The scatter GEMM (`forward.triton_moe_scatter_gemm`) chooses the same way between our
persistent Triton kernel and the Gluon one (`kernels.gluon_scatter`, Hopper), under keys of its own:

    SONIC_MOE_SCATTER=auto | triton | gluon | gluon-coop

"gluon" is its ping-pong tile, "gluon-coop" its cooperative 128x256 one, offered where the
reduction is long enough for it (`gluon_scatter.candidate_tiles`); pinned where it is not offered,
either runs our Triton kernel.

All accumulate in float32. grouped_mm's weight gradients were bit-identical to our Triton kernel's
at the shapes `bench_wgrad.py` ran; the Gluon kernel's differ in the last bit where it groups an
expert's last rows differently (`bench_gluon_wgrad.py`). The Gluon scatter GEMM's results were
bit-identical to the Triton one's (`bench_gluon_scatter.py`).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch
from torch import Tensor

from . import plans

log = logging.getLogger("moe_compiler")

PROVIDERS = ("auto", "triton", "grouped_mm", "gluon")
SCATTER_PROVIDERS = ("auto", "triton", "gluon", "gluon-coop")


def _pinned(value: str, variable: str = "SONIC_MOE_WGRAD", providers: tuple[str, ...] = PROVIDERS) -> str:
    if value not in providers:
        raise ValueError(f"{variable}={value!r}: one of {providers}")
    return value


PINNED = _pinned(os.environ.get("SONIC_MOE_WGRAD", "auto"))
SCATTER_PINNED = _pinned(os.environ.get("SONIC_MOE_SCATTER", "auto"), "SONIC_MOE_SCATTER", SCATTER_PROVIDERS)

# key -> the provider measured fastest there
_CHOSEN: dict[tuple, str] = {}


def usable(lhs: Tensor, rhs: Tensor, like: Tensor, *, bias_scale: Tensor | None, bias_grad: bool,
           interpreted: bool, major: int) -> bool:
    """Whether `grouped_mm_wgrad` can compute this weight gradient (and its bias gradient).

    Not for: a weight whose gradient is not dense and contiguous in its own layout (`_grouped_mm`
    writes a fresh contiguous [E, ., .] tensor), operands off 16-byte strides, a bias gradient
    scaled by router weights of another dtype than the operands (it would round them). CUDA:
    bfloat16 only (torch 2.11's `_grouped_mm`), Hopper or newer; the interpreter's CPU runs take any
    float dtype (torch's CPU fallback), so the path is tested without a GPU. The slot form is
    taken too (`grouped_mm_wgrad`'s `row_token`). `major`: the CUDA device's compute capability.
    """
    if not like.is_contiguous() or lhs.dtype != rhs.dtype:
        return False
    if bias_grad and bias_scale is not None and bias_scale.dtype != lhs.dtype:
        return False
    if lhs.is_cuda:
        if lhs.dtype != torch.bfloat16 or major < 9:
            return False
    elif not interpreted:
        return False
    vector = max(1, 16 // lhs.element_size())
    return lhs.shape[1] % vector == 0 and rhs.shape[1] % vector == 0 and lhs.shape[0] > 0


def grouped_mm_wgrad(lhs: Tensor, rhs: Tensor, *, gather_lhs: bool, gather_rhs: bool, sorted_rows: Tensor,
                     offsets: Tensor, top_k: int, transposed: bool, row_token: Tensor | None = None,
                     db: Tensor | None = None, bias_scale: Tensor | None = None) -> Tensor:
    """dW by `torch._grouped_mm`: [E, P, Q] (or [E, Q, P] when `transposed`, the layout of a
    transposed weight), contiguous. The gathered operand is copied into expert order first.

    `row_token` (the slot form): the token of each expert-ordered row. The padding rows sort after
    every expert, past offsets[E], where the grouped GEMM reads nothing; their token (which may be
    T) is clamped only so that the copy stays in bounds.

    db [E, P] (optional) gets each expert's column sums of Lhs, weighted by `bias_scale` (slot
    order) when given: one more K-grouped product, Lhs^T times a [TK, 8] block whose first column
    holds the weights (or ones), accumulated in float32 as the kernel's own sums are."""
    rows = sorted_rows.long()
    if row_token is None:
        tokens = rows // top_k
    else:
        gathered = lhs if gather_lhs else rhs
        tokens = row_token.long().clamp(max=max(gathered.shape[0] - 1, 0))
    lhs = lhs.index_select(0, tokens) if gather_lhs else lhs
    rhs = rhs.index_select(0, tokens) if gather_rhs else rhs
    ends = offsets[1:]
    if db is not None:
        block = lhs.new_zeros(lhs.shape[0], max(1, 16 // lhs.element_size()))
        block[:, 0] = 1 if bias_scale is None else bias_scale.reshape(-1)[rows]
        db.copy_(torch._grouped_mm(lhs.t(), block, offs=ends)[:, :, 0])
    if transposed:
        return torch._grouped_mm(rhs.t(), lhs, offs=ends)
    return torch._grouped_mm(lhs.t(), rhs, offs=ends)


def expected(key: tuple, names: tuple[str, ...]) -> str:
    """The provider `choose` will run at `key` among `names`, as far as it is known before the call:
    the pinned one, else the one measured there; "triton" while unmeasured (the caller plans for
    the common case; the measuring call itself runs every candidate anyway)."""
    name = PINNED if PINNED != "auto" else _CHOSEN.get(key, "triton")
    return name if name in names else "triton"


def choose(key: tuple, candidates: dict[str, Callable[[], Tensor]], *, cuda: bool,
           pinned: str | None = None) -> Callable[[], Tensor]:
    """The candidate to run at `key` ("triton" always among them): the pinned one (`pinned`, default
    SONIC_MOE_WGRAD's), else the one measured fastest at the first call there. Inside a CUDA-graph
    capture nothing is timed (timing syncs): an unmeasured key runs "triton" there and is measured
    at its next call outside one."""
    pinned = PINNED if pinned is None else pinned
    if pinned != "auto":
        return candidates.get(pinned, candidates["triton"])
    if len(candidates) == 1:
        return candidates["triton"]
    name = _CHOSEN.get(key)
    if name is not None and name not in candidates:  # chosen where it ran; these inputs it cannot take
        return candidates["triton"]
    if name is None:
        if cuda and torch.cuda.is_current_stream_capturing():
            return candidates["triton"]
        plans.abort("timing candidates")
        times = {name: _time(fn, cuda, guarded=name != "triton") for name, fn in candidates.items()}
        name = min(times, key=times.get)
        _CHOSEN[key] = name
        log.info("weight gradient at %s: %s (%s)", key, name,
                 ", ".join(f"{k} {v * 1e3:.0f} us" for k, v in times.items()))
    return candidates[name]


def _time(fn: Callable[[], Tensor], cuda: bool, guarded: bool) -> float:
    """Median ms of `fn` after a warm-up call. `guarded` (an alternative to our kernel): inf if it
    raises, so it is never chosen; our kernel's own errors propagate (never hidden behind another)."""
    try:
        fn()
        if cuda:
            from triton.testing import do_bench

            return do_bench(fn, warmup=5, rep=25, return_mode="median")
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[1]
    except Exception as exc:  # an alternative's compile errors are not RuntimeErrors
        if not guarded:
            raise
        log.warning("weight gradient provider failed while measured, not used: %s: %s", type(exc).__name__,
                    str(exc).split("\n")[0])
        return float("inf")


def chosen() -> dict[tuple, str]:
    """A copy of the choices made so far (key -> provider)."""
    return dict(_CHOSEN)
