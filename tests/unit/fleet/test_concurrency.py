"""Many processes, one cache: every key compiled once, nothing lost; a SIGKILLed compile leaves no entry and no
lock that blocks the others."""

import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest
from fleetkit import ROOT, UNIT, write_manifest

from rtckern.arch import Arch
from rtckern.cache import DiskCache
from rtckern.manager import KernelManager
from rtckern.spec import KernelSpec

POOL = [{"op": "axpy", "dtype": dt, "shape": [n], **({"aligned": 0} if n == 4098 else {})}
        for dt in ("fp32", "fp16", "bf16") for n in (1000, 4098, 1 << 20)]


def _env(cache):
    e = dict(os.environ, RTCKERN_CACHE_DIR=str(cache))
    e["PYTHONPATH"] = os.pathsep.join([str(UNIT), str(ROOT), e.get("PYTHONPATH", "")])
    return e


@pytest.mark.slow
def test_eight_processes_overlapping_manifests_compile_each_key_once(tmp_path):
    import json

    cache = tmp_path / "cache"
    procs = []
    for i in range(8):  # windows of 5 of the 9 lines: every line is in several manifests
        lines = [POOL[(i + j) % len(POOL)] for j in range(5)]
        m = write_manifest(tmp_path / f"m{i}.jsonl", lines)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "rtckern", "prefill", "--import", "registry_testkit_plugin", "--manifest", str(m),
             "--arch", "8.0;9.0a", "-j", "1", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=_env(cache), cwd=ROOT))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err.decode()[-2000:]
        outs.append(json.loads(out))
    d = DiskCache(cache)
    entries = {e.key for e in d.entries()}
    # every key some process served is in the cache, valid
    served = set()
    for i in range(8):
        served |= _served_keys(tmp_path / f"m{i}.jsonl", cache)
    assert served == entries and len(entries) >= 10
    assert d.verify(remove=False)["corrupt"] == 0
    # each key was compiled by exactly one process; the others found it cached
    assert sum(o["compiled"] for o in outs) == len(entries)
    assert all(o["served"] == o["requests"] == 10 for o in outs)


def _served_keys(manifest, cache):
    """The keys the manifest needs, planned in this process (no compile: they must all be cached already)."""
    from fleetkit import kit

    from rtckern.fleet import load_manifest, plan
    from rtckern.prefill import parse_archs

    reg = kit.make_registry(None)
    m = KernelManager(cache, remote=None)
    keys = set()
    for p in plan(load_manifest(manifest), parse_archs("8.0;9.0a"), reg):
        for link in p.chain:
            ks = [m.key(s) for s in link.specs]
            if all(m.disk.get_packed(k) for k in ks):
                keys |= set(ks)
                break
    return keys


SLOW = r'''
template <int N> struct Chain { __device__ static float f(float x) { return Chain<N-1>::f(x * 1.0001f + __sinf(x)); } };
template <> struct Chain<0> { __device__ static float f(float x) { return x; } };
extern "C" __global__ void slow_kernel(float* y) {
  float v = y[threadIdx.x];
#pragma unroll
  for (int i = 0; i < SLOW_N; ++i) v = Chain<64>::f(v + i);
  y[threadIdx.x] = v;
}
'''


def _slow_spec() -> KernelSpec:
    return KernelSpec("test/slow.cu", "slow_kernel", Arch.parse("sm_80"), code=SLOW, defines=(("SLOW_N", "128"),))


def _held(lock_path) -> bool:
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@pytest.mark.slow
def test_sigkill_mid_compile_leaves_no_entry_and_no_blocking_lock(tmp_path):
    cache = tmp_path / "cache"
    m = KernelManager(cache, remote=None)
    spec, d = _slow_spec(), DiskCache(cache)
    key = m.key(spec)
    code = ("import sys; sys.path.insert(0, %r); from test_concurrency import _slow_spec; "
            "from rtckern.manager import KernelManager; KernelManager(%r, remote=None).compile(_slow_spec())"
            % (str(UNIT / "fleet"), str(cache)))
    child = subprocess.Popen([sys.executable, "-c", code], env=_env(cache), cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not _held(d.lock_path(key)):  # the child holds the per-key lock: it is compiling
        assert child.poll() is None, child.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the child never took the lock"
        time.sleep(0.02)
    time.sleep(0.2)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not d.entry_path(key).exists() and not d.meta_path(key).exists()
    assert not [p for p in (cache / "v1").rglob("*") if p.is_file()]  # no partial or temp file
    t0 = time.monotonic()
    with d.lock(key, timeout=5):  # the kernel released the dead process's flock
        assert time.monotonic() - t0 < 1.0
    ck = m.compile(spec)
    assert m.stats.compiles == 1 and d.get(key).binary == ck.binary


LOCK_WORKER = r'''
import os, sys, time
from rtckern.cache import DiskCache
d, key, flag, n = DiskCache(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
overlaps = 0
for i in range(n):
    with d.lock(key, timeout=120):
        try:
            fd = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:  # someone else is inside too
            overlaps += 1
            continue
        os.close(fd)
        time.sleep(0.0005)
        os.unlink(flag)
print(overlaps)
'''


def test_lock_excludes_while_housekeeping_removes_lock_files(tmp_path):
    """Holders remove their lock file on release and `prune`/`clear` remove free ones, while others wait on it:
    whoever takes a lock checks that its file is still the one at the path, so two holders never overlap."""
    cache, key = tmp_path / "cache", "ef" + "9" * 62
    d = DiskCache(cache)
    procs = [subprocess.Popen([sys.executable, "-c", LOCK_WORKER, str(cache), key, str(tmp_path / "inside"), "150"],
                              stdout=subprocess.PIPE, text=True, env=_env(cache)) for _ in range(4)]
    cleanups = 0
    while any(p.poll() is None for p in procs):
        d.prune() if cleanups % 2 else d.clear()
        cleanups += 1
    outs = [p.communicate()[0] for p in procs]
    assert all(p.returncode == 0 for p in procs) and [int(o) for o in outs] == [0, 0, 0, 0]
    assert cleanups > 10 and not d.lock_path(key).exists()
