"""GEMM: rtckern.ops.gemm against torch.matmul (cuBLAS) in one process, large, skinny and fused-epilogue shapes.

    python -m benchmarks gemm                                    # the result set gemm_<gpu>.{json,md,png}
    python -m benchmarks gemm --check                            # and first the kernel-level checks
    python -m benchmarks gemm --tune --no-bench --table-out configs.json   # sweep configs, merge winners into the
                                                                 # user table (and copy it to configs.json)
    python -m benchmarks gemm --tune --skinny ...                # only the skinny shapes (M 16 / 128)

Timing: each call is captured 20 times in a CUDA graph and replayed (median of 7 replays / 20), so launch gaps do
not count for either side; the op's eager time (Python included) is reported too. Inputs are random (never
zeros), freshly drawn per shape; every timed output is checked against an fp32 reference first.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch

from benchmarks.env import legacy_meta
from benchmarks.runner import Result, Table, gpu_name
from rtckern.device import DeviceInfo
from rtckern.ops._gemm import candidates as cands
from rtckern.ops._gemm import geometry
from rtckern.ops._gemm.tune import error_bound, reference
from rtckern.ops import gemm

TDT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# (m, n, k, dtype, trans_b, bias, activation, residual, label)
BIG = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 4096)]
SKINNY = [(16, 4096, 4096), (16, 8192, 8192), (128, 4096, 4096), (128, 8192, 8192)]


SKINNY_ONLY = False  # --skinny: tune / bench the skinny shapes only


def bench_shapes() -> list[dict]:
    if SKINNY_ONLY:
        return [dict(m=m, n=n, k=k, dtype="bf16", trans_b=tb, group="skinny") for m, n, k in SKINNY
                for tb in (True, False)]
    out = []
    for dt in ("bf16", "fp16"):
        for m, n, k in BIG:
            for tb in (True, False):
                out.append(dict(m=m, n=n, k=k, dtype=dt, trans_b=tb, group="large"))
    for m, n, k in SKINNY:
        for tb in (True, False):
            out.append(dict(m=m, n=n, k=k, dtype="bf16", trans_b=tb, group="skinny"))
    for act, res in (("gelu_tanh", False), ("silu", True)):
        out.append(dict(m=4096, n=4096, k=4096, dtype="bf16", trans_b=True, bias=True, activation=act,
                        residual=res, group="fused"))
        out.append(dict(m=8192, n=8192, k=8192, dtype="bf16", trans_b=True, bias=True, activation=act,
                        residual=res, group="fused"))
    return out


def problem(s: dict) -> geometry.GemmProblem:
    return geometry.GemmProblem(1, s["m"], s["n"], s["k"], s["dtype"], s["dtype"], s["trans_b"], s.get("bias", False),
                                s.get("activation", "none"), s.get("residual", False), aligned=True, b_batched=False)


def graph_us(fn, reps: int = 20, replays: int = 7) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / reps)
    return statistics.median(times)


def eager_us(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / reps


# -- tune ----------------------------------------------------------------------------------------------------------
def _compile(spec):
    from rtckern.manager import get_manager

    get_manager().compile(spec)


def precompile_sweeps(dev, workers: int = 16) -> None:
    """Compile every config the sweeps will time, in parallel processes, into the disk cache."""
    import concurrent.futures as cf

    from rtckern.ops._gemm.tune import sweep_configs
    from rtckern.registry.core_api import target_for

    specs = []
    for s in bench_shapes():
        p = problem(s)
        for cfg in sweep_configs(geometry.GemmProblem(1, p.m, p.n, p.k, p.dtype, p.dtype, p.trans_b), dev):
            specs += geometry.kernel_specs(geometry.GemmProblem(1, p.m, p.n, p.k, p.dtype, p.dtype, p.trans_b), cfg,
                                           target_for(dev, cfg.kind == "sm90"))
    specs = list(dict.fromkeys(specs))
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(max_workers=min(workers, os.cpu_count() or 4)) as ex:
        errors = [e for e in ex.map(_safe_compile, specs) if e]
    print(f"precompiled {len(specs)} sweep kernels in {time.perf_counter() - t0:.1f}s; {len(errors)} failed", flush=True)
    for e in errors:
        print("COMPILE FAILED", e[:1500], flush=True)


def _safe_compile(spec):
    try:
        _compile(spec)
        return None
    except Exception as e:
        return f"{spec.describe()}: {e}"


def tune(args) -> int:
    from benchmarks.env import environment
    from rtckern import tuning
    from rtckern.ops._gemm import configs
    from rtckern.ops._gemm import tune as gemm_tune

    if args.no_pingpong:
        gemm_tune.ALLOW_PINGPONG = False
    tuner = gemm_tune.register_tuner()
    dev = DeviceInfo.from_device(0)
    precompile_sweeps(dev)
    env = environment()
    rows, report = [], []
    seen = set()
    for s in bench_shapes():
        p = geometry.GemmProblem(1, s["m"], s["n"], s["k"], s["dtype"], s["dtype"], s["trans_b"], b_batched=False)
        key = tuple(configs.key_of(p).items())
        if key in seen:
            continue
        seen.add(key)
        req = cands.request(p, dev)
        t0 = time.perf_counter()
        row, trials = tuning.tune_request(tuner, req)
        rows.append(row)
        ok = sorted((t for t in trials if t.seconds is not None), key=lambda t: t.seconds)
        bad = [t for t in trials if t.seconds is None]
        print(f"TUNE {s['m']}x{s['n']}x{s['k']} {s['dtype']} {configs.layout(s['trans_b'])}: best {row.config} "
              f"{row.meta['time_us']:.1f}us ({p.flops / row.meta['time_us'] / 1e6:.0f} TF); {len(ok)} timed, "
              f"{len(bad)} failed, {time.perf_counter() - t0:.1f}s", flush=True)
        for t in bad:
            print(f"   FAILED {dict(t.config)}: {t.error}", flush=True)
        report.append({"shape": s, "winner": row.to_json(),
                       "trials": [{"config": dict(t.config), "us": None if t.seconds is None else t.seconds * 1e6,
                                   "error": t.error} for t in trials]})
        # Merge as we go: a run cut short keeps every shape tuned so far.
        path = tuning.user_table_path(configs.OP)
        table = tuning.merge_rows(configs.OP, configs.KEY_FIELDS, [row], path)
        if args.table_out:
            with open(args.table_out, "w") as f:
                json.dump(table.to_json(), f, indent=1)
                f.write("\n")
        if args.out:
            with open(os.path.join(args.out, "gemm_tune_trials.json"), "w") as f:
                json.dump({"environment": env, "shapes": report}, f, indent=1)
    print(f"merged {len(rows)} rows into {tuning.user_table_path(configs.OP)}", flush=True)
    return 0


# -- bench ---------------------------------------------------------------------------------------------------------
def bench_one(s: dict, gen) -> dict:
    p = problem(s)
    dt = TDT[p.dtype]
    a = torch.randn(p.m, p.k, device="cuda", generator=gen).to(dt)
    b = (torch.randn(*((p.n, p.k) if p.trans_b else (p.k, p.n)), device="cuda", generator=gen)
         / math.sqrt(p.k)).to(dt)
    bias = torch.randn(p.n, device="cuda", generator=gen).to(dt) if p.bias else None
    res = torch.randn(p.m, p.n, device="cuda", generator=gen).to(dt) if p.residual else None
    act = None if p.activation == "none" else p.activation

    def ours():
        return gemm(a, b, bias=bias, activation=act, trans_b=p.trans_b, residual=res)

    y = ours()
    torch.cuda.synchronize()
    ref = reference(p, a, b, bias, res)
    err = float(torch.linalg.vector_norm(y.float() - ref) / torch.linalg.vector_norm(ref))
    bt = b.t() if p.trans_b else b

    def theirs():
        z = torch.matmul(a, bt)
        if bias is not None:
            z = z + bias
        if act == "gelu_tanh":
            z = torch.nn.functional.gelu(z, approximate="tanh")
        elif act == "silu":
            z = torch.nn.functional.silu(z)
        if res is not None:
            z = z + res
        return z

    us = graph_us(ours)
    tus = graph_us(theirs)
    mm_us = graph_us(lambda: torch.matmul(a, bt)) if (p.bias or p.residual or act) else tus
    sel = cands.selection(p, 0)
    cfg = sel.candidate.config(sel.request)
    return {**s, "us": us, "tflops": p.flops / us / 1e6, "torch_us": tus, "torch_tflops": p.flops / tus / 1e6,
            "torch_matmul_only_us": mm_us, "ratio_vs_torch": tus / us, "eager_us": eager_us(ours),
            "rel_err": err, "err_bound": error_bound(p), "ok": err <= error_bound(p),
            "candidate": sel.candidate.name, "config": cfg.as_dict(),
            "config_source": cands.tuned_plan(sel.request)[1]}


def table(rows: list[dict]) -> Table:
    cells = []
    for r in rows:
        if "error" in r:
            cells.append((r["group"], f"{r['m']}x{r['n']}x{r['k']}", r["dtype"], "", "", f"ERROR {r['error']}")
                         + ("",) * 6)
            continue
        epi = "+".join(x for x in (("bias" if r.get("bias") else ""), r.get("activation", "") or "",
                                   ("residual" if r.get("residual") else "")) if x and x != "none") or "-"
        cfg = r["config"]
        cfg_s = ",".join(f"{k}={v}" for k, v in cfg.items() if k not in ("group_m",))
        cells.append((r["group"], f"{r['m']}x{r['n']}x{r['k']}", r["dtype"], "tn" if r["trans_b"] else "nn", epi,
                      f"{r['tflops']:.0f}", f"{r['torch_tflops']:.0f}", f"{r['ratio_vs_torch']:.3f}",
                      f"{r['eager_us']:.1f}", f"{r['rel_err']:.1e}", r["candidate"], f"{cfg_s} ({r['config_source']})"))
    return Table(("group", "M x N x K", "dtype", "layout", "epilogue", "rtckern TFLOP/s", "torch TFLOP/s", "ratio",
                  "eager us", "rel err", "candidate", "config"), cells)


def plot(plt, meta: dict, rows: list[dict]):
    ok = [r for r in rows if "error" not in r]
    labels = [f"{r['m']}x{r['n']}x{r['k']}\n{r['dtype']} {'tn' if r['trans_b'] else 'nn'}"
              + ("\n" + (r.get('activation') or '') if r["group"] == "fused" else "") for r in ok]
    x = range(len(ok))
    fig, ax = plt.subplots(figsize=(max(10, 0.6 * len(ok)), 5))
    ax.bar([i - 0.2 for i in x], [r["tflops"] for r in ok], width=0.4, label="rtckern.ops.gemm")
    ax.bar([i + 0.2 for i in x], [r["torch_tflops"] for r in ok], width=0.4, label="torch.matmul (+ ops)")
    for i, r in zip(x, ok):
        ax.text(i, max(r["tflops"], r["torch_tflops"]) + 5, f"{r['ratio_vs_torch']:.2f}x", ha="center", fontsize=7)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=90, fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"GEMM on {gpu_name(meta)}, {(meta.get('date') or '')[:10]} (ratio = torch time / rtckern time)")
    ax.legend()
    fig.tight_layout()
    return fig


def bench(args) -> list[dict]:
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)
    rows = []
    shapes = bench_shapes()
    if args.quick:
        shapes = [s for s in shapes if s["dtype"] == "bf16" and (s["m"], s["n"], s["k"]) in QUICK_SHAPES]
    for s in shapes:
        try:
            r = bench_one(s, gen)
        except Exception as e:  # recorded and reported; the other shapes still run
            r = {**s, "error": f"{type(e).__name__}: {e}"[:500]}
        rows.append(r)
        if "error" in r:
            print(f"ERROR {s}: {r['error']}", flush=True)
        else:
            print(f"{r['group']:6s} {r['m']}x{r['n']}x{r['k']} {r['dtype']} {'tn' if r['trans_b'] else 'nn'} "
                  f"{r.get('activation', '')}{'+bias' if r.get('bias') else ''}{'+res' if r.get('residual') else ''}:"
                  f" {r['tflops']:.0f} TF vs torch {r['torch_tflops']:.0f} TF = {r['ratio_vs_torch']:.3f}x "
                  f"(eager {r['eager_us']:.0f}us, err {r['rel_err']:.1e} {'ok' if r['ok'] else 'BAD'}) "
                  f"{r['candidate']} {r['config_source']}", flush=True)
    return rows


CHECK = ("first the kernel-level checks: every kernel family and tile config launched directly (no registry) "
         "against float64 (benchmarks/_gemm_kernels.py)")
QUICK = "bf16 4096^3 (plain and fused epilogues) and 16x4096x4096 only"
QUICK_SHAPES = {(4096, 4096, 4096), (16, 4096, 4096)}


def add_args(ap) -> None:
    ap.add_argument("--tune", action="store_true", help="sweep every config of the benchmark's shapes first and "
                    "merge the winners into the user's tuning table")
    ap.add_argument("--bench", action=argparse.BooleanOptionalAction, default=True,
                    help="time the op against torch (the result set; on by default)")
    ap.add_argument("--table-out", default=None, help="--tune: also copy the merged table here")
    ap.add_argument("--no-pingpong", action="store_true", help="leave ping-pong configs out of the sweep")
    ap.add_argument("--skinny", action="store_true", help="only the skinny shapes (M 16 / 128, N = K 4096 / 8192)")
    ap.add_argument("--precompile-only", action="store_true", help="compile the sweep's kernels and stop")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 4),
                    help="--check: parallel compile processes")
    ap.add_argument("--no-sm90", action="store_true", help="--check: leave out the sm_90a kernels (after a hang)")


def run(args) -> Result | None:
    global SKINNY_ONLY
    SKINNY_ONLY = args.skinny
    if args.precompile_only:
        precompile_sweeps(DeviceInfo.from_device(0))
        return None
    rc = 0
    if args.tune:
        rc |= tune(args)
    checks = None
    if args.check:
        from benchmarks import _gemm_kernels

        checks = _gemm_kernels.run_checks(DeviceInfo.from_device(0), args.workers, args.no_sm90)
        rc |= 0 if all(c["ok"] for c in checks) else 1
    if not (args.bench or args.check):
        return None
    rows = bench(args) if args.bench else []
    result = to_result(rows, checks)
    result.rc |= rc
    return result


def to_result(rows: list[dict], checks: list[dict] | None) -> Result:
    """The result set of timed rows and kernel-level checks (either may be missing)."""
    rc = 0 if all(r.get("ok") for r in rows) and all(c["ok"] for c in checks or []) else 1
    body = []
    if checks is not None:
        bad = [c for c in checks if not c["ok"]]
        body.append(f"Kernel-level checks (every kernel family and tile config launched directly, float64 reference, "
                    f"bound max(u_out, 2^-16) * sqrt(K)): {len(checks) - len(bad)} passed, {len(bad)} failed.")
        if bad:
            body.append(Table(("case", "config", "rel err", "bound", "error"),
                              [(c["label"], c["config"], c.get("rel_err"), c.get("tol"), c.get("error")) for c in bad],
                              title="Failed kernel-level checks"))
    if rows:
        body += ["Times: CUDA-graph replays, median; torch column = torch.matmul (+ separate bias/activation/residual "
                 "ops for the fused rows). ratio = torch time / rtckern time (>1: rtckern faster).", table(rows)]
    return Result("rtckern GEMM vs torch.matmul", rows=rows, body=body,
                  data={"kernel_checks": checks} if checks is not None else {},
                  plot=(lambda plt, meta: plot(plt, meta, rows)) if rows else None, rc=rc)


def render(payload: dict) -> Result:
    """The result set of a stored JSON (one written before the runner too: {"environment", "results"})."""
    if "meta" not in payload:
        result = to_result(payload["results"], None)
        result.meta = legacy_meta(payload["environment"], gpu_used=True)
        return result
    return to_result(payload["rows"], payload.get("kernel_checks"))
