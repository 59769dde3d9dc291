"""Functional entry points of the drop-in modules and the transformers attention function, with an eager fast path.

    rtckern.torch.rms_norm(x, weight, eps, zero_centered=False, out_dtype=None)
    rtckern.torch.layer_norm(x, weight, bias, eps, zero_centered=False, out_dtype=None)
    rtckern.torch.attention(q, k, v, causal=False, softmax_scale=None)
    rtckern.torch.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    rtckern.torch.swiglu(gate, up)
    rtckern.torch.cross_entropy(logits, labels, ignore_index=-100, reduction="mean")

Where the native front serves the op (rtckern.plugins._torch_native), rms_norm and layer_norm first hand a call to its
direct entry (one C call to the replay, outside torch.compile), and rms_norm, layer_norm, attention and swiglu send
a call needing no gradient to torch.ops.rtckern.<op>, whose C++ replay costs less than any Python path, and a call
needing one too where the front has the op's autograd node (its arguments are then checked by the op's schema first:
a wrong type raises torch's RuntimeError). Otherwise, in plain eager code
these skip the dispatcher altogether: they call what torch.ops.rtckern.<op>'s own fast path calls (`*_direct` in the
family modules: rtckern's op without a gradient, the kernel op's autograd.Function or C++ autograd node with one;
same kernels, same fallback policy). Anywhere else they call torch.ops.rtckern.<op>: under torch.compile / dynamo
(which traces these functions), export, make_fx or any other dispatch or torch-function mode, with tensor subclasses
(FakeTensor, DTensor, ...) and under functorch transforms, so tracing sees the ops and their fake kernels.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from rtckern.ops._common import DIRECT_SLOTS
from rtckern.runtime.native import direct_front

from ._torch_lib import direct, needs_grad

# the norms' slots in the native front's direct entry (rtckern.runtime.native.direct_front): a call it serves replays
# from one C call, cheaper than torch.ops.rtckern's dispatcher; None from it: the routes below
_RMS_SLOT, _LN_SLOT = DIRECT_SLOTS.index("rms_norm"), DIRECT_SLOTS.index("layer_norm")

# The ops the native front serves (_torch_native.serve adds them): their calls needing no gradient cost less through
# torch.ops.rtckern (replayed in C++) than through the Python fast path below, tracing or not. (The packet, not its
# .default overload: torch-function modes and FX see the same callable as before.)
NATIVE_OPS: set[str] = set()
NATIVE_GRAD_OPS: set[str] = set()  # ... and whose calls needing a gradient make one C++ autograd node there


def _native(name: str, *tensors) -> bool:
    """torch.ops.rtckern.<name> is the cheaper route for this call: the front replays it, or makes its node."""
    return name in NATIVE_GRAD_OPS or (name in NATIVE_OPS and not needs_grad(*tensors))


_ops = torch.ops.rtckern
_compiling = torch.compiler.is_compiling  # (dynamo traces the torch.ops call; needs_grad's checks stay out of it)


def _family(module: str):
    """A registered family's plugin module (rtckern.plugins.torch imports only the families whose ops exist)."""
    mod = sys.modules.get(module)
    if mod is None:
        from rtckern.plugins.torch import skipped_ops

        raise RuntimeError(f"rtckern.torch: {module} is not registered: {skipped_ops}")
    return mod


def plain_eager(*tensors: Optional[torch.Tensor]) -> bool:
    """True when nothing is tracing or intercepting torch calls, so the dispatcher can be skipped: `direct`
    (no dispatch mode or functorch transform, plain non-meta tensors), not compiling, and no torch-function mode
    (which must see the op)."""
    if torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled():
        return False
    return direct(*tensors)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6, zero_centered: bool = False,
             out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """torch.ops.rtckern.rms_norm: through the native front, or without the dispatcher in plain eager code."""
    if not _compiling() and (front := direct_front.call) is not None:  # the front's replay, from one C call
        y = front(_RMS_SLOT, x, weight, eps, zero_centered, out_dtype)
        if y is not None:
            return y
    if (not _compiling() and _native("rms_norm", x, weight)) or not plain_eager(x, weight):
        return _ops.rms_norm(x, weight, eps, zero_centered, out_dtype)
    return _family("rtckern.plugins._torch_norms").rms_norm_direct(x, weight, eps, zero_centered, out_dtype)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
               eps: float = 1e-5, zero_centered: bool = False,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """torch.ops.rtckern.layer_norm: through the native front, or without the dispatcher in plain eager code."""
    if not _compiling() and (front := direct_front.call) is not None:  # the front's replay, from one C call
        y = front(_LN_SLOT, x, weight, bias, eps, zero_centered, out_dtype)
        if y is not None:
            return y
    if (not _compiling() and _native("layer_norm", x, weight, bias)) or not plain_eager(x, weight, bias):
        return _ops.layer_norm(x, weight, bias, eps, zero_centered, out_dtype)
    return _family("rtckern.plugins._torch_norms").layer_norm_direct(x, weight, bias, eps, zero_centered, out_dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: Optional[float] = None) -> torch.Tensor:
    """torch.ops.rtckern.attention ((batch, seqlen, heads, head_dim) layout): through the native front, or without
    the dispatcher in plain eager code."""
    if (not _compiling() and _native("attention", q, k, v)) or not plain_eager(q, k, v):
        return _ops.attention(q, k, v, causal, softmax_scale)
    return _family("rtckern.plugins._torch_attention").attention_direct(q, k, v, causal, softmax_scale)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.ops.rtckern.rope (transformers' apply_rotary_pos_emb, rotate-half convention), without the dispatcher
    in plain eager code."""
    if not plain_eager(q, k, cos, sin):
        return tuple(torch.ops.rtckern.rope(q, k, cos, sin, unsqueeze_dim))
    return _family("rtckern.plugins._torch_rope").rope_direct(q, k, cos, sin, unsqueeze_dim)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """torch.ops.rtckern.swiglu (silu(gate) * up): through the native front, or without the dispatcher in plain eager
    code."""
    if (not _compiling() and _native("swiglu", gate, up)) or not plain_eager(gate, up):
        return _ops.swiglu(gate, up)
    return _family("rtckern.plugins._torch_glu").swiglu_direct(gate, up)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean") -> torch.Tensor:
    """torch.ops.rtckern.cross_entropy (classes in the last dimension of logits), without the dispatcher in plain
    eager code."""
    if not plain_eager(logits, labels):
        return torch.ops.rtckern.cross_entropy(logits, labels, ignore_index, reduction)
    return _family("rtckern.plugins._torch_loss").cross_entropy_direct(logits, labels, ignore_index, reduction)
