"""fp8 GEMM and per-token-group fp8 quantization.

    y = rtckern.ops.gemm_fp8(a, b, a_scale, b_scale, out_dtype=torch.bfloat16, bias=None, trans_b=True)

a (M, K) and b (N, K), both float8_e4m3fn with K contiguous (b in nn.Linear's (out, in) layout: trans_b=True is
the only layout; 8-bit tensor-core MMAs read both operands K-major). y = (a * sa) @ (b * sb)^T (+ bias), fp32
accumulation, output bf16 / fp16 / fp32 (M, N). Scales are fp32, their granularity inferred from their shapes:
    per tensor       a_scale and/or b_scale with one element (a 0-d tensor, shape (1,) or (1, 1))
    per channel      a_scale (M,) or (M, 1): one per row of a; b_scale (N,) or (N, 1): one per row of b (an output
                     column); either may be per tensor instead
    blocks           a_scale (M, ceil(K/128)): 1 x 128 groups of a's rows (any strides: row-major, or the
                     column-major TMA-aligned layout of quantize_fp8(..., scale_format="col_tma")); b_scale
                     (ceil(N/128), ceil(K/128)): 128 x 128 blocks of b. Both or neither are block scales.
Any M, N >= 1; K a positive multiple of 16 (a ragged last K block of 16..112 is fine with block scales: its scales
are the last column). bias: (N,) bf16 / fp16 / fp32. Needs an sm_89+ GPU (fp8 conversions); sm_90 (H100 / H200)
takes the wgmma kernel when a's and b's bases are 16-byte aligned, others the CUDA-core fallback.

    q, scales = rtckern.ops.quantize_fp8(x, group=128, scale_format="row")

x (M, K) fp32 / fp16 / bf16 with contiguous, 16-byte aligned rows (a contiguous tensor's always are), K a multiple of
group (32, 64, 128 or 256), fewer than 2^31 groups. scales = amax(|group|) / 448 (1 for an all-zero group),
q = x * (1 / scale) as e4m3, rounded to nearest even and saturated to +-448 (never NaN for finite x). scales
(M, K / group) fp32: row-major ("row") or column-major with M padded to a multiple of 4 ("col_tma", DeepGEMM's
TMA-aligned layout: strides (1, ceil(M/4)*4)), which gemm_fp8 reads as a_scale.
Torch tensors only.
"""
from __future__ import annotations

import sys

from rtckern import config
from rtckern.device import DeviceInfo
from rtckern.dtypes import itemsize, parse_dtype
from rtckern.errors import InputError
from rtckern.runtime import arrays as arr
from rtckern.runtime.native import direct_front

from . import candidates as cands
from . import geometry, plan
from .._common import DIRECT_SLOTS, OutputPlan
from .geometry import Fp8Problem
from .launch import GemmLaunch, QuantLaunch

__all__ = ("gemm_fp8", "quantize_fp8", "grouped_gemm_fp8", "grouped_gemm_fp8_masked")

cands.register_all()
SCALE_FORMATS = ("row", "col_tma")


def _torch_types() -> frozenset:
    torch = sys.modules.get("torch")
    return frozenset((torch.Tensor, torch.nn.Parameter)) if torch is not None and hasattr(torch, "nn") else frozenset()


_GEMM_SLOT, _QUANT_SLOT = DIRECT_SLOTS.index("gemm_fp8"), DIRECT_SLOTS.index("quantize_fp8")


def gemm_fp8(a, b, a_scale, b_scale, out_dtype="bf16", bias=None, trans_b: bool = True):
    """fp8 matrix multiply: y = (a * a_scale) @ (b * b_scale)^T (+ bias), fp32 accumulation.

    Args:
        a: (M, K) float8_e4m3fn (or float8_e5m2, as gradients are in fp8 training), K contiguous, any M >= 1.
        b: (N, K) float8_e4m3fn, K contiguous (nn.Linear's (out, in) layout); K a positive multiple of 16.
        a_scale, b_scale: fp32 scales whose shapes give their granularity: one element (a 0-d tensor, (1,) or
            (1, 1)) per tensor; (M,) / (M, 1) and (N,) / (N, 1) per channel (either may be per tensor instead);
            block scales a_scale (M, ceil(K/128)) for 1 x 128 groups of a (row-major, or quantize_fp8's "col_tma"
            layout) with b_scale (ceil(N/128), ceil(K/128)) for 128 x 128 blocks of b (both or neither).
        out_dtype: bf16 (default), fp16 or fp32.
        bias: (N,) bf16 / fp16 / fp32, or None.
        trans_b: must be True (8-bit tensor-core MMAs read both operands K-major); False is refused.

    Returns:
        y, (M, N) in out_dtype, of a's library. With a's and b's bases 16-byte aligned, M = 1 with K >= 2048 takes a
        GEMV kernel (warps streaming whole rows of b) where its blocks fill the SMs; on sm_90, 2 <= M <= 32 (and M = 1
        with K >= 2048 on weights of 96 MiB and more) a streaming kernel (b's rows by cp.async into wgmma) where its
        64-row blocks fill the SMs (up to M = 64 with per-tensor or per-channel scales where they are two per SM),
        else the wgmma tile kernel (split over K in thread-block clusters for decode shapes whose tiles would leave
        SMs idle); other sm_89+ GPUs an mma.sync kernel (streaming b for M <= 64, 64 x 64 tiles above); unaligned
        bases a CUDA-core kernel.

    Raises:
        InputError: a GPU older than sm_89 (no fp8), a dtype other than float8_e4m3fn / float8_e5m2 for a,
            float8_e4m3fn for b or fp32 for the scales, K not a multiple of 16, shapes that disagree, scale shapes of
            no supported granularity, or a bad bias / out_dtype.
        UnsupportedRequestError: no kernel serves the request on this device (RTCKERN_DISABLE_OPS names the op).
    """
    front = direct_front.call  # the torch plugin's native front, where loaded (its C++ replay; None: this path)
    if front is not None and type(out_dtype) is str and out_dtype == "bf16":  # (its op's out_dtype None: bf16)
        y = front(_GEMM_SLOT, a, b, a_scale, b_scale, None, bias, trans_b)
        if y is not None:
            return y
    tt = _torch_types()
    if type(a) in tt and type(b) in tt and type(a_scale) in tt and type(b_scale) in tt and \
            (bias is None or type(bias) in tt):
        pa, pb = a.data_ptr(), b.data_ptr()
        # every array's device: a hit skips the checks that refuse a CPU or another GPU's operand
        key = (a.dtype, a.shape, a.stride(), a.device, b.dtype, b.shape, b.stride(), b.get_device(),
               not (pa | pb) & 15, a_scale.dtype, a_scale.shape, a_scale.stride(), a_scale.get_device(),
               b_scale.dtype, b_scale.shape, b_scale.stride(), b_scale.get_device(),
               None if bias is None else (bias.dtype, bias.shape, bias.stride(), bias.get_device()), out_dtype,
               trans_b)
        try:
            p = plan.plans.get(key)
        except TypeError:
            p, key = None, None
        if p is not None and p.settings is config.settings():
            return p.run_torch(pa, pb, a_scale.data_ptr(), b_scale.data_ptr(), 0 if bias is None else bias.data_ptr())
        mats = _wrap(a, b, a_scale, b_scale, bias)
        p = _build(*mats, out_dtype, trans_b)
        if key is not None:
            plan.plans.put(key, p)
        return p.run_mats(*mats)
    mats = _wrap(a, b, a_scale, b_scale, bias)
    return _build(*mats, out_dtype, trans_b).run_mats(*mats)


def _wrap(a, b, a_scale, b_scale, bias):
    return (arr.wrap(a, "a"), arr.wrap(b, "b"), arr.wrap(a_scale, "a_scale"), arr.wrap(b_scale, "b_scale"),
            arr.wrap(bias, "bias") if bias is not None else None)


def check_fp8_device(ordinal: int, op: str) -> DeviceInfo:
    dev = DeviceInfo.from_device(ordinal)
    if dev.arch.gfx or dev.arch.cc < (8, 9):
        raise InputError(f"{op} needs an NVIDIA GPU of compute capability 8.9 or newer (sm_89: Ada, sm_90: "
                         f"H100/H200) for fp8; device {ordinal} is {dev.arch}. Dequantize to bf16 and use "
                         "rtckern.ops.gemm on this GPU")
    return dev


def scale_layout(m: int, n: int, k: int, a_shape: tuple, a_strides: tuple, b_shape: tuple,
                 b_strides: tuple) -> tuple[str, tuple[int, int, int, int]]:
    """(granularity, (sa_row, sa_kb, sb_row, sb_kb)) of scales with these shapes and element strides; InputError
    naming what was given and what is accepted otherwise."""
    kb = geometry.kb_count(k)
    nb = (n + 127) // 128

    def vec(shape, strides):
        if len(shape) == 0:
            return 1, 0
        if len(shape) == 1 or (len(shape) == 2 and shape[1] == 1):
            return shape[0], strides[0] if shape[0] > 1 else 0
        return -1, 0

    la, sa_row = vec(a_shape, a_strides)
    lb, sb_row = vec(b_shape, b_strides)
    if la in (1, m) and lb in (1, n):
        gran = "tensor" if la == 1 and lb == 1 else "channel"
        return gran, (sa_row if la > 1 else 0, 0, sb_row if lb > 1 else 0, 0)
    if tuple(a_shape) == (m, kb) and tuple(b_shape) == (nb, kb):
        return "block", (a_strides[0] if m > 1 else 0, a_strides[1] if kb > 1 else 0,
                         b_strides[0] if nb > 1 else 0, b_strides[1] if kb > 1 else 0)
    raise InputError(
        f"a_scale has shape {tuple(a_shape)} and b_scale {tuple(b_shape)} for M={m}, N={n}, K={k}; supported: per "
        f"tensor (one element each), per channel (a_scale ({m},) or ({m}, 1), b_scale ({n},) or ({n}, 1); either "
        f"may be per tensor), or blocks (a_scale ({m}, {kb}): 1x128 groups, b_scale ({nb}, {kb}): 128x128 blocks)")


def _build(A, B, SA, SB, Bi, out_dtype, trans_b) -> OutputPlan:
    settings = config.settings()
    if not trans_b:
        raise InputError("gemm_fp8 takes b as (N, K) with K contiguous (trans_b=True) only: 8-bit tensor-core MMAs "
                         "read both operands K-major. For a (K, N) weight w pass w.t().contiguous() (once, offline)")
    if A.ndim != 2 or B.ndim != 2:
        raise InputError(f"a has shape {A.shape} and b {B.shape}; gemm_fp8 takes a (M, K) and b (N, K)")
    for X, name, allowed in ((A, "a", geometry.INPUT_DTYPES), (B, "b", ("fp8_e4m3",))):
        if X.dtype not in allowed:
            raise InputError(f"{name} is {X.dtype}; gemm_fp8 takes a float8_e4m3fn (or float8_e5m2: gradients) and b "
                             "float8_e4m3fn (quantize with rtckern.ops.quantize_fp8 or x.to(torch.float8_e4m3fn))")
        if X.strides[-1] != 1 and X.shape[-1] > 1:
            raise InputError(f"{name} has shape {X.shape} and strides {X.strides}: K must be contiguous (trans_b=True "
                             f"layout, K-major); pass {name}.contiguous()")
        arr.check_same_place(A, X, "a", name)
    m, k = A.shape
    n, kb = B.shape
    if k != kb:
        raise InputError(f"inner dimensions disagree: a {A.shape} has K={k}, b {B.shape} (N, K) has K={kb}")
    why = geometry.k_reason(k, "gemm_fp8")
    if why:
        raise InputError(why)
    out_dt = parse_dtype(out_dtype, "out_dtype", geometry.OUTPUT_DTYPES)
    for S, name in ((SA, "a_scale"), (SB, "b_scale")):
        if S.dtype != "fp32":
            raise InputError(f"{name} is {S.dtype}; scales must be float32")
        arr.check_same_place(A, S, "a", name)
    gran, strides = scale_layout(m, n, k, SA.shape, SA.strides, SB.shape, SB.strides)
    bias_dt = "none"
    if Bi is not None:
        if Bi.shape != (n,) or Bi.dtype not in geometry.BIAS_DTYPES or (n > 1 and Bi.strides[0] != 1):
            raise InputError(f"bias has shape {Bi.shape}, dtype {Bi.dtype}; expected a contiguous ({n},) array of "
                             f"bf16, fp16 or fp32")
        arr.check_same_place(A, Bi, "a", "bias")
        bias_dt = Bi.dtype
    dev = check_fp8_device(A.device, "gemm_fp8")
    if m == 0 or n == 0:
        return OutputPlan(settings, A, (m, n), out_dt, None)
    lda, ldb = A.strides[0] if m > 1 else k, B.strides[0] if n > 1 else k
    if lda < k or ldb < k:
        raise InputError(f"a has strides {A.strides} and b {B.strides}: gemm_fp8 takes rows at a positive stride of "
                         f"at least K={k} elements (rows that do not overlap); pass a.contiguous() / b.contiguous()")
    aligned = not (A.ptr % 16 or B.ptr % 16 or lda % 16 or ldb % 16)
    p = Fp8Problem(m=m, n=n, k=k, scale=gran, out_dtype=out_dt, bias=bias_dt, aligned=aligned, dtype=A.dtype)
    sel = cands.selection((p, A.device), lambda: cands.request(p, dev))
    cfg = sel.candidate.config(sel.request) \
        if isinstance(sel.candidate, (cands.Sm90aWgmmaCandidate, cands.GeometryCandidate)) \
        else None
    launch = GemmLaunch(sel.kernels[0], p, cfg, lda, ldb, strides, dev.sm_count)
    return OutputPlan(settings, A, (m, n), out_dt, launch, sel.candidate.name)


def quantize_fp8(x, group: int = 128, scale_format: str = "row"):
    """Per-token-group fp8 quantization (DeepSeek-V3 style), the producer of gemm_fp8's block-scaled a.

    Args:
        x: (M, K) torch CUDA tensor, fp32 / fp16 / bf16, contiguous rows on 16-byte aligned addresses (those of a
            contiguous tensor are); K a multiple of group and under 2^32; fewer than 2^31 groups in all.
        group: columns per scale: 32, 64, 128 or 256.
        scale_format: "row" (scales (M, K / group) row-major) or "col_tma" (column-major with M padded to a
            multiple of 4, strides (1, ceil(M/4)*4): DeepGEMM's TMA-aligned layout, which gemm_fp8 reads fastest).

    Returns:
        (q, scales): q float8_e4m3fn (M, K); scales fp32 (M, K / group) with scale = amax(|group|) / 448 (1 for an
        all-zero group), q = x * (1 / scale) rounded to nearest even and saturated to +-448 (never NaN for finite
        x).

    Raises:
        InputError: x not a torch tensor, not 2-D, a dtype it does not take, K not a multiple of group, rows not
            contiguous and 16-byte aligned, 2^31 groups or more, K of 2^32 or more, an unsupported group or
            scale_format, or a GPU older than sm_89.
        UnsupportedRequestError: no kernel serves the request on this device (RTCKERN_DISABLE_OPS names the op).
    """
    front = direct_front.call  # the torch plugin's native front, where loaded (its C++ replay; None: this path)
    if front is not None:
        out = front(_QUANT_SLOT, x, group, scale_format)
        if out is not None:
            return out
    tt = _torch_types()
    if type(x) not in tt:
        raise InputError(f"quantize_fp8 takes a torch tensor; got {type(x).__name__}")
    # group by type and value (128.0 == 128, which the slow path refuses); the address mod 32: fp32's 256-groups
    key = (x.dtype, x.shape, x.stride(), x.device, x.data_ptr() % 32, type(group), group, scale_format)
    try:
        p = plan.plans.get(key)
    except TypeError:
        p, key = None, None
    if p is None or p.settings is not config.settings():
        p = _build_quant(arr.wrap(x, "x"), group, scale_format)
        if key is not None:
            plan.plans.put(key, p)
    return p.run_torch(x.data_ptr())


def _build_quant(X, group, scale_format) -> plan.QuantPlan:
    settings = config.settings()
    if scale_format not in SCALE_FORMATS:
        raise InputError(f"scale_format={scale_format!r} is not supported; pass 'row' ((M, K/group) row-major) or "
                         "'col_tma' (column-major, M padded to 4: the layout gemm_fp8's block scales read fastest)")
    if not isinstance(group, int) or group not in geometry.QUANT_GROUPS:
        raise InputError(f"group={group!r} is not supported; supported: {', '.join(map(str, geometry.QUANT_GROUPS))}")
    if X.dtype not in geometry.QUANT_DTYPES:
        raise InputError(f"x is {X.dtype}; quantize_fp8 takes float32, float16 or bfloat16")
    if X.ndim != 2:
        raise InputError(f"x has shape {X.shape}; quantize_fp8 takes (M, K) (reshape tokens to rows first)")
    m, k = X.shape
    if k % group:
        raise InputError(f"K={k} is not a multiple of group={group}; pick a group that divides K")
    v_bytes = max(16 // X.itemsize, group // 32) * X.itemsize  # a lane's vector (quantize_fp8.cuh)
    ldx = X.strides[0] if m > 1 else k
    if (X.strides[1] != 1 and k > 1) or X.ptr % v_bytes or (ldx * X.itemsize) % v_bytes:
        raise InputError(f"x has strides {X.strides} at address {X.ptr:#x}: rows must be contiguous and aligned to "
                         f"{v_bytes} bytes; pass x.contiguous()")
    groups = k // group
    if m * groups >= 2**31:  # the kernel indexes groups in 32 bits
        raise InputError(f"x {X.shape} has {m * groups} groups of {group}; quantize_fp8 takes fewer than 2^31 per "
                         "call: quantize its rows in chunks")
    if k >= 2**32:  # and a group's first column in 32 bits (unsigned)
        raise InputError(f"x {X.shape} has rows of K={k}; quantize_fp8 takes K under 2^32: quantize column blocks "
                         "of the rows apart")
    dev = check_fp8_device(X.device, "quantize_fp8")
    if scale_format == "row":
        s_alloc, s_strides, s_row, s_col = (m, groups), (groups, 1), groups, 1
    else:
        mp = geometry.tma_aligned_rows(m)
        s_alloc, s_strides, s_row, s_col = (groups, mp), (1, mp), 1, mp
    if m == 0 or k == 0:
        return plan.QuantPlan(settings, X, m, k, s_alloc, (m, groups), s_strides, None)
    sel = cands.selection(("quant", X.dtype, group, m, k, X.device),
                          lambda: cands.quant_request(X.dtype, group, m, k, dev))
    launch = QuantLaunch(sel.kernels[0], m, k, group, ldx, s_row, s_col, itemsize(X.dtype))
    return plan.QuantPlan(settings, X, m, k, s_alloc, (m, groups), s_strides, launch)


from .grouped import grouped_gemm_fp8, grouped_gemm_fp8_masked  # noqa: E402  (the grouped ops, exported with gemm_fp8)
