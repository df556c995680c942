"""Pure-torch twin of the fused MoE experts: the CPU path, the test oracle, the benchmark baseline.

Notation (see `codegen.activations`): x [T, d]; topk_ids, topk_weights [T, K]; rows r = 0..TK-1 in
expert order; `sorted_rows[r]` is the flat slot t*K + k of row r; `expert_offsets` [E+1] bounds each
expert's rows.

Slot form (what token rounding produces; `slot_token` given): ids and weights are flat [S] slots,
`slot_token[s]` is the token of slot s (nondecreasing), and id -1 marks a padding slot that no
expert sees and that adds nothing. Padding rows sort after every expert's rows, so
`expert_offsets[E]` counts the real rows. The [T, K] form is the slot form with slot_token = s // K
and no padding. Weight layouts:

    transposed=False (Hugging Face):  w1 [E, 2n, d]  w2 [E, d, n]   (nn.Linear's [out, in])
    transposed=True  (gpt-oss):       w1 [E, d, 2n]  w2 [E, n, d]   ([in, out])
    biases (optional):                b1 [E, 2n]     b2 [E, d]

Forward:  H = gather(x) @ W1^T + b1;  A = act(H);  Y = A @ W2^T + b2;  out[t] = sum_k s[t,k] Y[row(t,k)]
Backward (recomputes A from H; never keeps Y or the gathered x):
    dA' = gather(dO) @ W2            dS[t,k] = <dA', A> + <dO[t], b2>
    dH  = act'(H) * s * dA'          dW2 = gather(dO)^T (s A)        db2 = sum s dO
    dW1 = dH^T gather(x)             db1 = sum dH
    dX  = sum_k (dH @ W1)[row(t,k)]

The expert loop here reads per-expert row counts on the host; that is fine on the CPU. The CUDA
path runs the Triton kernels, whose metadata never leaves the device.
"""
from __future__ import annotations

import torch

from .activations import (
    GATED,
    check_activation,
    split_gate_up,
    torch_activation,
    torch_activation_and_grad,
)

PAD = -1  # expert id of a padding slot (slot form only)


def torch_route(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing metadata, on the device: (sorted_rows int32 [TK], expert_offsets int32 [E+1]).

    A stable sort keeps each expert's rows in token order, so the result is deterministic. Padding
    slots (id -1, slot form) sort last and are not counted.
    """
    flat = topk_ids.reshape(-1).long()
    keys = torch.where(flat == PAD, num_experts, flat)
    sorted_rows = torch.argsort(keys, stable=True).to(torch.int32)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, keys.clamp(0, num_experts), torch.ones_like(flat))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(counts[:num_experts], 0).to(torch.int32)
    return sorted_rows, offsets


def tokens_of_slots(topk_ids: torch.Tensor, slot_token: torch.Tensor | None) -> torch.Tensor:
    """The token (int64) of every flat slot: slot_token, or s // K for [T, K] ids."""
    if slot_token is not None:
        return slot_token.reshape(-1).long()
    K = topk_ids.shape[1]
    return torch.arange(topk_ids.numel(), device=topk_ids.device) // K


def expert_matrices(w1: torch.Tensor, w2: torch.Tensor, e: int, transposed: bool):
    """Expert e's weights as (W1 [w1_out, d], W2 [d, n]): the nn.Linear orientation."""
    if transposed:
        return w1[e].t(), w2[e].t()
    return w1[e], w2[e]


def _bounds(expert_offsets: torch.Tensor) -> list[int]:
    return expert_offsets.tolist()  # host sync: CPU reference only


def check_routing(topk_ids: torch.Tensor, num_experts: int, slot_token: torch.Tensor | None = None) -> None:
    """Reject ids outside [0, E) (-1 is padding in the slot form): a wrong expert is the worst outcome."""
    low = PAD if slot_token is not None else 0
    if topk_ids.numel() and (int(topk_ids.min()) < low or int(topk_ids.max()) >= num_experts):
        allowed = f"[0, {num_experts}) or -1 (padding)" if slot_token is not None else f"[0, {num_experts})"
        raise IndexError(
            f"expert ids must lie in {allowed}; got range [{int(topk_ids.min())}, {int(topk_ids.max())}]"
        )


def slot_tokens_ok(topk_ids: torch.Tensor, slot_token: torch.Tensor, T: int) -> torch.Tensor:
    """A 0-d bool tensor, on the device: slot_token is nondecreasing and every real slot's token
    lies in [0, T) (padding may carry T). The kernels rely on both; checked without a host sync."""
    tok = slot_token.reshape(-1)
    real = topk_ids.reshape(-1) != PAD
    in_range = ((tok >= 0) & ((tok < T) | ~real)).all()
    return in_range & (tok[1:] >= tok[:-1]).all()


def check_slot_tokens(topk_ids: torch.Tensor, slot_token: torch.Tensor | None, T: int) -> None:
    if slot_token is not None and not bool(slot_tokens_ok(topk_ids, slot_token, T)):
        raise IndexError(f"slot_token must be nondecreasing with real slots' tokens in [0, T={T})")


def combine_slots(rows_in_slot_order: torch.Tensor, weights: torch.Tensor | None, topk_ids: torch.Tensor,
                  slot_token: torch.Tensor | None, T: int) -> torch.Tensor:
    """[T, d] in the accumulation dtype: sum over each token's real slots of (weight *) row."""
    acc = torch.float64 if rows_in_slot_order.dtype == torch.float64 else torch.float32
    y = rows_in_slot_order.to(acc)
    if weights is not None:
        y = y * weights.reshape(-1, 1).to(acc)
    if slot_token is None:  # [T, K]: every slot is real; a fixed k order
        return y.view(T, topk_ids.shape[1], y.shape[1]).sum(1)
    real = (topk_ids.reshape(-1) != PAD).unsqueeze(-1)
    y = torch.where(real, y, torch.zeros((), dtype=acc, device=y.device))
    tokens = tokens_of_slots(topk_ids, slot_token).clamp(max=max(T - 1, 0))  # padding may carry T
    return torch.zeros(T, y.shape[1], dtype=acc, device=y.device).index_add_(0, tokens, y)


def torch_moe_experts_fwd(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    *,
    activation: str = "swiglu",
    interleaved: bool = False,
    transposed: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    save_h: bool = True,
    slot_token: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (out [T, d] x.dtype, H [TK, w1_out] or empty, sorted_rows [TK], expert_offsets [E+1])."""
    check_activation(activation)
    T, d = x.shape
    S = topk_ids.numel()
    E = w1.shape[0]
    check_routing(topk_ids, E, slot_token)
    check_slot_tokens(topk_ids, slot_token, T)
    sorted_rows, offsets = torch_route(topk_ids, E)
    token_of_row = tokens_of_slots(topk_ids, slot_token)[sorted_rows.long()]
    w1_out = w1.shape[2] if transposed else w1.shape[1]
    h = x.new_zeros(S, w1_out)
    y = x.new_zeros(S, d)
    bounds = _bounds(offsets)
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        W1, W2 = expert_matrices(w1, w2, e, transposed)
        xg = x[token_of_row[lo:hi]]
        he = xg @ W1.t()
        if b1 is not None:
            he = he + b1[e]
        h[lo:hi] = he
        ye = torch_activation(he, activation, interleaved, alpha, limit) @ W2.t()
        if b2 is not None:
            ye = ye + b2[e]
        y[lo:hi] = ye
    y_slot = torch.empty_like(y)
    y_slot[sorted_rows.long()] = y
    out = combine_slots(y_slot, topk_weights, topk_ids, slot_token, T).to(x.dtype)
    if not save_h:
        h = x.new_empty(0, w1_out)
    return out, h, sorted_rows, offsets


def _rows_of(x, topk_ids, topk_weights, slot_token, sorted_rows):
    """(rows int64 [S], token of each row, router weight of each row in the accumulation dtype, acc)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = sorted_rows.long()
    return rows, tokens_of_slots(topk_ids, slot_token)[rows], topk_weights.reshape(-1)[rows].to(acc), acc


def torch_moe_experts_bwd_act(grad_out, x, topk_ids, topk_weights, w1, w2, b1, b2, h, sorted_rows, expert_offsets, *,
                              activation="swiglu", interleaved=False, transposed=False, alpha=1.702, limit=7.0,
                              slot_token=None):
    """(dH [S, w1_out], A' = s A [S, n], both x.dtype in expert row order; d_topk_weights)."""
    S, E = topk_ids.numel(), w1.shape[0]
    n = w2.shape[1] if transposed else w2.shape[2]
    rows, token_of_row, s_row, acc = _rows_of(x, topk_ids, topk_weights, slot_token, sorted_rows)
    dh = x.new_zeros(S, w1.shape[2] if transposed else w1.shape[1])
    a_scaled = x.new_zeros(S, n)
    ds_rows = torch.zeros(S, dtype=acc, device=x.device)
    bounds = _bounds(expert_offsets)
    grad_out = grad_out.to(x.dtype)
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        W1, W2 = expert_matrices(w1, w2, e, transposed)
        if h.numel():
            he = h[lo:hi]
        else:  # the forward ran without saving H (inference); recompute it
            he = x[token_of_row[lo:hi]] @ W1.t() + (0 if b1 is None else b1[e])
        dog = grad_out[token_of_row[lo:hi]]
        s = s_row[lo:hi].unsqueeze(-1)
        da_prime = dog @ W2  # [rows, n]
        a = torch_activation(he, activation, interleaved, alpha, limit)
        ds = (da_prime.to(acc) * a.to(acc)).sum(-1)
        if b2 is not None:
            ds = ds + (dog.to(acc) * b2[e].to(acc)).sum(-1)
        ds_rows[lo:hi] = ds
        _, dh[lo:hi] = torch_activation_and_grad(he, (s * da_prime.to(acc)), activation, interleaved, alpha, limit)
        a_scaled[lo:hi] = (s * a.to(acc)).to(x.dtype)
    ds_slot = torch.empty_like(ds_rows)
    ds_slot[rows] = ds_rows  # padding rows sit past expert_offsets[E] and keep their 0
    return dh, a_scaled, ds_slot.view(topk_weights.shape).to(topk_weights.dtype)


def torch_moe_experts_bwd_dw2(grad_out, x, topk_ids, topk_weights, w2, b2, a_scaled, sorted_rows, expert_offsets, *,
                              transposed=False, slot_token=None):
    """(dW2 like w2, db2 or None): dW2[e] = gather(dO)^T A', db2[e] = sum s dO."""
    _, token_of_row, s_row, acc = _rows_of(x, topk_ids, topk_weights, slot_token, sorted_rows)
    dw2 = torch.zeros_like(w2)
    db2 = None if b2 is None else torch.zeros_like(b2)
    bounds = _bounds(expert_offsets)
    grad_out = grad_out.to(x.dtype)
    for e in range(w2.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        dog = grad_out[token_of_row[lo:hi]]
        gw2 = dog.t() @ a_scaled[lo:hi]  # [d, n]
        dw2[e] = (gw2.t() if transposed else gw2).to(w2.dtype)
        if db2 is not None:
            db2[e] = (s_row[lo:hi].unsqueeze(-1) * dog.to(acc)).sum(0).to(b2.dtype)
    return dw2, db2


def torch_moe_experts_bwd_dw1(x, topk_ids, topk_weights, w1, b1, dh, sorted_rows, expert_offsets, *,
                              transposed=False, slot_token=None):
    """(dW1 like w1, db1 or None): dW1[e] = dH^T gather(x), db1[e] = sum dH."""
    _, token_of_row, _, acc = _rows_of(x, topk_ids, topk_weights, slot_token, sorted_rows)
    dw1 = torch.zeros_like(w1)
    db1 = None if b1 is None else torch.zeros_like(b1)
    bounds = _bounds(expert_offsets)
    for e in range(w1.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        gw1 = dh[lo:hi].t() @ x[token_of_row[lo:hi]]  # [w1_out, d]
        dw1[e] = (gw1.t() if transposed else gw1).to(w1.dtype)
        if db1 is not None:
            db1[e] = dh[lo:hi].to(acc).sum(0).to(b1.dtype)
    return dw1, db1


def torch_moe_experts_bwd_dx(x, topk_ids, topk_weights, w1, dh, sorted_rows, expert_offsets, *, transposed=False,
                             slot_token=None, product=None):
    """dX [T, d] = sum over each token's rows of dH @ W1 (+ L @ R for product = (L, R)), one rounding."""
    rows, _, _, acc = _rows_of(x, topk_ids, topk_weights, slot_token, sorted_rows)
    T, d = x.shape
    dx_rows = x.new_zeros(topk_ids.numel(), d)
    bounds = _bounds(expert_offsets)
    for e in range(w1.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if lo < hi:
            dx_rows[lo:hi] = dh[lo:hi] @ (w1[e].t() if transposed else w1[e])
    dx_slot = torch.empty_like(dx_rows)
    dx_slot[rows] = dx_rows
    dx = combine_slots(dx_slot, None, topk_ids, slot_token, T)
    if product is not None:
        lhs, rhs = product
        dx = dx + lhs.to(acc) @ rhs.to(acc)
    return dx.to(x.dtype)


def torch_moe_experts_bwd(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    h: torch.Tensor,
    sorted_rows: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    activation: str = "swiglu",
    interleaved: bool = False,
    transposed: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    slot_token: torch.Tensor | None = None,
):
    """Returns (dx, d_topk_weights, dw1, dw2, db1 or None, db2 or None), each in its input's dtype:
    the four parts below, in turn (the split ops of `codegen.ops` run them one by one)."""
    routing = (sorted_rows, expert_offsets)
    dh, a_scaled, ds = torch_moe_experts_bwd_act(grad_out, x, topk_ids, topk_weights, w1, w2, b1, b2, h, *routing,
                                                 activation=activation, interleaved=interleaved,
                                                 transposed=transposed, alpha=alpha, limit=limit,
                                                 slot_token=slot_token)
    layout = dict(transposed=transposed, slot_token=slot_token)
    dw2, db2 = torch_moe_experts_bwd_dw2(grad_out, x, topk_ids, topk_weights, w2, b2, a_scaled, *routing, **layout)
    dw1, db1 = torch_moe_experts_bwd_dw1(x, topk_ids, topk_weights, w1, b1, dh, *routing, **layout)
    dx = torch_moe_experts_bwd_dx(x, topk_ids, topk_weights, w1, dh, *routing, **layout)
    return dx, ds, dw1, dw2, db1, db2


def torch_moe_experts(x, topk_ids, topk_weights, w1, w2, b1=None, b2=None, *, slot_token=None, **flags):
    """The simplest correct loop, differentiable by plain autograd: the oracle for tests.

    One token-slot at a time per expert, no sorting, no fusion; runs in the inputs' dtype.
    Takes [T, K] ids and weights, or the slot form (flat ids with -1 padding, and `slot_token`).
    """
    activation = flags.get("activation", "swiglu")
    check_activation(activation)
    T, d = x.shape
    E = w1.shape[0]
    check_routing(topk_ids, E, slot_token)
    check_slot_tokens(topk_ids, slot_token, T)
    ids, weights = topk_ids.reshape(-1), topk_weights.reshape(-1)
    tokens = tokens_of_slots(topk_ids, slot_token)
    out = torch.zeros(T, d, dtype=torch.promote_types(x.dtype, topk_weights.dtype), device=x.device)
    for e in range(E):
        (slot,) = torch.where(ids == e)
        if slot.numel() == 0:
            continue
        tok = tokens[slot]
        W1, W2 = expert_matrices(w1, w2, e, flags.get("transposed", False))
        he = x[tok] @ W1.t() + (0 if b1 is None else b1[e])
        a = _differentiable_activation(he, activation, flags)
        ye = a @ W2.t() + (0 if b2 is None else b2[e])
        out = out.index_add(0, tok, ye * weights[slot].unsqueeze(-1))
    return out.to(x.dtype)


def _differentiable_activation(h: torch.Tensor, activation: str, flags: dict) -> torch.Tensor:
    """act(H) written with autograd-visible torch ops (for the oracle's gradients)."""
    interleaved = flags.get("interleaved", False)
    alpha, limit = flags.get("alpha", 1.702), flags.get("limit", 7.0)
    F = torch.nn.functional
    unary = {
        "swiglu": F.silu,
        "silu": F.silu,
        "geglu": F.gelu,
        "gelu": F.gelu,
        "geglu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "relu2": lambda t: torch.relu(t) ** 2,
        "relu": torch.relu,
        "reglu": torch.relu,
    }
    if not GATED[activation]:
        return unary[activation](h)
    g, u = split_gate_up(h, interleaved)
    if activation == "swiglu_oai":
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
        return (u + 1) * (g * torch.sigmoid(g * alpha))
    if activation == "swiglu_clamp":
        return F.silu(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)
    if activation == "swiglu_softcap":
        return alpha * torch.tanh(g / alpha) * torch.sigmoid(g) * (limit * torch.tanh(u / limit))
    return unary[activation](g) * u
