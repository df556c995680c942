"""The `sonic::` torch.library ops: the contract between the pattern passes and the kernels.

    sonic::moe_experts(x, topk_ids, topk_weights, w1, w2, b1?, b2?, activation, interleaved,
                       transposed, alpha, limit, save_h, slot_token?)
        -> (out [T, d], H [TK, w1_out] (or [0, w1_out] when save_h is False),
            sorted_rows int32 [TK], expert_offsets int32 [E+1])
    sonic::moe_experts_backward(grad_out, <forward inputs>, H, sorted_rows, expert_offsets, flags,
                                slot_token?)
        -> (dx, d_topk_weights, dw1, dw2, db1, db2)   (db1/db2 are empty when there is no bias)

Routing comes as [T, K] ids and weights (every id in [0, E)), or in the slot form that token
rounding produces: flat [S] ids and weights plus `slot_token` [S], the token of each slot
(nondecreasing), where id -1 marks a padding slot that adds nothing (see `codegen.reference`).
TK above is the number of slots.

Autograd saves x, the routing (ids, weights, sorted_rows, offsets) and the pre-activation H; the
backward recomputes A = act(H) and never sees the gathered x or the expert outputs Y.

    sonic::moe_experts_list(x, topk_ids, topk_weights, w_gate[], w_up[], w_down[], b1?, b2?, activation,
                            interleaved, alpha, limit, save_h, slot_token?) -> as moe_experts
    sonic::moe_experts_list_backward(...) -> (dx, d_topk_weights, dW1 [E, w1_out, d], dW2 [E, d, n], db1, db2)

    sonic::moe_experts_backward_act(<moe_experts_backward's arguments>) -> (dH [TK, w1_out], A' [TK, n],
                                                                          d_topk_weights)
    sonic::moe_experts_backward_dw2(grad_out, <inputs>, A', sorted_rows, expert_offsets, flags, slot_token?)
        -> (dw2, db2)
    sonic::moe_experts_backward_dw1(<inputs>, dH, sorted_rows, expert_offsets, flags, slot_token?) -> (dw1, db1)
    sonic::moe_experts_backward_dx(<inputs>, dH, sorted_rows, expert_offsets, flags, slot_token?, L?, R?) -> dx

The same backward in four parts (dH and A' in expert row order, as the kernels keep them), for
compiled graphs: `moe_compiler.grad_fold` puts them in a backward graph in place of the one op
when another term of x's gradient, L @ R (the router's), can be added inside dX's gather-sum, which
needs d_topk_weights first. Eager autograd runs the one op.

The list form takes each expert's nn.Linear weights as they are (an `nn.ModuleList` of experts):
w_gate[e] [n, d] with w_up[e] [n, d] (gated, separate), or w_gate[e] [w1_out, d] alone (non-gated,
or gate and up in one tensor, laid out per `interleaved`); w_down[e] [d, n]. The kernels read
those tensors where they are, through a cached table of their addresses: no weight is stacked per
step. The weight gradients come back stacked and each expert gets a view of its slice. Biases, when
the experts' Linears have them, come stacked as in the stacked form: b1 [E, w1_out] (gate then up
for separate tensors), b2 [E, d]; the rewrite stacks the per-expert bias vectors in the graph
(E (w1_out + d) elements, 1/d of the weights' size), so their gradients flow back through that stack.

`sonic::moe_experts`, `sonic::moe_experts_list` and `sonic::route` also have a `nograd` overload
(`codegen.nograd`): the same schema and implementation without the custom op's Python autograd
layer, 21-84 us less host time a call on H100 machines. The rewrite and the eager wrappers
call it where no gradient can flow (inference); called where one can, it raises.

Implementations: on CUDA the Triton kernels (`codegen.forward`, `codegen.backward`, launched as
`codegen.launch` configures them) when `launch.supports` takes the call; everywhere else the
pure-torch reference (`codegen.reference`). `SONIC_MOE_KERNEL=reference` forces the reference on
CUDA too (debugging, A/B checks); it is read once at import (`launch.runs_triton`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import backward, forward
from .activations import GATED, check_activation, check_activation_params
from .launch import list_banks, runs_triton, supports
from .nograd import overload, register_nograd
from .plans import planned
from .reference import (
    torch_moe_experts_bwd,
    torch_moe_experts_bwd_act,
    torch_moe_experts_bwd_dw1,
    torch_moe_experts_bwd_dw2,
    torch_moe_experts_bwd_dx,
    torch_moe_experts_fwd,
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
def _flags(activation, interleaved, transposed, alpha, limit):
    return dict(activation=activation, interleaved=interleaved, transposed=transposed, alpha=alpha, limit=limit)


@planned
def _moe_experts_fwd(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w1: Tensor,
    w2: Tensor,
    b1: Optional[Tensor],
    b2: Optional[Tensor],
    activation: str,
    interleaved: bool,
    transposed: bool,
    alpha: float,
    limit: float,
    save_h: bool,
    slot_token: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    flags = _flags(activation, interleaved, transposed, alpha, limit)
    args = (x, topk_ids, topk_weights, w1, w2, b1, b2)
    if runs_triton(x) and supports(*args, **flags):
        return forward.triton_moe_experts_fwd(*args, save_h=save_h, slot_token=slot_token, **flags)
    return torch_moe_experts_fwd(*args, save_h=save_h, slot_token=slot_token, **flags)


moe_experts_op = torch.library.custom_op("sonic::moe_experts", _moe_experts_fwd, mutates_args=())


@moe_experts_op.register_fake
def _moe_experts_fake(x, topk_ids, topk_weights, w1, w2, b1, b2, activation, interleaved, transposed, alpha, limit,
                      save_h, slot_token=None):
    T, d = x.shape
    TK = topk_ids.numel()
    E = w1.shape[0]
    w1_out = w1.shape[2] if transposed else w1.shape[1]
    out = x.new_empty(T, d)
    h = x.new_empty(TK if save_h else 0, w1_out)
    sorted_rows = x.new_empty(TK, dtype=torch.int32)
    offsets = x.new_empty(E + 1, dtype=torch.int32)
    return out, h, sorted_rows, offsets


register_nograd("moe_experts", _moe_experts_fwd, _moe_experts_fake)


def _bias_or_empty(db: Optional[Tensor], x: Tensor) -> Tensor:
    """A bias gradient, or the empty tensor the ops return for an absent bias (a schema has no None outputs)."""
    return x.new_empty(0) if db is None else db


def _empty_bias_grad(b: Optional[Tensor], x: Tensor) -> Tensor:
    """The fake of a bias gradient: like b, or empty for an absent bias."""
    return x.new_empty(0) if b is None else torch.empty_like(b)


@planned
def _moe_experts_backward(
    grad_out: Tensor,
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w1: Tensor,
    w2: Tensor,
    b1: Optional[Tensor],
    b2: Optional[Tensor],
    h: Tensor,
    sorted_rows: Tensor,
    expert_offsets: Tensor,
    activation: str,
    interleaved: bool,
    transposed: bool,
    alpha: float,
    limit: float,
    slot_token: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    flags = _flags(activation, interleaved, transposed, alpha, limit)
    args = (grad_out, x, topk_ids, topk_weights, w1, w2, b1, b2, h, sorted_rows, expert_offsets)
    if runs_triton(x) and supports(x, topk_ids, topk_weights, w1, w2, b1, b2, **flags):
        dx, dw, dw1, dw2, db1, db2 = backward.triton_moe_experts_bwd(*args, slot_token=slot_token, **flags)
    else:
        dx, dw, dw1, dw2, db1, db2 = torch_moe_experts_bwd(*args, slot_token=slot_token, **flags)
    return dx, dw, dw1, dw2, _bias_or_empty(db1, x), _bias_or_empty(db2, x)


moe_experts_backward_op = torch.library.custom_op("sonic::moe_experts_backward", _moe_experts_backward, mutates_args=())


@moe_experts_backward_op.register_fake
def _moe_experts_backward_fake(grad_out, x, topk_ids, topk_weights, w1, w2, b1, b2, h, sorted_rows, expert_offsets,
                               *flags, slot_token=None):
    return (
        torch.empty_like(x),
        torch.empty_like(topk_weights),
        torch.empty_like(w1),
        torch.empty_like(w2),
        _empty_bias_grad(b1, x),
        _empty_bias_grad(b2, x),
    )


register_nograd("moe_experts_backward", _moe_experts_backward, _moe_experts_backward_fake)


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w1, w2, b1, b2, activation, interleaved, transposed, alpha, limit, _, slot_token = inputs
    _, h, sorted_rows, offsets = output
    _saved_outputs_are_not_differentiable(ctx, h)
    ctx.save_for_backward(x, topk_ids, topk_weights, w1, w2, b1, b2, h, sorted_rows, offsets, slot_token)
    ctx.flags = (activation, interleaved, transposed, alpha, limit)


def _saved_outputs_are_not_differentiable(ctx, h):
    """H and the integer routing outputs only carry what the backward needs: no gradient flows into
    them. Without this, eager autograd materialises a zero gradient for each of them at every
    backward (for H, [TK, 2n]: 201 MB of fill at the 7b-256 shape), which the backward never reads;
    an absent output gradient (grad_out) arrives as None and the backward makes its zeros itself."""
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, _grad_h, _grad_rows, _grad_offsets):
    x, topk_ids, topk_weights, w1, w2, b1, b2, h, sorted_rows, offsets, slot_token = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(x)
    dx, dw, dw1, dw2, db1, db2 = moe_experts_backward_op(
        grad_out, x, topk_ids, topk_weights, w1, w2, b1, b2, h, sorted_rows, offsets, *ctx.flags, slot_token
    )
    return (
        dx,
        None,
        dw,
        dw1,
        dw2,
        None if b1 is None else db1,
        None if b2 is None else db2,
        None, None, None, None, None, None, None,
    )


moe_experts_op.register_autograd(_backward, setup_context=_setup_context)


def _bwd_part(part: str, x, topk_ids, topk_weights, w1, w2, b1, b2, sorted_rows, expert_offsets, flags, slot_token,
              **tensors):
    """One part of the backward by the Triton kernels when they support the call, else the reference."""
    if runs_triton(x) and supports(x, topk_ids, topk_weights, w1, w2, b1, b2, **flags):
        return backward.triton_moe_experts_bwd_part(part, x, topk_ids, topk_weights, w1, w2, b1, b2, sorted_rows,
                                                    expert_offsets, slot_token=slot_token, **tensors, **flags)
    return _reference_part(part, x, topk_ids, topk_weights, w1, w2, b1, b2, sorted_rows, expert_offsets, flags,
                           slot_token, **tensors)


def _reference_part(part: str, x, topk_ids, topk_weights, w1, w2, b1, b2, sorted_rows, expert_offsets, flags,
                    slot_token, **tensors):
    routing = (sorted_rows, expert_offsets)
    layout = dict(transposed=flags["transposed"], slot_token=slot_token)
    if part == "act":
        return torch_moe_experts_bwd_act(tensors["grad_out"], x, topk_ids, topk_weights, w1, w2, b1, b2,
                                         tensors["h"], *routing, slot_token=slot_token, **flags)
    if part == "dw2":
        return torch_moe_experts_bwd_dw2(tensors["grad_out"], x, topk_ids, topk_weights, w2, b2, tensors["a_scaled"],
                                         *routing, **layout)
    if part == "dw1":
        return torch_moe_experts_bwd_dw1(x, topk_ids, topk_weights, w1, b1, tensors["dh"], *routing, **layout)
    return torch_moe_experts_bwd_dx(x, topk_ids, topk_weights, w1, tensors["dh"], *routing,
                                    product=tensors["product"], **layout)


@planned
def _moe_experts_backward_act(
    grad_out: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor,
    b1: Optional[Tensor], b2: Optional[Tensor], h: Tensor, sorted_rows: Tensor, expert_offsets: Tensor,
    activation: str, interleaved: bool, transposed: bool, alpha: float, limit: float,
    slot_token: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    flags = _flags(activation, interleaved, transposed, alpha, limit)
    return _bwd_part("act", x, topk_ids, topk_weights, w1, w2, b1, b2, sorted_rows, expert_offsets, flags,
                     slot_token, grad_out=grad_out, h=h)


moe_experts_backward_act_op = torch.library.custom_op(
    "sonic::moe_experts_backward_act", _moe_experts_backward_act, mutates_args=())


@moe_experts_backward_act_op.register_fake
def _moe_experts_backward_act_fake(grad_out, x, topk_ids, topk_weights, w1, w2, b1, b2, h, sorted_rows, expert_offsets,
                                   activation, interleaved, transposed, alpha, limit, slot_token=None):
    TK = topk_ids.numel()
    w1_out, n = (w1.shape[2], w2.shape[1]) if transposed else (w1.shape[1], w2.shape[2])
    return x.new_empty(TK, w1_out), x.new_empty(TK, n), torch.empty_like(topk_weights)


register_nograd("moe_experts_backward_act", _moe_experts_backward_act, _moe_experts_backward_act_fake)


@planned
def _moe_experts_backward_dw2(
    grad_out: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor,
    b1: Optional[Tensor], b2: Optional[Tensor], a_scaled: Tensor, sorted_rows: Tensor, expert_offsets: Tensor,
    activation: str, interleaved: bool, transposed: bool, alpha: float, limit: float,
    slot_token: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    flags = _flags(activation, interleaved, transposed, alpha, limit)
    dw2, db2 = _bwd_part("dw2", x, topk_ids, topk_weights, w1, w2, b1, b2, sorted_rows, expert_offsets, flags,
                         slot_token, grad_out=grad_out, a_scaled=a_scaled)
    return dw2, _bias_or_empty(db2, x)


moe_experts_backward_dw2_op = torch.library.custom_op(
    "sonic::moe_experts_backward_dw2", _moe_experts_backward_dw2, mutates_args=())


@moe_experts_backward_dw2_op.register_fake
def _moe_experts_backward_dw2_fake(grad_out, x, topk_ids, topk_weights, w1, w2, b1, b2, a_scaled, *rest,
                                   slot_token=None):
    return torch.empty_like(w2), _empty_bias_grad(b2, x)


register_nograd("moe_experts_backward_dw2", _moe_experts_backward_dw2, _moe_experts_backward_dw2_fake)


@planned
def _moe_experts_backward_dw1(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor],
    b2: Optional[Tensor], dh: Tensor, sorted_rows: Tensor, expert_offsets: Tensor,
    activation: str, interleaved: bool, transposed: bool, alpha: float, limit: float,
    slot_token: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    flags = _flags(activation, interleaved, transposed, alpha, limit)
    dw1, db1 = _bwd_part("dw1", x, topk_ids, topk_weights, w1, w2, b1, b2, sorted_rows, expert_offsets, flags,
                         slot_token, dh=dh)
    return dw1, _bias_or_empty(db1, x)


moe_experts_backward_dw1_op = torch.library.custom_op(
    "sonic::moe_experts_backward_dw1", _moe_experts_backward_dw1, mutates_args=())


@moe_experts_backward_dw1_op.register_fake
def _moe_experts_backward_dw1_fake(x, topk_ids, topk_weights, w1, w2, b1, b2, dh, *rest, slot_token=None):
    return torch.empty_like(w1), _empty_bias_grad(b1, x)


register_nograd("moe_experts_backward_dw1", _moe_experts_backward_dw1, _moe_experts_backward_dw1_fake)


@planned
def _moe_experts_backward_dx(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor],
    b2: Optional[Tensor], dh: Tensor, sorted_rows: Tensor, expert_offsets: Tensor,
    activation: str, interleaved: bool, transposed: bool, alpha: float, limit: float,
    slot_token: Optional[Tensor] = None, dx_lhs: Optional[Tensor] = None, dx_rhs: Optional[Tensor] = None,
) -> Tensor:
    """dx, plus dx_lhs @ dx_rhs ([T, J] @ [J, d]) when given, added before the result is rounded."""
    if (dx_lhs is None) != (dx_rhs is None):
        raise ValueError("sonic.moe_experts_backward_dx: dx_lhs and dx_rhs come together")
    flags = _flags(activation, interleaved, transposed, alpha, limit)
    product = None if dx_lhs is None else (dx_lhs, dx_rhs)
    return _bwd_part("dx", x, topk_ids, topk_weights, w1, w2, b1, b2, sorted_rows, expert_offsets, flags,
                     slot_token, dh=dh, product=product)


moe_experts_backward_dx_op = torch.library.custom_op(
    "sonic::moe_experts_backward_dx", _moe_experts_backward_dx, mutates_args=())


@moe_experts_backward_dx_op.register_fake
def _moe_experts_backward_dx_fake(x, *rest, slot_token=None, dx_lhs=None, dx_rhs=None):
    return torch.empty_like(x)


register_nograd("moe_experts_backward_dx", _moe_experts_backward_dx, _moe_experts_backward_dx_fake)


@planned
def _moe_experts_list_fwd(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w_gate: list[Tensor],
    w_up: list[Tensor],
    w_down: list[Tensor],
    b1: Optional[Tensor],
    b2: Optional[Tensor],
    activation: str,
    interleaved: bool,
    alpha: float,
    limit: float,
    save_h: bool,
    slot_token: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    flags = dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    banks = runs_triton(x) and list_banks(x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, **flags)
    if banks:
        return forward.triton_moe_experts_list_fwd(x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2,
                                                   banks=banks, save_h=save_h, slot_token=slot_token, **flags)
    w1, w2 = stack_expert_lists(w_gate, w_up, w_down)
    return torch_moe_experts_fwd(x, topk_ids, topk_weights, w1, w2, b1, b2, save_h=save_h, slot_token=slot_token,
                                 transposed=False, **flags)


moe_experts_list_op = torch.library.custom_op("sonic::moe_experts_list", _moe_experts_list_fwd, mutates_args=())


@moe_experts_list_op.register_fake
def _moe_experts_list_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, activation, interleaved, alpha,
                           limit, save_h, slot_token=None):
    w1_out = _list_w1_out(w_gate, w_up)
    return (
        x.new_empty(x.shape),
        x.new_empty(topk_ids.numel() if save_h else 0, w1_out),
        x.new_empty(topk_ids.numel(), dtype=torch.int32),
        x.new_empty(len(w_gate) + 1, dtype=torch.int32),
    )


register_nograd("moe_experts_list", _moe_experts_list_fwd, _moe_experts_list_fake)


@planned
def _moe_experts_list_backward(
    grad_out: Tensor,
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w_gate: list[Tensor],
    w_up: list[Tensor],
    w_down: list[Tensor],
    b1: Optional[Tensor],
    b2: Optional[Tensor],
    h: Tensor,
    sorted_rows: Tensor,
    expert_offsets: Tensor,
    activation: str,
    interleaved: bool,
    alpha: float,
    limit: float,
    slot_token: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    flags = dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    banks = runs_triton(x) and list_banks(x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, **flags)
    if banks:
        dx, dw, dw1, dw2, db1, db2 = backward.triton_moe_experts_list_bwd(
            grad_out, x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, h, sorted_rows, expert_offsets,
            banks=banks, slot_token=slot_token, **flags)
    else:
        w1, w2 = stack_expert_lists(w_gate, w_up, w_down)
        dx, dw, dw1, dw2, db1, db2 = torch_moe_experts_bwd(grad_out, x, topk_ids, topk_weights, w1, w2, b1, b2, h,
                                                           sorted_rows, expert_offsets, slot_token=slot_token,
                                                           transposed=False, **flags)
    return dx, dw, dw1, dw2, _bias_or_empty(db1, x), _bias_or_empty(db2, x)


moe_experts_list_backward_op = torch.library.custom_op(
    "sonic::moe_experts_list_backward", _moe_experts_list_backward, mutates_args=())


@moe_experts_list_backward_op.register_fake
def _moe_experts_list_backward_fake(grad_out, x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, h, sorted_rows,
                                    expert_offsets, *flags, slot_token=None):
    E, (d, n) = len(w_gate), w_down[0].shape
    w1_out = _list_w1_out(w_gate, w_up)
    return (torch.empty_like(x), torch.empty_like(topk_weights), x.new_empty(E, w1_out, d), x.new_empty(E, d, n),
            _empty_bias_grad(b1, x), _empty_bias_grad(b2, x))


register_nograd("moe_experts_list_backward", _moe_experts_list_backward, _moe_experts_list_backward_fake)


def _list_bwd_part(part: str, x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, sorted_rows, expert_offsets,
                   flags, slot_token, **tensors):
    """One part of the list form's backward (as `_bwd_part`; the weight gradients stacked, the
    weight-gradient parts giving (dw, db) pairs with db empty for an absent bias, as the stacked form's)."""
    banks = runs_triton(x) and list_banks(x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, **flags)
    if banks:
        got = backward.triton_moe_experts_list_bwd_part(
            part, x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, sorted_rows, expert_offsets, banks=banks,
            slot_token=slot_token, **tensors, **flags)
    else:
        w1, w2 = stack_expert_lists(w_gate, w_up, w_down)
        got = _reference_part(part, x, topk_ids, topk_weights, w1, w2, b1, b2, sorted_rows, expert_offsets,
                              dict(flags, transposed=False), slot_token, **tensors)
    return (got[0], _bias_or_empty(got[1], x)) if part in ("dw1", "dw2") else got


@planned
def _moe_experts_list_backward_act(
    grad_out: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: list[Tensor], w_up: list[Tensor],
    w_down: list[Tensor], b1: Optional[Tensor], b2: Optional[Tensor], h: Tensor, sorted_rows: Tensor,
    expert_offsets: Tensor, activation: str, interleaved: bool, alpha: float, limit: float,
    slot_token: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    flags = dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    return _list_bwd_part("act", x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, sorted_rows,
                          expert_offsets, flags, slot_token, grad_out=grad_out, h=h)


moe_experts_list_backward_act_op = torch.library.custom_op(
    "sonic::moe_experts_list_backward_act", _moe_experts_list_backward_act, mutates_args=())


@moe_experts_list_backward_act_op.register_fake
def _moe_experts_list_backward_act_fake(grad_out, x, topk_ids, topk_weights, w_gate, w_up, w_down, *rest,
                                        slot_token=None):
    TK, n = topk_ids.numel(), w_down[0].shape[1]
    return x.new_empty(TK, _list_w1_out(w_gate, w_up)), x.new_empty(TK, n), torch.empty_like(topk_weights)


register_nograd("moe_experts_list_backward_act", _moe_experts_list_backward_act, _moe_experts_list_backward_act_fake)


@planned
def _moe_experts_list_backward_dw2(
    grad_out: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: list[Tensor], w_up: list[Tensor],
    w_down: list[Tensor], b1: Optional[Tensor], b2: Optional[Tensor], a_scaled: Tensor, sorted_rows: Tensor,
    expert_offsets: Tensor, activation: str, interleaved: bool, alpha: float, limit: float,
    slot_token: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    flags = dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    return _list_bwd_part("dw2", x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, sorted_rows,
                          expert_offsets, flags, slot_token, grad_out=grad_out, a_scaled=a_scaled)


moe_experts_list_backward_dw2_op = torch.library.custom_op(
    "sonic::moe_experts_list_backward_dw2", _moe_experts_list_backward_dw2, mutates_args=())


@moe_experts_list_backward_dw2_op.register_fake
def _moe_experts_list_backward_dw2_fake(grad_out, x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, *rest,
                                        slot_token=None):
    return x.new_empty(len(w_down), *w_down[0].shape), _empty_bias_grad(b2, x)


register_nograd("moe_experts_list_backward_dw2", _moe_experts_list_backward_dw2, _moe_experts_list_backward_dw2_fake)


@planned
def _moe_experts_list_backward_dw1(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: list[Tensor], w_up: list[Tensor],
    w_down: list[Tensor], b1: Optional[Tensor], b2: Optional[Tensor], dh: Tensor, sorted_rows: Tensor,
    expert_offsets: Tensor, activation: str, interleaved: bool, alpha: float, limit: float,
    slot_token: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    flags = dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    return _list_bwd_part("dw1", x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, sorted_rows,
                          expert_offsets, flags, slot_token, dh=dh)


moe_experts_list_backward_dw1_op = torch.library.custom_op(
    "sonic::moe_experts_list_backward_dw1", _moe_experts_list_backward_dw1, mutates_args=())


@moe_experts_list_backward_dw1_op.register_fake
def _moe_experts_list_backward_dw1_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, *rest,
                                        slot_token=None):
    return x.new_empty(len(w_gate), _list_w1_out(w_gate, w_up), x.shape[1]), _empty_bias_grad(b1, x)


register_nograd("moe_experts_list_backward_dw1", _moe_experts_list_backward_dw1, _moe_experts_list_backward_dw1_fake)


@planned
def _moe_experts_list_backward_dx(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: list[Tensor], w_up: list[Tensor],
    w_down: list[Tensor], b1: Optional[Tensor], b2: Optional[Tensor], dh: Tensor, sorted_rows: Tensor,
    expert_offsets: Tensor, activation: str, interleaved: bool, alpha: float, limit: float,
    slot_token: Optional[Tensor] = None, dx_lhs: Optional[Tensor] = None, dx_rhs: Optional[Tensor] = None,
) -> Tensor:
    """dx, plus dx_lhs @ dx_rhs ([T, J] @ [J, d]) when given, added before the result is rounded."""
    if (dx_lhs is None) != (dx_rhs is None):
        raise ValueError("sonic.moe_experts_list_backward_dx: dx_lhs and dx_rhs come together")
    flags = dict(activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    product = None if dx_lhs is None else (dx_lhs, dx_rhs)
    return _list_bwd_part("dx", x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, sorted_rows,
                          expert_offsets, flags, slot_token, dh=dh, product=product)


moe_experts_list_backward_dx_op = torch.library.custom_op(
    "sonic::moe_experts_list_backward_dx", _moe_experts_list_backward_dx, mutates_args=())


@moe_experts_list_backward_dx_op.register_fake
def _moe_experts_list_backward_dx_fake(x, *rest, slot_token=None, dx_lhs=None, dx_rhs=None):
    return torch.empty_like(x)


register_nograd("moe_experts_list_backward_dx", _moe_experts_list_backward_dx, _moe_experts_list_backward_dx_fake)


def _list_w1_out(w_gate: list[Tensor], w_up: list[Tensor]) -> int:
    return w_gate[0].shape[0] + (w_up[0].shape[0] if w_up else 0)


def stack_expert_lists(w_gate: list[Tensor], w_up: list[Tensor], w_down: list[Tensor]) -> tuple[Tensor, Tensor]:
    """(w1 [E, w1_out, d], w2 [E, d, n]) copies of per-expert weights: the reference (CPU) path only."""
    gate_up = [torch.cat((g, u)) for g, u in zip(w_gate, w_up)] if w_up else w_gate
    return torch.stack(gate_up), torch.stack(w_down)


def _setup_list_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, activation, interleaved, alpha, limit, _, slot_token = inputs
    _, h, sorted_rows, offsets = output
    _saved_outputs_are_not_differentiable(ctx, h)
    E = len(w_gate)
    ctx.save_for_backward(x, topk_ids, topk_weights, h, sorted_rows, offsets, slot_token, b1, b2, *w_gate, *w_up,
                          *w_down)
    ctx.sizes = (E, len(w_up), w_gate[0].shape[0])
    ctx.flags = (activation, interleaved, alpha, limit)


def _list_backward(ctx, grad_out, _grad_h, _grad_rows, _grad_offsets):
    x, topk_ids, topk_weights, h, sorted_rows, offsets, slot_token, b1, b2, *weights = ctx.saved_tensors
    E, n_up, gate_rows = ctx.sizes
    w_gate, w_up, w_down = weights[:E], weights[E:E + n_up], weights[E + n_up:]
    if grad_out is None:
        grad_out = torch.zeros_like(x)
    dx, dw, dw1, dw2, db1, db2 = moe_experts_list_backward_op(
        grad_out, x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, h, sorted_rows, offsets, *ctx.flags,
        slot_token
    )
    # views of the stacked gradients, one per expert tensor (no copy)
    d_gate = list(dw1[:, :gate_rows].unbind(0))
    d_up = list(dw1[:, gate_rows:].unbind(0)) if n_up else []
    grads = (dx, None, dw, d_gate, d_up, list(dw2.unbind(0)), None if b1 is None else db1,
             None if b2 is None else db2)
    # one entry per input as the caller passed them (slot_token may have been left to its default)
    return grads + (None,) * (len(ctx.needs_input_grad) - len(grads))


moe_experts_list_op.register_autograd(_list_backward, setup_context=_setup_list_context)


# ----------------------------------------------------------------- separate stacked gate and up weights


def _expert_views(stacked: Tensor, transposed: bool) -> list[Tensor]:
    """The E per-expert [out, in] views of a stacked [E, out, in] (or, transposed, [E, in, out]) weight."""
    return [w.t() for w in stacked.unbind(0)] if transposed else list(stacked.unbind(0))


def _moe_experts_split_fwd(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor,
                           w_down: Tensor, b1: Optional[Tensor], b2: Optional[Tensor], activation: str,
                           interleaved: bool, transposed: bool, alpha: float, limit: float, save_h: bool,
                           slot_token: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    views = (_expert_views(w, transposed) for w in (w_gate, w_up, w_down))
    return _moe_experts_list_fwd(x, topk_ids, topk_weights, *views, b1, b2, activation, interleaved, alpha, limit,
                                 save_h, slot_token)


moe_experts_split_op = torch.library.custom_op("sonic::moe_experts_split", _moe_experts_split_fwd, mutates_args=())


@moe_experts_split_op.register_fake
def _moe_experts_split_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, activation, interleaved,
                            transposed, alpha, limit, save_h, slot_token=None):
    views = (_expert_views(w, transposed) for w in (w_gate, w_up, w_down))
    return _moe_experts_list_fake(x, topk_ids, topk_weights, *views, b1, b2, activation, interleaved, alpha, limit,
                                  save_h, slot_token)


register_nograd("moe_experts_split", _moe_experts_split_fwd, _moe_experts_split_fake)


def _setup_split_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, activation, interleaved, transposed, alpha, limit, _, \
        slot_token = inputs
    _, h, sorted_rows, offsets = output
    _saved_outputs_are_not_differentiable(ctx, h)
    ctx.save_for_backward(x, topk_ids, topk_weights, h, sorted_rows, offsets, slot_token, b1, b2, w_gate, w_up, w_down)
    ctx.transposed = transposed
    ctx.flags = (activation, interleaved, alpha, limit)


def _split_backward(ctx, grad_out, _grad_h, _grad_rows, _grad_offsets):
    """The list form's backward on the experts' views; each stacked weight's gradient is a view of
    the stacked gradients it returns (gate and up: the two halves of dW1), not E tensors to stack."""
    x, topk_ids, topk_weights, h, sorted_rows, offsets, slot_token, b1, b2, w_gate, w_up, w_down = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(x)
    views = [_expert_views(w, ctx.transposed) for w in (w_gate, w_up, w_down)]
    dx, dw, dw1, dw2, db1, db2 = moe_experts_list_backward_op(
        grad_out, x, topk_ids, topk_weights, *views, b1, b2, h, sorted_rows, offsets, *ctx.flags, slot_token)
    gate_rows = views[0][0].shape[0]
    d_gate, d_up = dw1[:, :gate_rows], dw1[:, gate_rows:]
    if ctx.transposed:  # the stacked weights hold [in, out] per expert
        d_gate, d_up, dw2 = (g.transpose(1, 2) for g in (d_gate, d_up, dw2))
    grads = (dx, None, dw, d_gate, d_up, dw2, None if b1 is None else db1, None if b2 is None else db2)
    return grads + (None,) * (len(ctx.needs_input_grad) - len(grads))


moe_experts_split_op.register_autograd(_split_backward, setup_context=_setup_split_context)


def validate_moe_inputs(x, topk_ids, topk_weights, w1, w2, b1=None, b2=None, *, activation, transposed,
                        slot_token=None):
    """Clear errors for shapes, dtypes and devices the op cannot take (never a wrong answer)."""
    check_activation(activation)

    def fail(msg):
        raise ValueError(f"sonic.moe_experts: {msg}")

    if x.dim() != 2:
        fail(f"x must be [T, d], got shape {tuple(x.shape)}")
    T, d = x.shape
    if slot_token is None and (topk_ids.dim() != 2 or topk_ids.shape[0] != T):
        fail(f"topk_ids must be [T={T}, K], got {tuple(topk_ids.shape)}")
    if slot_token is not None:
        if topk_ids.dim() != 1 or slot_token.shape != topk_ids.shape:
            fail(f"slot form: ids {tuple(topk_ids.shape)} and slot_token {tuple(slot_token.shape)} must be [S]")
        if slot_token.dtype.is_floating_point or slot_token.dtype == torch.bool:
            fail(f"slot_token must be an integer tensor, got {slot_token.dtype}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        fail(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        fail(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    if topk_weights.dtype not in FLOAT_DTYPES:
        fail(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if w1.dim() != 3 or w2.dim() != 3:
        fail(f"w1 and w2 must be 3-D [E, ., .], got {tuple(w1.shape)} and {tuple(w2.shape)}")
    E = w1.shape[0]
    w1_in, w1_out = (w1.shape[1], w1.shape[2]) if transposed else (w1.shape[2], w1.shape[1])
    w2_in, w2_out = (w2.shape[1], w2.shape[2]) if transposed else (w2.shape[2], w2.shape[1])
    n = w2_in
    want_w1_out = 2 * n if GATED[activation] else n
    layout = "[E, d, w1_out] / [E, n, d]" if transposed else "[E, w1_out, d] / [E, d, n]"
    if w2.shape[0] != E or w1_in != d or w2_out != d or w1_out != want_w1_out:
        fail(
            f"expert weights {tuple(w1.shape)} / {tuple(w2.shape)} do not fit layout {layout} with d={d}, "
            f"n={n}, activation {activation!r} (w1_out must be {want_w1_out})"
        )
    if x.dtype not in FLOAT_DTYPES:
        fail(f"x must be a real floating-point tensor ({', '.join(map(str, FLOAT_DTYPES))}), got {x.dtype}")
    if x.dtype != w1.dtype or x.dtype != w2.dtype:
        fail(f"x, w1, w2 must share a dtype, got {x.dtype}, {w1.dtype}, {w2.dtype}")
    for name, bias in (("b1", b1), ("b2", b2)):
        if bias is not None and bias.dtype != x.dtype:
            fail(f"{name} must have x's dtype {x.dtype}, got {bias.dtype}")
    if b1 is not None and tuple(b1.shape) != (E, w1_out):
        fail(f"b1 must be [E, w1_out] = {(E, w1_out)}, got {tuple(b1.shape)}")
    if b2 is not None and tuple(b2.shape) != (E, d):
        fail(f"b2 must be [E, d] = {(E, d)}, got {tuple(b2.shape)}")
    devices = {t.device for t in (x, topk_ids, topk_weights, w1, w2, b1, b2, slot_token) if t is not None}
    if len(devices) > 1:
        fail(f"all inputs must be on one device, got {sorted(map(str, devices))}")


def moe_experts(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w1: Tensor,
    w2: Tensor,
    b1: Tensor | None = None,
    b2: Tensor | None = None,
    *,
    activation: str = "swiglu",
    interleaved: bool = False,
    transposed: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    slot_token: Tensor | None = None,
) -> Tensor:
    """out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), fused and differentiable.

    Expert e computes act(x W1[e]^T + b1[e]) W2[e]^T + b2[e] (see `codegen.reference` for layouts).
    The result has x's dtype; the K-way combine accumulates in float32.

    With `slot_token`, the routing is in the slot form (what `codegen.round_routing` returns):
    flat [S] ids (-1: padding) and weights, and the token of each slot, nondecreasing.
    """
    validate_moe_inputs(x, topk_ids, topk_weights, w1, w2, b1, b2, activation=activation, transposed=transposed,
                        slot_token=slot_token)
    check_activation_params(activation, alpha, limit)
    save_h = needs_saved_h(x, topk_weights, w1, w2, b1, b2)
    out, _, _, _ = overload("moe_experts", save_h)(
        x, topk_ids, topk_weights, w1, w2, b1, b2, activation, interleaved, transposed, float(alpha),
        float(limit), save_h, slot_token,
    )
    return out


def _call(fn, args, kwargs=None):
    return fn(*args, **(kwargs or {}))


def drop_slots_from(topk_ids, topk_weights, E: int, *, K: int | None = None, apply=_call) -> tuple:
    """[T, K] routing in which every slot with an id >= E is dropped (expert parallelism's sentinels:
    the experts of other ranks), as the slot form `moe_experts` takes: (ids [T K] with those slots
    -1, padding; a negative id becomes -2, refused as any id out of range is), weights [T K], and
    each slot's token. Elementwise ops and a cumsum on the device, no host sync; the op computes no
    row for a dropped slot and gives its weight a zero gradient.

    `apply(fn, args, kwargs)` performs each step (default: calls it); the rewrite
    (`patterns.common.rewrite`) passes its node inserter and graph nodes, with K given, to put the
    same steps into the graph."""
    K = topk_ids.shape[1] if K is None else K
    flat = apply(torch.reshape, (topk_ids, (-1,)))
    checked = apply(torch.where, (apply(torch.lt, (flat, 0)), -2, flat))
    ids = apply(torch.where, (apply(torch.ge, (flat, E)), -1, checked))
    ones = apply(torch.ones_like, (flat,), {"dtype": torch.int32})
    position = apply(torch.sub, (apply(torch.cumsum, (ones, 0), {"dtype": torch.int32}), 1))
    slot_token = apply(torch.floor_divide, (position, K)) if K != 1 else position
    return ids, apply(torch.reshape, (topk_weights, (-1,))), slot_token


def kept_slot_ids(ids, keep, E: int, apply=_call, token_dims: bool = False):
    """[T, K] ids with E (the sentinel `drop_slots_from` drops) at each slot `keep` does not keep:
    `keep` as `patterns.common.MoEMatch.slot_keep` holds it, with values (the reference) or graph
    nodes (the rewrite, `apply` its node inserter) in place of the nodes; `token_dims`: they keep the region's
    [B, S, .] token dims, flattened here as the ids were."""
    columns = []
    for j, (kept, kind) in enumerate(keep):
        if token_dims:
            kept = apply(torch.flatten, (kept,) if kind == "token" else (kept, 0, -2))
        slot_ids = ids if len(keep) == 1 else apply(torch.narrow, (ids, 1, j, 1))
        if kind == "token":  # [T]: the token's slots
            kept = apply(torch.unsqueeze, (kept, 1))
        elif kind == "flat":  # [T * K]: the slots token by token
            kept = apply(torch.Tensor.reshape_as, (kept, ids))
        elif kind == "expert":  # [T, E]: at each slot's expert
            kept = apply(torch.gather, (kept, 1, slot_ids))
        elif len(keep) != 1:  # [T, K] given per slot: its own column
            kept = apply(torch.narrow, (kept, 1, j, 1))
        columns.append(apply(torch.ne, (kept, 0)))
    kept = columns[0] if len(columns) == 1 else apply(torch.cat, (columns, 1))
    return apply(torch.where, (kept, ids, E))


def slots_from_offsets(x, offsets, E: int, apply=_call) -> tuple:
    """Rows that arrive grouped by expert (`torch._grouped_mm`'s layout: row r belongs to expert e
    where offsets[e-1] <= r < offsets[e], with 0 before the first) as the slot form `moe_experts`
    takes, one slot per row of x: (ids [R], -1 for the rows past offsets[-1], which are padding;
    weights [R], ones in x's dtype; slot_token [R], the row itself). `offsets` is the [E] int32
    nondecreasing tensor grouped_mm takes. A searchsorted and elementwise ops on the device, no host
    sync; `apply` as in `drop_slots_from`."""
    column = apply(torch.select, (x, 1, 0))
    ones = apply(torch.ones_like, (column,), {"dtype": torch.int32})
    row = apply(torch.sub, (apply(torch.cumsum, (ones, 0), {"dtype": torch.int32}), 1))
    expert = apply(torch.searchsorted, (offsets, row), {"right": True})
    ids = apply(torch.where, (apply(torch.ge, (expert, E)), -1, expert))
    return ids, apply(torch.ones_like, (column,)), row


def validate_moe_list_inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, b1=None, b2=None, *, activation,
                             interleaved=False, slot_token=None):
    """`validate_moe_inputs` for the list form: E experts, each list of one shape, dtype and device;
    the stacked biases b1 [E, w1_out], b2 [E, d] as the stacked form checks them."""
    def fail(msg):
        raise ValueError(f"sonic.moe_experts_list: {msg}")

    E = len(w_gate)
    if E == 0 or len(w_down) != E or (w_up and len(w_up) != E):
        fail(f"need E > 0 tensors in w_gate and w_down (and w_up, if any), got {E}, {len(w_down)}, {len(w_up)}")
    for name, group in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        shapes = {tuple(w.shape) for w in group}
        if len(shapes) > 1 or any(w.dim() != 2 for w in group):
            fail(f"{name} must hold 2-D tensors of one shape, got {sorted(shapes)}")
    if w_up and not GATED.get(activation, True):
        fail(f"w_up is only for gated activations, not {activation!r}")
    if w_up and w_up[0].shape != w_gate[0].shape:
        fail(f"w_gate {tuple(w_gate[0].shape)} and w_up {tuple(w_up[0].shape)} differ in shape")
    tensors = [*w_gate, *w_up, *w_down]
    if len({w.dtype for w in tensors}) > 1 or len({w.device for w in tensors}) > 1:
        fail("expert weights must share one dtype and one device")
    # the stacked check covers the rest (shapes against d and n, dtypes, devices, routing)
    w1_out = _list_w1_out(w_gate, w_up)
    w1 = w_gate[0].new_empty(1, 1, 1).expand(E, w1_out, w_gate[0].shape[1])
    w2 = w_down[0].new_empty(1, 1, 1).expand(E, *w_down[0].shape)
    validate_moe_inputs(x, topk_ids, topk_weights, w1, w2, b1, b2, activation=activation, transposed=False,
                        slot_token=slot_token)


def moe_experts_list(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w_gate: list[Tensor],
    w_up: list[Tensor],
    w_down: list[Tensor],
    *,
    activation: str = "swiglu",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    slot_token: Tensor | None = None,
    b1: Tensor | None = None,
    b2: Tensor | None = None,
) -> Tensor:
    """`moe_experts` over per-expert nn.Linear weights, read in place (see the module docstring).

    Expert e computes act(cat(x w_gate[e]^T, x w_up[e]^T) + b1[e]) w_down[e]^T + b2[e], or
    act(x w_gate[e]^T + b1[e]) w_down[e]^T + b2[e] when `w_up` is empty; b1 [E, w1_out] and
    b2 [E, d] are optional (stacked, as `moe_experts` takes them). Gradients reach every tensor of
    the three lists and the biases.
    """
    w_gate, w_up, w_down = list(w_gate), list(w_up), list(w_down)
    validate_moe_list_inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2, activation=activation,
                             slot_token=slot_token)
    check_activation_params(activation, alpha, limit)
    save_h = needs_saved_h(x, topk_weights, b1, b2, *w_gate, *w_up, *w_down)
    out, _, _, _ = overload("moe_experts_list", save_h)(x, topk_ids, topk_weights, w_gate, w_up, w_down, b1, b2,
                                                        activation, interleaved, float(alpha), float(limit), save_h,
                                                        slot_token)
    return out


def needs_saved_h(*tensors) -> bool:
    """Keep H for the backward only when one will run: grad mode on and an input that wants a grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
