"""What every benchmark result records: date, GPU, driver and package versions; and result writing."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGES = ("rtckern", "torch", "triton", "cupy-cuda13x", "cuda-core", "cuda-bindings", "cuda-pathfinder",
            "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "numpy")


def environment() -> dict:
    env: dict = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                 "python": platform.python_version(), "host": platform.node()}
    vers = {}
    for p in PACKAGES:
        try:
            vers[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            vers[p] = None
    env["packages"] = vers
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
        env["nvidia_smi"] = out
    except (OSError, subprocess.SubprocessError):
        env["nvidia_smi"] = None
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env["gpu"] = {"name": p.name, "sm_count": p.multi_processor_count, "cc": f"{p.major}.{p.minor}",
                          "memory_gib": round(p.total_memory / 2**30, 1), "torch_cuda": torch.version.cuda}
    except Exception:
        pass
    try:
        from rtckern.compiler.nvrtc import NvrtcCompiler

        env["nvrtc"] = "%d.%d" % NvrtcCompiler().version()
    except Exception:
        pass
    return env


def out_dir() -> Path:
    """$OUT on the device machine, else benchmarks/results."""
    d = Path(os.environ.get("OUT") or Path(__file__).parent / "results")  # noqa: rtckern config is for the library
    d.mkdir(parents=True, exist_ok=True)
    return d


def write(name: str, payload: dict, markdown: str) -> tuple[Path, Path]:
    d = out_dir()
    j = d / f"{name}.json"
    m = d / f"{name}.md"
    j.write_text(json.dumps(payload, indent=2) + "\n")
    m.write_text(markdown)
    return j, m


def md_table(headers, rows) -> str:
    out = ["| " + " | ".join(str(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"
