"""`rtckern ops`: the catalogue follows the registered candidates (dtypes, limits, arch ranges), for the shipped
families (a real process, --json) and for the registry's test candidates (in process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[1]
REPO = UNIT.parents[1]
sys.path.insert(0, str(UNIT))
import registry_testkit as kit  # noqa: E402

from rtckern.cli import build_parser  # noqa: E402
from rtckern.commands import ops as ops_cmd  # noqa: E402
from rtckern.registry import LimitProbe  # noqa: E402


@pytest.fixture(scope="module")
def shipped():
    r = subprocess.run([sys.executable, "-m", "rtckern", "ops", "--json"], capture_output=True, text=True, timeout=300,
                       cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_every_op_and_candidate_of_the_registry_is_listed(shipped):
    import rtckern.ops  # noqa: F401
    from rtckern.registry import candidates, default_registry

    reg = default_registry()
    ops = {o["op"]: o for o in shipped["ops"]}
    assert sorted(ops) == sorted(set(reg.ops()) | set(reg.builder_ops()))
    for op, o in ops.items():
        assert [c["name"] for c in o["candidates"]] == [c.name for c in candidates(op)]
        assert [(c["min_arch"], c["max_arch"], c["arch_specific"]) for c in o["candidates"]] == \
            [(c.min_arch, c.max_arch, c.arch_specific) for c in candidates(op)]
        assert o["dtypes"], f"{op}: no dtype found"


def test_shipped_dtypes_head_dims_and_row_lengths(shipped):
    ops = {o["op"]: o for o in shipped["ops"]}
    att = ops["attention"]
    assert att["dtypes"] == ["fp16", "bf16"] and att["limits"]["dim"] == "head_dim"
    assert att["limits"]["served"] == [32, 64, 96, 128, 256]
    by_name = {c["name"]: c for c in att["candidates"]}
    assert by_name["attention.sm90a_wgmma"]["limits"] == [64, 128, 256]
    assert ops["gemm_fp8"]["dtypes"] == ["fp8_e4m3", "fp8_e5m2"] and ops["gemm_fp8"]["archs"]["min"] == "sm_89"
    rms = ops["rms_norm"]
    assert rms["dtypes"] == ["fp32", "fp16", "bf16"] and rms["limits"]["dim"] == "N"
    rows = {c["name"]: c["limits"] for c in rms["candidates"]}
    assert max(rows["rms_norm.rows"]) < max(rms["limits"]["served"])  # a kind with a lower row limit


def _run(reg, capsys, *argv):
    args = build_parser().parse_args(["ops", *argv])
    rc = ops_cmd.run(args, registry=reg)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def reg(cache_dir, tmp_path):
    r = kit.make_registry(tmp_path / "decisions")
    r.register_request_builder(kit.OP, kit.build_axpy_request, replace=True, example="--dtype bf16 --shape 1048576",
                               limits=LimitProbe("n", (1001, 4096, 1 << 20)))
    return r


def test_catalogue_asks_the_candidates(reg, capsys):
    rc, out, _ = _run(reg, capsys, "--json")
    assert rc == 0
    (axpy,) = json.loads(out)["ops"]
    c = {x["name"]: x for x in axpy["candidates"]}
    assert c["axpy.hopper"]["dtypes"] == ["bf16"] and c["axpy.bigsmem"]["dtypes"] == ["fp32"]
    assert c["axpy.persistent"]["limits"] == [1 << 20]  # needs n >= sm_count * 1024
    assert c["axpy.wide"]["limits"] == [4096, 1 << 20]  # n % 4 == 0 (without the aligned option: n decides)
    assert axpy["limits"] == {"dim": "n", "dtype": "bf16", "tested": [1001, 4096, 1 << 20],
                              "served": [1001, 4096, 1 << 20]}
    rc, out, _ = _run(reg, capsys, "--arch", "sm_80", "--json")
    c = {x["name"]: x for x in json.loads(out)["ops"][0]["candidates"]}
    assert c["axpy.bigsmem"]["dtypes"] == []  # 200 KB of shared memory: not on sm_80
    assert c["axpy.hopper"]["probed_on"] == "sm_90"  # out of the device's range: asked on its own arch


def test_text_output_and_unknown_op(reg, capsys):
    rc, out, _ = _run(reg, capsys)
    assert rc == 0 and "; n 1001..1048576; sm_75+ (nvidia)" in out
    wide = next(line for line in out.splitlines() if "axpy.wide" in line)
    assert wide.split()[1:] == ["sm_80+", "nvidia", "100", "fp32", "fp16", "bf16", "4096,", "1048576"]
    rc, _, err = _run(reg, capsys, "axpz")
    assert rc == 2 and err.strip() == "rtckern ops: unknown op(s) axpz; the ops: axpy"
