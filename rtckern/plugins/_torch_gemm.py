"""torch.ops.rtckern.gemm(a, b, bias=None, activation=None, trans_b=False, out_dtype=None, residual=None), and the
grouped GEMMs torch.ops.rtckern.grouped_gemm(a, b, group_offsets, out_dtype=None, trans_b=True) /
grouped_gemm_masked(a, b, masked_m, out_dtype=None, trans_b=True).

y = act(a @ op(b) + bias) + residual with rtckern.ops.gemm's layouts and dtypes. Autograd: every gradient is
computed with rtckern's GEMM (there is no separate backward kernel; a GEMM's backward is two GEMMs):
- dZ = dY * act'(Z), Z recomputed by a GEMM with the bias and an fp32 output (no activation); dZ = dY without
  an activation. dZ is cast to a's dtype (fp16/bf16), as torch's own fp16/bf16 matmul backward does;
- da = dZ @ op(b)^T: one GEMM reading b in place (trans_b flipped);
- db = a^T @ dZ (or dZ^T @ a with trans_b): one GEMM whose A operand is a transposed copy (the GEMM reads A
  row-major only); a 2-D b shared across a's batch gets the batch folded into the reduction;
- dbias = sum of dZ over rows (fp32), dresidual = dY (summed over the batch when the residual was shared).

The grouped GEMMs (rtckern.ops.grouped_gemm / grouped_gemm_masked) are inference ops without autograd (b's gradient
is a per-group reduction over each group's rows, which no rtckern kernel computes). Fake kernels give y contiguous:
(total_m, N), or (G, capacity, N) for the masked form. Their torch references (the no-candidate fallback and
reference_mode) read the group index on the host, which synchronizes; the kernels never do.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rtckern.errors import InputError

from . import _torch_ref as R
from ._torch_dispatch import run
from ._torch_lib import kernel_op, ops_module

OPS = ("gemm", "grouped_gemm", "grouped_gemm_masked")
_ACTS = (None, "none", "gelu_tanh", "silu")


def _jit(a, b, bias, activation, trans_b, out_dtype, residual):
    return ops_module("gemm").gemm(a, b, bias=bias, activation=activation, trans_b=trans_b, out_dtype=out_dtype,
                                   residual=residual)


def _out_shape(a: Tensor, b: Tensor, trans_b: bool) -> tuple[int, ...]:
    if a.dim() not in (2, 3):
        raise InputError(f"a has shape {tuple(a.shape)}; expected (M, K) or (batch, M, K)")
    if b.dim() not in (2, 3):
        raise InputError(f"b has shape {tuple(b.shape)}; expected (K, N), (N, K) with trans_b=True, or with a "
                         "leading batch dimension")
    if b.dim() == 3 and a.dim() == 2:
        raise InputError(f"b is batched {tuple(b.shape)} but a is not {tuple(a.shape)}: give a a batch dimension")
    k = a.shape[-1]
    n, kb = (b.shape[-2], b.shape[-1]) if trans_b else (b.shape[-1], b.shape[-2])
    if k != kb:
        layout = "(N, K) since trans_b=True" if trans_b else "(K, N) since trans_b=False"
        raise InputError(f"inner dimensions disagree: a {tuple(a.shape)} has K={k}, b {tuple(b.shape)} is read as "
                         f"{layout}, so K={kb}. For an nn.Linear weight of shape (out, in), pass trans_b=True")
    return (a.shape[0], a.shape[1], n) if a.dim() == 3 else (a.shape[0], n)


@kernel_op("gemm")
def gemm(a: Tensor, b: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None,
         trans_b: bool = False, out_dtype: Optional[torch.dtype] = None, residual: Optional[Tensor] = None) -> Tensor:
    """rtckern.ops.gemm as a torch op."""
    return run("gemm", _jit, R.gemm, a, b, bias, activation, trans_b, out_dtype, residual)


@gemm.register_fake
def _(a, b, bias=None, activation=None, trans_b=False, out_dtype=None, residual=None):
    if a.dtype not in (torch.float16, torch.bfloat16) or b.dtype != a.dtype:
        raise InputError(f"a is {str(a.dtype).replace('torch.', '')} and b is {str(b.dtype).replace('torch.', '')}; "
                         "both must be float16 or both bfloat16")
    if activation not in _ACTS:
        raise InputError(f"activation={activation!r} is not supported; supported: None, 'gelu_tanh', 'silu'")
    return a.new_empty(_out_shape(a, b, trans_b), dtype=out_dtype or a.dtype)


# ---- autograd ---------------------------------------------------------------------------------------------------
def _setup(ctx, inputs, output):
    a, b, bias, activation, trans_b, out_dtype, residual = inputs
    ctx.save_for_backward(a, b, bias)
    ctx.act = None if activation in (None, "none") else activation
    ctx.trans_b = trans_b
    ctx.residual_shape = None if residual is None else tuple(residual.shape)


def _grad_b(a: Tensor, dz: Tensor, b: Tensor, trans_b: bool) -> Tensor:
    """db for y = a @ op(b): a^T dZ, or (dZ^T a) for trans_b; the transposed operand is copied contiguous."""
    shared = b.dim() == 2 or (b.shape[0] == 1 and a.shape[0] != 1)
    if shared:  # one b for the whole batch: fold the batch into the reduction dimension
        a2, dz2 = a.reshape(-1, a.shape[-1]), dz.reshape(-1, dz.shape[-1])
        g = gemm(dz2.t().contiguous(), a2) if trans_b else gemm(a2.t().contiguous(), dz2)
        return g if b.dim() == 2 else g.unsqueeze(0)
    if trans_b:
        return gemm(dz.transpose(-1, -2).contiguous(), a)
    return gemm(a.transpose(-1, -2).contiguous(), dz)


def _backward(ctx, dy):
    a, b, bias = ctx.saved_tensors
    # needs_input_grad covers the arguments the call passed (defaults left out are not listed)
    need = tuple(ctx.needs_input_grad) + (False,) * 7
    need_a, need_b, need_bias, need_res = need[0], need[1], need[2], need[6]
    if ctx.act is not None:
        z = gemm(a, b, bias, None, ctx.trans_b, torch.float32, None)
        dz = (dy.float() * R.activation_grad(z, ctx.act)).to(a.dtype)
    else:
        dz = dy.to(a.dtype)
    dz = dz.contiguous()
    empty = dz.numel() == 0 or a.shape[-1] == 0
    da = db = dbias = dres = None
    if need_a:
        da = torch.zeros_like(a) if empty else gemm(dz, b, None, None, not ctx.trans_b, None, None)
    if need_b:
        db = torch.zeros_like(b) if empty else _grad_b(a, dz, b, ctx.trans_b)
    if need_bias and bias is not None:
        dbias = dz.float().reshape(-1, dz.shape[-1]).sum(0).to(bias.dtype)
    if need_res and ctx.residual_shape is not None:
        dres = dy if tuple(dy.shape) == ctx.residual_shape else dy.sum(0)
    return da, db, dbias, None, None, None, dres


gemm.register_autograd(_backward, setup_context=_setup)


# ---- grouped GEMM (no autograd) -----------------------------------------------------------------------------------
def _grouped_out_shape(a: Tensor, b: Tensor, index: Tensor, trans_b: bool, masked: bool) -> tuple[int, ...]:
    op = "grouped_gemm_masked" if masked else "grouped_gemm"
    if a.dtype not in (torch.float16, torch.bfloat16) or b.dtype != a.dtype:
        raise InputError(f"a is {str(a.dtype).replace('torch.', '')} and b is {str(b.dtype).replace('torch.', '')}; "
                         "both must be float16 or both bfloat16")
    if a.dim() != (3 if masked else 2) or b.dim() != 3:
        want = "(G, capacity, K)" if masked else "(total_m, K)"
        raise InputError(f"a has shape {tuple(a.shape)} and b {tuple(b.shape)}; {op} takes a {want} and b (G, N, K) "
                         "with trans_b=True or (G, K, N) with trans_b=False")
    groups, k = b.shape[0], a.shape[-1]
    n, kb = (b.shape[1], b.shape[2]) if trans_b else (b.shape[2], b.shape[1])
    if k != kb:
        raise InputError(f"inner dimensions disagree: a {tuple(a.shape)} has K={k}, b {tuple(b.shape)} has K={kb}")
    length, name = (groups, "masked_m") if masked else (groups + 1, "group_offsets")
    if index.dtype != torch.int32 or tuple(index.shape) != (length,):
        raise InputError(f"{name} is {str(index.dtype).replace('torch.', '')} of shape {tuple(index.shape)}; expected "
                         f"int32 ({length},)")
    return (groups, a.shape[1], n) if masked else (a.shape[0], n)


def _jit_grouped(a, b, group_offsets, out_dtype, trans_b):
    return ops_module("gemm").grouped_gemm(a, b, group_offsets, out_dtype=out_dtype, trans_b=trans_b)


def _jit_grouped_masked(a, b, masked_m, out_dtype, trans_b):
    return ops_module("gemm").grouped_gemm_masked(a, b, masked_m, out_dtype=out_dtype, trans_b=trans_b)


def _ref_grouped_masked(a, b, masked_m, out_dtype, trans_b):
    return R.grouped_gemm(a, b, masked_m, out_dtype, trans_b, masked=True)


@kernel_op("grouped_gemm")
def grouped_gemm(a: Tensor, b: Tensor, group_offsets: Tensor, out_dtype: Optional[torch.dtype] = None,
                 trans_b: bool = True) -> Tensor:
    """rtckern.ops.grouped_gemm as a torch op."""
    return run("grouped_gemm", _jit_grouped, R.grouped_gemm, a, b, group_offsets, out_dtype, trans_b)


@grouped_gemm.register_fake
def _(a, b, group_offsets, out_dtype=None, trans_b=True):
    return a.new_empty(_grouped_out_shape(a, b, group_offsets, trans_b, False), dtype=out_dtype or a.dtype)


@kernel_op("grouped_gemm_masked")
def grouped_gemm_masked(a: Tensor, b: Tensor, masked_m: Tensor, out_dtype: Optional[torch.dtype] = None,
                        trans_b: bool = True) -> Tensor:
    """rtckern.ops.grouped_gemm_masked as a torch op."""
    return run("grouped_gemm_masked", _jit_grouped_masked, _ref_grouped_masked, a, b, masked_m, out_dtype, trans_b)


@grouped_gemm_masked.register_fake
def _(a, b, masked_m, out_dtype=None, trans_b=True):
    return a.new_empty(_grouped_out_shape(a, b, masked_m, trans_b, True), dtype=out_dtype or a.dtype)
