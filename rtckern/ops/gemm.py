"""Matrix multiply with fused epilogues.

    y = rtckern.ops.gemm(a, b, bias=None, activation=None, trans_b=False, out_dtype=None, residual=None)

    a: (M, K) or (batch, M, K)
    b: (K, N), or (N, K) with trans_b=True (the nn.Linear weight layout); (batch, ...) for a batched B, or 2-D
       to share one B across a's batch
    y = act(a @ op(b) + bias) + residual,  op(b) = b or b^T;  y: (M, N) or (batch, M, N)

Inputs fp16 or bf16 (a and b alike), fp32 accumulation, output fp16, bf16 or fp32 (default: a's dtype).
bias: (N,) in a's dtype. activation: None, "gelu_tanh" (GELU, tanh form) or "silu". residual: (M, N) or
(batch, M, N) in the output dtype, added after the activation. Any M, N, K >= 1. Rows must be contiguous in
their last dimension; a B whose first dimension is the contiguous one (a transposed view, e.g. weight.t()) is
read in place as the other layout. Operands with 16-byte aligned rows (base, row and batch strides multiples of
8 elements, K and, for trans_b=False, N multiples of 8) take the fast paths (wgmma + TMA on sm_90, cp.async
elsewhere); others a general path that reads elements one by one.

The output is a new array of a's library (torch in -> torch out, CuPy in -> CuPy out), computed on that
library's current stream.
"""
from __future__ import annotations

from typing import Any

from rtckern.errors import InputError
from rtckern.ops import _gemm_arrays as arr
from rtckern.ops import _gemm_candidates as cands
from rtckern.ops import _gemm_launch as L
from rtckern.ops import _gemm_plan as P

__all__ = ["gemm", "ACTIVATIONS"]

ACTIVATIONS = ("gelu_tanh", "silu")
_DTYPE_ALIASES = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16",
                  "fp32": "fp32", "float32": "fp32", "float": "fp32"}

cands.register_all()


def _out_dtype(out_dtype: Any, default: str) -> str:
    if out_dtype is None:
        return default
    name = str(out_dtype).replace("torch.", "").replace("<class 'numpy.", "").rstrip("'>")
    dt = _DTYPE_ALIASES.get(name)
    if dt is None:
        raise InputError(f"out_dtype={out_dtype!r} is not supported; supported: fp16, bf16, fp32 (or the torch "
                         "dtypes float16, bfloat16, float32)")
    return dt


def _activation(activation: Any) -> str:
    if activation is None or activation == "none":
        return "none"
    if activation in ACTIVATIONS:
        return activation
    hint = (" GELU is fused in its tanh form only: pass 'gelu_tanh' (torch's gelu(approximate='tanh'))"
            if activation == "gelu" else "")
    raise InputError(f"activation={activation!r} is not supported; supported: None, 'gelu_tanh', 'silu'.{hint}")


def _row_major(x: arr.Mat, name: str) -> None:
    if x.strides[-1] != 1 and x.shape[-1] > 1:
        raise InputError(f"{name} has shape {x.shape} and element strides {x.strides}: its last dimension is not "
                         f"contiguous, which no GEMM path reads; pass {name}.contiguous()")
    if x.ndim >= 2 and x.shape[-2] > 1 and x.strides[-2] < x.shape[-1]:
        raise InputError(f"{name} has shape {x.shape} and element strides {x.strides}: its rows overlap; pass "
                         f"{name}.contiguous()")


def _aligned16(x: arr.Mat, batched: bool) -> bool:
    """Base address, row stride and (when batched) batch stride allow 16-byte chunks."""
    if x.ptr % 16:
        return False
    if x.shape[-2] > 1 and x.strides[-2] % 8:
        return False
    return not (batched and x.ndim == 3 and x.shape[0] > 1 and x.strides[0] % 8)


def _as_batched(x: arr.Mat) -> tuple[int, int, int]:
    """(row stride, batch stride, batch) of a 2-D or 3-D operand."""
    row = x.strides[-2] if x.shape[-2] > 1 else x.shape[-1]
    if x.ndim == 2:
        return row, 0, 1
    return row, x.strides[0], x.shape[0]


def gemm(a, b, bias=None, activation=None, trans_b: bool = False, out_dtype=None, residual=None):
    """y = act(a @ op(b) + bias) + residual. See the module docstring."""
    A = arr.wrap(a, "a")
    B = arr.wrap(b, "b")
    if A.ndim not in (2, 3):
        raise InputError(f"a has shape {A.shape}; expected (M, K) or (batch, M, K)")
    if B.ndim not in (2, 3):
        raise InputError(f"b has shape {B.shape}; expected (K, N), (N, K) with trans_b=True, or with a leading "
                         "batch dimension")
    if A.dtype not in P.INPUT_DTYPES or B.dtype != A.dtype:
        raise InputError(f"a is {A.dtype} and b is {B.dtype}; both must be fp16 or both bf16 (convert with "
                         ".to(torch.bfloat16) or .half())")
    if A.device != B.device:
        raise InputError(f"a is on cuda:{A.device} and b on cuda:{B.device}; put them on one device")
    # A transposed view of B (first dimension contiguous) is the other layout, read in place.
    if B.strides[-1] != 1 and B.shape[-1] > 1 and (B.strides[-2] == 1 or B.shape[-2] == 1):
        B = arr.transpose_last(B)
        trans_b = not trans_b
    _row_major(A, "a")
    _row_major(B, "b")
    if B.ndim == 3 and A.ndim == 2:
        raise InputError(f"b is batched {B.shape} but a is not {A.shape}: give a a batch dimension of "
                         f"{B.shape[0]} (a.expand({B.shape[0]}, *a.shape).contiguous())")
    if A.ndim == 3 and B.ndim == 3 and A.shape[0] != B.shape[0] and B.shape[0] != 1:
        raise InputError(f"a has batch {A.shape[0]} and b has batch {B.shape[0]}; they must match (or b has 1)")

    m, k = A.shape[-2], A.shape[-1]
    n, kb = (B.shape[-2], B.shape[-1]) if trans_b else (B.shape[-1], B.shape[-2])
    if k != kb:
        layout = "(N, K) since trans_b=True" if trans_b else "(K, N) since trans_b=False"
        raise InputError(f"inner dimensions disagree: a {A.shape} has K={k}, b {B.shape} is read as {layout}, "
                         f"so K={kb}. For an nn.Linear weight of shape (out, in), pass trans_b=True")
    if k == 0:
        raise InputError(f"K is 0 (a {A.shape}, b {B.shape}); the GEMM needs K >= 1")
    out_dt = _out_dtype(out_dtype, A.dtype)
    act = _activation(activation)
    batch = A.shape[0] if A.ndim == 3 else 1
    out_shape = (batch, m, n) if A.ndim == 3 else (m, n)

    bias_ptr = 0
    if bias is not None:
        Bi = arr.wrap(bias, "bias")
        if Bi.shape != (n,) or Bi.dtype != A.dtype or (n > 1 and Bi.strides[0] != 1):
            raise InputError(f"bias has shape {Bi.shape}, dtype {Bi.dtype}, strides {Bi.strides}; expected a "
                             f"contiguous ({n},) array of {A.dtype} (a's dtype)")
        if Bi.device != A.device:
            raise InputError(f"bias is on cuda:{Bi.device}, a on cuda:{A.device}; put them on one device")
        bias_ptr = Bi.ptr
    res_ptr, ldr, stride_r = 0, 0, 0
    if residual is not None:
        R = arr.wrap(residual, "residual")
        if R.dtype != out_dt:
            raise InputError(f"residual is {R.dtype} but the output is {out_dt}; pass a residual of the output dtype")
        if R.shape not in (out_shape, (m, n)) or R.ndim not in (2, 3):
            raise InputError(f"residual has shape {R.shape}; expected {out_shape}" +
                             (f" or ({m}, {n}) shared across the batch" if A.ndim == 3 else ""))
        if R.device != A.device:
            raise InputError(f"residual is on cuda:{R.device}, a on cuda:{A.device}; put them on one device")
        _row_major(R, "residual")
        ldr, stride_r, _ = _as_batched(R)
        res_ptr = R.ptr

    out, c_ptr = arr.empty(A, out_shape, out_dt)
    if m == 0 or n == 0 or batch == 0:
        return out
    lda, stride_a, _ = _as_batched(A)
    ldb, stride_b, bbatch = _as_batched(B)
    b_batched = B.ndim == 3 and bbatch > 1
    aligned = (k % 8 == 0 and (trans_b or n % 8 == 0) and _aligned16(A, True) and _aligned16(B, b_batched))
    p = P.GemmProblem(batch=batch, m=m, n=n, k=k, dtype=A.dtype, out_dtype=out_dt, trans_b=bool(trans_b),
                      bias=bias is not None, activation=act, residual=residual is not None, aligned=aligned,
                      b_batched=b_batched)
    ops = L.Operands(a=A.ptr, b=B.ptr, c=c_ptr, lda=lda, ldb=ldb, ldc=n, stride_a=stride_a,
                     stride_b=stride_b if b_batched else 0, stride_c=m * n, bias=bias_ptr, res=res_ptr, ldr=ldr,
                     stride_r=stride_r)
    sel = cands.selection(p, A.device)
    keep = sel.candidate.launch(sel.request, sel.kernels, ops, stream=arr.current_stream(A),
                                workspace_alloc=lambda nbytes: arr.empty_bytes(A, nbytes))
    del keep  # split-K workspace: freed after the launches, safe with stream-ordered allocators
    return out
