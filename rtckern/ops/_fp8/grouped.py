"""Grouped fp8 GEMM with block scales for mixture-of-experts layers (the DeepSeek-V3 recipe of gemm_fp8, per group).

    y = rtckern.ops.grouped_gemm_fp8(a, b, a_scale, b_scale, group_offsets, out_dtype=torch.bfloat16)
    y = rtckern.ops.grouped_gemm_fp8_masked(a, b, a_scale, b_scale, masked_m, out_dtype=torch.bfloat16)

a, b float8_e4m3fn with K contiguous; b (G, N, K): each group's (expert's) weight in nn.Linear's layout (trans_b=True
is the only layout: 8-bit tensor-core MMAs read both operands K-major). Scales fp32, any strides:
    a_scale   1 x 128 groups of a's rows: (total_m, ceil(K/128)) in contiguous mode, (G, capacity, ceil(K/128)) in
              masked mode (quantize_fp8(..., scale_format="col_tma") gives the column-major layout read fastest)
    b_scale   128 x 128 blocks of each group's b: (G, ceil(N/128), ceil(K/128))
y = (a * a_scale) @ (b[g] * b_scale[g])^T per group, fp32 accumulation promoted every 128 K (as gemm_fp8), output
bf16 / fp16 / fp32.

Contiguous groups: a (total_m, K) holds the rows of G groups one group after the other; group_offsets int32 (G + 1,)
prefix sums in device memory; y (total_m, N). Masked groups (decode): a (G, capacity, K); masked_m int32 (G,) in
device memory, the valid rows of each group; y (G, capacity, N). As in rtckern.ops.grouped_gemm: the index is never
read on the host (no synchronization; the grid depends on shapes only, so CUDA-graph capture and replay with new
offsets / counts work after a first call), groups of 0 rows are fine, rows no group covers are left unwritten, and
index values outside [0, total_m] / [0, capacity] are clamped on the device. Offsets must be non-decreasing: the
kernel counts work tiles in 32 bits over them, bounded on the host for non-decreasing offsets only.

K a positive multiple of 16 (a ragged last K block is fine: its scales are the last column); any N >= 1; base
addresses 16-byte aligned and row / group strides multiples of 16 bytes; up to 4096 groups per call. GPUs: sm_90
(H100 / H200) only; others are refused (UnsupportedRequestError naming the reason): dequantize and use
rtckern.ops.grouped_gemm where bf16 runs, or a loop of rtckern.ops.gemm_fp8 over the groups.
"""
from __future__ import annotations

import math
import sys

from rtckern import config
from rtckern.device import DeviceInfo
from rtckern.dtypes import parse_dtype
from rtckern.errors import InputError
from rtckern.runtime import arrays as arr

from .. import _common_grouped as shared
from .._common import OutputPlan, current_plan, tma_coordinates_reason
from . import geometry
from . import grouped_candidates as cands
from . import grouped_geometry as gg
from . import grouped_plan as plan

__all__ = ("grouped_gemm_fp8", "grouped_gemm_fp8_masked")

cands.register_all()


def _torch_types() -> frozenset:
    torch = sys.modules.get("torch")
    return frozenset((torch.Tensor, torch.nn.Parameter)) if torch is not None and hasattr(torch, "nn") else frozenset()


def grouped_gemm_fp8(a, b, a_scale, b_scale, group_offsets, out_dtype="bf16", trans_b: bool = True):
    """Grouped fp8 matrix multiply with block scales over contiguous groups (MoE experts, the DeepSeek-V3 recipe):
    y[rows of g] = (a * a_scale)[rows of g] @ (b[g] * b_scale[g])^T, fp32 accumulation promoted every 128 K.

    Args:
        a: (total_m, K) float8_e4m3fn, K contiguous: the rows of G groups one group after the other.
        b: (G, N, K) float8_e4m3fn, K contiguous (each expert's nn.Linear weight); K a positive multiple of 16.
        a_scale: fp32 (total_m, ceil(K/128)), any strides (row-major, or quantize_fp8's "col_tma" layout): one scale
            per 1 x 128 group of a's rows.
        b_scale: fp32 (G, ceil(N/128), ceil(K/128)), any strides: one scale per 128 x 128 block of each b[g].
        group_offsets: int32 (G + 1,) prefix sums in device memory, beside a: group g is rows
            [group_offsets[g], group_offsets[g + 1]). Never read on the host (CUDA-graph capturable); values outside
            [0, total_m] are clamped on the device; they must be non-decreasing (see above).
        out_dtype: bf16 (default), fp16 or fp32.
        trans_b: must be True (8-bit tensor-core MMAs read both operands K-major); False is refused.

    Returns:
        y, (total_m, N) in out_dtype, of a's library; rows no group covers are left unwritten. Groups of 0 rows are
        fine; at most 4096 groups per call. Needs sm_90 (H100 / H200) and 16-byte aligned bases with row and group
        strides that are multiples of 16 bytes.

    Raises:
        InputError: a dtype other than float8_e4m3fn for a / b or fp32 for the scales, K not a multiple of 16,
            shapes that disagree, scales that are not the block shapes above, group_offsets not int32 (G + 1,)
            beside a, more than 4096 groups, trans_b=False, or a bad out_dtype; what the kernel's 32-bit indexing
            cannot reach: N or K of 2^31 or more (TMA coordinates), more than 2^31 - 257 rows, about 2^31 output
            tiles of 64 x 128, a scale tensor spanning
            more than 2^32 elements or with a negative stride (split the call, or copy the scales).
        UnsupportedRequestError: no kernel serves the request on this device (GPUs other than sm_90, unaligned
            operands; RTCKERN_DISABLE_OPS naming the op).
    """
    return _call("contiguous", a, b, a_scale, b_scale, group_offsets, out_dtype, trans_b)


def grouped_gemm_fp8_masked(a, b, a_scale, b_scale, masked_m, out_dtype="bf16", trans_b: bool = True):
    """Grouped fp8 matrix multiply with block scales over masked groups of a fixed capacity (MoE decode):
    y[g, :masked_m[g]] = (a * a_scale)[g, :masked_m[g]] @ (b[g] * b_scale[g])^T, fp32 accumulation promoted every
    128 K.

    Args:
        a: (G, capacity, K) float8_e4m3fn, K contiguous: each group's rows, the first masked_m[g] of them valid.
        b: (G, N, K) float8_e4m3fn, K contiguous; K a positive multiple of 16.
        a_scale: fp32 (G, capacity, ceil(K/128)), any strides: one scale per 1 x 128 group of a's rows.
        b_scale: fp32 (G, ceil(N/128), ceil(K/128)), any strides: one scale per 128 x 128 block of each b[g].
        masked_m: int32 (G,) in device memory, beside a: the valid rows of each group. Never read on the host
            (CUDA-graph capturable); values outside [0, capacity] are clamped on the device.
        out_dtype: bf16 (default), fp16 or fp32.
        trans_b: must be True (8-bit tensor-core MMAs read both operands K-major); False is refused.

    Returns:
        y, (G, capacity, N) in out_dtype, of a's library; rows from masked_m[g] on are left unwritten. Kernels and
        limits as grouped_gemm_fp8.

    Raises:
        InputError: a dtype other than float8_e4m3fn for a / b or fp32 for the scales, K not a multiple of 16,
            shapes that disagree, scales that are not the block shapes above, masked_m not int32 (G,) beside a,
            more than 4096 groups, trans_b=False, or a bad out_dtype; the 32-bit limits of grouped_gemm_fp8.
        UnsupportedRequestError: no kernel serves the request on this device (GPUs other than sm_90, unaligned
            operands; RTCKERN_DISABLE_OPS naming the op).
    """
    return _call("masked", a, b, a_scale, b_scale, masked_m, out_dtype, trans_b)


def _call(mode: str, a, b, a_scale, b_scale, index, out_dtype, trans_b):
    tt = _torch_types()
    if type(a) in tt and type(b) in tt and type(a_scale) in tt and type(b_scale) in tt and type(index) in tt:
        pa, pb = a.data_ptr(), b.data_ptr()
        key = (mode, a.dtype, a.shape, a.stride(), a.device, b.dtype, b.shape, b.stride(), b.device,
               not (pa | pb) & 15, a_scale.dtype, a_scale.shape, a_scale.stride(), a_scale.device, b_scale.dtype,
               b_scale.shape, b_scale.stride(), b_scale.device, index.dtype, index.shape, index.stride(),
               index.device, out_dtype, trans_b)
        p = current_plan(plan.plans, key)
        if p is not None:
            return p.run_torch(pa, pb, a_scale.data_ptr(), b_scale.data_ptr(), index.data_ptr())
        mats = _wrap(mode, a, b, a_scale, b_scale, index)
        p = _build(mode, *mats, out_dtype, trans_b)
        try:
            plan.plans.put(key, p)
        except TypeError:  # an unhashable out_dtype / trans_b that the checks accepted: no memo
            pass
        return p.run_mats(*mats)
    mats = _wrap(mode, a, b, a_scale, b_scale, index)
    return _build(mode, *mats, out_dtype, trans_b).run_mats(*mats)


def _wrap(mode, a, b, a_scale, b_scale, index):
    return (arr.wrap(a, "a"), arr.wrap(b, "b"), arr.wrap(a_scale, "a_scale"), arr.wrap(b_scale, "b_scale"),
            arr.wrap(index, shared.INDEX[mode][0]))


def _strides(x: arr.DeviceArray) -> tuple[int, ...]:
    """Element strides with 0 for dimensions of size 1 (any stride reads the one element)."""
    return tuple(st if sz > 1 else 0 for sz, st in zip(x.shape, x.strides))


# The kernel's 32-bit indexing (the registers of its 128 x 256 tiles allow no more): rows and box ends in int (a
# tile's last box ends up to 256 rows past its first row), work tiles in int (a block's next tile is up to a grid
# past the last), scale rows as unsigned offsets from the scales' bases.
MAX_ROWS = 2 ** 31 - 1 - 256
MAX_TILES = 2 ** 31 - 2 ** 16
MAX_SCALE_SPAN = 2 ** 32


def _check_32bit_indexing(mode: str, groups: int, rows: int, n: int, k: int, SA, SB, op: str) -> None:
    """Bound what the kernel indexes in 32 bits: N and K (TMA coordinates), rows, work tiles (for the smallest tile
    any config uses, 64 x 128) and the scales' element offsets (non-negative strides, spans below 2^32)."""
    why = tma_coordinates_reason(n=n, k=k)
    if why:
        raise InputError(f"{op}: {why}")
    what = "capacity" if mode == "masked" else "total_m"
    if rows > MAX_ROWS:
        raise InputError(f"{op}: {what}={rows}; the kernel indexes rows in 32 bits (at most {MAX_ROWS}): split the "
                         "call")
    tiles = shared.m_tiles_bound(mode, groups, rows, 64) * math.ceil(n / 128)
    if tiles > MAX_TILES:
        raise InputError(f"{op}: up to {tiles} output tiles of 64 x 128 for {groups} groups, {what}={rows}, N={n}; "
                         f"the kernel indexes at most {MAX_TILES}: split the groups or N over several calls")
    for S, name in ((SA, "a_scale"), (SB, "b_scale")):
        if any(st < 0 for st in S.strides):
            raise InputError(f"{name} has strides {S.strides}; {op} takes scales with non-negative strides (pass "
                             f"{name}.copy() or a contiguous array)")
        span = 1 + sum((sz - 1) * st for sz, st in zip(S.shape, S.strides) if sz > 0)
        if span > MAX_SCALE_SPAN:
            raise InputError(f"{name} spans {span} fp32 elements (shape {S.shape}, strides {S.strides}); {op} reaches "
                             f"scales by 32-bit offsets (at most {MAX_SCALE_SPAN}): split the call")


def _build(mode: str, A, B, SA, SB, I, out_dtype, trans_b) -> plan.Plan:
    """Validate one call signature and prepare its launch."""
    settings = config.settings()
    masked = mode == "masked"
    op = "grouped_gemm_fp8_masked" if masked else "grouped_gemm_fp8"
    if not trans_b:
        raise InputError(f"{op} takes b as (G, N, K) with K contiguous (trans_b=True) only: 8-bit tensor-core MMAs "
                         "read both operands K-major. For (G, K, N) weights w pass w.transpose(1, 2).contiguous() "
                         "(once, offline)")
    if A.ndim != (3 if masked else 2) or B.ndim != 3:
        want = "(G, capacity, K)" if masked else "(total_m, K)"
        raise InputError(f"a has shape {A.shape} and b {B.shape}; {op} takes a {want} and b (G, N, K)")
    for X, name in ((A, "a"), (B, "b")):
        if X.dtype != "fp8_e4m3":
            raise InputError(f"{name} is {X.dtype}; {op} takes float8_e4m3fn a and b (quantize with "
                             "rtckern.ops.quantize_fp8 or x.to(torch.float8_e4m3fn)); bf16 / fp16 inputs: "
                             "rtckern.ops.grouped_gemm")
        if X.strides[-1] != 1 and X.shape[-1] > 1:
            raise InputError(f"{name} has shape {X.shape} and strides {X.strides}: K must be contiguous; pass "
                             f"{name}.contiguous()")
        arr.check_same_place(A, X, "a", name)
    groups, n, kb = B.shape
    if masked and A.shape[0] != groups:
        raise InputError(f"a has {A.shape[0]} groups {A.shape} but b has {groups} {B.shape}; they must match")
    rows, k = A.shape[-2], A.shape[-1]
    if k != kb:
        raise InputError(f"inner dimensions disagree: a {A.shape} has K={k}, b {B.shape} (G, N, K) has K={kb}")
    why = geometry.k_reason(k, op)
    if why:
        raise InputError(why)
    out_dt = parse_dtype(out_dtype, "out_dtype", geometry.OUTPUT_DTYPES)
    kblocks, nblocks = geometry.kb_count(k), math.ceil(n / geometry.SCALE_BLOCK)
    want_sa = (groups, rows, kblocks) if masked else (rows, kblocks)
    for S, name, want in ((SA, "a_scale", want_sa), (SB, "b_scale", (groups, nblocks, kblocks))):
        if S.dtype != "fp32":
            raise InputError(f"{name} is {S.dtype}; scales must be float32")
        arr.check_same_place(A, S, "a", name)
        if tuple(S.shape) != want:
            raise InputError(f"a_scale has shape {SA.shape} and b_scale {SB.shape} for G={groups}, "
                             f"{'capacity' if masked else 'total_m'}={rows}, N={n}, K={k}; {op} takes block scales: "
                             f"a_scale {want_sa} (1x128 groups of a's rows) and b_scale {(groups, nblocks, kblocks)} "
                             "(128x128 blocks of each group's b)")
    shared.check_group_index(I, mode, groups, A)
    shared.check_sizes(groups, A.shape[-2], op)
    _check_32bit_indexing(mode, groups, rows, n, k, SA, SB, op)
    out_shape = (groups, rows, n) if masked else (rows, n)
    if rows == 0 or n == 0 or groups == 0:
        return OutputPlan(settings, A, out_shape, out_dt, None)
    lda = A.strides[-2] if rows > 1 else k
    stride_a = (A.strides[0] if groups > 1 else rows * lda) if masked else 0
    ldb = B.strides[1] if n > 1 else k
    stride_b = B.strides[0] if groups > 1 else n * ldb
    aligned = not (A.ptr % 16 or B.ptr % 16 or lda % 16 or stride_a % 16 or ldb % 16 or stride_b % 16)
    sa = _strides(SA)
    sa = (sa[1], sa[2], sa[0]) if masked else (sa[0], sa[1], 0)  # (row, K block, group)
    sb = _strides(SB)
    dev = DeviceInfo.from_device(A.device)
    p = gg.GroupedFp8Problem(mode=mode, groups=groups, rows=shared.rows_class(mode, rows, groups), n=n, k=k,
                             out_dtype=out_dt, aligned=aligned)
    sel = cands.selection(p, dev)
    lay = plan.Layout(rows=rows, lda=lda, stride_a=stride_a, ldb=ldb, stride_b=stride_b,
                      stride_c=rows * n if masked else 0, sa=sa, sb=(sb[1], sb[2], sb[0]))
    launch = plan.GroupedLaunch(sel.kernels[0], p, sel.candidate.config(sel.request), lay, dev.sm_count)
    return OutputPlan(settings, A, out_shape, out_dt, launch, sel.candidate.name)
