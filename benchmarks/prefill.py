"""Prefill (CPU only): the README's first command, `rtckern prefill` (the built-in set for the default arch list),
run cold on an empty cache and then warm, in CPU-seconds.

    python -m benchmarks prefill [--arch LIST] [--warm-runs 3] [--quick]

CPU-seconds are user + system time of the command and of every worker process it starts (the children's rusage):
what the work costs whatever else shares the machine. Wall time is recorded beside them, but on a shared machine
it depends on the neighbours (the load average at the start and end of each run is recorded too). The command runs
exactly as a user types it, in a fresh process, with RTCKERN_CACHE_DIR pointing to a new empty directory; --arch
passes an arch list instead of the default. --quick: the core kernels for one arch, one warm run (a smoke test).
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.runner import Result, Table

TOTAL = re.compile(r"^(\d+) kernels for (\S+) in ([0-9.]+) s with (\d+) process", re.MULTILINE)
QUICK = "the core kernels for sm_90 only, one warm run (a smoke test of the suite)"


def add_args(p) -> None:
    p.add_argument("--arch", default=None, help="arch list to pass as --arch (default: none, the default list)")
    p.add_argument("--warm-runs", type=int, default=3, help="warm runs after the cold one (default 3)")


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_once(command: list[str], cache_dir: Path) -> dict:
    """One run of the command: wall and CPU seconds (the process and its workers), its summary line, load."""
    env = dict(os.environ, RTCKERN_CACHE_DIR=str(cache_dir))
    for var in ("RTCKERN_ARCH_LIST", "RTCKERN_REMOTE_CACHE", "RTCKERN_CACHE_LAYERS"):
        env.pop(var, None)  # the defaults, as on a fresh machine
    load0 = os.getloadavg()[0]
    cpu0, t0 = _children_cpu_s(), time.perf_counter()
    r = subprocess.run(command, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - cpu0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {r.returncode}: {r.stderr[-2000:]}")
    m = TOTAL.search(r.stdout)
    if m is None:
        raise RuntimeError(f"no summary line in the output of {' '.join(command)}:\n{r.stdout[-2000:]}")
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "kernels": int(m.group(1)), "archs": m.group(2),
            "reported_s": float(m.group(3)), "processes": int(m.group(4)),
            "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)], "table": r.stdout.strip()}


def run(args) -> Result:
    command = ["rtckern", "prefill"]
    if args.quick:
        command += ["--arch", "9.0", "--family", "core"]
    elif args.arch:
        command += ["--arch", args.arch]
    tmp = Path(tempfile.mkdtemp(prefix="rtckern-prefill-bench-"))
    try:
        cold = run_once(command, tmp / "cache")
        warm = [run_once(command, tmp / "cache") for _ in range(1 if args.quick else max(1, args.warm_runs))]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [dict(run="cold (empty cache)", **{k: v for k, v in cold.items() if k != "table"})]
    rows += [dict(run=f"warm {i + 1} (all cached)", **{k: v for k, v in w.items() if k != "table"})
             for i, w in enumerate(warm)]
    table = Table(["run", "kernels", "CPU-seconds", "wall s", "processes", "load avg (1 min) before, after"],
                  [(r["run"], r["kernels"], r["cpu_s"], r["wall_s"], r["processes"],
                    f"{r['loadavg_1min'][0]}, {r['loadavg_1min'][1]}") for r in rows])
    cores = os.cpu_count()
    note = (f"`{' '.join(command)}` on {cores} cores, {cold['processes']} compile processes (the default: one per "
            f"core, at most 8), arch list {cold['archs']}. CPU-seconds are user + system time of the command and "
            "its worker processes; wall time depends on what else ran on this shared machine. The cold run's "
            "output:\n\n```\n" + cold["table"] + "\n```")
    return Result(title="rtckern prefill: the built-in kernel set, cold and warm, in CPU-seconds", rows=rows,
                  body=[table, note], data={"command_measured": " ".join(command), "cores": cores})
