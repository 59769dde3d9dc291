"""patch(model, rope=True): a transformers model's rotary position embedding on rtckern's kernel.

transformers' attention modules call a module-level apply_rotary_pos_emb(q, k, cos, sin) from their forward (q and k
(batch, heads, seqlen, head_dim) views of the projections; ~14 elementwise ops forward and as many backward for q and
k). patch() gives each attention module whose class's forward calls that name a forward of its own: the same code
with that one global name bound to rtckern's op (rtckern.torch.apply_rotary_pos_emb) in a copy of the modeling
module's namespace (`<module>.rtckern_rope` in sys.modules), so nothing outside the patched model changes (other
models, the modeling module's globals). The function it replaces is probed first on a small CPU input
and must compute the rotate-half embedding; a model whose function computes anything else (interleaved pairs,
partial rotary, multimodal sections, extra arguments) keeps its own and is reported. At run time calls the kernel
cannot take (CPU tensors, fp64, an odd head dim, other argument forms) run the model's own function, with one warning
(an error under RTCKERN_STRICT=1).
"""
from __future__ import annotations

import inspect
import sys
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
    if kwargs.get("unsqueeze_dim", 1) not in (1, 2) or isinstance(kwargs.get("unsqueeze_dim"), bool):
        return f"unsqueeze_dim={kwargs['unsqueeze_dim']!r}; rtckern's rope takes 1 or 2"
    tensors = (q, k, cos, sin)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "q, k, cos and sin are not all tensors"
    if not q.is_cuda or any(t.device != q.device for t in tensors[1:]):
        return f"tensors are on {', '.join(sorted({str(t.device) for t in tensors}))}"
    if q.dtype not in _DTYPES or k.dtype != q.dtype:
        return f"q {q.dtype}, k {k.dtype}; rtckern's rope takes one of float16, bfloat16, float32"
    if cos.dtype != sin.dtype or cos.dtype not in (q.dtype, torch.float32):
        return f"cos {cos.dtype} and sin {sin.dtype} with {q.dtype} q"
    d = q.shape[-1] if q.dim() else 0
    if q.dim() != 4 or k.dim() != 4 or d % 2 or k.shape[-1] != d:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}: 4-D with one even head dim is supported"
    if cos.dim() not in (2, 3) or cos.shape != sin.shape or cos.shape[-1] != d:
        return f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)} with head dim {d}"
    if d > 1 and any(t.stride(-1) != 1 for t in tensors):
        return "a head_dim that is not contiguous"
    return None


def rtckern_rope(original: Callable) -> Callable:
    """apply_rotary_pos_emb on rtckern's kernel, `original` for the calls it cannot take."""
    def apply_rotary_pos_emb(q, k, cos, sin, *rest, **kwargs):
        why = _why_not(q, k, cos, sin, rest, kwargs)
        if why is not None:
            fallback("rope", f"{NAME} of {tuple(getattr(q, 'shape', ()))}", why)
            return original(q, k, cos, sin, *rest, **kwargs)
        return E.apply_rotary_pos_emb(q, k, cos, sin, kwargs.get("unsqueeze_dim", 1))

    apply_rotary_pos_emb.rtckern_original = original  # what patch() replaced
    return apply_rotary_pos_emb


class RopeForward:
    """A patched module's forward: its class's forward with NAME bound to rtckern's op. An object rather than a bound
    function, so that the module still pickles (torch.save of a whole model: the class's forward and the replaced
    function are stored by reference, and the bound code is rebuilt on load) and deep-copies with its patch."""

    def __init__(self, module: torch.nn.Module, forward: types.FunctionType, original: Callable):
        self.module, self.forward, self.original = module, forward, original
        self._fn = _forward_with_rope(forward, original)

    def __call__(self, *args, **kwargs):
        return self._fn(self.module, *args, **kwargs)

    def __getstate__(self):
        return {"module": self.module, "forward": self.forward, "original": self.original}

    def __setstate__(self, state):
        self.__init__(**state)


def _forward_with_rope(forward: types.FunctionType, original: Callable) -> types.FunctionType:
    """forward's code with NAME bound to rtckern's op, in the namespace of a module of its own (_rope_module)."""
    fn = types.FunctionType(forward.__code__, _rope_module(forward.__globals__, original).__dict__, forward.__name__,
                            forward.__defaults__, forward.__closure__)
    fn.__kwdefaults__ = forward.__kwdefaults__
    fn.__qualname__, fn.__doc__ = forward.__qualname__, forward.__doc__
    fn.__dict__.update(forward.__dict__)
    return fn


def _rope_module(base: dict, original: Callable) -> types.ModuleType:
    """A copy of a modeling module's globals with NAME bound to rtckern's op, as a module registered in sys.modules
    under `<module>.rtckern_rope`: torch.compile guards a function's globals through its module's name, so the
    namespace must be a module of its own, not the modeling module (whose NAME is still transformers' function)."""
    name = f"{base.get('__name__', 'module')}.rtckern_rope"
    mod = sys.modules.get(name)
    if mod is None or getattr(mod.__dict__.get(NAME), "rtckern_original", None) is not original:
        mod = types.ModuleType(name)
        mod.__dict__.update(base)
        mod.__dict__.update(__name__=name, __spec__=None)
        mod.__dict__[NAME] = rtckern_rope(original)
        sys.modules[name] = mod
    return mod


def patch_rope(model: torch.nn.Module) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """Bind each module's forward that calls NAME to rtckern's op; (replaced (path, class), skipped (path, class,
    why))."""
    replaced, skipped = [], []
    probed: dict[int, Optional[str]] = {}
    for path, mod in model.named_modules():
        forward = type(mod).__dict__.get("forward")
        if not isinstance(forward, types.FunctionType):
            continue
        cls = type(mod).__qualname__
        if NAME not in forward.__code__.co_names:
            inner = inspect.unwrap(forward)
            if inner is not forward and NAME in getattr(getattr(inner, "__code__", None), "co_names", ()):
                skipped.append((path, cls, f"its forward calls {NAME} inside a decorator's wrapper, whose code "
                                           "cannot be rebound"))
            continue
        bound = mod.__dict__.get("forward")
        if bound is not None:
            if not isinstance(bound, RopeForward):
                skipped.append((path, cls, "the instance has a forward of its own"))
            continue  # patched before, or someone else's
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
        mod.forward = RopeForward(mod, forward, original)
        replaced.append((path, cls))
    return replaced, skipped
