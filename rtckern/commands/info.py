"""``rtckern info``: versions, NVRTC archs, visible devices, cache dir and stats."""

from __future__ import annotations

import json
import platform


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="versions, supported archs, visible devices, cache location and size")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def collect() -> dict:
    from importlib import metadata

    from .. import __version__
    from ..compiler.nvrtc import NvrtcCompiler, cuda_header_version, cuda_include_dir
    from ..config import settings
    from ..device import DeviceInfo, device_count
    from ..manager import get_manager

    def ver(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    info: dict = {"rtckern": __version__, "python": platform.python_version(),
                  "packages": {p: ver(p) for p in ("cuda-core", "cuda-bindings", "cuda-pathfinder",
                                                     "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "numpy",
                                                     "torch", "cupy-cuda13x", "hip-python")}}
    try:
        c = NvrtcCompiler()
        info["nvrtc"] = {"version": "%d.%d" % c.version(), "archs": [f"sm_{a}" for a in c.supported_archs()],
                         "cuda_headers": str(cuda_include_dir()), "cuda_header_version": cuda_header_version()}
    except Exception as e:
        info["nvrtc"] = {"error": str(e)}
    devices = []
    n = device_count()
    for i in range(n):
        d = DeviceInfo.from_device(i)
        devices.append({"ordinal": i, "name": d.name, "arch": d.arch.sm, "sm_count": d.sm_count,
                        "smem_per_block_optin": d.max_smem_per_block_optin, "regs_per_sm": d.regs_per_sm,
                        "warp_size": d.warp_size})
    info["devices"] = devices
    if n:
        from ..runtime.driver import driver_version

        info["driver_cuda_version"] = "%d.%d" % driver_version()
    s = settings()
    m = get_manager()
    disk = m.disk
    info["cache"] = {"dir": str(s.cache_dir), "enabled": bool(disk and disk.enabled),
                     "entries": sum(1 for _ in disk.entries(meta=False)) if disk else 0,
                     "bytes": disk.total_bytes() if disk else 0, "max_bytes": s.cache_max_bytes,
                     "read_only_layers": [str(p) for p in s.read_only_layers],
                     "remote": m.remote.endpoint.where() if m.remote is not None else None}  # never the password
    return info


def run(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
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
    if info["devices"]:
        print(f"devices (driver CUDA {info.get('driver_cuda_version')}):")
        for d in info["devices"]:
            print(f"  [{d['ordinal']}] {d['name']}  {d['arch']}  {d['sm_count']} SMs  "
                  f"{d['smem_per_block_optin'] // 1024} KB smem/block  warp {d['warp_size']}")
    else:
        print("devices: none visible (compile-only machine)")
    c = info["cache"]
    print(f"cache: {c['dir']}  ({c['entries']} entries, {c['bytes']} bytes"
          + (", disabled" if not c["enabled"] else "") + ")")
    return 0
