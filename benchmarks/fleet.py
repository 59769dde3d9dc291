"""Fleet (CPU only): per preset, prefill time, bundle sizes per arch, and warm starts from disk, layer and Redis.

For docs/fleet.md: per preset, the kernels it needs, prefill time with 1 and N processes, bundle size per device
arch, import time, and warm-start time of a fresh process (every request of the preset selected through the
registry, binaries from: local disk, a read-only layer, Redis; and cold, for comparison).

    python -m benchmarks fleet [--presets a,b] [--archs "8.0;9.0a"] [--jobs 2] [--quick]

No GPU: a warm start here ends with the binaries in memory; on a GPU add module loading (core.md: 0.6-0.9 ms per
kernel from a warm disk, load included). --quick: one request (a one-line manifest), one arch, one process.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.env import legacy_meta
from benchmarks.runner import Result, Table, gpu_name

ROOT = Path(__file__).resolve().parents[1]

WARM = r"""
import json, sys, time
t0 = time.perf_counter()
import rtckern.ops
from rtckern.device import DeviceInfo
from rtckern.fleet import load_manifest, load_preset
from rtckern.fleet.plan import build_request
from rtckern.manager import get_manager
from rtckern.registry import default_registry
t1 = time.perf_counter()
reg, n = default_registry(), 0
dev = DeviceInfo.for_arch(sys.argv[2])
for e in (load_manifest(sys.argv[1]) if sys.argv[1].endswith('.jsonl') else load_preset(sys.argv[1])):
    try:
        req = build_request(reg, e, dev)
    except LookupError:
        continue  # an op family without a builder yet
    sel = reg.select(req)
    n += len(sel.specs)
t2 = time.perf_counter()
st = get_manager().stats.as_dict()
print(json.dumps({"import_s": t1 - t0, "select_s": t2 - t1, "kernels": n, "compiles": st["compiles"],
                  "tiers": st["tiers"]}))
"""


def sh(args, env=None, **kw):
    e = dict(os.environ, PYTHONPATH=str(ROOT), RTCKERN_PERSIST_DECISIONS="0")
    e.update(env or {})
    t = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True, env=e, cwd=ROOT, **kw)
    return r, time.perf_counter() - t


def rtckern(*args, env=None):
    r, dt = sh([sys.executable, "-m", "rtckern", *args], env)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"rtckern {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return r, dt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def warm_start(preset: str, arch: str, env: dict) -> dict:
    r, wall = sh([sys.executable, "-c", WARM, preset, arch], env)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_s"] = wall
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


def bench_preset(source: str, archs: str, jobs: int, tmp: Path, redis_url: str | None) -> dict:
    """source: a shipped preset's name, or a manifest file (*.jsonl)."""
    manifest = source.endswith(".jsonl")
    preset = Path(source).stem if manifest else source
    res: dict = {"preset": preset, "archs": archs}
    for j in sorted({1, jobs}):
        cache = tmp / f"{preset}-j{j}"
        r, wall = rtckern("prefill", "--manifest" if manifest else "--preset", source, "--arch", archs, "-j", str(j),
                          "--out", str(cache),
                          "--bundle", str(tmp / f"{preset}-j{j}.bundle"), "--json", "--no-progress")
        s = json.loads(r.stdout)
        res[f"prefill_j{j}"] = {"wall_s": round(wall, 2), "seconds": s["seconds"], "compiled": s["compiled"],
                                "compile_ms_sum": s["compile_ms"], "requests": s["requests"], "served": s["served"],
                                "failed": s["failed"], "bundle_bytes": s["bundle"]["bytes"],
                                "bundle_sha256": s["bundle"]["sha256"]}
    res["bundles_identical_j1_vs_jN"] = len({res[f"prefill_j{j}"]["bundle_sha256"] for j in {1, jobs}}) == 1
    p1 = res["prefill_j1"]
    res["compile_s_per_kernel_one_core"] = round(p1["compile_ms_sum"] / 1e3 / max(1, p1["compiled"]), 3)
    res["failures"] = sorted({f["error"].split(":")[0] for f in s["failures"]})
    cache = tmp / f"{preset}-j1"
    per_arch = {}
    for a in archs.replace(",", ";").split(";"):
        b = tmp / f"{preset}-{a}.bundle"
        r, _ = rtckern("cache", "export", "--bundle", str(b), "--arch", a, "--json", "--cache-dir", str(cache))
        e = json.loads(r.stdout)
        dest = tmp / f"{preset}-{a}-import"
        r, imp = rtckern("cache", "import", str(b), "--json", "--cache-dir", str(dest))
        per_arch[a] = {"entries": e["entries"], "bundle_bytes": e["bytes"], "entry_bytes": e["entry_bytes"],
                       "import_process_s": round(imp, 3)}
    res["per_arch"] = per_arch
    # warm starts on an sm_90 machine (the H100/H200 part of the fleet)
    arch = "sm_90"
    local = tmp / f"{preset}-local"
    shutil.copytree(tmp / f"{preset}-9.0a-import", local) if (tmp / f"{preset}-9.0a-import").exists() else None
    ws = {
        "cold (empty caches: compiles)": warm_start(source, arch, {"RTCKERN_CACHE_DIR": str(tmp / f"{preset}-cold")}),
        "local disk": warm_start(source, arch, {"RTCKERN_CACHE_DIR": str(local)}),
        "read-only layer": warm_start(source, arch, {"RTCKERN_CACHE_DIR": str(tmp / f"{preset}-empty1"),
                                                     "RTCKERN_CACHE_LAYERS": str(local)}),
    }
    if redis_url:
        from rtckern.cache import DiskCache
        from rtckern.cache.remote import RedisCache

        remote, d = RedisCache(redis_url, timeout_s=2.0), DiskCache(local)
        remote._client.execute((b"FLUSHDB",), 2.0)  # the remote holds this preset's kernels only
        for e in d.entries():  # the remote holds what the sm_90 bundle holds
            remote.put_packed(e.key, d.get_packed(e.key))
        ws["redis (empty local)"] = warm_start(source, arch, {"RTCKERN_CACHE_DIR": str(tmp / f"{preset}-empty2"),
                                                              "RTCKERN_REMOTE_CACHE": redis_url})
    res["warm_start_sm90"] = ws
    return res


QUICK = "one request (a one-line manifest, rms_norm bf16 4096x2048), arch 9.0a only, one process (a smoke run)"
QUICK_MANIFEST = '{"op": "rms_norm", "dtype": "bf16", "shape": [4096, 2048]}\n'


def add_args(ap) -> None:
    ap.add_argument("--presets", default=None, help="comma list of shipped presets (default: all)")
    ap.add_argument("--archs", default=None, help='arch list of the prefill (default "8.0;9.0a")')
    ap.add_argument("--jobs", type=int, default=None, help="prefill processes besides 1 (default: CPUs)")


def run(args) -> Result:
    from rtckern.compiler.nvrtc import NvrtcCompiler
    from rtckern.fleet import preset_names

    archs = args.archs or ("9.0a" if args.quick else "8.0;9.0a")
    jobs = args.jobs or (1 if args.quick else os.cpu_count() or 2)
    tmp = Path(tempfile.mkdtemp(prefix="rtckern-fleet-"))
    if args.presets:
        presets = args.presets.split(",")
    elif args.quick:
        presets = [str(tmp / "quick.jsonl")]
        Path(presets[0]).write_text(QUICK_MANIFEST)
    else:
        presets = preset_names()
    redis = None
    url = None
    if shutil.which("redis-server"):
        port = free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        time.sleep(0.5)
    try:
        setup = {"toolchain": NvrtcCompiler().identity(), "archs": archs, "jobs": jobs,
                 "loadavg_at_start": os.getloadavg()}
        results = []
        for p in presets:
            print(f"== {p}", file=sys.stderr, flush=True)
            results.append(bench_preset(p, archs, jobs, tmp, url))
            print(json.dumps(results[-1], indent=1), file=sys.stderr, flush=True)
    finally:
        if redis is not None:
            redis.kill()
            redis.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return to_result(results, setup)


def to_result(results: list[dict], setup: dict) -> Result:
    return Result("Fleet: prefill, bundles and warm starts", rows=results, body=_body(results, setup),
                  data={"setup": setup}, plot=lambda plt, meta: plot(plt, meta, results))


def render(payload: dict) -> Result:
    """The result set of a stored JSON (one written before the runner too: {"meta" with the setup, "presets"})."""
    if "rows" in payload:
        return to_result(payload["rows"], payload["setup"])
    env = dict(payload["meta"])
    setup = {k: env.pop(k) for k in ("toolchain", "archs", "jobs")}
    env["nvrtc"] = setup["toolchain"].split("|")[0]  # "nvrtc-13.5|cuda-headers-..."
    result = to_result(payload["presets"], setup)
    result.meta = legacy_meta(env, gpu_used=False)
    return result


def plot(plt, meta: dict, results: list[dict]):
    """Seconds for a fresh sm_90 process to select every request of a preset, per source of the binaries."""
    sources = list(dict.fromkeys(src for r in results for src in r["warm_start_sm90"]))
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / len(sources)
    for i, src in enumerate(sources):
        xs = [j + (i - (len(sources) - 1) / 2) * width for j, r in enumerate(results) if src in r["warm_start_sm90"]]
        bars = ax.bar(xs, [r["warm_start_sm90"][src]["process_s"] for r in results if src in r["warm_start_sm90"]],
                      width=width, label=src)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([f"{r['preset']}\n({r['prefill_j1']['requests']} requests)" for r in results], fontsize=8)
    ax.set_ylabel("fresh process, s (log)")
    ax.legend(fontsize=8)
    ax.set_title(f"warm start of a fresh sm_90 process selecting every request of a preset ({gpu_name(meta)}, no "
                 "module loading)", fontsize=10)
    fig.tight_layout()
    return fig


def _body(results: list[dict], setup: dict) -> list:
    jobs = setup["jobs"]
    procs = "1 process" if jobs == 1 else f"1 and {jobs} processes"
    body = [f"CPU only. Prefill of each preset for `{setup['archs']}` with {procs} "
            f"(`rtckern prefill`), bundles per arch (`rtckern cache export` / `import`), and a fresh process on an "
            f"sm_90 machine selecting every request of the preset (binaries from each source, no GPU: module "
            f"loading not included). Toolchain: {setup['toolchain'].split('|')[0]}."]
    prefill = []
    for r in results:
        p1, pn = r["prefill_j1"], r.get(f"prefill_j{jobs}", r["prefill_j1"])
        prefill.append((r["preset"], p1["requests"], p1["served"], p1["compiled"], p1["wall_s"], pn["wall_s"],
                        r["compile_s_per_kernel_one_core"], "yes" if r["bundles_identical_j1_vs_jN"] else "NO",
                        p1["bundle_bytes"], ", ".join(r["failures"]) or "-"))
    body.append(Table(("preset", "requests", "served", "kernels compiled", "prefill s (1 process)",
                       f"prefill s ({jobs} processes)", "compile s per kernel", "bundles identical", "bundle bytes",
                       "failures"), prefill, title="Prefill"))
    body.append(Table(("preset", "arch", "entries", "bundle bytes", "entry bytes", "import s (process)"),
                      [(r["preset"], a, x["entries"], x["bundle_bytes"], x["entry_bytes"], x["import_process_s"])
                       for r in results for a, x in r["per_arch"].items()], title="Bundles per arch"))
    body.append(Table(("preset", "binaries from", "process s", "import s", "select s", "kernels", "compiles"),
                      [(r["preset"], src, w["process_s"], w["import_s"], w["select_s"], w["kernels"], w["compiles"])
                       for r in results for src, w in r["warm_start_sm90"].items()],
                      title="Warm start of a fresh process on sm_90 (every request selected)"))
    return body
