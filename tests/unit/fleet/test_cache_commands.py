"""`rtckern cache ls` filters and `rtckern cache prune` by age, size and superseded toolchain."""

import hashlib
import json
import os
import time

from fleetkit import cli

from rtckern.cache import DiskCache
from rtckern.compiler.base import CompiledKernel


def _current_identity() -> str:
    from rtckern.compiler.nvrtc import NvrtcCompiler

    return NvrtcCompiler().identity()


def _fill(root, rows):
    d = DiskCache(root)
    keys = []
    for i, (op, arch, compiler, age_days) in enumerate(rows):
        key = hashlib.sha256(f"{i}".encode()).hexdigest()
        d.put(key, CompiledKernel(b"\x7fELF" + bytes(1000 * (i + 1)), "cubin", "k"),
              {"op": op, "arch": arch, "compiler": compiler, "name_expression": f"k{i}"})
        t = time.time() - age_days * 86400
        os.utime(d.entry_path(key), (t, t))
        keys.append(key)
    return d, keys


def test_ls_filters(tmp_path):
    cur = _current_identity()
    _, keys = _fill(tmp_path, [("gemm", "sm_90a", cur, 0), ("gemm", "sm_90", cur, 0), ("softmax", "sm_80", cur, 0),
                               ("softmax", "sm_90", "nvrtc-12.8|cuda-headers-12080|-std=c++17", 0)])

    def ls(*a):
        return {r["key"] for r in json.loads(cli("cache", "ls", "--json", *a, cache=tmp_path).stdout)}

    assert ls() == set(keys)
    assert ls("--op", "gemm") == set(keys[:2])
    assert ls("--arch", "9.0") == ls("--arch", "sm_90") == ls("--arch", "90") == {keys[1], keys[3]}
    assert ls("--arch", "sm_90a") == {keys[0]}
    assert ls("--toolchain", "nvrtc-12.8") == {keys[3]}
    assert ls("--op", "softmax", "--toolchain", cur.split("|")[0]) == {keys[2]}
    bad = cli("cache", "ls", "--arch", "hopper", cache=tmp_path, check=False)
    assert bad.returncode == 2 and "unknown arch entry 'hopper'" in bad.stderr


def test_prune_by_age_size_and_superseded_toolchain(tmp_path):
    cur = _current_identity()
    old_tc = "nvrtc-12.8|cuda-headers-12080|-std=c++17"
    d, keys = _fill(tmp_path, [("a", "sm_80", cur, 10), ("b", "sm_80", cur, 0.5), ("c", "sm_80", old_tc, 0),
                               ("d", "sm_80", "hiprtc-6.2", 0), ("e", "sm_80", cur, 0)])

    def prune(*a):
        return json.loads(cli("cache", "prune", "--json", *a, cache=tmp_path).stdout)

    assert prune("--older-than-days", "2")["removed"] == 1  # a, unused for 10 days
    assert prune("--superseded")["removed"] == 1  # c: another NVRTC; hiprtc entries are not NVRTC's to judge
    left = {e.key for e in d.entries()}
    assert left == {keys[1], keys[3], keys[4]}
    sizes = {e.key: e.size for e in d.entries()}
    # size: least recently used go first (b is the oldest of the rest)
    r = prune("--max-bytes", str(sizes[keys[3]] + sizes[keys[4]]))
    assert r["removed"] == 1 and {e.key for e in d.entries()} == {keys[3], keys[4]}
    assert r["bytes"] == sizes[keys[3]] + sizes[keys[4]]
