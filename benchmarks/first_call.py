"""The first call of each op in a fresh process on a warm cache (kernels on disk, decisions persisted), vs torch's.

GPU (the real number):   python -m benchmarks first_call [--profile OP]
    Per op, two fresh processes that do the same setup (import torch and rtckern.ops, make tiny CUDA inputs,
    synchronize: the CUDA context exists before the clock starts) and then time one first call, synchronized:
    rtckern's op in one, torch's own op in the other. `extra ms` is rtckern's first call minus torch's (the issue's
    target: <= 5 ms per op). A warm-up process per op fills the cache dir first (compile, decisions).

CPU (no GPU):            python -m benchmarks first_call --cpu [--profile OP]
    Two measurements per op, each in a fresh process on a warm cache dir:
    - `select`: what `rtckern explain` / prefill do for a described device (DeviceInfo.for_arch("sm_90",
      sm_count=132)): build the request, registry selection with compile-only probes (keys, persisted decisions,
      tuning tables). The compiler's facts (version, archs: remembered per NVRTC library file, else read from the
      loaded NVRTC) are asked first: `compiler facts ms`, timed before the call, so `select ms` is what each op
      costs on top of them.
    - `call`: the real op call (array checks, plan, registry with its real probe, keys, disk tier, tuning tables,
      device facts, loading, launch geometry, prepared launch) with torch faked and a fake libcuda behind the real
      cuda.bindings (benchmarks/_cpu_stubs.py): everything but the GPU's own work, in a process that has imported
      what torch imports (cuda.bindings.driver). `call imported` names the heavy modules the first call imported itself
      (cuda.core, cuda.pathfinder, cuda.bindings.nvrtc) and whether it loaded libnvrtc: none of them should be
      needed on a warm cache.

--cache-dir DIR uses (and warms) DIR instead of a fresh temporary one. --profile OP prints a cProfile of OP's first
call (in the chosen mode) instead of the table (no result files).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# op -> (registry request: shape, options) for the described-device selection
SELECT_CASES = {
    "rms_norm": ("4x4096", {}),
    "layer_norm": ("4x4096", {}),
    "rms_norm_backward": ("4x4096", {}),
    "layer_norm_backward": ("4x4096", {}),
    "softmax": ("32x1024", {}),
    "softmax_backward": ("32x1024", {}),
    "scaled_upper_triang_masked_softmax": ("32x128x128", {}),
    "attention": ("1x1x32x128", {}),
    "gemm": ("1x4096x4096", {}),
}
CALL_OPS = tuple(SELECT_CASES)


def call_case(op: str, torch, stub: bool):
    """(rtckern's call, torch's call or None) for op on tiny inputs; nothing is called while building them."""
    import rtckern.ops as ops

    bf16, f32 = torch.bfloat16, torch.float32

    def t(*shape, dtype=bf16):
        return torch.empty(shape, dtype=dtype, device="cuda") if stub else \
            torch.randn(shape, dtype=dtype, device="cuda")

    F = None if stub else torch.nn.functional
    if op in ("rms_norm", "layer_norm", "rms_norm_backward", "layer_norm_backward"):
        x, w, b, dy = t(4, 4096), t(4096), t(4096), t(4, 4096)
        mean, rstd = t(4, dtype=f32), (t(4, dtype=f32).abs() + 1 if not stub else t(4, dtype=f32))
        return {
            "rms_norm": (lambda: ops.rms_norm(x, w, 1e-6), lambda: F.rms_norm(x, (4096,), w, 1e-6)),
            "layer_norm": (lambda: ops.layer_norm(x, w, b, 1e-5), lambda: F.layer_norm(x, (4096,), w, b, 1e-5)),
            "rms_norm_backward": (lambda: ops.rms_norm_backward(dy, x, w, rstd), None),
            "layer_norm_backward": (
                lambda: ops.layer_norm_backward(dy, x, w, b, mean, rstd),
                lambda: torch.ops.aten.native_layer_norm_backward(dy, x, (4096,), mean.view(4, 1), rstd.view(4, 1),
                                                                  w, b, (True, True, True))),
        }[op]
    if op in ("softmax", "softmax_backward"):
        s, ys = t(1, 32, 1, 1024), t(1, 32, 1, 1024)
        if op == "softmax":
            return lambda: ops.softmax(s, 0.125), lambda: torch.softmax(s, -1)
        return (lambda: ops.softmax_backward(ys, s, 0.125),
                lambda: torch.ops.aten._softmax_backward_data(s, ys, -1, bf16))
    if op == "scaled_upper_triang_masked_softmax":
        c = t(32, 128, 128)
        return lambda: ops.scaled_upper_triang_masked_softmax(c, 0.125), None
    if op == "attention":
        q, k, v = t(1, 1, 32, 128), t(1, 1024, 8, 128), t(1, 1024, 8, 128)
        return (lambda: ops.attention(q, k, v),
                lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       enable_gqa=True))
    if op == "gemm":
        a, bm = t(1, 4096), t(4096, 4096)
        return lambda: ops.gemm(a, bm, trans_b=True), lambda: a @ bm.t()
    raise KeyError(op)


# ---- children: one measurement in a fresh process, one JSON line out --------------------------------------------
def _profile(fn) -> None:
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    pstats.Stats(pr, stream=sys.stderr).sort_stats("cumtime").print_stats(40)


def child_select(op: str, profile: bool) -> dict:
    t0 = time.perf_counter()
    importlib.import_module("rtckern.ops")
    t1 = time.perf_counter()
    from rtckern.arch import Arch
    from rtckern.compiler import compiler_for
    from rtckern.device import DeviceInfo
    from rtckern.registry import default_registry, select
    from rtckern.registry.explain import build_request

    comp = compiler_for(Arch.parse("sm_90"))
    comp.identity(), comp.supported_archs()  # the compiler library: loaded once per process, whatever the op
    t2 = time.perf_counter()
    dev = DeviceInfo.for_arch("sm_90", sm_count=132)
    shape, opts = SELECT_CASES[op]

    def first():
        return select(build_request(default_registry(), op, shape=shape, dtype="bf16", device=dev, options=opts))

    if profile:
        _profile(first)
        return {}
    t3 = time.perf_counter()
    sel = first()
    t4 = time.perf_counter()
    first()
    t5 = time.perf_counter()
    return {"op": op, "import_ms": (t1 - t0) * 1e3, "nvrtc_ms": (t2 - t1) * 1e3, "first_ms": (t4 - t3) * 1e3,
            "second_us": (t5 - t4) * 1e6, "chosen": sel.candidate.name}


# What a first call on a warm cache should not need: the modules (tens to hundreds of ms each) and NVRTC's library.
HEAVY_MODULES = ("cuda.core", "cuda.pathfinder", "cuda.bindings.nvrtc")


def child_call(op: str, profile: bool) -> dict:
    from benchmarks._cpu_stubs import install_stubs

    importlib.import_module("cuda.bindings.driver")  # imported by torch in a CUDA process
    t0 = time.perf_counter()
    install_stubs(stub_registry=False)
    import torch

    importlib.import_module("rtckern.ops")
    t1 = time.perf_counter()
    fn, _ = call_case(op, torch, stub=True)
    before = set(sys.modules)
    if profile:
        _profile(fn)
        return {}
    t3 = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # a launch path the stubs do not cover (raw driver calls): say so in the table
        return {"op": op, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    t4 = time.perf_counter()
    fn()
    t5 = time.perf_counter()
    imported = [m for m in HEAVY_MODULES if m in sys.modules and m not in before]
    with open("/proc/self/maps") as f:
        if "libnvrtc" in f.read():
            imported.append("libnvrtc")
    return {"op": op, "import_ms": (t1 - t0) * 1e3, "first_ms": (t4 - t3) * 1e3, "second_us": (t5 - t4) * 1e6,
            "imported": ", ".join(imported) or "-"}


def child_gpu(op: str, who: str, profile: bool) -> dict:
    import torch

    t0 = time.perf_counter()
    importlib.import_module("rtckern.ops")
    t1 = time.perf_counter()
    rt, ref = call_case(op, torch, stub=False)
    torch.cuda.synchronize()
    fn = rt if who == "rtckern" else ref
    if fn is None:
        return {"op": op, "who": who}

    def once():
        fn()
        torch.cuda.synchronize()

    if profile:
        _profile(once)
        return {}
    t2 = time.perf_counter()
    once()
    t3 = time.perf_counter()
    once()
    t4 = time.perf_counter()
    return {"op": op, "who": who, "import_ms": (t1 - t0) * 1e3, "first_ms": (t3 - t2) * 1e3,
            "second_us": (t4 - t3) * 1e6, "device": torch.cuda.get_device_name()}


def run_child(args: list[str], env: dict) -> dict:
    r = subprocess.run([sys.executable, "-m", "benchmarks.first_call", "--child", *args], env=env, cwd=ROOT,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{r.stderr[-3000:]}")
    if "profile" in args:
        print(r.stderr)
        return {}
    return json.loads(r.stdout.strip().splitlines()[-1])


def median_of(rows: list[dict]) -> dict:
    import statistics

    out = dict(rows[0])
    for k, v in rows[0].items():
        if isinstance(v, float):
            out[k] = statistics.median(r[k] for r in rows)
    return out


# ---- the parent: warm the cache, run the children, report ---------------------------------------------------------
QUICK = "two ops (rms_norm, softmax), one process per measurement"


def add_args(ap) -> None:
    ap.add_argument("--cpu", action="store_true", help="the CPU measurements (described-device selection; the op "
                    "call with torch and the driver stubbed) instead of the GPU's")
    ap.add_argument("--gpu", action="store_true", help=argparse.SUPPRESS)  # the default; accepted as before
    ap.add_argument("--ops", default=None, help="comma-separated ops (default: all)")
    ap.add_argument("--repeats", type=int, default=None, help="fresh processes per measurement (median; default 3)")
    ap.add_argument("--cache-dir", default=None, help="cache dir to warm and use (default: a fresh temporary one)")
    ap.add_argument("--profile", default=None, metavar="OP", help="cProfile OP's first call instead of timing")


def needs_gpu(a) -> bool:
    return not a.cpu


def run(a):
    gpu = not a.cpu
    ops = a.ops.split(",") if a.ops else (["rms_norm", "softmax"] if a.quick else list(CALL_OPS))
    repeats = a.repeats or (1 if a.quick else 3)
    tmp = None
    if a.cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="rtckern-first-call-")
    env = dict(os.environ, RTCKERN_CACHE_DIR=a.cache_dir or tmp.name,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # Bytecode as an installed package has it (pip compiles .pyc at install): the warm-up children write it, into
    # a prefix of our own in case the tree is read-only or the environment says not to (then every child would
    # compile ~100 modules from source: ~250 ms on the H100 host, none of it rtckern's first-call cost).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = os.path.join(a.cache_dir or tmp.name, "pycache")
    modes = [("gpu", "rtckern"), ("gpu", "torch")] if gpu else [("select",), ("call",)]
    for op in ops:  # warm-up: compile, persist decisions (one process per op and mode)
        for m in modes:
            if m != ("gpu", "torch"):
                run_child([m[0], op, *m[1:]], env)
    if a.profile:
        for m in modes[:1] if gpu else modes:
            run_child([m[0], a.profile, *m[1:], "profile"], env)
        return None
    results: dict[str, dict] = {}
    for op in ops:
        # the modes' processes in turn (rtckern, torch, rtckern, ...): a drift of the host's speed during the op's
        # processes then moves both sides of `extra ms` alike
        runs = {m: [] for m in modes}
        for _ in range(repeats):
            for m in modes:
                runs[m].append(run_child([m[0], op, *m[1:]], env))
        for m, rows in runs.items():
            results.setdefault(op, {})["-".join(m)] = rows[0] if "error" in rows[0] else median_of(rows)
    return to_result(results, "gpu" if gpu else "cpu", repeats)


def to_result(results: dict, mode: str, repeats: int):
    # the runner's types are imported here, not at the top: a child process imports no more than it did as a script
    from benchmarks.runner import Result

    note, table = report(results, mode == "gpu", repeats)
    return Result("First call in a fresh process, warm cache", body=[note, table],
                  rows=[{"op": op, **r} for op, r in results.items()], data={"mode": mode, "repeats": repeats},
                  plot=lambda plt, meta: plot(plt, meta, results, mode == "gpu"))


def render(payload: dict):
    """The result set of a stored JSON (one written before the runner too: {"mode", "repeats", "results"}, no
    environment but the GPU the children named)."""
    if "meta" in payload:
        results = {r["op"]: {k: v for k, v in r.items() if k != "op"} for r in payload["rows"]}
        return to_result(results, payload["mode"], payload["repeats"])
    from benchmarks.env import legacy_meta

    result = to_result(payload["results"], payload["mode"], payload["repeats"])
    gpu = payload["mode"] == "gpu"
    device = next((r["gpu-rtckern"]["device"] for r in payload["results"].values()
                   if "device" in r.get("gpu-rtckern", {})), None) if gpu else None
    result.meta = legacy_meta({"gpu": device} if device else {}, gpu_used=gpu)
    return result


def plot(plt, meta: dict, results: dict, gpu: bool):
    """Per op, the first call's ms: rtckern's against torch's (GPU), or the selection's and the stubbed call's
    (CPU)."""
    from benchmarks.runner import gpu_name

    series = ((("gpu-rtckern", "rtckern first call"), ("gpu-torch", "torch first call")) if gpu else
              (("select", "select: first"), ("call", "call: first (stubbed launch)")))
    ops = list(results)
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(ops) + 1.8))
    for i, (key, label) in enumerate(series):
        ys = [j + (i - 0.5) * 0.4 for j, op in enumerate(ops) if results[op][key].get("first_ms") is not None]
        if not ys:  # a series this run has no value of (e.g. torch's under the plugin stub)
            continue
        bars = ax.barh(ys, [results[op][key]["first_ms"] for op in ops if results[op][key].get("first_ms") is not None],
                       height=0.4, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=2)
    ax.set_yticks(range(len(ops)))
    ax.set_yticklabels(ops, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms, first call in a fresh process on a warm cache (median of processes)")
    ax.margins(x=0.2)  # room for the legend right of the bars
    ax.legend(fontsize=8, loc="center right")
    ax.set_title(f"first call per op on {gpu_name(meta)}")
    fig.tight_layout()
    return fig


def report(results: dict, gpu: bool, repeats: int) -> tuple:
    from benchmarks.runner import Table

    def f(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    if gpu:
        dev = next((r["gpu-rtckern"].get("device") for r in results.values() if "device" in r["gpu-rtckern"]), "GPU")
        rows = []
        for op, r in results.items():
            rt, th = r["gpu-rtckern"], r["gpu-torch"]
            extra = rt["first_ms"] - th["first_ms"] if "first_ms" in th else None
            rows.append((op, f(rt.get("import_ms")), f(rt.get("first_ms")), f(th.get("first_ms")), f(extra),
                         f(rt.get("second_us"), "{:.0f}")))
        return (f"{dev}; median of {repeats} processes per cell, rtckern's and torch's processes in turn.",
                Table(("op", "import rtckern.ops ms", "rtckern first call ms", "torch first call ms", "extra ms",
                       "rtckern 2nd call us"), rows))
    rows = []
    for op, r in results.items():
        s, c = r["select"], r["call"]
        call = ((f(c.get("first_ms")), f(c.get("second_us"), "{:.0f}"), c.get("imported", "-"))
                if "error" not in c else (f"stub cannot run it ({c['error'][:60]})", "-", "-"))
        rows.append((op, f(s["import_ms"]), f(s["nvrtc_ms"]), f(s["first_ms"]), f(s["second_us"], "{:.0f}"), *call,
                     s["chosen"]))
    return (f"CPU only (median of {repeats} processes per cell).",
            Table(("op", "import rtckern.ops ms", "select: compiler facts ms", "select: first ms", "select: 2nd us",
                   "call: first ms", "call: 2nd us", "call imported", "chosen"), rows))


def child_main(argv: list[str]) -> None:
    """One measurement in this fresh process (`python -m benchmarks.first_call --child MODE OP ...`)."""
    if argv[:1] != ["--child"] or len(argv) < 3:
        raise SystemExit("a child of `python -m benchmarks first_call`: run that instead")
    mode, op, *rest = argv[1:]
    prof = "profile" in rest
    out = (child_select(op, prof) if mode == "select" else child_call(op, prof) if mode == "call"
           else child_gpu(op, rest[0], prof))
    print(json.dumps(out))


if __name__ == "__main__":
    child_main(sys.argv[1:])
