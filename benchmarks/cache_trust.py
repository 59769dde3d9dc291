"""Cache trust (CPU only): remote tier vs hostile servers, one compile per key under races, damaged-cache verify.

``remote_deadlines()``: the longest call the remote tier made against each hostile fake server
(rtckern.testing.HostileRedis) under a given whole-call deadline, next to the bar (deadline + 10 %); for the
trickling server also how long redis-py with the same per-read timeout stays blocked (what the tier did before).
``race_compiles()``: processes (and threads) that start together on one empty cache and all ask for the same
kernels: compiles per key. ``damaged_cache()``: a cache damaged in every way the runtime can meet, and what
`cache verify` (DiskCache.verify) finds.

    python -m benchmarks cache_trust [--deadline 0.5] [--calls 5] [--procs 8,32] [--threads 256] [--quick]
"""

from __future__ import annotations

import json
import logging
import threading
import time
import tracemalloc
import warnings
from pathlib import Path

from benchmarks.env import legacy_meta
from benchmarks.runner import Result, Table, gpu_name, stored_data
from rtckern.cache import CacheWarning, pack
from rtckern.cache.remote import RedisCache
from rtckern.compiler.base import CompiledKernel
from rtckern.testing import HOSTILE_MODES, HostileRedis

_CK = CompiledKernel(binary=b"\x7fELF" + bytes(range(256)) * 16, kind="cubin", lowered_name="_Z1kv")


def _one_call(url: str, op: str, deadline_s: float) -> tuple[float, int, int]:
    """(seconds, CacheWarnings raised, peak bytes allocated) for one get or put on a fresh tier."""
    r = RedisCache(url, timeout_s=deadline_s, cooldown_s=0.0)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        tracemalloc.start()
        t0 = time.monotonic()
        try:
            out = r.get_packed("ab" * 32) if op == "get" else r.put_packed("ab" * 32, pack(_CK, "ab" * 32))
        finally:
            took = time.monotonic() - t0
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    if out not in (None, False):
        raise AssertionError(f"a hostile server gave a {op} hit: {out!r}")
    r.close()
    return took, sum(1 for w in got if issubclass(w.category, CacheWarning)), peak


def _redis_py_blocked_s(url: str, per_read_timeout_s: float, give_up_s: float) -> float | None:
    """How long redis-py's GET stays blocked on a trickling server with a per-read timeout; None if it was
    still blocked after ``give_up_s`` (the server is then stopped, which ends the call)."""
    try:
        import redis
    except ImportError:
        return None
    client = redis.Redis.from_url(url, socket_timeout=per_read_timeout_s, socket_connect_timeout=per_read_timeout_s,
                                  retry_on_timeout=False)
    took: list[float] = []

    def call() -> None:
        t0 = time.monotonic()
        try:
            client.get("rtckern:v1:" + "ab" * 32)
        except Exception:
            pass
        took.append(time.monotonic() - t0)

    th = threading.Thread(target=call, daemon=True)
    th.start()
    th.join(give_up_s)
    return took[0] if took else None


def remote_deadlines(deadline_s: float = 0.5, calls: int = 5, *, redis_py_give_up_s: float = 10.0) -> dict:
    """Worst call duration of the remote tier against each hostile server, for get and put; ``within`` says
    whether every call stayed under deadline + 10 %, ``peak_alloc_bytes`` is the largest allocation peak of a
    call (the huge server announces 500 MB)."""
    limit = deadline_s * 1.10
    servers: dict[str, dict] = {}
    quiet = logging.getLogger("rtckern.cache.remote")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # one warning per call is expected: counted, not printed
    try:
        for mode in HOSTILE_MODES:
            servers[mode] = _against(mode, deadline_s, calls, limit)
    finally:
        quiet.setLevel(level)
    with HostileRedis("trickle") as srv:
        before = _redis_py_blocked_s(srv.url, deadline_s, redis_py_give_up_s)
    return {
        "deadline_s": deadline_s, "limit_s": round(limit, 4), "calls_per_op": calls, "servers": servers,
        "all_within": all(r["within"] for r in servers.values()),
        "redis_py_trickle_blocked_s": round(before, 3) if before is not None else f">{redis_py_give_up_s:g}",
    }


def _against(mode: str, deadline_s: float, calls: int, limit: float) -> dict:
    with HostileRedis(mode) as srv:
        row: dict[str, object] = {}
        for op in ("get", "put"):
            runs = [_one_call(srv.url, op, deadline_s) for _ in range(calls)]
            row[f"{op}_max_s"] = round(max(t for t, _, _ in runs), 4)
            row[f"{op}_warnings_per_call"] = sorted({w for _, w, _ in runs})
            row[f"{op}_peak_alloc_bytes"] = max(p for _, _, p in runs)
    row["max_s"] = max(row["get_max_s"], row["put_max_s"])
    row["within"] = row["max_s"] <= limit
    return row


# ---- one compile per key under races ----
_RACE_SPECS = [("axpy", t) for t in ("float", "rtk_half", "rtk_bf16")] + [("noop0", None), ("noop8", None)]
_RACER = r"""
import json, sys, time
from rtckern.arch import Arch
from rtckern.manager import KernelManager
from rtckern.spec import KernelSpec
specs = [KernelSpec("core/axpy.cuh", n, Arch.parse("sm_80"), template_args=(t,) if t else ()) for n, t in %r]
start = float(sys.argv[1])
while time.time() < start:
    time.sleep(0.001)
m = KernelManager(sys.argv[2], remote=None)
for s in specs:
    m.compile(s)
print(json.dumps({"compiles": m.stats.compiles}))
"""


def race_compiles(procs: int, tmp: Path) -> dict:
    """``procs`` processes start at the same instant on one empty cache and compile the same kernels."""
    import subprocess
    import sys

    cache = tmp / f"race{procs}"
    start = time.time() + 1.0 + procs * 0.05  # every interpreter is up before the start
    code = _RACER % (_RACE_SPECS,)
    ps = [subprocess.Popen([sys.executable, "-c", code, repr(start), str(cache)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for _ in range(procs)]
    outs = [p.communicate(timeout=900) for p in ps]
    bad = [e for (o, e), p in zip(outs, ps) if p.returncode]
    if bad:
        raise RuntimeError(f"a racing process failed: {bad[0][-2000:]}")
    compiles = sum(json.loads(o)["compiles"] for o, _ in outs)
    from rtckern.cache import DiskCache

    d = DiskCache(cache)
    keys = len(list(d.entries(meta=False)))
    return {"processes": procs, "kernels": len(_RACE_SPECS), "keys_in_cache": keys, "compiles": compiles,
            "compiles_per_key": round(compiles / keys, 3), "corrupt": d.verify(remove=False)["corrupt"]}


def race_threads(threads: int, tmp: Path) -> dict:
    """``threads`` threads of one process ask one manager for the same kernels at once."""
    from rtckern.arch import Arch
    from rtckern.manager import KernelManager
    from rtckern.spec import KernelSpec

    m = KernelManager(tmp / f"threads{threads}", remote=None)
    specs = [KernelSpec("core/axpy.cuh", n, Arch.parse("sm_80"), template_args=(t,) if t else ())
             for n, t in _RACE_SPECS]
    gate = threading.Barrier(threads)

    def work(i: int) -> None:
        gate.wait()
        for s in specs[i % len(specs):] + specs[:i % len(specs)]:
            m.compile(s)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return {"threads": threads, "kernels": len(specs), "compiles": m.stats.compiles,
            "compiles_per_key": round(m.stats.compiles / len(specs), 3)}


# ---- what verify finds on a damaged cache ----
def damaged_cache(tmp: Path) -> dict:
    """Compile a few kernels, damage the cache in each way the runtime can meet, and report what verify finds
    (listed entries and sidecars, by kind of damage) and what the runtime does with each damaged key."""
    import hashlib
    import os
    import struct

    from rtckern.arch import Arch
    from rtckern.cache import DiskCache
    from rtckern.cache import entry as entry_format
    from rtckern.manager import KernelManager
    from rtckern.spec import KernelSpec

    root = tmp / "damaged"
    m = KernelManager(root, remote=None)
    specs = [KernelSpec("core/axpy.cuh", n, Arch.parse(a), template_args=(t,) if t else (), op="core")
             for n, t, a in (("axpy", "float", "sm_80"), ("axpy", "rtk_half", "sm_80"), ("axpy", "rtk_bf16", "sm_80"),
                             ("noop0", None, "sm_80"), ("noop8", None, "sm_80"), ("axpy", "float", "sm_90"),
                             ("axpy", "rtk_half", "sm_90"))]
    keys = [m.key(s) for s in specs]
    for s in specs:
        m.compile(s)
    d = m.disk
    damage = {}

    def entry(i):
        return d.entry_path(keys[i])

    data = entry(0).read_bytes()
    entry(0).write_bytes(data[:-9] + bytes([data[-9] ^ 1]) + data[-8:])
    damage["byte flip"] = keys[0]
    entry(1).write_bytes(entry(1).read_bytes()[: 200])
    damage["truncated"] = keys[1]
    entry(2).write_bytes(entry(3).read_bytes())
    damage["entry of another key"] = keys[2]
    body = struct.pack("<I", 2) + b"[]" + b"\x7fELF"
    entry(3).write_bytes(entry_format._HEAD.pack(entry_format.MAGIC, entry_format.FORMAT,
                                                 hashlib.sha256(body).digest(), len(body)) + body)
    damage["valid digest, malformed header"] = keys[3]
    side = json.loads(d.meta_path(keys[5]).read_text())
    d.meta_path(keys[5]).write_text(json.dumps(dict(side, arch="sm_80")))
    damage["sidecar naming another arch"] = keys[5]
    orphan = d.meta_path("ee" * 32)
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_text("{}")
    temp = entry(4).parent / f".{entry(4).name}.dead.tmp"
    temp.write_bytes(b"half a write")
    old = time.time() - 3600
    for p in (orphan, temp):
        os.utime(p, (old, old))
    report = DiskCache(root).verify(remove=False)
    bad = {b["key"]: b["reason"] for b in report["bad"]}
    bad_side = {b["key"]: b["reason"] for b in report["bad_sidecars"]}
    found = {what: (bad.get(k) or bad_side.get(k)) for what, k in damage.items()}
    found["orphan sidecar"] = report["orphan_sidecars"]
    found["temp file of a killed writer"] = report["stale_temp_files"]
    # The runtime on the same cache: every damaged entry is a miss (recompiled), none is served.
    m2 = KernelManager(root, remote=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        served_right = all(m2.compile(s).binary == m.compile(s).binary for s in specs)
    return {"entries": len(specs), "verify": {k: v for k, v in report.items() if k not in ("bad", "bad_sidecars")},
            "found": found, "all_found": all(found.values()), "runtime_recompiled": m2.stats.compiles,
            "runtime_served_right": served_right}


QUICK = "1 call per operation, a 0.2 s deadline, 2 racing processes and 8 threads (a smoke run)"


def add_args(ap) -> None:
    ap.add_argument("--deadline", type=float, default=None, help="the remote tier's whole-call deadline, s (0.5)")
    ap.add_argument("--calls", type=int, default=None, help="calls per operation and server (5)")
    ap.add_argument("--procs", default=None, help="racing processes, comma list (8,32)")
    ap.add_argument("--threads", default=None, help="racing threads, comma list (256)")


def run(args) -> Result:
    import tempfile

    q = args.quick
    deadline = args.deadline if args.deadline is not None else (0.2 if q else 0.5)
    calls = args.calls if args.calls is not None else (1 if q else 5)
    procs = args.procs or ("2" if q else "8,32")
    threads = args.threads or ("8" if q else "256")
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        remote = remote_deadlines(deadline, calls, redis_py_give_up_s=1.0 if q else 10.0)
        race_p = [race_compiles(int(n), tmp) for n in procs.split(",")]
        race_t = [race_threads(int(n), tmp) for n in threads.split(",")]
        damaged = damaged_cache(tmp)
    servers = remote.pop("servers")
    rows = [{"server": m, **r} for m, r in servers.items()]
    return to_result(rows, {"remote": remote, "race_processes": race_p, "race_threads": race_t, "damaged": damaged})


def to_result(rows: list[dict], data: dict) -> Result:
    body = _body(data["remote"], rows, data["race_processes"], data["race_threads"], data["damaged"])
    return Result("Cache trust", rows=rows, body=body, data=data,
                  plot=lambda plt, meta: plot(plt, meta, rows, data["remote"]))


def render(payload: dict) -> Result:
    """The result set of a stored JSON (one written before the runner too: {"env", "remote" with its servers,
    ...})."""
    if "meta" in payload:
        return to_result(payload["rows"], stored_data(payload))
    data = {k: v for k, v in payload.items() if k != "env"}
    data["remote"] = {k: v for k, v in data["remote"].items() if k != "servers"}
    result = to_result([{"server": m, **r} for m, r in payload["remote"]["servers"].items()], data)
    result.meta = legacy_meta(payload["env"], gpu_used=False)
    return result


def plot(plt, meta: dict, servers: list[dict], remote: dict):
    """The remote tier's longest get and put against each hostile server, next to the deadline and its bar."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = range(len(servers))
    for off, op in ((-0.2, "get"), (0.2, "put")):
        bars = ax.bar([i + off for i in x], [r[f"{op}_max_s"] for r in servers], width=0.4, label=f"worst {op}")
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.axhline(remote["limit_s"], color="r", ls="--", lw=1, label=f"bar {remote['limit_s']} s (deadline + 10 %)")
    ax.axhline(remote["deadline_s"], color="k", ls=":", lw=1, label=f"deadline {remote['deadline_s']} s")
    ax.set_xticks(list(x))
    ax.set_xticklabels([r["server"] for r in servers])
    ax.set_ylabel("seconds (longest of the calls)")
    ax.set_ylim(0, remote["limit_s"] * 1.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"remote tier against hostile servers ({gpu_name(meta)}); redis-py with the same per-read timeout: "
                 f"blocked {remote['redis_py_trickle_blocked_s']} s", fontsize=9)
    fig.tight_layout()
    return fig


def _body(rd: dict, servers: list[dict], race_p: list[dict], race_t: list[dict], dc: dict) -> list:
    body = ["CPU only (no GPU involved)."]
    body.append(Table(("server", "worst get (s)", "worst put (s)", "within the bar", "warnings per call",
                       "peak allocation of a get"),
                      [(r["server"], r["get_max_s"], r["put_max_s"], "yes" if r["within"] else "NO",
                        "/".join(map(str, r["get_warnings_per_call"])), f"{r['get_peak_alloc_bytes']:,} B")
                       for r in servers],
                      title=f"Remote tier against hostile servers (deadline {rd['deadline_s']} s, bar {rd['limit_s']} s, "
                            f"{rd['calls_per_op']} calls per operation)"))
    body.append(f"redis-py with the same {rd['deadline_s']} s per-read timeout against the trickling server (the tier "
                f"before): blocked {rd['redis_py_trickle_blocked_s']} s.")
    rows = [(f"{r['processes']} processes", r["kernels"], r["keys_in_cache"], r["compiles"], r["compiles_per_key"])
            for r in race_p]
    rows += [(f"{r['threads']} threads", r["kernels"], r["kernels"], r["compiles"], r["compiles_per_key"])
             for r in race_t]
    body.append(Table(("racers (started together, empty cache)", "kernels", "keys in cache", "compiles",
                       "compiles per key"), rows, title="One compile per key"))
    body.append(Table(("damage", "verify reports"), [(k, v if not isinstance(v, int) else f"{v} found")
                                                     for k, v in dc["found"].items()],
                      title=f"`cache verify` on a deliberately damaged cache ({dc['entries']} entries)"))
    body.append(f"The runtime on the same cache recompiled {dc['runtime_recompiled']} kernels (the damaged entries) "
                f"and served every kernel byte-identical to a fresh compile: {dc['runtime_served_right']}.")
    return body
