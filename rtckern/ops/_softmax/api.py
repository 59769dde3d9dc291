"""Softmax ops over the last dimension: plain, scaled + boolean mask, square causal, bottom-right causal; forward
and backward. The attention-score softmaxes of Megatron-style and TransformerEngine-style models.

    y = rtckern.ops.softmax(x, scale=1.0)                           # softmax(scale * x), any shape (..., N)
    y = rtckern.ops.scaled_masked_softmax(x, mask, scale)           # x (B, H, Sq, Sk), mask (B or 1, 1, Sq, Sk)
    y = rtckern.ops.scaled_upper_triang_masked_softmax(x, scale)    # x (..., S, S): key k kept iff k <= q
    y = rtckern.ops.scaled_aligned_causal_masked_softmax(x, scale)  # x (..., Sq, Sk): k kept iff k <= q + Sk - Sq
    dx = rtckern.ops.<op>_backward(y, dy, scale)                     # dx = scale * y * (dy - sum(y * dy))

Dtypes fp32, fp16, bf16 (inputs and outputs alike), math in fp32. The boolean mask is True where a key is masked
out. Masked keys contribute exactly zero and get exactly zero; a row whose keys are all masked (a fully masked
mask row, or a query above the causal diagonal when Sq > Sk) gives all zeros, not NaN, and a zero gradient. An
input of -inf counts as a masked key whatever the sign of the scale.

Outputs are new arrays of the input's library (torch in -> torch out, CuPy in -> CuPy out), launched on that
library's current stream.

Implementations (registry candidates `<op>.ring` (sm_90+), `<op>.onepass`, then `<op>.online`; configs from the
tuning tables of each mask kind (`softmax`, `softmax_masked`, `softmax_causal`, `softmax_backward`,
`softmax_backward_causal`, and the `softmax_ring...` ones), measured per (arch, SM count, dtype, vector width, N);
where both kernels were timed on the same problem the faster one serves the request):
- persistent blocks fed by bulk copies into a ring of shared-memory slots (`<op>.ring`, sm_90+, rows of 16-byte
  aligned vectors that fit the ring with room for the next chunk);
- one launch, row held on chip and read from device memory once: rows in registers plus a shared-memory stash
  (sm_90: up to ~130k bf16/fp16 or ~74k fp32 keys forward, ~74k bf16/fp16 or ~37k fp32 backward), or the whole
  row copied into shared memory with cp.async (forward, up to ~113k bf16/fp16 keys);
- one launch, two passes with the second read of the row served by L2 (any length);
- two launches over chunks (`<op>.online`): any length and any number of rows; reads the row twice.
"""
from __future__ import annotations

import numpy as np

from rtckern.dtypes import FLOATS
from rtckern.errors import InputError
from rtckern.runtime import arrays as arr
from rtckern.runtime.native import direct_front

from .._common import DIRECT_SLOTS, parse_number
from . import candidates as cands
from . import geometry, plan

__all__ = (
    "softmax", "softmax_backward", "scaled_masked_softmax", "scaled_masked_softmax_backward",
    "scaled_upper_triang_masked_softmax", "scaled_upper_triang_masked_softmax_backward",
    "scaled_aligned_causal_masked_softmax", "scaled_aligned_causal_masked_softmax_backward",
)


def _input(x, name: str, min_ndim: int = 1) -> arr.DeviceArray:
    a = arr.wrap(x, name)
    arr.check_dtype(a, name, FLOATS)
    if len(a.shape) < min_ndim:
        raise InputError(f"{name} has shape {a.shape} ({len(a.shape)} dims); this op needs at least {min_ndim}")
    arr.check_contiguous(a, name)
    return a


def _scale(scale) -> np.float32:
    return np.float32(parse_number(scale, "scale", "a Python float such as 1 / math.sqrt(head_dim)"))


def _run_forward(op: str, a: arr.DeviceArray, geom: geometry.RowGeometry, scale, mask: arr.DeviceArray | None,
                 objs: tuple):
    if geom.rows == 0 or geom.n == 0:
        return arr.empty(a, a.shape, a.dtype)[0]
    p = plan.Plan(op, a, geom, lambda: _scale(scale), mask is not None)
    if a.lib == "torch":
        plan.remember((op, objs[0], objs[1], scale), p, *objs)
    return p.forward(a.ptr, mask.ptr if mask is not None else 0)


def _run_backward(op: str, slot: int, y, dy, scale, geometry_of) -> object:
    """slot: the op's in DIRECT_SLOTS."""
    front = direct_front.call  # the torch plugin's native front, where loaded (its C++ replay; None: this path)
    if front is not None:
        dx = front(slot, y, dy, scale)
        if dx is not None:
            return dx
    p = plan.lookup(op, y, dy, scale)
    if p is not None:
        return p.fast(y, dy) if p.fast is not None else p.backward(y.data_ptr(), dy.data_ptr())
    ya = _input(y, "y")
    dya = _input(dy, "dy")
    arr.check_same_place(ya, dya, "y", "dy")
    if dya.shape != ya.shape:
        raise InputError(f"dy has shape {dya.shape} but y has {ya.shape}; they must match")
    if dya.dtype != ya.dtype:
        raise InputError(f"dy has dtype {dya.dtype} but y has {ya.dtype}; they must match")
    geom = geometry_of(ya)
    if geom.rows == 0 or geom.n == 0:
        return arr.empty(ya, ya.shape, ya.dtype)[0]
    p = plan.Plan(op, ya, geom, lambda: _scale(scale), False)
    if ya.lib == "torch":
        plan.remember((op, y, dy, scale), p, y, dy)
    return p.backward(ya.ptr, dya.ptr)


# ---- geometry of each op -------------------------------------------------------------------------------------
def _plain_geometry(a: arr.DeviceArray) -> geometry.RowGeometry:
    n = a.shape[-1] if a.shape else 1
    return geometry.RowGeometry(rows=a.numel // n if n else 0, n=n)


def _square_causal_geometry(a: arr.DeviceArray) -> geometry.RowGeometry:
    sq, sk = a.shape[-2], a.shape[-1]
    if sq != sk:
        raise InputError(f"scaled_upper_triang_masked_softmax needs square score matrices (Sq == Sk), got shape "
                         f"{a.shape} with Sq={sq}, Sk={sk}; use scaled_aligned_causal_masked_softmax for Sq != Sk")
    return geometry.RowGeometry(rows=a.numel // sk if sk else 0, n=sk, sq=max(sq, 1), diag_offset=0)


def _aligned_causal_geometry(a: arr.DeviceArray) -> geometry.RowGeometry:
    sq, sk = a.shape[-2], a.shape[-1]
    return geometry.RowGeometry(rows=a.numel // sk if sk else 0, n=sk, sq=max(sq, 1), diag_offset=sk - sq)


def _masked_geometry(a: arr.DeviceArray, mask: arr.DeviceArray | None) -> geometry.RowGeometry:
    b, h, sq, sk = a.shape
    mb = mask.shape[0] if mask is not None else b
    return geometry.RowGeometry(rows=b * h * sq, n=sk, sq=max(sq, 1), heads=max(h, 1),
                                mask_batch_stride=0 if mb == 1 else sq)


def _check_mask(a: arr.DeviceArray, mask) -> arr.DeviceArray:
    m = arr.wrap(mask, "mask")
    if m.dtype != "bool":
        raise InputError(f"mask has dtype {m.dtype}; it must be bool (True = masked out): pass mask.bool() or "
                         "mask != 0")
    b, _, sq, sk = a.shape
    if len(m.shape) != 4 or m.shape[1] != 1 or m.shape[2:] != (sq, sk) or m.shape[0] not in (1, b):
        raise InputError(f"mask has shape {m.shape}; for x of shape {a.shape} it must be ({b}, 1, {sq}, {sk}) or "
                         f"(1, 1, {sq}, {sk}) (broadcast over heads, and over the batch when its first dim is 1)")
    arr.check_same_place(a, m, "x", "mask")
    arr.check_contiguous(m, "mask")
    return m


def _at_least_2d(a: arr.DeviceArray, name: str) -> arr.DeviceArray:
    if len(a.shape) < 2:
        raise InputError(f"{name} has shape {a.shape} ({len(a.shape)} dims); this op needs at least 2 (..., Sq, Sk)")
    return a


# ---- docstrings -----------------------------------------------------------------------------------------------
# Every softmax op raises the same errors and returns its result the same way, and every backward takes the same
# arguments: those sections are written once here and joined into each op's docstring (help() shows the whole).
_RETURNS = """
    Returns:
        A new contiguous array of x's shape, dtype and library (torch in -> torch out, CuPy in -> CuPy out),
        computed on that library's current stream.
"""
_BACKWARD_ARGS_RETURNS = """
    Args:
        y: the forward's output, fp32 / fp16 / bf16, contiguous.
        dy: the gradient of y, y's shape and dtype.
        scale: the forward's scale.

    Returns:
        dx = scale * y * (dy - sum(y * dy)) over the last dimension, like y.
"""
_RAISES = """
    Raises:
        InputError: not a CUDA array, a dtype other than fp32 / fp16 / bf16, a non-contiguous array, a shape the op
            does not take, or a scale that is not a number.
        UnsupportedRequestError: no kernel serves the request on this device (e.g. RTCKERN_DISABLE_OPS names it).
    """


def _note(returns_note: str) -> str:
    return f"        {returns_note}\n" if returns_note else ""


def _forward_doc(summary: str, args: str, returns_note: str = "") -> str:
    """A forward's docstring: its summary and Args, the common Returns and the line this op adds to it, Raises."""
    return summary + "\n" + args + _RETURNS + _note(returns_note) + _RAISES


def _backward_doc(summary: str, returns_note: str = "") -> str:
    """A backward's docstring: its summary, the common Args and Returns and the line this op adds to it, Raises."""
    return summary + "\n" + _BACKWARD_ARGS_RETURNS + _note(returns_note) + _RAISES


def _with_doc(doc: str):
    """Decorator: set the function's docstring to `doc` (built above from the shared sections)."""
    def set_doc(fn):
        fn.__doc__ = doc
        return fn
    return set_doc


_MASKED_SLOT = DIRECT_SLOTS.index("scaled_masked_softmax")
_MASKED_BACKWARD_SLOT = DIRECT_SLOTS.index("scaled_masked_softmax_backward")


# ---- public ops -----------------------------------------------------------------------------------------------
def _unmasked(op: str, min_ndim: int, geometry_of, forward_doc: str, backward_doc: str):
    """The op `op` and `op`_backward for scores without a mask array (plain, or causal: the mask is the geometry).
    geometry_of(array) gives the rows' geometry and refuses a shape the op does not take; the forward takes x of at
    least `min_ndim` dims. Built here once for softmax and the two causal forms (the same code; as functions of
    their own, so the hot path pays no extra call)."""
    slot, backward_slot = DIRECT_SLOTS.index(op), DIRECT_SLOTS.index(op + "_backward")

    def forward(x, scale: float = 1.0):
        front = direct_front.call  # the torch plugin's native front, where loaded (its C++ replay; None: this path)
        if front is not None:
            y = front(slot, x, scale)
            if y is not None:
                return y
        p = plan.lookup(op, x, None, scale)
        if p is not None:
            return p.fast(x, None) if p.fast is not None else p.forward(x.data_ptr(), 0)
        a = _input(x, "x", min_ndim)
        return _run_forward(op, a, geometry_of(a), scale, None, (x, None))

    backward_geometry = geometry_of if min_ndim < 2 else (lambda a: geometry_of(_at_least_2d(a, "y")))

    def backward(y, dy, scale: float = 1.0):
        return _run_backward(op + "_backward", backward_slot, y, dy, scale, backward_geometry)

    for fn, name, doc in ((forward, op, forward_doc), (backward, op + "_backward", backward_doc)):
        fn.__name__ = fn.__qualname__ = name
        fn.__doc__ = doc
    return forward, backward


softmax, softmax_backward = _unmasked(
    "softmax", 1, _plain_geometry,
    _forward_doc("softmax(scale * x) over the last dimension, arithmetic in fp32.", """
    Args:
        x: (..., N), fp32 / fp16 / bf16, contiguous, any N (long rows take a two-pass kernel).
        scale: multiplies x before the softmax (e.g. 1 / sqrt(head_dim)); -inf entries count as masked keys
            whatever its sign, and a row of only -inf gives zeros.
"""),
    _backward_doc("Gradient of softmax(scale * x) with respect to x, from y = softmax(scale * x) and dy."))


@_with_doc(_forward_doc(
    "softmax(scale * x) over the last dimension with the keys where `mask` is True set to exactly zero.", """
    Args:
        x: (B, H, Sq, Sk) attention scores, fp32 / fp16 / bf16, contiguous.
        mask: bool (B, 1, Sq, Sk) or (1, 1, Sq, Sk), True where a key is masked out; broadcast over heads (and
            over the batch when its first dimension is 1); contiguous, on x's device.
        scale: multiplies x before the softmax.
""", "Masked keys get exactly zero and contribute nothing; a row whose keys are all masked gives zeros, not NaN."))
def scaled_masked_softmax(x, mask, scale: float = 1.0):
    front = direct_front.call  # the torch plugin's native front, where loaded (its C++ replay; None: this path)
    if front is not None:
        y = front(_MASKED_SLOT, x, mask, scale)
        if y is not None:
            return y
    p = plan.lookup("scaled_masked_softmax", x, mask, scale)
    if p is not None:
        return p.fast(x, mask) if p.fast is not None else p.forward(x.data_ptr(), mask.data_ptr())
    a = _input(x, "x")
    if len(a.shape) != 4:
        raise InputError(f"scaled_masked_softmax needs x of shape (B, H, Sq, Sk); got {a.shape}")
    m = _check_mask(a, mask)
    return _run_forward("scaled_masked_softmax", a, _masked_geometry(a, m), scale, m, (x, mask))


@_with_doc(_backward_doc(
    "Gradient of scaled_masked_softmax from its output y (exactly zero at masked keys, so no mask is needed).",
    "Masked keys (and fully masked rows) get exactly zero."))
def scaled_masked_softmax_backward(y, dy, scale: float = 1.0):
    return _run_backward("scaled_masked_softmax_backward", _MASKED_BACKWARD_SLOT, y, dy, scale, _plain_geometry)


scaled_upper_triang_masked_softmax, scaled_upper_triang_masked_softmax_backward = _unmasked(
    "scaled_upper_triang_masked_softmax", 2, _square_causal_geometry,
    _forward_doc("Causal softmax(scale * x) over square score matrices: key k of query q is kept iff k <= q.", """
    Args:
        x: (..., S, S), typically (B * H, S, S), fp32 / fp16 / bf16, contiguous. Sq != Sk is refused: use
            scaled_aligned_causal_masked_softmax.
        scale: multiplies x before the softmax.
""", "Keys above the diagonal are exactly zero (and never read)."),
    _backward_doc("Gradient of scaled_upper_triang_masked_softmax; keys above the diagonal get exactly zero."))

scaled_aligned_causal_masked_softmax, scaled_aligned_causal_masked_softmax_backward = _unmasked(
    "scaled_aligned_causal_masked_softmax", 2, _aligned_causal_geometry,
    _forward_doc("Causal softmax(scale * x) aligned to the bottom-right corner: key k of query q is kept iff "
                 "k <= q + Sk - Sq.", """
    Args:
        x: (..., Sq, Sk), fp32 / fp16 / bf16, contiguous (Sq == Sk is the usual causal mask).
        scale: multiplies x before the softmax.
""", "Masked keys are exactly zero; with Sq > Sk the first Sq - Sk queries keep no key and give zeros."),
    _backward_doc("Gradient of scaled_aligned_causal_masked_softmax; masked keys get exactly zero."))


cands.register_all()
