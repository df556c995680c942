"""The forward at a few slots (decoding), in two launches and without routing metadata.

    _decode_up_kernel:   A[s] = act(x[s // K] @ W1[ids[s]]^T + b1[ids[s]])       one program per (slot, N block)
                         and, in its first program, the routing the op returns (sorted_rows, offsets)
    _decode_down_kernel: out[t] = sum_k w[t, k] * (A[t*K + k] @ W2[ids[t, k]]^T + b2)  one per (token, d block)

At decode sizes (T*K slots a handful, most on different experts) the grouped path is bound by the host:
it sorts the slots by expert, builds TMA descriptors and launches four kernels, each of whose
tiles holds one or two real rows. Here each slot reads its expert's weights directly, as a matrix-vector
product in float32, so nothing is sorted and no row is padded. Two slots on one expert read its
weights twice, which the launcher keeps rare by using this path only where slots are few next to the
experts (`codegen.decode.DECODE_MAX_SLOTS`). The op still returns the routing metadata (a
backward that recomputes H reads it); with so few slots the first program of the up-projection
ranks them itself, all pairs at once, instead of a routing launch of its own.

The numerics follow the grouped path's: H rounded to x's dtype before the activation, A stored in x's
dtype, each slot's product (+ b2) rounded to x's dtype, then weighted and summed over a token's K slots
in float32 in slot order. Weights are addressed as the grouped kernels address them (a Bank: stacked with
(e, out, in) strides, or per-expert tensors through an offset table), so every layout needs no copy.
"""
import triton
import triton.language as tl

from .activation import _act_fwd
from .grouped_gemm import _table_offset


@triton.jit
def _rank_slots(ids_ptr, sorted_rows_ptr, offsets_ptr, ok_ptr, TK, E, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr):
    """`codegen.reference.torch_route` for TK <= BLOCK_S slots: slot s goes to the row counting the
    slots before it in (expert, slot) order; offsets[e] counts the slots on experts below e.
    ok[0] = 1 when every id is in [0, E), else 0 (the launcher asserts it on the device)."""
    ss = tl.arange(0, BLOCK_S)
    live = ss < TK
    ids = tl.load(ids_ptr + ss, mask=live, other=0).to(tl.int64)
    bad = tl.sum((((ids < 0) | (ids >= E)) & live).to(tl.int32), axis=0)
    tl.store(ok_ptr, (bad == 0).to(tl.int32))
    ids = tl.where(live, ids, E)  # past the slots: after every expert, never counted below one
    earlier = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (ss[None, :] < ss[:, None]))
    rank = tl.sum((earlier & live[None, :]).to(tl.int32), axis=1)
    tl.store(sorted_rows_ptr + rank, ss, mask=live)
    for e0 in range(0, E + 1, BLOCK_E):
        es = e0 + tl.arange(0, BLOCK_E)
        below = tl.sum(((ids[None, :] < es[:, None]) & live[None, :]).to(tl.int32), axis=1)
        tl.store(offsets_ptr + es, below, mask=es <= E)


@triton.jit
def _clamped_expert(ids_ptr, slot, E):
    """ids[slot] as int64, clamped into [0, E): an id out of range reads a real expert's weights
    (never memory past them) and fails the launcher's device assert on `ok`."""
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    return tl.minimum(tl.maximum(expert, 0), E - 1)


@triton.jit(do_not_specialize=["TK"])
def _decode_up_kernel(
    x_ptr,  # [T, d], strides (stride_x_t, stride_x_d)
    ids_ptr,  # [TK] int, contiguous: expert of each slot
    w1_ptr,  # W1 bank: [E, w1_out, d] through (e, out, in) strides, or per-expert tensors (W_TABLE)
    w_table_ptr,  # [2E] int64 element offsets from w1_ptr (gate rows, then up rows), read when W_TABLE
    b1_ptr,  # [E, w1_out], read when HAS_B1
    a_ptr,  # [TK, n] x.dtype, contiguous
    sorted_rows_ptr,  # [TK] int32: the slots in expert order (stable), written by program (0, 0)
    offsets_ptr,  # [E + 1] int32: each expert's first row in that order, written by program (0, 0)
    ok_ptr,  # [1] int32: 1 when every id is in [0, E), written by program (0, 0)
    TK, d, n, E,
    stride_x_t, stride_x_d,
    stride_w1_e, stride_w1_o, stride_w1_i,
    stride_b1_e, stride_b1_o,
    alpha, limit,
    TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_B1: tl.constexpr, W_TABLE: tl.constexpr, W_ALIGN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Grid: (TK, cdiv(n, BLOCK_N)). Program (s, j): A[s, j*BLOCK_N:] from the matching gate and up rows.
    BLOCK_S >= TK: the slots program (0, 0) ranks; BLOCK_E: the experts it counts at a time."""
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    if (slot == 0) & (pid_n == 0):
        _rank_slots(ids_ptr, sorted_rows_ptr, offsets_ptr, ok_ptr, TK, E, BLOCK_S, BLOCK_E)
    expert = _clamped_expert(ids_ptr, slot, E)
    token = (slot // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    if GATED and INTERLEAVED:
        gate_rows = 2 * cols
        up_rows = 2 * cols + 1
    else:
        gate_rows = cols
        up_rows = cols
    if W_TABLE:
        gate_off = _table_offset(w_table_ptr, expert, W_ALIGN)
        up_off = _table_offset(w_table_ptr, E + expert, W_ALIGN)
    else:
        gate_off = expert * stride_w1_e
        up_off = gate_off
        if GATED and not INTERLEAVED:
            up_off += n * stride_w1_o
    ks = tl.arange(0, BLOCK_D)
    wg_ptrs = w1_ptr + gate_off + gate_rows[:, None].to(tl.int64) * stride_w1_o + ks[None, :] * stride_w1_i
    wu_ptrs = w1_ptr + up_off + up_rows[:, None].to(tl.int64) * stride_w1_o + ks[None, :] * stride_w1_i
    x_ptrs = x_ptr + token * stride_x_t + ks * stride_x_d
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, d, BLOCK_D):
        k_mask = (k0 + ks) < d
        xv = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        w_mask = col_mask[:, None] & k_mask[None, :]
        wg = tl.load(wg_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * xv[None, :], axis=1)
        if GATED:
            wu = tl.load(wu_ptrs, mask=w_mask, other=0.0).to(tl.float32)
            acc_u += tl.sum(wu * xv[None, :], axis=1)
            wu_ptrs += BLOCK_D * stride_w1_i
        wg_ptrs += BLOCK_D * stride_w1_i
        x_ptrs += BLOCK_D * stride_x_d
    if HAS_B1:
        b_base = b1_ptr + expert * stride_b1_e
        if GATED and not INTERLEAVED:
            b_up = cols + n
        else:
            b_up = up_rows
        acc_g += tl.load(b_base + gate_rows * stride_b1_o, mask=col_mask, other=0.0).to(tl.float32)
        if GATED:
            acc_u += tl.load(b_base + b_up * stride_b1_o, mask=col_mask, other=0.0).to(tl.float32)
    out_dtype = a_ptr.dtype.element_ty
    # act() reads H rounded to x's dtype, as the grouped path stores it
    a = _act_fwd(acc_g.to(out_dtype).to(tl.float32), acc_u.to(out_dtype).to(tl.float32), alpha, limit, ACTIVATION)
    tl.store(a_ptr + slot.to(tl.int64) * n + cols, a.to(out_dtype), mask=col_mask)


@triton.jit
def _decode_down_kernel(
    a_ptr,  # [TK, n] x.dtype, contiguous
    ids_ptr,  # [TK] int, contiguous
    s_ptr,  # [TK] router weights (any float dtype), contiguous
    w2_ptr,  # W2 bank: [E, d, n] through (e, out, in) strides, or per-expert tensors (W_TABLE)
    w_table_ptr,  # [E] int64 element offsets from w2_ptr, read when W_TABLE
    b2_ptr,  # [E, d], read when HAS_B2
    out_ptr,  # [T, d] out dtype, contiguous
    d, n, E,
    stride_w2_e, stride_w2_o, stride_w2_i,
    stride_b2_e, stride_b2_o,
    TOP_K: tl.constexpr, HAS_B2: tl.constexpr, W_TABLE: tl.constexpr, W_ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid: (T, cdiv(d, BLOCK_D)). Program (t, j): out[t, j*BLOCK_D:], its K slots in order."""
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = rows < d
    ns = tl.arange(0, BLOCK_N)
    y_dtype = a_ptr.dtype.element_ty
    out = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        slot = token * TOP_K + k
        expert = _clamped_expert(ids_ptr, slot, E)
        if W_TABLE:
            base = w2_ptr + _table_offset(w_table_ptr, expert, W_ALIGN)
        else:
            base = w2_ptr + expert * stride_w2_e
        w_ptrs = base + rows[:, None].to(tl.int64) * stride_w2_o + ns[None, :] * stride_w2_i
        a_ptrs = a_ptr + slot * n + ns
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for n0 in range(0, n, BLOCK_N):
            n_mask = (n0 + ns) < n
            av = tl.load(a_ptrs, mask=n_mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=row_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * av[None, :], axis=1)
            w_ptrs += BLOCK_N * stride_w2_i
            a_ptrs += BLOCK_N
        if HAS_B2:
            acc += tl.load(b2_ptr + expert * stride_b2_e + rows * stride_b2_o, mask=row_mask, other=0.0).to(tl.float32)
        y = acc.to(y_dtype).to(tl.float32)  # the grouped path stores each slot's product in x's dtype
        out += y * tl.load(s_ptr + slot).to(tl.float32)
    tl.store(out_ptr + token * d + rows, out.to(out_ptr.dtype.element_ty), mask=row_mask)
