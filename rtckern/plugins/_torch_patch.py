"""`patch(model)`: swap a model's norm modules for rtckern's in place, and switch a transformers model's attention
to rtckern.

What is swapped:
- torch.nn.RMSNorm and torch.nn.LayerNorm instances (exactly those classes: a subclass with its own forward is
  left alone and reported);
- Hugging Face-style RMSNorm classes (any class whose name contains "RMSNorm", plus those passed in
  `rms_norm_classes`) with a single 1-D `weight`, an `eps` or `variance_epsilon`, no buffers and no children.
  Their semantics are checked, not assumed: the class's own forward runs once on a small CPU probe (through
  torch.func.functional_call, so the model's weights are not touched) and must equal RMSNorm with the weight
  (Llama, Mistral, Qwen) or with 1 + weight (Gemma); a second probe (bf16 x, fp32 weight) finds the output dtype
  rule. A class matching neither is reported and left alone.
The new modules take over the same Parameter objects (optimizers, tied weights and state dicts are unchanged).
With rope=True the attention modules of a transformers model run their rotary embedding on rtckern's kernel
(_torch_hf_rope: their forward with apply_rotary_pos_emb bound to rtckern's op, after a probe of the function it
replaces); with mlp=True gated MLPs (down_proj(silu(gate_proj(x)) * up_proj(x))) run their activation on rtckern's
SwiGLU kernel (_torch_hf_mlp, after a probe of their forward); with loss=True a transformers causal LM computes
its loss (model(..., labels=...)) on rtckern's cross-entropy kernels (_torch_hf_loss).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import torch
from torch import nn

from . import _torch_modules as M

_PROBE_ROWS = 3


@dataclasses.dataclass
class PatchReport:
    replaced: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (module path, original class)
    skipped: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (path, class, reason)
    attention: Optional[str] = None  # the model's attention implementation after patch(), if it has one
    rope: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (module path, class) on rtckern's RoPE
    rope_skipped: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (path, class, reason)
    mlp: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (module path, class) on rtckern's SwiGLU
    mlp_skipped: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (path, class, reason)
    loss: bool = False  # the model's loss_function is rtckern's causal LM loss
    loss_skipped: str = ""  # why not, where loss=True was asked for

    def __str__(self) -> str:
        lines = [f"rtckern.torch.patch: replaced {len(self.replaced)} norm modules"]
        lines += [f"  {path}: {cls}" for path, cls in self.replaced]
        lines += [f"  skipped {path} ({cls}): {why}" for path, cls, why in self.skipped]
        if self.attention is not None:
            lines.append(f"  attention implementation: {self.attention}")
        if self.rope or self.rope_skipped:
            lines.append(f"  rotary embedding on rtckern in {len(self.rope)} modules")
            lines += [f"  rotary embedding skipped in {path} ({cls}): {why}" for path, cls, why in self.rope_skipped]
        if self.mlp or self.mlp_skipped:
            lines.append(f"  SwiGLU activation on rtckern in {len(self.mlp)} MLPs")
            lines += [f"  MLP activation skipped in {path} ({cls}): {why}" for path, cls, why in self.mlp_skipped]
        if self.loss:
            lines.append("  causal LM loss on rtckern")
        elif self.loss_skipped:
            lines.append(f"  loss skipped: {self.loss_skipped}")
        return "\n".join(lines)


def _rms_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _eps_of(mod: nn.Module) -> Optional[float]:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(mod, attr, None)
        if isinstance(v, (float, int)) and not isinstance(v, bool):
            return float(v)
    return None


def probe_hf_rmsnorm(mod: nn.Module) -> tuple[float, bool, str] | str:
    """(eps, zero_centered, out_dtype_rule) for an RMSNorm-like module, or the reason it cannot be served."""
    params = dict(mod.named_parameters(recurse=False))
    if set(params) != {"weight"} or params["weight"].dim() != 1:
        return f"expected exactly one 1-D parameter named 'weight', found {sorted(params)}"
    if list(mod.buffers(recurse=False)) or list(mod.children()):
        return "has buffers or child modules"
    eps = _eps_of(mod)
    if eps is None:
        return "has no numeric eps / variance_epsilon attribute"
    n = params["weight"].shape[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_PROBE_ROWS, n, generator=gen) * 2.0 + 0.5
    w = torch.randn(n, generator=gen) * 0.5 + 1.0
    try:
        with torch.no_grad():
            y = torch.func.functional_call(mod, {"weight": w}, (x,))
            y_mixed = torch.func.functional_call(mod, {"weight": w}, (x.bfloat16(),))
    except Exception as e:  # noqa: BLE001 - any failure of a foreign forward means "leave it alone"
        return f"its forward failed on a CPU probe ({type(e).__name__}: {e})"
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return "its forward does not return a tensor of the input's shape"
    zero_centered = None
    for zc, ref in ((False, _rms_reference(x, w, eps)), (True, _rms_reference(x, w + 1.0, eps))):
        if torch.allclose(y.float(), ref, rtol=1e-4, atol=1e-5):
            zero_centered = zc
            break
    if zero_centered is None:
        return "its forward computes neither x * rsqrt(mean(x^2) + eps) * weight nor the same with (1 + weight)"
    if y_mixed.dtype == torch.bfloat16:
        rule = "input"
    elif y_mixed.dtype == torch.float32:
        rule = "promote"
    else:
        return f"its output dtype for bf16 input and an fp32 weight is {y_mixed.dtype}"
    return eps, zero_centered, rule


def _is_rmsnorm_like(mod: nn.Module, extra: tuple[type, ...]) -> bool:
    return isinstance(mod, extra) or "rmsnorm" in type(mod).__name__.lower()


def convert(mod: nn.Module, rms_norm_classes: Iterable[type] = ()) -> nn.Module | str:
    """The rtckern replacement of one norm module, or the reason it is not replaced."""
    extra = tuple(rms_norm_classes)
    if isinstance(mod, (M.RMSNorm, M.LayerNorm)):
        return "already an rtckern module"
    if type(mod) is nn.RMSNorm:
        return M.from_torch_rmsnorm(mod)
    if type(mod) is nn.LayerNorm:
        return M.from_torch_layernorm(mod)
    if isinstance(mod, nn.LayerNorm):
        return "a torch.nn.LayerNorm subclass with its own forward"
    if _is_rmsnorm_like(mod, extra):
        probed = probe_hf_rmsnorm(mod)
        if isinstance(probed, str):
            return probed
        eps, zero_centered, rule = probed
        return M.from_hf_rmsnorm(mod, eps, zero_centered, rule)
    return "not a norm module"


def _set_attention(model: nn.Module, report: PatchReport) -> None:
    from ._torch_hf import NAME, register_transformers

    if not hasattr(model, "set_attn_implementation") or not register_transformers():
        return
    model.set_attn_implementation(NAME)
    report.attention = getattr(model.config, "_attn_implementation", None)


def patch(model: nn.Module, *, norms: bool = True, attention: bool = True, rope: bool = True, mlp: bool = True,
          loss: bool = True, rms_norm_classes: Iterable[type] = ()) -> PatchReport:
    """Swap model's norm modules for rtckern's in place; with attention=True and a transformers model, register
    and select attn_implementation="rtckern"; with rope=True, run the attention modules' rotary embedding
    (transformers' apply_rotary_pos_emb) on rtckern's kernel; with mlp=True, run gated MLPs' activation on rtckern's
    SwiGLU kernel; with loss=True, compute a transformers causal LM's loss on rtckern's cross-entropy kernels. Returns
    what was replaced and what was skipped, and why.

    Each part can be turned off (norms=False, attention=False, rope=False, mlp=False, loss=False); what a part leaves
    alone stays the model's own."""
    report = PatchReport()
    extra = tuple(rms_norm_classes)
    if norms:
        if _is_rmsnorm_like(model, extra) or isinstance(model, (nn.RMSNorm, nn.LayerNorm)):
            raise ValueError(f"patch() swaps submodules in place, and the model itself is a norm "
                             f"({M.describe(model)}); use rtckern.torch.convert(module) for a single module")
        new_of: dict[int, nn.Module] = {}
        for path, mod in model.named_modules():
            if not (isinstance(mod, (nn.RMSNorm, nn.LayerNorm)) or _is_rmsnorm_like(mod, extra)):
                continue
            new = convert(mod, extra)
            if isinstance(new, str):
                if not isinstance(mod, (M.RMSNorm, M.LayerNorm)):
                    report.skipped.append((path, M.describe(mod), new))
                continue
            new_of[id(mod)] = new
            report.replaced.append((path, M.describe(mod)))
        for parent in list(model.modules()):  # every place a swapped module appears (shared modules included)
            for name, child in list(parent._modules.items()):
                if child is not None and id(child) in new_of:
                    parent._modules[name] = new_of[id(child)]
    if attention:
        _set_attention(model, report)
    if rope:
        from ._torch_hf_rope import patch_rope

        report.rope, report.rope_skipped = patch_rope(model)
    if mlp:
        from ._torch_hf_mlp import patch_mlp

        report.mlp, report.mlp_skipped = patch_mlp(model)
    if loss:
        from ._torch_hf_loss import patch_loss

        report.loss, report.loss_skipped = patch_loss(model)
    return report
