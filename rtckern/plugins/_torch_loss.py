"""torch.ops.rtckern cross-entropy, forward and backward.

    loss = torch.ops.rtckern.cross_entropy(logits, labels, ignore_index=-100, reduction="mean")   (composite)
    loss, lse, count = torch.ops.rtckern.cross_entropy_fwd(logits, labels, ignore_index, reduction)   # fp32
    dlogits = torch.ops.rtckern.cross_entropy_bwd(dloss, logits, labels, lse, count, ignore_index)

Classes are the last dimension of logits ((..., classes), labels (...)), as a language model's loss flattens them;
torch's F.cross_entropy takes them in dimension 1. reduction "mean" (over the rows whose label is not ignore_index,
NaN when there is none, as torch), "sum" or "none" (per row, fp32); the mean and the sum are taken by rtckern's
reduction kernel (fp64, a fixed order), and their backward passes the one-element gradient (and the mean's count)
to the backward kernel: no torch op on either side. cross_entropy_fwd's autograd formula calls
cross_entropy_bwd (rtckern.ops.cross_entropy_backward): it saves the logits, the labels and the lse, and no fp32
copy of the logits (the eager `F.cross_entropy(logits.float(), labels)` keeps an fp32 log-softmax). A gradient
through the lse output (a z-loss on it) is added by torch ops, an fp32 pass over the logits. Double backward is not
supported. rtckern.torch.cross_entropy is the eager fast path.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rtckern.errors import InputError

from . import _torch_ref as R
from ._torch_dispatch import run
from ._torch_lib import F32, check_float, define_composite, direct, empty_stat, kernel_op, ops_module

OPS = ("cross_entropy", "cross_entropy_fwd", "cross_entropy_bwd")
REDUCTIONS = ("mean", "sum", "none")
_LABELS = (torch.int64, torch.int32)


def _loss():
    return ops_module("loss")


def _check(logits: Tensor, labels: Tensor) -> None:
    check_float(logits, "logits")
    if labels.dtype not in _LABELS:
        raise InputError(f"labels has dtype {str(labels.dtype).replace('torch.', '')}; supported: int64, int32")
    if logits.dim() < 1 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise InputError(f"labels has shape {tuple(labels.shape)}; it must be logits' shape without the last "
                         f"(classes) dimension, {tuple(logits.shape[:-1])}")


def _jit_fwd(logits, labels, ignore_index, reduction):
    out = _loss().cross_entropy(logits, labels, ignore_index, reduction)
    return out if reduction != "none" else (*out, empty_stat(logits))


def _jit_bwd(dloss, logits, labels, lse, count, ignore_index):
    return _loss().cross_entropy_backward(dloss, logits, labels, lse, ignore_index, count)


@kernel_op("cross_entropy_fwd")
def cross_entropy_fwd(logits: Tensor, labels: Tensor, ignore_index: int,
                      reduction: str) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, lse, count), fp32 (rtckern.ops.cross_entropy): per row with reduction "none" (count an empty
    placeholder), else the 0-d mean or sum and the 0-d count of rows not ignored."""
    return run("cross_entropy", _jit_fwd, R.cross_entropy_fwd, logits, labels, ignore_index, reduction)


@cross_entropy_fwd.register_fake
def _(logits, labels, ignore_index, reduction):
    _check(logits, labels)
    _check_reduction(reduction)
    lse = logits.new_empty(labels.shape, dtype=F32)
    if reduction == "none":
        return logits.new_empty(labels.shape, dtype=F32), lse, empty_stat(logits)
    return logits.new_empty((), dtype=F32), lse, logits.new_empty((), dtype=F32)


@kernel_op("cross_entropy_bwd")
def cross_entropy_bwd(dloss: Tensor, logits: Tensor, labels: Tensor, lse: Tensor, count: Optional[Tensor],
                      ignore_index: int) -> Tensor:
    """dlogits (rtckern.ops.cross_entropy_backward): dloss per row, or one element for a sum (count None) or a mean
    (divided by count)."""
    return run("cross_entropy_backward", _jit_bwd, R.cross_entropy_bwd, dloss, logits, labels, lse, count,
               ignore_index)


@cross_entropy_bwd.register_fake
def _(dloss, logits, labels, lse, count, ignore_index):
    _check(logits, labels)
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    logits, labels, ignore_index, reduction = inputs
    ctx.save_for_backward(logits, labels, output[1], output[2] if reduction == "mean" else None)
    ctx.ignore_index = ignore_index
    ctx.set_materialize_grads(False)  # no zeros for the lse's and count's gradients, which the formula ignores


def _one_stride(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t as the kernel reads it: in the lse's dtype (fp32; fp64 only in the references' tests), with one stride over
    its elements (a broadcast value, stride 0 everywhere, included)."""
    t = t if t.dtype == dtype else t.to(dtype)
    if t.is_contiguous() or all(s == 0 for s in t.stride()):
        return t
    return t.contiguous()


def _backward(ctx, dloss, dlse, _dcount):
    logits, labels, lse, count = ctx.saved_tensors
    dx = None
    if dloss is not None:
        dx = cross_entropy_bwd(_one_stride(dloss, lse.dtype), logits, labels, lse, count, ctx.ignore_index)
    if dlse is not None:  # a loss on the lse itself (a z-loss): d lse / d logits = softmax, every row, by torch ops
        extra = torch.exp(logits.to(lse.dtype) - lse.unsqueeze(-1)) * dlse.to(lse.dtype).unsqueeze(-1)
        dx = (extra if dx is None else dx.to(lse.dtype) + extra).to(logits.dtype)
    return dx, None, None, None


cross_entropy_fwd.register_autograd(_backward, setup_context=_setup)


def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise InputError(f"reduction={reduction!r}; supported: {', '.join(REDUCTIONS)}")


def cross_entropy_direct(logits, labels, ignore_index, reduction):
    """torch.ops.rtckern.cross_entropy in plain eager code (the caller checked `direct`)."""
    _check_reduction(reduction)
    return cross_entropy_fwd.call_direct(logits, labels, ignore_index, reduction)[0]


def _cross_entropy_composite(logits, labels, ignore_index=-100, reduction="mean"):
    if direct(logits, labels):
        return cross_entropy_direct(logits, labels, ignore_index, reduction)
    _check_reduction(reduction)
    return cross_entropy_fwd(logits, labels, ignore_index, reduction)[0]


define_composite('cross_entropy(Tensor logits, Tensor labels, int ignore_index=-100, str reduction="mean") -> Tensor',
                 _cross_entropy_composite, cross_entropy_direct)
