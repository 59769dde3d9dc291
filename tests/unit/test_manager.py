import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from rtckern import events
from rtckern.arch import Arch
from rtckern.manager import KernelManager
from rtckern.spec import KernelSpec


def test_compile_then_hits(manager, axpy_spec):
    seen = []
    events.add_listener(seen.append)
    try:
        a = manager.compile(axpy_spec)
        b = manager.compile(axpy_spec)
        c = KernelManager(manager.cache_dir).compile(axpy_spec)
    finally:
        events.remove_listener(seen.append)
    assert a.binary == b.binary == c.binary
    assert [e.source for e in seen] == ["compile", "memory", "disk"]
    assert manager.stats.compiles == 1


def test_corrupt_entry_recompiled_and_replaced(manager, axpy_spec):
    from rtckern.cache import CacheWarning

    ck = manager.compile(axpy_spec)
    key = manager.key(axpy_spec)
    manager.disk.entry_path(key).write_bytes(b"RTKCACHE" + b"\x00" * 10)
    fresh = KernelManager(manager.cache_dir)
    with pytest.warns(CacheWarning, match="invalid"):
        again = fresh.compile(axpy_spec)
    assert again.binary == ck.binary and fresh.stats.compiles == 1
    assert KernelManager(manager.cache_dir).disk.get(key).binary == ck.binary  # replaced on disk


def test_memory_only_when_disk_disabled(cache_dir, axpy_spec):
    m = KernelManager(cache_dir, disk=False)
    m.compile(axpy_spec)
    assert m.disk is None and not any(cache_dir.rglob("*.rtk"))


def _race(args):
    cache_dir, barrier_path = args
    from rtckern.manager import KernelManager as KM
    while not os.path.exists(barrier_path):
        time.sleep(0.001)
    m = KM(cache_dir)
    spec = KernelSpec("core/axpy.cuh", "coop_sum", Arch(9, 0))
    ck = m.compile(spec)
    return m.stats.compiles, ck.binary


def test_eight_processes_compile_once(tmp_path):
    cache_dir = str(tmp_path / "c")
    barrier = str(tmp_path / "go")
    ctx = mp.get_context("spawn")
    with ctx.Pool(8) as pool:
        res = pool.map_async(_race, [(cache_dir, barrier)] * 8)
        time.sleep(1.5)  # let all eight start and wait at the barrier
        open(barrier, "w").close()
        results = res.get(timeout=120)
    assert sum(c for c, _ in results) == 1
    assert len({b for _, b in results}) == 1


def test_killed_lock_holder_does_not_block(tmp_path, axpy_spec):
    """A process SIGKILLed while holding a key's lock leaves no partial entry and no blocking lock."""
    cache_dir = tmp_path / "c"
    m = KernelManager(cache_dir)
    key = m.key(axpy_spec)
    code = (
        "import sys,time; from rtckern.cache import DiskCache; from pathlib import Path;"
        f"d=DiskCache(Path({str(cache_dir)!r}));"
        f"cm=d.lock({key!r}); cm.__enter__(); print('locked', flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    t0 = time.perf_counter()
    ck = m.compile(axpy_spec)
    assert time.perf_counter() - t0 < 30 and ck.kind == "cubin"
    assert not list((cache_dir / "v1").rglob("*.tmp"))


def test_get_on_described_device_refused(manager, axpy_spec):
    from rtckern.device import DeviceInfo
    from rtckern.errors import LaunchError

    with pytest.raises(LaunchError, match="cannot load on a described"):
        manager.get(axpy_spec, DeviceInfo.for_arch("sm_80"))


def test_no_remote_tier_module_without_a_remote_cache(tmp_path):
    """A manager without RTCKERN_REMOTE_CACHE does not import the remote tier (sockets, TLS): first-call cost."""
    code = ("import sys; from rtckern.manager import KernelManager; KernelManager(); "
            "print('rtckern.cache.remote' in sys.modules, 'ssl' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "RTCKERN_REMOTE_CACHE"}
    env["RTCKERN_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
