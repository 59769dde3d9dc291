"""Registry and tuning on a live GPU: selection matches explain (live and a hand-described twin), loaded
kernels run and compute the right thing, live-only resource checks, the numerical probe, persisted live
decisions in a second process, and `rtckern tune` writing a table the next process uses."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "tests" / "unit"
sys.path.insert(0, str(UNIT))
import registry_testkit as kit  # noqa: E402

from rtckern.device import DeviceInfo  # noqa: E402
from rtckern.registry import Registry, Resources, default_registry, explain  # noqa: E402
from rtckern.registry.explain import build_request  # noqa: E402
from rtckern.spec import KernelSpec  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def live():
    return DeviceInfo.from_device(0)


def twin(live: DeviceInfo) -> DeviceInfo:
    """The live device's properties, described by hand: what `rtckern explain --arch` sees on a build host."""
    return dataclasses.replace(live, ordinal=None)


def env_for(tmp_path: Path, **extra) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(UNIT)]),
                RTCKERN_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1", **extra)


# On an H200 (sm_90, 132 SMs, 227 KB opt-in smem) the test candidates choose:
H200_TABLE = [("bf16", 1001, "axpy.hopper"), ("bf16", 1 << 20, "axpy.hopper"), ("fp32", 1001, "axpy.bigsmem"),
              ("fp32", 1 << 17, "axpy.bigsmem"), ("fp32", 1 << 20, "axpy.persistent"), ("fp16", 1 << 16, "axpy.wide"),
              ("fp16", 1001, "axpy.fallback")]


@pytest.mark.parametrize("dtype, n, expected", H200_TABLE)
def test_selection_matches_explain_and_runs(cache_dir, tmp_path, live, dtype, n, expected):
    if (live.arch.cc, live.sm_count) != ((9, 0), 132):
        pytest.skip(f"table written for an sm_90 with 132 SMs, this is {live.describe()}")
    req = kit.axpy_request(live, n=n, dtype=dtype)
    sel = kit.make_registry(tmp_path / "a").select(req)
    exp_live = explain(req, registry=kit.make_registry(tmp_path / "b"))
    exp_twin = explain(req.with_device(twin(live)), registry=kit.make_registry(tmp_path / "c"))
    assert (sel.name, exp_live.chosen, exp_twin.chosen) == (expected, expected, expected)
    assert exp_live.mode == "live" and exp_twin.mode == "compile-only"
    assert exp_live.chosen_result.cache_keys == exp_twin.chosen_result.cache_keys
    assert len(sel.kernels) == 1 and sel.kernels[0].device.ordinal == 0
    if expected != "axpy.bigsmem":  # bigsmem's kernel is smem_reverse, checked below
        assert kit.axpy_selftest(sel.candidate, req, sel.kernels) is None


def test_real_ops_selection_matches_explain(cache_dir, live):
    """Every built-in op with an example request: select on the GPU == explain on the GPU == explain on its
    hand-described twin."""
    import argparse
    import shlex

    import rtckern.ops  # noqa: F401  (registers the op families)

    def _example_args(example: str) -> argparse.Namespace:  # a request builder's example: --dtype, --shape, --opt
        p = argparse.ArgumentParser(add_help=False)
        p.add_argument("--dtype", default=None)
        p.add_argument("--shape", default=None)
        p.add_argument("--opt", action="append", default=[])
        return p.parse_known_args(shlex.split(example))[0]

    reg = default_registry()
    seen = []
    for op in reg.builder_ops():
        ex = _example_args(reg.request_builder(op).example)
        if ex.shape is None:
            continue
        opts = dict(o.split("=", 1) for o in ex.opt)
        req = build_request(reg, op, shape=ex.shape, dtype=ex.dtype, device=live, options=opts)
        try:
            chosen = reg.select(req).name
        except Exception as exc:  # UnsupportedRequestError: then explain must say none too
            chosen = None
            assert type(exc).__name__ == "UnsupportedRequestError", exc
        fresh = Registry(None)
        for c in reg.candidates(op):
            fresh.register(c)
        assert explain(req, registry=fresh).chosen == chosen, op
        assert explain(req.with_device(twin(live)), registry=fresh).chosen == chosen, op
        seen.append((op, chosen))
    print("real ops:", seen)
    assert seen


class Coop(kit._Axpy):
    """A cooperative launch of `grid` blocks of 1024 threads: co-resident only if grid <= occupancy x SMs."""

    name, priority, min_arch = "axpy.coop", 500, "sm_80"
    grid = 1 << 16

    def kernel_specs(self, req):
        return (KernelSpec("core/axpy.cuh", "coop_sum", self.target(req), op=kit.OP),)

    def launch_resources(self, req):
        return (Resources(block=1024, cooperative_grid=self.grid),)


def test_live_resource_checks(cache_dir, tmp_path, live):
    class SmallCoop(Coop):
        name, grid = "axpy.coop_small", live.sm_count

    reg = Registry(tmp_path / "d")
    for c in (Coop(), SmallCoop(), kit.BigSmem(), kit.Fallback()):
        reg.register(c)
    req = kit.axpy_request(live, n=1001, dtype="fp32")
    res = {r.name: r for r in reg.probe(req, stop_at_first=False)[0]}
    (why,) = res["axpy.coop"].reasons
    assert why.stage == "resources" and f"cooperative grid of {1 << 16} blocks >" in why.message
    assert f"x {live.sm_count} SMs" in why.message
    assert res["axpy.coop_small"].accepted
    # compile-only cannot see occupancy: the twin accepts what the live device refuses (explain says so)
    twin_res = {r.name: r for r in reg.probe(req.with_device(twin(live)), stop_at_first=False)[0]}
    assert twin_res["axpy.coop"].accepted
    bigsmem_ok = live.max_smem_per_block_optin >= kit.BIG_SMEM
    assert res["axpy.bigsmem"].accepted == bigsmem_ok
    if bigsmem_ok:  # the probe opted the kernel into 200 KB: launching with it works and reverses the input
        import cupy as cp

        sel = Registry(tmp_path / "e")
        sel.register(kit.BigSmem())
        s = sel.select(req)
        n = kit.BIG_SMEM // 4
        x = cp.asarray(np.random.default_rng(0).standard_normal(n).astype(np.float32))
        y = cp.full(n, np.nan, dtype=cp.float32)
        s.kernels[0].launch(1, 256, (x.data.ptr, y.data.ptr, n), shared_mem=kit.BIG_SMEM)
        cp.cuda.Device().synchronize()
        assert cp.array_equal(y, x[::-1])


class WrongMath(kit._Axpy):
    """Compiles, loads and fits, but computes y = a * x: only the numerical probe catches it."""

    name, priority, min_arch = "axpy.wrong", 400, "sm_80"

    def kernel_specs(self, req):
        code = ('#include "common/dtypes.cuh"\n'
                "template <typename T> __global__ void wrong_axpy(const T* x, T* y, float a, long long n) {\n"
                "  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
                "  if (i < n) y[i] = rtk_from_float<T>(a * rtk_to_float(x[i]));\n}\n")
        return (KernelSpec("test/wrong_axpy.cu", "wrong_axpy", self.target(req), code=code,
                           template_args=(kit._CTYPE[req.dtype("x")],), op=kit.OP),)


def test_numerical_probe_rejects_wrong_results(cache_dir, tmp_path, live):
    req = kit.axpy_request(live, n=1 << 16, dtype="fp16")
    reg = kit.make_registry(tmp_path / "off", numeric=False)
    reg.register(WrongMath())
    assert reg.select(req).name == "axpy.wrong"
    reg = kit.make_registry(tmp_path / "on", numeric=True)
    reg.register(WrongMath())
    sel = reg.select(req)
    assert sel.name == "axpy.wide"
    (wrong,) = [r for r in sel.results if r.name == "axpy.wrong"]
    assert wrong.reasons[0].stage == "numeric" and wrong.reasons[0].message.startswith("relative error")
    assert "numeric" in [r for r in sel.results if r.name == "axpy.wide"][0].checks


_CHILD = r"""
import json, sys
sys.path.insert(0, {unit!r})
import registry_testkit as kit
from rtckern.arch import Arch
from rtckern.compiler import compiler_for
from rtckern.device import DeviceInfo
nvrtc = compiler_for(Arch.parse("sm_90"))
calls, real = [], nvrtc.compile
nvrtc.compile = lambda spec: (calls.append(spec.name), real(spec))[1]
reg = kit.make_registry({store!r})
req = kit.axpy_request(DeviceInfo.from_device(0), n=1001, dtype="fp16")
sel = reg.select(req)
print(json.dumps({{"chosen": sel.name, "compiled": calls, "kernels": len(sel.kernels),
                  "from_store": {{r.name: r.from_store for r in sel.results}}}}))
"""


def test_live_decisions_are_read_by_a_second_process(tmp_path):
    code = _CHILD.format(unit=str(UNIT), store=str(tmp_path / "decisions"))
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env_for(tmp_path), capture_output=True, text=True,
                             timeout=180)
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["chosen"] == second["chosen"] == "axpy.fallback"
    assert sorted(first["compiled"]) == ["axpy", "broken_axpy"]
    assert second["compiled"] == [] and second["kernels"] == 1  # kernels from the disk cache, no retry of broken
    assert second["from_store"]["axpy.broken"] and second["from_store"]["axpy.fallback"]


def test_tune_writes_a_table_the_next_process_uses(tmp_path, live):
    tdir = tmp_path / "tuning"
    tdir.mkdir()
    other = {"arch": "sm_80", "sm_count": 108, "shape": {"dtype": "bf16", "n": 1048576}, "config": {"block": 64},
             "date": "2026-01-01T00:00:00Z", "versions": {"device": "NVIDIA A100"}}
    (tdir / "axpy.json").write_text(json.dumps({"format": 1, "op": "axpy", "key_fields": ["dtype", "n"],
                                                 "rows": [other]}))
    env = env_for(tmp_path, RTCKERN_TUNING_DIR=str(tdir))
    out = subprocess.run([sys.executable, "-m", "rtckern.cli", "tune", "axpy", "--dtype", "bf16", "--shapes",
                          "1048576,16777216", "--json", "--import", "registry_testkit_plugin"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    print(json.dumps(report["shapes"], indent=1))
    table = json.loads((tdir / "axpy.json").read_text())
    rows = {(r["arch"], r["shape"]["n"]): r for r in table["rows"]}
    assert set(rows) == {("sm_80", 1048576), (live.arch.base().sm, 1048576), (live.arch.base().sm, 16777216)}
    assert rows[("sm_80", 1048576)]["config"] == {"block": 64}
    new = rows[(live.arch.base().sm, 16777216)]
    assert new["sm_count"] == live.sm_count and new["date"] and new["versions"]["driver"]
    assert new["versions"]["device"] == live.name and new["time_us"] > 0
    trials = [t for s in report["shapes"] for t in s["trials"]]
    assert all(t["us"] and t["us"] > 0 for t in trials) and len(trials) == 10
    code = ("import sys, json; sys.path.insert(0, %r); import registry_testkit as kit\n"
            "from rtckern.device import DeviceInfo\n"
            "d = DeviceInfo.from_device(0)\n"
            "out = {}\n"
            "for n in (16777216, 12000000):\n"
            "    req = kit.axpy_request(d, n=n, dtype='bf16'); t = kit.TUNER.best(req)\n"
            "    out[n] = [t.source, t.config['block'], kit.Fallback().launch_resources(req)[0].block]\n"
            "print(json.dumps(out))\n") % str(UNIT)
    nxt = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert nxt.returncode == 0, nxt.stderr
    got = json.loads(nxt.stdout.strip().splitlines()[-1])
    win = new["config"]["block"]
    assert got["16777216"] == ["exact", win, win]
    assert got["12000000"] == ["nearest", win, win]  # 12M is nearer 16M than 1M on the log scale


def test_selftest_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rtckern.cli", "selftest", "axpy", "--json", "--import",
                          "registry_testkit_plugin"], env=env_for(tmp_path), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    status = {r["name"]: r["status"] for r in data["results"]}
    assert data["failed"] == 0
    assert status["axpy.fallback"] == "pass" and status["axpy.broken"] == "not served"
    assert sum(1 for s in status.values() if s == "pass") >= 2
