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

Repeated calls: the first call of a signature (dtypes, shapes, strides, 16-byte alignment, epilogue, layout,
device, settings) validates, asks the registry and prepares the launches (`plan.CallPlan`); later calls
with torch tensors of that signature read the tensors' metadata, find the plan in a dict and launch.
"""
from __future__ import annotations

import sys
from typing import Any

from rtckern import config
from rtckern.dtypes import parse_dtype
from rtckern.errors import InputError
from rtckern.runtime import arrays as arr

from . import candidates as cands
from . import geometry, plan
from .launch import Operands

__all__ = ("gemm", "grouped_gemm", "grouped_gemm_masked", "ACTIVATIONS")

ACTIVATIONS = ("gelu_tanh", "silu")

cands.register_all()


def _out_dtype(out_dtype: Any, default: str) -> str:
    if out_dtype is None:
        return default
    return parse_dtype(out_dtype, "out_dtype", geometry.OUTPUT_DTYPES, default="a's dtype")


def _activation(activation: Any) -> str:
    if activation is None or activation == "none":
        return "none"
    if activation in ACTIVATIONS:
        return activation
    hint = (" GELU is fused in its tanh form only: pass 'gelu_tanh' (torch's gelu(approximate='tanh'))"
            if activation == "gelu" else "")
    raise InputError(f"activation={activation!r} is not supported; supported: None, 'gelu_tanh', 'silu'.{hint}")


def _row_major(x: arr.DeviceArray, name: str) -> None:
    if x.strides[-1] != 1 and x.shape[-1] > 1:
        raise InputError(f"{name} has shape {x.shape} and element strides {x.strides}: its last dimension is not "
                         f"contiguous, which no GEMM path reads; pass {name}.contiguous()")
    if x.ndim >= 2 and x.shape[-2] > 1 and x.strides[-2] < x.shape[-1]:
        raise InputError(f"{name} has shape {x.shape} and element strides {x.strides}: its rows overlap; pass "
                         f"{name}.contiguous()")


def _aligned16(x: arr.DeviceArray, batched: bool) -> bool:
    """Base address, row stride and (when batched) batch stride allow 16-byte chunks."""
    if x.ptr % 16:
        return False
    if x.shape[-2] > 1 and x.strides[-2] % 8:
        return False
    return not (batched and x.ndim == 3 and x.shape[0] > 1 and x.strides[0] % 8)


def gemm(a, b, bias=None, activation=None, trans_b: bool = False, out_dtype=None, residual=None):
    """Matrix multiply with a fused epilogue: y = act(a @ op(b) + bias) + residual, op(b) = b or b^T.

    Args:
        a: (M, K) or (batch, M, K), fp16 or bf16, rows contiguous in their last dimension.
        b: (K, N), or (N, K) with trans_b=True (the nn.Linear weight layout), in a's dtype; (batch, ...) for a
            batched B, or 2-D to share one B across a's batch. A transposed view (e.g. weight.t()) is read in
            place as the other layout.
        bias: (N,) contiguous, in a's dtype, or None.
        activation: None, "gelu_tanh" (GELU in its tanh form, torch's gelu(approximate="tanh")) or "silu"
            (ACTIVATIONS lists them); plain "gelu" is refused with that hint.
        trans_b: b is (N, K).
        out_dtype: fp16, bf16 or fp32 (a torch / numpy dtype or a name); default a's dtype.
        residual: (M, N) or (batch, M, N) in the output dtype, added after the activation; or None.

    Returns:
        y, a new (M, N) or (batch, M, N) array of a's library, computed on its current stream with fp32
        accumulation. Any M, N, K >= 1; operands with 16-byte aligned rows (base, row and batch strides
        multiples of 8 elements, K and, for trans_b=False, N multiples of 8) take the fast paths (wgmma + TMA on
        sm_90, cp.async elsewhere), others a general path.

    Raises:
        InputError: arrays not on one GPU, a dtype pair other than fp16/fp16 or bf16/bf16, inner dimensions that
            disagree, K = 0, overlapping or non-contiguous rows, a bias or residual of the wrong shape or dtype, or
            an unsupported activation / out_dtype.
        UnsupportedRequestError: no kernel serves the request on this device (RTCKERN_DISABLE_OPS names the op).
    """
    tt = _TORCH_TYPES or _torch_types()
    if type(a) in tt and type(b) in tt and (bias is None or type(bias) in tt) and \
            (residual is None or type(residual) in tt):
        # Hot path: everything the plan depends on, read from the tensors (no wrapping, no validation: a plan
        # exists only for a signature that passed validation once).
        pa, pb = a.data_ptr(), b.data_ptr()
        key = (a.dtype, a.shape, a.stride(), a.device, b.dtype, b.shape, b.stride(), b.device, not (pa | pb) & 15,
               trans_b, activation, out_dtype,
               None if bias is None else (bias.dtype, bias.shape, bias.stride(), bias.device),
               None if residual is None else (residual.dtype, residual.shape, residual.stride(), residual.device))
        try:
            call_plan = plan.plans.get(key)
        except TypeError:  # an unhashable activation / out_dtype: validation below says what is wrong
            call_plan, key = None, None
        if call_plan is not None and call_plan.settings is config.settings():
            return call_plan.run_torch(pa, pb, 0 if bias is None else bias.data_ptr(),
                                       0 if residual is None else residual.data_ptr())
        call_plan, mats = _plan_for(a, b, bias, activation, trans_b, out_dtype, residual)
        if key is not None:
            plan.plans.put(key, call_plan)
        return call_plan.run_mats(*mats)
    call_plan, mats = _plan_for(a, b, bias, activation, trans_b, out_dtype, residual)
    return call_plan.run_mats(*mats)


_TORCH_TYPES: frozenset = frozenset()


def _torch_types() -> frozenset:
    """torch.Tensor and nn.Parameter once torch is imported (the exact types the hot path accepts; subclasses
    such as fake tensors take the general path)."""
    global _TORCH_TYPES
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "nn"):
        _TORCH_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
    return _TORCH_TYPES


def _mat_key(A: arr.DeviceArray, B: arr.DeviceArray, Bi, R, trans_b, activation, out_dtype) -> tuple | None:
    def meta(x):
        return None if x is None else (x.lib, x.dtype, x.shape, x.strides, x.device)

    key = (meta(A), meta(B), not (A.ptr | B.ptr) & 15, trans_b, activation, out_dtype, meta(Bi), meta(R))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _plan_for(a, b, bias, activation, trans_b, out_dtype, residual):
    """(plan, (A, B, bias, residual) as Mats) for a call: the memoized plan of its signature, or a new one after
    full validation."""
    A = arr.wrap(a, "a")
    B = arr.wrap(b, "b")
    Bi = arr.wrap(bias, "bias") if bias is not None else None
    R = arr.wrap(residual, "residual") if residual is not None else None
    key = _mat_key(A, B, Bi, R, trans_b, activation, out_dtype)
    call_plan = plan.plans.get(key) if key is not None else None
    if call_plan is None or call_plan.settings is not config.settings():
        call_plan = _build_plan(A, B, Bi, R, activation, trans_b, out_dtype)
        if key is not None:
            plan.plans.put(key, call_plan)
    return call_plan, (A, B, Bi, R)


def _build_plan(A: arr.DeviceArray, B: arr.DeviceArray, Bi, R, activation, trans_b, out_dtype) -> plan.CallPlan:
    """Validate one call signature and prepare its launches."""
    settings = config.settings()
    if A.ndim not in (2, 3):
        raise InputError(f"a has shape {A.shape}; expected (M, K) or (batch, M, K)")
    if B.ndim not in (2, 3):
        raise InputError(f"b has shape {B.shape}; expected (K, N), (N, K) with trans_b=True, or with a leading "
                         "batch dimension")
    if A.dtype not in geometry.INPUT_DTYPES or B.dtype != A.dtype:
        raise InputError(f"a is {A.dtype} and b is {B.dtype}; both must be fp16 or both bf16 (convert with "
                         ".to(torch.bfloat16) or .half())")
    arr.check_same_place(A, B, "a", "b")
    # A transposed view of B (first dimension contiguous) is the other layout, read in place.
    if B.strides[-1] != 1 and B.shape[-1] > 1 and (B.strides[-2] == 1 or B.shape[-2] == 1):
        B = B.transpose_last()
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

    if Bi is not None:
        if Bi.shape != (n,) or Bi.dtype != A.dtype or (n > 1 and Bi.strides[0] != 1):
            raise InputError(f"bias has shape {Bi.shape}, dtype {Bi.dtype}, strides {Bi.strides}; expected a "
                             f"contiguous ({n},) array of {A.dtype} (a's dtype)")
        arr.check_same_place(A, Bi, "a", "bias")
    ldr = stride_r = 0
    if R is not None:
        if R.dtype != out_dt:
            raise InputError(f"residual is {R.dtype} but the output is {out_dt}; pass a residual of the output dtype")
        if R.shape not in (out_shape, (m, n)) or R.ndim not in (2, 3):
            raise InputError(f"residual has shape {R.shape}; expected {out_shape}" +
                             (f" or ({m}, {n}) shared across the batch" if A.ndim == 3 else ""))
        arr.check_same_place(A, R, "a", "residual")
        _row_major(R, "residual")
        ldr, stride_r, _ = arr.batched_matrix(R)

    if m == 0 or n == 0 or batch == 0:
        return plan.CallPlan.nothing_to_do(settings, A, out_shape, out_dt)
    lda, stride_a, _ = arr.batched_matrix(A)
    ldb, stride_b, bbatch = arr.batched_matrix(B)
    b_batched = B.ndim == 3 and bbatch > 1
    aligned = (k % 8 == 0 and (trans_b or n % 8 == 0) and _aligned16(A, True) and _aligned16(B, b_batched))
    p = geometry.GemmProblem(batch=batch, m=m, n=n, k=k, dtype=A.dtype, out_dtype=out_dt, trans_b=bool(trans_b),
                             bias=Bi is not None, activation=act, residual=R is not None, aligned=aligned,
                             b_batched=b_batched)
    strides = Operands(a=0, b=0, c=0, lda=lda, ldb=ldb, ldc=n, stride_a=stride_a,
                       stride_b=stride_b if b_batched else 0, stride_c=m * n, ldr=ldr, stride_r=stride_r)
    sel = cands.selection(p, A.device)
    launches = sel.candidate.prepare(sel.request, sel.kernels, strides)
    return plan.CallPlan(settings, A, out_shape, out_dt, launches, sel.candidate.name)


from .grouped import grouped_gemm, grouped_gemm_masked  # noqa: E402  (the grouped ops, exported with gemm)
