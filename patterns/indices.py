"""Which integer tensors a call reads as indices, and a proof that they are in range before the
call runs on a GPU.

An out-of-range index is an error on the CPU and a device-side assert on CUDA, which ends the
process's use of the GPU. `verify` evaluates a large guessed region on the GPU only where every
index its GPU part reads was computed on the CPU and is checked here first, against the size of
the dim it indexes (one that is not raises IndexError, as the CPU would). A call that reads an integer tensor in a way this module does not know (an
index into an op it has no rule for) raises `Unprovable`: the region is then not evaluated there.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .common import is_call


class Unprovable(RuntimeError):
    """An integer tensor read where its range cannot be checked before a GPU kernel reads it."""


# ops that read an integer or bool tensor as values (never as an address)
_AS_VALUES = ("mul", "__mul__", "__rmul__", "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "div",
              "__truediv__", "truediv", "true_divide", "where", "masked_fill", "eq", "ne", "lt", "le", "gt", "ge",
              "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "logical_and", "logical_or", "logical_not",
              "__and__", "__or__", "__invert__", "to", "float", "double", "half", "bfloat16", "long", "int", "bool",
              "type_as", "view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "flatten", "permute",
              "transpose", "contiguous", "clone", "sum", "cat", "stack", "size", "dim", "numel")
# (self, dim, index) positions, in the method and the function form alike
_ALONG_DIM = ("index_select", "gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
              "scatter_reduce_", "index_add", "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_",
              "index_reduce", "index_reduce_")
_SUBSCRIPTS = ("getitem", "setitem", "__getitem__", "__setitem__", "index_put", "index_put_")


def check(node: fx.Node, args: tuple, kwargs: dict) -> None:
    """Raise `Unprovable` unless every integer tensor `node`'s call reads (`args`, `kwargs`: its
    values) is read as values, or is an index on the CPU within the dim it indexes."""
    integers = [t for t in _tensors((args, kwargs)) if not t.is_floating_point()]
    if not integers:
        return
    if is_call(node, *_SUBSCRIPTS) or (node.op == "call_function" and node.target in (operator.getitem,
                                                                                       operator.setitem)):
        if not isinstance(args[0], torch.Tensor):
            return  # a selection from a list or a tuple
        indices = args[1] if len(args) > 1 else kwargs.get("indices")
        _check_subscript(args[0], indices if isinstance(indices, (tuple, list)) else (indices,))
        return
    if is_call(node, *_ALONG_DIM):
        self, dim, index = (_arg(args, kwargs, i, name) for i, name in enumerate(("input", "dim", "index")))
        _in_range(index, 0, self.shape[dim] if self.dim() else 1, f"{node.target}'s index")
        return
    if is_call(node, "take_along_dim"):
        self, index, dim = (_arg(args, kwargs, i, name) for i, name in enumerate(("input", "indices", "dim")))
        _in_range(index, 0, self.numel() if dim is None else self.shape[dim], "take_along_dim's indices")
        return
    if is_call(node, "embedding"):
        index, weight = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
        _in_range(index, 0, weight.shape[0], "embedding's indices")
        return
    if is_call(node, *_AS_VALUES):
        return
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
    raise Unprovable(f"{name} reads an integer tensor as this check does not know")


def _check_subscript(tensor: torch.Tensor, indices) -> None:
    """`tensor[indices]` (read or written): each integer tensor index within the dim it indexes;
    bool masks are checked against the shape by torch itself, before any kernel runs."""
    entries = list(indices)
    if any(e is Ellipsis for e in entries):
        at = entries.index(Ellipsis)
        used = sum(_dims_used(e) for e in entries if e is not Ellipsis)
        entries[at:at + 1] = [slice(None)] * (tensor.dim() - used)
    dim = 0
    for entry in entries:
        if isinstance(entry, torch.Tensor) and not entry.is_floating_point() and entry.dtype != torch.bool:
            if dim >= tensor.dim():
                raise Unprovable("an index past the tensor's dims")
            _in_range(entry, -tensor.shape[dim], tensor.shape[dim], "a subscript")
        dim += _dims_used(entry)


def _dims_used(entry) -> int:
    if entry is None:
        return 0
    if isinstance(entry, torch.Tensor) and entry.dtype == torch.bool:
        return max(entry.dim(), 1)
    return 1


def _in_range(index, low: int, high: int, what: str) -> None:
    if not isinstance(index, torch.Tensor):
        raise Unprovable(f"{what} is not a tensor")
    if index.device.type != "cpu":
        raise Unprovable(f"{what} is computed on the GPU from the hidden states, not from the routing alone")
    if index.numel() and (int(index.min()) < low or int(index.max()) >= high):  # as the CPU would say
        raise IndexError(f"{what} holds values outside [{low}, {high})")


def _arg(args: tuple, kwargs: dict, position: int, name: str):
    if len(args) > position:
        return args[position]
    if name in kwargs:
        return kwargs[name]
    return {"indices": None, "dim": None}.get(name)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)
