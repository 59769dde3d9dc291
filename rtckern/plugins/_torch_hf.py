"""Hugging Face transformers integration: rtckern attention in transformers' attention-function registry.

    rtckern.torch.register_transformers()      # also done by `import rtckern.torch` when transformers is loaded,
                                               # and by rtckern.torch.patch(model)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="rtckern")
    model.set_attn_implementation("rtckern")

The attention function follows transformers' sdpa_attention_forward contract (query/key/value (batch, heads,
seqlen, head_dim), kv heads not repeated; returns ((batch, seqlen, heads, head_dim), None)) and its causal
decision: causal when the module is causal, no mask was built and seqlen_q > 1; with no mask and
seqlen_k > seqlen_q (prefill into an empty static cache) the keys past seqlen_q are cropped, as sdpa does.
Padded and packed batches take rtckern.ops.attention_varlen, as transformers' flash_attention_2 integration takes
flash_attn_varlen_func (_torch_hf_varlen: the "rtckern" mask builder hands over a padding mask or packed sequence
ids instead of sdpa's 4D mask; the flash-attention kwargs cu_seq_lens_q/k, max_length_q/k and restarting
position_ids are honoured). Decode steps over a KV cache (a StaticCache's, whose 4D mask went to sdpa before, or a
DynamicCache's; up to 16 queries, no padding) take rtckern.ops.attention_with_kvcache on the cache tensors in place
(_torch_hf_kvcache: the builder hands over the cache lengths, made on the device). Calls the kernels cannot take
(any other mask pattern; dropout; sliding windows; softcapping; position biases; attention weights asked for; head
dims or dtypes rtckern.ops.attention does not support) run transformers' sdpa attention instead, with one warning
(an error under RTCKERN_STRICT=1).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _torch_eager as E
from . import _torch_hf_kvcache as K
from . import _torch_hf_varlen as V
from ._torch_dispatch import fallback

NAME = "rtckern"
_HEAD_DIMS = (32, 64, 96, 128, 256)


def _why_not(module, query, key, value, attention_mask, dropout, kwargs) -> Optional[str]:
    if attention_mask is not None and V.mask_kind(attention_mask) is None:
        return ("an attention mask was given (a custom pattern); causal/full attention, padding and packed sequences "
                "are fused")
    if dropout:
        return f"attention dropout {dropout} (training with attention_dropout > 0)"
    for k in ("sliding_window", "softcap", "position_bias", "s_aux", "sinks"):
        if kwargs.get(k) is not None:
            return f"{k}={kwargs[k]!r} is not supported by rtckern attention"
    if kwargs.get("output_attentions"):
        return "output_attentions=True needs the attention weights"
    if not query.is_cuda:
        return f"tensors are on {query.device}"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {query.dtype}; rtckern attention takes float16 / bfloat16"
    if query.shape[-1] not in _HEAD_DIMS or key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        return f"head dims q {query.shape[-1]}, k {key.shape[-1]}, v {value.shape[-1]}; supported: {_HEAD_DIMS}"
    if query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} kv heads"
    return None


def rtckern_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                              scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    kind = V.mask_kind(attention_mask)
    why = _why_not(module, query, key, value, attention_mask, dropout, kwargs)
    if why is None and kind == "lengths":  # a decode step over a KV cache (the builder checked the mask pattern)
        why = K.why_not(query, key, value)
    if why is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        fallback("attention", f"transformers attention of {tuple(query.shape)} {query.dtype}", why)
        if kind is not None:  # what rtckern_mask handed over: sdpa takes a 4D mask
            attention_mask = V.as_sdpa_mask(attention_mask, query.shape[2], key.shape[2])
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if kind == "lengths":
        return K.run(attention_mask, query, key, value, scaling), None
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    plan = V.route(attention_mask, query, key, kwargs)
    if plan is not None:  # padded or packed: the padding / packed masks come from the causal mask builder
        return V.run(plan, query, key, value, attention_mask is not None or bool(causal), scaling), None
    causal = bool(causal) and q_len > 1
    if causal and kv_len > q_len:  # prefill into an empty static cache (what sdpa_attention_forward does)
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = E.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal, scaling)
    return out, None


def register_transformers() -> bool:
    """Register "rtckern" with transformers' AttentionInterface (and its mask builder, sdpa's except for padding and
    packed sequences: _torch_hf_varlen.rtckern_mask). False when transformers (or its attention and mask registries)
    is not installed."""
    try:
        from transformers import AttentionInterface
        from transformers import masking_utils as mu

        masks = mu.AttentionMaskInterface
        if not (callable(mu.sdpa_mask) and callable(mu.causal_mask_function)):  # what rtckern_mask builds on
            return False
    except (ImportError, AttributeError):
        return False
    AttentionInterface.register(NAME, rtckern_attention_forward)
    V.use_masking_utils(mu)
    masks.register(NAME, V.rtckern_mask)
    return True
