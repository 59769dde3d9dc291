"""Attention over a KV cache (serving): decode bandwidth, chunked prefill TFLOP/s and host cost of
rtckern.ops.attention_with_kvcache against torch SDPA and the dense op.

    python -m benchmarks attention_kvcache [--quick] [--max-cache-gb 16]

Decode points: bf16, head dim 128, seqlen_q 1, 32 q heads over 4 kv heads (GQA 8:1) and over 8 (4:1), batch
1/8/64/256 x context 1k/8k/32k/128k (every sequence full), caches over --max-cache-gb skipped. Layouts: contiguous
(batch, context, kv heads, 128), paged with pages of 16 and 64 tokens (block table shuffled). Series: rtckern
(num_splits chosen), rtckern_nosplit (num_splits=1, contiguous), sdpa (torch's scaled_dot_product_attention with
enable_gqa on the same contiguous cache, (batch, heads, seq, dim) views), rtckern_fp8 (a contiguous float8_e4m3fn
cache with per-kv-head scales, num_splits chosen: half the bytes). GB/s = K and V bytes read / kernel time (the fp8
series: its e4m3 bytes); "fp8 speedup" = the bf16 contiguous cache's time / the fp8 cache's;
the ratio column divides by the device's copy bandwidth measured in the same run (a 1 GiB device copy, read +
write bytes). Kernel time: a CUDA graph of calls cycling through enough copies of the cache that together exceed
the L2 several times (no call finds its cache in L2), replayed 5 times, median per call.

Chunked prefill points: 512 new query tokens (causal, bottom-right) onto a cache of 4k/8k/32k tokens (batch 1, the
same heads): rtckern's TFLOP/s (paged 64) against the dense op on the same keys (ops.attention with q of 512 rows
and the 4k-32k keys), work 4 h d (512 ctx - 512 * 511 / 2); GPU time from CUDA-graph replays, and eager calls
queued back to back beside it (at 4k the host's work between the long-query path's launches can show there).

Host cost: wall time per eager call over 300 calls at batch 1 / context 1k (GPU work a few microseconds, so the
host's cost decides), rtckern against SDPA.
"""
from __future__ import annotations

import math
import statistics
import time

from benchmarks.runner import Result, Table, gpu_name

QUICK = "GQA 8:1, contiguous and paged 16, batch 1/64, context 8k/32k; no prefill"
HD = 128
HQ = 32
L2_FACTOR = 192 << 20  # bytes the cycled caches cover together (about 4x an H100's L2)


def add_args(ap) -> None:
    ap.add_argument("--max-cache-gb", type=float, default=16.0, help="skip decode points whose K+V cache is larger")


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write bytes)."""
    import torch

    a = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return 2 * a.numel() * 2 / statistics.median(ts) / 1e9


def graphed_seconds(calls) -> float:
    """Seconds per call of a list of zero-argument calls captured in one CUDA graph (median of 5 replays)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    from benchmarks.attention import warm

    warm(g.replay, 3)  # clocks up before the timed replays (benchmarks.attention.warm)
    ts = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3 / len(calls))
    return statistics.median(ts)


def decode_points(quick: bool):
    pts = []
    for hk in ((4,) if quick else (4, 8)):
        for batch in ((1, 64) if quick else (1, 8, 64, 256)):
            for ctx in ((8192, 32768) if quick else (1024, 8192, 32768, 131072)):
                pts.append(dict(hk=hk, batch=batch, ctx=ctx))
    return pts


def make_caches(batch, ctx, hk, page, copies):
    """`copies` (k, v, block_table) triples of full caches of `ctx` tokens per sequence."""
    import torch

    out = []
    for i in range(copies):
        if page is None:
            k = torch.randn(batch, ctx, hk, HD, device="cuda", dtype=torch.bfloat16)
            out.append((k, torch.randn_like(k), None))
        else:
            per = ctx // page
            k = torch.randn(batch * per, page, hk, HD, device="cuda", dtype=torch.bfloat16)
            table = torch.randperm(batch * per, device="cuda").to(torch.int32).view(batch, per)
            out.append((k, torch.randn_like(k), table))
    return out


def fp8_caches(batch, ctx, hk, copies):
    """`copies` contiguous e4m3 (k, v) caches with per-kv-head scales (k_scale, v_scale)."""
    import torch

    out = []
    for _ in range(copies):
        k = torch.randn(batch, ctx, hk, HD, device="cuda").to(torch.float8_e4m3fn)
        out.append((k, torch.randn(batch, ctx, hk, HD, device="cuda").to(torch.float8_e4m3fn),
                    torch.full((hk,), 0.02, device="cuda"), torch.full((hk,), 0.02, device="cuda")))
    return out


def decode_row(p, layouts, copy_gbs, max_bytes):
    import torch
    import torch.nn.functional as F

    from rtckern import ops

    batch, ctx, hk = p["batch"], p["ctx"], p["hk"]
    nbytes = 2 * batch * ctx * hk * HD * 2
    if nbytes > max_bytes:
        return None
    copies = max(1, min(64, -(-L2_FACTOR // nbytes)))
    reps = max(copies, 8)
    q = torch.randn(batch, 1, HQ, HD, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    row = dict(p, cache_mb=round(nbytes / 2**20, 1), copies=copies, us={}, gbs={})
    for layout, page in layouts:
        caches = make_caches(batch, ctx, hk, page, copies)
        series = {f"rtckern_{layout}": 0}
        if page is None:
            series["rtckern_nosplit"] = 1
        for name, splits in series.items():
            calls = [(lambda c=caches[i % copies], s=splits: ops.attention_with_kvcache(q, c[0], c[1], lens,
                                                                                        block_table=c[2],
                                                                                        num_splits=s))
                     for i in range(reps)]
            row["us"][name] = graphed_seconds(calls) * 1e6
            if splits == 0:
                row.setdefault("splits", {})[layout] = chosen_splits(q, caches[0], lens)
        if page is None:
            qt = q.transpose(1, 2)

            def sdpa(c):
                return F.scaled_dot_product_attention(qt, c[0].transpose(1, 2), c[1].transpose(1, 2), enable_gqa=True)
            calls = [(lambda c=caches[i % copies]: sdpa(c)) for i in range(reps)]
            try:
                row["us"]["sdpa"] = graphed_seconds(calls) * 1e6
            except Exception as e:  # report and go on
                print(f"sdpa failed at {p}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        del caches
        torch.cuda.empty_cache()
    fp8_copies = max(1, min(64, -(-L2_FACTOR // (nbytes // 2))))
    caches = fp8_caches(batch, ctx, hk, fp8_copies)
    calls = [(lambda c=caches[i % fp8_copies]: ops.attention_with_kvcache(q, c[0], c[1], lens, k_scale=c[2],
                                                                         v_scale=c[3]))
             for i in range(max(fp8_copies, 8))]
    row["us"]["rtckern_fp8"] = graphed_seconds(calls) * 1e6
    del caches, calls
    torch.cuda.empty_cache()
    for name, us in row["us"].items():
        row["gbs"][name] = (nbytes // 2 if name == "rtckern_fp8" else nbytes) / (us * 1e-6) / 1e9
    row["vs_copy"] = {n: g / copy_gbs for n, g in row["gbs"].items()}
    return row


def chosen_splits(q, cache, lens) -> int:
    """The split count the op's plan chose for this call signature (num_splits=0)."""
    from rtckern.ops._attention import kvcache as kv

    k, v, table = cache
    key = kv._key(q, k, v, lens, table, None, None, True, None, 0, False)
    return kv.plans.get(key).splits


def prefill_rows():
    import torch

    from benchmarks.attention import time_ms
    from rtckern import ops

    rows = []
    sq, hk, page = 512, 4, 64
    for ctx in (4096, 8192, 32768):
        q = torch.randn(1, sq, HQ, HD, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(ctx // page, page, hk, HD, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        table = torch.arange(ctx // page, device="cuda", dtype=torch.int32).view(1, -1)
        lens = torch.full((1,), ctx, dtype=torch.int32, device="cuda")
        kd, vd = k.reshape(1, ctx, hk, HD), v.reshape(1, ctx, hk, HD)
        work = 4.0 * HQ * HD * (sq * ctx - sq * (sq - 1) / 2)
        calls = {"rtckern_paged64": lambda: ops.attention_with_kvcache(q, k, v, lens, block_table=table),
                 "dense_op": lambda: ops.attention(q, kd, vd, causal=True)}
        # GPU time per call from CUDA-graph replays (the kernels' throughput, as for the decode points); the eager
        # time, where host work between the long-query path's launches can show, beside it
        ms = {n: graphed_seconds([fn] * 8) * 1e3 for n, fn in calls.items()}
        eager_ms = {n: time_ms(fn)[0] for n, fn in calls.items()}
        rows.append(dict(kind="prefill", sq=sq, ctx=ctx, hk=hk, ms=ms, eager_ms=eager_ms,
                         tflops={n: work / (m * 1e-3) / 1e12 for n, m in ms.items()},
                         eager_tflops={n: work / (m * 1e-3) / 1e12 for n, m in eager_ms.items()}))
        print(f"prefill 512 onto {ctx}: " + " ".join(f"{n}={t:.0f}" for n, t in rows[-1]["tflops"].items()),
              flush=True)
    return rows


def host_cost():
    import torch
    import torch.nn.functional as F

    from rtckern import ops

    q = torch.randn(1, 1, HQ, HD, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 1024, 4, HD, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.full((1,), 1024, dtype=torch.int32, device="cuda")
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = {}
    for name, fn in (("rtckern", lambda: ops.attention_with_kvcache(q, k, v, lens)),
                     ("sdpa", lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        walls = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(300):
                fn()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) / 300 * 1e6)
        out[name] = statistics.median(walls)
    return out


def run(args):
    copy_gbs = copy_bandwidth()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    layouts = [("contiguous", None), ("paged16", 16)] + ([] if args.quick else [("paged64", 64)])
    rows = []
    for p in decode_points(args.quick):
        r = decode_row(p, layouts, copy_gbs, args.max_cache_gb * 2**30)
        if r is None:
            continue
        r["kind"] = "decode"
        rows.append(r)
        print(f"decode hk{p['hk']} batch {p['batch']} ctx {p['ctx']} ({r['cache_mb']} MB): " +
              " ".join(f"{n}={g:.0f}" for n, g in r["gbs"].items()), flush=True)
    if not args.quick:
        rows += prefill_rows()
    host = host_cost()
    print(f"host cost per call (us): {host}", flush=True)
    return to_result(rows, copy_gbs, host)


def to_result(rows: list[dict], copy_gbs: float, host: dict) -> Result:
    return Result("Attention over a KV cache: decode bandwidth, chunked prefill, host cost", rows=rows,
                  body=body(rows, copy_gbs, host), data={"copy_gbs": copy_gbs, "host_us": host},
                  plot=plot_fn(rows, copy_gbs))


def render(payload: dict) -> Result:
    return to_result(payload["rows"], payload["copy_gbs"], payload["host_us"])


def body(rows, copy_gbs, host) -> list:
    dec = [r for r in rows if r["kind"] == "decode"]
    names = []
    for r in dec:
        names += [n for n in r["gbs"] if n not in names]

    def ratio(r, a, b):
        return f"{r['gbs'][a] / r['gbs'][b]:.2f}x" if a in r["gbs"] and b in r["gbs"] else None

    def fp8(r, what):
        if "rtckern_fp8" not in r.get("us", {}):  # older result sets have no fp8 series
            return None
        if what == "copy":
            return f"{r['vs_copy']['rtckern_fp8']:.2f}"
        return f"{r['us']['rtckern_contiguous'] / r['us']['rtckern_fp8']:.2f}x"

    t1 = Table(["GQA", "batch", "context", "cache MB", *[f"{n} GB/s" for n in names],
                "best rtckern / copy", "rtckern contiguous / sdpa", "fp8 / copy", "fp8 speedup"],
               [[f"{HQ}:{r['hk']}", r["batch"], r["ctx"], r["cache_mb"],
                 *[f"{r['gbs'][n]:.0f}" if n in r["gbs"] else None for n in names],
                 f"{max(v for n, v in r['vs_copy'].items() if n.startswith('rtckern') and n != 'rtckern_fp8'):.2f}",
                 ratio(r, "rtckern_contiguous", "sdpa"), fp8(r, "copy"), fp8(r, "speedup")] for r in dec],
               title="Decode (seqlen_q 1, head dim 128, q bf16; cache bf16, or e4m3 for rtckern_fp8)")
    pre = [r for r in rows if r["kind"] == "prefill"]
    def eager(r):  # older result sets timed eager calls only
        e = r.get("eager_tflops")
        return (f"{e['rtckern_paged64']:.0f}", f"{e['dense_op']:.0f}") if e else (None, None)

    t2 = Table(["seqlen_q", "context", "rtckern paged64 TFLOP/s", "dense op TFLOP/s", "ratio",
                "eager: rtckern TFLOP/s", "eager: dense op TFLOP/s"],
               [[r["sq"], r["ctx"], f"{r['tflops']['rtckern_paged64']:.0f}", f"{r['tflops']['dense_op']:.0f}",
                 f"{r['tflops']['rtckern_paged64'] / r['tflops']['dense_op']:.2f}x", *eager(r)] for r in pre],
               title="Chunked prefill (causal, GQA 8:1, head dim 128, bf16; GPU time from CUDA-graph replays, and "
                     "eager calls queued back to back)")
    note = (f"Copy bandwidth of this GPU in this run: {copy_gbs:.0f} GB/s. Host cost per eager call (batch 1, "
            f"context 1k): rtckern {host.get('rtckern', 0):.1f} us, SDPA {host.get('sdpa', 0):.1f} us.")
    return [note, t1] + ([t2] if pre else [])


def plot_fn(rows, copy_gbs: float):
    dec = [r for r in rows if r["kind"] == "decode" and r["hk"] == 4]
    if not dec:
        return None

    def plot(plt, meta):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for i, batch in enumerate(sorted({r["batch"] for r in dec})):  # one color per batch: rtckern solid, SDPA dashed
            pts = sorted((r["ctx"], r) for r in dec if r["batch"] == batch)
            xs = [c for c, _ in pts]
            for name, style in (("rtckern_paged16", "-o"), ("sdpa", "--x")):
                ys = [r["gbs"].get(name, math.nan) for _, r in pts]
                ax.plot(xs, ys, style, color=plt.cm.tab10(i), label=f"{name} batch {batch}")
        ax.axhline(copy_gbs, color="k", lw=1, label="device copy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("K+V GB/s")
        ax.set_title(f"decode, GQA 32:4, head dim 128, bf16 on {gpu_name(meta)}")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        return fig
    return plot
