"""The `rtckern` torch.library namespace: one fragment for the composite (decomposing) ops, shared helpers for
the custom ops' fake kernels."""
from __future__ import annotations

import functools
import importlib

import torch

from rtckern.errors import InputError

NAMESPACE = "rtckern"
# Ops defined here by schema and implemented as CompositeImplicitAutograd: they decompose (under autograd,
# torch.compile and export) into the custom ops that carry the kernels and the autograd formulas.
LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

F32 = torch.float32
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def define_composite(schema: str, fn) -> None:
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, fn, "CompositeImplicitAutograd")


def empty_stat(x: torch.Tensor) -> torch.Tensor:
    """Placeholder output for statistics not asked for: custom ops cannot return None."""
    return x.new_empty((0,), dtype=F32)


def placeholder(param, like: torch.Tensor) -> torch.Tensor:
    """Placeholder gradient output for a parameter that is absent or whose gradient was not asked for."""
    return like.new_empty((0,), dtype=param.dtype if param is not None else like.dtype)


def needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def check_float(t: torch.Tensor, name: str, allowed=FLOAT_DTYPES) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise InputError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; supported: {names}")


def check_vector(v, x: torch.Tensor, name: str) -> None:
    """A per-column parameter of a norm: shape (N,) for x of shape (..., N)."""
    if v is None:
        return
    if x.dim() == 0:
        raise InputError("x is a 0-d tensor; the norms normalize over the last dimension, so x needs at least one "
                         "dimension")
    if tuple(v.shape) != (x.shape[-1],):
        raise InputError(f"{name} has shape {tuple(v.shape)}; it must be ({x.shape[-1]},), the size of x's last "
                         f"dimension (x has shape {tuple(x.shape)})")


def check_same_shape(a: torch.Tensor, x: torch.Tensor, name: str, x_name: str = "x") -> None:
    if a.shape != x.shape:
        raise InputError(f"{name} has shape {tuple(a.shape)} but {x_name} has {tuple(x.shape)}; they must match")


@functools.cache
def ops_module(family: str):
    """The family's API module, rtckern.ops._<family>_api (its public ops and the *_impl entry points the custom
    ops call)."""
    return importlib.import_module(f"rtckern.ops._{family}_api")
