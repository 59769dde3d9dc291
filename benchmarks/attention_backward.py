"""Attention backward: TFLOP/s of rtckern.ops.attention_backward against torch SDPA's flash and cuDNN backward.

    python -m benchmarks attention_backward [--deterministic] [--impls simt] [--quick]

Points: bf16, head dim 64 (32 heads) and 128 (16 heads), seqlen 1k / 4k / 16k at 16k tokens per batch, causal and
not. Only the backward is timed: rtckern's op from a saved (o, lse); SDPA's through autograd.grad of an output
computed once under the backend (sdpa_kernel), retaining the graph. CUDA events, median of --reps back-to-back calls
after a warm-up. TFLOP/s = 2.5 x the forward's 4 * batch * heads * seqlen^2 * head_dim, halved for causal.
The runner writes attention_backward_<gpu>.json and .md (one current file set per GPU, overwritten by each run).
"""
from __future__ import annotations

from benchmarks.attention import time_ms

QUICK = "head dim 128 only, 1k and 16k, 5 reps"


def bench_points():
    pts = []
    for hd, heads in ((64, 32), (128, 16)):
        for sl in (1024, 4096, 16384):
            for causal in (False, True):
                pts.append(dict(hd=hd, heads=heads, seqlen=sl, batch=16384 // sl, causal=causal))
    return pts


def tflops(p, ms):
    f = 4.0 * p["batch"] * p["heads"] * p["seqlen"] ** 2 * p["hd"]
    if p["causal"]:
        f /= 2
    return 2.5 * f / (ms * 1e-3) / 1e12


def rtckern_runner(q, k, v, g, causal, deterministic=False):
    from rtckern import ops

    o, lse = ops.attention(q, k, v, causal=causal, return_lse=True)

    def fn():
        return ops.attention_backward(g, q, k, v, o, lse, causal=causal, deterministic=deterministic)
    return fn


def forced(impl: str):
    """The settings that force an rtckern candidate (entered once around its whole timing: the memoized plans
    belong to one settings object)."""
    import contextlib

    from rtckern import config

    if not impl:
        return contextlib.nullcontext()
    return config.override(force_impl={"attention_backward": f"attention_backward.{impl}"})


def sdpa_backward_runner(backend_name, q, k, v, g, causal):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v))
    with sdpa_kernel(getattr(SDPBackend, backend_name)):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    gt = g.transpose(1, 2)

    def fn():
        return torch.autograd.grad(out, (qt, kt, vt), gt, retain_graph=True)
    return fn


def add_args(ap) -> None:
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--deterministic", action="store_true", help="also time rtckern's deterministic mode")
    ap.add_argument("--impls", default="", help="extra forced rtckern candidates to time, comma list (e.g. simt)")


def run(args):
    import torch

    from benchmarks.runner import Result, Table

    points = bench_points()
    reps = args.reps
    if args.quick:
        points = [p for p in points if p["hd"] == 128 and p["seqlen"] in (1024, 16384)]
        reps = 5
    rows = []
    for p in points:
        gen = torch.Generator(device="cuda").manual_seed(1)
        shp = (p["batch"], p["seqlen"], p["heads"], p["hd"])
        q, k, v, g = (torch.randn(shp, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        runners = {"rtckern": ("", lambda: rtckern_runner(q, k, v, g, p["causal"]))}
        if args.deterministic:
            runners["rtckern_det"] = ("", lambda: rtckern_runner(q, k, v, g, p["causal"], deterministic=True))
        for impl in filter(None, args.impls.split(",")):
            runners[f"rtckern_{impl}"] = (impl, lambda: rtckern_runner(q, k, v, g, p["causal"]))
        runners["sdpa_flash"] = ("", lambda: sdpa_backward_runner("FLASH_ATTENTION", q, k, v, g, p["causal"]))
        runners["sdpa_cudnn"] = ("", lambda: sdpa_backward_runner("CUDNN_ATTENTION", q, k, v, g, p["causal"]))
        ms = {}
        for name, (impl, make) in runners.items():
            try:
                with forced(impl):
                    ms[name] = time_ms(make(), reps=reps)
            except Exception as e:  # report and go on: one backend missing must not lose the others
                print(f"{name} failed at {p}: {type(e).__name__}: {e}", flush=True)
            torch.cuda.empty_cache()
        row = dict(p, ms={n: m[0] for n, m in ms.items()}, spread={n: [m[1], m[2]] for n, m in ms.items()},
                   tflops={n: tflops(p, m[0]) for n, m in ms.items()})
        rows.append(row)
        line = " ".join(f"{n}={t:.0f}" for n, t in sorted(row["tflops"].items(), key=lambda kv: -kv[1]))
        print(f"hd{p['hd']} s{p['seqlen']} b{p['batch']} causal={int(p['causal'])}: {line}", flush=True)
    names = sorted({k for r in rows for k in r["tflops"]})

    def ratio(t, other):
        return f"{t['rtckern'] / t[other]:.2f}x" if "rtckern" in t and other in t else None
    table = Table(["hd", "heads", "seqlen", "batch", "causal", *names, "rtckern / flash", "rtckern / cudnn"],
                  [[r["hd"], r["heads"], r["seqlen"], r["batch"], int(r["causal"]),
                    *[f"{r['tflops'][n]:.0f}" if n in r["tflops"] else None for n in names],
                    ratio(r["tflops"], "sdpa_flash"), ratio(r["tflops"], "sdpa_cudnn")] for r in rows])
    note = ("bf16, 16k tokens per batch; TFLOP/s = 2.5 x forward FLOPs (halved for causal); median of CUDA-event "
            f"timings over {reps} back-to-back calls.")
    return Result("Attention backward: TFLOP/s against SDPA's flash and cuDNN backward", rows=rows,
                  body=[note, table])
