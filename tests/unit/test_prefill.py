"""rtckern.prefill's default arch list (Turing to Blackwell, RTCKERN_ARCH_LIST replaces it) and what the built-in
set compiles for Blackwell: the portable kernels, really compiled by NVRTC (one small kernel per family and arch)."""

from __future__ import annotations

import pytest

from rtckern import config
from rtckern.arch import Arch
from rtckern.compiler import compiler_for
from rtckern.prefill import DEFAULT_ARCHS, builtin_specs, parse_archs

BLACKWELL = ("sm_100", "sm_120")
FAMILIES = ("rms_norm", "layer_norm", "softmax", "attention", "gemm")


def test_default_arch_list_covers_turing_to_blackwell():
    with config.override(arch_list=None):  # whatever RTCKERN_ARCH_LIST this environment has
        archs = parse_archs(None)
    assert [a.sm for a in archs] == ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120"]
    core = {s.arch.sm for s in builtin_specs(archs, families=["core"])}
    assert set(BLACKWELL) <= core


def test_arch_list_variable_replaces_the_default_and_an_explicit_list_wins():
    with config.override(arch_list="8.0;10.0+PTX"):
        assert [str(a) for a in parse_archs(None)] == ["8.0", "10.0+PTX"]
        assert [str(a) for a in parse_archs("9.0a")] == ["9.0a"]
    assert DEFAULT_ARCHS == "7.5;8.0;8.6;8.9;9.0a;10.0;12.0"


@pytest.fixture(scope="module")
def blackwell_plan():
    from rtckern.fleet import load_preset
    from rtckern.fleet.plan import plan
    from rtckern.prefill import load_builtin_providers

    load_builtin_providers()
    return plan(load_preset("common") + load_preset("llama-3.1-8b"), parse_archs("10.0;12.0"))


def test_blackwell_requests_take_portable_candidates_and_say_why_not_sm90a(blackwell_plan):
    """Every preset request is served on sm_100 and sm_120 by kernels compiled for that arch itself (no 'a' target:
    the sm_90a kernels run on sm_90 only), and the plan says why the sm_90a candidates were passed over."""
    assert blackwell_plan and all(p.chain for p in blackwell_plan), [p.error for p in blackwell_plan if not p.chain]
    for p in blackwell_plan:
        assert {s.arch.sm for s in p.chain[0].specs} == {p.device.arch.sm}, p.describe()
    gemm = next(p for p in blackwell_plan if p.entry.op == "gemm")
    assert any("gemm.sm90_wgmma" in r and "runs on sm_90 GPUs only: newer ones take a portable candidate" in r
               for r in gemm.rejected), gemm.rejected


def test_blackwell_targets_compile_for_each_family(blackwell_plan):
    """One kernel of each family's chosen candidate (the smallest, ~0.1-0.4 s of NVRTC each) for sm_100 and sm_120."""
    picked = {}
    for p in blackwell_plan:
        if p.entry.op in FAMILIES:
            key = (p.entry.op, p.device.arch.sm)
            picked.setdefault(key, min(p.chain[0].specs, key=lambda s: len(s.name_expression)))
    assert set(picked) == {(op, sm) for op in FAMILIES for sm in BLACKWELL}
    for (op, sm), spec in sorted(picked.items()):
        ck = compiler_for(spec.arch).compile(spec)
        assert ck.kind == "cubin" and len(ck.binary) > 1000 and spec.arch == Arch.parse(sm), (op, sm)


def test_a_worker_that_dies_fails_its_kernels_and_the_run_goes_on(tmp_path):
    """A compile worker killed mid-run (the OOM killer, a crashing compiler) breaks the process pool: the kernels
    it and the pool still held come back failed, saying so, every other result stands, and nothing raises."""
    import multiprocessing
    import os
    import signal

    from rtckern.prefill import prefill

    specs = builtin_specs([Arch.parse("8.0"), Arch.parse("9.0")], ["core", "rope"])
    killed = []
    others = {p.pid for p in multiprocessing.active_children()}  # (the test session's own compile pool)

    def progress(r):
        if not killed:
            victims = [p for p in multiprocessing.active_children() if p.pid not in others]
            if victims:
                os.kill(victims[0].pid, signal.SIGKILL)
                killed.append(victims[0].pid)

    results = prefill(specs, jobs=2, cache_dir=str(tmp_path / "c"), progress=progress)
    assert killed and [r.spec for r in results] == list(specs)
    died = [r for r in results if r.status == "failed"]
    assert died and all("the compile worker died" in r.error for r in died)
