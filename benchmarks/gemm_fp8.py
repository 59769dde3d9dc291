"""fp8 GEMM and quantization: TFLOP/s of rtckern.ops.gemm_fp8 (per-tensor and 1x128 / 128x128 block scales) against
torch._scaled_mm (per-tensor scales, bf16 out), and quantize_fp8's GB/s against the device's copy bandwidth.

    python -m benchmarks gemm_fp8 [--quick]

Shapes (M x N x K): issue 23's list (4096^3, 8192^3, Llama-70B / DeepSeek-V3 projections, M = 128 and 16 decode
shapes). CUDA events around back-to-back calls, median of --reps. TFLOP/s = 2 M N K / time. The decode range (M =
1..64 on weights larger than L2): the bytes a call moves (a, b, c; the weight's N x K dominate) per second against the
device's copy bandwidth, the memory-bound roofline, with sm_90a's tile and streaming kernels, the GEMV kernel (M = 1),
sm_89's decode kernel (gemm_fp8.sm89_skinny) and the CUDA-core fallback it replaced there (gemm_fp8.simt, 5 reps)
forced beside the kernel the registry picks; decode on small weights (M = 1, and 8 to 64 on the weights whose 64-row
blocks are fewer than the SMs) over rotating copies of b, the GEMV (M = 1), tile and streaming kernels forced; and
sm_89's prefill kernel (gemm_fp8.sm89_mma, M > 64) against that fallback, both forced, at two shapes (TFLOP/s).
quantize_fp8 and rms_norm_quant (bf16 4096 / 16384 x 7168, group 128): GPU time from CUDA-graph replays.

Sustained (the shapes with M >= 4096, --sustain seconds per call, 0 to skip): the GPU runs each of the three calls
back to back for that long, in turn, twice (the order reversed the second time), with the SM clock and the board power
sampled through NVML over the last two thirds of each (NVML's power reading is itself an average over about a second).
The short timings above catch the GPU wherever the call before left its clock (run back to back, these shapes hold it
at the board's power limit, and a pause lets it boost again); sustained, every call runs at the power limit, which is
where a long prefill runs. TFLOP/s per GHz there says how much of the gap is the kernel's work per clock rather than
the clock the power limit leaves it.
"""
from __future__ import annotations

import contextlib
import statistics

from benchmarks.runner import Result, Table, gpu_name, recorded_args

SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (4096, 7168, 18432), (4096, 24576, 1536), (128, 28672, 8192),
          (16, 28672, 8192))
# decode: M = 1..64 on weights of 132-235 MB (Llama-3.1-70B's MLP up / down, DeepSeek-V3's 7168 x 18432), every call
# reading its weight from device memory
DECODE = ((1, 28672, 8192), (8, 28672, 8192), (32, 28672, 8192), (64, 28672, 8192), (1, 8192, 28672),
          (8, 8192, 28672), (64, 8192, 28672), (1, 7168, 18432), (8, 7168, 18432), (64, 7168, 18432))
QUICK = "4096^3 and M=128 only, two decode shapes, 10 reps, no sustained table"


def add_args(ap) -> None:
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sustain", type=float, default=2.0,
                    help="seconds each call runs back to back at the large shapes (0: skip the sustained table)")


def _time_ms(fn, reps: int) -> float:
    import torch

    from benchmarks.attention import warm

    warm(fn)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def _copy_gbs() -> float:
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), 20)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def _operands(m: int, n: int, k: int) -> tuple:
    """(a, b, a unit per-tensor scale, a's 1 x 128 and b's 128 x 128 block scales) for an M x N x K problem, seeded."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    sa_blk = torch.rand(m, -(-k // 128), device="cuda", generator=g) + 0.5
    sb_blk = torch.rand(-(-n // 128), -(-k // 128), device="cuda", generator=g) + 0.5
    return a, b, one, sa_blk, sb_blk


def _series(a, b, one, sa_blk, sb_blk) -> dict:
    """The compared calls (SERIES) on one problem's operands: rtckern per-tensor and block-scaled, torch._scaled_mm."""
    import torch

    from rtckern import ops

    return {"rtckern per-tensor": lambda: ops.gemm_fp8(a, b, one, one),
            "rtckern block": lambda: ops.gemm_fp8(a, b, sa_blk, sb_blk),
            "torch._scaled_mm": lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)}


def reps_of(args) -> int:
    return 10 if args.quick else args.reps


def run(args):
    import torch

    from benchmarks.attention_kvcache import graphed_seconds
    from rtckern import ops

    reps = reps_of(args)
    shapes = ((4096, 4096, 4096), (128, 28672, 8192)) if args.quick else SHAPES
    rows = []
    for m, n, k in shapes:
        a, b, one, sa_blk, sb_blk = _operands(m, n, k)
        flops = 2.0 * m * n * k
        res = {}
        runs = _series(a, b, one, sa_blk, sb_blk)
        for name, fn in runs.items():
            try:
                res[name] = flops / (_time_ms(fn, reps) * 1e-3) / 1e12
            except Exception as e:  # one path failing must not lose the others
                print(f"{name} failed at {m}x{n}x{k}: {type(e).__name__}: {e}", flush=True)
        rows.append({"m": m, "n": n, "k": k, "tflops": res})
        print(f"{m}x{n}x{k}: " + ", ".join(f"{k_}={v:.0f}" for k_, v in res.items()), flush=True)
        runs.clear()  # the lambdas hold a and b
        torch.cuda.empty_cache()
    sustain = 0.0 if args.quick else args.sustain
    urows = _sustained([s for s in shapes if s[0] >= 4096], sustain) if sustain > 0 else []
    copy = _copy_gbs()
    drows = _decode(DECODE[:2] if args.quick else DECODE, reps, copy)
    srows = _small_decode(SMALL[:2] if args.quick else SMALL, copy)
    prows = _sm89_prefill(PREFILL[:1] if args.quick else PREFILL, reps)
    qrows = []
    for m, k in ((4096, 7168), (16384, 7168)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        nbytes = m * k * 2 + m * k + m * (k // 128) * 4  # bf16 in; e4m3 and fp32 group scales out
        for op, fn in (("quantize_fp8", lambda: ops.quantize_fp8(x, 128)),
                       ("rms_norm_quant", lambda: ops.rms_norm_quant(x, w, 1e-6, group=128))):
            # GPU time from CUDA-graph replays: a call moves 90-350 MB in 30-120 us, close to its host cost, so
            # events around single eager calls timed the host as much as the kernel (0.68-0.98x copy between runs)
            ms = graphed_seconds([fn] * 8) * 1e3
            qrows.append({"op": op, "m": m, "k": k, "gbs": (nbytes + (k * 2 if op == "rms_norm_quant" else 0))
                          / (ms * 1e-3) / 1e9, "copy_gbs": copy})

    return to_result(rows, qrows, reps, drows, prows, srows, urows)


def _sustained(shapes, seconds: float) -> list[dict]:
    """Per shape and series: TFLOP/s over `seconds` of back-to-back calls, with the mean SM clock (MHz) and board
    power (W) NVML read over the last two thirds of them; two rounds, the series' order reversed in the second."""
    import threading
    import time

    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
        # by UUID: NVML numbers the GPUs in PCI order whatever CUDA_VISIBLE_DEVICES and CUDA's order say
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid)
    except Exception as e:  # no NVML, or the device not found in it: TFLOP/s without clocks
        print(f"sustained: no NVML handle for this GPU ({type(e).__name__}: {e}); clocks and power not sampled",
              flush=True)
        handle = None

    def run_for(fn, flops: float) -> dict:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        samples, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                samples.append((pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                                pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3))
                time.sleep(0.02)
        sampler = threading.Thread(target=sample, daemon=True) if handle is not None else None
        if sampler is not None:
            sampler.start()
        try:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            calls, t0 = 0, time.perf_counter()
            start.record()
            while time.perf_counter() - t0 < seconds:
                for _ in range(10):
                    fn()
                calls += 10
                torch.cuda.synchronize()
            end.record()
            end.synchronize()
        finally:  # a call that raises stops the sampling too
            stop.set()
            if sampler is not None:
                sampler.join()
        out = {"tflops": flops * calls / (start.elapsed_time(end) * 1e-3) / 1e12}
        late = samples[len(samples) // 3:]
        if late:
            out["mhz"] = statistics.fmean(c for c, _ in late)
            out["watts"] = statistics.fmean(w for _, w in late)
        return out

    rows = []
    for m, n, k in shapes:
        a, b, one, sa_blk, sb_blk = _operands(m, n, k)
        runs = _series(a, b, one, sa_blk, sb_blk)
        rounds: dict[str, list[dict]] = {name: [] for name in runs}
        for order in (list(runs), list(runs)[::-1]):
            for name in order:
                try:
                    rounds[name].append(run_for(runs[name], 2.0 * m * n * k))
                except Exception as e:  # one path failing must not lose the others
                    print(f"sustained {name} failed at {m}x{n}x{k}: {type(e).__name__}: {e}", flush=True)
        # the fields every round has (a round whose sampler read nothing has no clock or power)
        res = {name: {f: statistics.fmean(r[f] for r in got) for f in got[0] if all(f in r for r in got)}
               for name, got in rounds.items() if got}
        rows.append({"m": m, "n": n, "k": k, "seconds": seconds, "series": res})
        print(f"sustained {m}x{n}x{k}: " + ", ".join(
            f"{name}={v['tflops']:.0f} TFLOP/s" + (f" at {v['mhz']:.0f} MHz, {v['watts']:.0f} W" if "mhz" in v else "")
            for name, v in res.items()), flush=True)
        runs.clear()
        torch.cuda.empty_cache()
    return rows


# decode on small weights (Llama-3.1-8B's attention projections and down projection, DeepSeek-V3's smaller ones),
# which the L2 would hold between back-to-back calls: each call reads the next of enough copies of the weight to exceed
# the L2 twice over (a model's other layers evict a layer's weight between its calls), timed as CUDA-graph replays.
# M = 8 and 32 on the weights of 64-96 row blocks of 64, where the streaming kernel ranks first from 2/5 of the SMs;
# M = 64 there, on the tile kernel's rows tuned with the weight read from device memory (tune.weight_copies).
SMALL = ((1, 4096, 4096), (1, 6144, 4096), (1, 4096, 7168), (1, 2112, 7168), (1, 7168, 2048), (1, 1024, 4096),
         (8, 4096, 4096), (8, 6144, 4096), (8, 4096, 14336), (32, 4096, 7168), (64, 4096, 4096), (64, 7168, 2048))
SMALL_ROTATION_BYTES = 200 << 20


def _small_decode(shapes, copy: float) -> list[dict]:
    """Per shape: us per call and GB/s of the kernel the registry picks, the GEMV, tile and streaming kernels forced,
    and torch._scaled_mm, each over rotating copies of b."""
    import torch

    from benchmarks.attention_kvcache import graphed_seconds
    from rtckern import config, ops
    from rtckern.registry import explain

    out = []
    for m, n, k in shapes:
        us = {}
        try:
            a, b, one, _, _ = _operands(m, n, k)
            bs = [b] + [b.clone() for _ in range(-(-SMALL_ROTATION_BYTES // (n * k)) - 1)]

            def gemm(w):
                return ops.gemm_fp8(a, w, one, one)
            forced = (GEMV, TILE, STREAM) if m == 1 else (TILE, STREAM)
            series = {"rtckern": (None, gemm), **{s: (SMALL_FORCED[s], gemm) for s in forced},
                      "torch._scaled_mm": (None, lambda w: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one,
                                                                            out_dtype=torch.bfloat16))}
            for name, (impl, call) in series.items():
                try:
                    with config.override(force_impl={"gemm_fp8": impl}) if impl else contextlib.nullcontext():
                        us[name] = graphed_seconds([lambda w=w: call(w) for w in bs]) * 1e6
                except Exception as e:  # the tile or streaming kernel forced off sm_90
                    print(f"{name} failed at {m}x{n}x{k}: {type(e).__name__}: {e}", flush=True)
            chosen = explain("gemm_fp8", shape=(m, n, k), device=0).chosen
        except Exception as e:  # one shape failing must not lose the run
            print(f"small decode failed at {m}x{n}x{k}: {type(e).__name__}: {e}", flush=True)
            chosen = None
        out.append({"m": m, "n": n, "k": k, "us": us, "copy_gbs": copy, "chosen": chosen})
        print(f"small decode {m}x{n}x{k}: " + ", ".join(f"{k_}={v:.1f} us" for k_, v in us.items()), flush=True)
        torch.cuda.empty_cache()
    return out


PREFILL = ((4096, 4096, 4096), (1024, 7168, 18432))
MMA = "sm89_mma per-tensor"  # gemm_fp8.sm89_mma forced (M > 64): sm_89's prefill kernel


def _sm89_prefill(shapes, reps: int) -> list[dict]:
    """Per shape: TFLOP/s of sm_89's two kernels for M > 64, forced (on sm_90 the wgmma kernel ranks first)."""
    import torch

    from rtckern import config, ops

    out = []
    for m, n, k in shapes:
        tflops = {}
        try:
            a, b, one, _, _ = _operands(m, n, k)
            for name, impl, r in ((MMA, "gemm_fp8.sm89_mma", reps), (SIMT, "gemm_fp8.simt", 3)):
                with config.override(force_impl={"gemm_fp8": impl}):
                    tflops[name] = 2.0 * m * n * k / (_time_ms(lambda: ops.gemm_fp8(a, b, one, one), r) * 1e-3) / 1e12
        except Exception as e:  # one shape failing (or out of memory) must not lose the run
            print(f"sm89 prefill failed at {m}x{n}x{k}: {type(e).__name__}: {e}", flush=True)
        out.append({"m": m, "n": n, "k": k, "tflops": tflops})
        print(f"sm89 prefill {m}x{n}x{k}: " + ", ".join(f"{k_}={v:.1f}" for k_, v in tflops.items()), flush=True)
        torch.cuda.empty_cache()
    return out


def _decode(shapes, reps: int, copy: float) -> list[dict]:
    """Per decode shape: GB/s (a + b + c bytes per second) of both rtckern scalings, torch._scaled_mm and each kernel
    of FORCED forced."""
    out: list[dict] = []
    # the forced sm_89 kernels (LATE) in a pass of their own after the others, so that their slower calls do not
    # precede the other series' timings
    for late_pass in (False, True):
        for m, n, k in shapes:
            _decode_shape(out, late_pass, m, n, k, reps, copy)
    return out


def _decode_shape(out: list, late_pass: bool, m: int, n: int, k: int, reps: int, copy: float) -> None:
    """One shape's timings: a row of the series sm_90 runs (appended to out), or with late_pass the forced sm_89
    kernels' (LATE) added to the shape's row."""
    import torch

    from rtckern import config

    try:
        a, b, one, sa_blk, sb_blk = _operands(m, n, k)
    except Exception as e:  # out of memory on a smaller GPU: the other shapes still run
        print(f"decode {m}x{n}x{k}: operands failed: {type(e).__name__}: {e}", flush=True)
        if not late_pass:
            out.append({"m": m, "n": n, "k": k, "gbs": {}, "copy_gbs": copy})
        return
    nbytes = n * k + m * k + m * n * 2
    runs = _series(a, b, one, sa_blk, sb_blk)
    per_tensor = runs["rtckern per-tensor"]
    runs.update(dict.fromkeys(FORCED, per_tensor))  # each forced kernel: the per-tensor call
    gbs = {} if not late_pass else next(d for d in out if (d["m"], d["n"], d["k"]) == (m, n, k))["gbs"]
    for name, fn in runs.items():
        if (name in LATE) != late_pass:
            continue
        try:
            if name in FORCED:  # a kernel forced; the rtckern columns are the registry's pick
                if m > FORCED_MAX_M[name]:
                    continue
                with config.override(force_impl={"gemm_fp8": FORCED[name]}):
                    gbs[name] = nbytes / (_time_ms(fn, 5 if name == SIMT else reps) * 1e-3) / 1e9
                continue
            gbs[name] = nbytes / (_time_ms(fn, reps) * 1e-3) / 1e9
        except Exception as e:
            print(f"{name} failed at {m}x{n}x{k}: {type(e).__name__}: {e}", flush=True)
    if not late_pass:
        out.append({"m": m, "n": n, "k": k, "gbs": gbs, "copy_gbs": copy})
    print(f"decode {m}x{n}x{k}: " + ", ".join(f"{k_}={v / copy:.2f}x copy" for k_, v in gbs.items()),
          flush=True)
    runs.clear()
    torch.cuda.empty_cache()


SERIES = ("rtckern per-tensor", "rtckern block", "torch._scaled_mm")
TILE = "tile per-tensor"  # gemm_fp8.sm90a_wgmma forced (M <= 64)
STREAM = "stream per-tensor"  # gemm_fp8.sm90a_stream forced (M <= 64)
SKINNY = "skinny per-tensor"  # gemm_fp8.sm89_skinny forced (M <= 64): the decode kernel sm_89 runs
SIMT = "simt per-tensor"  # gemm_fp8.simt forced (M <= 16): the CUDA-core fallback sm_89 ran before it
GEMV = "gemv per-tensor"  # gemm_fp8.gemv forced (M = 1; the small-weight table's series too)
FORCED = {TILE: "gemm_fp8.sm90a_wgmma", STREAM: "gemm_fp8.sm90a_stream", GEMV: "gemm_fp8.gemv",
          SKINNY: "gemm_fp8.sm89_skinny", SIMT: "gemm_fp8.simt"}
FORCED_MAX_M = {TILE: 64, STREAM: 64, GEMV: 1, SKINNY: 64, SIMT: 16}
LATE = (SKINNY, SIMT)  # timed in a second pass over the shapes
SMALL_FORCED = {GEMV: "gemm_fp8.gemv", TILE: FORCED[TILE], STREAM: FORCED[STREAM]}


def to_result(rows: list[dict], qrows: list[dict], reps: int, drows: list[dict] | None = None,
              prows: list[dict] | None = None, srows: list[dict] | None = None,
              urows: list[dict] | None = None) -> Result:
    def ratio(t, a_, b_):
        return f"{t[a_] / t[b_]:.2f}x" if a_ in t and b_ in t else None
    table = Table(["M", "N", "K", "rtckern per-tensor", "rtckern block", "torch._scaled_mm", "per-tensor / torch",
                   "block / torch"],
                  [[r["m"], r["n"], r["k"], *[f"{r['tflops'][c]:.0f}" if c in r["tflops"] else None for c in SERIES],
                    ratio(r["tflops"], "rtckern per-tensor", "torch._scaled_mm"),
                    ratio(r["tflops"], "rtckern block", "torch._scaled_mm")] for r in rows], title="gemm_fp8 TFLOP/s")
    qtable = Table(["op", "M", "K", "GB/s", "copy GB/s", "fraction of copy"],
                   [[q.get("op", "quantize_fp8"), q["m"], q["k"], f"{q['gbs']:.0f}", f"{q['copy_gbs']:.0f}",
                     f"{q['gbs'] / q['copy_gbs']:.2f}"] for q in qrows],
                   title="quantize_fp8 and the fused rms_norm_quant (bf16 in; e4m3 and fp32 scales out, group 128; "
                         "bytes in + out)")
    drows = drows or []
    dseries = SERIES + (TILE, STREAM, GEMV, SKINNY, SIMT)
    dtable = Table(["M", "N", "K", *[f"{c} GB/s" for c in dseries], "copy GB/s",
                    *[f"{c} / copy" for c in dseries if c != "torch._scaled_mm"]],
                   [[d["m"], d["n"], d["k"], *[f"{d['gbs'][c]:.0f}" if c in d["gbs"] else None for c in dseries],
                     f"{d['copy_gbs']:.0f}",
                     *[f"{d['gbs'][c] / d['copy_gbs']:.2f}" if c in d["gbs"] else None
                       for c in dseries if c != "torch._scaled_mm"]]
                    for d in drows],
                   title="decode range (M = 1..64): bytes moved (a + b + c) per second against the copy bandwidth "
                         "(the memory-bound roofline; goal 0.9)")
    srows = srows or []
    sseries = ("rtckern", GEMV, TILE, STREAM, "torch._scaled_mm")

    def gbs(s, c):
        nbytes = s["n"] * s["k"] + s["m"] * (s["k"] + 2 * s["n"])
        return f"{nbytes / (s['us'][c] * 1e-6) / 1e9:.0f}" if c in s["us"] else None
    stable = Table(["M", "N", "K", "rtckern kernel", *[f"{c} us" for c in sseries], *[f"{c} GB/s" for c in sseries],
                    "copy GB/s", "tile / gemv time"],
                   [[s["m"], s["n"], s["k"], s.get("chosen"),
                     *[f"{s['us'][c]:.1f}" if c in s["us"] else None for c in sseries],
                     *[gbs(s, c) for c in sseries], f"{s['copy_gbs']:.0f}", ratio(s["us"], TILE, GEMV)]
                    for s in srows],
                   title="decode on small weights (per-tensor, bf16 out; CUDA-graph replays over rotating copies "
                         "of b, 200 MB in all)")
    prows = prows or []
    ptable = Table(["M", "N", "K", f"{MMA} TFLOP/s", f"{SIMT} TFLOP/s", "sm89_mma / simt"],
                   [[p["m"], p["n"], p["k"], *[f"{p['tflops'][c]:.1f}" if c in p["tflops"] else None
                                               for c in (MMA, SIMT)],
                     ratio(p["tflops"], MMA, SIMT)] for p in prows],
                   title="prefill on sm_89's kernels, forced on this GPU (sm_89 runs them; sm_90 the wgmma kernel)")
    urows = urows or []

    def sustained_cells(u, c):
        v = u["series"].get(c)
        if v is None:
            return [None, None, None, None]
        ghz = v.get("mhz", 0) / 1e3
        return [f"{v['tflops']:.0f}", f"{v['mhz']:.0f}" if "mhz" in v else None,
                f"{v['watts']:.0f}" if "watts" in v else None, f"{v['tflops'] / ghz:.0f}" if ghz else None]

    def sustained_ratio(u, c, field="tflops"):
        s_, t_ = u["series"].get(c), u["series"].get("torch._scaled_mm")
        if not s_ or not t_:
            return None
        if field == "tflops":
            return f"{s_['tflops'] / t_['tflops']:.2f}x"
        if "mhz" not in s_ or "mhz" not in t_:
            return None
        return f"{(s_['tflops'] / s_['mhz']) / (t_['tflops'] / t_['mhz']):.2f}x"
    utable = Table(["M", "N", "K", *[f"{c} {f}" for c in SERIES for f in ("TFLOP/s", "MHz", "W", "TFLOP/s per GHz")],
                    "per-tensor / torch", "block / torch", "per-tensor / torch per clock", "block / torch per clock"],
                   [[u["m"], u["n"], u["k"], *[x for c in SERIES for x in sustained_cells(u, c)],
                     sustained_ratio(u, "rtckern per-tensor"), sustained_ratio(u, "rtckern block"),
                     sustained_ratio(u, "rtckern per-tensor", "clock"), sustained_ratio(u, "rtckern block", "clock")]
                    for u in urows],
                   title=f"sustained at the power limit ({urows[0]['seconds']:g} s of back-to-back calls each, two "
                         "rounds; NVML's SM clock and board power over the last two thirds)" if urows else "")
    note = (f"e4m3 inputs, bf16 output; median of {reps} CUDA-event timings of back-to-back calls (quantization: "
            "CUDA-graph replays); torch._scaled_mm "
            "with per-tensor scales (its fastest form).")
    return Result("fp8 GEMM and quantization", rows=rows,
                  body=[note, table] + ([utable] if urows else []) + ([dtable] if drows else [])
                  + ([stable] if srows else [])
                  + ([ptable] if prows else []) + [qtable],
                  data={"quantize": qrows, **({"decode": drows} if drows else {}),
                        **({"sustained": urows} if urows else {}),
                        **({"small_decode": srows} if srows else {}), **({"sm89_prefill": prows} if prows else {})},
                  plot=lambda plt, meta: plot(plt, meta, rows, qrows))


def render(payload: dict) -> Result:
    return to_result(payload["rows"], payload["quantize"], reps_of(recorded_args(payload)), payload.get("decode"),
                     payload.get("sm89_prefill"), payload.get("small_decode"), payload.get("sustained"))


def plot(plt, meta: dict, rows: list[dict], qrows: list[dict]):
    """TFLOP/s per shape (rtckern's two scalings against torch._scaled_mm), and quantize_fp8 against a copy."""
    fig, (ax, qax) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(SERIES)
    for i, name in enumerate(SERIES):
        xs = [j + (i - 1) * width for j, r in enumerate(rows) if name in r["tflops"]]
        ax.bar(xs, [r["tflops"][name] for r in rows if name in r["tflops"]], width=width, label=name)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['m']}x{r['n']}x{r['k']}" for r in rows], fontsize=8)
    ax.set_ylabel("TFLOP/s (2 M N K / time)")
    ax.set_title("gemm_fp8, e4m3 in, bf16 out")
    ax.legend(fontsize=8)
    qax.bar([f"{q.get('op', 'quantize_fp8').replace('_', ' ')}\n{q['m']}x{q['k']}" for q in qrows],
            [q["gbs"] / q["copy_gbs"] for q in qrows], color="tab:purple")
    qax.axhline(1.0, color="k", lw=1)
    qax.set_ylim(0, 1.1)
    qax.set_ylabel("GB/s / device copy GB/s")
    qax.set_title("quantize (group 128)")
    qax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"fp8 GEMM and quantization on {gpu_name(meta)}")
    fig.tight_layout()
    return fig
