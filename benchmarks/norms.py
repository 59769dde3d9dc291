"""RMSNorm / LayerNorm benchmark (issue 4): GB/s of rtckern's kernels against a device-to-device copy, torch
eager and torch.compile, M x N = 2^27 elements, N in {1024, 4096, 5120, 8192, 12288, 16384, 65536}.

    python3 benchmarks/norms.py sweep  --out DIR   # every launch config of every kernel kind; best per shape
    python3 benchmarks/norms.py bench  --out DIR   # the public ops (registry's choice) vs copy/eager/compile
    python3 benchmarks/norms.py all    --out DIR   # both
    python3 benchmarks/norms.py compile-times      # cold NVRTC compile of every kernel variant (no GPU)
    python3 benchmarks/norms.py sweep --kinds l2   # only l2 configs, plus the shipped (tabled) config of every
                                                   # kind, re-timed in the same run for the kind choice; l2 / l2c
                                                   # configs also with the L2 policies (--no-l2-policy: without)
    python3 benchmarks/norms.py sweep --kinds l2c  # the cluster-split l2 backward (sm_90+), same re-timing
    python3 benchmarks/norms.py sweep --kinds stage --dirs bwd   # the cp.async-staged backward, same re-timing
    python3 benchmarks/norms.py tables --sweep OLD.json.gz --sweep NEW.json   # later sweeps win per kind/shape
    python3 benchmarks/norms.py tables --sweep NEW.json --merge   # only the shapes NEW timed change

Bytes: forward reads x (+ weight, bias) and writes y; backward reads x, dy (+ weight) and writes dx (+ dweight,
dbias). Timing: CUDA events around `inner` back-to-back calls queued behind a GPU sleep (so the host's launch
cost stays out), warm-up first, median of `reps`; 2^27-element tensors are far larger than the 60 MB L2.
Results: DIR/norms_sweep.json, DIR/norms_bench.json, DIR/norms_bench.md, DIR/norms_bench.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rtckern.arch import Arch  # noqa: E402
from rtckern.device import DeviceInfo  # noqa: E402
from rtckern.ops import _norms_kernels as K  # noqa: E402
from rtckern.ops import _norms_launch as L  # noqa: E402

TOTAL = 1 << 27
NS = (1024, 4096, 5120, 8192, 12288, 16384, 65536)
DTYPES = ("bf16", "fp16", "fp32")
OPS = ("rms", "layer")
EPS = 1e-5


# ---- configs swept ----------------------------------------------------------------------------------------------
# OPT bits swept per kernel kind (1 persistent/prefetch, 2 default-cached loads, 4 re-convert after reduce).
OPTS = {("fwd", "rows"): (0, 2, 1, 5), ("bwd", "rows"): (1, 5, 0),
        ("fwd", "cluster"): (0, 2, 5), ("bwd", "cluster"): (1, 5, 0)}


def rows_configs(n: int, vec: int, opts=(0, 1)) -> list[K.RowsConfig]:
    packs = n // vec
    out = []
    for nv in (1, 2, 3, 4, 5, 6, 8):
        if packs % nv:
            continue
        tpr = packs // nv
        for opt in opts:
            if tpr <= 32 and tpr & (tpr - 1) == 0:
                out += [K.RowsConfig(tpr, max(1, 128 // tpr), opt), K.RowsConfig(tpr, max(1, 256 // tpr), opt)]
            elif tpr % 32 == 0 and tpr <= 1024:
                out.append(K.RowsConfig(tpr, 1, opt))
    c = K.rows_config(n, vec)
    out += [K.RowsConfig(c.tpr, c.rpb, opt) for opt in opts]
    return list(dict.fromkeys(out))


def split_configs(n: int, vec: int, itemsize: int, cap: int, lo: int, hi: int, opts=(0, 1)) -> list[K.SplitConfig]:
    out = []
    for parts in (2, 4, 8):
        if parts > cap:
            continue
        for threads in (128, 256, 512):
            b = K.packs_per_thread(n, vec, threads, parts) * vec * itemsize
            if lo <= b <= hi and K.slice_cols(n, vec, parts) * (parts - 1) < n:
                out += [K.SplitConfig(threads, parts, opt) for opt in opts]
    return out


def affine_configs(p) -> list[K.SplitConfig]:
    """Persistent cluster forward with the weight / bias slice in shared memory (OPT 512 with persist, raw x
    re-converted after the reduction, default-cached or streaming loads; with and without OPT 1024, the next
    row's statistics and cluster barrier before this row's write): 256-1024 threads, 2-8 blocks per row.
    (Capped at 64 registers, two to four blocks per SM with the weight and bias read a pack at a time, they ran
    8-25% slower: docs/performance.md, Norms.)"""
    out = []
    for parts in (2, 4, 8):
        for threads in (256, 512, 1024):
            base = K.PERSIST | 4 | K.SMEM_AFFINE
            for opt in (base, base | 2, base | K.PIPE_STATS, base | 2 | K.PIPE_STATS):
                cfg = K.SplitConfig(threads, parts, opt)
                if 16 <= K.fwd_thread_bytes(p, "cluster", cfg) and L.fwd_feasible(p, "cluster", cfg) is None:
                    out.append(cfg)
    return out


def l2_configs(p, backward: bool, sm90: bool = False) -> list[K.L2Config]:
    """Threads per block x min blocks per SM (forward: x default-cached pass 2; rows of 32 KB and more: x the
    largest shared-memory stash that lets 1-4 blocks share an SM; on sm_90, also each row split over a cluster of
    2 or 4 blocks, with and without a stash)."""
    out = []
    for threads in (128, 256, 512, 1024):
        # minb 4 / 8 for 128-256 threads: a 64 / 32-register cap, more blocks (loads in flight) per SM
        for minb in (1, 2, 4, 8):
            if minb * threads > 2048 or (minb == 2 and threads < 512) or (backward and threads == 128) or \
                    (minb > 2 and (backward or threads > 256)):
                continue
            for opt in ((1, 0) if backward else (0, 2)):
                cfg = K.L2Config(threads, minb, opt)
                feas = L.bwd_feasible if backward else L.fwd_feasible
                if feas(p, "l2", cfg) is None and (p.n // p.vec) >= threads // 2:
                    out.append(cfg)
    if not backward and p.n * K.ITEMSIZE[p.x] >= 32768:
        out += l2_stash_configs(p)
        if sm90:
            out += l2_split_configs(p)
    if L2_POLICY_VARIANTS:  # sm_80+: each config (default-cached pass 2 aside) also with the L2 access policies
        out += [dataclasses.replace(c, opt=c.opt | K.L2_POLICY) for c in out if not c.opt & 2]
    return out


# `sweep --l2-policy` (the default): the l2 configs also with OPT L2_POLICY (pass 1 evict_last, pass 2 evict_first).
L2_POLICY_VARIANTS = True


def l2_split_configs(p) -> list[K.L2Config]:
    """Forward l2 with the row split over clusters of 2 / 4 blocks: 256-1024 threads, plain (minb 1 / 2, both
    pass-2 cache policies) and with the largest stash that fits 1-3 blocks per SM."""
    out = {}
    pack = p.vec * K.ITEMSIZE[p.x]
    for parts in (2, 4):
        for threads in (256, 512, 1024):
            if K.slice_cols(p.n, p.vec, parts) // p.vec < threads // 2:
                continue
            for minb in (1, 2):
                if minb * threads <= 2048:
                    for opt in (0, 2):
                        out[(parts, threads, minb, opt, 0)] = K.L2Config(threads, minb, opt, 0, parts)
            nv = K.packs_per_thread(p.n, p.vec, threads, parts)
            for blocks in (1, 2, 3):
                if blocks * threads > 2048:
                    continue
                fit = (SMEM_PER_SM // blocks - 1024 - K.FWD_L2_STATIC_SMEM) // (threads * pack)
                stash = min(nv, fit)
                per_block = stash * threads * pack + 1024 + K.FWD_L2_STATIC_SMEM
                minb = min(SMEM_PER_SM // per_block, 2048 // threads, 4)
                cfg = K.L2Config(threads, minb, 0, stash, parts)
                if stash >= 1:
                    out[(parts, threads, minb, 0, stash)] = cfg
    return [c for c in out.values() if L.fwd_feasible(p, "l2", c) is None]


SMEM_PER_SM = 228 * 1024  # H100 / H200; 1 KB of it is reserved per block


def l2_stash_configs(p) -> list[K.L2Config]:
    """Forward l2 with a stash: for 256-1024 threads and 1-4 blocks per SM, the largest stash that fits (and one
    pack less, which leaves room for an extra block's worth of L2 re-read); minb = the blocks per SM the stash
    allows (the register cap that matches)."""
    out = {}
    pack = p.vec * K.ITEMSIZE[p.x]
    for threads in (256, 512, 1024):
        nv = K.packs_per_thread(p.n, p.vec, threads)
        for blocks in (1, 2, 3, 4):
            if blocks * threads > 2048:
                continue
            fit = (SMEM_PER_SM // blocks - 1024 - K.FWD_L2_STATIC_SMEM) // (threads * pack)
            for stash in (min(nv, fit), min(nv, fit) - 1):
                per_block = stash * threads * pack + 1024 + K.FWD_L2_STATIC_SMEM
                minb = min(SMEM_PER_SM // per_block, 2048 // threads, 4)
                cfg = K.L2Config(threads, minb, 0, stash)
                if stash >= 1 and L.fwd_feasible(p, "l2", cfg) is None:
                    out[(threads, stash)] = cfg
    return list(out.values())


def stage_configs(p) -> list[K.StageConfig]:
    """Staged backward: threads per block (4 to 32 columns per thread) x rows in flight that fit 227 KB."""
    out = []
    for threads in (128, 160, 256, 320, 384, 512, 640, 768, 1024):  # 160 / 320 / 640: N = 5120 in whole packs
        cols = K.packs_per_thread(p.n, p.vec, threads) * p.vec
        if not 4 <= cols <= K.BWD_STAGE_MAX_THREAD_COLS or (p.n // p.vec) < threads // 2:
            continue
        for depth in (2, 3, 4, 6):
            cfg = K.StageConfig(threads, depth)
            if L.bwd_feasible(p, "stage", cfg) is None:
                out.append(cfg)
    return out


# Weight per row from L1 (8), two / four rows per iteration (32 / 128), column sums in shared memory (64); OPT 2
# and 16 (64-register cap) lost in earlier sweeps (docs/performance.md).
L2C_OPTS = (0, 8, 32, 40, 96, 128, 192)
# With `sweep --l2-policy`, these also with the L2 access policies (OPT 256).
L2C_POLICY_OPTS = (0, 32, 96)


def l2c_configs(p) -> list[K.SplitConfig]:
    """Cluster size (16: non-portable) x threads per block x OPT, 4 to 32 columns per thread."""
    out = []
    for parts in (2, 4, 8, 16):
        for threads in (128, 256, 512):
            cols = K.packs_per_thread(p.n, p.vec, threads, parts) * p.vec
            if not 4 <= cols <= K.BWD_L2C_MAX_THREAD_COLS:
                continue
            for opt in L2C_OPTS + (tuple(o | K.L2_POLICY for o in L2C_POLICY_OPTS) if L2_POLICY_VARIANTS else ()):
                cfg = K.SplitConfig(threads, parts, opt)
                if L.bwd_feasible(p, "l2c", cfg) is None and K.slice_cols(p.n, p.vec, parts) // p.vec >= threads // 2:
                    out.append(cfg)
    return out


def fwd_problem(op: str, dtype: str, n: int) -> K.FwdProblem:
    return K.FwdProblem(layer=op == "layer", n=n, x=dtype, y=dtype, w=dtype, bias=op == "layer",
                        vec=16 // K.ITEMSIZE[dtype])


def bwd_problem(op: str, dtype: str, n: int) -> K.BwdProblem:
    return K.BwdProblem(layer=op == "layer", n=n, x=dtype, dy=dtype, dx=dtype, w=dtype, weight_grad=True,
                        bias_grad=op == "layer", vec=16 // K.ITEMSIZE[dtype])


def sweep_plan(sm90: bool, kinds: tuple[str, ...] | None = None, dirs: tuple[str, ...] = ("fwd", "bwd"),
               ns: tuple[int, ...] = NS) -> list[tuple]:
    """(direction, op, dtype, n, kind, cfg) for every config to time. With `kinds`, only those kinds' configs
    (rows of at least 8 KB), plus the config the shipped tables give each other kind, longest rows first.
    `dirs`, `ns`: only those directions and row lengths."""
    if kinds is not None:
        plan = _kinds_plan(sm90, kinds)
    else:
        plan = _full_plan(sm90)
    return [it for it in plan if it[0] in dirs and it[3] in ns]


def _full_plan(sm90: bool) -> list[tuple]:
    plan = []
    for dtype in DTYPES:
        isz = K.ITEMSIZE[dtype]
        for n in NS:
            for op in OPS:
                fp, bp = fwd_problem(op, dtype, n), bwd_problem(op, dtype, n)
                for cfg in l2_configs(fp, False, sm90):
                    plan.append(("fwd", op, dtype, n, "l2", cfg))
                for cfg in l2_configs(bp, True):
                    plan.append(("bwd", op, dtype, n, "l2", cfg))
                for cfg in rows_configs(n, fp.vec, OPTS[("fwd", "rows")]):
                    if L.fwd_feasible(fp, "rows", cfg) is None:
                        plan.append(("fwd", op, dtype, n, "rows", cfg))
                for cfg in rows_configs(n, fp.vec, OPTS[("bwd", "rows")]):
                    if L.bwd_feasible(bp, "rows", cfg) is None:
                        plan.append(("bwd", op, dtype, n, "rows", cfg))
                if sm90 and n * isz >= 16384:
                    for cfg in split_configs(n, fp.vec, isz, 8, 16, 128, OPTS[("fwd", "cluster")]):
                        if L.fwd_feasible(fp, "cluster", cfg) is None:
                            plan.append(("fwd", op, dtype, n, "cluster", cfg))
                    plan += [("fwd", op, dtype, n, "cluster", cfg) for cfg in affine_configs(fp)]
                if sm90 and n * isz >= 16384:
                    for cfg in l2c_configs(bp):
                        plan.append(("bwd", op, dtype, n, "l2c", cfg))
                if n * isz >= 8192:
                    for cfg in stage_configs(bp):
                        plan.append(("bwd", op, dtype, n, "stage", cfg))
                if sm90 and n * isz >= 8192:
                    for cfg in split_configs(n, fp.vec, 1, 8, 4, K.BWD_MAX_THREAD_ELEMS, OPTS[("bwd", "cluster")]):
                        if L.bwd_feasible(bp, "cluster", cfg) is None:
                            plan.append(("bwd", op, dtype, n, "cluster", cfg))
                if n == 65536:
                    c = L.fwd_heuristic(fp, "coop")
                    if c is not None:
                        plan.append(("fwd", op, dtype, n, "coop", c))
                    c = L.bwd_heuristic(bp, "coop")
                    if c is not None:
                        plan.append(("bwd", op, dtype, n, "coop", c))
    return plan


def _kinds_plan(sm90: bool, kinds: tuple[str, ...]) -> list[tuple]:
    dev = DeviceInfo.for_arch("sm_90" if sm90 else "sm_80", sm_count=132)
    plan = []
    full = [it for it in _full_plan(sm90) if it[4] in kinds]
    for n in sorted(NS, reverse=True):
        for dtype in DTYPES:
            if n * K.ITEMSIZE[dtype] < 8192:
                continue
            for op in OPS:
                plan += [it for it in full if it[1:4] == (op, dtype, n)]
                for d, prob, cfg_of in (("fwd", fwd_problem(op, dtype, n), L.fwd_config),
                                        ("bwd", bwd_problem(op, dtype, n), L.bwd_config)):
                    if d == "fwd" and all(k in K.BWD_ONLY_KINDS for k in kinds):
                        continue  # nothing swept in this direction to choose against
                    for kind in ("rows", "cluster", "l2", "l2c", "stage"):
                        if (kind in ("cluster", "l2c") and not sm90) or (d == "fwd" and kind in K.BWD_ONLY_KINDS):
                            continue
                        cfg = cfg_of(prob, kind, dev)  # the shipped config of every kind, the swept ones too
                        if cfg is not None and (d, op, dtype, n, kind, cfg) not in plan:
                            plan.append((d, op, dtype, n, kind, cfg))
    return plan


def specs_of(item, arch: Arch):
    d, op, dtype, n, kind, cfg = item
    if d == "fwd":
        return (L.fwd_spec(fwd_problem(op, dtype, n), kind, cfg, arch),)
    return L.bwd_specs(bwd_problem(op, dtype, n), kind, cfg, arch)


def _compile_one(spec):
    from rtckern.manager import get_manager

    t = time.perf_counter()
    try:
        get_manager().compile(spec)
        return spec.name_expression, (time.perf_counter() - t) * 1e3, ""
    except Exception as e:  # reported in the results, the sweep goes on
        return spec.name_expression, 0.0, str(e)[:300]


def prefill(specs, workers: int) -> dict:
    """Compile every spec into the disk cache in worker processes (before CUDA is initialized here)."""
    import multiprocessing as mp

    uniq = list(dict.fromkeys(specs))
    t = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as ex:
        res = list(ex.map(_compile_one, uniq, chunksize=4))
    errs = [r for r in res if r[2]]
    ms = sorted(r[1] for r in res if not r[2])
    print(f"prefill: {len(uniq)} kernels in {time.perf_counter() - t:.1f} s on {workers} processes; "
          f"compile ms median {statistics.median(ms) if ms else 0:.0f}, max {max(ms) if ms else 0:.0f}; "
          f"{len(errs)} failed", flush=True)
    for e in errs[:5]:
        print("  compile failed:", e[0], e[2].splitlines()[0] if e[2] else "", flush=True)
    return {"kernels": len(uniq), "median_ms": statistics.median(ms) if ms else None, "max_ms": max(ms) if ms else None,
            "failed": [(e[0], e[2]) for e in errs]}


# ---- timing -----------------------------------------------------------------------------------------------------
def timeit(fn, torch, reps: int = 15, inner: int = 4, warmup: int = 3) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        torch.cuda._sleep(1_000_000)  # keeps the GPU busy while the host queues the timed calls
        s.record()
        for _ in range(inner):
            fn()
        e.record()
        e.synchronize()
        samples.append(s.elapsed_time(e) / inner)
    return statistics.median(samples) / 1e3


def env_info(torch) -> dict:
    from rtckern.compiler import compiler_for
    from rtckern.runtime.driver import driver_version

    import rtckern

    p = torch.cuda.get_device_properties(0)
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "gpu": p.name, "sm_count": p.multi_processor_count, "capability": "%d.%d" % (p.major, p.minor),
            "driver_cuda": "%d.%d" % driver_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "rtckern": rtckern.__version__, "nvrtc": compiler_for(Arch(p.major, p.minor)).identity().split("|")[0],
            "python": platform.python_version(), "host": platform.node()}
    try:
        import subprocess

        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # no nvidia-smi: the CUDA driver version above still says which driver
        info["driver"] = f"unknown ({e})"
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


# ---- data -------------------------------------------------------------------------------------------------------
class Data:
    """Inputs for one (dtype, N): x, dy, weight, bias; outputs y, dx; fp32 row statistics of x."""

    def __init__(self, torch, dtype: str, n: int):
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        self.rows = TOTAL // n
        g = torch.Generator(device="cuda")
        g.manual_seed(n * 7 + len(dtype))
        self.x = (torch.randn(self.rows, n, device="cuda", generator=g) + 0.5).to(dt)
        self.dy = torch.randn(self.rows, n, device="cuda", generator=g).to(dt)
        self.w = (1 + 0.2 * torch.randn(n, device="cuda", generator=g)).to(dt)
        self.b = (0.1 * torch.randn(n, device="cuda", generator=g)).to(dt)
        self.y = torch.empty_like(self.x)
        self.dx = torch.empty_like(self.x)
        self.dw = torch.empty_like(self.w)
        self.db = torch.empty_like(self.b)
        xf = self.x.float()
        self.mean = xf.mean(-1)
        self.rstd = {"rms": torch.rsqrt((xf * xf).mean(-1) + EPS),
                     "layer": torch.rsqrt(((xf - self.mean[:, None]) ** 2).mean(-1) + EPS)}
        del xf
        self.ref_dw = {}

    def check_rows(self, torch):
        return torch.cat([torch.arange(0, 32), torch.arange(self.rows - 32, self.rows)]).cuda()

    def ref_fwd(self, torch, op: str, rows):
        x = self.x[rows].double()
        mean = x.mean(-1, keepdim=True) if op == "layer" else 0.0
        xc = x - mean
        var = (xc * xc).mean(-1, keepdim=True)
        y = xc * torch.rsqrt(var + EPS) * self.w.double()
        return y + self.b.double() if op == "layer" else y

    def ref_dx(self, torch, op: str, rows):
        x, dy = self.x[rows].double(), self.dy[rows].double()
        n = x.shape[-1]
        mean = self.mean[rows].double()[:, None] if op == "layer" else 0.0
        rstd = self.rstd[op][rows].double()[:, None]
        xh = (x - mean) * rstd
        g = dy * self.w.double()
        c1 = (g * xh).sum(-1, keepdim=True) / n
        c0 = g.sum(-1, keepdim=True) / n if op == "layer" else 0.0
        return rstd * (g - xh * c1 - c0)

    def reference_dw(self, torch, op: str):
        if op not in self.ref_dw:
            acc = torch.zeros(self.x.shape[1], dtype=torch.float64, device="cuda")
            accb = torch.zeros_like(acc)
            step = max(1, (1 << 24) // self.x.shape[1])
            for r0 in range(0, self.rows, step):
                x = self.x[r0:r0 + step].double()
                dy = self.dy[r0:r0 + step].double()
                mean = self.mean[r0:r0 + step].double()[:, None] if op == "layer" else 0.0
                acc += (dy * (x - mean) * self.rstd[op][r0:r0 + step].double()[:, None]).sum(0)
                accb += dy.sum(0)
            self.ref_dw[op] = (acc, accb)
        return self.ref_dw[op]


def _rel(torch, out, ref) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return (torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)).item()


def _ptr(t) -> int:
    return t.data_ptr() if t is not None else 0


def run_item(torch, data: Data, item, kernels):
    """One launch of a swept config on `data`; returns the launch closure."""
    d, op, dtype, n, kind, cfg = item
    stream = torch.cuda.current_stream().cuda_stream

    def zeros_u32(count):
        t = torch.zeros(count, dtype=torch.int32, device="cuda")
        return t, t.data_ptr()

    def empty_f32(count):
        t = torch.empty(count, dtype=torch.float32, device="cuda")
        return t, t.data_ptr()

    if d == "fwd":
        p = fwd_problem(op, dtype, n)
        call = L.FwdCall(x=_ptr(data.x), residual=0, h=0, w=_ptr(data.w), b=_ptr(data.b) if op == "layer" else 0,
                         y=_ptr(data.y), mean=0, rstd=0, eps=EPS, rows=data.rows, sx=n, sr=0, sh=0, sy=n,
                         stream=stream, zeros_u32=zeros_u32, empty_f32=empty_f32)
        return lambda: L.launch_fwd(p, kind, cfg, kernels[0], call)
    p = bwd_problem(op, dtype, n)
    call = L.BwdCall(x=_ptr(data.x), w=_ptr(data.w), dy=_ptr(data.dy), dres=0,
                     mean=_ptr(data.mean) if op == "layer" else 0, rstd=_ptr(data.rstd[op]), dx=_ptr(data.dx),
                     dw=_ptr(data.dw), db=_ptr(data.db) if op == "layer" else 0, rows=data.rows, sx=n, sdy=n,
                     sdres=0, sdx=n, stream=stream, zeros_u32=zeros_u32, empty_f32=empty_f32)
    return lambda: L.launch_bwd(p, kind, cfg, kernels, call)


def check_item(torch, data: Data, item) -> float:
    """Largest relative error of the outputs of the last launch (subset rows for y / dx, all of dweight)."""
    d, op, dtype, n, kind, cfg = item
    rows = data.check_rows(torch)
    if d == "fwd":
        return _rel(torch, data.y[rows], data.ref_fwd(torch, op, rows))
    errs = [_rel(torch, data.dx[rows], data.ref_dx(torch, op, rows))]
    rw, rb = data.reference_dw(torch, op)
    errs.append(_rel(torch, data.dw, rw))
    if op == "layer":
        errs.append(_rel(torch, data.db, rb))
    return max(errs)


TOL = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1.5e-2}


def cmd_sweep(out: Path, torch, arch: Arch, budget_s: float, kinds=None, dirs=("fwd", "bwd"), ns=NS) -> dict:
    sm90 = arch.cc >= (9, 0)
    plan = sweep_plan(sm90, kinds, dirs, ns)
    t_start = time.perf_counter()
    results = []
    by_data: dict = {}
    for item in plan:
        by_data.setdefault((item[2], item[3]), []).append(item)
    for (dtype, n), items in by_data.items():
        if time.perf_counter() - t_start > budget_s:
            print(f"sweep: time budget spent; skipping {dtype} N={n}", flush=True)
            continue
        data = Data(torch, dtype, n)
        for item in items:
            d, op, _, _, kind, cfg = item
            row = {"dir": d, "op": op, "dtype": dtype, "n": n, "kind": kind, "config": L.cfg_to_json(cfg)}
            try:
                kernels = L.load(specs_of(item, arch), 0)
                fn = run_item(torch, data, item, kernels)
                data.y.fill_(float("nan"))
                data.dx.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                row["err"] = check_item(torch, data, item)
                sec = timeit(fn, torch, reps=10, inner=3)
                p = fwd_problem(op, dtype, n) if d == "fwd" else bwd_problem(op, dtype, n)
                row["us"] = sec * 1e6
                row["gbps"] = p.bytes_moved(data.rows) / sec / 1e9
                row["regs"] = kernels[0].num_regs
                row["ok"] = bool(row["err"] < TOL[dtype])
            except Exception as e:  # recorded: a failing config must not stop the sweep
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                row["ok"] = False
            results.append(row)
        del data
        torch.cuda.empty_cache()
        (out / "norms_sweep.json").write_text(json.dumps({"env": env_info(torch), "results": results}, indent=1))
        best = {}
        for r in results:
            if r["dtype"] == dtype and r["n"] == n and r.get("ok"):
                k = (r["dir"], r["op"])
                if k not in best or r["gbps"] > best[k]["gbps"]:
                    best[k] = r
        bad = [r for r in results if r["dtype"] == dtype and r["n"] == n and not r.get("ok")]
        print(f"sweep {dtype:>4} N={n:>6}: " + "  ".join(
            f"{k[0]}/{k[1]} {v['kind']} {json.dumps(v['config'], separators=(',', ':'))} {v['gbps']:.0f}"
            for k, v in sorted(best.items())) + (f"  [{len(bad)} failed]" if bad else ""), flush=True)
        for r in bad[:6]:
            print("   FAILED", r["dir"], r["op"], r["kind"], r["config"], r.get("err"), r.get("error", "")[:200],
                  flush=True)
    (out / "norms_sweep.json").write_text(json.dumps({"env": env_info(torch), "results": results}, indent=1))
    return {"results": results}


# ---- public ops vs torch ----------------------------------------------------------------------------------------
def cmd_bench(out: Path, torch, compile_budget_s: float, env: dict | None = None) -> dict:
    from rtckern.ops import _norms_api as norms

    import torch._dynamo

    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.cache_size_limit = 1024
    F = torch.nn.functional
    rows_out = []
    copy = {}
    for dtype in DTYPES:
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        a = torch.randn(TOTAL, device="cuda").to(dt)
        b = torch.empty_like(a)
        sec = timeit(lambda: b.copy_(a), torch)
        copy[dtype] = 2 * a.numel() * a.element_size() / sec / 1e9
        del a, b
    print("copy GB/s:", {k: round(v) for k, v in copy.items()}, flush=True)
    compile_spent = 0.0
    for dtype in DTYPES:
        for n in NS:
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
                del y, leaves, xg, wg, grads
                if compile_spent < compile_budget_s:
                    t0 = time.perf_counter()
                    cf = torch.compile(fn, dynamic=False)
                    cf(*args)
                    torch.cuda.synchronize()
                    compile_spent += time.perf_counter() - t0
                    r["compile_fwd_gbps"] = fbytes / timeit(lambda: cf(*args), torch) / 1e9
                else:
                    r["compile_fwd_gbps"] = None
                kinds = _chosen(norms, op, dtype, n)
                r.update(kinds)
                rows_out.append(r)
                print(_line(r), flush=True)
            del data
            torch.cuda.empty_cache()
            if env is not None:  # the report so far, so a run cut short still leaves one
                write_report(out, env, {"copy_gbps": copy, "results": rows_out}, None)
    return {"copy_gbps": copy, "results": rows_out}


def _chosen(norms, op, dtype, n) -> dict:
    out = {}
    for sig, (_s, req, cand, _k) in norms._fast.items():
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


def write_report(out: Path, env: dict, bench: dict, sweep: dict | None) -> None:
    doc = {"env": env, **bench}
    (out / "norms_bench.json").write_text(json.dumps(doc, indent=1))
    lines = [f"# rtckern norms benchmark — {env['gpu']} ({env['sm_count']} SMs), {env['date']}", "",
             f"driver {env.get('driver')} (CUDA {env['driver_cuda']}), torch {env['torch']} (CUDA {env['torch_cuda']}),"
             f" triton {env.get('triton')}, {env['nvrtc']}, rtckern {env['rtckern']}. M x N = 2^27 elements.",
             "Copy GB/s (read + write, same dtype): " + ", ".join(f"{k} {v:.0f}" for k, v in bench["copy_gbps"].items()),
             "", "Targets: fwd >= 0.90x copy and >= 1.0x torch.compile; bwd >= 0.80x copy and >= 1.5x eager.", "",
             "| op | dtype | N | fwd GB/s | x copy | eager | compile | x compile | bwd GB/s | x copy | eager bwd | x eager"
             " | kernels | fwd ok | bwd ok |", "|" + "---|" * 15]
    for r in bench["results"]:
        fc, fcomp = _ratio(r["ours_fwd_gbps"], r["copy_gbps"]), _ratio(r["ours_fwd_gbps"], r["compile_fwd_gbps"])
        bc, be = _ratio(r["ours_bwd_gbps"], r["copy_gbps"]), _ratio(r["ours_bwd_gbps"], r["eager_bwd_gbps"])
        fok = fc >= 0.90 and (fcomp is None or fcomp >= 1.0)
        bok = bc >= 0.80 and be >= 1.5

        def g(v, fmt="{:.0f}"):
            return fmt.format(v) if v is not None else "-"
        lines.append(f"| {r['op']} | {r['dtype']} | {r['n']} | {g(r['ours_fwd_gbps'])} | {g(fc, '{:.2f}')} | "
                     f"{g(r['eager_fwd_gbps'])} | {g(r['compile_fwd_gbps'])} | {g(fcomp, '{:.2f}')} | "
                     f"{g(r['ours_bwd_gbps'])} | {g(bc, '{:.2f}')} | {g(r['eager_bwd_gbps'])} | {g(be, '{:.2f}')} | "
                     f"{r.get('fwd_kind', '')} / {r.get('bwd_kind', '')} | {'yes' if fok else 'NO'} | "
                     f"{'yes' if bok else 'NO'} |")
    (out / "norms_bench.md").write_text("\n".join(lines) + "\n")
    try:
        plot(out, env, bench)
    except Exception as e:  # the JSON and table stand without the plot
        print("plot failed:", e)


def plot(out: Path, env: dict, bench: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 6, figsize=(26, 8), sharex=True)
    for i, d in enumerate(("fwd", "bwd")):
        for j, (op, dtype) in enumerate((o, t) for o in OPS for t in DTYPES):
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
    fig.suptitle(f"rtckern norms, {env['gpu']}, {env['date']}")
    fig.tight_layout()
    fig.savefig(out / "norms_bench.png", dpi=80)


# ---- compile times (CPU) ----------------------------------------------------------------------------------------
SELECTED_NS = (7, 1000, 1024, 4096, 5120, 8192, 12288, 16384, 65536, 100000, 262144)


def _selected_specs() -> set:
    """The kernels the registry picks (shipped tables; 132 SMs on sm_90) for every norm op, dtype and N in
    SELECTED_NS on sm_75 / sm_80 / sm_90: what a user's first call compiles."""
    import rtckern.ops  # noqa: F401  (registers the candidates)
    from rtckern.ops import _norms_candidates as cands
    from rtckern.registry import select

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
                    fp = K.FwdProblem(**{**fp.__dict__, "vec": K.pick_vec(n, (K.ITEMSIZE[dtype],), (16,))})
                    bp = K.BwdProblem(**{**bwd_problem(op, dtype, n).__dict__, "vec": fp.vec})
                    for kind in ("rows", "cluster", "l2", "l2c", "stage", "coop"):
                        if kind in ("cluster", "l2c") and a.cc < (9, 0):
                            continue
                        c = L.fwd_config(fp, kind, dev) if kind not in K.BWD_ONLY_KINDS else None
                        if c is not None:
                            variants.append(L.fwd_spec(fp, kind, c, a))
                        c = L.bwd_config(bp, kind, dev)
                        if c is not None:
                            variants.extend(L.bwd_specs(bp, kind, c, a))
    selected = _selected_specs()
    variants = list(dict.fromkeys(variants + sorted(selected, key=lambda s: s.name_expression + s.arch.sm)))
    comp = compiler_for(Arch.parse("sm_90"))
    t0 = time.perf_counter()
    comp.compile(L.fwd_spec(fwd_problem("rms", "bf16", 1024), "rows", K.rows_config(1024, 8), Arch.parse("sm_80")))
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


# ---- tuned tables from a sweep ----------------------------------------------------------------------------------
def _read_sweep(path: Path) -> dict:
    import gzip

    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return json.loads(raw)


def cmd_tables(sweep_paths: list[Path], into: Path, merge: bool = False) -> None:
    """Write the best config per (kind, norm, dtype, N) and the fastest kind per (direction, norm, dtype, N) of
    sweeps as rtckern tuning tables (norm_fwd.json, norm_bwd.json, norm_kind.json). With several sweeps, a later
    one replaces an earlier one's configs of each (direction, kind, shape) it timed, and the kind choice of each
    shape it timed (so a partial sweep that re-times the other kinds' shipped configs decides the kind within
    one run). With merge, only the shapes the sweeps timed change: their rows replace the tables' rows of the
    same key in place (for a partial sweep on top of the shipped tables)."""
    best_cfg: dict = {}
    best_kind: dict = {}
    meta_of: dict = {}
    arch = sms = None
    for sweep_path in sweep_paths:
        doc = _read_sweep(sweep_path)
        env = doc["env"]
        arch, sms = "sm_" + env["capability"].replace(".", ""), env["sm_count"]
        meta = {"date": env["date"], "versions": {k: env[k] for k in ("gpu", "driver", "nvrtc", "rtckern", "torch")},
                "source": f"benchmarks/norms.py sweep ({sweep_path.name})"}
        ok = [r for r in doc["results"] if r.get("ok") and r.get("gbps")]
        cfg_here: dict = {}
        kind_here: dict = {}
        for r in ok:
            k = (r["dir"], r["kind"], r["op"], r["dtype"], r["n"])
            if k not in cfg_here or r["gbps"] > cfg_here[k]["gbps"]:
                cfg_here[k] = r
            k2 = (r["dir"], r["op"], r["dtype"], r["n"])
            if r["kind"] != "coop" and (k2 not in kind_here or r["gbps"] > kind_here[k2]["gbps"]):
                kind_here[k2] = r
        for k, r in cfg_here.items():
            best_cfg[k], meta_of[id(r)] = r, meta
        for k, r in kind_here.items():
            best_kind[k], meta_of[id(r)] = r, meta
    into.mkdir(parents=True, exist_ok=True)
    cfg_fields, kind_fields = ["kind", "norm", "dtype", "n", "vec"], ["dir", "norm", "dtype", "n"]
    for d, op_name in (("fwd", L.TABLE_FWD), ("bwd", L.TABLE_BWD)):
        rows = [{"arch": arch, "sm_count": sms,
                 "shape": {"kind": kind, "norm": op, "dtype": dt, "n": n, "vec": 16 // K.ITEMSIZE[dt]},
                 "config": r["config"], "time_us": round(r["us"], 2), "gbps": round(r["gbps"]), **meta_of[id(r)]}
                for (dd, kind, op, dt, n), r in sorted(best_cfg.items()) if dd == d]
        _write_table(into / f"{op_name}.json", op_name, cfg_fields, rows, merge)
    rows = [{"arch": arch, "sm_count": sms, "shape": {"dir": d, "norm": op, "dtype": dt, "n": n},
             "config": {"kind": r["kind"]}, "gbps": round(r["gbps"]), **meta_of[id(r)]}
            for (d, op, dt, n), r in sorted(best_kind.items())]
    _write_table(into / f"{L.TABLE_KIND}.json", L.TABLE_KIND, kind_fields, rows, merge)
    print(f"tables: {len(best_cfg)} configs, {len(best_kind)} kind choices -> {into}" + (" (merged)" if merge else ""))


def _write_table(path: Path, op_name: str, fields: list, rows: list, merge: bool) -> None:
    from rtckern import tuning

    if merge:
        new = tuning.parse_table({"format": 1, "op": op_name, "key_fields": fields, "rows": rows}, path, op_name)
        tuning.merge_rows(op_name, fields, new.rows, path, keep_order=True)
    else:
        doc_out = {"format": 1, "op": op_name, "key_fields": fields, "rows": rows}
        path.write_text(json.dumps(doc_out, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=("sweep", "bench", "all", "compile-times", "tables"))
    ap.add_argument("--sweep", type=Path, action="append", help="tables: a norms_sweep.json(.gz) to read; repeat: "
                    "later sweeps win")
    ap.add_argument("--kinds", help="sweep/all: only these kernel kinds (comma-separated), plus the tabled "
                    "config of the others")
    ap.add_argument("--dirs", default="fwd,bwd", help="sweep/all: only these directions (fwd, bwd)")
    ap.add_argument("--ns", help="sweep/all: only these row lengths (comma-separated; default: every benchmark N)")
    ap.add_argument("--into", type=Path, default=Path(__file__).resolve().parents[1] / "rtckern" / "tuning_tables")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--sweep-budget", type=float, default=150.0, help="seconds of sweep timing at most")
    ap.add_argument("--compile-budget", type=float, default=120.0, help="seconds of torch.compile at most")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--write-tables", action="store_true", help="sweep/all: write the winners into --into")
    ap.add_argument("--l2-policy", action=argparse.BooleanOptionalAction, default=True,
                    help="sweep/all: also every l2 config (and the l2c OPTs in L2C_POLICY_OPTS) with the L2 access "
                    "policies (OPT 256; sm_80+); on by default, so a sweep re-times what the tables ship")
    ap.add_argument("--merge", action="store_true", help="tables: change only the shapes the sweeps timed (rows "
                    "replaced in place) instead of writing the tables from the sweeps alone")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.cmd == "compile-times":
        cmd_compile_times(a.out)
        return
    if a.cmd == "tables":
        cmd_tables(a.sweep or [], a.into, a.merge)
        return
    global L2_POLICY_VARIANTS
    L2_POLICY_VARIANTS = a.l2_policy
    kinds = tuple(a.kinds.split(",")) if a.kinds else None
    dirs = tuple(a.dirs.split(","))
    ns = tuple(int(v) for v in a.ns.split(",")) if a.ns else NS
    arch = Arch.parse("sm_90")
    pre = None
    if a.cmd in ("sweep", "all"):
        import subprocess

        smi = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip().splitlines()
        if smi:
            arch = Arch.parse("sm_" + smi[0].replace(".", ""))
        specs = [s for item in sweep_plan(arch.cc >= (9, 0), kinds, dirs, ns) for s in specs_of(item, arch)]
        pre = prefill(specs, a.workers)
    import torch

    sweep = None
    if a.cmd in ("sweep", "all"):
        sweep = cmd_sweep(a.out, torch, arch, a.sweep_budget, kinds, dirs, ns)
        print("prefill:", json.dumps({k: v for k, v in pre.items() if k != "failed"}), flush=True)
        if a.write_tables:
            cmd_tables((a.sweep or []) + [a.out / "norms_sweep.json"], a.into, a.merge)
    if a.cmd in ("bench", "all"):
        env = env_info(torch)
        bench = cmd_bench(a.out, torch, a.compile_budget, env)
        write_report(a.out, env, bench, sweep)


if __name__ == "__main__":
    main()
