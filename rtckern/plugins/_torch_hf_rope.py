"""patch(model, rope=True): a transformers model's rotary position embedding on rtckern's kernel.

transformers' attention modules call a module-level apply_rotary_pos_emb(q, k, cos, sin) from their forward (q and k
(batch, heads, seqlen, head_dim) views of the projections; ~14 elementwise ops forward and as many backward for q and
k). patch() gives each attention module whose class's forward calls that name a forward of its own: the same code
with that one global name bound to rtckern's op (rtckern.torch.apply_rotary_pos_emb), so nothing outside the patched
model changes (other models, the module's globals). The function it replaces is probed first on a small CPU input
and must compute the rotate-half embedding; a model whose function computes anything else (interleaved pairs,
partial rotary, multimodal sections, extra arguments) keeps its own and is reported. At run time calls the kernel
cannot take (CPU tensors, fp64, an odd head dim, other argument forms) run the model's own function, with one warning
(an error under RTCKERN_STRICT=1).
"""
from __future__ import annotations

import types
from typing import Callable, Optional

import torch

from . import _torch_eager as E
from . import _torch_ref as R
from ._torch_dispatch import fallback

NAME = "apply_rotary_pos_emb"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def probe(fn: Callable) -> Optional[str]:
    """None when fn(q, k, cos, sin) (and with unsqueeze_dim=2) computes the rotate-half embedding, else why not."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=gen), torch.randn(2, 1, 5, 8, generator=gen)
    cos, sin = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)
    try:
        with torch.no_grad():
            got = fn(q, k, cos, sin)
            got2 = fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    except Exception as e:  # noqa: BLE001 - any failure of a foreign function means "leave it alone"
        return f"{NAME} failed on a CPU probe ({type(e).__name__}: {e})"
    want = R.rope(q, k, cos, sin, 1)
    want2 = R.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2)
    for g, w in zip(tuple(got) + tuple(got2), want + want2):
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or not torch.allclose(g, w, rtol=1e-5, atol=1e-5):
            return f"{NAME} computes something other than the rotate-half rotary embedding"
    return None


def _why_not(q, k, cos, sin, rest: tuple, kwargs: dict) -> Optional[str]:
    if rest or set(kwargs) - {"unsqueeze_dim"}:
        return f"arguments beyond (q, k, cos, sin, unsqueeze_dim): {len(rest)} positional, {sorted(kwargs)}"
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return "q, k, cos and sin are not all tensors"
    if not q.is_cuda:
        return f"tensors are on {q.device}"
    if q.dtype not in _DTYPES or k.dtype != q.dtype:
        return f"q {q.dtype}, k {k.dtype}; rtckern's rope takes one of float16, bfloat16, float32"
    if cos.dtype != sin.dtype or cos.dtype not in (q.dtype, torch.float32):
        return f"cos {cos.dtype} and sin {sin.dtype} with {q.dtype} q"
    if q.dim() != 4 or k.dim() != 4 or q.shape[-1] % 2:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}: 4-D with an even head dim is supported"
    return None


def rtckern_rope(original: Callable) -> Callable:
    """apply_rotary_pos_emb on rtckern's kernel, `original` for the calls it cannot take."""
    def apply_rotary_pos_emb(q, k, cos, sin, *rest, **kwargs):
        why = _why_not(q, k, cos, sin, rest, kwargs)
        if why is not None:
            fallback("rope", f"{NAME} of {tuple(getattr(q, 'shape', ()))}", why)
            return original(q, k, cos, sin, *rest, **kwargs)
        return E.apply_rotary_pos_emb(q, k, cos, sin, kwargs.get("unsqueeze_dim", 1))

    apply_rotary_pos_emb.rtckern_original = original  # what patch() replaced (and a marker: already patched)
    return apply_rotary_pos_emb


def _forward_with_rope(forward: types.FunctionType, original: Callable) -> types.FunctionType:
    """forward's code with NAME bound to rtckern's op in a copy of its globals."""
    g = dict(forward.__globals__)
    g[NAME] = rtckern_rope(original)
    fn = types.FunctionType(forward.__code__, g, forward.__name__, forward.__defaults__, forward.__closure__)
    fn.__kwdefaults__ = forward.__kwdefaults__
    fn.__qualname__, fn.__doc__, fn.__module__ = forward.__qualname__, forward.__doc__, forward.__module__
    fn.__dict__.update(forward.__dict__)
    return fn


def patch_rope(model: torch.nn.Module) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """Bind each module's forward that calls NAME to rtckern's op; (replaced (path, class), skipped (path, class,
    why))."""
    replaced, skipped = [], []
    probed: dict[int, Optional[str]] = {}
    for path, mod in model.named_modules():
        forward = type(mod).__dict__.get("forward")
        if not isinstance(forward, types.FunctionType) or NAME not in forward.__code__.co_names:
            continue
        cls = type(mod).__qualname__
        bound = mod.__dict__.get("forward")
        if bound is not None:
            fn = getattr(bound, "__func__", None)
            if fn is not None and hasattr(fn.__globals__.get(NAME), "rtckern_original"):
                continue  # patched before
            skipped.append((path, cls, "the instance has a forward of its own"))
            continue
        original = forward.__globals__.get(NAME)
        if not callable(original):
            skipped.append((path, cls, f"its module has no callable {NAME}"))
            continue
        why = probed.get(id(original))
        if id(original) not in probed:
            why = probed[id(original)] = probe(original)
        if why is not None:
            skipped.append((path, cls, why))
            continue
        mod.forward = types.MethodType(_forward_with_rope(forward, original), mod)
        replaced.append((path, cls))
    return replaced, skipped
