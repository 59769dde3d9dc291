"""torch.ops.rtckern fp8 ops: the GEMM, the grouped GEMMs, the quantizer and the fused RMSNorm + quantization producer.

    y = torch.ops.rtckern.gemm_fp8(a, b, a_scale, b_scale, out_dtype=None, bias=None, trans_b=True)
    y = torch.ops.rtckern.grouped_gemm_fp8(a, b, a_scale, b_scale, group_offsets, out_dtype=None, trans_b=True)
    y = torch.ops.rtckern.grouped_gemm_fp8_masked(a, b, a_scale, b_scale, masked_m, out_dtype=None, trans_b=True)
    q, scales = torch.ops.rtckern.quantize_fp8(x, group=128, scale_format="row")
    q, scales = torch.ops.rtckern.rms_norm_quant(x, weight=None, eps=1e-6, group=128, scale_format="row",
                                                 zero_centered=False)

rtckern.ops.gemm_fp8 / grouped_gemm_fp8(_masked) / quantize_fp8 / rms_norm_quant as kernel ops (_torch_lib.KernelOp):
out_dtype None is bfloat16. The fake kernels give exactly what the kernels return: y (M, N) contiguous (grouped:
(total_m, N), masked (G, capacity, N)); q with x's shape, contiguous,
float8_e4m3fn; scales (M, K / group) fp32, row-major for "row", column-major with M padded to a multiple of 4 for
"col_tma" (strides (1, ceil(M / 4) * 4)); for rms_norm_quant M is the number of rows of x (x.numel() / N). No
autograd (inference ops: fp8 tensors carry no gradient). CPU tensors are refused by the kernels as every rtckern
op refuses them; the torch references (_torch_ref.gemm_fp8 / quantize_fp8 / rms_norm_quant: dequantize and matmul
in fp32; amax / 448 and a saturating cast; the grouped references group by group, reading the group index on the host)
serve reference_mode and the no-candidate fallback.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rtckern.errors import InputError

from . import _torch_ref as R
from ._torch_dispatch import run
from ._torch_lib import F32, FLOAT_DTYPES, check_float, check_vector, kernel_op, ops_module

OPS = ("gemm_fp8", "grouped_gemm_fp8", "grouped_gemm_fp8_masked", "quantize_fp8", "rms_norm_quant")
E4M3 = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GROUPS = (32, 64, 128, 256)
SCALE_FORMATS = ("row", "col_tma")
K_MULTIPLE = 16


def _name(dt) -> str:
    return str(dt).replace("torch.", "")


# ---- checks the fake kernels share (the kernels' own checks say the same) --------------------------------------
def _scale_kind(s: Tensor, rows, name: str) -> str:
    if s.dtype != F32:
        raise InputError(f"{name} is {_name(s.dtype)}; scales must be float32")
    if s.numel() == 1 and s.dim() <= 2:
        return "tensor"
    if s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1):
        return "channel" if s.shape[0] == rows else "bad"
    return "block" if s.dim() == 2 else "bad"


def _gemm_fp8_out(a, b, a_scale, b_scale, out_dtype, bias, trans_b) -> tuple:
    if not trans_b:
        raise InputError("gemm_fp8 takes b as (N, K) with K contiguous (trans_b=True) only: 8-bit tensor-core MMAs "
                         "read both operands K-major. For a (K, N) weight w pass w.t().contiguous() (once, offline)")
    if a.dim() != 2 or b.dim() != 2:
        raise InputError(f"a has shape {tuple(a.shape)} and b {tuple(b.shape)}; gemm_fp8 takes a (M, K) and b (N, K)")
    for t, name, allowed in ((a, "a", (E4M3, torch.float8_e5m2)), (b, "b", (E4M3,))):
        if t.dtype not in allowed:
            raise InputError(f"{name} is {_name(t.dtype)}; gemm_fp8 takes a float8_e4m3fn (or float8_e5m2: "
                             "gradients) and b float8_e4m3fn (quantize with rtckern.ops.quantize_fp8 or "
                             "x.to(torch.float8_e4m3fn))")
    m, k = a.shape
    n, kb = b.shape
    if k != kb:
        raise InputError(f"inner dimensions disagree: a {tuple(a.shape)} has K={k}, b {tuple(b.shape)} (N, K) has "
                         f"K={kb}")
    if k % K_MULTIPLE != 0:
        raise InputError(f"K={k} is not supported: gemm_fp8 needs K a positive multiple of {K_MULTIPLE} (16-byte "
                         "rows); pad K with zeros (in a and b) to the next multiple of 16")
    out = out_dtype or torch.bfloat16
    if out not in OUT_DTYPES:
        raise InputError(f"out_dtype={_name(out)} is not supported; supported: bfloat16, float16, float32")
    ka, kbs = _scale_kind(a_scale, m, "a_scale"), _scale_kind(b_scale, n, "b_scale")
    kblocks, nblocks = (k + 127) // 128, (n + 127) // 128
    # the kernel's reading (ops/_fp8/api.py scale_layout): per tensor / channel, else the block shapes themselves,
    # whatever the shapes look like (at K <= 128 the block scales have one column: (M, 1) and (ceil(N/128), 1))
    ok = (ka in ("tensor", "channel") and kbs in ("tensor", "channel")) or \
        (tuple(a_scale.shape) == (m, kblocks) and tuple(b_scale.shape) == (nblocks, kblocks))
    if not ok:
        raise InputError(
            f"a_scale has shape {tuple(a_scale.shape)} and b_scale {tuple(b_scale.shape)} for M={m}, N={n}, K={k}; "
            f"supported: per tensor (one element each), per channel (a_scale ({m},) or ({m}, 1), b_scale ({n},) or "
            f"({n}, 1); either may be per tensor), or blocks (a_scale ({m}, {kblocks}): 1x128 groups, b_scale "
            f"({nblocks}, {kblocks}): 128x128 blocks)")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype not in OUT_DTYPES):
        raise InputError(f"bias has shape {tuple(bias.shape)}, dtype {_name(bias.dtype)}; expected a contiguous "
                         f"({n},) array of bf16, fp16 or fp32")
    return (m, n), out


def _check_quant(x: Tensor, group: int, scale_format: str, op: str, dims: str) -> None:
    if scale_format not in SCALE_FORMATS:
        raise InputError(f"scale_format={scale_format!r} is not supported; pass 'row' ((M, K/group) row-major) or "
                         "'col_tma' (column-major, M padded to 4: the layout gemm_fp8's block scales read fastest)")
    if group not in GROUPS:
        raise InputError(f"group={group!r} is not supported; supported: {', '.join(map(str, GROUPS))}")
    check_float(x, "x", FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] % group != 0:
        raise InputError(f"x has shape {tuple(x.shape)}: {dims} must be a multiple of group={group}; pick a group "
                         "that divides it")


def _fake_scales(x: Tensor, m, groups: int, scale_format: str) -> Tensor:
    if scale_format == "row":
        return x.new_empty((m, groups), dtype=F32)
    mp = (m + 3) // 4 * 4
    return x.new_empty_strided((m, groups), (1, mp), dtype=F32)


# ---- gemm_fp8 -----------------------------------------------------------------------------------------------------
def _jit_gemm(a, b, a_scale, b_scale, out_dtype, bias, trans_b):
    return ops_module("fp8").gemm_fp8(a, b, a_scale, b_scale, out_dtype=out_dtype or torch.bfloat16, bias=bias,
                                      trans_b=trans_b)


@kernel_op("gemm_fp8")
def gemm_fp8(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, out_dtype: Optional[torch.dtype] = None,
             bias: Optional[Tensor] = None, trans_b: bool = True) -> Tensor:
    """rtckern.ops.gemm_fp8 as a torch op (out_dtype None: bfloat16)."""
    return run("gemm_fp8", _jit_gemm, R.gemm_fp8, a, b, a_scale, b_scale, out_dtype, bias, trans_b)


@gemm_fp8.register_fake
def _(a, b, a_scale, b_scale, out_dtype=None, bias=None, trans_b=True):
    shape, out = _gemm_fp8_out(a, b, a_scale, b_scale, out_dtype, bias, trans_b)
    return a.new_empty(shape, dtype=out)


# ---- grouped_gemm_fp8 -------------------------------------------------------------------------------------------
def _grouped_fp8_out(a, b, a_scale, b_scale, index, out_dtype, trans_b, masked: bool) -> tuple:
    op = "grouped_gemm_fp8_masked" if masked else "grouped_gemm_fp8"
    if not trans_b:
        raise InputError(f"{op} takes b as (G, N, K) with K contiguous (trans_b=True) only: 8-bit tensor-core MMAs "
                         "read both operands K-major")
    if a.dim() != (3 if masked else 2) or b.dim() != 3:
        want = "(G, capacity, K)" if masked else "(total_m, K)"
        raise InputError(f"a has shape {tuple(a.shape)} and b {tuple(b.shape)}; {op} takes a {want} and b (G, N, K)")
    for t, name in ((a, "a"), (b, "b")):
        if t.dtype != E4M3:
            raise InputError(f"{name} is {_name(t.dtype)}; {op} takes float8_e4m3fn a and b")
    groups, n, k = b.shape
    rows = a.shape[-2]
    if a.shape[-1] != k:
        raise InputError(f"inner dimensions disagree: a {tuple(a.shape)} has K={a.shape[-1]}, b {tuple(b.shape)} "
                         f"(G, N, K) has K={k}")
    if k % K_MULTIPLE != 0:
        raise InputError(f"K={k} is not supported: {op} needs K a positive multiple of {K_MULTIPLE} (16-byte rows)")
    out = out_dtype or torch.bfloat16
    if out not in OUT_DTYPES:
        raise InputError(f"out_dtype={_name(out)} is not supported; supported: bfloat16, float16, float32")
    kblocks, nblocks = (k + 127) // 128, (n + 127) // 128
    want_sa = (groups, rows, kblocks) if masked else (rows, kblocks)
    for s, name in ((a_scale, "a_scale"), (b_scale, "b_scale")):
        if s.dtype != F32:
            raise InputError(f"{name} is {_name(s.dtype)}; scales must be float32")
    if tuple(a_scale.shape) != want_sa or tuple(b_scale.shape) != (groups, nblocks, kblocks):
        raise InputError(f"a_scale has shape {tuple(a_scale.shape)} and b_scale {tuple(b_scale.shape)}; {op} takes "
                         f"block scales: a_scale {want_sa} and b_scale {(groups, nblocks, kblocks)}")
    length, name = (groups, "masked_m") if masked else (groups + 1, "group_offsets")
    if index.dtype != torch.int32 or tuple(index.shape) != (length,):
        raise InputError(f"{name} is {_name(index.dtype)} of shape {tuple(index.shape)}; expected int32 ({length},)")
    return ((groups, rows, n) if masked else (rows, n)), out


def _jit_grouped(a, b, a_scale, b_scale, group_offsets, out_dtype, trans_b):
    return ops_module("fp8").grouped_gemm_fp8(a, b, a_scale, b_scale, group_offsets,
                                              out_dtype=out_dtype or torch.bfloat16, trans_b=trans_b)


def _jit_grouped_masked(a, b, a_scale, b_scale, masked_m, out_dtype, trans_b):
    return ops_module("fp8").grouped_gemm_fp8_masked(a, b, a_scale, b_scale, masked_m,
                                                     out_dtype=out_dtype or torch.bfloat16, trans_b=trans_b)


def _ref_grouped_masked(a, b, a_scale, b_scale, masked_m, out_dtype, trans_b):
    return R.grouped_gemm_fp8(a, b, a_scale, b_scale, masked_m, out_dtype, trans_b, masked=True)


@kernel_op("grouped_gemm_fp8")
def grouped_gemm_fp8(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, group_offsets: Tensor,
                     out_dtype: Optional[torch.dtype] = None, trans_b: bool = True) -> Tensor:
    """rtckern.ops.grouped_gemm_fp8 as a torch op (out_dtype None: bfloat16)."""
    return run("grouped_gemm_fp8", _jit_grouped, R.grouped_gemm_fp8, a, b, a_scale, b_scale, group_offsets,
               out_dtype, trans_b)


@grouped_gemm_fp8.register_fake
def _(a, b, a_scale, b_scale, group_offsets, out_dtype=None, trans_b=True):
    shape, out = _grouped_fp8_out(a, b, a_scale, b_scale, group_offsets, out_dtype, trans_b, False)
    return a.new_empty(shape, dtype=out)


@kernel_op("grouped_gemm_fp8_masked")
def grouped_gemm_fp8_masked(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, masked_m: Tensor,
                            out_dtype: Optional[torch.dtype] = None, trans_b: bool = True) -> Tensor:
    """rtckern.ops.grouped_gemm_fp8_masked as a torch op (out_dtype None: bfloat16)."""
    return run("grouped_gemm_fp8_masked", _jit_grouped_masked, _ref_grouped_masked, a, b, a_scale, b_scale, masked_m,
               out_dtype, trans_b)


@grouped_gemm_fp8_masked.register_fake
def _(a, b, a_scale, b_scale, masked_m, out_dtype=None, trans_b=True):
    shape, out = _grouped_fp8_out(a, b, a_scale, b_scale, masked_m, out_dtype, trans_b, True)
    return a.new_empty(shape, dtype=out)


# ---- quantize_fp8 -------------------------------------------------------------------------------------------------
def _jit_quant(x, group, scale_format):
    return ops_module("fp8").quantize_fp8(x, group=group, scale_format=scale_format)


@kernel_op("quantize_fp8")
def quantize_fp8(x: Tensor, group: int = 128, scale_format: str = "row") -> tuple[Tensor, Tensor]:
    """rtckern.ops.quantize_fp8 as a torch op: (q, scales)."""
    return run("quantize_fp8", _jit_quant, R.quantize_fp8, x, group, scale_format)


@quantize_fp8.register_fake
def _(x, group=128, scale_format="row"):
    _check_quant(x, group, scale_format, "quantize_fp8", "K")
    if x.dim() != 2:
        raise InputError(f"x has shape {tuple(x.shape)}; quantize_fp8 takes (M, K) (reshape tokens to rows first)")
    m, k = x.shape
    return x.new_empty((m, k), dtype=E4M3), _fake_scales(x, m, k // group, scale_format)


# ---- rms_norm_quant -----------------------------------------------------------------------------------------------
def _jit_norm_quant(x, weight, eps, group, scale_format, zero_centered):
    return ops_module("norms").rms_norm_quant(x, weight, eps, group=group, scale_format=scale_format,
                                              zero_centered=zero_centered)


@kernel_op("rms_norm_quant")
def rms_norm_quant(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, group: int = 128,
                   scale_format: str = "row", zero_centered: bool = False) -> tuple[Tensor, Tensor]:
    """rtckern.ops.rms_norm_quant as a torch op: (q, scales), RMSNorm and per-group fp8 quantization in one pass."""
    return run("rms_norm_quant", _jit_norm_quant, R.rms_norm_quant, x, weight, eps, group, scale_format,
               zero_centered)


@rms_norm_quant.register_fake
def _(x, weight=None, eps=1e-6, group=128, scale_format="row", zero_centered=False):
    _check_quant(x, group, scale_format, "rms_norm_quant", "the last dimension (N)")
    check_vector(weight, x, "weight")
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    return x.new_empty(x.shape, dtype=E4M3), _fake_scales(x, m, n // group, scale_format)
