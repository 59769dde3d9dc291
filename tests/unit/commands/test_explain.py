"""`rtckern explain` and `rtckern.registry.explain`: no GPU, hand-described devices, the test candidates."""
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
from rtckern.commands import explain as explain_cmd  # noqa: E402
from rtckern.device import DeviceInfo  # noqa: E402
from rtckern.manager import get_manager  # noqa: E402
from rtckern.registry import explain  # noqa: E402


@pytest.fixture
def reg(cache_dir, tmp_path):
    return kit.make_registry(tmp_path / "decisions")


def cli(reg, argv, capsys):
    args = build_parser().parse_args(["explain", *argv])
    rc = explain_cmd.run(args, registry=reg)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_lists_every_candidate_and_the_chosen_spec_and_key(reg, capsys):
    rc, out, _ = cli(reg, ["axpy", "--dtype", "fp32", "--shape", "1001", "--arch", "sm_86", "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["chosen"] == "axpy.fallback" and data["mode"] == "compile-only"
    cands = {c["name"]: c for c in data["candidates"]}
    # those that can serve, in rank order, then the rejected ones
    assert list(cands) == ["axpy.broken", "axpy.bigsmem", "axpy.fallback", "axpy.hopper", "axpy.persistent",
                           "axpy.wide"]
    assert [c["rank"] for c in data["candidates"]] == [1, 2, 3, None, None, None]
    assert {n: c["accepted"] for n, c in cands.items()} == {
        "axpy.hopper": False, "axpy.broken": False, "axpy.persistent": False, "axpy.bigsmem": False,
        "axpy.wide": False, "axpy.fallback": True}
    assert cands["axpy.bigsmem"]["reasons"] == [
        "resources: kernel 0: 204800 B dynamic shared memory > 101376 B, the per-block limit of sm_86"]
    assert cands["axpy.fallback"]["reasons"] == []
    (spec,) = data["chosen_specs"]
    assert (spec["source"], spec["name"], spec["template_args"], spec["arch"]) == (
        "core/axpy.cuh", "axpy", ["float"], "sm_86")
    sel = reg.select(kit.axpy_request(DeviceInfo.for_arch("sm_86"), n=1001, dtype="fp32"))
    assert data["cache_keys"] == [get_manager().key(sel.specs[0])]
    assert data["request"]["device"]["sm_count"] == 84 and data["request"]["shape"] == {"n": 1001}


def test_text_output_names_chosen_reasons_and_key(reg, capsys):
    rc, out, _ = cli(reg, ["axpy", "--dtype", "bf16", "--shape", "4x256", "--arch", "sm_90"], capsys)
    assert rc == 0
    assert "probe:   compile-only" in out
    assert "chosen   axpy.hopper (priority 200) rank 1, no cost estimate" in out
    assert "why:    ranked 1 of 4 that can serve (no cost estimate, priority 200); next in line: axpy.broken" in out
    assert "chosen: axpy.hopper" in out and "kernel: axpy<rtk_bf16> [core/axpy.cuh] for sm_90a" in out
    assert "- compile: broken_axpy.cu(2): error: identifier \"undeclared_symbol\" is undefined" in out
    assert "cache key: " in out


def test_sm_count_and_smem_describe_the_device(reg, capsys):
    base = ["axpy", "--dtype", "fp32", "--shape", "131072", "--arch", "sm_90", "--json"]
    assert json.loads(cli(reg, base, capsys)[1])["chosen"] == "axpy.bigsmem"
    assert json.loads(cli(reg, base + ["--sm-count", "114"], capsys)[1])["chosen"] == "axpy.persistent"
    small = json.loads(cli(reg, base + ["--smem", "101376"], capsys)[1])
    assert small["chosen"] == "axpy.wide"
    assert small["request"]["device"]["max_smem_per_block_optin"] == 101376


def test_first_stops_at_the_chosen(reg, capsys):
    data = json.loads(cli(reg, ["axpy", "--dtype", "bf16", "--shape", "1001", "--arch", "sm_90", "--json",
                                "--first"], capsys)[1])
    probed = {c["name"]: c["probed"] for c in data["candidates"]}
    assert probed["axpy.hopper"] and not probed["axpy.fallback"]


def test_nothing_serves_exits_1(cache_dir, tmp_path, capsys):
    reg = kit.make_registry(tmp_path / "d", classes=(kit.Hopper, kit.Wide))
    rc, out, _ = cli(reg, ["axpy", "--shape", "1024", "--arch", "sm_75"], capsys)
    assert rc == 1 and "chosen: none (the op would raise UnsupportedRequestError)" in out


@pytest.mark.parametrize("argv, match", [
    (["axpy", "--arch", "sm_90"], "--shape is required"),
    (["--arch", "sm_90"], "name an op"),
    (["nope", "--shape", "8", "--arch", "sm_90"], "op 'nope' has no request builder; ops with one: ['axpy']"),
    (["axpy", "--shape", "8", "--arch", "sm_90", "--opt", "causal=1"],
     "op 'axpy' takes no option(s) ['causal']; its options: ['aligned']"),
    (["axpy", "--shape", "8x0", "--arch", "sm_90"], "every dimension must be positive"),
    (["axpy", "--shape", "8", "--arch", "sm_90", "--device", "0"], "give --device (a live GPU) or --arch"),
])
def test_bad_arguments_say_what_to_do(reg, capsys, argv, match):
    rc, _, err = cli(reg, argv, capsys)
    assert rc == 2 and match in err


def test_list_shows_ops_candidates_and_example(reg, capsys):
    rc, out, _ = cli(reg, ["--list"], capsys)
    assert rc == 0 and out.startswith("axpy: axpy.hopper, axpy.broken")
    assert "example: rtckern explain axpy --dtype bf16 --shape 1048576 --arch sm_90" in out


def test_list_examples_run_without_a_gpu(reg, capsys):
    import shlex

    _, out, _ = cli(reg, ["--list"], capsys)
    example = next(line for line in out.splitlines() if "example: " in line).split("example: ", 1)[1]
    rc, out, err = cli(reg, shlex.split(example)[2:], capsys)
    assert rc == 0 and "chosen: axpy." in out, out + err


def test_python_api(reg):
    exp = explain("axpy", dtype="bf16", shape="1001", arch="sm_80", sm_count=32, registry=reg)
    assert exp.chosen == "axpy.fallback" and exp.request.device.sm_count == 32
    assert exp.to_dict()["candidates"][0]["name"] == "axpy.broken"  # first in rank order (no costs: priority)
    req = kit.axpy_request(exp.request.device, n=1 << 16, dtype="bf16")
    assert explain(req, registry=reg).chosen == "axpy.persistent"
    with pytest.raises(ValueError, match=r"needs a device: arch='sm_90'"):
        explain("axpy", shape="8", registry=reg)


def test_real_command_line_with_an_imported_op(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(UNIT)]), RTCKERN_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "rtckern.cli", "explain", "axpy", "--dtype", "bf16", "--shape",
                          "8192x4096", "--arch", "sm_90", "--sm-count", "132", "--json",
                          "--import", "registry_testkit_plugin"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["chosen"] == "axpy.hopper"
    assert all({"name", "accepted", "reasons"} <= set(c) for c in data["candidates"])
    assert data["request"]["shape"] == {"n": 8192 * 4096}


@pytest.mark.parametrize("argv", [["tune", "axpy", "--shapes", "1024"], ["selftest", "axpy"]])
def test_tune_and_selftest_need_a_live_gpu(reg, capsys, argv):
    from rtckern.device import device_count

    if device_count() > 0:
        pytest.skip("a GPU is visible here")
    kit.register_tuner()
    args = build_parser().parse_args(argv)
    assert args.func(args, registry=reg) == 2
    assert "needs a live GPU to measure on; --device 0 asked, but no GPU is visible" in capsys.readouterr().err


def test_list_as_json_and_attention_shapes_of_another_rank(capsys):
    """`explain --list --json` is JSON (it printed the text list); an attention shape that is neither the head dim
    nor q's full shape is refused by name (its last entry was read as the head dim)."""
    import rtckern.ops  # noqa: F401 - the families' request builders

    args = build_parser().parse_args(["explain", "--list", "--json"])
    assert explain_cmd.run(args) == 0
    ops = {o["op"]: o for o in json.loads(capsys.readouterr().out)["ops"]}
    assert "rms_norm.l2" in ops["rms_norm"]["candidates"] and ops["rms_norm"]["example"].startswith("rtckern explain")
    for op, shape, full in (("attention", "4x4096x16", "BxSxHxD"), ("attention_varlen", "2x16384x16x128", "TxHxD")):
        args = build_parser().parse_args(["explain", op, "--shape", shape, "--arch", "sm_80"])
        assert explain_cmd.run(args) == 2
        assert capsys.readouterr().err.strip() == (f"rtckern explain: {op}: shape {shape} has {len(shape.split('x'))} "
                                                   f"dims; give the head dim (e.g. 128) or q's shape {full}")
