"""Core service: copy bandwidth, hot-path launch cost against cuda.core / CuPy / torch, compile and cache timings.

    python -m benchmarks core
"""

from __future__ import annotations

import statistics
import tempfile
import time

import numpy as np

from benchmarks.env import legacy_meta
from benchmarks.runner import Result, Table, gpu_name, stored_data


def copy_bandwidth(torch, nbytes=4 << 30, reps=20) -> float:
    """Device-to-device copy in GB/s, counting bytes read plus bytes written (median of reps)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    t = statistics.median(times)
    del src, dst
    return 2 * (nbytes // 2) / t / 1e9


def per_call_us(fns: dict, n=20000, rounds=7) -> dict:
    """Host cost per launch of each {name: (fn, sync)}: n back-to-back launches of an empty kernel per round, the
    launchers taking turns round by round (the host's drift, which moved these timings by 20% between runs, then falls
    on every launcher alike); the median of rounds, in us."""
    for fn, sync in fns.values():
        for _ in range(1000):
            fn()
        sync()
    res: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, (fn, sync) in fns.items():
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            res[name].append((time.perf_counter() - t0) / n * 1e6)
    return {name: statistics.median(v) for name, v in res.items()}


def run(args) -> Result:
    import torch
    from cuda.core import LaunchConfig, launch

    from rtckern.arch import Arch
    from rtckern.device import DeviceInfo
    from rtckern.manager import KernelManager
    from rtckern.spec import KernelSpec

    torch.cuda.init()
    dev = DeviceInfo.from_device(0)
    arch = Arch(dev.arch.major, dev.arch.minor)
    results: dict = {"device": dev.describe()}

    results["copy_gbps"] = round(copy_bandwidth(torch), 1)

    # --- compile and cache timings ---
    with tempfile.TemporaryDirectory() as d:
        specs = [KernelSpec("core/axpy.cuh", "axpy", arch, template_args=(t,)) for t in ("float", "rtk_half", "rtk_bf16")]
        m = KernelManager(d)
        cold = []
        for s in specs:
            t0 = time.perf_counter()
            m.compile(s)
            cold.append((time.perf_counter() - t0) * 1e3)
        warm = []
        for s in specs:
            m2 = KernelManager(d)  # fresh process-like manager: memory empty, disk warm
            t0 = time.perf_counter()
            m2.get(s, 0)
            warm.append((time.perf_counter() - t0) * 1e3)
        m2.get(specs[-1], 0)
        n = 100000
        t0 = time.perf_counter()
        for _ in range(n):
            m2.get(specs[-1], 0)
        mem_us = (time.perf_counter() - t0) / n * 1e6
        results["cold_compile_ms"] = [round(x, 1) for x in cold]
        results["warm_disk_load_ms"] = [round(x, 3) for x in warm]
        results["memory_hit_us"] = round(mem_us, 3)

        # --- launch cost ---
        mgr = KernelManager(d)
        k0 = mgr.get(KernelSpec("core/axpy.cuh", "noop0", arch), 0)
        k8 = mgr.get(KernelSpec("core/axpy.cuh", "noop8", arch), 0)
        buf = torch.zeros(16, device="cuda")
        p = buf.data_ptr()
        args8 = (p, p, p, p, 1, 2, np.float32(1.0), np.float32(2.0))
        stream = torch.cuda.current_stream()
        sh = stream.cuda_stream
        sync = torch.cuda.synchronize
        from rtckern.runtime.streams import core_stream

        cs = core_stream(sh)
        cfg = LaunchConfig(grid=1, block=32)
        import cupy

        src = "extern \"C\" __global__ void noop8(float* out, const float* a, const float* b, const float* c, " \
              "long long n0, long long n1, float s0, float s1) { if (blockIdx.x == 0 && threadIdx.x == 0 && n0 < 0) " \
              "out[0] = a[0] + b[0] + c[0] + (float)n1 + s0 + s1; }"
        ck = cupy.RawKernel(src, "noop8")
        cb = cupy.zeros(16, dtype=cupy.float32)
        cargs = (cb, cb, cb, cb, np.int64(1), np.int64(2), np.float32(1.0), np.float32(2.0))
        t = torch.zeros(1, device="cuda")
        us = per_call_us({
            "raw0": (lambda: launch(cs, cfg, k0.core), sync),
            "raw8": (lambda: launch(cs, cfg, k8.core, *args8), sync),
            "rt0": (lambda: k0.launch(1, 32, (), 0, sh), sync),
            "rt8": (lambda: k8.launch(1, 32, args8, 0, sh), sync),
            "rt8_torch_stream": (lambda: k8.launch(1, 32, args8, 0, stream), sync),
            "cupy": (lambda: ck((1,), (32,), cargs), lambda: cupy.cuda.Device().synchronize()),
            "torch": (lambda: t.add_(1.0), sync)})
        raw0, raw8, rt0, rt8, rt8_torch_stream = (us[k] for k in ("raw0", "raw8", "rt0", "rt8", "rt8_torch_stream"))
        cupy_us, torch_us = us["cupy"], us["torch"]
        results["launch_us"] = {"cuda_core_0args": round(raw0, 3), "cuda_core_8args": round(raw8, 3),
                                "rtckern_0args": round(rt0, 3), "rtckern_8args": round(rt8, 3),
                                "rtckern_8args_torch_stream_obj": round(rt8_torch_stream, 3),
                                "cupy_rawkernel_8args": round(cupy_us, 3), "torch_add_": round(torch_us, 3)}
        results["targets"] = {
            "launch_8args_vs_cuda_core": round(rt8 / raw8, 3), "launch_8args_le_1.25x": rt8 <= 1.25 * raw8,
            "below_cupy": rt8 < cupy_us, "below_torch": rt8 < torch_us,
            "warm_disk_le_1ms": max(warm) <= 1.0, "memory_hit_le_2us": mem_us <= 2.0}

    return to_result(results)


def to_result(results: dict) -> Result:
    L = results["launch_us"]
    rows = [{"launcher": "cuda.core launch (raw)", "args0_us": L["cuda_core_0args"], "args8_us": L["cuda_core_8args"]},
            {"launcher": "rtckern Kernel.launch (int stream)", "args0_us": L["rtckern_0args"],
             "args8_us": L["rtckern_8args"]},
            {"launcher": "rtckern Kernel.launch (torch stream)", "args0_us": None,
             "args8_us": L["rtckern_8args_torch_stream_obj"]},
            {"launcher": "CuPy RawKernel", "args0_us": None, "args8_us": L["cupy_rawkernel_8args"]},
            {"launcher": "torch eager `add_`", "args0_us": L["torch_add_"], "args8_us": None}]
    body = [f"On {results['device']}.", f"Device-to-device copy: **{results['copy_gbps']} GB/s** (read + write)",
            Table(["launcher", "0 args", "8 args"], [(r["launcher"], r["args0_us"], r["args8_us"]) for r in rows],
                  title="Host cost per launch (µs, empty kernel, 20k back-to-back launches per round, median of 7 rounds, the launchers in turn)"),
            Table(["what", "value"], [
                ["cold NVRTC compile (axpy f32/f16/bf16), ms", results["cold_compile_ms"]],
                ["warm disk hit + load, new manager, ms", results["warm_disk_load_ms"]],
                ["memory hit (manager.get), µs", results["memory_hit_us"]]], title="Compile and cache"),
            Table(["target", "value"], list(results["targets"].items()), title="Targets")]
    return Result("Core service benchmark", rows=rows, body=body, data=results,
                  plot=lambda plt, meta: plot(plt, meta, rows))


def render(payload: dict) -> Result:
    """The result set of a stored JSON (one written before the runner too: {"env", "device", "launch_us", ...})."""
    if "meta" in payload:
        return to_result(stored_data(payload))
    result = to_result({k: v for k, v in payload.items() if k != "env"})
    result.meta = legacy_meta(payload["env"], gpu_used=True)
    return result


def plot(plt, meta: dict, rows: list[dict]):
    """Host cost per launch of an empty kernel, per launcher, with 0 and 8 arguments."""
    fig, ax = plt.subplots(figsize=(9, 4))
    y = range(len(rows))
    for off, key, label in ((-0.2, "args0_us", "0 args"), (0.2, "args8_us", "8 args")):
        ys = [i + off for i, r in zip(y, rows) if r[key] is not None]
        if not ys:  # a series this run has no value of (e.g. torch's under the plugin stub)
            continue
        bars = ax.barh(ys, [r[key] for r in rows if r[key] is not None], height=0.4, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.set_yticks(list(y))
    ax.set_yticklabels([r["launcher"].replace("`", "") for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("host us per launch (empty kernel, 20k back-to-back launches per round, median of 7 rounds, the launchers in turn)")
    ax.legend(fontsize=8)
    ax.set_title(f"host cost per launch on {gpu_name(meta)}")
    fig.tight_layout()
    return fig
