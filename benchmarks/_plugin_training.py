"""Training steps for benchmarks/plugin.py: issue 22's end-to-end point (patch variants against the unpatched model,
three runs) and a packed (varlen) batch against the same sequences padded.

A `Batch` is what one training step feeds a model: the model's keyword arguments, which flattened (batch * seqlen)
positions hold real tokens, which of them predict a next token and that token. The loss is the model's own
(model(..., labels=...).loss, transformers' causal LM loss, as a trainer runs it): the mean cross entropy over those
predictions, so a packed batch and its padded twin have the same loss up to rounding, and their real-token
logits line up row for row (sequence by sequence, in order).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import statistics
from typing import Any, Callable, Optional

# Issue 22's point: with plugin.LLAMA (4 layers, hidden 2048, 16 heads, 4 kv heads, head dim 128), 2 x 2048 tokens.
TRAIN = dict(batch=2, seq=2048)
# patch() keywords of each variant; "none" is an unpatched copy timed the same way (an A/A control: its "speedup"
# is the noise of the measurement).
_ONLY = dict(norms=False, attention=False, rope=False, mlp=False, loss=False)
VARIANTS: dict[str, dict] = {"none": None, "attention": {**_ONLY, "attention": True}, "norms": {**_ONLY, "norms": True},
                             "rope": {**_ONLY, "rope": True}, "mlp": {**_ONLY, "mlp": True},
                             "loss": {**_ONLY, "loss": True}, "full": {}}
# The packed batch: sequences of random lengths (uniform in LENGTHS) summing to PACKED_TOKENS.
PACKED_TOKENS = 4096
LENGTHS = (256, 1792)
LOSS_RTOL = 1e-2  # packed vs padded loss: bf16's epsilon (2^-7 = 7.8e-3), rounded up


@dataclasses.dataclass
class Batch:
    kwargs: dict  # model(**kwargs)
    pred: Any  # flattened positions whose logits predict a next token (int64)
    targets: Any  # that token, for each
    real: Optional[Any] = None  # flattened positions of real tokens (None: all); their logits are compared
    tokens: int = 0  # real tokens

    @functools.cached_property
    def labels(self):
        """transformers' labels for the model's loss: each predicted token at the position after its predictor (the
        loss shifts them back), -100 elsewhere (padding, the first token of each sequence)."""
        import torch

        shape = self.kwargs["input_ids"].shape
        labels = torch.full((shape.numel(),), -100, dtype=torch.int64, device=self.targets.device)
        labels[self.pred + 1] = self.targets
        return labels.view(shape)


def build_llama(device: str = "cuda", dtype=None, attn: str = "sdpa", seed: int = 0, **overrides):
    """A randomly initialised LlamaForCausalLM (plugin.LLAMA with overrides), initialised on `device` (fast on a GPU),
    then cast to `dtype` (bf16 by default)."""
    import torch
    import transformers

    from benchmarks.plugin import LLAMA

    cfg = transformers.LlamaConfig(**{**LLAMA, **overrides})
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=attn)
    return model.to(device, dtype or torch.bfloat16)


def dense_batch(ids) -> Batch:
    """(batch, seq) token ids, no padding: every position but the last of a row predicts the next token."""
    import torch

    b, s = ids.shape
    pos = torch.arange(b * s, device=ids.device).view(b, s)[:, :-1].reshape(-1)
    return Batch(dict(input_ids=ids, use_cache=False), pos, ids.reshape(-1)[pos + 1], None, b * s)


def packed_lengths(total: int = PACKED_TOKENS, lo: int = LENGTHS[0], hi: int = LENGTHS[1], seed: int = 0) -> list[int]:
    """Lengths drawn uniformly in [lo, hi] summing to `total` (the last one takes what is left, also in [lo, hi])."""
    import numpy as np

    if not lo <= hi or total < lo:
        raise ValueError(f"no lengths in [{lo}, {hi}] sum to {total}")
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    left = total
    while not lo <= left <= hi:
        lengths.append(int(rng.integers(lo, min(hi, left - lo) + 1)))
        left -= lengths[-1]
    return lengths + [left]


def packed_and_padded(lengths: list[int], vocab: int, device: str = "cuda", seed: int = 0) -> dict[str, Batch]:
    """The same sequences as a packed batch (batch 1, position_ids restarting per sequence, no attention mask: what
    transformers' DataCollatorWithFlattening gives) and padded to the longest (right padding, a 2D attention mask)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]
    total, longest = sum(lengths), max(lengths)
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    packed_ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ends = set((starts + torch.tensor(lengths) - 1).tolist())
    pred_packed = torch.tensor([p for p in range(total) if p not in ends])
    padded_ids = torch.zeros(len(lengths), longest, dtype=torch.long)
    mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        padded_ids[i, :len(s)] = s
        mask[i, :len(s)] = 1
    real = mask.reshape(-1).nonzero().squeeze(1)
    pred_padded = torch.cat([i * longest + torch.arange(n - 1) for i, n in enumerate(lengths)])
    dev = lambda t: t.to(device)  # noqa: E731
    packed = Batch(dict(input_ids=dev(packed_ids), position_ids=dev(positions), use_cache=False), dev(pred_packed),
                   dev(packed_ids.reshape(-1)[pred_packed + 1]), None, total)
    padded = Batch(dict(input_ids=dev(padded_ids), attention_mask=dev(mask), use_cache=False), dev(pred_padded),
                   dev(padded_ids.reshape(-1)[pred_padded + 1]), dev(real), total)
    return {"packed": packed, "padded": padded}


def forward_loss(model, batch: Batch):
    """(logits, loss) of one forward: logits (batch, seq, vocab), loss the model's (the mean cross entropy over
    batch.pred's predictions)."""
    out = model(**batch.kwargs, labels=batch.labels)
    return out.logits, out.loss


def train_step(model, batch: Batch) -> None:
    model.zero_grad(set_to_none=True)
    forward_loss(model, batch)[1].backward()


def outputs(model, batch: Batch, names) -> tuple[Any, float, dict]:
    """The real-token logits (detached), the loss and the gradients of `names` after one forward + backward."""
    model.zero_grad(set_to_none=True)
    logits, loss = forward_loss(model, batch)
    loss.backward()
    flat = logits.detach().flatten(0, 1)
    real = flat if batch.real is None else flat.index_select(0, batch.real)
    p = dict(model.named_parameters())
    grads = {k: p[k].grad.detach().clone() for k in names}
    model.zero_grad(set_to_none=True)
    return real, loss.item(), grads


def compare(ref32: tuple, base: tuple, others: dict[str, tuple]) -> dict[str, dict]:
    """plugin.accuracy's record for each of `others` (outputs() triples), against the fp32 reference and the
    unpatched bf16 model (`base`), with the losses."""
    from benchmarks.plugin import rel_err

    (l32, loss32, g32), (lb, lossb, gb) = ref32, base
    out = {}
    for name, (lo, losso, go) in others.items():
        out[name] = {"logits_err_torch_bf16": rel_err(lb, l32), "logits_err_rtckern_bf16": rel_err(lo, l32),
                     "logits_err_rtckern_vs_torch": rel_err(lo, lb),
                     "loss": {"fp32": loss32, "torch_bf16": lossb, "rtckern_bf16": losso},
                     "grad_err": {k: {"torch_bf16": rel_err(gb[k], g32[k]), "rtckern_bf16": rel_err(go[k], g32[k])}
                                  for k in g32}}
    return out


def make_variants(ref, variants=VARIANTS) -> tuple[dict, dict]:
    """Deep copies of `ref`, each patched as its VARIANTS entry says; and what each patch() replaced."""
    import rtckern.torch as rt

    models, info = {}, {}
    for name, kw in variants.items():
        m = copy.deepcopy(ref)
        if kw is None:
            info[name] = {"norms_replaced": 0, "attention": m.config._attn_implementation, "rope_modules": 0,
                          "mlp_modules": 0, "loss": False}
        else:
            report = rt.patch(m, **kw)
            info[name] = {"patch": kw, "norms_replaced": len(report.replaced), "rope_modules": len(report.rope),
                          "mlp_modules": len(report.mlp), "loss": report.loss,
                          "attention": m.config._attn_implementation}
        models[name] = m
    return models, info


def strict_probe(fn: Callable[[], Any]) -> str:
    """'rtckern' when fn() runs every patched op on rtckern's kernels (under RTCKERN_STRICT=1 a torch fallback
    raises), else what fell back and why (the error, on one line)."""
    from rtckern import config

    try:
        with config.override(strict=True):
            fn()
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return f"falls back: {type(e).__name__}: {' '.join(str(e).split())}"[:500]
    return "rtckern"


def served(model, batch: Batch) -> str:
    """strict_probe of one forward of `batch` (no grad)."""
    import torch

    def forward():
        with torch.no_grad():
            model(**batch.kwargs)
    return strict_probe(forward)


def _timed_reps(fns: dict[str, Callable[[], None]], reps: int, warmup: int) -> dict[str, list[float]]:
    """Each function timed `reps` times (CUDA events), round robin: drift hits all alike."""
    from benchmarks.plugin import _timed

    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            times[k].append(_timed(fn))
    return times


def gpu_ms_per_step(step: Callable[[], None], steps: int = 3) -> float:
    """ms of GPU work per call of `step` (kernels, copies and memsets summed from torch.profiler's device records over
    `steps` calls): against the wall step time it tells how much of a step the GPU idles, waiting for the host."""
    import torch

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    return total_us / steps / 1e3


def variant_runs(ref, models: dict, batch: Batch, runs: int = 3, reps: int = 20, warmup: int = 3) -> dict:
    """Each variant's training step timed against the unpatched model's, the two alternating, `runs` times over
    (run by run, every variant in turn: a slow stretch of the GPU lands in one run of each, not in one variant);
    on a GPU, then each variant's GPU time per step (gpu_ms_per_step) against the unpatched model's."""
    import torch

    out: dict = {name: {"runs": []} for name in models}
    for _ in range(runs):
        for name, m in models.items():
            t = _timed_reps({"torch": lambda: train_step(ref, batch), "patched": lambda: train_step(m, batch)},
                            reps, warmup)
            torch_ms, patched_ms = statistics.median(t["torch"]), statistics.median(t["patched"])
            out[name]["runs"].append({"torch_ms": torch_ms, "patched_ms": patched_ms, "speedup": torch_ms / patched_ms,
                                      "torch_spread": [min(t["torch"]), max(t["torch"])],
                                      "patched_spread": [min(t["patched"]), max(t["patched"])]})
    for rec in out.values():
        rec["speedups"] = [r["speedup"] for r in rec["runs"]]
        rec["median_speedup"] = statistics.median(rec["speedups"])
    if torch.cuda.is_available():  # what the GPU itself spends per step: the step time is partly host time
        torch_gpu = gpu_ms_per_step(lambda: train_step(ref, batch))
        for name, m in models.items():
            patched_gpu = gpu_ms_per_step(lambda: train_step(m, batch))
            out[name]["gpu_ms"] = {"torch": torch_gpu, "patched": patched_gpu, "speedup": torch_gpu / patched_gpu}
    ref.zero_grad(set_to_none=True)
    for m in models.values():
        m.zero_grad(set_to_none=True)
    return out


def run_training_point(runs: int = 3, reps: int = 20, device: str = "cuda", seed: int = 0, packed: bool = True,
                       packed_reps: int = 20, batch: int = TRAIN["batch"], seq: int = TRAIN["seq"],
                       packed_tokens: int = PACKED_TOKENS, lengths: tuple[int, int] = LENGTHS, **overrides) -> dict:
    """Issue 22's training step (TRAIN with plugin.LLAMA; other sizes for the --cpu mode): accuracy of each patch
    variant, then `runs` timed runs; with packed=True, the packed-vs-padded comparison on the same models
    (run_packed)."""
    import torch

    from benchmarks.plugin import LLAMA, grad_params, within_tolerance

    ref = build_llama(device, seed=seed, **overrides)
    cfg = ref.config
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(device)
    dense = dense_batch(ids)
    models, info = make_variants(ref)
    names = grad_params(cfg.num_hidden_layers)
    ref32 = copy.deepcopy(ref).float()  # the same bf16-valued weights: errors below are arithmetic only
    o32, obase = outputs(ref32, dense, names), outputs(ref, dense, names)
    acc = compare(o32, obase, {name: outputs(m, dense, names) for name, m in models.items() if name != "none"})
    del o32, obase
    result: dict = {"config": {**LLAMA, **overrides, "batch": batch, "seq": seq, "dtype": "bf16"}, "variants": info,
                    "served": {name: served(m, dense) for name, m in models.items() if name != "none"},
                    "accuracy": acc, "accuracy_failures": {k: within_tolerance(a) for k, a in acc.items()}}
    if packed:
        result["packed"] = run_packed(ref32, ref, models["full"], reps=packed_reps, device=device, seed=seed,
                                      tokens=packed_tokens, lengths=lengths)
    del ref32
    if device == "cuda":
        torch.cuda.empty_cache()
    if runs > 0:
        result["speed"] = variant_runs(ref, models, dense, runs=runs, reps=reps)
    return result


PACKED_CONFIGS = (("sdpa padded", "ref", "padded"), ("sdpa packed", "ref", "packed"),
                  ("rtckern padded", "rt", "padded"), ("rtckern packed", "rt", "packed"))


def packed_failures(acc: dict) -> list[str]:
    """Packed loss == padded loss (rtckern) within LOSS_RTOL; rtckern's logits and gradients (padded and packed)
    within 2x the unpatched padded model's own bf16 error (+1e-3), as plugin.within_tolerance."""
    loss, bad = acc["loss"], []
    if not abs(loss["rtckern packed"] - loss["rtckern padded"]) <= LOSS_RTOL * abs(loss["rtckern padded"]):
        bad.append(f"loss: rtckern packed {loss['rtckern packed']:.5f} vs padded {loss['rtckern padded']:.5f}")
    base = "sdpa padded"
    for name in ("rtckern padded", "rtckern packed", "sdpa packed"):
        if not acc["logits_err"][name] <= 2 * acc["logits_err"][base] + 1e-3:
            bad.append(f"logits {name}: {acc['logits_err'][name]:.3e} vs {base} {acc['logits_err'][base]:.3e}")
        for k, e in acc["grad_err"].items():
            if not e[name] <= 2 * e[base] + 1e-3:
                bad.append(f"grad {k} {name}: {e[name]:.3e} vs {base} {e[base]:.3e}")
    return bad


def run_packed(ref32, ref, rt_model, reps: int = 20, warmup: int = 3, device: str = "cuda", seed: int = 0,
               tokens: int = PACKED_TOKENS, lengths: tuple[int, int] = LENGTHS) -> dict:
    """`tokens` tokens in sequences of random lengths (uniform in `lengths`), packed and padded, through the unpatched
    model (sdpa) and the patched one (attn_implementation="rtckern": varlen for both): accuracy against the fp32
    model on the padded batch, then forward + backward time, the four alternating."""
    from benchmarks.plugin import grad_params

    lengths = packed_lengths(tokens, *lengths, seed=seed)
    batches = packed_and_padded(lengths, ref.config.vocab_size, device, seed)
    models = {"ref": ref, "rt": rt_model}
    names = grad_params(ref.config.num_hidden_layers)
    l32, loss32, g32 = outputs(ref32, batches["padded"], names)
    acc: dict = {"loss": {"fp32 padded": loss32}, "logits_err": {}, "grad_err": {k: {} for k in names}}
    for name, m, b in PACKED_CONFIGS:
        lo, loss, go = outputs(models[m], batches[b], names)
        acc["loss"][name] = loss
        acc["logits_err"][name] = _rel(lo, l32)
        for k in names:
            acc["grad_err"][k][name] = _rel(go[k], g32[k])
        del lo, go
    del l32, g32
    fns = {name: (lambda m=models[m], b=batches[b]: train_step(m, b)) for name, m, b in PACKED_CONFIGS}
    times = _timed_reps(fns, reps, warmup)
    for m in models.values():
        m.zero_grad(set_to_none=True)
    ms = {k: statistics.median(v) for k, v in times.items()}
    padded = batches["padded"].kwargs["input_ids"].shape
    return {"lengths": lengths, "tokens": sum(lengths), "padded_shape": list(padded),
            "padding_fraction": 1 - sum(lengths) / (padded[0] * padded[1]),
            "served": {"rtckern padded": served(rt_model, batches["padded"]),
                       "rtckern packed": served(rt_model, batches["packed"])},
            "fwd_bwd_ms": ms, "spread_ms": {k: [min(v), max(v)] for k, v in times.items()},
            "tokens_per_s": {k: sum(lengths) / (v * 1e-3) for k, v in ms.items()},
            "speedup": {"rtckern packed vs rtckern padded": ms["rtckern padded"] / ms["rtckern packed"],
                        "rtckern packed vs sdpa padded": ms["sdpa padded"] / ms["rtckern packed"],
                        "rtckern packed vs sdpa packed": ms["sdpa packed"] / ms["rtckern packed"],
                        "rtckern padded vs sdpa padded": ms["sdpa padded"] / ms["rtckern padded"]},
            "accuracy": acc, "accuracy_failures": packed_failures(acc)}


def _rel(x, ref) -> float:
    from benchmarks.plugin import rel_err

    return rel_err(x, ref)
