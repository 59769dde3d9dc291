"""A transformers causal LM's loss on rtckern's cross-entropy kernels (patch(model, loss=True)).

transformers computes a causal LM's loss (model(input_ids, labels=...)) with ForCausalLMLoss: it upcasts the logits to
fp32 (a full copy), shifts the labels and runs torch's cross-entropy (which writes an fp32 log-softmax) with
reduction "mean", or "sum" divided by num_items_in_batch where the trainer passes it. `causal_lm_loss` does the same
on rtckern.torch.cross_entropy: the logits are read once forward and once backward in their own dtype, nothing of
their size is kept but the gradient. patch() sets it as the model's `loss_function` (transformers' own setter) where
the model's loss is ForCausalLMLoss; other losses are left alone and reported. Logits off the GPU or of a dtype the
kernels do not take run transformers' function with one warning (an error under RTCKERN_STRICT=1).
"""
from __future__ import annotations

import torch

from . import _torch_eager as E
from ._torch_dispatch import fallback

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _hf_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


def causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                   shift_labels=None, **kwargs) -> torch.Tensor:
    """transformers' ForCausalLMLoss (same arguments and result: fp32, the mean over the predicted tokens, or their
    sum over num_items_in_batch) on rtckern's kernels."""
    if not logits.is_cuda or logits.dtype not in _DTYPES:
        fallback("cross_entropy", f"the causal LM loss of {tuple(logits.shape)} {logits.dtype} logits",
                 f"logits are on {logits.device}" if not logits.is_cuda else f"dtype {logits.dtype}")
        return _hf_loss()(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                          ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
    if shift_labels is None:  # tokens < n predict n: the last position of each sequence predicts nothing
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = E.cross_entropy(logits.reshape(-1, vocab_size), shift_labels, ignore_index, reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def patch_loss(model: torch.nn.Module) -> tuple[bool, str]:
    """Give a transformers causal LM rtckern's loss: (patched, why not). The model's loss is what it set itself
    (`_loss_function`), else what its loss_type maps to; the property is not read (it warns for models without a
    loss, such as a backbone)."""
    prop = getattr(type(model), "loss_function", None)
    if not isinstance(prop, property) or prop.fset is None:
        return False, ""  # not a transformers model: nothing to report
    own = model.__dict__.get("_loss_function")
    if own is causal_lm_loss:
        return True, ""
    loss_type = getattr(model, "loss_type", None)
    if own is None and loss_type is None:
        return False, ""  # a model without a loss of its own (a backbone): nothing to report
    try:
        hf = _hf_loss()
    except ImportError as e:
        return False, f"transformers' ForCausalLMLoss cannot be imported: {e}"
    if own is not None and own is not hf:
        return False, (f"its loss is {getattr(own, '__name__', type(own).__name__)}, not transformers' causal LM loss "
                       "(ForCausalLMLoss)")
    if own is None and loss_type != "ForCausalLM":
        return False, f"its loss_type is {loss_type}, not ForCausalLM"
    model.loss_function = causal_lm_loss
    return True, ""
