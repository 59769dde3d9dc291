"""`rtckern prefill --manifest/--preset`: requests -> candidates -> kernels, rounds on compile failure, summary,
exit status, determinism for any --jobs."""

import json

import pytest
from fleetkit import LINES, cli, prefill_json, write_manifest

from rtckern.fleet import parse_lines, replay, summarize
from rtckern.prefill import parse_archs


def _entries(lines):
    return parse_lines([json.dumps(x) for x in lines])


def test_replay_picks_what_the_runtime_picks(registry, cache_dir):
    res = replay(_entries(LINES), parse_archs("8.0;9.0a"), registry=registry, cache_dir=str(cache_dir))
    served = {o.planned.describe(): o.served_by for o in res.requests}
    assert served == {
        "axpy(bf16, 1048576) on sm_80": "axpy.persistent", "axpy(bf16, 1048576) on sm_90": "axpy.hopper",
        "axpy(fp32, 1000) on sm_80": "axpy.wide", "axpy(fp32, 1000) on sm_90": "axpy.bigsmem",
        "axpy(fp16, 4098, aligned=0) on sm_80": "axpy.fallback", "axpy(fp16, 4098, aligned=0) on sm_90": "axpy.fallback",
        "axpy(fp16, 4096, aligned=1) on sm_80": "axpy.wide", "axpy(fp16, 4096, aligned=1) on sm_90": "axpy.wide"}
    # axpy.broken (priority 150) does not compile: tried once per arch, then each request moved down its chain.
    tried = [t for o in res.requests for t in o.tried]
    assert tried and all(t.startswith("axpy.broken: broken_axpy: ") and "undeclared_symbol" in t for t in tried)
    s = summarize(res)
    assert (s["requests"], s["served"], s["failed"], s["rejected"]) == (8, 8, 0, 2)
    # The runtime's own selection on a described sm_90 device agrees, kernel for kernel.
    from fleetkit import kit

    from rtckern.device import DeviceInfo

    sel = registry.select(kit.axpy_request(DeviceInfo.for_arch("sm_90"), n=1000, dtype="fp32"))
    out = next(o for o in res.requests if o.planned.describe() == "axpy(fp32, 1000) on sm_90")
    from rtckern.manager import get_manager

    assert sel.name == "axpy.bigsmem" and out.keys == tuple(get_manager().key(s) for s in sel.specs)


def test_every_candidate_mode_compiles_the_whole_chain(registry, cache_dir):
    first = replay(_entries(LINES[:1]), parse_archs("9.0a"), registry=registry, cache_dir=str(cache_dir))
    every = replay(_entries(LINES[:1]), parse_archs("9.0a"), registry=registry, cache_dir=str(cache_dir),
                   all_candidates=True)
    assert len(first.keys()) == 1  # hopper only
    # hopper, persistent, wide (n % 4 == 0) and fallback; bigsmem is fp32 only; broken fails
    assert len(every.keys()) == 4 and set(first.keys()) < set(every.keys())


def test_unknown_op_and_op_without_candidates_fail_with_reasons(registry, cache_dir):
    registry.register_request_builder("lonely", lambda shape, dtype, device: __import__(
        "rtckern.registry", fromlist=["OpRequest"]).OpRequest(op="lonely", device=device))
    lines = LINES[:1] + [{"op": "rms_norm", "dtype": "bf16", "shape": [8, 4096]},
                         {"op": "lonely", "dtype": "bf16", "shape": [8]},
                         {"op": "axpy", "dtype": "bf16", "shape": [8], "bogus": 1}]
    res = replay(_entries(lines), parse_archs("8.0"), registry=registry, cache_dir=str(cache_dir))
    s = summarize(res)
    assert (s["served"], s["failed"]) == (1, 3)
    errs = {f["request"]: f["error"] for f in s["failures"]}
    assert errs["rms_norm(bf16, 8x4096) on sm_80"].startswith(
        "op 'rms_norm' has no request builder: its op family is not installed or has not registered yet "
        "(ops with a builder: axpy, lonely)")
    assert errs["lonely(bf16, 8) on sm_80"].startswith("no candidate is registered for op 'lonely'")
    assert "takes no option(s) ['bogus']; its options: ['aligned']" in errs["axpy(bf16, 8, bogus=1) on sm_80"]


def test_forced_candidate_is_applied_as_at_runtime(registry, cache_dir):
    from rtckern import config

    with config.override(force_impl={"axpy": "axpy.fallback"}):
        res = replay(_entries(LINES[:2]), parse_archs("9.0a"), registry=registry, cache_dir=str(cache_dir))
    assert {o.served_by for o in res.requests} == {"axpy.fallback"}


def test_cli_summary_exit_status_and_json(tmp_path):
    m = write_manifest(tmp_path / "m.jsonl", LINES + [{"op": "nosuch", "dtype": "fp16", "shape": [4]}])
    out, r = prefill_json("--manifest", str(m), "--arch", "8.0;9.0a", "-j", "2", cache=tmp_path / "c", check=False)
    assert r.returncode == 1
    assert (out["requests"], out["served"], out["failed"], out["compiled"], out["cached"]) == (10, 8, 2, 8, 0)
    assert out["per_arch"]["sm_90"]["compiled"] == 4 and out["lines"] == 5 and out["source"] == str(m)
    assert all("op 'nosuch' has no request builder" in f["error"] for f in out["failures"])
    again, r = prefill_json("--manifest", str(m), "--arch", "9.0a 8.0", cache=tmp_path / "c", check=False)
    assert (again["compiled"], again["cached"]) == (0, 8)
    t = cli("prefill", "--import", "registry_testkit_plugin", "--manifest", str(m), "--arch", "8.0",
            "--no-progress", cache=tmp_path / "c", check=False)
    assert t.returncode == 1 and "already cached" in t.stdout and "rejected" in t.stdout
    assert "FAILED nosuch(fp16, 4) on sm_80: op 'nosuch' has no request builder" in t.stderr


def test_manifest_and_preset_are_exclusive_and_bad_manifest_is_clear(tmp_path):
    r = cli("prefill", "--manifest", "x.jsonl", "--preset", "common", check=False)
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"op": "axpy", "dtype": "bf16"}\n')
    r = cli("prefill", "--manifest", str(bad), cache=tmp_path / "c", check=False)
    assert r.returncode == 2 and f"{bad}:1: missing field(s) ['shape']" in r.stderr
    presets = json.loads(cli("prefill", "--list-presets", "--json").stdout)
    assert {"name": "common", "lines": 64} in presets


@pytest.mark.slow
def test_same_bundle_for_any_jobs_and_for_identical_inputs(tmp_path):
    m = write_manifest(tmp_path / "m.jsonl", LINES)
    sums = {}
    for name, jobs in (("a", "1"), ("b", "4"), ("c", "1")):
        out, _ = prefill_json("--manifest", str(m), "--arch", "8.0;9.0a", "-j", jobs, "--out", str(tmp_path / name),
                              "--bundle", str(tmp_path / f"{name}.bundle"))
        sums[name] = out["bundle"]["sha256"]
    blobs = {n: (tmp_path / f"{n}.bundle").read_bytes() for n in "abc"}
    assert blobs["a"] == blobs["b"] == blobs["c"] and len(set(sums.values())) == 1
    # and the bundle holds exactly the served kernels
    from rtckern.fleet import verify_bundle

    index, _ = verify_bundle(tmp_path / "a.bundle")
    assert len(index) == out["compiled"] + out["cached"] == 8


def test_on_round_announces_every_kernel_before_it_is_compiled(registry, cache_dir):
    rounds, done = [], []
    res = replay(_entries(LINES), parse_archs("8.0;9.0a"), registry=registry, cache_dir=str(cache_dir),
                 progress=done.append, on_round=rounds.append)
    assert len(rounds) >= 2 and sum(rounds) == len(done) == len(res.kernels)  # a fallback round after axpy.broken
