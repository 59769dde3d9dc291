"""PyTorch plugin end to end: a small Llama from transformers, unpatched against rtckern.torch.patch(model).

A randomly initialised Llama (sdpa attention, transformers' RMSNorm) against rtckern.torch.patch(model) (rtckern
RMSNorm + attention). Parts (--parts, default all):
- train: issue 22's training step (4 layers, hidden 2048, 16 heads, 4 kv heads, batch 2 x seq 2048, bf16; the
  model's own loss, model(..., labels=...).loss): each patch variant -- one part alone (attention, norms, rope, mlp,
  loss), full -- and an unpatched copy (A/A control: the noise), timed against the unpatched model in alternation,
  three runs (--runs): each run's speedup and the median;
- packed: the same 4096 tokens as random-length sequences (256..1792), packed (batch 1, position_ids restarting, as
  DataCollatorWithFlattening gives; attn_implementation="rtckern" takes the varlen path) against padded to the
  longest with an attention mask (rtckern: varlen on the unpadded tokens; sdpa: a 4D mask), and sdpa on the packed
  batch (transformers' block-diagonal 4D mask): forward + backward ms and tokens/s; the packed loss must equal the
  padded loss on the real tokens (bf16 tolerance);
- e2e: forward and forward+backward at two sizes (CONFIGS);
- decode: a token-by-token decode step (batch 1, DynamicCache, eager: host-bound, the plugin's per-call cost
  decides);
- graphs: decode steps on a StaticCache, eager and captured in a CUDA graph, unpatched and patched (a capture that
  fails is reported, not raised);
- overhead: the host cost of one call through each layer of the plugin.

    python -m benchmarks plugin [--quick] [--parts train,packed,...] [--runs 3] [--reps N]
    python -m benchmarks plugin --cpu      (a tiny Llama on the CPU: the suite's code paths, no GPU, no kernels)

Accuracy: logits and parameter gradients of the bf16 models against a float32 copy of the unpatched model
(relative L2 error); the patched model must stay within 2x the unpatched model's own bf16 error (+1e-3).
Speed: CUDA events, warm-up first, the models alternating iteration by iteration (drift hits both alike), median of
`reps`.
"""
from __future__ import annotations

import copy
import inspect
import statistics
import time

from benchmarks.env import legacy_meta
from benchmarks.runner import Result, Table, gpu_name, stored_data

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


def build_models(batch: int, seq: int, seed: int = 0, device: str = "cuda", **overrides):
    import torch
    import transformers

    import rtckern.torch as rt

    cfg = transformers.LlamaConfig(**{**LLAMA, **overrides})
    torch.manual_seed(seed)
    ref = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(device, torch.bfloat16)
    ref32 = copy.deepcopy(ref).float()  # the same (bf16-valued) weights: the errors below are arithmetic only
    patched = copy.deepcopy(ref)
    report = rt.patch(patched)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    return ref32, ref, patched, report, ids


def _loss(model, ids):
    """The model's own loss (transformers' causal LM loss: every position but the last predicts the next token)."""
    return model(ids, labels=ids).loss


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
    """ms of one call: CUDA events on a GPU, the host clock without one (the --cpu mode)."""
    import torch

    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
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


def run_e2e(batch: int = 4, seq: int = 2048, reps: int = 20, device: str = "cuda", **overrides) -> dict:
    import torch

    ref32, ref, patched, report, ids = build_models(batch, seq, device=device, **overrides)
    result = {"config": {**LLAMA, **overrides, "batch": batch, "seq": seq, "dtype": "bf16"},
              "replaced": len(report.replaced), "attention": report.attention, "rope_modules": len(report.rope),
              "mlp_modules": len(report.mlp), "loss": report.loss}
    result["accuracy"] = accuracy(ref32, ref, patched, ids)
    result["accuracy_failures"] = within_tolerance(result["accuracy"])
    del ref32
    if device == "cuda":
        torch.cuda.empty_cache()
    result["speed"] = speed(ref, patched, ids, reps=reps)
    return result


def _parts_text(e2e: dict) -> str:
    """The rope / MLP / loss parts of a patch, where the result records them."""
    if "rope_modules" not in e2e:
        return ""
    return (f", rope in {e2e['rope_modules']} modules, swiglu in {e2e['mlp_modules']} MLPs, "
            f"loss={'rtckern' if e2e['loss'] else 'transformers'}")


def _e2e_body(res: dict) -> list:
    body = []
    for name, e2e in res["e2e"].items():
        acc, sp = e2e["accuracy"], e2e["speed"]
        c = e2e["config"]
        body.append(f"## {name}: Llama {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, batch {c['batch']} "
                    f"x seq {c['seq']}, bf16\n\npatched: {e2e['replaced']} norms, attention={e2e['attention']}"
                    + _parts_text(e2e))
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
    return body


CONFIGS = {
    "gpu_bound": dict(batch=4, seq=2048),  # 4 layers, 8192 tokens
    "small": dict(batch=2, seq=2048, num_hidden_layers=2),  # 4096 tokens: host overheads show
}
PARTS = ("overhead", "decode", "train", "packed", "e2e", "graphs")
# --cpu: a Llama and batches small enough for the CPU, every part's code path with every rtckern op falling back to
# torch
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
TINY_SIZES = dict(seq=256, packed_tokens=512, lengths=(32, 224))


QUICK = ("train (three runs, 10 reps), packed, decode, graphs and overhead with fewer reps; not the e2e sizes "
         "(under 2 minutes on an H100)")


def add_args(ap) -> None:
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated parts to run, of {', '.join(PARTS)} (default: all)")
    ap.add_argument("--runs", type=int, default=3, help="independent timed runs of the training point (default 3)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed iterations per run and model (default 20; --quick 10; --cpu 2)")
    ap.add_argument("--cpu", action="store_true",
                    help="a tiny Llama on the CPU (every rtckern op falls back to torch): exercises the suite's code "
                         "paths without a GPU; its times mean nothing")


def needs_gpu(args) -> bool:
    return not getattr(args, "cpu", False)


def parse_parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise SystemExit(f"benchmarks plugin: --parts {text!r}: unknown {bad or 'empty'}; pick from {', '.join(PARTS)}")
    return parts


def run(args) -> Result:
    import torch

    from benchmarks import _plugin_graphs as G
    from benchmarks import _plugin_training as T

    parts = parse_parts(args.parts)
    cpu = getattr(args, "cpu", False)
    device = "cpu" if cpu else "cuda"
    model = TINY if cpu else {}
    reps = args.reps or (2 if cpu else 10 if args.quick else 20)
    res: dict = {"device": "cpu (tiny model, --cpu)" if cpu else torch.cuda.get_device_name(), "parts": list(parts),
                 "e2e": {}}

    def report() -> Result:
        return to_result(res)

    def done() -> None:
        if device == "cuda":
            torch.cuda.empty_cache()
        args.partial(report())

    if "overhead" in parts and not cpu:
        res["overhead_us"] = call_overhead_us(500 if args.quick else 2000)
        done()
    if "decode" in parts:
        res["decode"] = decode_step_ms(steps=16 if args.quick or cpu else 32, reps=3 if cpu else 5 if args.quick else 7,
                                       prompt=32 if cpu else 128, device=device, **model)
        done()
    if "train" in parts or "packed" in parts:
        res["train"] = T.run_training_point(runs=args.runs if "train" in parts else 0, reps=reps, device=device,
                                            packed="packed" in parts, packed_reps=reps,
                                            **(TINY_SIZES if cpu else {}), **model)
        done()
    if "e2e" in parts and not args.quick:
        for name, cfg in CONFIGS.items():
            res["e2e"][name] = run_e2e(reps=reps, device=device, **{**model, **cfg, **({"seq": 256} if cpu else {})})
            done()
    if "graphs" in parts:
        ref = T.build_llama(device, **model).eval()
        patched = T.make_variants(ref, {"full": {}})[0]["full"].eval()
        ref32 = copy.deepcopy(ref).float()
        res["graphs"] = G.static_decode({"torch": ref, "rtckern": patched}, prompt=32 if cpu else 128,
                                        steps=16 if cpu else 32 if args.quick else 64,
                                        reps=3 if cpu else 5 if args.quick else 7, device=device, reference=ref32)
        del ref, patched, ref32
        done()
    return report()


def to_result(res: dict) -> Result:
    """The result set of the parts measured so far (res: device, parts, e2e per config and each part's dict)."""
    rows = [{"part": "e2e", "model": name, **e2e} for name, e2e in res["e2e"].items()]
    return Result("rtckern.torch end to end", rows=rows + _rows(res), body=_body(res),
                  data={k: v for k, v in res.items() if k != "e2e"}, rc=1 if _failures(res) else 0,
                  plot=(lambda plt, meta: plot(plt, meta, res)) if speedups(res) else None)


def render(payload: dict) -> Result:
    """The result set of a stored JSON (one written before the runner too: {"date", "device", "torch",
    "overhead_us", "e2e"})."""
    if "rows" in payload:
        e2e = {r["model"]: {k: v for k, v in r.items() if k not in ("part", "model")} for r in payload["rows"]
               if r["part"] == "e2e"}
        return to_result({**stored_data(payload), "e2e": e2e})
    result = to_result({k: v for k, v in payload.items() if k not in ("date", "torch")})
    result.meta = legacy_meta({"date": payload["date"], "gpu": payload["device"], "torch": payload["torch"]},
                              gpu_used=True)
    return result


def speedups(res: dict) -> list[tuple[str, str, float, list]]:
    """(part, what, rtckern's speedup over torch, per-run speedups) of every comparison the parts measured."""
    out = []
    train = res.get("train") or {}
    for name, sp in train.get("speed", {}).items():
        what = "unpatched copy (A/A control)" if name == "none" else f"patch: {name}"
        out.append(("train step", what, sp["median_speedup"], sp["speedups"]))
    for what, x in ((train.get("packed") or {}).get("speedup") or {}).items():
        out.append(("packed", what, x, []))
    for name, e2e in res["e2e"].items():
        out += [("e2e", f"{name} {k.removesuffix('_ms')}", v["speedup"], []) for k, v in e2e["speed"].items()]
    if res.get("decode"):
        out.append(("decode", "eager step (DynamicCache)", res["decode"]["speedup"], []))
    for k, x in ((res.get("graphs") or {}).get("speedup") or {}).items():
        if x is not None:
            out.append(("graphs", f"StaticCache, {k}", x, []))
    return out


def plot(plt, meta: dict, res: dict):
    """rtckern's speedup over the unpatched model (sdpa + HF RMSNorm) in every comparison measured; dots: the
    training step's runs."""
    sp = speedups(res)
    parts = list(dict.fromkeys(p for p, *_ in sp))
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(sp) + 1.8))
    for i, (part, what, x, runs) in enumerate(sp):
        ax.barh(i, x, color=plt.cm.tab10(parts.index(part)), label=part if part not in [s[0] for s in sp[:i]] else None)
        ax.plot(runs, [i] * len(runs), "k.", ms=4)
        ax.text(max([x, *runs]), i, f" {x:.2f}x", va="center", fontsize=7)
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks(range(len(sp)))
    ax.set_yticklabels([what for _, what, _, _ in sp], fontsize=8)
    ax.invert_yaxis()
    lo = min(min([x, *runs]) for _, _, x, runs in sp)
    ax.set_xlim(min(0.8, lo - 0.05), None)
    ax.margins(x=0.1)
    ax.set_xlabel("speedup over the unpatched model (torch time / rtckern time)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"rtckern.torch end to end on {gpu_name(meta)}", fontsize=10)
    fig.tight_layout()
    return fig


def _failures(res: dict) -> list[str]:
    bad = [f"e2e {n}: {f}" for n, e in res["e2e"].items() for f in e["accuracy_failures"]]
    train = res.get("train") or {}
    bad += [f"train {v}: {f}" for v, fs in train.get("accuracy_failures", {}).items() for f in fs]
    bad += [f"packed: {f}" for f in (train.get("packed") or {}).get("accuracy_failures", [])]
    return bad


def _rows(res: dict) -> list[dict]:
    rows = []
    train = res.get("train") or {}
    for name, sp in train.get("speed", {}).items():
        rows.append({"part": "train", "variant": name, **train["variants"][name], "speedups": sp["speedups"],
                     "median_speedup": sp["median_speedup"], "runs": sp["runs"]})
    packed = train.get("packed")
    if packed:
        rows += [{"part": "packed", "config": k, "fwd_bwd_ms": ms, "tokens_per_s": packed["tokens_per_s"][k]}
                 for k, ms in packed["fwd_bwd_ms"].items()]
    graphs = res.get("graphs")
    if graphs:
        rows += [{"part": "graphs", "model": k, **{f: v.get(f) for f in ("eager_ms", "graph_ms", "graph_error")}}
                 for k, v in graphs["models"].items()]
    return rows


def _f(v, fmt: str = ".3f", suffix: str = "") -> str | None:
    return None if v is None else f"{v:{fmt}}{suffix}"


def _variant_text(v: dict) -> str:
    if "patch" not in v:
        return "unpatched copy (A/A control)"
    kw = ", ".join(f"{k}={x}" for k, x in v["patch"].items())
    rope = f", rope in {v['rope_modules']} modules" if "rope_modules" in v else ""
    mlp = f", swiglu in {v['mlp_modules']} MLPs" if "mlp_modules" in v else ""
    loss = f", loss={'rtckern' if v['loss'] else 'transformers'}" if "loss" in v else ""
    return f"patch({kw}): {v['norms_replaced']} norms, attention={v['attention']}{rope}{mlp}{loss}"


def _train_body(tr: dict) -> list:
    c = tr["config"]
    body: list = [f"## training step: Llama {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
                  f"{c['num_attention_heads']} heads, {c['num_key_value_heads']} kv heads, batch {c['batch']} x seq "
                  f"{c['seq']}, bf16 (forward + backward)"]
    if tr.get("speed"):
        runs = len(next(iter(tr["speed"].values()))["runs"])
        rows = []
        for name, sp in tr["speed"].items():
            ms = " / ".join(f"{r['torch_ms']:.2f} vs {r['patched_ms']:.2f}" for r in sp["runs"])
            rows.append((name, _variant_text(tr["variants"][name]), ms, " / ".join(f"{x:.3f}x" for x in sp["speedups"]),
                         f"{sp['median_speedup']:.3f}x"))
        body.append(Table(("variant", "what", f"ms torch vs patched, runs 1-{runs}", "speedup per run",
                           "median speedup"), rows))
        body.append("Each run times every variant against the unpatched model (sdpa + HF RMSNorm), the two "
                    "alternating step by step; speedup = median torch ms / median patched ms. Goals (issue 22): "
                    "attention >= 1.05x, full >= 1.3x.")
        gpu = [(name, f"{g['torch']:.2f}", f"{g['patched']:.2f}", f"{g['speedup']:.3f}x")
               for name, g in ((n, sp.get("gpu_ms")) for n, sp in tr["speed"].items()) if g]
        if gpu:
            body.append(Table(("variant", "GPU ms per step, torch", "GPU ms per step, patched", "GPU-time speedup"),
                              gpu, title="GPU time per step (kernels, copies and memsets; torch.profiler, 3 steps)"))
            body.append("Where a step's wall time exceeds its GPU time the GPU waits on the host (Python and launch "
                        "cost): the wall-time speedup above is bounded by the host's pace, the GPU-time speedup by "
                        "the kernels'.")
    if tr.get("served"):
        body.append("\n".join(["served by (one forward under RTCKERN_STRICT=1):", ""] +
                              [f"- {k}: {v}" for k, v in tr["served"].items()]))
    lines = ["relative L2 error against the fp32 model (same weights), torch bf16 / each variant:", ""]
    for name, acc in tr["accuracy"].items():
        lines.append(f"- {name}: logits {acc['logits_err_torch_bf16']:.3e} / {acc['logits_err_rtckern_bf16']:.3e}; "
                     "grads " + ", ".join(f"{k.removeprefix('model.').removesuffix('.weight')} "
                                          f"{e['torch_bf16']:.2e}/{e['rtckern_bf16']:.2e}"
                                          for k, e in acc["grad_err"].items()))
    fails = {k: v for k, v in tr["accuracy_failures"].items() if v}
    body += ["\n".join(lines), f"accuracy failures: {fails or 'none'}"]
    return body


def _packed_body(pk: dict) -> list:
    ms, tps = pk["fwd_bwd_ms"], pk["tokens_per_s"]
    rows = [(k, f"{ms[k]:.3f}", f"{tps[k]:,.0f}", f"{pk['accuracy']['loss'][k]:.5f}",
             f"{pk['accuracy']['logits_err'][k]:.3e}") for k in ms]
    shape = pk["padded_shape"]
    return [Table(("batch", "fwd+bwd ms", "tokens/s", "loss", "logits err vs fp32"), rows,
                  title=f"packed vs padded: {pk['tokens']} tokens in {len(pk['lengths'])} sequences "
                        f"{pk['lengths']}; padded {shape[0]} x {shape[1]} ({pk['padding_fraction']:.0%} padding)"),
            "\n".join(["packed: batch 1, position_ids restarting per sequence, no mask; padded: right padding and a "
                       "2D attention mask; rtckern = patch(model) (every part), sdpa = unpatched. fp32 loss "
                       f"(padded): {pk['accuracy']['loss']['fp32 padded']:.5f}.", ""] +
                      [f"- {k}: {v:.3f}x" for k, v in pk["speedup"].items()] +
                      [f"- served, {k}: {v}" for k, v in pk["served"].items()]),
            f"accuracy failures: {pk['accuracy_failures'] or 'none'}"]


def _graphs_body(g: dict) -> list:
    c = g["config"]
    rows = []
    for name, m in g["models"].items():
        f = m.get("forced")
        rows.append((name, _f(m["eager_ms"]), _f(m["graph_ms"]), _f(m["graph_speedup_vs_eager"], ".2f", "x"),
                     m.get("graph_matches_eager"), m["eager_tokens_agree_with_first"],
                     f"{f['top1']}/{f['steps']}" if f else None,
                     f"{f['err_median']:.2e} / {f['err_max']:.2e}" if f else None, m["served"],
                     m["graph_error"] or "-"))
    sp = g.get("speedup") or {}
    first = next(iter(g["models"]), "the first model")
    return [Table(("model", "eager ms/token", "graph ms/token", "graph vs eager", "graph tokens == eager",
                   f"greedy tokens == {first}'s", "teacher-forced top-1 == fp32", "logits error vs fp32 (median / max)",
                   "served by", "graph capture"), rows,
                  title=f"decode on a StaticCache, eager and CUDA graph: batch 1, prompt {c['prompt']}, {c['steps']} "
                        f"steps, max_cache_len {c['max_cache_len']}, bf16"),
            f"rtckern vs torch: eager {_f(sp.get('eager'), '.3f', 'x')}, CUDA graph "
            f"{_f(sp.get('graph'), '.3f', 'x') or '- (not captured)'} "
            "(issue 21: no slower eager, faster under CUDA graphs).",
            "Greedy tokens of a randomly initialised model part at the first near-tie of two logits, which bf16 "
            "rounding decides either way" + (
                f"; teacher-forced, every model decodes {first}'s greedy inputs and each step's logits are compared "
                "with the unpatched model's in fp32 (relative L2 error per step)."
                if any(m.get("forced") for m in g["models"].values()) else ".")]


def _body(res: dict) -> list:
    body: list = []
    if res.get("train"):
        body += _train_body(res["train"])
        if res["train"].get("packed"):
            body += _packed_body(res["train"]["packed"])
    if res.get("graphs"):
        body += _graphs_body(res["graphs"])
    body += _e2e_body(res)
    if res.get("overhead_us"):
        body.append(Table(("call", "us"), list(res["overhead_us"].items()), title="host cost per call (us, GPU idle)"))
    return body
