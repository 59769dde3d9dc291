"""Write docs/ops.md from the docstrings of rtckern.ops: ``python tools/gen_ops_doc.py`` (tests/unit/ops/test_docs.py
checks that the file is up to date and that every op documents its parameters, returns and raises)."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import rtckern.ops as ops  # noqa: E402

# family subpackage -> section title, in page order
FAMILIES = {"_norms": "Norms", "_softmax": "Softmax", "_attention": "Attention", "_gemm": "GEMM", "_fp8": "fp8",
            "_rope": "Rotary position embedding", "_glu": "Gated activations", "_loss": "Losses"}
SECTIONS = ("Args", "Returns", "Raises")

PREAMBLE = """# Ops: `rtckern.ops`

Generated from the ops' docstrings by `python tools/gen_ops_doc.py`; do not edit by hand.

```python
import rtckern.ops as ops
y = ops.rms_norm(x, w, eps=1e-6)
```

- **Arrays**: torch CUDA tensors, CuPy arrays, or any object with `__dlpack__` / `__cuda_array_interface__` (viewed
  through torch). Outputs are new arrays of the input's library (torch in, torch out; CuPy in, CuPy out), allocated
  by that library and computed on its current stream. Host (CPU) arrays are refused with an `InputError` that says
  to move them to the GPU; the torch plugin's modules fall back to torch instead (`docs/torch.md`).
- **Checks**: each new call signature is validated once (dtype, shape, device, layout); an `InputError` names the
  argument, the value and what is accepted. Later calls with the same signature (torch tensors) skip to the launch.
- **Which kernel**: the registry picks one implementation per request and device (`rtckern explain OP ...` shows the
  candidates and why). No candidate serving the request is an `UnsupportedRequestError` listing each candidate's
  reason (a GPU older than the op needs, or `RTCKERN_DISABLE_OPS` naming the op).
- **First call**: compiles (or loads from the caches) the kernels it needs; `rtckern prefill` does that ahead of time
  (`docs/fleet.md`). Every op is also a `torch.ops.rtckern.*` custom op (`docs/torch.md`).
"""


def _section_lines(doc: str) -> list[str]:
    """The docstring as markdown: the summary and paragraphs as text, Args / Raises entries as bullets."""
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    section = None
    for line in lines:
        head = line.rstrip(":")
        if line.endswith(":") and head in SECTIONS and not line.startswith(" "):
            section = head
            out += ["", f"**{section}**", ""]
            continue
        if section is None or section == "Returns":
            out.append(line.strip())
            continue
        m = re.match(r"^    (\S[^:]*?):\s(.*)$", line)
        if m:  # a new entry: "name: text" or "name, other: text"
            names = ", ".join(f"`{n.strip()}`" for n in m.group(1).split(","))
            out.append(f"- {names}: {m.group(2).strip()}")
        elif line.strip():
            out[-1] += " " + line.strip()
    return out


def _signature(name: str, fn) -> str:
    sig = inspect.signature(fn)
    params = []
    for p in sig.parameters.values():
        text = p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not any(x.startswith("*") for x in params):
            params.append("*")
        params.append(text)
    return f"{name}({', '.join(params)})"


# What holds for a whole family, before its ops
INTRO = {
    "_norms": "Storage fp32, fp16 or bf16, arithmetic in fp32, over the last dimension (any N >= 1); the weight (and "
              "bias) may be fp32 with fp16 / bf16 activations. Rows may be strided; zero rows launch nothing. The "
              "same inputs give bitwise the same outputs on a given device, the weight gradients included.",
    "_softmax": "Dtypes fp32, fp16, bf16 (inputs and outputs alike), arithmetic in fp32; every softmax is over the last "
                "dimension. A boolean mask is True where a key is masked out. Masked keys contribute exactly zero "
                "and get exactly zero; a row whose keys are all masked (a fully masked mask row, or a query above the "
                "causal diagonal when Sq > Sk) gives all zeros, not NaN, and a zero gradient. An input of -inf "
                "counts as a masked key whatever the sign of the scale.",
    "_attention": "Dense (batch, seqlen, heads, head_dim) or packed varlen (total, heads, head_dim) layouts, and "
                  "queries over a contiguous or paged KV cache; bf16 or fp16 with fp32 accumulation; head_dim 32, 64, 96, 128 or 256; GQA / MQA (heads_q a multiple of "
                  "heads_kv); causal masks aligned to the bottom-right corner. A query that sees no key gets an "
                  "output of zeros and an lse of -inf (never NaN). Limits: seqlen up to 2^31 - 1, batch and heads_q "
                  "up to 65535 each per call.",
    "_gemm": "fp16 or bf16 operands, fp32 accumulation, fused bias, activation and residual epilogue; any M, N, K "
             ">= 1. The grouped GEMMs (mixture-of-experts layers) multiply the rows of every group by the group's own "
             "B in one launch; their group index lives in device memory and is never read on the host.",
    "_fp8": "float8_e4m3fn operands with fp32 scales, on sm_89+ GPUs (Ada, Hopper and newer; the grouped fp8 GEMMs "
            "on sm_90); quantize_fp8 and rms_norm_quant (Norms) produce the operands and their scales.",
    "_rope": "RoPE of q and k in one launch, in transformers' rotate-half convention, forward and backward; torch "
             "tensors only (rtckern.torch.apply_rotary_pos_emb is its autograd-aware drop-in, and patch() puts a "
             "transformers model's attention modules on it).",
    "_glu": "SwiGLU, the gated activation of Llama-style MLPs, forward and backward; separate gate and up arrays or "
            "the two halves of a fused gate_up projection (rtckern.torch.swiglu is its autograd-aware drop-in, and "
            "patch() puts a transformers model's MLPs on it).",
    "_loss": "Cross-entropy of rows of logits (classes in the last dimension) against int64 / int32 labels, forward "
             "and backward, one read of the logits each way and no fp32 copy of them (rtckern.torch.cross_entropy "
             "adds the reductions and autograd, and patch() puts a transformers causal LM's loss on it).",
}


def ops_doc() -> str:
    import importlib

    by_family = {f: [n for n in importlib.import_module(f"rtckern.ops.{f}.api").__all__
                     if callable(getattr(ops, n, None))] for f in FAMILIES}
    missing = sorted(n for n in ops.__all__ if callable(getattr(ops, n)) and
                     not any(n in names for names in by_family.values()))
    if missing:
        raise SystemExit(f"ops of no family: {missing}; add their family to FAMILIES")
    out = [PREAMBLE.rstrip("\n"), "", "| op | family |", "|---|---|"]
    out += [f"| [`{n}`](#{n}) | {FAMILIES[f]} |" for f, names in by_family.items() for n in names]
    for family, names in by_family.items():
        out += ["", f"## {FAMILIES[family]}", "", INTRO[family]]
        if family == "_gemm":
            out += ["", f"`rtckern.ops.ACTIVATIONS` = `{ops.ACTIVATIONS!r}`: the fused activations gemm takes."]
        for name in names:
            fn = getattr(ops, name)
            out += ["", f"### {name}", "", "```python", _signature(name, fn), "```", ""]
            out += _section_lines(fn.__doc__ or "")
    return "\n".join(out).replace("\n\n\n", "\n\n") + "\n"


if __name__ == "__main__":
    (REPO / "docs" / "ops.md").write_text(ops_doc())
