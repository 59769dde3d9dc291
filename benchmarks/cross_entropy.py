"""Cross-entropy (a language model's loss): rtckern.ops.cross_entropy / cross_entropy_backward against torch's
F.cross_entropy on fp32-upcast logits (what transformers' causal LM loss runs), eager and under torch.compile.

    python -m benchmarks cross_entropy [--quick] [--no-compile]

Per shape (tokens x vocabulary, bf16 logits, int64 labels with every tenth ignored), after a check of both directions
against a float64 reference: GPU time from CUDA-graph replays of 20 back-to-back calls, as GB/s (forward: the logits
read; backward: the logits read and their gradient written) and as a fraction of this GPU's copy bandwidth. Forward +
backward as a training step runs them: torch.autograd.grad of the mean loss through rtckern.torch.cross_entropy,
through F.cross_entropy(logits.float(), labels) and through the same under torch.compile, each captured in a CUDA
graph; and the memory each needs beyond its inputs (peak allocated during one eager forward + backward).
"""
from __future__ import annotations

from benchmarks._one_pass import add_rates, fmt, host_table, host_us, measure_shapes, plot
from benchmarks.runner import Result, Table

SHAPES = (  # label, tokens, vocabulary
    ("Llama 4L training step (issue 22)", 4096, 32000),
    ("Llama-3 8k tokens", 8192, 128256),
    ("Qwen2.5 4k tokens", 4096, 151936),
    ("Gemma 3 4k tokens", 4096, 262144),
    ("64 rows, 128k vocabulary", 64, 128256),
)
QUICK = "the first two shapes"
IGNORE = -100


def add_args(ap) -> None:
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")


def formula(logits, labels):
    import torch

    return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=IGNORE)


def _check(x, labels) -> dict:
    """Relative errors of each direction against float64 (per-row losses, the gradient of the mean); the eager
    formula's."""
    import torch

    from rtckern.ops import cross_entropy, cross_entropy_backward

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))

    x64 = x.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(x64, labels, ignore_index=IGNORE, reduction="none")
    count = int((labels != IGNORE).sum())
    (g64,) = torch.autograd.grad(ref.sum() / count, x64)
    loss, lse = cross_entropy(x, labels, IGNORE)
    dloss = torch.full_like(loss, 1.0 / count)
    got = cross_entropy_backward(dloss, x, labels, lse, IGNORE)
    xt = x.detach().requires_grad_()
    (gt,) = torch.autograd.grad(formula(xt, labels), xt)
    out = {"fwd_rel_l2": rel(loss, ref.detach()), "bwd_rel_l2": rel(got, g64), "torch_bwd_rel_l2": rel(gt, g64)}
    out["ok"] = out["fwd_rel_l2"] < 1e-5 and out["bwd_rel_l2"] < 8e-3  # fp32 loss; one bf16 rounding per gradient
    return out


def _extra_mb(fn) -> float:
    """MB allocated at the peak of one eager call beyond what was allocated before it."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return (peak - before) / 2**20


def bench_shape(label, tokens, n, gen, copy_gbs: float, compiled) -> dict:
    import torch

    import rtckern.torch as rt
    from benchmarks.gemm import graph_us
    from rtckern.ops import cross_entropy, cross_entropy_backward

    x = torch.randn(tokens, n, device="cuda", generator=gen).mul_(2).bfloat16()
    labels = torch.randint(0, n, (tokens,), device="cuda", generator=gen)
    labels[::10] = IGNORE
    r = {"shape": label, "tokens": tokens, "n": n, **_check(x, labels)}
    logits_bytes = tokens * n * 2
    loss, lse = cross_entropy(x, labels, IGNORE)
    dloss = torch.full_like(loss, 1.0 / tokens)
    r["fwd_us"] = graph_us(lambda: cross_entropy(x, labels, IGNORE))
    r["bwd_us"] = graph_us(lambda: cross_entropy_backward(dloss, x, labels, lse, IGNORE))
    r["torch_fwd_us"] = graph_us(lambda: formula(x, labels))
    xr = x.detach().requires_grad_()

    def through(fn):
        return lambda: torch.autograd.grad(fn(xr, labels), (xr,))
    r["autograd_fwd_bwd_us"] = graph_us(through(lambda a, b: rt.cross_entropy(a, b, IGNORE)))
    r["torch_fwd_bwd_us"] = graph_us(through(formula))
    r["extra_mb"] = _extra_mb(through(lambda a, b: rt.cross_entropy(a, b, IGNORE)))
    r["torch_extra_mb"] = _extra_mb(through(formula))
    if compiled is not None:
        r["compiled_fwd_us"] = graph_us(lambda: compiled(x, labels))
        r["compiled_fwd_bwd_us"] = graph_us(through(compiled))
        r["compiled_extra_mb"] = _extra_mb(through(compiled))
    return add_rates(r, logits_bytes, 2 * logits_bytes, copy_gbs)  # logits in; logits in, gradient out


def host_cost(gen) -> dict:
    """us per eager call (host time to submit) at a tiny shape, rtckern.torch.cross_entropy against the formula,
    forward and forward + backward through autograd; alternating rounds."""
    import torch

    import rtckern.torch as rt

    x = torch.randn(4, 32000, device="cuda", generator=gen).bfloat16()
    labels = torch.randint(0, 32000, (4,), device="cuda", generator=gen)
    xr = x.detach().requires_grad_()
    calls = {"fwd rtckern": lambda: rt.cross_entropy(x, labels), "fwd torch": lambda: formula(x, labels),
             "fwd+bwd rtckern": lambda: torch.autograd.grad(rt.cross_entropy(xr, labels), (xr,)),
             "fwd+bwd torch": lambda: torch.autograd.grad(formula(xr, labels), (xr,))}
    return host_us(calls)


def run(args) -> Result:
    return result(*measure_shapes(args, SHAPES, formula, bench_shape, host_cost, 7,
                                   lambda r: f"; extra MB {r['extra_mb']:.0f} vs {r['torch_extra_mb']:.0f}"))


def result(rows: list[dict], data: dict) -> Result:
    table = Table(("shape", "tokens x vocab", "fwd us", "fwd / copy", "bwd us", "bwd / copy", "fwd+bwd us",
                   "torch fwd us", "torch fwd+bwd us", "compiled fwd+bwd us", "fwd+bwd vs torch",
                   "fwd+bwd vs compiled", "extra MB: rtckern / torch / compiled", "rel err fwd / bwd",
                   "torch rel err bwd"),
                  [(r["shape"], f"{r['tokens']} x {r['n']}", fmt(r["fwd_us"]), fmt(r["fwd_of_copy"], "{:.2f}"),
                    fmt(r["bwd_us"]), fmt(r["bwd_of_copy"], "{:.2f}"), fmt(r["autograd_fwd_bwd_us"]),
                    fmt(r["torch_fwd_us"]), fmt(r["torch_fwd_bwd_us"]), fmt(r.get("compiled_fwd_bwd_us")),
                    fmt(r["speedup_fwd_bwd_vs_torch"], "{:.2f}x"), fmt(r.get("speedup_fwd_bwd_vs_compiled"), "{:.2f}x"),
                    f"{r['extra_mb']:.0f} / {r['torch_extra_mb']:.0f} / {fmt(r.get('compiled_extra_mb'), '{:.0f}')}",
                    f"{r['fwd_rel_l2']:.1e} / {r['bwd_rel_l2']:.1e}", f"{r['torch_bwd_rel_l2']:.1e}") for r in rows])
    hosts = host_table(data["host_us"], "(4, 32000) logits")
    body = [f"bf16 logits of shape tokens x vocabulary, int64 labels (every tenth -100, ignored). Copy bandwidth of "
            f"this GPU in this run: {data['copy_gbs']:.0f} GB/s. Every time: CUDA-graph replays of 20 back-to-back "
            "calls (GPU time). fwd / bwd: rtckern.ops.cross_entropy and cross_entropy_backward (per-row losses); "
            "fwd+bwd: torch.autograd.grad of the mean loss through rtckern.torch.cross_entropy, through "
            "F.cross_entropy(logits.float(), labels) (torch; what transformers' causal LM loss runs), and through the "
            "same under torch.compile (Inductor); 'vs' = their time / rtckern's. Extra MB: the peak allocated during "
            "one eager forward + backward beyond the inputs. Errors: relative L2 against float64 (per-row losses; "
            "the gradient of the mean).", table, hosts]
    return Result("Cross-entropy (rtckern.ops.cross_entropy) against torch's F.cross_entropy on fp32 logits",
                  rows=rows, body=body, data=data, rc=0 if all(r["ok"] for r in rows) else 1,
                  plot=lambda plt, meta: plot(plt, rows, meta, "cross_entropy", "F.cross_entropy(logits.float())",
                                              "Cross-entropy"))


def render(payload: dict) -> Result:
    from benchmarks.runner import stored_data

    return result(payload["rows"], stored_data(payload))
