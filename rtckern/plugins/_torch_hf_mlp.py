"""patch(model, mlp=True): a gated MLP's activation (down_proj(act_fn(gate_proj(x)) * up_proj(x)): Llama, Mistral,
Qwen) on rtckern's SwiGLU kernel.

Each module with gate_proj, up_proj and down_proj children whose class's forward(self, x) computes
down_proj(silu(gate_proj(x)) * up_proj(x)) gets a forward of its own running rtckern.torch.swiglu on the two
projections (the projections themselves stay the module's). The claim is checked, not assumed: the class's forward
runs once on a CPU probe with tiny stand-in weights (torch.func.functional_call: the model's own weights are not
touched or copied) and must match that formula; anything else (GELU-gated MLPs, fused gate_up projections, LoRA or
quantized projections) is left alone and reported. At run time activations the kernel cannot take (CPU tensors,
fp64) run the module's own act_fn(gate) * up, with one warning (an error under RTCKERN_STRICT=1).
"""
from __future__ import annotations

import inspect
import types
from typing import Optional

import torch
import torch.nn.functional as F

from . import _torch_eager as E
from ._torch_dispatch import fallback

_PARTS = ("gate_proj", "up_proj", "down_proj")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _is_gated_mlp(mod: torch.nn.Module) -> bool:
    return all(isinstance(getattr(mod, p, None), torch.nn.Module) for p in _PARTS) and callable(
        getattr(mod, "act_fn", None))


def probe(mod: torch.nn.Module) -> Optional[str]:
    """None when the module's own forward computes down_proj(silu(gate_proj(x)) * up_proj(x)), else why not."""
    forward = type(mod).__dict__.get("forward")
    if not isinstance(forward, types.FunctionType):
        return "its class does not define forward itself"
    params = list(inspect.signature(forward).parameters.values())
    if len(params) != 2 or params[1].kind not in (params[1].POSITIONAL_ONLY, params[1].POSITIONAL_OR_KEYWORD):
        return f"forward takes {[p.name for p in params[1:]]}, not one input"
    gen = torch.Generator().manual_seed(0)
    tiny, sizes = {}, {"gate_proj": (3, 4), "up_proj": (3, 4), "down_proj": (4, 3)}
    for part, (out, inp) in sizes.items():
        tiny[f"{part}.weight"] = torch.randn(out, inp, generator=gen)
        if getattr(getattr(mod, part), "bias", None) is not None:
            tiny[f"{part}.bias"] = torch.randn(out, generator=gen)
    x = torch.randn(2, 4, generator=gen) * 2
    modes = [(m, m.training) for m in mod.modules()]
    try:
        mod.train()  # in training mode: a forward with dropout or other training-only steps does not match
        with torch.no_grad():
            got = torch.func.functional_call(mod, tiny, (x,))
    except Exception as e:  # noqa: BLE001 - any failure of a foreign forward means "leave it alone"
        return f"its forward failed on a CPU probe ({type(e).__name__}: {e})"
    finally:
        for m, training in modes:
            m.training = training

    def lin(part, t):
        return F.linear(t, tiny[f"{part}.weight"], tiny.get(f"{part}.bias"))
    want = lin("down_proj", F.silu(lin("gate_proj", x)) * lin("up_proj", x))
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5,
                                                                                          atol=1e-5):
        return "its forward computes something other than down_proj(silu(gate_proj(x)) * up_proj(x))"
    return None


def _activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not gate.is_cuda or gate.dtype not in _DTYPES or up.dtype != gate.dtype:
        fallback("swiglu", f"the MLP activation of {tuple(gate.shape)} {gate.dtype}",
                 f"tensors are on {gate.device}" if not gate.is_cuda else f"dtype {gate.dtype} / {up.dtype}")
        return self.act_fn(gate) * up
    return E.swiglu(gate, up)


class SwigluForward:
    """A patched MLP's forward: its own projections around rtckern's SwiGLU. An object rather than a bound function,
    so that the module still pickles (torch.save of a whole model) and deep-copies with its patch."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, x):
        m = self.module
        return m.down_proj(_activation(m, m.gate_proj(x), m.up_proj(x)))


def patch_mlp(model: torch.nn.Module) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """Give each gated MLP that passes the probe rtckern's forward; (replaced (path, class), skipped (path, class,
    why))."""
    replaced, skipped = [], []
    for path, mod in model.named_modules():
        if not _is_gated_mlp(mod):
            continue
        cls = type(mod).__qualname__
        bound = mod.__dict__.get("forward")
        if bound is not None:
            if not isinstance(bound, SwigluForward):
                skipped.append((path, cls, "the instance has a forward of its own"))
            continue  # patched before, or someone else's
        why = probe(mod)
        if why is not None:
            skipped.append((path, cls, why))
            continue
        mod.forward = SwigluForward(mod)
        replaced.append((path, cls))
    return replaced, skipped
