"""torch.ops.rtckern SwiGLU, forward and backward.

    y = torch.ops.rtckern.swiglu(gate, up)                  # silu(gate) * up: a Llama-style MLP's activation
    dgate, dup = torch.ops.rtckern.swiglu_bwd(dy, gate, up)

swiglu's autograd formula calls swiglu_bwd (rtckern.ops.swiglu_backward); it saves gate and up (the eager
`act_fn(gate) * up` saves three tensors). Double backward is not supported. rtckern.torch.swiglu is the eager fast
path (the op's implementation without the dispatcher).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _torch_ref as R
from ._torch_dispatch import run
from ._torch_lib import check_float, check_same_shape, kernel_op, ops_module

OPS = ("swiglu", "swiglu_bwd")


def _glu():
    return ops_module("glu")


def _jit_fwd(gate, up):
    return _glu().swiglu(gate, up)


def _jit_bwd(dy, gate, up):
    return _glu().swiglu_backward(dy, gate, up)


@kernel_op("swiglu")
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up (rtckern.ops.swiglu)."""
    return run("swiglu", _jit_fwd, R.swiglu, gate, up)


@kernel_op("swiglu_bwd")
def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(dgate, dup) (rtckern.ops.swiglu_backward)."""
    return run("swiglu_backward", _jit_bwd, R.swiglu_bwd, dy, gate, up)


@swiglu.register_fake
def _(gate, up):
    check_float(gate, "gate")
    check_same_shape(up, gate, "up", "gate")
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@swiglu_bwd.register_fake
def _(dy, gate, up):
    check_float(gate, "gate")
    check_same_shape(up, gate, "up", "gate")
    check_same_shape(dy, gate, "dy", "gate")
    fmt = torch.contiguous_format
    return torch.empty_like(gate, memory_format=fmt), torch.empty_like(up, memory_format=fmt)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    # the kernel reads rows that do not overlap; autograd may hand over expanded gradients (a loss summing y over a
    # leading dimension gives row stride 0): contiguous() copies those and returns a contiguous dy as it is
    return swiglu_bwd(dy.contiguous(), gate, up)


swiglu.register_autograd(_backward, setup_context=_setup)


def swiglu_direct(gate, up):
    """torch.ops.rtckern.swiglu in plain eager code (the caller checked `direct`)."""
    return swiglu.call_direct(gate, up)
