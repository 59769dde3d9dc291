"""What every benchmark result records (date, commit, host, GPU, driver, package versions) and the GPU file tag."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rtckern", "torch", "triton", "cupy-cuda13x", "cuda-core", "cuda-bindings", "cuda-pathfinder",
            "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "numpy", "transformers")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _output(args: list[str], timeout: float = 20) -> str | None:
    """stdout of a command, or None where it is missing or fails."""
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def smi_gpus() -> list[dict]:
    """The GPUs nvidia-smi lists (name, driver, memory, max SM clock); [] without nvidia-smi or a GPU."""
    out = _output(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                   "--format=csv,noheader"])
    gpus = []
    for line in (out or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4 and parts[0]:
            gpus.append({"name": parts[0], "driver": parts[1], "memory": parts[2], "max_sm_clock": parts[3]})
    return gpus


def gpu_count() -> int:
    """Visible CUDA GPUs: nvidia-smi's list, else torch's count where nvidia-smi is missing."""
    n = len(smi_gpus())
    if n or _output(["nvidia-smi", "-L"]) is not None:
        return n
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # no torch, or a torch without CUDA: no GPU this runner can use
        return 0


def gpu_tag(name: str | None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200': the file-name part that tells the GPUs apart
    (the same rule tools/device_run.sh used)."""
    words = (name or "").replace("NVIDIA", "").split()
    tag = "".join(ch for ch in (words[0] if words else "").lower() if ch.isascii() and ch.isalnum())
    return tag or "gpu"


def git_commit() -> tuple[str | None, bool]:
    """(short commit of the checkout, whether tracked files differ from it); (None, False) outside git.
    BENCH_COMMIT=<commit> names the commit where the checkout is a copy whose git metadata is older than its files
    (the device machine copies the working tree over the repository it started with): then clean is assumed."""
    given = os.environ.get("BENCH_COMMIT", "").strip()
    if given:
        return given, False
    commit = _output(["git", "rev-parse", "--short", "HEAD"])
    if not commit:
        return None, False
    status = _output(["git", "status", "--porcelain", "--untracked-files=no"])
    return commit, bool(status)


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def environment(date: str | None = None) -> dict:
    """The run's environment. Never initialises CUDA itself: GPU properties come from torch only where the suite
    already initialised it, else from nvidia-smi."""
    commit, dirty = git_commit()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    env: dict = {"date": date or utc_now(), "commit": commit, "dirty": dirty, "host": platform.node(),
                 "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                 "cores": os.cpu_count(), "loadavg": load,
                 "packages": {p: _version(p) for p in PACKAGES}}
    gpus = smi_gpus()
    env["nvidia_smi"] = gpus
    env["driver"] = gpus[0]["driver"] if gpus else None
    env["driver_cuda"] = None
    if gpus:
        try:
            from rtckern.runtime.driver import driver_version

            env["driver_cuda"] = "%d.%d" % driver_version()
        except Exception:  # recorded as unknown; the driver version above still names the driver
            pass
    env["gpu"] = None
    torch = sys.modules.get("torch")  # imported by the suite (or a stand-in of op_overhead --stub)
    if torch is not None:
        try:
            env["torch"] = str(torch.__version__)
            env["torch_cuda"] = torch.version.cuda
            env["cudnn"] = torch.backends.cudnn.version()
            if torch.cuda.is_initialized():
                p = torch.cuda.get_device_properties(0)
                env["gpu"] = {"name": p.name, "count": torch.cuda.device_count(), "sm_count": p.multi_processor_count,
                              "cc": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1)}
        except Exception:  # a torch without CUDA, or the CPU harness's stand-in torch
            pass
    if env["gpu"] is None and gpus:
        env["gpu"] = {"name": gpus[0]["name"], "count": len(gpus), "memory": gpus[0]["memory"]}
    try:
        from rtckern.compiler.nvrtc import NvrtcCompiler

        env["nvrtc"] = "%d.%d" % NvrtcCompiler().version()
    except Exception:  # no NVRTC here: recorded as unknown
        env["nvrtc"] = None
    return env


def describe(env: dict, command: str | None = None) -> list[str]:
    """The metadata lines at the top of every result markdown (missing fields are left out)."""
    commit = env.get("commit") or "unknown"
    if env.get("dirty"):
        commit += " (with uncommitted changes)"
    lines = [f"- date: {env.get('date') or 'not recorded'}, commit {commit}"
             + (f", host {env['host']}" if env.get("host") else "")]
    gpu = env.get("gpu") if env.get("gpu_used", True) else None
    if gpu:
        facts = [f"{gpu['sm_count']} SMs" if gpu.get("sm_count") else "", f"cc {gpu['cc']}" if gpu.get("cc") else "",
                 f"{gpu['memory_gib']} GiB" if gpu.get("memory_gib") else gpu.get("memory") or ""]
        facts = ", ".join(f for f in facts if f)
        count = f"{gpu['count']} x " if (gpu.get("count") or 1) > 1 else ""
        driver = (f"driver {env.get('driver') or 'not recorded'}"
                  + (f" (CUDA {env['driver_cuda']})" if env.get("driver_cuda") else ""))
        lines.append(f"- GPU: {count}{gpu.get('name')}" + (f" ({facts})" if facts else "") + f", {driver}")
    else:
        host = [str(env["cpu"]) if env.get("cpu") else "", f"{env['cores']} cores" if env.get("cores") else "",
                f"load average {env['loadavg']}" if env.get("loadavg") else ""]  # (unknown in older sets)
        host = ", ".join(f for f in host if f)
        lines.append("- GPU: none used (CPU only" + (f": {host})" if host else ")"))
    pk = env.get("packages") or {}
    torch = env.get("torch") or pk.get("torch")
    versions = []
    if torch:
        extra = ", ".join(x for x in (f"CUDA {env['torch_cuda']}" if env.get("torch_cuda") else "",
                                      f"cuDNN {env['cudnn']}" if env.get("cudnn") else "") if x)
        versions.append(f"torch {torch}" + (f" ({extra})" if extra else ""))
    versions.append(f"NVRTC {env.get('nvrtc') or 'unknown'}")
    versions += [f"{p} {pk[p]}" for p in ("cuda-core", "cuda-bindings", "cupy-cuda13x", "triton", "transformers",
                                          "numpy") if pk.get(p)]
    if env.get("python"):
        versions.append(f"Python {env['python']}")
    lines.append("- versions: " + ", ".join(versions))
    if command:
        lines.append(f"- command: `{command}`")
    return lines


# ---- result sets written before the runner ------------------------------------------------------------------------
# Their environment sat under "env", "environment" or "meta" (or at the top), under names that varied by suite.
LEGACY_NAMES = {"git": "commit", "rtckern_commit": "commit", "cuda_torch": "torch_cuda", "capability": "cc"}


def parse_smi(value) -> list[dict]:
    """nvidia-smi's GPUs as recorded before the runner: None, a list of dicts, or its CSV lines ("name, driver,
    [memory,] clock")."""
    if not value:
        return []
    if isinstance(value, list):
        return value
    gpus = []
    for line in str(value).splitlines():
        parts = [p.strip() for p in line.split(",")]
        gpu = {"name": parts[0], "driver": parts[1] if len(parts) > 1 else None}
        gpu.update({"memory": parts[2], "max_sm_clock": parts[3]} if len(parts) > 3 else
                   {"max_sm_clock": parts[2]} if len(parts) > 2 else {})
        gpus.append(gpu)
    return gpus


def legacy_meta(env: dict, *, gpu_used: bool, command: str | None = None) -> dict:
    """The runner's meta of an environment recorded before the runner. Every recorded field is kept (the known ones
    under the runner's names, the others as they were); a field that was never recorded stays out (or None)."""
    env = {LEGACY_NAMES.get(k, k): v for k, v in env.items()}
    smi = parse_smi(env.pop("nvidia_smi", None))
    gpu = env.pop("gpu", None)
    gpu = dict({"name": gpu} if isinstance(gpu, str) else gpu or {})
    for key in ("sm_count", "cc"):
        if key in env:
            gpu.setdefault(key, env.pop(key))
    torch_cuda = gpu.pop("torch_cuda", None) or env.pop("torch_cuda", None)
    if smi:
        gpu.setdefault("name", smi[0]["name"])
        gpu.setdefault("count", len(smi))
    packages = dict(env.pop("packages", None) or {})
    torch = env.pop("torch", None) or packages.get("torch")  # the full version (+cu130) where one was recorded
    for name in PACKAGES:
        if name in env and not isinstance(env[name], dict):
            packages.setdefault(name, env.pop(name))
    if isinstance(env.get("nvrtc"), str):
        env["nvrtc"] = env["nvrtc"].removeprefix("nvrtc-")
    meta = {"date": env.pop("date", None), "commit": env.pop("commit", None), "packages": packages,
            "nvidia_smi": smi, "driver": env.pop("driver", None) or (smi[0].get("driver") if smi else None),
            "gpu": (gpu or None) if gpu_used else None, "torch": torch, "torch_cuda": torch_cuda, "command": command,
            "gpu_used": gpu_used}
    return {**meta, **env}
