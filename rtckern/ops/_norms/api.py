"""RMSNorm and LayerNorm over the last dimension, forward and backward.

    y = rms_norm(x, weight, eps=1e-6)                       # y = x * rstd * weight
    y, h = rms_norm(x, weight, residual=r)                  # h = x + r (x's dtype); y = rms_norm(h)
    y, rstd = rms_norm(x, weight, return_rstd=True)          # rstd: fp32, shape x.shape[:-1]
    y = layer_norm(x, weight, bias, eps=1e-5)
    y, mean, rstd = layer_norm(x, weight, bias, return_stats=True)
    dx, dweight = rms_norm_backward(dy, x, weight, rstd)    # x: the normalized input (h with a residual)
    q, scales = rms_norm_quant(x, weight, eps, group=128)   # fp8 e4m3 + per-group scales in one pass (quant.py)
    dx, dweight, dbias = layer_norm_backward(dy, x, weight, bias, mean, rstd)

Options: zero_centered=True stores the weight as gamma - 1 (y = x_hat * (1 + weight)); out_dtype / dx_dtype
pick the output dtype; the weight (and bias) may be fp32 with fp16/bf16 activations; dresidual= adds a gradient
arriving for h into dx. Storage fp32, fp16 or bf16; arithmetic in fp32. Any N >= 1; rows may be strided (the last
dimension must be contiguous); zero rows launch nothing. The same inputs give bitwise the same outputs, dweight
included, on a given device. Torch tensors in give torch tensors out, CuPy arrays give CuPy arrays.
"""
from __future__ import annotations

import math
from typing import Any

from rtckern.caches import PlanCache
from rtckern.config import settings
from rtckern.device import DeviceInfo
from rtckern.dtypes import FLOATS, TABLE, parse_dtype
from rtckern.errors import InputError
from rtckern.registry import OpRequest, select
from rtckern.runtime import arrays as arr
from rtckern.runtime.native import direct_front

from .._common import DIRECT_SLOTS, current_plan, parse_number
from . import plan

__all__ = ("rms_norm", "layer_norm", "rms_norm_backward", "layer_norm_backward", "rms_norm_quant")

# The decided (request, candidate, kernels) per (op, dtypes, n, vec, flags, device): what the plans of
# plan.py ask once per alignment class.
_fast = PlanCache("norms.selections")


def _dtype_name(d: Any, what: str) -> str:
    return parse_dtype(d, what, default="x's dtype")


def _any_dtype(d: Any) -> str:
    """The canonical name of any dtype rtckern knows ("" when none): for errors that point elsewhere."""
    try:
        return parse_dtype(d, "dtype", TABLE)
    except InputError:
        return ""


def _eps(eps: Any) -> float:
    e = parse_number(eps, "eps", "a small positive float such as 1e-6")
    if not math.isfinite(e) or e < 0:
        raise InputError(f"eps={eps!r} must be finite and >= 0; pass a small positive float such as 1e-6")
    return e


def _rows(obj: Any, name: str) -> arr.Rows:
    return arr.rows(arr.wrap(obj, name), name)


def _check_x(x: Any, name: str = "x") -> arr.Rows:
    xa = _rows(x, name)
    arr.check_dtype(xa, name, FLOATS)
    if xa.n < 1:
        raise InputError(f"{name} has shape {xa.shape}: its last dimension is 0; the norms need N >= 1 columns")
    return xa


def _affine(weight: Any, bias: Any, xa: arr.Rows) -> tuple[arr.Rows | None, arr.Rows | None, str | None]:
    allowed = (xa.dtype,) if xa.dtype == "fp32" else (xa.dtype, "fp32")
    wa = ba = None
    if weight is not None:
        wa = _rows(weight, "weight")
        _check_vector(wa, xa, "weight", allowed)
    if bias is not None:
        ba = _rows(bias, "bias")
        _check_vector(ba, xa, "bias", (wa.dtype,) if wa is not None else allowed)
    w_dtype = wa.dtype if wa is not None else (ba.dtype if ba is not None else None)
    return wa, ba, w_dtype


def _check_vector(v: arr.Rows, x: arr.Rows, name: str, allowed: tuple[str, ...]) -> None:
    """A per-column parameter (weight, bias): shape (N,), dtype in `allowed`, same library and device as x."""
    arr.check_same_place(x, v, "x", name)
    if v.shape != (x.n,):
        raise InputError(f"{name} has shape {v.shape}; it must be ({x.n},), the size of x's last dimension "
                         f"(x has shape {x.shape})")
    if v.dtype not in allowed:
        raise InputError(f"{name} has dtype {v.dtype}; with x in {x.dtype} it must be one of {', '.join(allowed)}")


def _check_like(a: arr.Rows, x: arr.Rows, name: str, allowed: tuple[str, ...]) -> None:
    """An array with x's shape (residual, dy, dresidual)."""
    arr.check_same_place(x, a, "x", name)
    if a.shape != x.shape:
        raise InputError(f"{name} has shape {a.shape} but x has {x.shape}; they must match")
    if a.dtype not in allowed:
        raise InputError(f"{name} has dtype {a.dtype}; supported here: {', '.join(allowed)}")


def _check_stats(s: arr.Rows, x: arr.Rows, name: str) -> None:
    """Saved statistics (mean, rstd): fp32, one contiguous value per row of x."""
    arr.check_same_place(x, s, "x", name)
    if s.dtype != "fp32":
        raise InputError(f"{name} has dtype {s.dtype}; the saved statistics are fp32 (as the forward returns them)")
    if s.rows * s.n != x.rows or (s.rows > 1 and s.row_stride != s.n):
        raise InputError(f"{name} has shape {s.shape}; it must hold one contiguous value per row of x "
                         f"({x.rows} rows, x shape {x.shape})")


def _selector(n: int, device: int):
    """decide(op, dtypes, flags, vec) -> (request, candidate, kernels) for rows of n on device (the plans call it
    once per alignment class)."""
    def decide(op: str, dtypes: tuple, flags: tuple, vec: int) -> tuple:
        def build():
            return OpRequest(op=op, dtypes=dtypes, shape=(("n", n), ("vec", vec)), flags=flags,
                             device=DeviceInfo.from_device(device))
        return _decide((op, dtypes, n, vec, flags, device), build)
    return decide


def _decide(sig: tuple, build) -> tuple:
    """(request, candidate, kernels) for a call signature. The memo holds the settings object it was decided
    under (so its id cannot be reused) and decides again when the settings change (config.override)."""
    s = settings()
    hit = _fast.get(sig)
    if hit is None or hit[0] is not s:
        req = build()
        sel = select(req)
        hit = _fast.put(sig, (s, req, sel.candidate, sel.kernels))
    return hit[1:]


# ---- forward ----------------------------------------------------------------------------------------------------
_RMS_SLOT, _ADD_RMS_SLOT, _LN_SLOT = (DIRECT_SLOTS.index(n)
                                      for n in ("rms_norm", "fused_add_rms_norm", "layer_norm"))


def _forward(layer: bool, x, weight, bias, eps, residual, zero_centered, out_dtype, save_stats):
    front = direct_front.call  # the torch plugin's native front, where loaded (its C++ replay; None: this path)
    if front is not None and out_dtype is None and not save_stats:  # (the composite ops' arguments and results)
        if layer:
            y = None if residual is not None else front(_LN_SLOT, x, weight, bias, eps, zero_centered, None)
        elif residual is None:
            y = front(_RMS_SLOT, x, weight, eps, zero_centered, None)
        else:
            y = front(_ADD_RMS_SLOT, x, residual, weight, eps, zero_centered)
        if y is not None:
            return y
    # Hot path: a signature seen before (all torch tensors) runs its memoized plan; see plan.py.
    key = plan.fwd_key(layer, x, weight, bias, eps, residual, zero_centered, out_dtype, save_stats)
    if key is not None:
        call_plan = current_plan(plan.fwd_plans, key)
        if call_plan is not None:
            fast = call_plan.fast
            if fast is not None:
                return fast(x, weight, bias)
            return call_plan.run(x.data_ptr(), 0 if weight is None else weight.data_ptr(),
                                 0 if bias is None else bias.data_ptr(), 0 if residual is None else residual.data_ptr())
    op = "layer_norm" if layer else "rms_norm"
    xa = _check_x(x)
    wa, ba, w_dtype = _affine(weight, bias, xa)
    ra = None
    if residual is not None:
        ra = _rows(residual, "residual")
        _check_like(ra, xa, "residual", (xa.dtype,))
    if out_dtype is not None and _any_dtype(out_dtype).startswith("fp8"):
        raise InputError(f"{op} does not write fp8 (out_dtype={out_dtype}) alone: fp8 activations need per-group "
                         "scales; pass return_scales=True (rms_norm, e4m3, groups of 128) for (q, scales), or use "
                         "rtckern.ops.rms_norm_quant(x, weight, eps, group=...) for other groups and scale layouts")
    y_dtype = xa.dtype if out_dtype is None else _dtype_name(out_dtype, "out_dtype")
    e = _eps(eps)
    if xa.rows == 0:
        y, _ = arr.empty(xa, xa.shape, y_dtype)
        outs = [y] + ([arr.empty(xa, xa.shape, xa.dtype)[0]] if ra is not None else []) + \
            ([arr.empty(xa, xa.shape[:-1], "fp32")[0]] if (save_stats and layer) else []) + \
            ([arr.empty(xa, xa.shape[:-1], "fp32")[0]] if save_stats else [])
        return outs[0] if len(outs) == 1 else tuple(outs)
    call_plan = plan.fwd_plan(layer, op, xa, wa, ba, ra, y_dtype, e, zero_centered, save_stats,
                              _selector(xa.n, xa.device))
    if xa.lib == "torch":
        call_plan.like_x = y_dtype == xa.dtype and x.is_contiguous()
        for t in (x, weight, bias, residual):
            if t is not None:
                plan.remember_torch_type(t)
        key = plan.fwd_key(layer, x, weight, bias, eps, residual, zero_centered, out_dtype, save_stats)
        if key is not None:
            plan.store(plan.fwd_plans, key, call_plan)
    return call_plan.run(xa.ptr, wa.ptr if wa else 0, ba.ptr if ba else 0, ra.ptr if ra else 0)


def rms_norm(x: Any, weight: Any = None, eps: float = 1e-6, *, residual: Any = None, zero_centered: bool = False,
             out_dtype: Any = None, return_rstd: bool = False, return_scales: bool = False):
    """RMSNorm over the last dimension: y = x / sqrt(mean(x^2) + eps) * weight, arithmetic in fp32.

    Args:
        x: (..., N), fp32 / fp16 / bf16, N >= 1; rows may be strided, the last dimension must be contiguous.
        weight: (N,) in x's dtype or fp32, or None (no scaling).
        eps: added to the mean square, finite and >= 0.
        residual: x's shape and dtype, or None: h = x + residual (rounded to x's dtype) is normalized and returned.
        zero_centered: the weight is stored as gamma - 1 (y = x_hat * (1 + weight)), as in Gemma.
        out_dtype: y's dtype (fp32 / fp16 / bf16; a torch or numpy dtype or a name), default x's; fp8 e4m3
            (float8_e4m3fn) together with return_scales=True.
        return_rstd: also return rstd = 1 / sqrt(mean(h^2) + eps), fp32 of shape x.shape[:-1] (for the backward).
        return_scales: with out_dtype=float8_e4m3fn, normalize and quantize in one pass: (q, scales) with one fp32
            scale per 128 columns, row-major (M, N / 128), exactly rms_norm_quant(x, weight, eps,
            zero_centered=zero_centered); rms_norm_quant itself takes other groups and the column-major layout.
            Torch tensors on an sm_89+ GPU; no residual or rstd with it.

    Returns:
        y (x's shape) alone; (y, h) with a residual; rstd appended last with return_rstd: (y, rstd) or
        (y, h, rstd); (q, scales) with return_scales. Arrays of x's library (torch in -> torch out, CuPy in -> CuPy
        out), computed on its current stream; bitwise the same for the same inputs on a given device.

    Raises:
        InputError: an array that is not a CUDA array (torch tensor, CuPy array, or DLPack / CUDA-array-interface
            object), a dtype other than fp32 / fp16 / bf16, shapes that disagree, a last dimension that is not
            contiguous, or a bad eps / out_dtype (the message names the value and what is accepted).
        UnsupportedRequestError: no kernel serves the request on this device (RTCKERN_DISABLE_OPS names the op, or
            the GPU is older than every candidate's minimum).
    """
    if return_scales:
        return _quantized(x, weight, eps, residual, zero_centered, out_dtype, return_rstd)
    return _forward(False, x, weight, None, eps, residual, zero_centered, out_dtype, return_rstd)


def _quantized(x, weight, eps, residual, zero_centered, out_dtype, return_rstd):
    """rms_norm(..., out_dtype=float8_e4m3fn, return_scales=True): rms_norm_quant with groups of 128."""
    if out_dtype is None or _any_dtype(out_dtype) != "fp8_e4m3":
        raise InputError(f"return_scales=True goes with out_dtype=float8_e4m3fn (got out_dtype={out_dtype}): the "
                         "scales are those of fp8 e4m3 groups; drop return_scales for an unquantized y")
    if residual is not None or return_rstd:
        raise InputError("rms_norm with return_scales=True takes no residual and returns no rstd: add the residual "
                         "first (or call rms_norm(x, residual=...) and then quantize_fp8), and drop return_rstd")
    return rms_norm_quant(x, weight, eps, zero_centered=zero_centered)


def layer_norm(x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5, *, residual: Any = None,
               zero_centered: bool = False, out_dtype: Any = None, return_stats: bool = False):
    """LayerNorm over the last dimension: y = (x - mean) / sqrt(var + eps) * weight + bias, arithmetic in fp32.

    Args:
        x: (..., N), fp32 / fp16 / bf16, N >= 1; rows may be strided, the last dimension must be contiguous.
        weight, bias: (N,) in x's dtype or fp32 (both the same dtype), or None.
        eps: added to the variance, finite and >= 0.
        residual: x's shape and dtype, or None: h = x + residual (rounded to x's dtype) is normalized and returned.
        zero_centered: the weight is stored as gamma - 1 (y = x_hat * (1 + weight) + bias).
        out_dtype: y's dtype (fp32 / fp16 / bf16), default x's.
        return_stats: also return mean and rstd, fp32 of shape x.shape[:-1] (for the backward).

    Returns:
        y alone; (y, h) with a residual; mean, rstd appended last with return_stats: (y, mean, rstd) or
        (y, h, mean, rstd). Arrays of x's library, computed on its current stream.

    Raises:
        InputError: an array that is not a CUDA array (torch tensor, CuPy array, or DLPack / CUDA-array-interface
            object), a dtype other than fp32 / fp16 / bf16, shapes that disagree, a last dimension that is not
            contiguous, or a bad eps / out_dtype (the message names the value and what is accepted).
        UnsupportedRequestError: no kernel serves the request on this device (RTCKERN_DISABLE_OPS names the op, or
            the GPU is older than every candidate's minimum).
    """
    return _forward(True, x, weight, bias, eps, residual, zero_centered, out_dtype, return_stats)


# ---- backward ---------------------------------------------------------------------------------------------------
_RMS_BWD_SLOT = DIRECT_SLOTS.index("rms_norm_backward")
_LN_BWD_SLOT = DIRECT_SLOTS.index("layer_norm_backward")


def _backward(layer: bool, dy, x, weight, bias, mean, rstd, zero_centered, dresidual, dx_dtype, weight_grad,
              bias_grad):
    front = direct_front.call  # the torch plugin's native front, where loaded (its C++ replay; None: this path)
    if front is not None and dx_dtype is None:
        # its ops return empty placeholders for the gradients not asked for: those are None here
        if layer:
            out = None if dresidual is not None else front(_LN_BWD_SLOT, dy, x, weight, bias, mean, rstd,
                                                          zero_centered, weight_grad, bias_grad)
            if out is not None:
                return (out[0], out[1] if weight_grad and weight is not None else None,
                        out[2] if bias_grad and bias is not None else None)
        else:
            out = front(_RMS_BWD_SLOT, dy, x, weight, rstd, zero_centered, weight_grad, dresidual)
            if out is not None:
                return out[0], out[1] if weight_grad and weight is not None else None
    key = plan.bwd_key(layer, dy, x, weight, bias, mean, rstd, zero_centered, dresidual, dx_dtype, weight_grad,
                       bias_grad)
    if key is not None:
        call_plan = current_plan(plan.bwd_plans, key)
        if call_plan is not None:
            if call_plan.fast is not None:
                return call_plan.fast(dy, x, weight, dresidual, mean, rstd)
            return call_plan.run(x.data_ptr(), 0 if weight is None else weight.data_ptr(), dy.data_ptr(),
                                 0 if dresidual is None else dresidual.data_ptr(),
                                 0 if mean is None else mean.data_ptr(), rstd.data_ptr())
    op = "layer_norm_backward" if layer else "rms_norm_backward"
    xa = _check_x(x)
    dya = _rows(dy, "dy")
    _check_like(dya, xa, "dy", FLOATS)
    wa, ba, w_dtype = _affine(weight, bias, xa)
    if rstd is None:
        raise InputError(f"{op} needs rstd, the per-row statistics the forward returns "
                         f"({'layer_norm(..., return_stats=True)' if layer else 'rms_norm(..., return_rstd=True)'})")
    rsa = _rows(rstd, "rstd")
    _check_stats(rsa, xa, "rstd")
    ma = None
    if layer:
        if mean is None:
            raise InputError("layer_norm_backward needs mean, which layer_norm(..., return_stats=True) returns")
        ma = _rows(mean, "mean")
        _check_stats(ma, xa, "mean")
    dx_name = xa.dtype if dx_dtype is None else _dtype_name(dx_dtype, "dx_dtype")
    dra = None
    if dresidual is not None:
        dra = _rows(dresidual, "dresidual")
        _check_like(dra, xa, "dresidual", (dx_name,))
    want_dw = bool(weight_grad) and wa is not None
    want_db = bool(bias_grad) and ba is not None
    if xa.rows == 0:
        dx, _ = arr.empty(xa, xa.shape, dx_name)
        dw = arr.zeros(xa, (xa.n,), w_dtype)[0] if want_dw else None
        db = arr.zeros(xa, (xa.n,), w_dtype)[0] if want_db else None
        return (dx, dw, db) if layer else (dx, dw)
    call_plan = plan.bwd_plan(layer, op, xa, dya, wa, dra, dx_name, w_dtype, want_dw, want_db, zero_centered,
                              _selector(xa.n, xa.device))
    if xa.lib == "torch":
        # the whole-call fast path allocates dx like x and dw, db like the weight: where those fit
        grads_like_w = not (want_dw or want_db) or (wa is not None and wa.dtype == w_dtype and weight.is_contiguous())
        call_plan.like = (dx_name == xa.dtype and x.is_contiguous()) if grads_like_w else None
        for t in (dy, x, weight, bias, mean, rstd, dresidual):
            if t is not None:
                plan.remember_torch_type(t)
        key = plan.bwd_key(layer, dy, x, weight, bias, mean, rstd, zero_centered, dresidual, dx_dtype, weight_grad,
                           bias_grad)
        if key is not None:
            plan.store(plan.bwd_plans, key, call_plan)
    return call_plan.run(xa.ptr, wa.ptr if wa else 0, dya.ptr, dra.ptr if dra else 0, ma.ptr if ma else 0, rsa.ptr)


def rms_norm_backward(dy: Any, x: Any, weight: Any, rstd: Any, *, zero_centered: bool = False,
                      dresidual: Any = None, dx_dtype: Any = None, weight_grad: bool = True):
    """Gradients of rms_norm from the forward's input and its rstd.

    Args:
        dy: the gradient of y, x's shape, fp32 / fp16 / bf16.
        x: the normalized input (h when the forward added a residual).
        weight: the forward's weight, or None.
        rstd: fp32, one value per row of x, as rms_norm(..., return_rstd=True) returned it.
        zero_centered: as in the forward.
        dresidual: a gradient arriving for h (x's shape, dx's dtype), added into dx; or None.
        dx_dtype: dx's dtype, default x's.
        weight_grad: False skips dweight (returned as None).

    Returns:
        (dx, dweight): dx like x; dweight (N,) in the weight's dtype, or None without a weight or with
        weight_grad=False. dweight is reduced in a fixed order: bitwise repeatable.

    Raises:
        InputError: an array that is not a CUDA array (torch tensor, CuPy array, or DLPack / CUDA-array-interface
            object), a dtype other than fp32 / fp16 / bf16, shapes that disagree, a last dimension that is not
            contiguous, or a bad eps / out_dtype (the message names the value and what is accepted).
        UnsupportedRequestError: no kernel serves the request on this device (RTCKERN_DISABLE_OPS names the op, or
            the GPU is older than every candidate's minimum).
    """
    return _backward(False, dy, x, weight, None, None, rstd, zero_centered, dresidual, dx_dtype, weight_grad, False)


def layer_norm_backward(dy: Any, x: Any, weight: Any, bias: Any, mean: Any, rstd: Any, *,
                        zero_centered: bool = False, dresidual: Any = None, dx_dtype: Any = None,
                        weight_grad: bool = True, bias_grad: bool = True):
    """Gradients of layer_norm from the forward's input and its mean and rstd.

    Args:
        dy: the gradient of y, x's shape, fp32 / fp16 / bf16.
        x: the normalized input (h when the forward added a residual).
        weight, bias: the forward's, or None.
        mean, rstd: fp32, one value per row of x, as layer_norm(..., return_stats=True) returned them.
        zero_centered: as in the forward.
        dresidual: a gradient arriving for h (x's shape, dx's dtype), added into dx; or None.
        dx_dtype: dx's dtype, default x's.
        weight_grad, bias_grad: False skips that gradient (returned as None).

    Returns:
        (dx, dweight, dbias): dx like x; dweight and dbias (N,) in the parameters' dtype, None for a gradient not
        asked for or without its parameter. Bitwise repeatable.

    Raises:
        InputError: an array that is not a CUDA array (torch tensor, CuPy array, or DLPack / CUDA-array-interface
            object), a dtype other than fp32 / fp16 / bf16, shapes that disagree, a last dimension that is not
            contiguous, or a bad eps / out_dtype (the message names the value and what is accepted).
        UnsupportedRequestError: no kernel serves the request on this device (RTCKERN_DISABLE_OPS names the op, or
            the GPU is older than every candidate's minimum).
    """
    return _backward(True, dy, x, weight, bias, mean, rstd, zero_centered, dresidual, dx_dtype, weight_grad,
                     bias_grad)


from .quant import rms_norm_quant  # noqa: E402  (the fused fp8 producer; quant.py)


def _register() -> None:
    from rtckern import tuning
    from rtckern.registry import default_registry

    from .candidates import all_candidates, register_builders

    reg = default_registry()
    for cand in all_candidates():
        if cand.name not in {c.name for c in reg.candidates(cand.op)}:
            reg.register(cand)
    register_builders(reg)
    tuning.defer_tuners(f"{__package__}.tune")  # imported by `rtckern tune`, not by an op call


_register()
