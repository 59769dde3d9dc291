"""torch.ops.rtckern softmax ops, each with its backward op and an autograd formula that calls it:

    softmax(x, scale=1.0)                                   softmax(scale * x) over the last dimension
    scaled_masked_softmax(x, mask, scale=1.0)               x (B, H, Sq, Sk); bool mask (B or 1, 1, Sq, Sk)
    scaled_upper_triang_masked_softmax(x, scale=1.0)        causal over square (..., S, S)
    scaled_aligned_causal_masked_softmax(x, scale=1.0)      causal aligned bottom-right over (..., Sq, Sk)
    <name>_bwd(y, dy, scale) -> dx                          rtckern's backward kernels

Semantics (masked keys exactly zero, fully masked rows all zero) are rtckern.ops.softmax's.
"""
from __future__ import annotations

import torch
from torch import Tensor

from rtckern.errors import InputError

from . import _torch_ref as R
from ._torch_dispatch import run
from ._torch_lib import KernelOp, check_float, check_same_shape, ops_module

_NAMES = ("softmax", "scaled_masked_softmax", "scaled_upper_triang_masked_softmax",
          "scaled_aligned_causal_masked_softmax")
OPS = _NAMES + tuple(n + "_bwd" for n in _NAMES)


def _softmax():
    return ops_module("softmax")


def _check_mask(x: Tensor, mask: Tensor) -> None:
    if x.dim() != 4:
        raise InputError(f"scaled_masked_softmax needs x of shape (B, H, Sq, Sk); got {tuple(x.shape)}")
    if mask.dtype != torch.bool:
        raise InputError(f"mask has dtype {str(mask.dtype).replace('torch.', '')}; it must be bool (True = masked "
                         "out): pass mask.bool() or mask != 0")
    b, _, sq, sk = x.shape
    if mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (sq, sk) or mask.shape[0] not in (1, b):
        raise InputError(f"mask has shape {tuple(mask.shape)}; for x of shape {tuple(x.shape)} it must be "
                         f"({b}, 1, {sq}, {sk}) or (1, 1, {sq}, {sk})")


def _check_x(name: str, x: Tensor, min_ndim: int) -> None:
    check_float(x, "x")
    if x.dim() < min_ndim:
        raise InputError(f"{name} needs x with at least {min_ndim} dims; got shape {tuple(x.shape)}")
    if name == "scaled_upper_triang_masked_softmax" and x.shape[-2] != x.shape[-1]:
        raise InputError(f"scaled_upper_triang_masked_softmax needs square score matrices (Sq == Sk), got shape "
                         f"{tuple(x.shape)}; use scaled_aligned_causal_masked_softmax for Sq != Sk")


def _define(name: str, min_ndim: int, masked: bool):
    """Register rtckern::<name> and rtckern::<name>_bwd with fake kernels and autograd; return both."""
    ref_fwd = getattr(R, name)

    def jit_fwd(*args):
        return getattr(_softmax(), name)(*args)

    def jit_bwd(y, dy, scale):
        return getattr(_softmax(), name + "_backward")(y, dy, scale)

    if masked:
        def fwd(x: Tensor, mask: Tensor, scale: float = 1.0) -> Tensor:
            return run(name, jit_fwd, ref_fwd, x, mask, scale)

        def fake(x, mask, scale=1.0):
            check_float(x, "x")
            _check_mask(x, mask)
            return x.new_empty(x.shape)
    else:
        def fwd(x: Tensor, scale: float = 1.0) -> Tensor:
            return run(name, jit_fwd, ref_fwd, x, scale)

        def fake(x, scale=1.0):
            _check_x(name, x, min_ndim)
            return x.new_empty(x.shape)

    fwd.__doc__ = f"rtckern.ops.softmax.{name} as a torch op."
    fwd_op = KernelOp(name, fwd)
    fwd_op.register_fake(fake)

    def bwd(y: Tensor, dy: Tensor, scale: float) -> Tensor:
        return run(name + "_backward", jit_bwd, R.softmax_bwd, y, dy, scale)

    def bwd_fake(y, dy, scale):
        check_same_shape(dy, y, "dy", "y")
        return y.new_empty(y.shape)

    bwd.__doc__ = f"rtckern.ops.softmax.{name}_backward as a torch op: dx from y and dy."
    bwd_op = KernelOp(name + "_bwd", bwd)
    bwd_op.register_fake(bwd_fake)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.scale = inputs[-1]

    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        dx = bwd_op(y, dy.contiguous(), ctx.scale)
        return (dx, None, None) if masked else (dx, None)

    fwd_op.register_autograd(backward, setup_context=setup)
    return fwd_op, bwd_op


softmax, softmax_bwd = _define("softmax", 1, False)
scaled_masked_softmax, scaled_masked_softmax_bwd = _define("scaled_masked_softmax", 4, True)
scaled_upper_triang_masked_softmax, scaled_upper_triang_masked_softmax_bwd = \
    _define("scaled_upper_triang_masked_softmax", 2, False)
scaled_aligned_causal_masked_softmax, scaled_aligned_causal_masked_softmax_bwd = \
    _define("scaled_aligned_causal_masked_softmax", 2, False)
