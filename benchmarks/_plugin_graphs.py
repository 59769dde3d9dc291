"""Decode steps on a static KV cache, eager and captured in a CUDA graph, for benchmarks/plugin.py.

Batch 1, greedy: a step is `model(token, past_key_values=StaticCache)` and writes its argmax back into the token
buffer, so the step has fixed shapes and addresses and replays as one torch.cuda.CUDAGraph (StaticCache keeps its
position in a device tensor that the step advances in place). Each rep resets the cache, prefills the prompt
(eagerly, untimed), then times `steps` steps: eager calls, or replays of the graph captured after a warm-up on a side
stream. Unpatched and patched models alternate rep by rep.

Accuracy: greedy decoding of a randomly initialised model diverges at the first near-tie of two logits, which bf16
rounding in either library decides, so whether two models' greedy tokens agree says little. With `reference` (the
unpatched model in fp32), every model also decodes teacher-forced: the prompt, then the first model's greedy inputs
step by step on its own StaticCache (every model sees the same tokens), and each step's logits are compared with the
fp32 model's (top-1 agreement, relative L2 error): the decode path's accuracy, torch's and rtckern's alike.

A capture that fails (a host sync or an allocation outside torch's allocator inside a captured op, a first call
during capture) is reported as `graph_error` for that model and its eager numbers still stand. Which attention ran
is probed separately (`served`): the steps pass no 2D mask, so the "rtckern" mask builder hands the static cache's
lengths over instead of sdpa's 4D mask and each step's attention runs rtckern.ops.attention_with_kvcache on the cache
in place (rtckern/plugins/_torch_hf_kvcache.py), eager and captured alike.
"""
from __future__ import annotations

import inspect
import statistics
import time
from typing import Optional

WARMUP_STEPS = 3


def _cache_kw(model) -> str:
    """The KV cache's keyword: `cache` in newer transformers, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class StaticDecoder:
    """One model's decode loop on its own StaticCache, eager or replayed from a captured graph."""

    def __init__(self, model, prompt_ids, steps: int, device: str = "cuda"):
        import torch
        import transformers

        self.model, self.ids, self.steps, self.device = model, prompt_ids, steps, device
        length = prompt_ids.shape[1] + steps + WARMUP_STEPS + 1
        self.cache = transformers.StaticCache(config=model.config, max_cache_len=length)
        self.kw = _cache_kw(model)
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.graph = None
        self.graph_error: Optional[str] = None

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def prefill(self) -> None:
        import torch

        with torch.no_grad():
            self.cache.reset()
            out = self.model(self.ids, use_cache=True, **{self.kw: self.cache})
            self.tok.copy_(out.logits[:, -1:].argmax(-1))

    def step(self) -> None:
        import torch

        with torch.no_grad():
            out = self.model(self.tok, use_cache=True, **{self.kw: self.cache})
            self.tok.copy_(out.logits[:, -1:].argmax(-1))

    def capture(self) -> bool:
        """Warm up on a side stream, then capture one step; False (and graph_error says why) if that fails."""
        import torch

        try:
            self.prefill()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    self.step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.step()
            self.sync()
            self.graph = graph
        except Exception as e:  # noqa: BLE001 - reported in the result, the suite goes on
            self.graph_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
            try:
                self.sync()
            except Exception as e2:  # noqa: BLE001
                self.graph_error += f" (then synchronize: {type(e2).__name__}: {e2})"[:400]
        return self.graph is not None

    def _run(self, graphed: bool) -> None:
        for _ in range(self.steps):
            if graphed:
                self.graph.replay()
            else:
                self.step()

    def time_ms(self, graphed: bool) -> float:
        """ms per token over `steps` steps after a fresh prefill."""
        self.prefill()
        self.sync()
        t0 = time.perf_counter()
        self._run(graphed)
        self.sync()
        return (time.perf_counter() - t0) / self.steps * 1e3

    def tokens(self, graphed: bool) -> list[int]:
        """The greedy tokens of `steps` steps after a fresh prefill (untimed: reads each one back)."""
        self.prefill()
        got = []
        for _ in range(self.steps):
            if graphed:
                self.graph.replay()
            else:
                self.step()
            got.append(int(self.tok.item()))
        return got

    def first_input(self) -> int:
        """The token the prefill's greedy argmax feeds the first step."""
        self.prefill()
        return int(self.tok.item())

    def forced_logits(self, inputs: list[int]):
        """fp32 logits of a step on each of `inputs` in turn after a fresh prefill (teacher forcing; the first input is
        the prefill's argmax), shape (len(inputs), vocab)."""
        import torch

        rows = []
        with torch.no_grad():
            self.cache.reset()
            self.model(self.ids, use_cache=True, **{self.kw: self.cache})
            for t in inputs:
                self.tok.fill_(t)
                out = self.model(self.tok, use_cache=True, **{self.kw: self.cache})
                rows.append(out.logits[0, -1].float())
        return torch.stack(rows)

    def served(self) -> str:
        """strict_probe of the prefill, then of one decode step ("prefill: ...; step: ..."). Run before the timed
        reps (a step that failed leaves the cache half-updated; every rep starts with a reset)."""
        from benchmarks._plugin_training import strict_probe

        prefill = strict_probe(self.prefill)
        step = strict_probe(self.step) if prefill == "rtckern" else "not run"
        return f"prefill: {prefill}; step: {step}"


def forced_accuracy(got, want) -> dict:
    """Per-step agreement of logits `got` with the fp32 model's `want` (steps x vocab): top-1 matches, and the
    median and largest relative L2 error over the steps."""
    import torch

    err = torch.linalg.vector_norm(got - want, dim=-1) / torch.linalg.vector_norm(want, dim=-1).clamp_min(1e-30)
    return {"steps": int(got.shape[0]), "top1": int((got.argmax(-1) == want.argmax(-1)).sum()),
            "err_median": float(err.median()), "err_max": float(err.max())}


def _patched(model) -> bool:
    import rtckern.torch as rt

    return model.config._attn_implementation == "rtckern" or any(
        isinstance(m, (rt.RMSNorm, rt.LayerNorm)) for m in model.modules())


def static_decode(models: dict, prompt: int = 128, steps: int = 64, reps: int = 7, device: str = "cuda",
                  graphs: Optional[bool] = None, seed: int = 0, reference=None) -> dict:
    """ms per token, eager and graphed, for each of `models` (name -> model, eval mode, on `device`); the models
    alternate rep by rep. graphs: capture CUDA graphs (default: on CUDA). reference: the unpatched model in fp32, for
    the teacher-forced accuracy of each model's decode steps (`forced`)."""
    import torch

    graphs = device == "cuda" if graphs is None else graphs
    first = next(iter(models.values()))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, first.config.vocab_size, (1, prompt), generator=gen).to(device)
    decoders = {name: StaticDecoder(m, ids, steps, device) for name, m in models.items()}
    out: dict = {"config": {"batch": 1, "prompt": prompt, "steps": steps, "reps": reps,
                            "cache": "StaticCache", "max_cache_len": prompt + steps + WARMUP_STEPS + 1}, "models": {}}
    for name, d in decoders.items():
        rec = out["models"][name] = {"served": d.served() if _patched(d.model) else "torch (unpatched)"}
        d.time_ms(False)  # warm-up (first calls compile or load kernels)
        rec["eager_tokens"] = d.tokens(False)
        if graphs and d.capture():
            rec["graph_tokens"] = d.tokens(True)
            rec["graph_matches_eager"] = rec["graph_tokens"] == rec["eager_tokens"]
        rec["graph_error"] = d.graph_error if graphs else "not captured (no CUDA)"
    times: dict = {(n, g): [] for n in decoders for g in (False, True)}
    for _ in range(reps):
        for name, d in decoders.items():
            times[(name, False)].append(d.time_ms(False))
            if d.graph is not None:
                times[(name, True)].append(d.time_ms(True))
    names = list(decoders)
    first_tokens = out["models"][names[0]]["eager_tokens"]
    if reference is not None:
        inputs = [decoders[names[0]].first_input()] + first_tokens[:-1]
        want = StaticDecoder(reference, ids, steps, device).forced_logits(inputs)
        for name, d in decoders.items():
            out["models"][name]["forced"] = forced_accuracy(d.forced_logits(inputs), want)
    for name, d in decoders.items():
        rec = out["models"][name]
        same = sum(a == b for a, b in zip(rec["eager_tokens"], first_tokens))
        rec["eager_tokens_agree_with_first"] = f"{same}/{len(first_tokens)}"
        for graphed, key in ((False, "eager"), (True, "graph")):
            t = times[(name, graphed)]
            rec[f"{key}_ms"] = statistics.median(t) if t else None
            rec[f"{key}_spread"] = [min(t), max(t)] if t else None
        rec["graph_speedup_vs_eager"] = (rec["eager_ms"] / rec["graph_ms"]) if rec["graph_ms"] else None
        del rec["eager_tokens"]
        rec.pop("graph_tokens", None)
    if len(names) == 2:  # unpatched, patched
        a, b = (out["models"][n] for n in names)
        out["speedup"] = {"eager": a["eager_ms"] / b["eager_ms"],
                          "graph": (a["graph_ms"] / b["graph_ms"]) if a["graph_ms"] and b["graph_ms"] else None}
    return out
