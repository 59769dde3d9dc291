"""Attention backward: TFLOP/s of rtckern.ops.attention_backward against torch SDPA's flash and cuDNN backward.

    python -m benchmarks attention_backward [--deterministic] [--impls sm80_mma,simt] [--quick]

--impls adds forced rtckern candidates next to the registry's choice (rtckern_<impl>, and rtckern_<impl>_det with
--deterministic): e.g. --impls sm80_mma compares the mma.sync kernel with the sm_90a one the registry picks.

Points: bf16, head dim 64 (32 heads) and 128 (16 heads), seqlen 1k / 4k / 16k at 16k tokens per batch, causal and not;
GQA points (SDPA with enable_gqa): a Llama-style training step's attention (batch 2 x 2k tokens, 16 q heads over 4 kv
heads, head dim 128), GQA 8 at 4k and GQA 4 at head dim 64, each with rtckern_unsplit beside the registry's choice (the
wgmma kernel without its head split: each block walks the whole GQA group). Only the backward is timed: rtckern's op
from a saved (o, lse); SDPA's through autograd.grad of an output computed once under the backend (sdpa_kernel),
retaining the graph. CUDA events, median of --reps back-to-back calls after a warm-up. TFLOP/s = 2.5 x the forward's 4 *
batch * heads * seqlen^2 * head_dim, halved for causal.
The runner writes attention_backward_<gpu>.json, .md and .png (one current file set per GPU, overwritten by each
run); --compile-times writes attention_backward.{json,md,png} (no GPU).
"""
from __future__ import annotations

from benchmarks.attention import tflops_panels, time_ms
from benchmarks.runner import Result, Table, gpu_name, recorded_args

COMPILE_BUDGET_S = 2.0  # the budget per backward kernel on the CPU machine

QUICK = "head dim 128 only, 1k and 16k, 5 reps"


def bench_points():
    pts = []
    for hd, heads in ((64, 32), (128, 16)):
        for sl in (1024, 4096, 16384):
            for causal in (False, True):
                pts.append(dict(hd=hd, heads=heads, heads_kv=heads, seqlen=sl, batch=16384 // sl, causal=causal))
    for hd, heads, heads_kv, sl, batch in ((128, 16, 4, 2048, 2), (128, 32, 4, 4096, 4), (64, 32, 8, 1024, 16)):
        for causal in (False, True):
            pts.append(dict(hd=hd, heads=heads, heads_kv=heads_kv, seqlen=sl, batch=batch, causal=causal))
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
    if impl == "unsplit":  # the wgmma kernel without its head split
        from rtckern.testing import attention_backward_unsplit

        return attention_backward_unsplit()
    return config.override(force_impl={"attention_backward": f"attention_backward.{impl}"})


def sdpa_backward_runner(backend_name, q, k, v, g, causal):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v))
    gqa = q.shape[2] != k.shape[2]
    with sdpa_kernel(getattr(SDPBackend, backend_name)):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
    gt = g.transpose(1, 2)

    def fn():
        return torch.autograd.grad(out, (qt, kt, vt), gt, retain_graph=True)
    return fn


def add_args(ap) -> None:
    ap.add_argument("--compile-times", action="store_true", help="cold NVRTC compile of every backward kernel of "
                    "every candidate for sm_90 and sm_80 (bf16, each head dim and causal mode; no GPU)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--deterministic", action="store_true", help="also time rtckern's deterministic mode")
    ap.add_argument("--impls", default="", help="extra forced rtckern candidates to time, comma list (e.g. sm80_mma,simt)")


def needs_gpu(args) -> bool:
    return not args.compile_times


def compile_times():
    """Cold NVRTC compile (no cache) of each kernel every backward candidate uses, on described sm_90 and sm_80
    devices: the issue's budget is 2 s per backward kernel on the CPU machine."""
    import time

    from rtckern.compiler import compiler_for
    from rtckern.device import DeviceInfo
    from rtckern.registry import candidates
    from rtckern.registry.candidate import arch_reason

    from rtckern.ops._attention import backward_candidates as bc

    seen, rows = set(), []
    for arch in ("sm_90", "sm_80"):
        dev = DeviceInfo.for_arch(arch)
        for hd in (64, 128, 256):
            for causal in (False, True):
                req = bc.request("bf16", hd, causal, False, dev)
                for cand in candidates("attention_backward"):
                    if arch_reason(cand, req) is not None or cand.supports(req) is not None:  # cannot serve
                        continue
                    for spec in cand.kernel_specs(req):
                        if spec in seen:
                            continue
                        seen.add(spec)
                        t0 = time.perf_counter()
                        compiler_for(spec.arch).compile(spec)
                        dt = time.perf_counter() - t0
                        rows.append(dict(candidate=cand.name, arch=spec.arch.sm, kernel=spec.name_expression,
                                         seconds=round(dt, 3)))
                        print(f"{dt:6.2f} s  {spec.arch.sm:7s} {spec.name_expression}", flush=True)
    return compile_result(rows)


def compile_result(rows: list[dict]) -> Result:
    note = (f"Cold NVRTC compile of each kernel (no cache), one at a time (CPUs and load average: the lines above); "
            f"max {max(r['seconds'] for r in rows):.2f} s over {len(rows)} kernels.")
    table = Table(["candidate", "arch", "kernel", "seconds"],
                  [[r["candidate"], r["arch"], r["kernel"], f"{r['seconds']:.2f}"] for r in rows])
    return Result("Attention backward: cold compile per kernel", rows=rows, body=[note, table],
                  plot=lambda plt, meta: compile_plot(plt, meta, rows))


def compile_plot(plt, meta: dict, rows: list[dict]):
    """Seconds per kernel, one color per candidate, against the budget."""
    fig, ax = plt.subplots(figsize=(12, 4.5))
    names = list(dict.fromkeys(r["candidate"] for r in rows))
    for i, name in enumerate(names):
        xs = [j for j, r in enumerate(rows) if r["candidate"] == name]
        ax.bar(xs, [rows[j]["seconds"] for j in xs], color=plt.cm.tab10(i % 10), label=name)
    ax.axhline(COMPILE_BUDGET_S, color="k", ls="--", lw=1, label=f"budget {COMPILE_BUDGET_S:g} s per kernel")
    ax.set_xlabel("kernel (in compile order: sm_90 then sm_80, head dims 64 / 128 / 256, causal and not)")
    ax.set_ylabel("cold NVRTC compile, s")
    ax.set_xticks([])
    ax.legend(fontsize=8)
    ax.set_title(f"attention backward: cold compile per kernel, {len(rows)} kernels ({gpu_name(meta)})")
    fig.tight_layout()
    return fig


def reps_of(args) -> int:
    return 5 if args.quick else args.reps


def run(args):
    if args.compile_times:
        return compile_times()
    import torch

    points = bench_points()
    reps = reps_of(args)
    if args.quick:
        points = [p for p in points if p["hd"] == 128 and p["seqlen"] in (1024, 16384)]
    rows = []
    for p in points:
        gen = torch.Generator(device="cuda").manual_seed(1)
        shp = (p["batch"], p["seqlen"], p["heads"], p["hd"])
        kv_shp = (p["batch"], p["seqlen"], p.get("heads_kv", p["heads"]), p["hd"])
        q, g = (torch.randn(shp, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        k, v = (torch.randn(kv_shp, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        runners = {"rtckern": ("", lambda: rtckern_runner(q, k, v, g, p["causal"]))}
        if kv_shp[2] != shp[2]:
            runners["rtckern_unsplit"] = ("unsplit", lambda: rtckern_runner(q, k, v, g, p["causal"]))
        if args.deterministic:
            runners["rtckern_det"] = ("", lambda: rtckern_runner(q, k, v, g, p["causal"], deterministic=True))
        for impl in filter(None, args.impls.split(",")):
            runners[f"rtckern_{impl}"] = (impl, lambda: rtckern_runner(q, k, v, g, p["causal"]))
            if args.deterministic and impl != "simt":
                runners[f"rtckern_{impl}_det"] = (impl, lambda: rtckern_runner(q, k, v, g, p["causal"],
                                                                                deterministic=True))
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
        print(f"hd{p['hd']} h{p['heads']}/{kv_shp[2]} s{p['seqlen']} b{p['batch']} causal={int(p['causal'])}: {line}",
              flush=True)
    return bench_result(rows, reps)


def bench_result(rows: list[dict], reps: int) -> Result:
    names = sorted({k for r in rows for k in r["tflops"]})

    def ratio(t, other):
        return f"{t['rtckern'] / t[other]:.2f}x" if "rtckern" in t and other in t else None
    table = Table(["hd", "heads", "kv heads", "seqlen", "batch", "causal", *names, "rtckern / flash",
                   "rtckern / cudnn"],
                  [[r["hd"], r["heads"], r.get("heads_kv", r["heads"]), r["seqlen"], r["batch"], int(r["causal"]),
                    *[f"{r['tflops'][n]:.0f}" if n in r["tflops"] else None for n in names],
                    ratio(r["tflops"], "sdpa_flash"), ratio(r["tflops"], "sdpa_cudnn")] for r in rows])
    note = ("bf16, 16k tokens per batch (GQA points: batch x seqlen as listed); TFLOP/s = 2.5 x forward FLOPs "
            f"(halved for causal); median of CUDA-event timings over {reps} back-to-back calls.")
    def plot(plt, meta):
        # GQA points get panels of their own, labelled like head dims ("128 GQA 16/4")
        def panel(r):
            kv = r.get("heads_kv", r["heads"])
            return str(r["hd"]) if kv == r["heads"] else f"{r['hd']} GQA {r['heads']}/{kv}"
        return tflops_panels(plt, [dict(r, hd=panel(r)) for r in rows],
                             f"attention backward bf16 on {gpu_name(meta)} ({meta.get('date')})")
    return Result("Attention backward: TFLOP/s against SDPA's flash and cuDNN backward", rows=rows,
                  body=[note, table], plot=plot if rows else None)


def render(payload: dict) -> Result:
    """The result set of a stored JSON: the timed points, or the cold compiles of --compile-times."""
    rows = payload["rows"]
    if rows and "seconds" in rows[0]:
        return compile_result(rows)
    return bench_result(rows, reps_of(recorded_args(payload)))
