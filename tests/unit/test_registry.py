"""Registry: requests, selection over hand-built devices, reasons, overrides, memoization, persisted decisions.

No GPU: every device here is described by hand, so probes compile (real NVRTC, through a fresh cache) but do not
load. The live-device resource check is tested on stand-in kernel objects with the attributes a loaded Kernel
has.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import registry_testkit as kit  # noqa: E402

from rtckern import config  # noqa: E402
from rtckern.device import DeviceInfo  # noqa: E402
from rtckern.errors import ConfigError, UnsupportedRequestError  # noqa: E402
from rtckern.registry import Candidate, Cost, OpRequest, Registry, Resources  # noqa: E402
from rtckern.registry import fallback  # noqa: E402
from rtckern.registry.probe import live_resource_reason, required_checks  # noqa: E402
from rtckern.registry.results import Reason  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def reg(cache_dir, tmp_path):
    return kit.make_registry(tmp_path / "decisions")


def dev(arch, **kw):
    return DeviceInfo.for_arch(arch, **kw)


# -- OpRequest ---------------------------------------------------------------------------------------------------
def test_request_is_frozen_hashable_and_order_insensitive():
    d = dev("sm_80")
    a = OpRequest("rms_norm", dtypes={"x": "bf16", "w": "fp32"}, shape={"n": 4096}, flags={"res": True}, device=d)
    b = OpRequest("rms_norm", dtypes=(("w", "fp32"), ("x", "bf16")), shape=(("n", 4096),),
                  flags=(("res", True),), device=d)
    assert a == b and hash(a) == hash(b) and a.digest() == b.digest()
    assert a.dtype("x") == "bf16" and a.dim("n") == 4096 and a.flag("res") is True and a.flag("zz", None) is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.op = "softmax"  # type: ignore[misc]
    assert len({a, b, dataclasses.replace(a, shape={"n": 8192})}) == 2


def test_request_digest_ignores_ordinal_but_identity_does_not():
    live_like = dataclasses.replace(dev("sm_90"), ordinal=0)
    a = kit.axpy_request(dev("sm_90"))
    b = kit.axpy_request(live_like)
    assert a != b  # separate in-memory decisions: kernels are loaded per device
    assert a.digest() == b.digest()  # one persisted key for the same device properties
    assert a.digest() != kit.axpy_request(dev("sm_90", sm_count=114)).digest()


@pytest.mark.parametrize("kwargs, match", [
    (dict(shape=(("n", 1), ("n", 2))), r"name 'n' given twice"),
    (dict(shape={"n": 4.0}), r"shape\['n'\] = 4.0 \(float\); allowed: int"),
    (dict(shape={"n": True}), r"is a bool; put booleans in flags"),
    (dict(dtypes={"x": 3}), r"dtypes\['x'\] = 3"),
    (dict(flags={"f": [1]}), r"flags\['f'\] = \[1\]"),
    (dict(device="sm_90"), r"must be a rtckern.device.DeviceInfo, got 'sm_90'"),
])
def test_request_validation_names_the_bad_value(kwargs, match):
    base = dict(op="axpy", device=dev("sm_80"))
    base.update(kwargs)
    with pytest.raises((TypeError, ValueError), match=match):
        OpRequest(**base)


# -- selection tables over hand-built devices ---------------------------------------------------------------------
SMALL = 1001  # below every persistent threshold, not a multiple of 4
TABLE = [
    # (arch, device overrides, dtype, n, chosen)
    ("sm_75", {}, "bf16", 1 << 20, "axpy.fallback"),             # every sm_80+ path out of range
    ("sm_80", {}, "bf16", 1 << 20, "axpy.persistent"),           # 1M >= 108 SMs x 1024
    ("sm_80", {}, "bf16", 1 << 16, "axpy.wide"),                 # 64K < 110592: not persistent
    ("sm_80", {"sm_count": 32}, "bf16", 1 << 16, "axpy.persistent"),  # a smaller part: 64K >= 32768
    ("sm_80", {}, "fp32", SMALL, "axpy.fallback"),               # 200 KB smem > 163 KB; unaligned
    ("sm_86", {}, "fp32", 1 << 16, "axpy.wide"),                 # 200 KB > 99 KB
    ("sm_86", {}, "bf16", SMALL, "axpy.fallback"),
    ("sm_90", {}, "bf16", SMALL, "axpy.hopper"),                 # sm_90a path
    ("sm_90", {}, "fp32", SMALL, "axpy.bigsmem"),                # 200 KB <= 227 KB
    ("sm_90", {"max_smem_per_block_optin": 101376}, "fp32", SMALL, "axpy.fallback"),
    ("sm_90", {"sm_count": 114}, "fp32", 1 << 17, "axpy.persistent"),  # 128K >= 114 x 1024
    ("sm_90", {}, "fp32", 1 << 17, "axpy.bigsmem"),                    # 128K < 132 x 1024
]


@pytest.mark.parametrize("arch, over, dtype, n, chosen", TABLE)
def test_selection_table(reg, arch, over, dtype, n, chosen):
    sel = reg.select(kit.axpy_request(dev(arch, **over), n=n, dtype=dtype))
    assert sel.name == chosen
    assert sel.kernels == ()  # described device: compile-only
    assert all(s.arch.cc == dev(arch).arch.cc for s in sel.specs)


def test_arch_specific_candidate_compiles_for_the_a_target(reg):
    sel = reg.select(kit.axpy_request(dev("sm_90"), n=SMALL, dtype="bf16"))
    assert sel.name == "axpy.hopper" and sel.specs[0].arch.sm == "sm_90a"


def test_two_devices_in_one_process_get_separate_decisions(reg):
    a = reg.select(kit.axpy_request(dev("sm_80"), n=SMALL, dtype="fp32"))
    b = reg.select(kit.axpy_request(dev("sm_90"), n=SMALL, dtype="fp32"))
    c = reg.select(kit.axpy_request(dev("sm_90", sm_count=100), n=1 << 17, dtype="fp32"))
    d = reg.select(kit.axpy_request(dev("sm_90"), n=1 << 17, dtype="fp32"))
    assert (a.name, b.name, c.name, d.name) == ("axpy.fallback", "axpy.bigsmem", "axpy.persistent", "axpy.bigsmem")
    assert reg.select(kit.axpy_request(dev("sm_80"), n=SMALL, dtype="fp32")) is a


# -- reasons ----------------------------------------------------------------------------------------------------
def test_every_reason_is_data_with_stage_and_message(reg):
    exp = reg.probe(kit.axpy_request(dev("sm_86"), n=SMALL, dtype="fp32"), stop_at_first=False)[0]
    by = {r.name: r for r in exp}
    # those that can serve first, in rank order (no costs here: priority), then the rejected, in priority order
    assert [r.name for r in exp] == ["axpy.broken", "axpy.bigsmem", "axpy.fallback", "axpy.hopper",
                                     "axpy.persistent", "axpy.wide"]
    assert [r.rank for r in exp] == [1, 2, 3, None, None, None]
    stages = {n: [x.stage for x in r.reasons] for n, r in by.items()}
    assert stages == {"axpy.hopper": ["arch"], "axpy.broken": ["compile"], "axpy.persistent": ["supports"],
                      "axpy.bigsmem": ["resources"], "axpy.wide": ["supports"], "axpy.fallback": []}
    assert by["axpy.hopper"].reasons[0].message.startswith("sm_86 is below the minimum sm_90")
    assert 'identifier "undeclared_symbol" is undefined' in by["axpy.broken"].reasons[0].message
    assert by["axpy.persistent"].reasons[0].message == "n=1001 < 86016 (1024 per SM x 84 SMs)"
    assert by["axpy.bigsmem"].reasons[0].message == (
        "kernel 0: 204800 B dynamic shared memory > 101376 B, the per-block limit of sm_86")
    assert by["axpy.fallback"].accepted and by["axpy.fallback"].cache_keys


def test_unsupported_error_lists_every_candidate_and_its_reasons(cache_dir, tmp_path):
    reg = kit.make_registry(tmp_path / "d", classes=(kit.Hopper, kit.Broken, kit.Wide))
    req = kit.axpy_request(dev("sm_75"), n=SMALL, dtype="bf16")
    with pytest.raises(UnsupportedRequestError, match=r"no implementation serves axpy\(") as ei:
        reg.select(req)
    err = ei.value
    assert set(err.reasons) == {"axpy.hopper", "axpy.broken", "axpy.wide"}
    assert err.reasons["axpy.hopper"][0].startswith("arch: sm_75 is below the minimum sm_90")
    assert err.reasons["axpy.broken"][0].startswith("compile: ")
    assert err.reasons["axpy.wide"][0].startswith("arch: sm_75 is below the minimum sm_80")
    for name in err.reasons:
        assert f"  {name}: " in str(err)
    assert [r.name for r in err.results] == ["axpy.broken", "axpy.hopper", "axpy.wide"]  # ranked, then rejected
    # the failure is memoized too: raising again probes nothing
    n = reg.probe_count
    with pytest.raises(UnsupportedRequestError):
        reg.select(req)
    assert reg.probe_count == n


def test_no_candidates_error_says_how_to_register(cache_dir, tmp_path):
    with pytest.raises(UnsupportedRequestError, match=r"no candidates are registered[\s\S]*register a Candidate "
                                                      r"with op='nope'"):
        Registry(tmp_path).select(OpRequest("nope", device=dev("sm_80")))


# -- ranking by expected cost -------------------------------------------------------------------------------------
def _costed(cls, value, source="table", calls=None):
    """cls with cost() answering `value` (None: no estimate); `calls` collects the names cost() was asked for."""
    def cost(self, req):
        if calls is not None:
            calls.append(self.name)
        return None if value is None else Cost(value, source, f"{self.name} row")
    return type(cls.__name__ + "Costed", (cls,), {"cost": cost})


def _ranked_reg(tmp_path, *classes):
    return kit.make_registry(tmp_path / "decisions", classes=classes)


def test_cost_order_beats_priority(cache_dir, tmp_path):
    reg = _ranked_reg(tmp_path, _costed(kit.Wide, 2.0), _costed(kit.Fallback, 1.0), kit.Persistent)
    req = kit.axpy_request(dev("sm_80"), n=1 << 20, dtype="bf16")
    ranked, rejected = reg.rank(req)
    # costed first, cheapest first (fallback, priority 0, before wide, 100); no estimate last (persistent, 130)
    assert [(c.name, cost and cost.value) for c, cost in ranked] == [
        ("axpy.fallback", 1.0), ("axpy.wide", 2.0), ("axpy.persistent", None)]
    assert rejected == []
    sel = reg.select(req)
    assert sel.name == "axpy.fallback"
    assert [(r.name, r.rank, r.probed) for r in sel.results] == [
        ("axpy.fallback", 1, True), ("axpy.wide", 2, False), ("axpy.persistent", 3, False)]
    assert sel.results[0].cost == Cost(1.0, "table", "axpy.fallback row")


def test_equal_costs_fall_back_to_priority(cache_dir, tmp_path):
    reg = _ranked_reg(tmp_path, _costed(kit.Fallback, 1.0), _costed(kit.Wide, 1.0))
    req = kit.axpy_request(dev("sm_80"), n=4096, dtype="bf16")
    assert [c.name for c, _ in reg.rank(req)[0]] == ["axpy.wide", "axpy.fallback"]
    assert reg.select(req).name == "axpy.wide"


def test_a_candidate_that_cannot_serve_is_skipped_with_its_reason(cache_dir, tmp_path):
    calls: list = []
    reg = _ranked_reg(tmp_path, _costed(kit.Wide, 0.5, calls=calls), _costed(kit.Fallback, 3.0, calls=calls),
                      _costed(kit.Hopper, 0.1, calls=calls))
    req = kit.axpy_request(dev("sm_80"), n=1001, dtype="bf16")  # not aligned: wide cannot serve; sm_80: no hopper
    results, chosen, _ = reg.probe(req, stop_at_first=True)
    assert chosen.name == "axpy.fallback" and calls == ["axpy.fallback"]  # cost() only for those that can serve
    by = {r.name: r for r in results}
    assert (by["axpy.wide"].rank, by["axpy.wide"].cost) == (None, None)
    assert [str(x) for x in by["axpy.wide"].reasons] == ["supports: needs n % 4 == 0 (aligned), n=1001"]
    assert by["axpy.hopper"].reasons[0].stage == "arch"


def test_a_probe_failure_moves_to_the_next_by_cost(cache_dir, tmp_path):
    reg = _ranked_reg(tmp_path, _costed(kit.BigSmem, 0.1), _costed(kit.Wide, 2.0), _costed(kit.Fallback, 1.0))
    req = kit.axpy_request(dev("sm_86"), n=4096, dtype="fp32")  # bigsmem's 200 KB do not fit sm_86's 99 KB
    sel = reg.select(req)
    assert sel.name == "axpy.fallback"  # cost 1.0, before wide (2.0, higher priority)
    assert [(r.name, r.accepted, r.probed) for r in sel.results] == [
        ("axpy.bigsmem", False, True), ("axpy.fallback", True, True), ("axpy.wide", False, False)]
    assert sel.results[0].reasons[0].stage == "resources"
    # the decision persists, the failure included: another registry on the same store probes nothing
    again = _ranked_reg(tmp_path, _costed(kit.BigSmem, 0.1), _costed(kit.Wide, 2.0), _costed(kit.Fallback, 1.0))
    sel2 = again.select(req)
    assert sel2.name == "axpy.fallback" and again.probe_count == 0
    assert [r.from_store for r in sel2.results[:2]] == [True, True]


def test_explain_shows_each_cost_its_source_and_why_the_winner_won(cache_dir, tmp_path):
    from rtckern.registry import explain

    reg = _ranked_reg(tmp_path, _costed(kit.BigSmem, 0.1), _costed(kit.Wide, 2.0, "rule"),
                      _costed(kit.Fallback, 1.0), kit.Hopper)
    exp = explain("axpy", dtype="fp32", shape="4096", arch="sm_86", registry=reg)
    text = exp.format()
    assert "rejected axpy.bigsmem (priority 120) rank 1, expected cost 0.1 (table: axpy.bigsmem row)" in text
    assert "chosen   axpy.fallback (priority 0) rank 2, expected cost 1 (table: axpy.fallback row)" in text
    assert "accepted axpy.wide (priority 100) rank 3, expected cost 2 (rule: axpy.wide row)" in text
    assert "rejected axpy.hopper (priority 200)\n" in text
    assert exp.why() == ("ranked 2 of 3 that can serve (expected cost 1 (table: axpy.fallback row)); better-ranked "
                         "axpy.bigsmem failed its probe (resources); next in line: axpy.wide (expected cost 2 "
                         "(rule: axpy.wide row), priority 100)")
    d = exp.to_dict()
    assert d["ranking"] == ["axpy.bigsmem", "axpy.fallback", "axpy.wide"] and d["why"] == exp.why()
    assert d["candidates"][1]["cost"] == {"value": 1.0, "source": "table", "detail": "axpy.fallback row"}


def test_cost_must_be_a_cost(cache_dir, tmp_path):
    bad = type("BadCost", (kit.Fallback,), {"cost": lambda self, req: 1.0})
    reg = _ranked_reg(tmp_path, bad)
    with pytest.raises(TypeError, match=r"candidate 'axpy.fallback': cost\(\) returned 1.0; expected a Cost"):
        reg.select(kit.axpy_request(dev("sm_80"), n=64))
    with pytest.raises(ValueError, match="Cost.source must be 'table' or 'rule'"):
        Cost(1.0, "guess")
    with pytest.raises(ValueError, match="Cost.value must be a number"):
        Cost(float("nan"))


# -- memoization ------------------------------------------------------------------------------------------------
def test_select_is_memoized(reg):
    req = kit.axpy_request(dev("sm_80"), n=SMALL, dtype="bf16")
    first = reg.select(req)
    n = reg.probe_count
    assert n >= 2  # broken and fallback got past the cheap checks
    assert reg.select(req) is first
    assert reg.select(kit.axpy_request(dev("sm_80"), n=SMALL, dtype="bf16")) is first  # equal request
    assert reg.probe_count == n


def test_concurrent_first_calls_probe_once(cache_dir, tmp_path):
    ref = kit.make_registry(None)
    req = kit.axpy_request(dev("sm_86"), n=SMALL, dtype="fp32")
    ref.select(req)
    reg = kit.make_registry(None)
    barrier = threading.Barrier(8)
    out, errors = [], []

    def worker():
        try:
            barrier.wait()
            out.append(reg.select(req))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len({id(s) for s in out}) == 1 and len(out) == 8
    assert reg.probe_count == ref.probe_count
    assert not reg._key_locks  # the per-request lock goes once the decision is memoized (a server sees many shapes)


# -- overrides ----------------------------------------------------------------------------------------------------
def test_force_impl_picks_the_named_candidate(reg):
    req = kit.axpy_request(dev("sm_90"), n=SMALL, dtype="fp32")
    assert reg.select(req).name == "axpy.bigsmem"
    with config.override(force_impl={"axpy": "axpy.fallback"}):
        sel = reg.select(req)
        assert sel.name == "axpy.fallback"
        skipped = {r.name: r.reasons for r in sel.results if r.name != "axpy.fallback"}
        assert all(rs[0] == Reason("override", "not tried: RTCKERN_FORCE_IMPL forces 'axpy.fallback' for op "
                                               "'axpy'") for rs in skipped.values())
    assert reg.select(req).name == "axpy.bigsmem"  # the override's decisions do not outlive it


def test_forced_candidate_that_cannot_serve_raises_with_its_reasons(reg):
    req = kit.axpy_request(dev("sm_80"), n=SMALL, dtype="bf16")
    with config.override(force_impl={"axpy": "axpy.hopper"}):
        with pytest.raises(UnsupportedRequestError, match=r"axpy.hopper: arch: sm_80 is below the minimum sm_90"
                                                          r"[\s\S]*RTCKERN_FORCE_IMPL forces 'axpy.hopper'") as ei:
            reg.select(req)
    assert ei.value.reasons["axpy.fallback"][0].startswith("override: not tried")


def test_force_unknown_name_lists_the_candidates(reg):
    with config.override(force_impl={"axpy": "axpy.nonesuch"}):
        with pytest.raises(ConfigError, match=r"^RTCKERN_FORCE_IMPL forces 'axpy.nonesuch' for op 'axpy', which is not "
                                              r"one of its candidates: axpy.hopper, .*axpy.fallback\. Fix or unset "
                                              r"RTCKERN_FORCE_IMPL$"):
            reg.select(kit.axpy_request(dev("sm_80")))
    assert reg.probe_count == 0


@pytest.mark.parametrize("field, value, setting", [
    ("force_impl", {"axpy": "axpy.fallback", "axyp": "axyp.fast"}, "RTCKERN_FORCE_IMPL"),
    ("disabled_ops", frozenset({"gemm_nope"}), "RTCKERN_DISABLE_OPS"),
])
def test_unknown_op_in_an_override_is_a_config_error_naming_the_known_ops(reg, field, value, setting):
    """Even when the op selected is a known one: a typo in the setting is never silently ignored."""
    bad = sorted(set(value) - {"axpy"})[0]
    with config.override(**{field: value}):
        with pytest.raises(ConfigError, match=rf"^{setting} names op '{bad}', which no registered candidate serves; "
                                              r"known ops: axpy(?: \(or all\))?\. Fix or unset " + setting):
            reg.select(kit.axpy_request(dev("sm_80")))
        with pytest.raises(ConfigError, match=setting):
            reg.check_overrides()
    assert reg.probe_count == 0


def test_disable_ops_all_and_known_overrides_pass_the_check(reg):
    with config.override(force_impl={"axpy": "axpy.fallback"}, disabled_ops=frozenset({"all"})):
        reg.check_overrides()


@pytest.mark.parametrize("disabled", [frozenset({"axpy"}), frozenset({"all"})])
def test_disable_ops_rejects_every_candidate(reg, disabled):
    with config.override(disabled_ops=disabled):
        with pytest.raises(UnsupportedRequestError, match=r"rtckern kernels disabled for op 'axpy' by "
                                                          r"RTCKERN_DISABLE_OPS=") as ei:
            reg.select(kit.axpy_request(dev("sm_80")))
    assert len(ei.value.reasons) == len(kit.ALL)
    assert reg.probe_count == 0


def test_strict_setting_turns_the_torch_fallback_into_an_error(monkeypatch):
    monkeypatch.setattr(fallback, "_warned", set())
    err = UnsupportedRequestError("axpy(...)", {"axpy.wide": ["supports: no"]})
    with config.override(strict=True):
        assert not fallback.fallback_allowed()
        with pytest.raises(UnsupportedRequestError, match="axpy.wide: supports: no"):
            fallback.warn_fallback_once("axpy", err)
    with config.override(strict=False):
        assert fallback.fallback_allowed()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            fallback.warn_fallback_once("axpy", err)
            fallback.warn_fallback_once("axpy", err)
        assert len(w) == 1 and "using torch's own op instead" in str(w[0].message)


# -- persisted decisions ------------------------------------------------------------------------------------------
_CHILD = r"""
import json, sys
sys.path.insert(0, {unit!r})
import registry_testkit as kit
from rtckern.device import DeviceInfo
from rtckern.arch import Arch
from rtckern.compiler import compiler_for
nvrtc = compiler_for(Arch.parse("sm_80"))  # count every compile attempt, failed ones included
calls, real = [], nvrtc.compile
nvrtc.compile = lambda spec: (calls.append(spec.name), real(spec))[1]
reg = kit.make_registry({store!r})
req = kit.axpy_request(DeviceInfo.for_arch("sm_80"), n=1001, dtype="bf16")
sel = reg.select(req)
res = reg.probe(req, stop_at_first=False)[0]
print(json.dumps({{"chosen": sel.name, "compiled": sorted(calls),
                  "from_store": {{r.name: r.from_store for r in res}},
                  "reasons": {{r.name: [str(x) for x in r.reasons] for r in res}}}}))
"""


def _run_child(store: Path, cache: Path) -> dict:
    env = dict(os.environ, RTCKERN_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    code = _CHILD.format(unit=str(Path(__file__).resolve().parent), store=str(store))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_reads_decisions_without_probing(cache_dir, tmp_path):
    store = tmp_path / "decisions"
    reg = kit.make_registry(store)
    req = kit.axpy_request(dev("sm_80"), n=SMALL, dtype="bf16")
    reg.probe(req, stop_at_first=False)  # every candidate, stored
    files = list(store.rglob("*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved["mode"] == "compile-only" and "ordinal" not in saved["request"]["device"]
    assert set(saved["candidates"]) == {"axpy.broken", "axpy.fallback"}  # costly stages only
    # A child process with an empty kernel cache: nothing compiled, the compile failure not retried.
    child = _run_child(store, tmp_path / "child-cache")
    assert child["chosen"] == "axpy.fallback"
    assert child["compiled"] == []
    assert child["from_store"]["axpy.broken"] and child["from_store"]["axpy.fallback"]
    assert child["reasons"]["axpy.broken"][0].startswith("compile: ")
    assert not child["from_store"]["axpy.wide"]  # cheap checks always run in-process


def test_first_process_compiles_when_nothing_is_stored(cache_dir, tmp_path):
    child = _run_child(tmp_path / "empty-store", tmp_path / "child-cache")
    assert child["chosen"] == "axpy.fallback"
    assert child["compiled"] == ["axpy", "broken_axpy"]  # each tried once (probe_all reused the select's)
    # the child's own select() stored them; its explain-style probe_all then read them back
    assert child["from_store"]["axpy.broken"] and child["from_store"]["axpy.fallback"]


def test_stored_outcome_is_not_reused_when_the_kernels_change(cache_dir, tmp_path):
    store = tmp_path / "decisions"
    req = kit.axpy_request(dev("sm_80"), n=SMALL, dtype="bf16")
    kit.make_registry(store).probe(req, stop_at_first=False)

    class Edited(kit.Fallback):  # same name, different kernel (another define): a new cache key
        def kernel_specs(self, req):
            (s,) = super().kernel_specs(req)
            return (dataclasses.replace(s, defines=s.defines + (("RTK_EDITED", "1"),)),)

    reg = Registry(store)
    reg.register(Edited())
    (res,), _, _ = reg.probe(req, stop_at_first=False)
    assert res.accepted and not res.from_store
    reg2 = Registry(store)
    reg2.register(Edited())
    assert reg2.probe(req, stop_at_first=False)[0][0].from_store


def test_corrupt_decision_file_is_a_miss(cache_dir, tmp_path, caplog):
    store = tmp_path / "decisions"
    req = kit.axpy_request(dev("sm_80"), n=SMALL, dtype="bf16")
    kit.make_registry(store).probe(req, stop_at_first=False)
    (path,) = store.rglob("*.json")
    path.write_text(path.read_text()[:40])
    res = kit.make_registry(store).probe(req, stop_at_first=False)[0]
    assert not any(r.from_store for r in res)
    assert "ignoring unreadable probe decision file" in caplog.text
    json.loads(path.read_text())  # rewritten whole


def test_persistence_follows_the_settings(cache_dir):
    from rtckern.registry import clear_decisions, decisions_dir

    req = kit.axpy_request(dev("sm_80"), n=SMALL, dtype="bf16")
    with config.override(persist_decisions=False):
        kit.make_registry(...).select(req)
    assert not (cache_dir / "decisions").exists()
    kit.make_registry(...).select(req)
    assert decisions_dir() == cache_dir / "decisions"
    assert len(list((cache_dir / "decisions" / "axpy").glob("*.json"))) == 1
    assert clear_decisions() == 1 and not list((cache_dir / "decisions").rglob("*.json"))
    assert not any(r.from_store for r in kit.make_registry(...).select(req).results)


# -- probe stages that need a live device, on stand-in kernels ----------------------------------------------------
class StubKernel:
    def __init__(self, regs=32, static=0, max_threads=1024, occupancy=4):
        self.num_regs, self.shared_size_bytes, self.max_threads_per_block = regs, static, max_threads
        self._occ = occupancy

    def max_active_blocks_per_sm(self, block, smem):
        return self._occ


@pytest.mark.parametrize("kernel, res, match", [
    (StubKernel(), Resources(256), None),
    (StubKernel(max_threads=512), Resources(1024), r"block of 1024 threads > 512, the kernel's limit"),
    (StubKernel(regs=255, max_threads=1024), Resources(512),
     r"255 registers x 512 threads = 130560 > 65536 per SM"),
    (StubKernel(static=48 * 1024), Resources(128, dynamic_smem=200 * 1024),
     r"49152 B static \+ 204800 B dynamic shared memory = 253952 B > 232448 B per block"),
    (StubKernel(occupancy=0), Resources(128), r"occupancy 0 blocks/SM at 128 threads"),
    (StubKernel(occupancy=2), Resources(128, cooperative_grid=265),
     r"cooperative grid of 265 blocks > 2 blocks/SM x 132 SMs = 264 co-resident"),
    (StubKernel(occupancy=2), Resources(128, cooperative_grid=264), None),
])
def test_live_resource_check(kernel, res, match):
    req = kit.axpy_request(dataclasses.replace(dev("sm_90"), ordinal=0))
    why = live_resource_reason(kernel, res, req)
    if match is None:
        assert why is None
    else:
        assert why is not None and __import__("re").search(match, why), why


def test_numeric_probe_runs_only_on_a_live_device():
    assert "numeric" not in required_checks("compile-only", True)
    assert required_checks("live", True)[-1] == "numeric"
    assert "numeric" not in required_checks("live", False)


# -- declarations ------------------------------------------------------------------------------------------------
def test_bad_declarations_are_refused_at_register(tmp_path):
    reg = Registry(tmp_path)

    class NoName(Candidate):
        op = "x"

        def kernel_specs(self, req):
            return ()

    class BadArch(kit.Fallback):
        name, min_arch = "axpy.badarch", "sm_9x"

    class NoSpecs(Candidate):
        name, op = "x.nospecs", "x"

    with pytest.raises(ValueError, match="has no name"):
        reg.register(NoName())
    with pytest.raises(ValueError, match=r"min_arch='sm_9x' does not parse"):
        reg.register(BadArch())
    with pytest.raises(ValueError, match=r"does not implement kernel_specs"):
        reg.register(NoSpecs())
    reg.register(kit.Fallback())
    with pytest.raises(ValueError, match=r"'axpy.fallback' is already registered"):
        reg.register(kit.Fallback())
    reg.register(kit.Fallback(), replace=True)
    assert [c.name for c in reg.candidates("axpy")] == ["axpy.fallback"]
