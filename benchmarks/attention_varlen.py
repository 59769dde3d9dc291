"""Attention over packed variable-length sequences: TFLOP/s of rtckern.ops.attention_varlen (and
attention_varlen_backward) against the dense op and torch.

    python -m benchmarks attention_varlen [--impls sm80_mma,sm90a_wgmma] [--quick]

Points: bf16, 16k tokens packed from uniform random lengths (512..4k, and 128..2k: mean about 1k), head dim 64 (32
heads) and 128 (16 heads), q heads = kv heads, causal and not. Series: rtckern_varlen (the registry's choice, and
forced candidates with --impls); rtckern_dense_padded (the dense op on the same sequences padded to the longest);
rtckern_dense_equal (the dense op on equal-length sequences of the same token count: what the issue's ">= 0.9x the
dense op on the same total tokens" compares with); torch_flash_varlen (aten._flash_attention_forward with
cumulative lengths, where this torch has it); sdpa_flash_per_seq (one SDPA flash call per sequence). TFLOP/s count
the real per-sequence work, 4 h len^2 d per sequence (halved for causal), for every series but dense_equal (its own
work), so padding shows as lost throughput. CUDA events, median of --reps back-to-back calls after a warm-up.

Backward rows (pass "bwd"; the 128..2k lengths, mean about 1k, the issue's point): rtckern_varlen is
rtckern.ops.attention_varlen_backward (the registry's choice; forced candidates with --impls); rtckern_dense_equal
the dense attention_backward on equal lengths; torch_flash_varlen aten._flash_attention_backward with cumulative
lengths; sdpa_flash_per_seq the SDPA flash backward of every sequence (autograd over the per-sequence calls).
Backward TFLOP/s count 2.5x the forward's work.
The runner writes attention_varlen_<gpu>.json, .md and .png (one current file set per GPU, overwritten by each run).
"""
from __future__ import annotations

import math

from benchmarks.attention import time_ms
from benchmarks.runner import Result, Table, gpu_name, recorded_args

QUICK = "the 128..2k lengths and head dim 128 only, 5 reps"
BWD_FACTOR = 2.5  # backward FLOPs per forward FLOP (the count)
TOKENS = 16384
DISTS = {"512-4k": (512, 4096), "128-2k": (128, 2048)}


def lengths(lo: int, hi: int, seed: int, total: int = TOKENS) -> list[int]:
    """Uniform random lengths in [lo, hi] adding up to exactly `total` (the last one cut to fit)."""
    import random

    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < total:
        lens.append(min(rng.randint(lo, hi), total - sum(lens)))
    return lens


def bench_points():
    fwd = [dict(dist=dist, hd=hd, heads=heads, causal=causal, **{"pass": "fwd"}) for dist in DISTS
           for hd, heads in ((64, 32), (128, 16)) for causal in (False, True)]
    bwd = [dict(dist="128-2k", hd=hd, heads=heads, causal=causal, **{"pass": "bwd"})
           for hd, heads in ((64, 32), (128, 16)) for causal in (False, True)]
    return fwd + bwd


def work(lens, heads, hd, causal) -> float:
    f = sum(4.0 * heads * n * n * hd for n in lens)
    return f / 2 if causal else f


def forced(impl: str):
    """The settings that force an rtckern varlen candidate, forward and backward (entered around its whole
    timing)."""
    import contextlib

    from rtckern import config

    if not impl:
        return contextlib.nullcontext()
    return config.override(force_impl={"attention_varlen": f"attention_varlen.{impl}",
                                       "attention_varlen_backward": f"attention_varlen_backward.{impl}"})


def backward_runners(lens, heads, hd, causal, impls=()):
    """The backward series of one packed batch (see the module docstring), and the work of dense_equal."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rtckern import ops

    gen = torch.Generator(device="cuda").manual_seed(3)
    total, longest = sum(lens), max(lens)
    q, k, v, dout = (torch.randn(total, heads, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for _ in range(4))
    starts = [sum(lens[:i]) for i in range(len(lens) + 1)]
    cu = torch.tensor(starts, dtype=torch.int32, device="cuda")
    o, lse = ops.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal, return_lse=True)

    def varlen():
        return ops.attention_varlen_backward(dout, q, k, v, o, lse, cu, cu, longest, longest, causal=causal)
    out = {"rtckern_varlen": ("", varlen)}
    for impl in impls:
        out[f"rtckern_varlen_{impl}"] = (impl, varlen)
    each = total // len(lens)
    eq, edo = (torch.randn(len(lens), each, heads, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(2))
    eo, else_ = ops.attention(eq, eq, eq, causal=causal, return_lse=True)
    out["rtckern_dense_equal"] = ("", lambda: ops.attention_backward(edo, eq, eq, eq, eo, else_, causal=causal))
    fa = getattr(torch.ops.aten, "_flash_attention_forward", None)
    fb = getattr(torch.ops.aten, "_flash_attention_backward", None)
    if fa is not None and fb is not None:
        scale = 1.0 / math.sqrt(hd)
        try:
            to, tl, rng, unused, _ = fa(q, k, v, cu, cu, longest, longest, 0.0, causal, False, scale=scale)
            out["torch_flash_varlen"] = ("", lambda: fb(dout, q, k, v, to, tl, cu, cu, longest, longest, 0.0, causal,
                                                        rng, unused, scale=scale))
        except Exception as e:  # this torch's flash varlen forward is missing or refuses the inputs
            print(f"torch_flash_varlen unavailable: {type(e).__name__}: {str(e)[:200]}", flush=True)
    leaves = [tuple(t[starts[i]:starts[i] + n].transpose(0, 1)[None].detach().requires_grad_(True)
                    for t in (q, k, v)) for i, n in enumerate(lens)]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        outs = [F.scaled_dot_product_attention(a, b, c, is_causal=causal) for a, b, c in leaves]
    grads = [dout[starts[i]:starts[i] + n].transpose(0, 1)[None] for i, n in enumerate(lens)]
    flat = [t for trio in leaves for t in trio]

    def sdpa_per_sequence():
        return torch.autograd.grad(outs, flat, grads, retain_graph=True)
    out["sdpa_flash_per_seq"] = ("", sdpa_per_sequence)
    own = {"rtckern_dense_equal": BWD_FACTOR * work([each] * len(lens), heads, hd, causal)}
    return out, own


def runners(lens, heads, hd, causal, impls=()):
    """name -> (forced impl, fn) for one packed batch, and the work of the series that do not do the packed
    batch's (dense_equal)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rtckern import ops

    gen = torch.Generator(device="cuda").manual_seed(2)
    total, longest = sum(lens), max(lens)
    q, k, v = (torch.randn(total, heads, hd, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    starts = [sum(lens[:i]) for i in range(len(lens) + 1)]
    cu = torch.tensor(starts, dtype=torch.int32, device="cuda")

    def varlen():
        return ops.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal)
    out = {"rtckern_varlen": ("", varlen)}
    for impl in impls:
        out[f"rtckern_varlen_{impl}"] = (impl, varlen)
    padded = torch.zeros(len(lens), longest, heads, hd, device="cuda", dtype=torch.bfloat16)
    for i, n in enumerate(lens):
        padded[i, :n] = q[starts[i]:starts[i] + n]
    out["rtckern_dense_padded"] = ("", lambda: ops.attention(padded, padded, padded, causal=causal))
    each = total // len(lens)
    equal = torch.randn(len(lens), each, heads, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
    out["rtckern_dense_equal"] = ("", lambda: ops.attention(equal, equal, equal, causal=causal))
    fa = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if fa is not None:
        out["torch_flash_varlen"] = ("", lambda: fa(q, k, v, cu, cu, longest, longest, 0.0, causal, False,
                                                    scale=1.0 / math.sqrt(hd)))
    views = [tuple(t[starts[i]:starts[i] + n].transpose(0, 1)[None] for t in (q, k, v)) for i, n in enumerate(lens)]

    def sdpa_per_sequence():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return [F.scaled_dot_product_attention(a, b, c, is_causal=causal) for a, b, c in views]
    out["sdpa_flash_per_seq"] = ("", sdpa_per_sequence)
    own = {"rtckern_dense_equal": work([each] * len(lens), heads, hd, causal)}
    return out, own


def add_args(ap) -> None:
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--impls", default="",
                    help="extra forced rtckern varlen candidates to time, comma list (e.g. sm80_mma,sm90a_wgmma)")


def reps_of(args) -> int:
    return 5 if args.quick else args.reps


def run(args):
    import torch

    points, reps = bench_points(), reps_of(args)
    if args.quick:
        points = [p for p in points if p["dist"] == "128-2k" and p["hd"] == 128]
    impls = tuple(filter(None, args.impls.split(",")))
    rows = []
    for p in points:
        lens = lengths(*DISTS[p["dist"]], seed=7)
        bwd = p["pass"] == "bwd"
        series, own = (backward_runners if bwd else runners)(lens, p["heads"], p["hd"], p["causal"], impls)
        real = work(lens, p["heads"], p["hd"], p["causal"]) * (BWD_FACTOR if bwd else 1.0)
        ms = {}
        for name, (impl, fn) in series.items():
            try:
                with forced(impl):
                    ms[name] = time_ms(fn, reps=reps)
            except Exception as e:  # report and go on: one engine missing must not lose the others
                print(f"{name} failed at {p}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.empty_cache()
        row = dict(p, tokens=sum(lens), sequences=len(lens), longest=max(lens), ms={n: m[0] for n, m in ms.items()},
                   spread={n: [m[1], m[2]] for n, m in ms.items()},
                   tflops={n: own.get(n, real) / (m[0] * 1e-3) / 1e12 for n, m in ms.items()})
        rows.append(row)
        line = " ".join(f"{n}={t:.0f}" for n, t in sorted(row["tflops"].items(), key=lambda kv: -kv[1]))
        print(f"{p['pass']} {p['dist']} hd{p['hd']} causal={int(p['causal'])} ({len(lens)} sequences, longest "
              f"{max(lens)}): {line}", flush=True)
    return to_result(rows, reps)


def to_result(rows: list[dict], reps: int) -> Result:
    return Result("Attention over packed variable-length sequences: TFLOP/s", rows=rows, body=body(rows, reps),
                  plot=(lambda plt, meta: plot(plt, meta, rows)) if rows else None)


def render(payload: dict) -> Result:
    return to_result(payload["rows"], reps_of(recorded_args(payload)))


def body(rows, reps) -> list:
    names = []
    for r in rows:
        names += [n for n in r["tflops"] if n not in names]

    def ratio(t, other):
        return f"{t['rtckern_varlen'] / t[other]:.2f}x" if "rtckern_varlen" in t and t.get(other) else None

    def best_torch(t):
        vals = [v for n, v in t.items() if n.startswith(("torch_", "sdpa_"))]
        return f"{t['rtckern_varlen'] / max(vals):.2f}x" if vals and "rtckern_varlen" in t else None

    table = Table(["pass", "lengths", "hd", "causal", "sequences", "longest", *names, "varlen / dense equal",
                   "varlen / dense padded", "varlen / best torch"],
                  [[r.get("pass", "fwd"), r["dist"], r["hd"], int(r["causal"]), r["sequences"], r["longest"],
                    *[f"{r['tflops'][n]:.0f}" if n in r["tflops"] else None for n in names],
                    ratio(r["tflops"], "rtckern_dense_equal"), ratio(r["tflops"], "rtckern_dense_padded"),
                    best_torch(r["tflops"])] for r in rows])
    note = (f"bf16, {TOKENS} tokens per batch packed from uniform random lengths, hidden 2048 (q heads = kv heads); "
            "TFLOP/s on the real per-sequence work (4 h len^2 d per sequence, halved for causal; 2.5x that for the "
            f"backward rows), dense_equal on its own; median of CUDA-event timings over {reps} back-to-back calls.")
    return [note, table]


def plot(plt, meta: dict, rows: list[dict]):
    """TFLOP/s per series, one panel per pass and length mix, bars grouped by (head dim, causal)."""
    panels = list(dict.fromkeys((r.get("pass", "fwd"), r["dist"]) for r in rows))
    names = []
    for r in rows:
        names += [n for n in r["tflops"] if n not in names]
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), sharey=True, squeeze=False)
    for ax, (pas, dist) in zip(axes[0], panels):
        pts = [r for r in rows if (r.get("pass", "fwd"), r["dist"]) == (pas, dist)]
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * width for j, r in enumerate(pts) if n in r["tflops"]]
            ax.bar(xs, [r["tflops"][n] for r in pts if n in r["tflops"]], width=width, color=colors[n], label=n)
        ax.set_xticks(range(len(pts)))
        ax.set_xticklabels([f"hd {r['hd']}\n{'causal' if r['causal'] else 'non-causal'}" for r in pts], fontsize=8)
        ax.set_title(f"{'forward' if pas == 'fwd' else 'backward'}, lengths {dist} ({pts[0]['sequences']} sequences)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("TFLOP/s (real per-sequence work)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(names), fontsize=8, bbox_to_anchor=(0.5, 0.95))
    fig.suptitle(f"attention over packed variable-length sequences, bf16, {TOKENS} tokens, on {gpu_name(meta)}")
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return fig
