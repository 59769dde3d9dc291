"""rtckern's ops as PyTorch custom ops, drop-in modules and model patching.

    import rtckern.torch                       # registers torch.ops.rtckern.*
    y = torch.ops.rtckern.rms_norm(x, weight, 1e-6)
    o = torch.ops.rtckern.attention(q, k, v, True)            # (batch, seqlen, heads, head_dim)
    o = torch.ops.rtckern.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, True)  # packed (total, heads, head_dim)
    o, lse = torch.ops.rtckern.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens)  # decode over a KV cache
    norm = rtckern.torch.RMSNorm(4096, eps=1e-6)              # torch.nn.RMSNorm, same state dict
    report = rtckern.torch.patch(model)                       # swap norms in place; transformers attention
    y = rtckern.torch.rms_norm(x, weight, 1e-6)               # the op without the dispatcher in plain eager code
    q, k = rtckern.torch.apply_rotary_pos_emb(q, k, cos, sin)  # transformers' RoPE, one kernel for q and k
    h = rtckern.torch.swiglu(gate, up)                        # silu(gate) * up, one kernel each way
    loss = rtckern.torch.cross_entropy(logits, labels)        # (..., classes) logits, no fp32 copy of them

Ops (namespace `rtckern`): rms_norm, fused_add_rms_norm, layer_norm (composite; their *_fwd / *_bwd custom ops
carry the kernels), softmax, scaled_masked_softmax, scaled_upper_triang_masked_softmax,
scaled_aligned_causal_masked_softmax (+ *_bwd), attention (composite; attention_fwd / attention_bwd), attention_varlen
(composite; attention_varlen_fwd / attention_varlen_bwd), attention_with_kvcache (contiguous or paged KV cache,
appends in place: k_cache / v_cache are declared mutated; inference only), gemm, gemm_fp8, quantize_fp8,
rms_norm_quant (fused RMSNorm + per-group fp8 quantization; inference only, no autograd), grouped_gemm,
grouped_gemm_masked, grouped_gemm_fp8, grouped_gemm_fp8_masked (mixture-of-experts GEMMs; inference only, no autograd),
rope (rotary position embedding of q and k, transformers' apply_rotary_pos_emb; rope_bwd carries its backward),
swiglu (silu(gate) * up, a Llama-style MLP's activation; swiglu_bwd carries its backward), cross_entropy
(composite, classes in the last dimension; cross_entropy_fwd / cross_entropy_bwd).

The ops are torch.library.Library ops (_torch_lib.KernelOp, chosen over custom_op for host cost): an eager call
is one Python kernel that runs rtckern's op itself; under tracing, modes and subclasses they dispatch in full. Where
the native front is built (_torch_native, RTCKERN_TORCH_NATIVE), a C++ kernel in front of them replays plain eager
calls that need no gradient without entering Python (`native_status()` says what it serves).
Importing this module does not import torch._dynamo. Every op has a fake kernel (shape and dtype inference
under torch.compile, export and FakeTensorMode),
autograd wired to rtckern's backward kernels (norms, softmax; gemm's backward is rtckern GEMMs; attention's is
documented in _torch_attention), launches on torch's current stream, and outputs allocated by torch.
torch.compile(fullgraph=True) traces them without graph breaks. CUDA graphs: warm up once before capture; a
first call during capture raises GraphCaptureError instead of compiling (install_capture_guard).

When no JIT candidate serves a request, torch's own implementation runs with one warning per op; RTCKERN_STRICT=1
(rtckern.config `strict`) makes that an error. An op family whose rtckern.ops module is missing is skipped at
registration, named in `skipped_ops` and logged.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

log = logging.getLogger(__name__)

# family -> (its rtckern.ops API module, the plugin module registering its torch ops)
FAMILIES = {
    "norms": ("rtckern.ops._norms.api", "rtckern.plugins._torch_norms"),
    "softmax": ("rtckern.ops._softmax.api", "rtckern.plugins._torch_softmax"),
    "attention": ("rtckern.ops._attention.api", "rtckern.plugins._torch_attention"),
    "attention_varlen": ("rtckern.ops._attention.api", "rtckern.plugins._torch_attention_varlen"),
    "attention_kvcache": ("rtckern.ops._attention.api", "rtckern.plugins._torch_attention_kvcache"),
    "gemm": ("rtckern.ops._gemm.api", "rtckern.plugins._torch_gemm"),
    "fp8": ("rtckern.ops._fp8.api", "rtckern.plugins._torch_fp8"),
    "rope": ("rtckern.ops._rope.api", "rtckern.plugins._torch_rope"),
    "glu": ("rtckern.ops._glu.api", "rtckern.plugins._torch_glu"),
    "loss": ("rtckern.ops._loss.api", "rtckern.plugins._torch_loss"),
}

registered_ops: list[str] = []  # torch.ops.rtckern.<name> for each
skipped_ops: dict[str, str] = {}  # family -> why it was not registered


def _register_family(family: str, ops_module: str, plugin_module: str) -> None:
    if importlib.util.find_spec(ops_module) is None:
        skipped_ops[family] = f"{ops_module} is not present in this rtckern; its torch ops are not registered"
        log.warning("rtckern.torch: %s", skipped_ops[family])
        return
    importlib.import_module(ops_module)  # registers the family's registry candidates
    mod = importlib.import_module(plugin_module)  # defines torch.ops.rtckern.* (once per process)
    registered_ops.extend(mod.OPS)


def _register_all() -> None:
    for family, (ops_module, plugin_module) in FAMILIES.items():
        _register_family(family, ops_module, plugin_module)


_register_all()

from ._torch_dispatch import GraphCaptureError, install_capture_guard, reference_mode  # noqa: E402
from ._torch_attention_kvcache import attention_with_kvcache  # noqa: E402
from ._torch_attention_varlen import attention_varlen  # noqa: E402
from ._torch_eager import apply_rotary_pos_emb, attention, cross_entropy, layer_norm, plain_eager, rms_norm, \
    swiglu  # noqa: E402
from ._torch_hf import register_transformers, rtckern_attention_forward  # noqa: E402
from ._torch_modules import LayerNorm, RMSNorm  # noqa: E402
from ._torch_patch import PatchReport, convert, patch  # noqa: E402
from rtckern.logs import register_torch as register_torch_logging  # noqa: E402

from ._torch_native import activate as _activate_native, status as native_status  # noqa: E402

install_capture_guard()
_activate_native()  # torch.ops.rtckern through the C++ front where it is built (RTCKERN_TORCH_NATIVE)
register_torch_logging()  # `rtckern` in torch's log registry (TORCH_LOGS / torch._logging.set_logs)
if "transformers" in sys.modules:  # registering needs transformers imported; patch() registers otherwise
    register_transformers()

__all__ = ["GraphCaptureError", "LayerNorm", "PatchReport", "RMSNorm", "apply_rotary_pos_emb", "attention",
           "attention_varlen", "attention_with_kvcache", "convert", "cross_entropy", "install_capture_guard",
           "layer_norm", "native_status", "patch",
           "plain_eager", "reference_mode", "register_transformers", "registered_ops", "rms_norm",
           "rtckern_attention_forward", "skipped_ops", "swiglu"]
