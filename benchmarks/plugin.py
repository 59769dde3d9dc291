"""PyTorch plugin end to end: a small Llama from transformers, unpatched against rtckern.torch.patch(model).

A randomly initialised Llama (sdpa attention, transformers' RMSNorm) against rtckern.torch.patch(model) (rtckern
RMSNorm + attention), at two sizes (CONFIGS), a token-by-token decode step (batch 1, KV cache, eager: host-bound, so
the plugin's per-call cost decides), and the host cost of one call through each layer of the plugin.

    python -m benchmarks plugin [--quick]

Accuracy: logits and parameter gradients of both bf16 models against a float32 copy of the unpatched model
(relative L2 error); the patched model must stay within 2x the unpatched model's own bf16 error (+1e-3).
Speed: forward (inference) and forward+backward (loss.backward()) with CUDA events, warm-up first, the two models
alternating iteration by iteration (drift hits both alike), median of `reps`.
"""
from __future__ import annotations

import copy
import inspect
import statistics
import time

from benchmarks.runner import Result, Table

# Large enough per call to keep the GPU busy (4 layers of 2048 hidden, 8192 tokens): a timing of launch gaps would
# measure Python, not kernels. Head dim 128, GQA 4.
LLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5)


def grad_params(layers: int) -> tuple[str, ...]:
    last = layers - 1
    return ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
            f"model.layers.{last}.post_attention_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
            f"model.layers.{last}.self_attn.k_proj.weight", f"model.layers.{last}.mlp.down_proj.weight",
            "model.norm.weight", "lm_head.weight")


def rel_err(x, ref) -> float:
    import torch

    if not torch.isfinite(x).all():
        return float("inf")
    d = torch.linalg.vector_norm((x.double() - ref.double())).item()
    return d / max(torch.linalg.vector_norm(ref.double()).item(), 1e-30)


def build_models(batch: int, seq: int, seed: int = 0, **overrides):
    import torch
    import transformers

    import rtckern.torch as rt

    cfg = transformers.LlamaConfig(**{**LLAMA, **overrides})
    torch.manual_seed(seed)
    ref = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").cuda().to(torch.bfloat16)
    ref32 = copy.deepcopy(ref).float()  # the same (bf16-valued) weights: the errors below are arithmetic only
    patched = copy.deepcopy(ref)
    report = rt.patch(patched)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    return ref32, ref, patched, report, ids


def _loss(model, ids):
    import torch

    logits = model(ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def accuracy(ref32, ref, patched, ids) -> dict:
    import torch

    out: dict = {}
    with torch.no_grad():
        l32, lref, lrt = (m(ids).logits for m in (ref32, ref, patched))
    out["logits_err_torch_bf16"] = rel_err(lref, l32)
    out["logits_err_rtckern_bf16"] = rel_err(lrt, l32)
    out["logits_err_rtckern_vs_torch"] = rel_err(lrt, lref)
    del l32, lref, lrt
    names = grad_params(ref.config.num_hidden_layers)
    grads = {}
    for name, m in (("fp32", ref32), ("torch", ref), ("rtckern", patched)):
        m.zero_grad(set_to_none=True)
        _loss(m, ids).backward()
        p = dict(m.named_parameters())
        grads[name] = {k: p[k].grad.detach().clone() for k in names}
        m.zero_grad(set_to_none=True)
    out["grad_err"] = {k: {"torch_bf16": rel_err(grads["torch"][k], grads["fp32"][k]),
                           "rtckern_bf16": rel_err(grads["rtckern"][k], grads["fp32"][k])} for k in names}
    return out


def within_tolerance(acc: dict) -> list[str]:
    """The comparisons that fail 'patched error <= 2 x unpatched error + 1e-3'."""
    bad = []
    if not acc["logits_err_rtckern_bf16"] <= 2 * acc["logits_err_torch_bf16"] + 1e-3:
        bad.append(f"logits: rtckern {acc['logits_err_rtckern_bf16']:.3e} vs torch {acc['logits_err_torch_bf16']:.3e}")
    for k, e in acc["grad_err"].items():
        if not e["rtckern_bf16"] <= 2 * e["torch_bf16"] + 1e-3:
            bad.append(f"grad {k}: rtckern {e['rtckern_bf16']:.3e} vs torch {e['torch_bf16']:.3e}")
    return bad


def _timed(fn) -> float:
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def speed(ref, patched, ids, reps: int = 20, warmup: int = 3) -> dict:
    import torch

    def fwd(m):
        with torch.no_grad():
            m(ids)

    def train_step(m):
        m.zero_grad(set_to_none=True)
        _loss(m, ids).backward()

    out = {}
    for name, fn in (("forward_ms", fwd), ("fwd_bwd_ms", train_step)):
        for _ in range(warmup):
            fn(ref)
            fn(patched)
        t_ref, t_rt = [], []
        for _ in range(reps):
            t_ref.append(_timed(lambda: fn(ref)))
            t_rt.append(_timed(lambda: fn(patched)))
        out[name] = {"torch": statistics.median(t_ref), "rtckern": statistics.median(t_rt),
                     "torch_spread": [min(t_ref), max(t_ref)], "rtckern_spread": [min(t_rt), max(t_rt)]}
        out[name]["speedup"] = out[name]["torch"] / out[name]["rtckern"]
    ref.zero_grad(set_to_none=True)
    patched.zero_grad(set_to_none=True)
    return out


def decode_step_ms(steps: int = 32, reps: int = 7, prompt: int = 128, device: str = "cuda", **overrides) -> dict:
    """Time per generated token, batch 1, greedy, KV cache (transformers' DynamicCache), eager, no grad: unpatched
    against patched, the two alternating rep by rep; each rep prefills the prompt (untimed), then times `steps`
    decode steps. At batch 1 the GPU work per step is small: the host cost of each norm and attention call shows."""
    import torch
    import transformers

    import rtckern.torch as rt

    cfg = transformers.LlamaConfig(**{**LLAMA, **overrides})
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ref = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(device, dtype).eval()
    patched = copy.deepcopy(ref)
    rt.patch(patched)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # the KV cache's argument and output name: `cache` in newer transformers, `past_key_values` before
    kw = "cache" if "cache" in inspect.signature(ref.forward).parameters else "past_key_values"

    def run_steps(model) -> float:
        with torch.no_grad():
            out = model(ids, use_cache=True)
            cache, nxt = out[kw], out.logits[:, -1:].argmax(-1)
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(nxt, use_cache=True, **{kw: cache})
                cache, nxt = out[kw], out.logits[:, -1:].argmax(-1)
            sync()
            return (time.perf_counter() - t0) / steps * 1e3

    run_steps(ref)  # warm-up: rtckern's first calls compile/load their kernels
    run_steps(patched)
    t_ref, t_rt = [], []
    for _ in range(reps):
        t_ref.append(run_steps(ref))
        t_rt.append(run_steps(patched))
    torch_ms, rtckern_ms = statistics.median(t_ref), statistics.median(t_rt)
    return {"config": {**LLAMA, **overrides, "batch": 1, "prompt": prompt, "steps": steps},
            "torch_ms": torch_ms, "rtckern_ms": rtckern_ms, "speedup": torch_ms / rtckern_ms,
            "torch_spread": [min(t_ref), max(t_ref)], "rtckern_spread": [min(t_rt), max(t_rt)]}


def _host_us(fn, n: int) -> float:
    import torch

    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return round(best, 2)


def call_overhead_us(n: int = 2000) -> dict:
    """Host time per call on inputs so small that the GPU idles and the host loop is the cost: each layer of the
    plugin (custom op through the dispatcher, the eager fast path, the drop-in module, transformers' function),
    the rtckern op it wraps, and torch's own op."""
    import torch

    import rtckern.torch as rt
    from rtckern import ops

    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    mod = rt.RMSNorm(1024, eps=1e-6).to("cuda", torch.bfloat16)
    q = torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16)
    qt = q.transpose(1, 2)
    llama_attn = type("M", (), {"is_causal": True, "num_key_value_groups": 1})()
    fns = {
        "rms_norm: torch.ops.rtckern.rms_norm": lambda: torch.ops.rtckern.rms_norm(x, w, 1e-6),
        "rms_norm: rtckern.torch.rms_norm (eager fast path)": lambda: rt.rms_norm(x, w, 1e-6),
        "rms_norm: rtckern.torch.RMSNorm module": lambda: mod(x),
        "rms_norm: rtckern.ops.rms_norm": lambda: ops.rms_norm(x, w, 1e-6),
        "rms_norm: torch.nn.functional.rms_norm": lambda: torch.nn.functional.rms_norm(x, (1024,), w, 1e-6),
        "attention: torch.ops.rtckern.attention": lambda: torch.ops.rtckern.attention(q, q, q, True),
        "attention: rtckern.torch.attention (eager fast path)": lambda: rt.attention(q, q, q, True),
        "attention: transformers function": lambda: rt.rtckern_attention_forward(llama_attn, qt, qt, qt, None),
        "attention: rtckern.ops.attention": lambda: ops.attention(q, q, q, causal=True),
        "attention: torch sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(qt, qt, qt, is_causal=True),
    }
    return {name: _host_us(fn, n) for name, fn in fns.items()}


def run_e2e(batch: int = 4, seq: int = 2048, reps: int = 20, **overrides) -> dict:
    import torch

    ref32, ref, patched, report, ids = build_models(batch, seq, **overrides)
    result = {"config": {**LLAMA, **overrides, "batch": batch, "seq": seq, "dtype": "bf16"},
              "replaced": len(report.replaced), "attention": report.attention}
    result["accuracy"] = accuracy(ref32, ref, patched, ids)
    result["accuracy_failures"] = within_tolerance(result["accuracy"])
    del ref32
    torch.cuda.empty_cache()
    result["speed"] = speed(ref, patched, ids, reps=reps)
    return result


def _body(res: dict) -> list:
    body = []
    for name, e2e in res["e2e"].items():
        acc, sp = e2e["accuracy"], e2e["speed"]
        c = e2e["config"]
        body.append(f"## {name}: Llama {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, batch {c['batch']} "
                    f"x seq {c['seq']}, bf16\n\npatched: {e2e['replaced']} norms, attention={e2e['attention']}")
        body.append(Table(("median ms", "torch (sdpa + HF RMSNorm)", "rtckern", "speedup"),
                          [(k, f"{sp[k]['torch']:.3f}", f"{sp[k]['rtckern']:.3f}", f"{sp[k]['speedup']:.3f}x")
                           for k in ("forward_ms", "fwd_bwd_ms")]))
        lines = ["relative L2 error against the fp32 model (same weights):", "",
                 f"- logits: torch bf16 {acc['logits_err_torch_bf16']:.3e}, rtckern bf16 "
                 f"{acc['logits_err_rtckern_bf16']:.3e}"]
        for k, e in acc["grad_err"].items():
            lines.append(f"- grad {k}: torch bf16 {e['torch_bf16']:.3e}, rtckern bf16 {e['rtckern_bf16']:.3e}")
        body += ["\n".join(lines), f"accuracy failures: {e2e['accuracy_failures'] or 'none'}"]
    dec = res.get("decode")
    if dec:
        c = dec["config"]
        body.append(Table(("ms per token", "torch (sdpa + HF RMSNorm)", "rtckern", "speedup"),
                          [("decode step", f"{dec['torch_ms']:.3f}", f"{dec['rtckern_ms']:.3f}",
                            f"{dec['speedup']:.3f}x")],
                          title=f"decode: Llama {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, batch 1, "
                                f"prompt {c['prompt']}, {c['steps']} steps, KV cache, eager, bf16"))
    body.append(Table(("call", "us"), list(res["overhead_us"].items()), title="host cost per call (us, GPU idle)"))
    return body


CONFIGS = {
    "gpu_bound": dict(batch=4, seq=2048),  # 4 layers, 8192 tokens
    "small": dict(batch=2, seq=2048, num_hidden_layers=2),  # 4096 tokens: host overheads show
}


QUICK = "the small model only (2 layers, 4096 tokens), besides the decode step and the per-call costs"


def run(args) -> Result:
    import torch

    res = {"device": torch.cuda.get_device_name(), "overhead_us": call_overhead_us(), "decode": decode_step_ms(),
           "e2e": {}}
    for name, cfg in CONFIGS.items():
        if args.quick and name != "small":
            continue
        res["e2e"][name] = run_e2e(**cfg)
        torch.cuda.empty_cache()
    rows = [{"model": name, **e2e} for name, e2e in res["e2e"].items()]
    return Result("rtckern.torch end to end", rows=rows, body=_body(res),
                  data={k: v for k, v in res.items() if k != "e2e"})
