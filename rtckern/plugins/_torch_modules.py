"""Drop-in norm modules: `RMSNorm` and `LayerNorm`, subclasses of torch.nn.RMSNorm / torch.nn.LayerNorm (same
constructor, parameters, state-dict keys, isinstance checks) whose forward runs rtckern's kernels.

They take the rtckern path for CUDA tensors of fp32/fp16/bf16 with a weight of x's dtype or fp32; anything else
(CPU tensors, other dtype mixes) runs the module's torch forward, with one warning per op (an error under
RTCKERN_STRICT=1). A module built by `patch()` from a Hugging Face RMSNorm class keeps that class's semantics:
zero-centered weights (Gemma's `1 + weight`) and its output dtype rule, and falls back to the original forward.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from . import _torch_eager as E
from ._torch_dispatch import fallback
from ._torch_lib import FLOAT_DTYPES

# How a norm picks its output dtype from x's and the weight's: "input" (torch.nn), "promote" (Llama-style
# `weight * x_hat.to(input_dtype)`, which gives fp32 for bf16 x with an fp32 weight).
OUT_RULES = ("input", "promote")


def _why_not_jit(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> Optional[str]:
    """None when the rtckern kernels take this call; else the reason (the fallback warning shows it)."""
    if not x.is_cuda:
        return f"x is on {x.device}; rtckern's kernels run on CUDA GPUs"
    if x.dtype not in FLOAT_DTYPES:
        return f"x has dtype {x.dtype}; supported: float32, float16, bfloat16"
    for p, name in ((weight, "weight"), (bias, "bias")):
        if p is not None and p.dtype not in (x.dtype, torch.float32):
            return f"{name} has dtype {p.dtype} with x in {x.dtype}; supported: x's dtype or float32"
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        return f"weight ({weight.dtype}) and bias ({bias.dtype}) differ in dtype"
    return None


def _flatten(x: torch.Tensor, normalized_shape: tuple[int, ...]) -> torch.Tensor:
    """x (..., *normalized_shape) viewed as (..., prod(normalized_shape)) with a contiguous last dimension."""
    if len(normalized_shape) > 1:
        x = x.reshape(*x.shape[: x.dim() - len(normalized_shape)], math.prod(normalized_shape))
    if x.dim() and x.stride(-1) != 1 and x.shape[-1] > 1:
        x = x.contiguous()
    return x


def _out_dtype(rule: str, x: torch.Tensor, weight: Optional[torch.Tensor]) -> Optional[torch.dtype]:
    if rule == "promote" and weight is not None and weight.dtype != x.dtype:
        return torch.promote_types(x.dtype, weight.dtype)
    return None


class RMSNorm(nn.RMSNorm):
    """torch.nn.RMSNorm on rtckern's kernels; extra keyword arguments: zero_centered (y = x_hat * (1 + weight)),
    out_dtype_rule ("input" or "promote", see OUT_RULES)."""

    def __init__(self, normalized_shape, eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None, *, zero_centered: bool = False, out_dtype_rule: str = "input") -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, device=device,
                         dtype=dtype)
        if out_dtype_rule not in OUT_RULES:
            raise ValueError(f"out_dtype_rule={out_dtype_rule!r}; pick one of {OUT_RULES}")
        self.zero_centered = zero_centered
        self.out_dtype_rule = out_dtype_rule
        # The module patch() replaced, when it was not a torch.nn one: its forward is the fallback. Kept out of
        # _modules so that it stays out of the state dict, .to() and parameters().
        self.__dict__["_torch_original"] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight  # once: a parameter read goes through nn.Module.__getattr__ (~1 us per read)
        why = _why_not_jit(x, weight, None)
        if why is not None:
            fallback("rms_norm", f"{x.dtype} input of shape {tuple(x.shape)} on {x.device}", why)
            return self._fallback(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        out_dtype = _out_dtype(self.out_dtype_rule, x, weight)
        if weight is not None and weight.dim() != 1:
            weight = weight.reshape(-1)
        shape = self.normalized_shape
        y = E.rms_norm(_flatten(x, shape), weight, eps, self.zero_centered, out_dtype)
        return y.view(*x.shape[: x.dim() - len(shape)], *shape) if len(shape) > 1 else y

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        original = self.__dict__.get("_torch_original")
        if original is not None:  # the replaced module's own forward, on this module's current weight
            return torch.func.functional_call(original, {"weight": self.weight}, (x,))
        if self.zero_centered or self.out_dtype_rule != "input":
            w = None if self.weight is None else self.weight.float() + (1.0 if self.zero_centered else 0.0)
            y = torch.nn.functional.rms_norm(x.float(), self.normalized_shape, w, self.eps)
            return y.to(_out_dtype(self.out_dtype_rule, x, self.weight) or x.dtype)
        return nn.RMSNorm.forward(self, x)

    @property
    def variance_epsilon(self) -> Optional[float]:
        """The eps under Hugging Face's attribute name (code that reads it keeps working after patch())."""
        return self.eps

    def extra_repr(self) -> str:
        extra = ", zero_centered=True" if self.zero_centered else ""
        if self.out_dtype_rule != "input":
            extra += f", out_dtype_rule={self.out_dtype_rule!r}"
        return super().extra_repr() + extra + ", backend=rtckern"


class LayerNorm(nn.LayerNorm):
    """torch.nn.LayerNorm on rtckern's kernels (same constructor, parameters and state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias  # once each: parameter reads go through nn.Module.__getattr__
        why = _why_not_jit(x, w, b)
        if why is not None:
            fallback("layer_norm", f"{x.dtype} input of shape {tuple(x.shape)} on {x.device}", why)
            return nn.LayerNorm.forward(self, x)
        # 1-D parameters go in as they are: a reshape would add a view (and an autograd node) per call
        if w is not None and w.dim() != 1:
            w = w.reshape(-1)
        if b is not None and b.dim() != 1:
            b = b.reshape(-1)
        y = E.layer_norm(_flatten(x, self.normalized_shape), w, b, self.eps)
        return y.view(x.shape) if len(self.normalized_shape) > 1 else y

    def extra_repr(self) -> str:
        return super().extra_repr() + ", backend=rtckern"


def _like(mod: nn.Module, new: nn.Module) -> nn.Module:
    """Move new's parameters to be mod's own Parameter objects (optimizers and tied references stay valid)."""
    for name, p in list(new.named_parameters(recurse=False)):
        setattr(new, name, getattr(mod, name))
    new.train(mod.training)
    return new


def from_torch_rmsnorm(mod: nn.RMSNorm) -> RMSNorm:
    new = RMSNorm(mod.normalized_shape, eps=mod.eps, elementwise_affine=mod.elementwise_affine, device="meta")
    return _like(mod, new)


def from_torch_layernorm(mod: nn.LayerNorm) -> LayerNorm:
    new = LayerNorm(mod.normalized_shape, eps=mod.eps, elementwise_affine=mod.elementwise_affine,
                    bias=mod.bias is not None, device="meta")
    return _like(mod, new)


def from_hf_rmsnorm(mod: nn.Module, eps: float, zero_centered: bool, out_rule: str) -> RMSNorm:
    """An rtckern RMSNorm serving a Hugging Face-style RMSNorm instance, falling back to its original forward."""
    n = mod.weight.shape[0]
    new = RMSNorm(n, eps=eps, device="meta", zero_centered=zero_centered, out_dtype_rule=out_rule)
    _like(mod, new)
    new.__dict__["_torch_original"] = mod
    return new


def describe(mod: Any) -> str:
    return f"{type(mod).__module__}.{type(mod).__qualname__}"
