"""SwiGLU, the gated activation of Llama-style MLPs, forward and backward in one pass each.

    y = rtckern.ops.swiglu(gate, up)                   # silu(gate) * up
    y = rtckern.ops.swiglu(gate_up)                    # the two halves of a fused gate_up projection's rows
    dgate, dup = rtckern.ops.swiglu_backward(dy, gate, up)
    dgate_up = rtckern.ops.swiglu_backward(dy, gate_up)

silu(g) = g * sigmoid(g). Storage fp32 / fp16 / bf16 (one dtype for every array), arithmetic in fp32, one rounding per
output. Rows may be strided (the last dimension contiguous). Torch tensors in give torch tensors out, CuPy arrays
give CuPy arrays (torch tensors take the memoized fast path).
"""
from __future__ import annotations

import sys

from rtckern import config
from rtckern.device import DeviceInfo
from rtckern.dtypes import FLOATS
from rtckern.errors import InputError
from rtckern.runtime import arrays as arr

from .._common import tensor_signature as _sig
from . import candidates as cands
from . import geometry, plan
from .geometry import GluKernel

__all__ = ("swiglu", "swiglu_backward")

cands.register_all()


def swiglu(gate, up=None):
    """SwiGLU: y = silu(gate) * up = gate * sigmoid(gate) * up, elementwise.

    Args:
        gate: (..., N) torch CUDA tensor or CuPy array, fp32 / fp16 / bf16, rows strided or not (the last dimension
            contiguous). With up=None: (..., 2N), the gate in the first half of each row and up in the second (a
            fused gate_up projection, vLLM's silu_and_mul layout).
        up: (..., N) like gate, in gate's dtype; or None (above).

    Returns:
        y: (..., N), contiguous, in gate's dtype.

    Raises:
        InputError: host memory, a dtype it does not take, shapes or dtypes that differ, an odd last dimension with
            up=None, a strided last dimension or leading dimensions that do not flatten to one row stride.
        UnsupportedRequestError: no kernel serves the request on this device (RTCKERN_DISABLE_OPS names the op).
    """
    return _call((gate, up), False)[0]


def swiglu_backward(dy, gate, up=None):
    """The gradients of SwiGLU's inputs: dgate = dy * up * s * (1 + gate * (1 - s)), dup = dy * gate * s, with
    s = sigmoid(gate).

    Args:
        dy: (..., N), the gradient of y, in gate's dtype (rows strided or not).
        gate: the forward's gate ((..., N), or (..., 2N) with up=None).
        up: the forward's up, or None when gate holds both halves.

    Returns:
        (dgate, dup), each (..., N) and contiguous; with up=None one (..., 2N) array holding dgate and dup in the
        halves of its rows, like the forward's gate.

    Raises:
        InputError: as swiglu's, and dy's shape or dtype not that of y.
        UnsupportedRequestError: no kernel serves the request on this device (RTCKERN_DISABLE_OPS names the op).
    """
    out = _call((dy, gate, up), True)
    return out if up is not None else out[0]


def _call(args: tuple, backward: bool):
    torch = sys.modules.get("torch")
    present = [a for a in args if a is not None]
    key = None
    if torch is not None and all(type(a) in (torch.Tensor, torch.nn.Parameter) for a in present):
        key = (backward, args[-1] is None, *(_sig(a) for a in present))
        p = plan.plans.get(key)
        if p is not None and p.settings is config.settings():
            return p.run(tuple(a.data_ptr() for a in present))
    rows_ = _wrapped(args, backward)
    p = _build(rows_, args[-1] is None, backward)
    if key is not None:
        plan.plans.put(key, p)
    return p.run(tuple(a.ptr for a in rows_))


def _wrapped(args: tuple, backward: bool) -> list[arr.Rows]:
    names = ("dy", "gate", "up") if backward else ("gate", "up")
    return [arr.rows(arr.wrap(a, name), name) for a, name in zip(args, names) if a is not None]


def _build(rows_: list[arr.Rows], fused: bool, backward: bool) -> plan.GluPlan:
    """The plan of a call whose arrays (present ones, in argument order) are rows_; fused: up is None."""
    settings = config.settings()
    if backward:
        dy, g = rows_[0], rows_[1]
        u = None if fused else rows_[2]
    else:
        dy, g = None, rows_[0]
        u = None if fused else rows_[1]
    if g.dtype not in FLOATS:
        raise InputError(f"gate is {g.dtype}; swiglu takes {', '.join(FLOATS)}")
    if fused:
        if g.n % 2:
            raise InputError(f"gate has shape {g.shape}: with up=None its last dimension holds [gate, up] halves and "
                             "must be even")
        n = g.n // 2
        out_shape = g.shape[:-1] + (n,)
        up_ptr, up_rs = g.ptr + n * g.itemsize, g.row_stride
    else:
        if u.dtype != g.dtype or u.shape != g.shape:
            raise InputError(f"up is {u.dtype} {u.shape} but gate is {g.dtype} {g.shape}; pass one dtype and shape")
        arr.check_same_place(g, u, "gate", "up")
        n, out_shape, up_ptr, up_rs = g.n, g.shape, u.ptr, u.row_stride
    if dy is not None:
        if dy.dtype != g.dtype or dy.shape != out_shape:
            raise InputError(f"dy is {dy.dtype} {dy.shape}; swiglu's output here is {g.dtype} {out_shape}")
        arr.check_same_place(g, dy, "gate", "dy")
    rows = g.rows
    outputs = 1 if (fused or not backward) else 2
    shape = g.shape if (backward and fused) else out_shape  # a fused gradient has gate's (..., 2N) shape
    if rows == 0 or n == 0:
        return plan.GluPlan(settings, g, shape, outputs, (), (), None, (), "")
    first = 1 if backward else 0  # the gate's argument index (dy comes first in the backward)
    up_ref = (first, n * g.itemsize) if fused else (first + 1, 0)
    in_ptrs = ((0, 0),) * backward + ((first, 0), up_ref)
    in_addrs = ((dy.ptr,) if dy is not None else ()) + (g.ptr, up_ptr)
    in_strides = ((dy.row_stride,) if dy is not None else ()) + (g.row_stride, up_rs)
    if backward and fused:
        out_rs, out_ptrs = (2 * n, 2 * n), ((0, 0), (0, n * g.itemsize))
    elif backward:
        out_rs, out_ptrs = (n, n), ((0, 0), (1, 0))
    else:
        out_rs, out_ptrs = (n,), ((0, 0),)
    vec = geometry.vector_width(g.dtype, n, in_addrs, in_strides + out_rs)
    kern = GluKernel(g.dtype, vec, backward)
    sel = cands.selection(kern, n, DeviceInfo.from_device(g.device), g.device)
    kinds = geometry.BWD_KINDS if backward else geometry.FWD_KINDS
    go = sel.kernels[0].prepare(geometry.grid(rows, n, vec), (geometry.THREADS, 1, 1), kinds, 0)
    tail = (rows, n) + in_strides + out_rs
    return plan.GluPlan(settings, g, shape, outputs, in_ptrs, out_ptrs, go, tail, sel.candidate.name)
