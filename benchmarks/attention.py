"""Attention forward: correctness grid and TFLOP/s against torch SDPA (flash and cuDNN backends).

    python -m benchmarks attention [--check] [--tests JUNIT_XML]    # the result set attention_<gpu>.{json,md,png}
    python -m benchmarks attention --compile-times                  # cold NVRTC compiles (no GPU;
                                                                    # DIR/attention_compile.json)
    python -m benchmarks attention --render benchmarks/results/attention_h100.json   # re-write the set (no GPU)

Engines:
  rtckern  the public op, rtckern.ops.attention (registry selection, cached kernels)
  raw      the kernel templates through rtckern's KernelManager, no registry: times tile configurations that the
           registry would not pick (--tiles)
--tests JUNIT_XML records the outcome of the GPU attention test suite (pytest --junitxml) in the same files.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks.env import legacy_meta
from benchmarks.runner import Result, Table, gpu_name, stored_data

ROOT = Path(__file__).resolve().parents[1]


def _load_configs():
    # By file path: the raw engine must not depend on the rest of the package importing cleanly.
    spec = importlib.util.spec_from_file_location("rtckern_attn_configs", ROOT / "rtckern/ops/_attention/configs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["rtckern_attn_configs"] = mod
    spec.loader.exec_module(mod)
    return mod


C = _load_configs()


# ----------------------------------------------------------------------------------------------------------------
# raw engine: kernel templates through rtckern's KernelManager, bypassing the registry
# ----------------------------------------------------------------------------------------------------------------
class RawEngine:
    def __init__(self):
        from rtckern.manager import get_manager

        self.manager = get_manager()
        self.compile_s = {}

    def kernel(self, source: str, name: str, targs: tuple, arch: str):
        from rtckern.arch import Arch
        from rtckern.spec import KernelSpec

        spec = KernelSpec(source=source, name=name, template_args=targs, arch=Arch.parse(arch), op="attention")
        t0 = time.perf_counter()
        k = self.manager.get(spec, device=0)
        self.compile_s.setdefault(spec.name_expression + " " + arch, time.perf_counter() - t0)
        return k

    def runner(self, tile, dtype: str, hd: int, causal: bool):
        import numpy as np
        import torch

        if isinstance(tile, C.SimtTile):
            source, kname, arch = C.SIMT_SOURCE, C.SIMT_KERNEL, "sm_90"
        elif isinstance(tile, C.Sm90Tile):
            source, kname, arch = C.SM90_SOURCE, C.SM90_KERNEL, "sm_90a"
        elif isinstance(tile, C.Sm90WsTile):
            source, kname, arch = C.SM90_WS_SOURCE, C.SM90_WS_KERNEL, "sm_90a"
        else:
            source, kname, arch = C.SM80_SOURCE, C.SM80_KERNEL, "sm_90"
        kern = self.kernel(source, kname, tile.template_args(dtype, hd, causal), arch)
        smem = tile.smem_bytes(hd)
        if smem > 48 * 1024:
            kern.set_max_dynamic_shared_memory(smem)
        if isinstance(tile, C.Sm90WsTile):
            from rtckern.runtime import arrays as A
            from rtckern.ops._attention.launch import launch_ws

            def run_ws(q, k, v, o, lse, scale):
                launch_ws(kern, tile, dtype, A.wrap(q, "q"), A.wrap(k, "k"), A.wrap(v, "v"), o.data_ptr(),
                          0 if lse is None else lse.data_ptr(), scale, torch.cuda.current_stream().cuda_stream)

            run_ws.label = tile.label()
            return run_ws

        def run(q, k, v, o, lse, scale):
            b, sq, hq, _ = q.shape
            sk, hk = k.shape[1], k.shape[2]
            st = lambda t: [np.int64(x) for x in (t.stride(0), t.stride(1), t.stride(2))]
            args = (np.uint64(q.data_ptr()), np.uint64(k.data_ptr()), np.uint64(v.data_ptr()),
                    np.uint64(o.data_ptr()), np.uint64(0 if lse is None else lse.data_ptr()), np.int64(sq),
                    np.int64(sk), np.int64(hq), np.int64(hk), *st(q), *st(k), *st(v), *st(o),
                    np.float32(scale * math.log2(math.e)))
            kern.launch(tile.grid(b, hq, sq), tile.threads, args, shared_mem=smem,
                        stream=torch.cuda.current_stream().cuda_stream)

        run.label = tile.label()
        return run


class RtckernEngine:
    def __init__(self, impl: str = ""):
        from rtckern import ops

        self.ops = ops
        self.impl = impl  # "" = the registry's choice; else a candidate name forced for the runner's loops

    def runner(self, tile, dtype, hd, causal):
        ops = self.ops
        # the op's own choice (or the forced candidate); tile is ignored

        def run(q, k, v, o, lse, scale):
            # Returns the op's own outputs (new arrays); o and lse are not written.
            return ops.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=lse is not None)

        run.label = f"rtckern[{self.impl}]" if self.impl else "rtckern"
        if self.impl:
            from rtckern import config

            run.ctx = lambda: config.override(force_impl={"attention": self.impl})
        return run


# ----------------------------------------------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------------------------------------------
def visible_mask(sq, sk, causal, device):
    import torch

    if not causal:
        return None
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j <= i + (sk - sq)  # bottom-right aligned


def reference(q, k, v, causal, scale):
    """float64 attention in (b, s, h, d) layout; returns (o, lse) with o = 0, lse = -inf for rows that see no key."""
    import torch

    hq, hk = q.shape[2], k.shape[2]
    qf = q.double().transpose(1, 2)
    kf = k.double().transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    vf = v.double().transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    m = visible_mask(q.shape[1], k.shape[1], causal, q.device)
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2), lse


def math_sdpa(q, k, v, causal, scale):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = visible_mask(q.shape[1], k.shape[1], causal, q.device)
    with sdpa_kernel(SDPBackend.MATH):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m,
                                           scale=scale, enable_gqa=True)
    return o.transpose(1, 2)


def check_case(run, dtype, b, sq, sk, hq, hk, hd, causal, seed, strided=False):
    import torch

    torch.manual_seed(seed)
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    dev = "cuda"
    if strided:  # q, k, v as views into one packed (b, s, heads, d) buffer: non-trivial head/row strides
        assert sq == sk
        qkv = torch.randn(b, sq, hq + 2 * hk, hd, device=dev, dtype=tdt)
        q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hk], qkv[:, :, hq + hk:]
    else:
        q = torch.randn(b, sq, hq, hd, device=dev, dtype=tdt)
        k = torch.randn(b, sk, hk, hd, device=dev, dtype=tdt)
        v = torch.randn(b, sk, hk, hd, device=dev, dtype=tdt)
    scale = 1.0 / math.sqrt(hd)
    o = torch.full((b, sq, hq, hd), float("nan"), device=dev, dtype=tdt)
    lse = torch.full((b, hq, sq), float("nan"), device=dev, dtype=torch.float32)
    res = run(q, k, v, o, lse, scale)
    if res is not None:  # the op allocates its outputs
        o, lse = res
    torch.cuda.synchronize()
    ref_o, ref_lse = reference(q, k, v, causal, scale)
    seen = torch.isfinite(ref_lse).transpose(1, 2)  # (b, sq, hq): rows with at least one visible key
    err = (o.double() - ref_o).abs()
    ours = err.max().item() if err.numel() else 0.0
    unwritten = int(torch.isnan(o).sum().item()) + int(torch.isnan(lse).sum().item())
    mo = math_sdpa(q, k, v, causal, scale)
    merr = (mo.double() - ref_o).abs()[seen].max().item() if bool(seen.any()) else 0.0
    fin = torch.isfinite(ref_lse)
    lse_err = (lse.double() - ref_lse)[fin].abs().max().item() if bool(fin.any()) else 0.0
    lse_inf_ok = bool((lse[~fin] == float("-inf")).all().item())
    # Pass: within 2x math SDPA's error (plus one bf16/fp16 ulp at 2^-10 scale for cases where math is exact).
    floor = 1e-6
    ok = (unwritten == 0 and math.isfinite(ours) and ours <= 2 * merr + floor and lse_err < 1e-3 and lse_inf_ok)
    return dict(dtype=dtype, b=b, sq=sq, sk=sk, hq=hq, hk=hk, hd=hd, causal=causal, strided=strided,
                err=ours, math_err=merr, ratio=ours / merr if merr > 0 else None, lse_err=lse_err,
                lse_inf_ok=lse_inf_ok, unwritten=unwritten, ok=ok)


def check_grid():
    """(b, sq, sk, hq, hk) cases crossed with head dims, causal, dtypes: ragged seqlens, sq != sk, GQA 1/4/8."""
    shapes = [
        (2, 1, 1, 8, 8), (2, 17, 17, 8, 2), (1, 113, 1000, 8, 1), (1, 1000, 113, 8, 8), (2, 1000, 1000, 8, 2),
        (1, 1, 4097, 8, 1), (1, 4097, 4097, 4, 1), (3, 17, 113, 8, 2), (1, 113, 17, 8, 1), (1, 300, 300, 16, 4),
    ]
    cases = []
    for hd in C.HEAD_DIMS:
        for causal in (False, True):
            for i, (b, sq, sk, hq, hk) in enumerate(shapes):
                if hd == 256 and sq * sk > 4_000_000 and causal is False:
                    continue
                dtype = "bf16" if (i + hd // 32 + causal) % 2 == 0 else "fp16"
                cases.append(dict(dtype=dtype, b=b, sq=sq, sk=sk, hq=hq, hk=hk, hd=hd, causal=causal))
        cases.append(dict(dtype="bf16", b=2, sq=257, sk=257, hq=8, hk=2, hd=hd, causal=True, strided=True))
    return cases


# ----------------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------------
WARM_S = 0.05  # each series starts after this long of back-to-back calls (see time_ms)


def warm(fn, calls: int = 5, seconds: float = WARM_S) -> None:
    """Runs fn until `calls` calls and `seconds` of wall time have passed, synchronized. A series timed right after
    the host was busy alone (allocating inputs, building a plan) measured up to 16% slower than the same kernel
    timed again at once (attention_backward_h100, rtckern vs rtckern_unsplit with one config): the GPU's clocks
    need tens of milliseconds of load to come back up."""
    import time

    import torch

    t0 = time.perf_counter()
    n = 0
    while n < calls or time.perf_counter() - t0 < seconds:
        fn()
        n += 1
        if n % 5 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()


def time_ms(fn, warmup=5, reps=30):
    """Median, min, max milliseconds of fn on the GPU, after `warm`. Calls are queued back to back (no sync between
    reps), so host-side overhead overlaps the previous call's GPU work, as in a model's forward pass."""
    import torch

    warm(fn, warmup)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    ts = [s.elapsed_time(e) for s, e in ev]
    return statistics.median(ts), min(ts), max(ts)


def bench_points():
    """bf16 at 16k tokens per batch: hidden 2048 for head dims 32 / 64 / 128 (64, 32, 16 heads), 1536 for 96."""
    pts = []
    for hd, heads in ((32, 64), (64, 32), (96, 16), (128, 16)):
        for sl in (1024, 4096, 16384):
            for causal in (False, True):
                pts.append(dict(hd=hd, heads=heads, seqlen=sl, batch=16384 // sl, causal=causal))
    return pts


def tflops(p, ms):
    f = 4.0 * p["batch"] * p["heads"] * p["seqlen"] ** 2 * p["hd"]
    if p["causal"]:
        f /= 2
    return f / (ms * 1e-3) / 1e12


def sdpa_runner(backend_name):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def make(q, k, v, causal):
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        def fn():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        return fn

    return make


def parse_tile(s: str):
    """'128x64w4s2q' -> Sm80Tile(128, 64, 4, 2, True); 'wg128x128' -> Sm90Tile(128, 2); 'simt'."""
    if s == "simt":
        return C.SIMT_TILE
    if s.startswith("ws"):  # ws128x128k2v2[p]
        pp = s.endswith("p")
        bm, rest = s[2:].rstrip("p").split("x")
        bn, rest = rest.split("k")
        ks, vs = rest.split("v")
        return C.Sm90WsTile(int(bn), int(bm) // 64, int(ks), int(vs), pp)
    if s.startswith("wg"):
        bm, bn = s[2:].split("x")
        return C.Sm90Tile(int(bn), int(bm) // 64)
    q = s.endswith("q")
    s = s.rstrip("q")
    bm, rest = s.split("x")
    bn, rest = rest.split("w")
    w, st = rest.split("s")
    return C.Sm80Tile(int(bm), int(bn), int(w), int(st), q)


def family_tile(family: str, hd: int, causal: bool):
    """The default tile of a kernel family for (hd, causal), or None where the family lacks that head dim."""
    if family == "sm80":
        return C.SM80_TILES[(hd, causal)][0]
    if family == "sm90":
        return C.SM90_TILES.get(hd)
    if family in ("sm90ws", "sm90wsp"):  # the default ws tile; sm90wsp: with the ping-pong schedule forced on
        t = C.SM90_WS_TILES.get((hd, causal))
        return None if t is None else C.Sm90WsTile(t.bn, t.nwg, t.ks, t.vs, t.pingpong or family == "sm90wsp")
    if family == "simt":
        return C.SIMT_TILE
    raise ValueError(f"unknown kernel family {family!r}: sm80, sm90, sm90ws, simt")


def run_grid(result, make_runner, tag, seed0, max_elems=None, only_hd=None):
    fails = n = 0
    for cs in check_grid():
        if max_elems and cs["sq"] * cs["sk"] > max_elems:
            continue
        if only_hd and cs["hd"] not in only_hd:
            continue
        run = make_runner(cs["dtype"], cs["hd"], cs["causal"])
        if run is None:
            continue
        with getattr(run, "ctx", contextlib.nullcontext)():
            r = check_case(run, seed=seed0 + n, **cs)
        r["kernel"] = f"{tag}:{run.label}"
        result["checks"].append(r)
        n += 1
        fails += not r["ok"]
        if not r["ok"]:
            print("FAIL", tag, {k: r[k] for k in ("dtype", "b", "sq", "sk", "hq", "hk", "hd", "causal", "err",
                                                  "math_err", "lse_err", "unwritten")}, flush=True)
    rs = [r for r in result["checks"] if r["kernel"].startswith(tag + ":")]
    worst = max(rs, key=lambda r: r["ratio"] or 0) if rs else None
    print(f"check {tag}: {n - fails} passed, {fails} failed; worst err/math_err "
          f"{worst['ratio'] if worst else None}", flush=True)
    return fails


CHECK = "the correctness grid first (float64 reference; pass = error <= 2x math SDPA's)"
QUICK = "head dims 64 and 128 at seqlen 4096 only (and with --check, the grid at head dim 128)"


def add_args(ap) -> None:
    ap.add_argument("--engine", choices=("rtckern", "raw"), default="rtckern")
    ap.add_argument("--check-kernels", default="",
                    help="raw kernels to run the grid on: comma list of sm80, sm90, sm90ws, simt")
    ap.add_argument("--bench", action=argparse.BooleanOptionalAction, default=True,
                    help="time the engine against SDPA (on by default)")
    ap.add_argument("--tiles", default="", help="extra raw tiles to time: hd=tile,tile;hd=...")
    ap.add_argument("--impls", default="", help="rtckern engine: extra forced candidates to time, comma list")
    ap.add_argument("--compile-times", action="store_true", help="cold NVRTC compile of every default kernel (no GPU)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tests", default="", help="a pytest --junitxml file of the GPU attention tests to record")


def needs_gpu(args) -> bool:
    return not args.compile_times


def run(args) -> Result | None:
    if args.compile_times:
        compile_times(args.out)
        return None
    import torch

    raw = RawEngine() if (args.engine == "raw" or args.tiles or args.check_kernels) else None
    eng = raw if args.engine == "raw" else RtckernEngine()
    result = dict(engine=args.engine, checks=[], bench=[])
    if args.tests:
        result["gpu_tests"] = junit_summary(Path(args.tests))

    def default_runner(dtype, hd, causal):
        if args.engine == "raw":
            return eng.runner(C.SM80_TILES[(hd, causal)][0], dtype, hd, causal)
        return eng.runner(None, dtype, hd, causal)

    if args.check:
        run_grid(result, default_runner, args.engine, 0, only_hd=(128,) if args.quick else None)
    for fam in filter(None, args.check_kernels.split(",")):
        def mk(dtype, hd, causal, fam=fam):
            t = family_tile(fam, hd, causal)
            return None if t is None else raw.runner(t, dtype, hd, causal)
        run_grid(result, mk, fam, 5000, max_elems=2_000_000 if fam == "simt" else None)

    extra = {}
    for part in filter(None, args.tiles.split(";")):
        hd, tiles = part.split("=")
        extra[int(hd)] = [parse_tile(t) for t in tiles.split(",")]

    if args.bench:
        rows = []
        points = bench_points()
        if args.quick:
            points = [p for p in points if p["seqlen"] == 4096 and p["hd"] in (64, 128)]
        for p in points:
            g = torch.Generator(device="cuda").manual_seed(1)
            shp = (p["batch"], p["seqlen"], p["heads"], p["hd"])
            q, k, v = (torch.randn(shp, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
            o = torch.empty_like(q)
            scale = 1.0 / math.sqrt(p["hd"])
            entries = {}
            runners = [default_runner("bf16", p["hd"], p["causal"])]
            for impl in filter(None, args.impls.split(",")):
                runners.append(RtckernEngine(impl).runner(None, "bf16", p["hd"], p["causal"]))
            for t in extra.get(p["hd"], []):
                runners.append(raw.runner(t, "bf16", p["hd"], p["causal"]))
            for run in runners:
                if run.label in entries:
                    continue
                try:
                    with getattr(run, "ctx", contextlib.nullcontext)():
                        entries[run.label] = time_ms(lambda: run(q, k, v, o, None, scale), reps=args.reps)
                except Exception as e:
                    print(f"{run.label} failed: {e}", flush=True)
            for bname in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
                try:
                    fn = sdpa_runner(bname)(q, k, v, p["causal"])
                    entries["sdpa_" + bname.split("_")[0].lower()] = time_ms(fn, reps=args.reps)
                except Exception as e:
                    print(f"{bname} failed: {e}")
            row = dict(p, ms={k: v[0] for k, v in entries.items()},
                       spread={k: [v[1], v[2]] for k, v in entries.items()},
                       tflops={k: tflops(p, v[0]) for k, v in entries.items()})
            rows.append(row)
            line = " ".join(f"{k}={v:.0f}" for k, v in sorted(row["tflops"].items(), key=lambda kv: -kv[1]))
            print(f"hd{p['hd']} s{p['seqlen']} b{p['batch']} causal={int(p['causal'])}: {line}", flush=True)
        result["bench"] = rows
    if raw is not None:
        result["load_or_compile_s_device"] = raw.compile_s
    return to_result(result)


def to_result(result: dict, meta: dict | None = None) -> Result:
    """The runner's Result of a run's dict (engine, checks, bench rows, gpu_tests)."""
    rows = result.pop("bench")
    data = dict(result)
    return Result(f"Attention forward, TFLOP/s ({data['engine']} engine)", rows=rows, body=body(data, rows),
                  data=data, meta=meta, rc=0 if all(c["ok"] for c in data["checks"]) else 1,
                  plot=(lambda plt, m: plot(plt, m, rows)) if rows else None)


def render(payload: dict) -> Result:
    """A result JSON of this suite, re-rendered with the environment it recorded (an older file's "env" too)."""
    if "meta" in payload:
        result = stored_data(payload)
        result["bench"] = payload["rows"]
        meta = payload["meta"]
    else:  # written before the runner: {"env": {...}, "engine", "checks", "bench", "gpu_tests"}
        result = {k: v for k, v in payload.items() if k != "env"}
        meta = legacy_meta(payload["env"], gpu_used=True)
    result.setdefault("checks", [])
    return to_result(result, meta)


def junit_summary(path: Path) -> dict:
    """Counts of a pytest --junitxml run (passed / failed / errors / skipped) and the failing test ids."""
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    cases = [c for s in suites for c in s.iter("testcase")]
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("failure") is not None]
    errors = [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    return dict(tests=len(cases), passed=len(cases) - len(failed) - len(errors) - len(skipped), failed=len(failed),
                errors=len(errors), skipped=len(skipped), failing=failed + errors,
                seconds=round(sum(float(s.get("time", 0)) for s in suites), 1),
                date=suites[0].get("timestamp") if suites else None)


def compile_times(out: str):
    """Cold NVRTC compile (no cache) of each default kernel: the issue's budget is 1.5 s per kernel on the CPU
    machine."""
    from rtckern.arch import Arch
    from rtckern.compiler import compiler_for
    from rtckern.spec import KernelSpec

    jobs = []
    for hd in C.HEAD_DIMS:
        for causal in (False, True):
            jobs.append((C.SM80_SOURCE, C.SM80_KERNEL, C.SM80_TILES[(hd, causal)][0], hd, causal, "sm_90"))
            jobs.append((C.SIMT_SOURCE, C.SIMT_KERNEL, C.SIMT_TILE, hd, causal, "sm_75"))
            if hd in C.SM90_HEAD_DIMS:
                jobs.append((C.SM90_SOURCE, C.SM90_KERNEL, C.SM90_TILES[hd], hd, causal, "sm_90a"))
                jobs.append((C.SM90_WS_SOURCE, C.SM90_WS_KERNEL, C.SM90_WS_TILES[(hd, causal)], hd, causal, "sm_90a"))
    rows = []
    for source, name, tile, hd, causal, arch in jobs:
        spec = KernelSpec(source, name, Arch.parse(arch), template_args=tile.template_args("bf16", hd, causal))
        comp = compiler_for(spec.arch)
        t0 = time.perf_counter()
        comp.compile(spec)
        dt = time.perf_counter() - t0
        rows.append(dict(kernel=spec.name_expression, arch=arch, seconds=round(dt, 3)))
        print(f"{dt:6.2f} s  {arch:7s} {spec.name_expression}", flush=True)
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    res = dict(date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), cpus=os.cpu_count(),
               loadavg=load, python=platform.python_version(), kernels=rows,
               max_s=max(r["seconds"] for r in rows))
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        res["nvrtc"] = f"{major}.{minor}"
    except Exception:
        pass
    print(f"max {res['max_s']:.2f} s over {len(rows)} kernels (load average {load})")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "attention_compile.json").write_text(json.dumps(res, indent=1))
    return res


def body(result: dict, bench: list[dict]) -> list:
    out = ["bf16, batch x seqlen = 16384 tokens, hidden 2048 (1536 at head dim 96). TFLOP/s = 4 b h s^2 d / time "
           "(halved for causal); median of CUDA-event timings."]
    labels = []
    for r in bench:
        for k in r["tflops"]:
            if k not in labels:
                labels.append(k)
    out += result.get("notes", [])
    t = result.get("gpu_tests")
    if t:
        out.append(f"GPU test suite (`pytest tests/gpu/ops/test_attention.py`, {t['date']}): "
                   f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped of "
                   f"{t['tests']} in {t['seconds']} s" + (": failing " + ", ".join(t["failing"]) if t["failing"]
                                                           else "."))
    checks = result.get("checks") or []
    if checks:
        bad = sum(not c["ok"] for c in checks)
        worst = max((c["ratio"] or 0 for c in checks), default=0)
        out.append(f"Correctness grid (float64 reference, pass = error <= 2x math SDPA's): {len(checks) - bad} "
                   f"passed, {bad} failed; worst error / math SDPA error {worst:.2f}.")
    if not bench:
        return out
    rows = []
    for r in bench:
        t = r["tflops"]
        ours = max((v for k, v in t.items() if not k.startswith("sdpa_")), default=0.0)
        ratios = [f"{ours / t[k]:.2f}" if t.get(k) else "-" for k in ("sdpa_flash", "sdpa_cudnn")]
        rows.append((r["hd"], r["seqlen"], r["batch"], int(r["causal"]),
                     *(f"{t[k]:.0f}" if k in t else "-" for k in labels), *ratios))
    out.append(Table(("head dim", "seqlen", "batch", "causal", *labels, "best rtckern / flash", "best rtckern / cuDNN"),
                     rows))
    return out


def plot(plt, meta: dict, bench: list[dict]):
    return tflops_panels(plt, bench, f"attention forward bf16 on {gpu_name(meta)} ({meta.get('date')})")


def tflops_panels(plt, bench: list[dict], title: str, ncol: int = 4):
    """TFLOP/s against seqlen, one panel per (head dim, causal), one color per series in every panel (dashed: SDPA);
    the rows: hd, seqlen, causal and a tflops dict per series (the backward suite's rows too)."""
    hds = sorted({r["hd"] for r in bench})
    panels = [(hd, c) for hd in hds for c in (False, True)]
    nrow = (len(panels) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(18, 4.2 * nrow), sharey=True, squeeze=False)
    axes = axes.ravel()
    every = []
    for r in bench:
        every += [k for k in r["tflops"] if k not in every]
    cmap = plt.cm.tab10 if len(every) <= 10 else plt.cm.tab20
    colors = {lab: cmap(i % cmap.N) for i, lab in enumerate(every)}
    for ax, (hd, causal) in zip(axes, panels):
        rows = [r for r in bench if r["hd"] == hd and r["causal"] == causal]
        for lab in every:
            xs = [r["seqlen"] for r in rows if lab in r["tflops"]]
            ys = [r["tflops"][lab] for r in rows if lab in r["tflops"]]
            if xs:
                ax.plot(xs, ys, marker="o", label=lab, color=colors[lab],
                        linestyle="--" if lab.startswith("sdpa") else "-")
        if ax.get_legend_handles_labels()[0]:  # (a panel may have no points)
            ax.legend(fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_title(f"head dim {hd}, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("seqlen (batch x seqlen = 16k)")
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    axes[0].set_ylabel("TFLOP/s")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
