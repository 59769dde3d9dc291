"""Grouped GEMM (MoE experts): TFLOP/s of rtckern.ops.grouped_gemm (bf16) and grouped_gemm_fp8 (block scales)
against torch's per-group loop, torch._grouped_mm (bf16, where this torch has it) and the dense GEMM at equal work.

    python -m benchmarks grouped_gemm [--quick] [--skip-fp8] [--skip-bf16]

Shapes: DeepSeek-V3's expert GEMMs, N x K = 4096 x 7168 (gate and up projections of 7168 -> 2 x 2048) and
7168 x 2048 (down), G = 8 / 64 / 256 experts x 16 / 128 / 1024 tokens each (every group the same size; a skewed row
per shape puts half the tokens in one group), and the masked decode form (G experts of `capacity` rows, half of them
valid on average). Series, bf16: rtckern (grouped_gemm, one launch), torch_loop (a @ b[g].T per group, sizes known on
the host), torch_grouped_mm (torch._grouped_mm with the offsets), dense (rtckern.ops.gemm on all the tokens with one
expert's weight: the same FLOPs without the grouping). fp8 (e4m3, 1x128 / 128x128 block scales): rtckern
(grouped_gemm_fp8), rtckern_loop (gemm_fp8 per group), dense (gemm_fp8 on all the tokens). Masked: rtckern
(grouped_gemm_masked / grouped_gemm_fp8_masked) against torch.bmm over the full capacity (bf16).

TFLOP/s = 2 x (rows computed: the groups' rows, the valid ones for masked) x N x K / kernel time. Kernel time: a CUDA
graph of 10 calls replayed 5 times (median), so launch gaps (the loop's G launches) do not count; the weights
(hundreds of MB to GB) never fit in L2.
"""
from __future__ import annotations

import math

from benchmarks.runner import gpu_name

QUICK = "N x K = 4096 x 7168 and 7168 x 2048 at G = 64 x 128 tokens only, and one masked point"
SHAPES = ((4096, 7168), (7168, 2048))  # (N, K) of DeepSeek-V3's experts
GROUPS = (8, 64, 256)
TOKENS = (16, 128, 1024)
MASKED = ((8, 128), (32, 64), (256, 16))  # (G, capacity): decode


def add_args(ap) -> None:
    ap.add_argument("--skip-fp8", action="store_true", help="bf16 only")
    ap.add_argument("--skip-bf16", action="store_true", help="fp8 only")


def _seconds(run) -> float:
    import torch

    from rtckern.tuning import time_graphed

    return time_graphed(torch.device("cuda", torch.cuda.current_device()), run, reps=10, replays=5)


def _time_all(runs: dict, flops: float, label: str) -> dict:
    out = {}
    for name, fn in runs.items():
        try:
            out[name] = flops / _seconds(fn) / 1e12
        except Exception as e:  # one path failing must not lose the others
            print(f"{name} failed at {label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                  flush=True)
    return out


def _sizes(groups: int, tokens: int, skewed: bool) -> list[int]:
    if not skewed:
        return [tokens] * groups
    total = groups * tokens  # half of the tokens in group 0, the rest spread evenly
    rest = (total - total // 2) // max(1, groups - 1)
    sizes = [total // 2] + [rest] * (groups - 1)
    sizes[-1] += total - sum(sizes)
    return sizes


def _offsets(sizes):
    import torch

    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def bf16_point(n: int, k: int, sizes: list[int]) -> dict:
    import torch

    from rtckern import ops

    g, total = len(sizes), sum(sizes)
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(total, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    b = torch.randn(g, n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    off = _offsets(sizes)
    bounds = off.tolist()
    y = torch.empty(total, n, device="cuda", dtype=torch.bfloat16)

    def loop():
        for i in range(g):
            torch.mm(a[bounds[i]:bounds[i + 1]], b[i].t(), out=y[bounds[i]:bounds[i + 1]])

    runs = {"rtckern": lambda: ops.grouped_gemm(a, b, off), "torch_loop": loop,
            "dense": lambda: ops.gemm(a, b[0], trans_b=True)}
    if hasattr(torch, "_grouped_mm"):
        ends = off[1:].contiguous()
        runs["torch_grouped_mm"] = lambda: torch._grouped_mm(a, b.transpose(1, 2), offs=ends)
    res = _time_all(runs, 2.0 * total * n * k, f"bf16 {n}x{k} G={g}")
    return res


def fp8_point(n: int, k: int, sizes: list[int]) -> dict:
    import torch

    from rtckern import ops

    g, total = len(sizes), sum(sizes)
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(total, k, device="cuda", generator=gen, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    b = torch.randn(g, n, k, device="cuda", generator=gen, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    kb, nb = math.ceil(k / 128), math.ceil(n / 128)
    sa = torch.rand(total, kb, device="cuda", generator=gen) + 0.5
    sb = torch.rand(g, nb, kb, device="cuda", generator=gen) + 0.5
    off = _offsets(sizes)
    bounds = off.tolist()

    def loop():
        for i in range(g):
            if bounds[i + 1] > bounds[i]:
                ops.gemm_fp8(a[bounds[i]:bounds[i + 1]], b[i], sa[bounds[i]:bounds[i + 1]], sb[i])

    runs = {"rtckern": lambda: ops.grouped_gemm_fp8(a, b, sa, sb, off), "rtckern_loop": loop,
            "dense": lambda: ops.gemm_fp8(a, b[0], sa, sb[0])}
    res = _time_all(runs, 2.0 * total * n * k, f"fp8 {n}x{k} G={g}")
    return res


def masked_point(n: int, k: int, g: int, cap: int, fp8: bool) -> dict:
    import torch

    from rtckern import ops

    gen = torch.Generator(device="cuda").manual_seed(1)
    counts = torch.randint(0, cap + 1, (g,), device="cuda", generator=gen, dtype=torch.int32)
    valid = int(counts.sum())
    if fp8:
        a = torch.randn(g, cap, k, device="cuda", generator=gen, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        b = torch.randn(g, n, k, device="cuda", generator=gen, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        sa = torch.rand(g, cap, math.ceil(k / 128), device="cuda", generator=gen) + 0.5
        sb = torch.rand(g, math.ceil(n / 128), math.ceil(k / 128), device="cuda", generator=gen) + 0.5
        runs = {"rtckern": lambda: ops.grouped_gemm_fp8_masked(a, b, sa, sb, counts)}
    else:
        a = torch.randn(g, cap, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        b = torch.randn(g, n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        runs = {"rtckern": lambda: ops.grouped_gemm_masked(a, b, counts),
                "torch_bmm": lambda: torch.bmm(a, b.transpose(1, 2))}
    res = _time_all(runs, 2.0 * max(1, valid) * n * k, f"masked {n}x{k} G={g} cap={cap}")
    return res


def run(args):
    import torch

    from benchmarks.runner import Result

    points = [(g, t, False) for g in GROUPS for t in TOKENS] + [(64, 128, True)]
    masked = MASKED
    if args.quick:
        points, masked = [(64, 128, False)], MASKED[1:2]
    rows = []
    for dtype in [d for d in ("bf16", "fp8") if not getattr(args, f"skip_{d}")]:
        for n, k in SHAPES:
            for g, t, skewed in points:
                sizes = _sizes(g, t, skewed)
                res = (bf16_point if dtype == "bf16" else fp8_point)(n, k, sizes)
                rows.append({"kind": "contiguous", "dtype": dtype, "n": n, "k": k, "groups": g, "tokens": t,
                             "skewed": skewed, "tflops": res})
                print(f"{dtype} {n}x{k} G={g} x {t}{' skewed' if skewed else ''}: "
                      + ", ".join(f"{a}={v:.0f}" for a, v in res.items()), flush=True)
                torch.cuda.empty_cache()
            for g, cap in masked:
                res = masked_point(n, k, g, cap, dtype == "fp8")
                rows.append({"kind": "masked", "dtype": dtype, "n": n, "k": k, "groups": g, "capacity": cap,
                             "tflops": res})
                print(f"{dtype} masked {n}x{k} G={g} cap {cap}: "
                      + ", ".join(f"{a}={v:.0f}" for a, v in res.items()), flush=True)
                torch.cuda.empty_cache()
            args.partial(Result("Grouped GEMM (MoE experts)", rows=rows, body=body(rows)))
    return Result("Grouped GEMM (MoE experts)", rows=rows, body=body(rows), plot=plot_fn(rows))


def render(payload: dict):
    """The result set of an earlier run, from its JSON (python -m benchmarks grouped_gemm --render FILE)."""
    from benchmarks.runner import Result

    rows = payload["rows"]
    return Result("Grouped GEMM (MoE experts)", rows=rows, body=body(rows), plot=plot_fn(rows))


def _ratio(t: dict, a: str, b: str):
    return f"{t[a] / t[b]:.2f}x" if a in t and b in t and t[b] > 0 else None


def _cell(t: dict, name: str):
    return f"{t[name]:.0f}" if name in t else None


def body(rows) -> list:
    from benchmarks.runner import Table

    out = ["TFLOP/s of useful work (the groups' rows; masked: the valid rows) from CUDA-graph replays; ratios in one "
           "run on one GPU."]
    b16 = [r for r in rows if r["kind"] == "contiguous" and r["dtype"] == "bf16"]
    if b16:
        cols = ("rtckern", "torch_grouped_mm", "torch_loop", "dense")
        out.append(Table(["N", "K", "G", "tokens/group", *cols, "vs _grouped_mm", "vs loop", "vs dense"],
                         [[r["n"], r["k"], r["groups"], f"{r['tokens']}{' skewed' if r['skewed'] else ''}",
                           *[_cell(r["tflops"], c) for c in cols], _ratio(r["tflops"], "rtckern", "torch_grouped_mm"),
                           _ratio(r["tflops"], "rtckern", "torch_loop"), _ratio(r["tflops"], "rtckern", "dense")]
                          for r in b16], title="bf16 grouped_gemm"))
    f8 = [r for r in rows if r["kind"] == "contiguous" and r["dtype"] == "fp8"]
    if f8:
        cols = ("rtckern", "rtckern_loop", "dense")
        out.append(Table(["N", "K", "G", "tokens/group", *cols, "vs loop", "vs dense"],
                         [[r["n"], r["k"], r["groups"], f"{r['tokens']}{' skewed' if r['skewed'] else ''}",
                           *[_cell(r["tflops"], c) for c in cols], _ratio(r["tflops"], "rtckern", "rtckern_loop"),
                           _ratio(r["tflops"], "rtckern", "dense")] for r in f8],
                         title="fp8 grouped_gemm_fp8 (1x128 / 128x128 block scales)"))
    mk = [r for r in rows if r["kind"] == "masked"]
    if mk:
        out.append(Table(["dtype", "N", "K", "G", "capacity", "rtckern", "torch_bmm (full capacity)", "vs bmm"],
                         [[r["dtype"], r["n"], r["k"], r["groups"], r["capacity"], _cell(r["tflops"], "rtckern"),
                           _cell(r["tflops"], "torch_bmm"), _ratio(r["tflops"], "rtckern", "torch_bmm")] for r in mk],
                         title="masked (decode) grouped GEMM"))
    return out


def plot_fn(rows):
    pts = [r for r in rows if r["kind"] == "contiguous" and not r["skewed"]]
    if not pts:
        return None

    def plot(plt, meta):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
        for ax, dtype in zip(axes, ("bf16", "fp8")):
            for (n, k), style in zip(SHAPES, ("-", "--")):
                sel = sorted((r for r in pts if r["dtype"] == dtype and (r["n"], r["k"]) == (n, k)),
                             key=lambda r: (r["groups"], r["tokens"]))
                if not sel:
                    continue
                xs = list(range(len(sel)))
                for name, marker in (("rtckern", "o"), ("torch_grouped_mm", "x"), ("torch_loop", "s"),
                                     ("rtckern_loop", "s"), ("dense", "^")):
                    ys = [r["tflops"].get(name, math.nan) for r in sel]
                    if not all(math.isnan(y) for y in ys):
                        ax.plot(xs, ys, style + marker, label=f"{name} {n}x{k}")
                ax.set_xticks(xs, [f"{r['groups']}x{r['tokens']}" for r in sel], rotation=45, fontsize=7)
            ax.set_title(f"{dtype} on {gpu_name(meta)}")
            ax.set_xlabel("groups x tokens per group")
            ax.legend(fontsize=6)
        axes[0].set_ylabel("TFLOP/s")
        fig.tight_layout()
        return fig
    return plot
