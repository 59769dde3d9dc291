"""``rtckern info``: versions, compilers (NVRTC, hiprtc), visible devices, every cache tier (the disk cache, the
read-only layers, the remote tier and whether it answers) and the effective settings. Creates nothing."""

from __future__ import annotations

import json
import platform

from ._help import add_command

REMOTE_PING_MAX_S = 2.0  # info waits at most this long for the remote tier (or RTCKERN_REMOTE_TIMEOUT_S if shorter)


def add_parser(sub) -> None:
    p = add_command(
        sub, "info", summary="versions, compilers, devices, cache tiers and effective settings",
        description="Shows the rtckern and package versions, NVRTC (its archs and CUDA headers) and hiprtc, the "
                    "visible GPUs, the disk cache, the read-only layers (RTCKERN_CACHE_LAYERS) and the remote tier "
                    f"(RTCKERN_REMOTE_CACHE: asked for PING, waiting at most {REMOTE_PING_MAX_S:g} s), then every "
                    "setting in effect, marking those set in the environment. Reads only: a missing cache "
                    "directory is reported, not created.",
        examples=["rtckern info", "rtckern info --json | python -m json.tool",
                  "RTCKERN_CACHE_DIR=/mnt/shared/rtckern rtckern info"])
    p.add_argument("--json", action="store_true", help="print everything as JSON (keys: rtckern, python, packages, "
                   "nvrtc, hiprtc, devices, driver_cuda_version, cache, settings)")
    p.set_defaults(func=run)


def _packages() -> dict:
    from importlib import metadata

    def ver(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {p: ver(p) for p in ("cuda-core", "cuda-bindings", "cuda-pathfinder", "nvidia-cuda-nvrtc",
                                "nvidia-cuda-runtime", "numpy", "tqdm", "torch", "cupy-cuda13x", "hip-python")}


def _nvrtc() -> dict:
    from ..compiler.nvrtc import NvrtcCompiler, cuda_header_version, cuda_include_dir

    try:
        c = NvrtcCompiler()
        return {"version": "%d.%d" % c.version(), "archs": [f"sm_{a}" for a in c.supported_archs()],
                "cuda_headers": str(cuda_include_dir()), "cuda_header_version": cuda_header_version()}
    except Exception as e:
        return {"error": str(e)}


def _hiprtc() -> dict:
    """hiprtc (AMD targets): its library, versions and gfx targets, or why it is unavailable."""
    try:
        from ..compiler.hiprtc import HiprtcCompiler

        c = HiprtcCompiler()
        return {"available": True, "library": c.library_path, "version": "%d.%d" % c.version(),
                "comgr": c.comgr_version(), "targets": len(c.supported_archs())}
    except Exception as e:  # HiprtcUnavailable (no library) and anything a broken install raises
        return {"available": False, "error": str(e).splitlines()[0] if str(e) else type(e).__name__}


def _devices() -> tuple[list[dict], str | None]:
    from ..device import DeviceInfo, device_count

    devices = []
    n = device_count()
    for i in range(n):
        d = DeviceInfo.from_device(i)
        devices.append({"ordinal": i, "name": d.name, "arch": d.arch.sm, "sm_count": d.sm_count,
                        "smem_per_block_optin": d.max_smem_per_block_optin, "regs_per_sm": d.regs_per_sm,
                        "warp_size": d.warp_size})
    if not n:
        return devices, None
    from ..runtime.driver import driver_version

    return devices, "%d.%d" % driver_version()


def _tier(root, *, writable: bool) -> dict:
    """One directory tier: whether it exists, its entries and bytes; never created."""
    from ..cache import DiskCache
    from ._cache_dir import is_cache

    out = {"dir": str(root), "exists": is_cache(root), "entries": 0, "bytes": 0}
    if out["exists"]:
        d = DiskCache(root, read_only=True)
        sizes = [e.size for e in d.entries(meta=False)]
        out.update(entries=len(sizes), bytes=sum(sizes))
        if writable:
            import os

            out["writable"] = os.access(root, os.W_OK)
    return out


def _remote(s) -> dict | None:
    if not s.remote_cache:
        return None
    from ..cache.remote import remote_from_settings

    tier = remote_from_settings(s)
    try:
        why = tier.ping(min(s.remote_timeout_s, REMOTE_PING_MAX_S))
    finally:
        tier.close()
    return {"where": tier.endpoint.where(), "reachable": why is None, "error": why}  # never the password


def collect() -> dict:
    from .. import __version__
    from ..config import effective, settings

    s = settings()
    devices, driver = _devices()
    # driver_cuda_version: null where no CUDA driver answers (a CPU-only machine), as --help lists the key
    info: dict = {"rtckern": __version__, "python": platform.python_version(), "packages": _packages(),
                  "nvrtc": _nvrtc(), "hiprtc": _hiprtc(), "devices": devices, "driver_cuda_version": driver or None}
    disk = _tier(s.cache_dir, writable=True)
    remote = _remote(s)
    info["cache"] = {**disk, "enabled": s.disk_cache, "max_bytes": s.cache_max_bytes,
                     "read_only_layers": [str(p) for p in s.read_only_layers],
                     "layers": [_tier(p, writable=False) for p in s.read_only_layers],
                     "remote": remote["where"] if remote else None, "remote_status": remote}
    info["settings"] = effective(s)
    return info


def _tier_line(t: dict) -> str:
    from ._table import human_bytes

    if not t["exists"]:
        return f"no cache at {t['dir']}"
    ro = "" if t.get("writable", True) else ", not writable"
    return f"{t['dir']}  ({t['entries']} entries, {human_bytes(t['bytes'])}{ro})"


def run(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from ._table import human_bytes

    print(f"rtckern {info['rtckern']}  (Python {info['python']})")
    for k, v in info["packages"].items():
        if v:
            print(f"  {k:<22} {v}")
    nv = info["nvrtc"]
    if "error" in nv:
        print(f"NVRTC: unavailable ({nv['error']})")
    else:
        print(f"NVRTC {nv['version']}: {' '.join(nv['archs'])}")
        print(f"  CUDA headers {nv['cuda_header_version']} at {nv['cuda_headers']}")
    hip = info["hiprtc"]
    print(f"hiprtc {hip['version']} (comgr {hip['comgr']}, {hip['targets']} gfx targets) at {hip['library']}"
          if hip["available"] else f"hiprtc: unavailable ({hip['error']})")
    if info["devices"]:
        print(f"devices (driver CUDA {info.get('driver_cuda_version')}):")
        for d in info["devices"]:
            print(f"  [{d['ordinal']}] {d['name']}  {d['arch']}  {d['sm_count']} SMs  "
                  f"{d['smem_per_block_optin'] // 1024} KB smem/block  warp {d['warp_size']}")
    else:
        print("devices: none visible (compile-only machine)")
    c = info["cache"]
    cap = f", capped at {human_bytes(c['max_bytes'])}" if c["max_bytes"] else ""
    print(f"disk cache: {_tier_line(c)}" + ("" if c["enabled"] else "  [disabled: RTCKERN_DISK_CACHE=0]") + cap)
    for layer in c["layers"]:
        print(f"read-only layer: {_tier_line(layer)}")
    if not c["layers"]:
        print("read-only layers: none (RTCKERN_CACHE_LAYERS)")
    r = c["remote_status"]
    if r is None:
        print("remote tier: none (RTCKERN_REMOTE_CACHE)")
    else:
        print(f"remote tier: {r['where']}  " + ("(reachable)" if r["reachable"] else f"(unreachable: {r['error']})"))
    print("settings (* = set in the environment):")
    width = max(len(x["env"]) for x in info["settings"])
    for x in info["settings"]:
        print(f"  {'*' if x['set'] else ' '} {x['env']:<{width}}  {x['value'] or '-'}")
    return 0
