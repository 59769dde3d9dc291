"""Multi-GPU cold start: several ranks (one process per GPU, torchrun) starting cold on one cache directory.

    python -m benchmarks multi_gpu [--nproc N] [--cache-dir DIR]

Each rank records every compile/cache event, checks its outputs against torch, and the time from process
start to first correct output. Rank 0 checks that every kernel key was compiled exactly once across ranks. The
cache directory is a fresh empty one unless --cache-dir names one (it is then used as it is).
"""

from __future__ import annotations

import json
import os
import time

T_START = time.perf_counter()  # a rank's process start (this module is the first thing a rank imports)


def worker(result_path: str) -> None:
    """One rank, under torchrun; rank 0 writes the gathered result to result_path."""
    import torch
    import torch.distributed as dist

    import rtckern.ops as ops
    from rtckern import events

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")  # a CPU barrier is all this needs (no NCCL)
    torch.cuda.set_device(rank)
    seen = []
    events.add_listener(lambda e: seen.append((e.key, e.source, round(e.ms, 2), e.spec.name)))
    dev = f"cuda:{rank}"
    torch.manual_seed(rank)
    dist.barrier()
    t0 = time.perf_counter()
    x = torch.randn(1024, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    a = torch.randn(1024, 2048, device=dev, dtype=torch.bfloat16)
    b = torch.randn(2048, 1024, device=dev, dtype=torch.bfloat16)
    q = torch.randn(2, 1024, 16, 128, device=dev, dtype=torch.bfloat16)
    s = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)

    def rel(u, r):
        return ((u.double() - r.double()).norm() / r.double().norm()).item()

    errs = {
        "rms_norm": rel(ops.rms_norm(x, w), torch.nn.functional.rms_norm(x.float(), (4096,), w.float(), eps=1e-6)),
        "softmax": rel(ops.softmax(s), torch.softmax(s.float(), -1)),
        "gemm": rel(ops.gemm(a, b), a.float() @ b.float()),
        "attention": rel(ops.attention(q, q, q, causal=True),
                         torch.nn.functional.scaled_dot_product_attention(
                             q.transpose(1, 2).float(), q.transpose(1, 2).float(), q.transpose(1, 2).float(),
                             is_causal=True).transpose(1, 2)),
    }
    torch.cuda.synchronize()
    first_output_s = time.perf_counter() - t0
    mine = {"rank": rank, "device": torch.cuda.get_device_name(rank), "errors": errs,
            "ok": all(v < 2e-2 for v in errs.values()), "first_output_s": round(first_output_s, 3),
            "since_start_s": round(time.perf_counter() - T_START, 3),
            "compiles": [k for k, src, _, _ in seen if src == "compile"],
            "events": seen}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        from collections import Counter

        counts = Counter(k for g in gathered for k in g["compiles"])
        result = {"world": world, "ranks": gathered,
                  "keys_compiled": len(counts), "max_compiles_per_key": max(counts.values()) if counts else 0,
                  "every_key_compiled_once": all(c == 1 for c in counts.values()),
                  "all_ranks_correct": all(g["ok"] for g in gathered)}
        with open(result_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def add_args(ap) -> None:
    ap.add_argument("--nproc", type=int, default=None, help="ranks, one per GPU (default: every visible GPU)")
    ap.add_argument("--cache-dir", default=None, help="the shared cache directory (default: a fresh empty one)")


def run(args):
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from benchmarks.env import ROOT, gpu_count

    nproc = args.nproc or gpu_count()
    tmp = Path(tempfile.mkdtemp(prefix="rtckern-multi-"))
    try:
        cache = args.cache_dir or str(tmp / "cold-cache")
        out = tmp / "result.json"
        env = dict(os.environ, RTCKERN_CACHE_DIR=cache,
                   PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "-m",
               "benchmarks.multi_gpu", "--worker", str(out)]
        rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
        if rc != 0 or not out.is_file():
            raise RuntimeError(f"the ranks failed (torchrun exit status {rc}): {' '.join(cmd)}")
        result = json.loads(out.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return to_result(result)


def to_result(result: dict):
    from benchmarks.runner import Result, Table

    world = result["world"]
    rows = result.pop("ranks")
    table = [[g["rank"], g["device"], g["first_output_s"], len(g["compiles"]),
              sum(1 for e in g["events"] if e[1] != "compile"), g["ok"],
              " ".join(f"{k}={v:.1e}" for k, v in g["errors"].items())] for g in rows]
    body = [Table(["rank", "GPU", "time to first output (s)", "compiled", "cache hits", "correct", "rel. errors"],
                  table),
            f"Keys compiled: {result['keys_compiled']}; most compiles of one key across ranks: "
            f"{result['max_compiles_per_key']} (every key once: {result['every_key_compiled_once']}); "
            f"all ranks correct: {result['all_ranks_correct']}"]
    return Result(f"Multi-GPU cold start: {world} ranks, one cache directory", rows=rows, body=body, data=result,
                  gpus=world, plot=lambda plt, meta: plot(plt, meta, rows))


def render(payload: dict):
    """The result set of a stored JSON (one written before the runner too: {"env", "world", "ranks", ...})."""
    if "rows" in payload:
        from benchmarks.runner import stored_data

        return to_result({**stored_data(payload), "ranks": payload["rows"]})
    from benchmarks.env import legacy_meta

    result = to_result({k: v for k, v in payload.items() if k != "env"})
    result.meta = legacy_meta(payload["env"], gpu_used=True)
    return result


def first_loads(rank: dict) -> dict:
    """kernel -> (source, ms) of a rank's first get of each kernel that missed memory: compiled, or read from the
    shared disk cache (another rank's compile)."""
    out = {}
    for _key, source, ms, kernel in rank["events"]:
        if source != "memory":
            out.setdefault(kernel, (source, ms))
    return out


def plot(plt, meta: dict, ranks: list[dict]):
    """Per kernel and rank, the ms of its first get, colored by where it came from: one compile per key across
    the ranks, the others read it from the shared cache."""
    from benchmarks.runner import gpu_name

    loads = [first_loads(r) for r in ranks]
    kernels = list(dict.fromkeys(k for lo in loads for k in lo))
    colors = {"compile": "tab:red", "disk": "tab:blue"}
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(kernels) * len(ranks) + 1.8))
    height = 0.8 / len(ranks)
    for i, (rank, lo) in enumerate(zip(ranks, loads)):
        for j, k in enumerate(kernels):
            if k in lo:
                source, ms = lo[k]
                y = j + (i - (len(ranks) - 1) / 2) * height
                ax.barh(y, ms, height=height, color=colors.get(source, "tab:gray"))
                ax.text(ms, y, f" rank {rank['rank']}: {source} {ms:.0f} ms", va="center", fontsize=7)
    ax.set_yticks(range(len(kernels)))
    ax.set_yticklabels(kernels, fontsize=8)
    ax.invert_yaxis()
    ax.margins(x=0.35)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c, label=src) for src, c in colors.items()], fontsize=8,
              loc="lower right")
    ax.set_xlabel("ms of the first get: its compile, or its read from the shared cache (waiting on the compiling rank "
                  "included)")
    ax.set_title(f"multi-GPU cold start: {len(ranks)} ranks on {gpu_name(meta)}, one cache directory")
    fig.tight_layout()
    return fig


if __name__ == "__main__":  # a rank, started by run() through torchrun
    import sys

    if sys.argv[1:2] != ["--worker"] or len(sys.argv) != 3:
        raise SystemExit("a rank of `python -m benchmarks multi_gpu`: run that instead")
    worker(sys.argv[2])
