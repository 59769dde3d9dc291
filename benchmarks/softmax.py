"""Softmax ops (plain, masked, causal; forward and backward): GB/s against a device copy, torch eager, torch.compile.

Rows of N keys with M x N = 2^27 elements.

    python -m benchmarks softmax [--prefill] [--tune] [--no-bench] [--compile all|plain|none] [--ceilings] [--hints]

--prefill   compiles, in parallel, every kernel the GPU tests and this benchmark use (disk cache), so pytest and the
            timings do not compile one by one.
--tune      times every one-pass config per (direction, dtype, N) (rtckern.tuning), checks each against a float64
            reference first, and writes the winners as tuning tables softmax.json / softmax_backward.json (the
            format of rtckern/tuning_tables/) to the output folder and to this process's tuning dir.
bench       (the default; --no-bench skips it) times the ops: the result set softmax_<gpu>.{json,md,png}. A run
            with --no-bench and only --prefill / --tune writes DIR/softmax_tuning.json, which a later bench run
            into the same folder reports.
--ceilings  also the traffic ceilings the ratios to copy are read against (benchmarks/_softmax_ceilings.py).
--hints     also the cache-hint variants of the selected kernels (benchmarks/_softmax_hints.py).

Bytes counted: each input read once and each output written once; the boolean mask's bytes (its own size) where
there is one; for the causal ops only the keys at or below the diagonal are read (the kernels skip the rest),
every key is written. GB/s ratios between implementations are time ratios on the same problem.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import time
from pathlib import Path

from benchmarks.env import legacy_meta
from benchmarks.runner import Result, Table, gpu_name, stored_data

ELEMENTS = 1 << 27
BENCH_NS = (1024, 4096, 8192, 16384, 65536)
TEST_NS = (1, 3, 1000, 1024, 4096, 8192, 16384, 65536, 100000)
SCALE = 0.125
FWD_OPS = ("softmax", "scaled_masked_softmax", "scaled_upper_triang_masked_softmax",
           "scaled_aligned_causal_masked_softmax")
T0 = time.time()
COMPILE_DEADLINE = [1e9]  # seconds after start past which torch.compile baselines are skipped (--compile-deadline)


def log(*a) -> None:
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


# ---- prefill -----------------------------------------------------------------------------------------------------
def _compile_one(spec):
    from rtckern.manager import get_manager

    t = time.perf_counter()
    try:
        get_manager().compile(spec)
        return spec.name_expression, time.perf_counter() - t, ""
    except Exception as e:  # reported in the summary; the test or timing that needs it fails loudly later
        return spec.name_expression, time.perf_counter() - t, str(e).splitlines()[0][:200]


def prefill(dev, dtypes) -> dict:
    """Every kernel of both candidates of every op for the test row lengths, plus every tuning config."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp

    from rtckern.ops._softmax import candidates as cands, geometry
    from rtckern.ops._softmax.tune import sweep_configs
    from rtckern.registry import candidates
    from rtckern.registry.candidate import arch_reason
    from rtckern.registry.core_api import target_for

    specs = []
    for op in cands.OPS:
        for dt in ("fp32", "fp16", "bf16"):
            vecs_by_n = {n: {geometry.vector_width(dt, n)} for n in TEST_NS + BENCH_NS}
            vecs_by_n[1024].add(1)  # the misaligned-view test
            for n, vecs in vecs_by_n.items():
                for vec in vecs:
                    req = cands.request(op, dt, n, vec, dev)
                    for c in candidates(op):
                        if arch_reason(c, req) is None and c.supports(req) is None:
                            specs += c.kernel_specs(req)
    target = target_for(dev)
    for direction in (geometry.FWD, geometry.BWD):
        for dt in dtypes:
            for n in BENCH_NS:
                vec = geometry.vector_width(dt, n)
                for cfg in sweep_configs(direction, dt, n, vec, dev.max_smem_per_block_optin, dev.max_threads_per_sm):
                    for kind in (geometry.PLAIN, geometry.MASKED, geometry.CAUSAL):  # tuned rows serve every mask kind
                        specs.append(cands.onepass_spec(direction, kind, dt, vec, cfg, target))
                if direction == geometry.FWD:  # the masked sweep's own configs (head loops)
                    for cfg in sweep_configs(direction, dt, n, vec, dev.max_smem_per_block_optin,
                                             dev.max_threads_per_sm, geometry.MASKED):
                        if cfg.heads > 1:
                            specs.append(cands.onepass_spec(direction, geometry.MASKED, dt, vec, cfg, target))
    if dev.arch.cc >= (9, 0):
        from rtckern.ops._softmax import ring

        for direction in (geometry.FWD, geometry.BWD):
            for dt in dtypes:
                for n in BENCH_NS:
                    for kind in (geometry.PLAIN, geometry.MASKED, geometry.CAUSAL):
                        if ring.kernel_kind(direction, kind) != kind:
                            continue
                        for cfg in ring.sweep_rings(direction, kind, dt, n, dev.max_smem_per_block_optin):
                            specs.append(cands.ring_spec(direction, kind, dt, cfg, target))
    specs = list(dict.fromkeys(specs))
    t = time.perf_counter()
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 8, mp_context=mp.get_context("spawn")) as ex:
        res = list(ex.map(_compile_one, specs, chunksize=2))
    failed = [(n, e) for n, _, e in res if e]
    out = {"kernels": len(specs), "wall_s": round(time.perf_counter() - t, 2),
           "compile_s_median": round(statistics.median(r[1] for r in res), 3), "failed": failed}
    log(f"prefill: {out['kernels']} kernels in {out['wall_s']} s (median {out['compile_s_median']} s each), "
        f"{len(failed)} failed")
    for n, e in failed:
        log("  FAILED", n, e)
    return out


# ---- timing ------------------------------------------------------------------------------------------------------
def time_ms(torch, fn, reps: int = 15, inner: int = 4) -> float:
    """Median over `reps` samples of `inner` back-to-back calls (events on the current stream). A GPU sleep is
    queued first so that the host queues the timed calls while the GPU is busy: device time only (the host's cost
    per call is measured by benchmarks/op_overhead.py), the same for every implementation."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # ~0.5 ms at 1.98 GHz: longer than queueing `inner` calls
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / inner)
    return statistics.median(samples)


def copy_gbps(torch, numel: int, dtype) -> float:
    src = torch.randn(numel, device="cuda", dtype=dtype)
    dst = torch.empty_like(src)
    ms = time_ms(torch, lambda: dst.copy_(src), reps=20)
    return 2 * numel * src.element_size() / ms / 1e6


# ---- tuning ------------------------------------------------------------------------------------------------------
def tune(torch, dev, dtypes, out_dir: Path, one_pass: bool = True, rings: bool = True,
         directions=("fwd", "bwd"), ns=None, kinds=None, kernels=None) -> list[dict]:
    """Every tuning table of every (direction, mask kind): the one-pass kernels' and (sm_90+) the ring kernel's.
    Each config is checked against float64 on the kind's problem before it may win; winners are written to the
    output folder and to this process's tuning dir (so --bench in the same run uses them). `directions`, `ns`,
    `kinds` (mask kinds 0 plain, 1 masked, 2 causal): only those (a partial re-tune merges into the tables).
    `kernels` (one-pass kernel names): only those kernels' configs, plus the config the tables give now (timed in
    the same run, so the winner is chosen against it)."""
    from rtckern.ops._softmax.configs import KINDS

    report = []
    for is_ring in ((False,) if one_pass else ()) + ((True,) if rings and dev.arch.cc >= (9, 0) else ()):
        for direction in directions:
            for kind in KINDS[direction]:
                if kinds is not None and kind not in kinds:
                    continue
                report += tune_table(torch, dev, dtypes, out_dir, direction, kind, is_ring, ns or BENCH_NS,
                                     None if is_ring else kernels)
    return report


def tune_table(torch, dev, dtypes, out_dir: Path, direction: str, kind: int, is_ring: bool,
               ns=BENCH_NS, kernels=None) -> list[dict]:
    from rtckern import tuning
    from rtckern.ops._softmax import candidates as cands, geometry, ring
    from rtckern.ops._softmax.configs import KEY_FIELDS, RING_KEY_FIELDS, table
    from rtckern.ops._softmax.tune import tune_problem

    tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    name = table(direction, kind, is_ring)
    tuner = tuning.get_tuner(name)
    op = {(geometry.FWD, geometry.PLAIN): "softmax", (geometry.FWD, geometry.MASKED): "scaled_masked_softmax",
          (geometry.FWD, geometry.CAUSAL): "scaled_aligned_causal_masked_softmax",
          (geometry.BWD, geometry.PLAIN): "softmax_backward",
          (geometry.BWD, geometry.CAUSAL): "scaled_aligned_causal_masked_softmax_backward"}[(direction, kind)]
    report, rows = [], []
    for dt in dtypes:
        for n in ns:
            vec = ring.vec(dt) if is_ring else geometry.vector_width(dt, n)
            req = cands.request(op, dt, n, vec, dev)
            configs = tuner.configs(req)
            now = None
            if kernels is not None:
                from rtckern.ops._softmax.configs import config_dict, tuned_onepass

                now = tuned_onepass(direction, dt, n, vec, dev, kind)[0]
                keep = [c for c in configs if c.get("kernel") in kernels]
                if now is not None and config_dict(now) not in keep:
                    keep.append(config_dict(now))
                configs = keep
            tag = f"{name} {dt} n={n}"
            if not configs:
                log(f"  tune {tag}: no config holds the row")
                continue
            bad = []
            for cfg in configs:  # correctness of every config before it may win
                try:
                    err = check_config(torch, tdt[dt], direction, kind, dt, n, vec, cfg, is_ring, req)
                except Exception as e:  # a config that cannot load or launch is out, with its reason
                    err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                if not (isinstance(err, float) and err < (1e-5 if dt == "fp32" else 1.5e-2)):
                    bad.append((cfg, err))
            if bad:
                log(f"  tune {tag}: configs failing the reference check: {bad}")
            good = [c for c in configs if c not in [b[0] for b in bad]]
            if not good:
                report.append({"table": name, "dtype": dt, "n": n, "failed_check": [{"config": c, "err": e}
                                                                                    for c, e in bad]})
                continue
            orig = tuner.configs
            tuner.configs = lambda r: good
            try:
                row, trials = tuning.tune_request(tuner, req)
            except Exception as e:  # recorded and reported; the other shapes still run
                log(f"  tune {tag}: FAILED {type(e).__name__}: {e}")
                report.append({"table": name, "dtype": dt, "n": n, "error": str(e)[:500]})
                continue
            finally:
                tuner.configs = orig
            geom, mask_rows = tune_problem(direction, kind, n, dev)
            nbytes = problem_bytes(direction, kind, geom, geometry.ELEM_BYTES[dt], mask_rows)
            best = min((t for t in trials if t.seconds), key=lambda t: t.seconds)
            log(f"  tune {tag}: best {dict(best.config)} {best.seconds * 1e6:.1f} us "
                f"({nbytes / best.seconds / 1e9:.0f} GB/s) of {len(trials)}")
            if now is not None and dict(row.config) == config_dict(now):
                # a partial re-tune whose winner is the shipped config keeps the shipped row: its time is what
                # the ring kernel's table is compared with (the ring was not re-timed here)
                log(f"  tune {tag}: the shipped config won; its row is kept")
            else:
                rows.append(row)
            report.append({"table": name, "kernel": "ring" if is_ring else "onepass", "direction": direction,
                           "kind": kind, "dtype": dt, "n": n, "vec": vec, "best": dict(row.config),
                           "trials": [{"config": dict(t.config),
                                       "us": round(t.seconds * 1e6, 2) if t.seconds else None,
                                       "gbps": round(nbytes / t.seconds / 1e9, 1) if t.seconds else None,
                                       "error": t.error} for t in trials],
                           "failed_check": [{"config": c, "err": e} for c, e in bad]})
    if rows:
        for d in (out_dir, tuning.user_dir()):
            tuning.merge_rows(name, RING_KEY_FIELDS if is_ring else KEY_FIELDS, rows, Path(d) / f"{name}.json")
    return report


def problem_bytes(direction: str, kind: int, geom, elem: int, mask_rows: int) -> int:
    """Bytes of a tuning problem, counted as the benchmark counts them (causal: kept keys read, all written)."""
    from rtckern.ops._softmax import geometry
    from rtckern.ops._softmax.ring import kernel_kind

    k = kernel_kind(direction, kind)
    kept = sum(geom.valid_keys(r, geometry.CAUSAL) for r in range(geom.sq)) * (geom.rows // geom.sq) \
        if k == geometry.CAUSAL else geom.rows * geom.n
    reads = kept * elem * (1 if direction == geometry.FWD else 2)
    return reads + geom.rows * geom.n * elem + mask_rows * geom.n


def check_config(torch, tdtype, direction, kind, dt, n, vec, config, is_ring, req) -> float:
    """Relative error of one config against float64 on the kind's problem (fresh random rows, NaN-poisoned output,
    enough rows for several tiles per block of the persistent ring kernel)."""
    from rtckern.ops._softmax import candidates as cands, geometry, ring
    from rtckern.ops._softmax.tune import _Buffers

    k = ring.kernel_kind(direction, kind)
    rows = min(3 * req.device.sm_count * 8, (1 << 23) // n) + 3
    sq = 1
    if k == geometry.MASKED:
        sq = 64
        rows = max(sq, rows - rows % sq)
        geom = geometry.RowGeometry(rows=rows, n=n, sq=sq, heads=rows // sq, mask_batch_stride=0)
    elif k == geometry.CAUSAL:
        sq = min(n, 256)
        rows = max(sq, rows - rows % sq)
        geom = geometry.RowGeometry(rows=rows, n=n, sq=sq, diag_offset=n - sq)
    else:
        geom = geometry.RowGeometry(rows=rows, n=n)
    x = torch.randn(rows, n, device="cuda", dtype=tdtype) * 3
    keep = torch.ones(rows, n, dtype=torch.bool, device="cuda")
    mask = None
    if k == geometry.MASKED:
        mask = torch.rand(sq, n, device="cuda") < 0.3
        keep = ~mask.repeat(rows // sq, 1)
    elif k == geometry.CAUSAL:
        valid = torch.tensor([geom.valid_keys(r, geometry.CAUSAL) for r in range(sq)], device="cuda").repeat(rows // sq)
        keep = torch.arange(n, device="cuda")[None, :] < valid[:, None]
    out = torch.full_like(x, float("nan"))
    ref_y = torch.nan_to_num(torch.softmax((x.double() * 0.5).masked_fill(~keep, float("-inf")), -1), nan=0.0)
    if direction == geometry.FWD:
        arrays = [x, out]
        ref = ref_y
    else:
        y = ref_y.to(tdtype)
        dy = torch.randn_like(y)
        arrays = [y, dy, out]
        y64, dy64 = y.double(), dy.double()
        ref = 0.5 * y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True))
    bufs = _Buffers(arrays, [a.data_ptr() for a in arrays], mask)
    stream = torch.cuda.current_stream().cuda_stream
    if is_ring:
        from rtckern.ops._softmax.tune import ring_launcher

        launch, _ = ring_launcher(direction, kind, ring.Ring(**config), req, geom, bufs)
        launch(stream)
    else:
        cfg = geometry.OnePass(**config)
        kernel = cands.onepass_kernel(direction, kind, dt, vec, cfg, req)
        ptrs = (bufs.ptrs[0], bufs.ptrs[1], bufs.mask) if direction == geometry.FWD else tuple(bufs.ptrs)
        cands.launch_onepass(kernel, direction, cfg, dt, vec, ptrs, geom, _f32(0.5), stream, kind)
    torch.cuda.synchronize()
    if torch.isnan(out).any():
        return float("inf")
    return (torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)).item()


def _f32(v):
    import numpy as np

    return np.float32(v)


# ---- the ops' problems -------------------------------------------------------------------------------------------
def problem(torch, op: str, n: int, dtype):
    """(x, extra, bytes_fwd, bytes_bwd, shape text) for op at row length n, or None where the op cannot form
    2^27 elements (square causal beyond 8192)."""
    m = ELEMENTS // n
    e = torch.finfo(dtype).bits // 8
    if op == "softmax":
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        return x, None, 2 * m * n * e, 3 * m * n * e, f"{m}x{n}"
    if op == "scaled_masked_softmax":
        sq = min(n, 1024)
        b = 2
        h = m // (b * sq)
        x = torch.randn(b, h, sq, n, device="cuda", dtype=dtype)
        mask = torch.rand(b, 1, sq, n, device="cuda") < 0.2
        return x, mask, 2 * m * n * e + mask.numel(), 3 * m * n * e, f"{b}x{h}x{sq}x{n}, mask {b}x1x{sq}x{n}"
    if op == "scaled_upper_triang_masked_softmax":
        if n * n > ELEMENTS:
            return None
        bh = ELEMENTS // (n * n)
        x = torch.randn(bh, n, n, device="cuda", dtype=dtype)
        valid = bh * n * (n + 1) // 2
        return x, None, (valid + m * n) * e, (2 * valid + m * n) * e, f"{bh}x{n}x{n}"
    if op == "scaled_aligned_causal_masked_softmax":
        sq = min(n, m)
        b = m // sq
        x = torch.randn(b, sq, n, device="cuda", dtype=dtype)
        off = n - sq
        valid = b * sum(min(n, q + 1 + off) for q in range(sq))
        return x, None, (valid + m * n) * e, (2 * valid + m * n) * e, f"{b}x{sq}x{n}"
    raise ValueError(op)


def torch_forward(torch, op: str, x, extra, scale: float):
    """The eager expression of op (the one torch.compile is given too)."""
    if op == "softmax":
        return lambda x, extra: torch.softmax(x * scale, dim=-1)
    if op == "scaled_masked_softmax":
        return lambda x, mask: torch.softmax((x * scale).masked_fill(mask, float("-inf")), dim=-1)

    def causal(x, extra):
        sq, sk = x.shape[-2], x.shape[-1]
        q = torch.arange(sq, device=x.device)[:, None]
        k = torch.arange(sk, device=x.device)[None, :]
        return torch.softmax((x * scale).masked_fill(k > q + (sk - sq), float("-inf")), dim=-1)

    return causal


def rtk_forward(sm, op: str):
    if op == "scaled_masked_softmax":
        return lambda x, mask: sm.scaled_masked_softmax(x, mask, SCALE)
    f = getattr(sm, op)
    return lambda x, extra: f(x, SCALE)


def bench(torch, dev, dtypes, compile_mode: str, copy_ref: dict, ns=BENCH_NS) -> list[dict]:
    results = []
    for op in FWD_OPS:
        for dt_name in dtypes:
            if op != "softmax" and dt_name != "bf16":
                continue
            for n in ns:
                try:
                    r = bench_one(torch, op, dt_name, n, compile_mode, copy_ref)
                except Exception as e:  # recorded; the other problems still run
                    log(f"  {op} {dt_name} n={n}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                    r = {"op": op, "dtype": dt_name, "n": n, "error": f"{type(e).__name__}: {e}"[:1000]}
                if r is not None:
                    results.append(r)
                torch.cuda.empty_cache()
    return results


def _check_rows(torch, out, ref) -> float:
    """Relative error of a few rows of a benchmarked output against float64 (the numbers are of a correct op)."""
    if torch.isnan(out).any():
        return float("inf")
    return (torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)).item()


def bench_one(torch, op, dt_name, n, compile_mode, copy_ref) -> dict | None:
    from rtckern import ops as sm
    from rtckern.ops._softmax import candidates as cands, geometry

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dt_name]
    p = problem(torch, op, n, dtype)
    if p is None:
        return None
    x, extra, bytes_f, bytes_b, shape = p
    r = {"op": op, "dtype": dt_name, "n": n, "shape": shape, "bytes_fwd": bytes_f, "bytes_bwd": bytes_b}
    fwd = rtk_forward(sm, op)
    vec = geometry.vector_width(dt_name, n)
    sel = cands.selection(op, dt_name, n, vec, 0)
    r["impl_fwd"] = sel.name + " " + " ".join(s.name_expression for s in sel.specs)
    eager = torch_forward(torch, op, x, extra, SCALE)
    # Correctness of what is timed: the first rows of the flattened problem against float64.
    y = fwd(x, extra)
    x2, y2 = x.reshape(-1, n), y.reshape(-1, n)
    rows = min(8, x2.shape[0])
    if op == "softmax":
        ref = torch.softmax(x2[:rows].double() * SCALE, -1)
    else:
        ref = torch.nan_to_num(eager(x.double(), extra).reshape(-1, n)[:rows], nan=0.0)
    r["check_fwd_err"] = _check_rows(torch, y2[:rows], ref)
    r["rtk_fwd_ms"] = time_ms(torch, lambda: fwd(x, extra))
    r["eager_fwd_ms"] = time_ms(torch, lambda: eager(x, extra))
    if op == "softmax":
        r["eager_plain_fwd_ms"] = time_ms(torch, lambda: torch.softmax(x, dim=-1))
    wanted = compile_mode == "all" or (compile_mode == "plain" and op == "softmax" and dt_name == "bf16")
    if wanted and time.time() - T0 > COMPILE_DEADLINE[0]:
        r["compile_error"] = f"skipped: past the --compile-deadline of {COMPILE_DEADLINE[0]} s"
    elif wanted:
        try:
            t = time.perf_counter()
            cf = torch.compile(eager, dynamic=False)
            cf(x, extra)
            torch.cuda.synchronize()
            r["compile_s"] = round(time.perf_counter() - t, 1)
            r["compile_fwd_ms"] = time_ms(torch, lambda: cf(x, extra))
        except Exception as e:  # recorded: a missing baseline is reported, not hidden
            r["compile_error"] = str(e).splitlines()[0][:300]
    # backward
    dy = torch.randn_like(y)
    bop = op + "_backward"
    bwd = getattr(sm, bop)
    selb = cands.selection(bop, dt_name, n, vec, 0)
    r["impl_bwd"] = selb.name + " " + " ".join(s.name_expression for s in selb.specs)
    dx = bwd(y, dy, SCALE)
    y64, dy64 = y.reshape(-1, n)[:rows].double(), dy.reshape(-1, n)[:rows].double()
    r["check_bwd_err"] = _check_rows(torch, dx.reshape(-1, n)[:rows],
                                     SCALE * y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True)))
    del dx
    r["rtk_bwd_ms"] = time_ms(torch, lambda: bwd(y, dy, SCALE))
    r["eager_bwd_ms"] = time_ms(torch, lambda: torch._softmax_backward_data(dy, y, -1, y.dtype))
    if op == "softmax":  # the two-launch online path on the same problem, for comparison
        from rtckern import config

        with config.override(force_impl={op: f"{op}.online", bop: f"{bop}.online"}):
            r["online_fwd_ms"] = time_ms(torch, lambda: fwd(x, extra))
            r["online_bwd_ms"] = time_ms(torch, lambda: bwd(y, dy, SCALE))
        r["online_fwd_gbps"] = round(bytes_f / r["online_fwd_ms"] / 1e6, 1)
        r["online_bwd_gbps"] = round(bytes_b / r["online_bwd_ms"] / 1e6, 1)
    for k in ("rtk_fwd", "eager_fwd", "eager_plain_fwd", "compile_fwd"):
        if k + "_ms" in r:
            r[k + "_gbps"] = round(bytes_f / r[k + "_ms"] / 1e6, 1)
    for k in ("rtk_bwd", "eager_bwd"):
        r[k + "_gbps"] = round(bytes_b / r[k + "_ms"] / 1e6, 1)
    r["fwd_vs_copy"] = round(r["rtk_fwd_gbps"] / copy_ref[dt_name], 3)
    r["bwd_vs_copy"] = round(r["rtk_bwd_gbps"] / copy_ref[dt_name], 3)
    log(f"  {op} {dt_name} n={n}: fwd {r['rtk_fwd_gbps']} GB/s ({r['fwd_vs_copy']}x copy), eager "
        f"{r['eager_fwd_gbps']}, plain {r.get('eager_plain_fwd_gbps', '-')}, compile {r.get('compile_fwd_gbps', '-')}, "
        f"online {r.get('online_fwd_gbps', '-')}; bwd {r['rtk_bwd_gbps']} ({r['bwd_vs_copy']}x), eager "
        f"{r['eager_bwd_gbps']}, online {r.get('online_bwd_gbps', '-')}; err {r['check_fwd_err']:.1e}/"
        f"{r['check_bwd_err']:.1e}; {r['impl_fwd']} | {r['impl_bwd']}")
    return r


# ---- report ------------------------------------------------------------------------------------------------------
def geomean(v):
    v = [a for a in v if a]
    return math.exp(sum(math.log(a) for a in v) / len(v)) if v else None


def summary(results: list[dict]) -> dict:
    out = {}
    results = [r for r in results if "error" not in r]
    for op in FWD_OPS:
        for dt in ("bf16", "fp16", "fp32"):
            rs = [r for r in results if r["op"] == op and r["dtype"] == dt]
            if not rs:
                continue
            s = {"fwd_vs_copy_min": min(r["fwd_vs_copy"] for r in rs),
                 "bwd_vs_copy_min": min(r["bwd_vs_copy"] for r in rs),
                 "fwd_vs_eager_geomean": round(geomean([r["rtk_fwd_gbps"] / r["eager_fwd_gbps"] for r in rs]), 3)}
            if op == "softmax":
                s["fwd_vs_eager_plain_geomean"] = round(
                    geomean([r["rtk_fwd_gbps"] / r["eager_plain_fwd_gbps"] for r in rs]), 3)
            comp = [r["rtk_fwd_gbps"] / r["compile_fwd_gbps"] for r in rs if r.get("compile_fwd_gbps")]
            if comp:
                s["fwd_vs_compile_min"] = round(min(comp), 3)
                s["fwd_vs_compile_geomean"] = round(geomean(comp), 3)
            out[f"{op}/{dt}"] = s
    return out


def body(copy_ref: dict, results: list[dict], summ: dict, tune_report: list[dict]) -> list:
    out = [f"M x N = 2^27 elements, scale {SCALE}. Device-to-device copy of the same bytes: "
           + ", ".join(f"{k} {v:.0f} GB/s" for k, v in copy_ref.items()) + ".",
           "eager = torch expression (scale, mask as -inf, softmax); eager plain = torch.softmax(x) unscaled; "
           "compile = torch.compile of the eager expression; backward eager = torch._softmax_backward_data. "
           "Device time: each sample is queued behind a GPU sleep (host cost per call: op_overhead)."]
    rows = []
    for r in results:
        if "error" in r:
            rows.append((r["op"], r["dtype"], r["n"], f"FAILED: {r['error'][:120]}") + ("",) * 10)
            continue
        ce = r.get("compile_fwd_gbps")
        rows.append((r["op"], r["dtype"], r["n"], r["shape"], f"{r['rtk_fwd_gbps']:.0f}", f"{r['fwd_vs_copy']:.2f}",
                     f"{r['eager_fwd_gbps']:.0f}", r.get("eager_plain_fwd_gbps", "-"), ce if ce else "-",
                     f"{r['rtk_fwd_gbps'] / r['eager_fwd_gbps']:.2f}", f"{(r['rtk_fwd_gbps'] / ce) if ce else 0:.2f}",
                     f"{r['rtk_bwd_gbps']:.0f}", f"{r['bwd_vs_copy']:.2f}", f"{r['eager_bwd_gbps']:.0f}"))
    out.append(Table(("op", "dtype", "N", "shape", "fwd GB/s", "x copy", "eager", "eager plain", "compile", "x eager",
                      "x compile", "bwd GB/s", "x copy", "eager bwd"), rows))
    out.append("## Summary\n\n```\n" + json.dumps(summ, indent=1) + "\n```")
    if tune_report:
        fmt_one = lambda c: (f"{c['kernel']} {c['threads']}/{c['group']}/{c['items']}/"  # noqa: E731
                             f"{c['min_blocks']}")
        fmt_ring = lambda c: f"ring {c['warps']}/{c['group']}/{c['items']}/{c['rows']}/{c['slots']}"  # noqa: E731
        rows = []
        for t in tune_report:
            if "best" not in t:
                continue
            fmt = fmt_ring if t.get("kernel") == "ring" else fmt_one
            tried = "; ".join(f"{fmt(c['config'])}: {c['gbps']}" for c in t["trials"])
            rows.append((t["table"], t["dtype"], t["n"], fmt(t["best"]), tried))
        out.append(Table(("table", "dtype", "N", "best", "GB/s of each config tried"), rows,
                         title="Tuning: the best config per table (one-pass: kernel threads/group/items/min_blocks; "
                               "ring: warps/group/items/rows/slots) and the GB/s of every config tried"))
    impls = sorted({(r["op"], r["dtype"], r["n"], r["impl_fwd"], r["impl_bwd"]) for r in results if "error" not in r})
    if impls:
        out.append("## Kernels used\n\n" + "\n".join(f"- {o} {d} N={n}: {f}; backward {b}" for o, d, n, f, b in impls))
    return out


def plot(plt, meta: dict, results: list[dict], copy_ref: dict):
    results = [r for r in results if "error" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, d in zip(axes, ("fwd", "bwd")):
        for op, style in zip(FWD_OPS, ("o-", "s-", "^-", "v-")):
            rs = [r for r in results if r["op"] == op and r["dtype"] == "bf16"]
            if rs:
                ax.plot([r["n"] for r in rs], [r[f"rtk_{d}_gbps"] for r in rs], style, label=f"rtckern {op}")
        rs = [r for r in results if r["op"] == "softmax" and r["dtype"] == "bf16"]
        ax.plot([r["n"] for r in rs], [r[f"eager_{d}_gbps"] for r in rs], "x--", label="torch eager (scaled softmax)"
                if d == "fwd" else "torch eager backward")
        if d == "fwd":
            ax.plot([r["n"] for r in rs], [r.get("eager_plain_fwd_gbps") for r in rs], "+--",
                    label="torch eager softmax(x)")
            cr = [r for r in rs if r.get("compile_fwd_gbps")]
            if cr:
                ax.plot([r["n"] for r in cr], [r["compile_fwd_gbps"] for r in cr], "d:", label="torch.compile (scaled)")
        ax.axhline(copy_ref["bf16"], color="k", lw=1, label="device copy")
        ax.axhline(copy_ref["bf16"] * (0.9 if d == "fwd" else 0.85), color="k", ls=":", lw=1,
                   label=f"{0.9 if d == 'fwd' else 0.85:.2f} x copy (target)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (keys per row), M x N = 2^27, bf16")
        ax.set_title("forward" if d == "fwd" else "backward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("GB/s")
    fig.suptitle(f"softmax ops, bf16, M x N = 2^27, on {gpu_name(meta)} ({meta.get('date')})")
    fig.tight_layout()
    return fig


QUICK = "bf16 at N = 4096 only (every op, forward and backward)"


def add_args(ap) -> None:
    ap.add_argument("--prefill", action="store_true", help="compile every kernel of the GPU tests and the benchmark "
                    "first, in parallel")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-ring", action="store_true", help="only the ring kernel's sweep (sm_90+)")
    ap.add_argument("--bench", action=argparse.BooleanOptionalAction, default=True,
                    help="time the ops (the result set; on by default)")
    ap.add_argument("--tune-dirs", default="fwd,bwd", help="--tune: only these directions")
    ap.add_argument("--tune-kinds", help="--tune: only these mask kinds (plain, masked, causal; comma-separated)")
    ap.add_argument("--tune-no-ring", action="store_true", help="--tune: the one-pass tables only")
    ap.add_argument("--tune-ns", help="--tune: only these row lengths (comma-separated; default the benchmark's)")
    ap.add_argument("--tune-kernels", help="--tune: only these one-pass kernels' configs (regs, async, l2), plus "
                    "the config the tables give now")
    ap.add_argument("--compile", default="plain", choices=("all", "plain", "none"))
    ap.add_argument("--dtypes", default=None, help="comma list (default bf16,fp16,fp32)")
    ap.add_argument("--compile-deadline", type=float, default=1e9,
                    help="seconds after start past which torch.compile baselines are skipped")
    ap.add_argument("--ceilings", action="store_true", help="also the traffic ceilings: bandwidth by traffic mix and "
                    "the causal problems' traffic without arithmetic")
    ap.add_argument("--hints", action="store_true", help="also the cache-hint variants of the selected kernels")
    ap.add_argument("--hints-ns", default="1024,4096,8192,16384,65536", help="--hints: row lengths")
    ap.add_argument("--hints-dtype", default="bf16", help="--hints: dtype")
    ap.add_argument("--hints-rounds", type=int, default=3, help="--hints: rounds over the variants (median)")


def run(args) -> Result | None:
    COMPILE_DEADLINE[0] = args.compile_deadline
    dtypes = (args.dtypes or ("bf16" if args.quick else "bf16,fp16,fp32")).split(",")

    import torch

    from benchmarks.env import environment
    from rtckern.device import DeviceInfo
    importlib.import_module("rtckern.ops")  # registers candidates and tuners

    torch.cuda.init()
    dev = DeviceInfo.from_device(0)
    log("device:", dev.describe())
    out_dir = args.out
    payload: dict = {}
    if args.prefill:
        payload["prefill"] = prefill(dev, dtypes)
    tune_report = []
    if args.tune:
        tune_report = tune(torch, dev, dtypes, out_dir, rings=not args.tune_no_ring,
                           directions=tuple(args.tune_dirs.split(",")),
                           ns=tuple(int(v) for v in args.tune_ns.split(",")) if args.tune_ns else None,
                           kinds=tuple({"plain": 0, "masked": 1, "causal": 2}[k] for k in args.tune_kinds.split(","))
                           if args.tune_kinds else None,
                           kernels=tuple(args.tune_kernels.split(",")) if args.tune_kernels else None)
        payload["tuning"] = tune_report
    elif args.tune_ring:
        tune_report = tune(torch, dev, dtypes, out_dir, one_pass=False)
        payload["tuning"] = tune_report
    elif (out_dir / "softmax_tuning.json").is_file():  # an earlier --tune run into this folder
        earlier = json.loads((out_dir / "softmax_tuning.json").read_text())
        tune_report = earlier.get("tuning", [])
        payload["tuning"] = tune_report
        payload.setdefault("prefill", earlier.get("prefill"))
    if not (args.bench or args.ceilings or args.hints):
        (out_dir / "softmax_tuning.json").write_text(json.dumps({"env": environment(), **payload}, indent=1,
                                                                default=str) + "\n")
        return None
    results = []
    if args.bench:
        copy_ref = {dt: copy_gbps(torch, ELEMENTS, {"fp32": torch.float32, "fp16": torch.float16,
                                                    "bf16": torch.bfloat16}[dt]) for dt in dtypes}
        copy_ref_4g = copy_gbps(torch, 1 << 31, torch.bfloat16)
        torch.cuda.empty_cache()  # the problems get fresh allocations, not pieces of the 4 GiB copy's (docs/performance.md)
        log("copy GB/s:", {k: round(v) for k, v in copy_ref.items()}, "4 GiB bf16:", round(copy_ref_4g))
        results = bench(torch, dev, dtypes, args.compile, copy_ref, ns=(4096,) if args.quick else BENCH_NS)
        summ = summary(results)
        payload.update({"copy_gbps": copy_ref, "copy_gbps_4gib": copy_ref_4g, "elements": ELEMENTS, "scale": SCALE,
                        "summary": summ})
        log("summary:", json.dumps(summ))
    if args.ceilings:
        from benchmarks import _softmax_ceilings as ceil

        torch.cuda.empty_cache()
        payload["ceilings"] = ceil.ceilings(torch, log)
    if args.hints:
        from benchmarks import _softmax_hints as hints

        torch.cuda.empty_cache()
        payload["hints"] = hints.hints(dev, [int(v) for v in args.hints_ns.split(",")], args.hints_dtype,
                                       args.hints_rounds, log)
    return to_result(results, payload)


def to_result(results: list[dict], data: dict) -> Result:
    """The result set of the timed ops (where data has their copy bandwidths), ceilings and hints (where data has
    them)."""
    out = Result("Softmax benchmark", rows=results, data=data)
    if "copy_gbps" in data:
        out.body = body(data["copy_gbps"], results, data["summary"], data.get("tuning") or [])
        out.plot = lambda plt, meta: plot(plt, meta, results, data["copy_gbps"])
    if "ceilings" in data:
        from benchmarks import _softmax_ceilings as ceil

        out.body += ceil.tables(data["ceilings"])
    if "hints" in data:
        from benchmarks import _softmax_hints as hints

        out.body.append(hints.table(data["hints"]))
    return out


def render(payload: dict) -> Result:
    """The result set of a stored JSON (one written before the runner too: {"env", "results", ...})."""
    if "meta" not in payload:
        data = {k: v for k, v in payload.items() if k not in ("env", "results")}
        result = to_result(payload["results"], data)
        result.meta = legacy_meta(payload["env"], gpu_used=True)
        return result
    return to_result(payload["rows"], stored_data(payload))
