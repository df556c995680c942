"""`sonic::<op>.nograd`: an op's forward with no autograd formula, for calls no gradient can reach.

A `torch.library.custom_op` answers every call through two Python layers before its implementation:
its autograd layer (which, under no_grad, redispatches below itself) and a wrapper that checks the
outputs' aliasing and keeps Dynamo out of the implementation's frames. With a dozen arguments that
costs ~35 us a call on a CPU host (~70 us on the hosts of H100 machines), which at a few tokens is
a large part of a decode step.

The `nograd` overload has the default overload's schema, implementation and fake, registered as a
CompositeExplicitAutograd kernel: the Autograd key goes to PyTorch's C++ fallback, and the call
reaches the implementation in one Python call. The rewrite picks it where the region's traced
result needs no gradient (`patterns.common._grad_flows`; Dynamo guards the grad mode and the
inputs' requires_grad it traced under), the eager wrappers where grad mode is off or no input wants
one. Called where a gradient is wanted anyway, it raises. Without custom_op's wrapper nothing keeps
Dynamo out of the implementation's frames; none needs to: a compiled graph runs with Dynamo
disabled, and Dynamo traces a call of the op as one node.

Overload resolution of `torch.ops.sonic.<op>(...)` (the packet) tries `default` first, so a call
through the packet keeps its gradient.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

_LIB = torch.library.Library("sonic", "FRAGMENT")
USE_NOGRAD = True  # False: `overload` answers `default` for every call (benchmarks' A/B; read when a call is made)


def _wants_grad(args) -> bool:
    if not torch.is_grad_enabled():
        return False
    for a in args:
        if isinstance(a, Tensor):
            if a.requires_grad:
                return True
        elif isinstance(a, (list, tuple)) and any(isinstance(t, Tensor) and t.requires_grad for t in a):
            return True
    return False


def register_nograd(name: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Define `sonic::<name>.nograd` with `sonic::<name>.default`'s schema, `impl` and `fake`."""
    schema = str(getattr(torch.ops.sonic, name).default._schema)
    prefix = f"sonic::{name}("
    if not schema.startswith(prefix):
        raise RuntimeError(f"unexpected schema for sonic::{name}: {schema}")
    _LIB.define(f"{name}.nograd(" + schema[len(prefix):])

    def nograd_impl(*args, **kwargs):
        if _wants_grad(args) or _wants_grad(kwargs.values()):
            raise RuntimeError(
                f"sonic::{name}.nograd has no gradient, and this call wants one (grad mode is on and an input "
                f"requires grad): call sonic::{name}.default"
            )
        return impl(*args, **kwargs)

    _LIB.impl(f"{name}.nograd", nograd_impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"sonic::{name}.nograd", fake, lib=_LIB)
    return getattr(torch.ops.sonic, name).nograd


def overload(name: str, wants_grad: bool) -> torch._ops.OpOverload:
    """The overload of `sonic::<name>` for a call that does (default) or does not (nograd) want a gradient."""
    packet = getattr(torch.ops.sonic, name)
    return packet.default if wants_grad or not USE_NOGRAD else packet.nograd
