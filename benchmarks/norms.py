"""RMSNorm / LayerNorm: GB/s of rtckern's kernels against a device-to-device copy, torch eager and torch.compile.

M x N = 2^27 elements, N in {1024, 4096, 5120, 8192, 12288, 16384, 65536}, bf16 / fp16 / fp32, forward and backward.

    python -m benchmarks norms [bench]   # the public ops (registry's choice) vs copy/eager/compile: the result set
    python -m benchmarks norms sweep     # the package tuner (`rtckern tune <norm op>`) over every benchmark shape
                                         # (trials: DIR/norms_sweep.json); --into DIR merges the rows into the
                                         # tables there (rtckern/tuning_tables: the shipped ones)
    python -m benchmarks norms sweep --kinds l2 --dirs bwd --ns 65536   # only these kinds' configs (plus each
                                         # kind's current config, re-timed in the same run)
    python -m benchmarks norms all       # both
    python -m benchmarks norms compile-times   # cold NVRTC compile of every kernel variant (no GPU;
                                               # DIR/norms_compile_times.json)

One shape of the sweep is `rtckern tune rms_norm --dtype bf16 --shapes 4096` (and layer_norm, the backwards):
the candidate configs, their checks against float64, the timing and the table rows are the package's
(rtckern/ops/_norms/tune.py). Bytes: forward reads x (+ weight, bias) and writes y; backward reads x, dy
(+ weight) and writes dx (+ dweight, dbias). Timing: CUDA events around `inner` back-to-back calls queued behind
a GPU sleep (so the host's launch cost stays out), warm-up first, median of `reps`; 2^27-element tensors are far
larger than the 60 MB L2.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

from benchmarks.env import legacy_meta
from benchmarks.runner import Result, Table, gpu_name
from rtckern.arch import Arch
from rtckern.device import DeviceInfo
from rtckern.ops._norms import configs, geometry, tune

TOTAL = tune.TUNE_ELEMENTS
NS = (1024, 4096, 5120, 8192, 12288, 16384, 65536)
DTYPES = ("bf16", "fp16", "fp32")
OPS = ("rms", "layer")
EPS = tune.EPS
Data = tune.Data
_rel = tune.rel_error


def fwd_problem(op: str, dtype: str, n: int) -> geometry.FwdProblem:
    return tune.table_problem("fwd", op, dtype, n)


def bwd_problem(op: str, dtype: str, n: int) -> geometry.BwdProblem:
    return tune.table_problem("bwd", op, dtype, n)


def timeit(fn, torch, reps: int = 15, inner: int = 4, warmup: int = 3) -> float:
    return tune.timeit(fn, torch, reps=reps, inner=inner, warmup=warmup)


# ---- sweep: the package tuner over the benchmark's shapes --------------------------------------------------------
def cmd_sweep(out: Path, torch, budget_s: float, kinds=None, dirs=("fwd", "bwd"), ns=NS, l2_policy: bool = True,
              into: Path | None = None) -> dict:
    """Tune every (norm op, dtype, N) of the benchmark with the package's NormTuner; the trials go to
    DIR/norms_sweep.json, and with `into`, the rows (fastest config per kind, fastest kind) into the tables there."""
    from benchmarks.env import environment
    from rtckern import tuning
    from rtckern.ops._norms import candidates as cands

    importlib.import_module("rtckern.ops")  # registers the norm ops' request builders
    device = DeviceInfo.from_device(torch.cuda.current_device())
    env = environment()
    ops = [op for op, (d, _) in tune.OPS.items() if d in dirs]
    t_start = time.perf_counter()
    results = []
    for dtype in DTYPES:
        for n in ns:
            if time.perf_counter() - t_start > budget_s:
                print(f"sweep: time budget spent; skipping {dtype} N={n}", flush=True)
                continue
            for op in ops:
                tuner = tune.NormTuner(op, kinds, l2_policy)
                req = cands.build_request(op, (n,), dtype, device)
                source = f"rtckern tune {op} --dtype {dtype} --shapes {n}"
                if kinds or not l2_policy:
                    source += (f" (python -m benchmarks norms sweep{' --kinds ' + ','.join(kinds) if kinds else ''}"
                               f"{'' if l2_policy else ' --no-l2-policy'})")
                try:
                    row, trials = tuning.tune_request(tuner, req, source=source)
                finally:
                    tuner.release()
                d, norm = tune.OPS[op]
                moved = tune.table_problem(d, norm, dtype, n).bytes_moved(TOTAL // n)
                for t in trials:
                    results.append({"dir": d, "op": norm, "dtype": dtype, "n": n, "kind": t.config["kind"],
                                    "config": {k: v for k, v in t.config.items() if k != "kind"},
                                    "us": None if t.seconds is None else t.seconds * 1e6,
                                    "gbps": None if t.seconds is None else moved / t.seconds / 1e9,
                                    "ok": t.seconds is not None, "error": t.error})
                written = tuner.table_rows(req, row, trials)
                if into is not None:
                    for name, fields, rows in written:
                        tuning.merge_rows(name, fields, rows, into / f"{name}.json", keep_order=True)
                kind_rows = [r for name, _, rs in written if name == configs.TABLE_KIND for r in rs]
                bad = [t for t in trials if t.seconds is None]
                print(f"sweep {op:>19} {dtype:>4} N={n:>6}: " + ", ".join(
                    f"{r.config['kind']} {r.meta['gbps']} GB/s" for r in kind_rows)
                    + f" best {json.dumps(dict(row.config), separators=(',', ':'))}"
                    + (f"  [{len(bad)} failed]" if bad else ""), flush=True)
                for t in bad[:6]:
                    print("   FAILED", op, dict(t.config), t.error[:200], flush=True)
            torch.cuda.empty_cache()
            (out / "norms_sweep.json").write_text(json.dumps({"env": env, "results": results}, indent=1))
    return {"results": results}


def cmd_bench(torch, compile_budget_s: float, dtypes=DTYPES, ns=NS, partial=None) -> dict:
    """partial(bench so far): called after each N (a run cut short still leaves a report)."""
    from rtckern import ops as norms

    import torch._dynamo

    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.cache_size_limit = 1024
    F = torch.nn.functional
    rows_out = []
    copy = {}
    for dtype in dtypes:
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        a = torch.randn(TOTAL, device="cuda").to(dt)
        b = torch.empty_like(a)
        sec = timeit(lambda: b.copy_(a), torch)
        copy[dtype] = 2 * a.numel() * a.element_size() / sec / 1e9
        a = b = None
    print("copy GB/s:", {k: round(v) for k, v in copy.items()}, flush=True)
    compile_spent = 0.0
    for dtype in dtypes:
        for n in ns:
            data = Data(torch, dtype, n)
            x, w, bias, dy = data.x, data.w, data.b, data.dy
            for op in OPS:
                fp, bp = fwd_problem(op, dtype, n), bwd_problem(op, dtype, n)
                fbytes, bbytes = fp.bytes_moved(data.rows), bp.bytes_moved(data.rows)
                r = {"op": op, "dtype": dtype, "n": n, "rows": data.rows, "copy_gbps": copy[dtype]}
                if op == "rms":
                    ours_f = lambda: norms.rms_norm(x, w, EPS)  # noqa: E731
                    eager_f = lambda: F.rms_norm(x, (n,), w, EPS)  # noqa: E731

                    def fn(x_, w_):
                        return F.rms_norm(x_, (n,), w_, EPS)
                    args = (x, w)
                    _, rstd = norms.rms_norm(x, w, EPS, return_rstd=True)
                    ours_b = lambda: norms.rms_norm_backward(dy, x, w, rstd)  # noqa: E731
                else:
                    ours_f = lambda: norms.layer_norm(x, w, bias, EPS)  # noqa: E731
                    eager_f = lambda: F.layer_norm(x, (n,), w, bias, EPS)  # noqa: E731

                    def fn(x_, w_, b_):
                        return F.layer_norm(x_, (n,), w_, b_, EPS)
                    args = (x, w, bias)
                    _, mean, rstd = norms.layer_norm(x, w, bias, EPS, return_stats=True)
                    ours_b = lambda: norms.layer_norm_backward(dy, x, w, bias, mean, rstd)  # noqa: E731
                # Correctness of what is timed (subset rows of y, all of dweight).
                rows = data.check_rows(torch)
                r["fwd_err"] = _rel(torch, ours_f()[rows], data.ref_fwd(torch, op, rows))
                grads = ours_b()
                r["bwd_err"] = max(_rel(torch, grads[0][rows], data.ref_dx(torch, op, rows)),
                                   _rel(torch, grads[1], data.reference_dw(torch, op)[0]))
                r["ours_fwd_gbps"] = fbytes / timeit(ours_f, torch) / 1e9
                r["eager_fwd_gbps"] = fbytes / timeit(eager_f, torch) / 1e9
                r["ours_bwd_gbps"] = bbytes / timeit(ours_b, torch) / 1e9
                xg = x.detach().requires_grad_()
                wg = w.detach().requires_grad_()
                leaves = [xg, wg] + ([bias.detach().requires_grad_()] if op == "layer" else [])
                y = fn(*leaves)
                r["eager_bwd_gbps"] = bbytes / timeit(
                    lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True), torch) / 1e9
                y = leaves = xg = wg = grads = None
                if compile_spent < compile_budget_s:
                    t0 = time.perf_counter()
                    cf = torch.compile(fn, dynamic=False)
                    cf(*args)
                    torch.cuda.synchronize()
                    compile_spent += time.perf_counter() - t0
                    r["compile_fwd_gbps"] = fbytes / timeit(lambda: cf(*args), torch) / 1e9
                else:
                    r["compile_fwd_gbps"] = None
                kinds = _chosen(op, dtype, n)
                r.update(kinds)
                rows_out.append(r)
                print(_line(r), flush=True)
            del data
            torch.cuda.empty_cache()
            if partial is not None:  # the report so far, so a run cut short still leaves one
                partial({"copy_gbps": copy, "results": rows_out})
    return {"copy_gbps": copy, "results": rows_out}


def _chosen(op, dtype, n) -> dict:
    """The candidates the op's hot-path memo holds for (op, dtype, n): what the timed calls ran."""
    from rtckern.ops._norms import api as norms_api

    out = {}
    for sig, (_s, req, cand, _k) in norms_api._fast.items():
        if sig[2] == n and dict(sig[1]).get("x") == dtype and sig[0].startswith("layer" if op == "layer" else "rms"):
            out["bwd_kind" if sig[0].endswith("backward") else "fwd_kind"] = cand.name
    return out


def _ratio(a, b):
    return a / b if (a and b) else None


def _line(r) -> str:
    def f(v):
        return f"{v:6.0f}" if v else "     -"
    return (f"{r['op']:>5} {r['dtype']:>4} N={r['n']:>6}  fwd {f(r['ours_fwd_gbps'])} "
            f"(x{_ratio(r['ours_fwd_gbps'], r['copy_gbps']):.2f} copy, eager {f(r['eager_fwd_gbps'])}, compile "
            f"{f(r['compile_fwd_gbps'])})  bwd {f(r['ours_bwd_gbps'])} (x{_ratio(r['ours_bwd_gbps'], r['copy_gbps']):.2f}"
            f" copy, eager {f(r['eager_bwd_gbps'])})  err {r['fwd_err']:.1e}/{r['bwd_err']:.1e}  "
            f"{r.get('fwd_kind', '')}/{r.get('bwd_kind', '')}")


def result(bench: dict) -> Result:
    rows = []
    for r in bench["results"]:
        fc, fcomp = _ratio(r["ours_fwd_gbps"], r["copy_gbps"]), _ratio(r["ours_fwd_gbps"], r["compile_fwd_gbps"])
        bc, be = _ratio(r["ours_bwd_gbps"], r["copy_gbps"]), _ratio(r["ours_bwd_gbps"], r["eager_bwd_gbps"])
        fok = fc >= 0.90 and (fcomp is None or fcomp >= 1.0)
        bok = bc >= 0.80 and be >= 1.5

        def g(v, fmt="{:.0f}"):
            return fmt.format(v) if v is not None else "-"
        rows.append((r["op"], r["dtype"], r["n"], g(r["ours_fwd_gbps"]), g(fc, "{:.2f}"), g(r["eager_fwd_gbps"]),
                     g(r["compile_fwd_gbps"]), g(fcomp, "{:.2f}"), g(r["ours_bwd_gbps"]), g(bc, "{:.2f}"),
                     g(r["eager_bwd_gbps"]), g(be, "{:.2f}"), f"{r.get('fwd_kind', '')} / {r.get('bwd_kind', '')}",
                     "yes" if fok else "NO", "yes" if bok else "NO"))
    body = ["M x N = 2^27 elements. Copy GB/s (read + write, same dtype): "
            + ", ".join(f"{k} {v:.0f}" for k, v in bench["copy_gbps"].items()),
            "Targets: fwd >= 0.90x copy and >= 1.0x torch.compile; bwd >= 0.80x copy and >= 1.5x eager.",
            Table(("op", "dtype", "N", "fwd GB/s", "x copy", "eager", "compile", "x compile", "bwd GB/s", "x copy",
                   "eager bwd", "x eager", "kernels", "fwd ok", "bwd ok"), rows)]
    return Result("rtckern norms benchmark", rows=bench["results"], body=body,
                  data={"copy_gbps": bench["copy_gbps"]}, plot=lambda plt, meta: plot(plt, meta, bench))


def render(payload: dict) -> Result:
    """The result set of a stored JSON (one written before the runner too: {"env", "copy_gbps", "results"})."""
    if "meta" not in payload:
        out = result({"copy_gbps": payload["copy_gbps"], "results": payload["results"]})
        out.meta = legacy_meta(payload["env"], gpu_used=True)
        return out
    return result({"copy_gbps": payload["copy_gbps"], "results": payload["rows"]})


def plot(plt, meta: dict, bench: dict):
    dtypes = [t for t in DTYPES if t in bench["copy_gbps"]]
    ops = [o for o in OPS if any(r["op"] == o for r in bench["results"])]
    fig, axes = plt.subplots(2, len(ops) * len(dtypes), figsize=(26 * len(ops) * len(dtypes) / 6, 8), sharex=True,
                             squeeze=False)
    for i, d in enumerate(("fwd", "bwd")):
        for j, (op, dtype) in enumerate((o, t) for o in ops for t in dtypes):
            ax = axes[i][j]
            rs = [r for r in bench["results"] if r["op"] == op and r["dtype"] == dtype]
            ns = [r["n"] for r in rs]
            ax.plot(ns, [r[f"ours_{d}_gbps"] for r in rs], "o-", label="rtckern")
            ax.plot(ns, [r[f"eager_{d}_gbps"] for r in rs], "s--", label="torch eager")
            if d == "fwd":
                ax.plot(ns, [r["compile_fwd_gbps"] or float("nan") for r in rs], "^--", label="torch.compile")
            ax.axhline(bench["copy_gbps"][dtype], color="k", lw=1, label="copy")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op} {dtype} {d}")
            ax.set_ylim(0, bench["copy_gbps"][dtype] * 1.1)
            if j == 0:
                ax.set_ylabel("GB/s")
            if i == 1:
                ax.set_xlabel("N")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"rtckern norms (M x N = 2^27) on {gpu_name(meta)}, {meta.get('date')}")
    fig.tight_layout()
    return fig


# ---- compile times (CPU) ----------------------------------------------------------------------------------------
SELECTED_NS = (7, 1000, 1024, 4096, 5120, 8192, 12288, 16384, 65536, 100000, 262144)


def _selected_specs() -> set:
    """The kernels the registry picks (shipped tables; 132 SMs on sm_90) for every norm op, dtype and N in
    SELECTED_NS on sm_75 / sm_80 / sm_90: what a user's first call compiles."""
    from rtckern.ops._norms import candidates as cands
    from rtckern.registry import select

    importlib.import_module("rtckern.ops")  # registers the candidates

    out = set()
    for arch in ("sm_75", "sm_80", "sm_90"):
        dev = DeviceInfo.for_arch(arch, sm_count=132)
        for op in cands.FWD_OPS + cands.BWD_OPS:
            for dtype in DTYPES:
                for n in SELECTED_NS:
                    out.update(select(cands.build_request(op, (n,), dtype, dev)).specs)
    return out


def cmd_compile_times(out: Path | None) -> dict:
    """Cold compile (new key, warm process) of representative variants of every kind for sm_75 / sm_80 / sm_90,
    and of the kernels the registry selects (`selected`)."""
    from rtckern.compiler import compiler_for

    variants = []
    for arch in ("sm_75", "sm_80", "sm_90"):
        a = Arch.parse(arch)
        dev = DeviceInfo.for_arch(arch)
        for dtype in DTYPES:
            for n in (7, 4096, 65536, 262144):
                for op in OPS:
                    fp = fwd_problem(op, dtype, n)
                    vec = geometry.pick_vec(n, (geometry.ITEMSIZE[dtype],), (16,))
                    fp = geometry.FwdProblem(**{**fp.__dict__, "vec": vec})
                    bp = geometry.BwdProblem(**{**bwd_problem(op, dtype, n).__dict__, "vec": fp.vec})
                    for kind in ("rows", "cluster", "l2", "l2c", "stage", "coop"):
                        if kind in ("cluster", "l2c") and a.cc < (9, 0):
                            continue
                        c = configs.fwd_config(fp, kind, dev) if kind not in geometry.BWD_ONLY_KINDS else None
                        if c is not None:
                            variants.append(geometry.fwd_spec(fp, kind, c, a))
                        c = configs.bwd_config(bp, kind, dev)
                        if c is not None:
                            variants.extend(geometry.bwd_specs(bp, kind, c, a))
    selected = _selected_specs()
    variants = list(dict.fromkeys(variants + sorted(selected, key=lambda s: s.name_expression + s.arch.sm)))
    comp = compiler_for(Arch.parse("sm_90"))
    t0 = time.perf_counter()
    comp.compile(geometry.fwd_spec(fwd_problem("rms", "bf16", 1024), "rows", geometry.rows_config(1024, 8),
                                   Arch.parse("sm_80")))
    first = (time.perf_counter() - t0) * 1e3
    rows = []
    for s in variants:
        ck = comp.compile(s)
        rows.append({"kernel": s.name_expression, "arch": s.arch.sm, "ms": round(ck.compile_ms, 1),
                     "selected": s in selected})
    ms = sorted(r["ms"] for r in rows)
    sel = sorted(r["ms"] for r in rows if r["selected"])
    summary = {"kernels": len(rows), "first_in_process_ms": round(first, 1), "median_ms": statistics.median(ms),
               "p90_ms": ms[int(0.9 * (len(ms) - 1))], "max_ms": ms[-1], "over_150ms": sum(m > 150 for m in ms),
               "selected_kernels": len(sel), "selected_median_ms": statistics.median(sel),
               "selected_max_ms": sel[-1], "selected_over_150ms": sum(m > 150 for m in sel),
               "cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count(),
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    print(json.dumps(summary))
    for r in sorted(rows, key=lambda r: -r["ms"])[:8]:
        print(f"  {r['ms']:7.1f} ms  {r['arch']}  {r['kernel']}")
    if out is not None:
        (out / "norms_compile_times.json").write_text(json.dumps({"summary": summary, "kernels": rows}, indent=1))
    return summary



QUICK = "bf16 at N = 4096 only (both norms, forward and backward)"


def add_args(ap) -> None:
    ap.add_argument("cmd", nargs="?", default="bench", choices=("bench", "sweep", "all", "compile-times"),
                    help="bench (default): the result set; sweep: the tuner over the benchmark's shapes; all: both; "
                    "compile-times: cold NVRTC compiles, no GPU")
    ap.add_argument("--kinds", help="sweep/all: only these kernel kinds (comma-separated), plus the tabled "
                    "config of the others")
    ap.add_argument("--dirs", default="fwd,bwd", help="sweep/all: only these directions (fwd, bwd)")
    ap.add_argument("--ns", help="sweep/all: only these row lengths (comma-separated; default: every benchmark N)")
    ap.add_argument("--into", type=Path, default=None, help="sweep/all: merge the rows into the tables in this "
                    "directory (rtckern/tuning_tables: the shipped tables; rows replaced in place)")
    ap.add_argument("--sweep-budget", type=float, default=3600.0, help="seconds of sweep at most (checked per N)")
    ap.add_argument("--compile-budget", type=float, default=120.0, help="seconds of torch.compile at most")
    ap.add_argument("--l2-policy", action=argparse.BooleanOptionalAction, default=True,
                    help="sweep/all: also every l2 config (and some l2c OPTs) with the L2 access policies (OPT 256; "
                    "sm_80+); on by default, so a sweep re-times what the tables ship")


def needs_gpu(a) -> bool:
    return a.cmd != "compile-times"


def run(a) -> Result | None:
    if a.cmd == "compile-times":
        cmd_compile_times(a.out)
        return None
    kinds = tuple(a.kinds.split(",")) if a.kinds else None
    dirs = tuple(a.dirs.split(","))
    ns = tuple(int(v) for v in a.ns.split(",")) if a.ns else NS
    import torch

    if a.cmd in ("sweep", "all"):
        cmd_sweep(a.out, torch, a.sweep_budget, kinds, dirs, ns, a.l2_policy, a.into)
    if a.cmd == "sweep":
        return None
    bench = cmd_bench(torch, a.compile_budget, ("bf16",) if a.quick else DTYPES, (4096,) if a.quick else NS,
                      partial=lambda b: a.partial(result(b)))
    return result(bench)
