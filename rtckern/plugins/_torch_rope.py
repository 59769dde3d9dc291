"""torch.ops.rtckern rotary position embedding, forward and backward.

    q_embed, k_embed = torch.ops.rtckern.rope(q, k, cos, sin, unsqueeze_dim)   # transformers' apply_rotary_pos_emb
    dq, dk = torch.ops.rtckern.rope_bwd(dq_embed, dk_embed, cos, sin, unsqueeze_dim)

rope's autograd formula calls rope_bwd (rtckern.ops.rope_backward). cos and sin are constants to the kernels; when
one of them requires a gradient (they do not in transformers, which builds them under no_grad) the formula adds their
gradients with torch ops. Double backward is not supported. rtckern.torch.apply_rotary_pos_emb is the eager fast
path (the op's implementation without the dispatcher).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _torch_ref as R
from ._torch_dispatch import run
from ._torch_lib import FLOAT_DTYPES, check_float, kernel_op, ops_module

OPS = ("rope", "rope_bwd")


def _rope():
    return ops_module("rope")


def _jit_fwd(q, k, cos, sin, unsqueeze_dim):
    return _rope().rope(q, k, cos, sin, unsqueeze_dim)


def _jit_bwd(dq, dk, cos, sin, unsqueeze_dim):
    return _rope().rope_backward(dq, dk, cos, sin, unsqueeze_dim)


def _ref_fwd(q, k, cos, sin, unsqueeze_dim):
    return R.rope(q, k, cos, sin, unsqueeze_dim)


def _ref_bwd(dq, dk, cos, sin, unsqueeze_dim):
    return R.rope(dq, dk, cos, sin, unsqueeze_dim, backward=True)


@kernel_op("rope")
def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int) -> tuple[Tensor, Tensor]:
    """(q_embed, k_embed) (rtckern.ops.rope)."""
    return run("rope", _jit_fwd, _ref_fwd, q, k, cos, sin, unsqueeze_dim)


@kernel_op("rope_bwd")
def rope_bwd(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int) -> tuple[Tensor, Tensor]:
    """(dq, dk) (rtckern.ops.rope_backward)."""
    return run("rope_backward", _jit_bwd, _ref_bwd, dq, dk, cos, sin, unsqueeze_dim)


def _fake(q, k, cos, sin, unsqueeze_dim):
    check_float(q, "q")
    check_float(k, "k")
    check_float(cos, "cos", FLOAT_DTYPES)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"rope takes 4-D q and k; got {tuple(q.shape)} and {tuple(k.shape)}")
    return torch.empty_like(q), torch.empty_like(k)


rope.register_fake(_fake)
rope_bwd.register_fake(_fake)


def _setup(ctx, inputs, output):
    q, k, cos, sin, unsqueeze_dim = inputs
    ctx.unsqueeze_dim = unsqueeze_dim
    tables = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(cos, sin, *((q, k) if tables else ()))


def _dense_rows(g):
    """A gradient the kernel can read: head_dim contiguous (autograd may hand over expanded or strided ones)."""
    return g if g.stride(-1) == 1 or g.shape[-1] == 1 else g.contiguous()


def _backward(ctx, gq, gk):
    cos, sin, *qk = ctx.saved_tensors
    dq, dk = rope_bwd(_dense_rows(gq), _dense_rows(gk), cos, sin, ctx.unsqueeze_dim)
    dcos = dsin = None
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        dcos, dsin = R.rope_table_grads(gq, gk, qk[0], qk[1], cos, sin, ctx.unsqueeze_dim)
    return dq, dk, dcos, dsin, None


rope.register_autograd(_backward, setup_context=_setup)


def rope_direct(q, k, cos, sin, unsqueeze_dim):
    """torch.ops.rtckern.rope in plain eager code (the caller checked `direct`)."""
    return rope.call_direct(q, k, cos, sin, unsqueeze_dim)
