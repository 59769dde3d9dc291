"""RMSNorm and LayerNorm over the last dimension, forward and backward.

    y = rms_norm(x, weight, eps=1e-6)                       # y = x * rstd * weight
    y, h = rms_norm(x, weight, residual=r)                  # h = x + r (x's dtype); y = rms_norm(h)
    y, rstd = rms_norm(x, weight, return_rstd=True)          # rstd: fp32, shape x.shape[:-1]
    y = layer_norm(x, weight, bias, eps=1e-5)
    y, mean, rstd = layer_norm(x, weight, bias, return_stats=True)
    dx, dweight = rms_norm_backward(dy, x, weight, rstd)    # x: the normalized input (h with a residual)
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

from rtckern.config import settings
from rtckern.device import DeviceInfo
from rtckern.errors import InputError
from rtckern.registry import OpRequest, select

from . import _norms_arrays as A
from . import _norms_kernels as K
from ._norms_launch import BwdCall, FwdCall

__all__ = ["rms_norm", "layer_norm", "rms_norm_backward", "layer_norm_backward"]

_DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "fp32": "fp32", "fp16": "fp16",
                "bf16": "bf16", "float": "fp32", "half": "fp16"}

# Hot path: the decided (request, candidate, kernels) per call signature, so a repeated call builds no request.
_fast: dict[tuple, tuple] = {}


def _dtype_name(d: Any, what: str) -> str:
    s = str(d).replace("torch.", "")
    name = _DTYPE_NAMES.get(s) or _DTYPE_NAMES.get(getattr(d, "name", ""))
    if name is None:
        raise InputError(f"{what}={d!r} is not supported; pass one of {A.SUPPORTED} (or None for x's dtype)")
    return name


def _eps(eps: Any) -> float:
    try:
        e = float(eps)
    except (TypeError, ValueError):
        raise InputError(f"eps={eps!r} is not a number; pass a small positive float such as 1e-6") from None
    if not math.isfinite(e) or e < 0:
        raise InputError(f"eps={eps!r} must be finite and >= 0; pass a small positive float such as 1e-6")
    return e


def _check_x(x: Any, name: str = "x") -> A.Rows:
    xa = A.wrap(x, name)
    A.check_float(xa, name)
    if xa.n < 1:
        raise InputError(f"{name} has shape {xa.shape}: its last dimension is 0; the norms need N >= 1 columns")
    return xa


def _affine(weight: Any, bias: Any, xa: A.Rows) -> tuple[A.Rows | None, A.Rows | None, str | None]:
    allowed = (xa.dtype,) if xa.dtype == "fp32" else (xa.dtype, "fp32")
    wa = ba = None
    if weight is not None:
        wa = A.wrap(weight, "weight")
        A.check_vector(wa, xa, "weight", allowed)
    if bias is not None:
        ba = A.wrap(bias, "bias")
        A.check_vector(ba, xa, "bias", (wa.dtype,) if wa is not None else allowed)
    w_dtype = wa.dtype if wa is not None else (ba.dtype if ba is not None else None)
    return wa, ba, w_dtype


def _align(a: A.Rows | None) -> tuple[int, int]:
    if a is None:
        return (1, 16)
    return a.itemsize, K.byte_alignment(a.ptr, a.row_stride * a.itemsize)


def _vec(n: int, x: A.Rows, others: list[tuple[int, int]]) -> int:
    pairs = [_align(x)] + others
    return K.pick_vec(n, tuple(p[0] for p in pairs), tuple(p[1] for p in pairs))


def _device(a: A.Rows) -> DeviceInfo:
    return DeviceInfo.from_device(a.device)


def _decide(sig: tuple, build) -> tuple:
    """(request, candidate, kernels) for a call signature. The memo holds the settings object it was decided
    under (so its id cannot be reused) and decides again when the settings change (config.override)."""
    s = settings()
    hit = _fast.get(sig)
    if hit is None or hit[0] is not s:
        req = build()
        sel = select(req)
        hit = _fast[sig] = (s, req, sel.candidate, sel.kernels)
    return hit[1:]


def _workspace(like: A.Rows):
    return (lambda count: A.zeros_u32(like, count)), (lambda count: A.empty(like, (count,), "fp32"))


# ---- forward ----------------------------------------------------------------------------------------------------
def _forward(layer: bool, x, weight, bias, eps, residual, zero_centered, out_dtype, save_stats):
    op = "layer_norm" if layer else "rms_norm"
    xa = _check_x(x)
    wa, ba, w_dtype = _affine(weight, bias, xa)
    ra = None
    if residual is not None:
        ra = A.wrap(residual, "residual")
        A.check_like(ra, xa, "residual", (xa.dtype,))
    y_dtype = xa.dtype if out_dtype is None else _dtype_name(out_dtype, "out_dtype")
    e = _eps(eps)
    y, yp = A.empty(xa, xa.shape, y_dtype)
    h, hp = A.empty(xa, xa.shape, xa.dtype) if ra is not None else (None, 0)
    mean, mp = A.empty(xa, xa.shape[:-1], "fp32") if (save_stats and layer) else (None, 0)
    rstd, rp = A.empty(xa, xa.shape[:-1], "fp32") if save_stats else (None, 0)
    outs = [y] + ([h] if ra is not None else []) + ([mean] if mean is not None else []) + \
        ([rstd] if rstd is not None else [])
    result = outs[0] if len(outs) == 1 else tuple(outs)
    if xa.rows == 0:
        return result

    n = xa.n
    isz_y = K.ITEMSIZE[y_dtype]
    others = [(isz_y, K.byte_alignment(yp, n * isz_y))]
    if wa is not None:
        others.append(_align(wa))
    if ba is not None:
        others.append(_align(ba))
    if ra is not None:
        others += [_align(ra), (xa.itemsize, K.byte_alignment(hp, n * xa.itemsize))]
    vec = _vec(n, xa, others)
    flags = (("bias", ba is not None), ("residual", ra is not None), ("save_stats", bool(save_stats)),
             ("weight", wa is not None), ("zero_centered", bool(zero_centered)))
    dtypes = (("w", w_dtype or "none"), ("x", xa.dtype), ("y", y_dtype))
    sig = (op, dtypes, n, vec, flags, xa.device)

    def build():
        return OpRequest(op=op, dtypes=dtypes, shape=(("n", n), ("vec", vec)), flags=flags, device=_device(xa))

    req, cand, kernels = _decide(sig, build)
    zeros_u32, empty_f32 = _workspace(xa)
    call = FwdCall(x=xa.ptr, residual=ra.ptr if ra else 0, h=hp, w=wa.ptr if wa else 0, b=ba.ptr if ba else 0,
                   y=yp, mean=mp, rstd=rp, eps=e, rows=xa.rows, sx=xa.row_stride, sr=ra.row_stride if ra else 0,
                   sh=n, sy=n, stream=A.current_stream(xa), zeros_u32=zeros_u32, empty_f32=empty_f32)
    cand.launch(req, kernels, call)
    return result


def rms_norm(x: Any, weight: Any = None, eps: float = 1e-6, *, residual: Any = None, zero_centered: bool = False,
             out_dtype: Any = None, return_rstd: bool = False):
    """RMSNorm over the last dimension. Returns y; (y, h) with a residual; rstd appended with return_rstd."""
    return _forward(False, x, weight, None, eps, residual, zero_centered, out_dtype, return_rstd)


def layer_norm(x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5, *, residual: Any = None,
               zero_centered: bool = False, out_dtype: Any = None, return_stats: bool = False):
    """LayerNorm over the last dimension. Returns y; (y, h) with a residual; mean, rstd appended with
    return_stats."""
    return _forward(True, x, weight, bias, eps, residual, zero_centered, out_dtype, return_stats)


# ---- backward ---------------------------------------------------------------------------------------------------
def _backward(layer: bool, dy, x, weight, bias, mean, rstd, zero_centered, dresidual, dx_dtype, weight_grad,
              bias_grad):
    op = "layer_norm_backward" if layer else "rms_norm_backward"
    xa = _check_x(x)
    dya = A.wrap(dy, "dy")
    A.check_like(dya, xa, "dy", ("fp32", "fp16", "bf16"))
    wa, ba, w_dtype = _affine(weight, bias, xa)
    if rstd is None:
        raise InputError(f"{op} needs rstd, the per-row statistics the forward returns "
                         f"({'layer_norm(..., return_stats=True)' if layer else 'rms_norm(..., return_rstd=True)'})")
    rsa = A.wrap(rstd, "rstd")
    A.check_stats(rsa, xa, "rstd")
    ma = None
    if layer:
        if mean is None:
            raise InputError("layer_norm_backward needs mean, which layer_norm(..., return_stats=True) returns")
        ma = A.wrap(mean, "mean")
        A.check_stats(ma, xa, "mean")
    dx_name = xa.dtype if dx_dtype is None else _dtype_name(dx_dtype, "dx_dtype")
    dra = None
    if dresidual is not None:
        dra = A.wrap(dresidual, "dresidual")
        A.check_like(dra, xa, "dresidual", (dx_name,))
    want_dw = bool(weight_grad) and wa is not None
    want_db = bool(bias_grad) and ba is not None
    dx, dxp = A.empty(xa, xa.shape, dx_name)
    dw, dwp = A.empty(xa, (xa.n,), w_dtype) if want_dw else (None, 0)
    db, dbp = A.empty(xa, (xa.n,), w_dtype) if want_db else (None, 0)
    result = (dx, dw, db) if layer else (dx, dw)
    if xa.rows == 0:
        if want_dw:
            dw, _ = A.zeros(xa, (xa.n,), w_dtype)
        if want_db:
            db, _ = A.zeros(xa, (xa.n,), w_dtype)
        return (dx, dw, db) if layer else (dx, dw)

    n = xa.n
    others = [_align(dya), (K.ITEMSIZE[dx_name], K.byte_alignment(dxp, n * K.ITEMSIZE[dx_name]))]
    if wa is not None:
        others.append(_align(wa))
    if dra is not None:
        others.append(_align(dra))
    vec = _vec(n, xa, others)
    flags = (("bias_grad", want_db), ("dresidual", dra is not None), ("weight", wa is not None),
             ("weight_grad", want_dw), ("zero_centered", bool(zero_centered)))
    dtypes = (("dx", dx_name), ("dy", dya.dtype), ("w", w_dtype or "none"), ("x", xa.dtype))
    sig = (op, dtypes, n, vec, flags, xa.device)

    def build():
        return OpRequest(op=op, dtypes=dtypes, shape=(("n", n), ("vec", vec)), flags=flags, device=_device(xa))

    req, cand, kernels = _decide(sig, build)
    zeros_u32, empty_f32 = _workspace(xa)
    call = BwdCall(x=xa.ptr, w=wa.ptr if wa else 0, dy=dya.ptr, dres=dra.ptr if dra else 0,
                   mean=ma.ptr if ma else 0, rstd=rsa.ptr, dx=dxp, dw=dwp, db=dbp, rows=xa.rows, sx=xa.row_stride,
                   sdy=dya.row_stride, sdres=dra.row_stride if dra else 0, sdx=n, stream=A.current_stream(xa),
                   zeros_u32=zeros_u32, empty_f32=empty_f32)
    cand.launch(req, kernels, call)
    return result


def rms_norm_backward(dy: Any, x: Any, weight: Any, rstd: Any, *, zero_centered: bool = False,
                      dresidual: Any = None, dx_dtype: Any = None, weight_grad: bool = True):
    """Gradients of rms_norm: (dx, dweight); dweight is None without a weight or with weight_grad=False.
    x is the normalized input (h when the forward added a residual); dresidual is added into dx."""
    return _backward(False, dy, x, weight, None, None, rstd, zero_centered, dresidual, dx_dtype, weight_grad, False)


def layer_norm_backward(dy: Any, x: Any, weight: Any, bias: Any, mean: Any, rstd: Any, *,
                        zero_centered: bool = False, dresidual: Any = None, dx_dtype: Any = None,
                        weight_grad: bool = True, bias_grad: bool = True):
    """Gradients of layer_norm: (dx, dweight, dbias), None for a gradient not asked for or without its
    parameter."""
    return _backward(True, dy, x, weight, bias, mean, rstd, zero_centered, dresidual, dx_dtype, weight_grad,
                     bias_grad)


def _register() -> None:
    from rtckern.registry import default_registry

    from ._norms_candidates import all_candidates, register_builders

    reg = default_registry()
    for cand in all_candidates():
        if cand.name not in {c.name for c in reg.candidates(cand.op)}:
            reg.register(cand)
    register_builders(reg)


_register()
