"""Grouped GEMM for mixture-of-experts layers: one launch multiplies the rows of every group by the group's own B.

    y = rtckern.ops.grouped_gemm(a, b, group_offsets, out_dtype=None, trans_b=True)
    y = rtckern.ops.grouped_gemm_masked(a, b, masked_m, out_dtype=None, trans_b=True)

Contiguous groups (prefill, training): a (total_m, K) holds the rows (tokens) of G groups one group after the other
(sorted by expert); group_offsets, int32 (G + 1,) prefix sums in device memory: group g is rows
[group_offsets[g], group_offsets[g + 1]) of a and of y. y (total_m, N): y[rows of g] = a[rows of g] @ op(b[g]).

Masked groups (decode, a fixed capacity per expert): a (G, capacity, K); masked_m, int32 (G,) in device memory: the
valid rows of each group. y (G, capacity, N): y[g, :masked_m[g]] = a[g, :masked_m[g]] @ op(b[g]).

b: (G, N, K) with trans_b=True (each expert's nn.Linear weight, the default) or (G, K, N) with trans_b=False; a view
of b with its last two dimensions swapped is read in place as the other layout.

Neither group index is read on the host: no synchronization, and the grid depends only on the shapes (an upper bound
of the groups' tiles; blocks past the real tiles exit), so a call can be captured in a CUDA graph and replayed with
new offsets or counts (make one call of the same shapes before capturing: it compiles and prepares the launch).
Groups of 0 rows are fine. Rows that no group covers (contiguous: before group_offsets[0] and from group_offsets[G]
on; masked: from masked_m[g] on) are left unwritten: y is allocated uninitialized, so read only the groups' rows, or
zero the rest yourself. Offsets should be non-decreasing within [0, total_m] and counts within [0, capacity]; they
are not checked on the host (that would synchronize) but clamped on the device: bad values give wrong rows, never an
access out of bounds.

dtypes: a and b both bf16 or both fp16, fp32 accumulation, y bf16 / fp16 / fp32 (default: a's dtype). Rows
contiguous in their last dimension (any row and group strides). Up to 4096 groups per call.

GPUs: sm_90 (H100 / H200) runs the dense GEMM's wgmma + TMA kernel compiled for groups (persistent over every
group's tiles) when the operands suit TMA: 16-byte aligned base addresses, row and group strides multiples of 8
elements, K (and N with trans_b=False) a multiple of 8. sm_80 and newer otherwise run the mma.sync kernel compiled
for groups (one tile per block; element loads where rows are not 16-byte aligned): correct, slower. sm_75 and older
GPUs are refused (UnsupportedRequestError naming the reason). y is an array of a's library on its current stream.
"""
from __future__ import annotations

import sys

from rtckern import config
from rtckern.device import DeviceInfo
from rtckern.dtypes import parse_dtype
from rtckern.errors import InputError
from rtckern.runtime import arrays as arr

from .. import _common_grouped as shared
from .._common import OutputPlan, current_plan
from . import geometry
from . import grouped_candidates as cands
from . import grouped_geometry as gg
from . import grouped_plan as plan

__all__ = ("grouped_gemm", "grouped_gemm_masked")

cands.register_all()

def _torch_types() -> frozenset:
    torch = sys.modules.get("torch")
    return frozenset((torch.Tensor, torch.nn.Parameter)) if torch is not None and hasattr(torch, "nn") else frozenset()


def grouped_gemm(a, b, group_offsets, out_dtype=None, trans_b: bool = True):
    """Grouped matrix multiply over contiguous groups (MoE experts): y[rows of g] = a[rows of g] @ op(b[g]), one
    launch for every group, fp32 accumulation.

    Args:
        a: (total_m, K) bf16 or fp16: the rows (tokens) of G groups one group after the other (sorted by expert).
        b: (G, N, K) with trans_b=True (each expert's nn.Linear weight) or (G, K, N) with trans_b=False, a's dtype;
            a view with the last two dimensions swapped is read in place as the other layout.
        group_offsets: int32 (G + 1,) prefix sums in device memory, beside a: group g is rows
            [group_offsets[g], group_offsets[g + 1]) of a and y. Never read on the host (no synchronization; the
            grid depends on shapes only, so a call captured in a CUDA graph replays with new offsets); values
            outside [0, total_m] or decreasing are clamped on the device (wrong rows, never a fault).
        out_dtype: fp16, bf16 or fp32; None (default) is a's dtype.
        trans_b: True (default): b is (G, N, K); False: (G, K, N).

    Returns:
        y, (total_m, N) in out_dtype, of a's library. Rows no group covers (before group_offsets[0], from
        group_offsets[G] on) are left unwritten. Groups of 0 rows are fine; at most 4096 groups per call. sm_90
        (H100 / H200) runs a persistent wgmma + TMA kernel when a's and b's bases are 16-byte aligned and their row
        and group strides, K (and N with trans_b=False) are multiples of 8 elements; other sm_80+ GPUs and layouts
        a mma.sync kernel.

    Raises:
        InputError: dtypes other than matching fp16 / bf16, shapes that disagree (K, the number of groups),
            group_offsets not int32 (G + 1,) beside a, more than 4096 groups, a last dimension that is not
            contiguous, or a bad out_dtype.
        UnsupportedRequestError: no kernel serves the request on this device (sm_75 and older GPUs;
            RTCKERN_DISABLE_OPS naming the op).
    """
    return _call("contiguous", a, b, group_offsets, out_dtype, trans_b)


def grouped_gemm_masked(a, b, masked_m, out_dtype=None, trans_b: bool = True):
    """Grouped matrix multiply over masked groups of a fixed capacity (MoE decode): y[g, :masked_m[g]] =
    a[g, :masked_m[g]] @ op(b[g]), one launch for every group, fp32 accumulation.

    Args:
        a: (G, capacity, K) bf16 or fp16: each group's rows, the first masked_m[g] of them valid.
        b: (G, N, K) with trans_b=True (each expert's nn.Linear weight) or (G, K, N) with trans_b=False, a's dtype;
            a view with the last two dimensions swapped is read in place as the other layout.
        masked_m: int32 (G,) in device memory, beside a: the valid rows of each group. Never read on the host (the
            grid covers every group's capacity and blocks past a group's valid rows exit, so a call captured in a
            CUDA graph replays with new counts); values outside [0, capacity] are clamped on the device.
        out_dtype: fp16, bf16 or fp32; None (default) is a's dtype.
        trans_b: True (default): b is (G, N, K); False: (G, K, N).

    Returns:
        y, (G, capacity, N) in out_dtype, of a's library. Rows from masked_m[g] on are left unwritten (not computed,
        not zeroed). Kernels and limits as grouped_gemm.

    Raises:
        InputError: dtypes other than matching fp16 / bf16, shapes that disagree (K, the number of groups),
            masked_m not int32 (G,) beside a, more than 4096 groups, a last dimension that is not contiguous, or a
            bad out_dtype.
        UnsupportedRequestError: no kernel serves the request on this device (sm_75 and older GPUs;
            RTCKERN_DISABLE_OPS naming the op).
    """
    return _call("masked", a, b, masked_m, out_dtype, trans_b)


def _call(mode: str, a, b, index, out_dtype, trans_b):
    tt = _torch_types()
    if type(a) in tt and type(b) in tt and type(index) in tt:
        # Hot path: everything the plan depends on, read from the tensors (a plan exists only for a signature that
        # passed validation once).
        pa, pb = a.data_ptr(), b.data_ptr()
        key = (mode, a.dtype, a.shape, a.stride(), a.device, b.dtype, b.shape, b.stride(), b.device,
               not (pa | pb) & 15, index.dtype, index.shape, index.stride(), index.device, out_dtype, trans_b)
        p = current_plan(plan.plans, key)
        if p is not None:
            return p.run_torch(pa, pb, index.data_ptr())
        mats = _wrap(a, b, index, mode)
        p = _build(mode, *mats, out_dtype, trans_b)
        try:
            plan.plans.put(key, p)
        except TypeError:  # an unhashable out_dtype / trans_b that the checks accepted: no memo
            pass
        return p.run_mats(*mats)
    mats = _wrap(a, b, index, mode)
    return _build(mode, *mats, out_dtype, trans_b).run_mats(*mats)


def _wrap(a, b, index, mode: str):
    return arr.wrap(a, "a"), arr.wrap(b, "b"), arr.wrap(index, shared.INDEX[mode][0])


def _rows_contiguous(x: arr.DeviceArray, name: str) -> None:
    if x.strides[-1] != 1 and x.shape[-1] > 1:
        raise InputError(f"{name} has shape {x.shape} and element strides {x.strides}: its last dimension is not "
                         f"contiguous; pass {name}.contiguous()")
    if x.shape[-2] > 1 and x.strides[-2] < x.shape[-1]:
        raise InputError(f"{name} has shape {x.shape} and element strides {x.strides}: its rows overlap; pass "
                         f"{name}.contiguous()")


def _build(mode: str, A: arr.DeviceArray, B: arr.DeviceArray, I: arr.DeviceArray, out_dtype, trans_b) -> plan.Plan:
    """Validate one call signature and prepare its launch."""
    settings = config.settings()
    masked = mode == "masked"
    op = "grouped_gemm_masked" if masked else "grouped_gemm"
    if A.ndim != (3 if masked else 2):
        want = "(G, capacity, K)" if masked else "(total_m, K): the rows of every group, one group after the other"
        raise InputError(f"a has shape {A.shape}; {op} takes a {want}")
    if B.ndim != 3:
        raise InputError(f"b has shape {B.shape}; {op} takes b (G, N, K) with trans_b=True or (G, K, N) with "
                         "trans_b=False: one matrix per group")
    if A.dtype not in geometry.INPUT_DTYPES or B.dtype != A.dtype:
        raise InputError(f"a is {A.dtype} and b is {B.dtype}; both must be fp16 or both bf16 (convert with "
                         ".to(torch.bfloat16) or .half()); fp8 inputs: rtckern.ops.grouped_gemm_fp8")
    arr.check_same_place(A, B, "a", "b")
    if B.strides[-1] != 1 and B.shape[-1] > 1 and (B.strides[-2] == 1 or B.shape[-2] == 1):
        B = B.transpose_last()  # a transposed view of the other layout, read in place
        trans_b = not trans_b
    _rows_contiguous(A, "a")
    _rows_contiguous(B, "b")
    groups = B.shape[0]
    if masked and A.shape[0] != groups:
        raise InputError(f"a has {A.shape[0]} groups {A.shape} but b has {groups} {B.shape}; they must match")
    k = A.shape[-1]
    n, kb = (B.shape[1], B.shape[2]) if trans_b else (B.shape[2], B.shape[1])
    if k != kb:
        layout = "(G, N, K) since trans_b=True" if trans_b else "(G, K, N) since trans_b=False"
        raise InputError(f"inner dimensions disagree: a {A.shape} has K={k}, b {B.shape} is read as {layout}, so "
                         f"K={kb}")
    if k == 0:
        raise InputError(f"K is 0 (a {A.shape}, b {B.shape}); the GEMM needs K >= 1")
    out_dt = A.dtype if out_dtype is None else \
        parse_dtype(out_dtype, "out_dtype", geometry.OUTPUT_DTYPES, default="a's dtype")
    shared.check_group_index(I, mode, groups, A)
    shared.check_sizes(groups, A.shape[-2], op)
    rows = A.shape[-2]
    out_shape = (groups, rows, n) if masked else (rows, n)
    if rows == 0 or n == 0 or groups == 0:
        return OutputPlan(settings, A, out_shape, out_dt, None)
    lda = A.strides[-2] if rows > 1 else k
    stride_a = (A.strides[0] if groups > 1 else rows * lda) if masked else 0
    ldb = B.strides[-2] if B.shape[-2] > 1 else B.shape[-1]
    stride_b = B.strides[0] if groups > 1 else B.shape[-2] * ldb
    aligned = not (A.ptr % 16 or B.ptr % 16 or lda % 8 or stride_a % 8 or ldb % 8 or stride_b % 8 or k % 8
                   or (not trans_b and n % 8))
    dev = DeviceInfo.from_device(A.device)
    p = gg.GroupedProblem(mode=mode, groups=groups, rows=shared.rows_class(mode, rows, groups), n=n, k=k,
                          dtype=A.dtype, out_dtype=out_dt, trans_b=bool(trans_b), aligned=aligned)
    sel = cands.selection(p, dev)
    lay = plan.Layout(rows=rows, lda=lda, stride_a=stride_a, ldb=ldb, stride_b=stride_b,
                      stride_c=rows * n if masked else 0)
    launch = plan.GroupedLaunch(sel.kernels[0], p, sel.candidate.config(sel.request), lay, dev.sm_count)
    return OutputPlan(settings, A, out_shape, out_dt, launch, sel.candidate.name)
