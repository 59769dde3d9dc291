"""Attention backward: TFLOP/s of rtckern.ops.attention_backward against torch SDPA's flash and cuDNN backward.

    PYTHONPATH=. python3 benchmarks/attention_backward.py --out benchmarks/results [--deterministic] [--impls simt]

Points: bf16, head dim 64 (32 heads) and 128 (16 heads), seqlen 1k / 4k / 16k at 16k tokens per batch, causal and
not. Only the backward is timed: rtckern's op from a saved (o, lse); SDPA's through autograd.grad of an output
computed once under the backend (sdpa_kernel), retaining the graph. CUDA events, median of --reps back-to-back calls
after a warm-up. TFLOP/s = 2.5 x the forward's 4 * batch * heads * seqlen^2 * head_dim, halved for causal.
Writes attention_backward_<gpu>.json and .md under --out (one current file set per GPU, overwritten by each run).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.attention import environment, gpu_slug, time_ms  # noqa: E402


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


def markdown(result) -> str:
    env = result["env"]
    names = sorted({k for r in result["bench"] for k in r["tflops"]})
    lines = [f"# Attention backward, {env['gpu']}", "",
             f"torch {env['torch']}, CUDA {env['torch_cuda']}, cuDNN {env['cudnn']}, NVRTC {env.get('nvrtc')}, "
             f"{env['date']}. bf16, 16k tokens per batch; TFLOP/s = 2.5 x forward FLOPs (halved for causal); "
             "median of CUDA-event timings.", "",
             "| hd | heads | seqlen | batch | causal | " + " | ".join(names) + " | rtckern / flash | rtckern / cudnn |",
             "|" + "---|" * (7 + len(names))]
    for r in result["bench"]:
        t = r["tflops"]
        cells = [f"{t[n]:.0f}" if n in t else "-" for n in names]
        fl = f"{t['rtckern'] / t['sdpa_flash']:.2f}x" if "rtckern" in t and "sdpa_flash" in t else "-"
        cu = f"{t['rtckern'] / t['sdpa_cudnn']:.2f}x" if "rtckern" in t and "sdpa_cudnn" in t else "-"
        lines.append(f"| {r['hd']} | {r['heads']} | {r['seqlen']} | {r['batch']} | {int(r['causal'])} | "
                     + " | ".join(cells) + f" | {fl} | {cu} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--deterministic", action="store_true", help="also time rtckern's deterministic mode")
    ap.add_argument("--impls", default="", help="extra forced rtckern candidates to time, comma list (e.g. simt)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    import torch

    env = environment()
    print(json.dumps(env), flush=True)
    rows = []
    for p in bench_points():
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
                    ms[name] = time_ms(make(), reps=args.reps)
            except Exception as e:  # report and go on: one backend missing must not lose the others
                print(f"{name} failed at {p}: {type(e).__name__}: {e}", flush=True)
            torch.cuda.empty_cache()
        row = dict(p, ms={n: m[0] for n, m in ms.items()}, spread={n: [m[1], m[2]] for n, m in ms.items()},
                   tflops={n: tflops(p, m[0]) for n, m in ms.items()})
        rows.append(row)
        line = " ".join(f"{n}={t:.0f}" for n, t in sorted(row["tflops"].items(), key=lambda kv: -kv[1]))
        print(f"hd{p['hd']} s{p['seqlen']} b{p['batch']} causal={int(p['causal'])}: {line}", flush=True)
    result = dict(env=env, bench=rows)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"attention_backward_{gpu_slug(env['gpu'])}"
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        (out / f"{name}.md").write_text(markdown(result))
        print("wrote", out / f"{name}.json", out / f"{name}.md")


if __name__ == "__main__":
    main()
