"""The norm tuner behind `rtckern tune rms_norm|layer_norm|rms_norm_backward|layer_norm_backward` (CPU: timings
injected, no GPU)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rtckern.ops  # noqa: F401  (registers the norm ops, their request builders and tuners)
from rtckern import config, tuning
from rtckern.cli import build_parser
from rtckern.device import DeviceInfo
from rtckern.ops._norms import configs, geometry, tune

REPO = Path(__file__).resolve().parents[3]
OPS = ("rms_norm", "layer_norm", "rms_norm_backward", "layer_norm_backward")
H100 = DeviceInfo.for_arch("sm_90", sm_count=132)
LIVE = dataclasses.replace(H100, ordinal=0, name="NVIDIA H100 80GB HBM3")
OP_OF = {("fwd", "rms"): "rms_norm", ("fwd", "layer"): "layer_norm", ("bwd", "rms"): "rms_norm_backward",
         ("bwd", "layer"): "layer_norm_backward"}


def _req(op: str, n: int, dtype: str = "bf16", device=H100, **opts):
    from rtckern.registry import build_request

    return build_request(op, shape=(n,), dtype=dtype, device=device, options=opts)


def _shipped(table: str) -> list[dict]:
    return json.loads((tuning.SHIPPED_DIR / f"{table}.json").read_text())["rows"]


def test_a_tuner_is_registered_under_every_norm_op():
    for op in OPS:
        t = tuning.get_tuner(op)
        assert t.op == op
        want = ["norm_fwd" if "backward" not in op else "norm_bwd", "norm_kind"]
        assert t.table_names() == want


def test_the_candidate_space_holds_every_shipped_config_and_kind():
    """Every shipped row's config is one the tuner sweeps for its shape (the swept space alone, without the
    tables' current config that configs() adds), and every shipped kind choice is a kind it times."""
    kinds_timed: dict = {}
    for table, d in (("norm_fwd", "fwd"), ("norm_bwd", "bwd")):
        for r in _shipped(table):
            sh = r["shape"]
            assert (r["arch"], r["sm_count"]) == ("sm_90", 132)
            p = tune.table_problem(d, sh["norm"], sh["dtype"], sh["n"], sh["vec"])
            want = {"kind": sh["kind"], **r["config"]}
            assert want in [tune.config_dict(k, c) for k, c in tune._swept(d, p, H100, True)], (table, sh, r["config"])
            op = OP_OF[(d, sh["norm"])]
            timed = tuning.get_tuner(op).configs(_req(op, sh["n"], sh["dtype"], vec=str(sh["vec"])))
            assert want in timed
            kinds_timed[(d, sh["norm"], sh["dtype"], sh["n"])] = {c["kind"] for c in timed}
    for r in _shipped("norm_kind"):
        sh = r["shape"]
        assert r["config"]["kind"] in kinds_timed[(sh["dir"], sh["norm"], sh["dtype"], sh["n"])], sh


def test_retired_l2c_opt_bits_are_neither_swept_nor_accepted():
    p = tune.table_problem("bwd", "rms", "bf16", 65536)
    assert not [c for k, c in tune.sweep_configs("bwd", p, H100) if k == "l2c" and c.opt & (16 | 128)]
    for opt in (16, 128, 192):
        assert "were removed" in geometry.bwd_feasible(p, "l2c", geometry.SplitConfig(512, 16, opt))
    for t in ("norm_fwd", "norm_bwd"):
        assert not [r for r in _shipped(t) if r["shape"]["kind"] == "l2c" and r["config"]["opt"] & (16 | 128)]


def test_shipped_rows_name_the_command_that_regenerates_them():
    for table in ("norm_fwd", "norm_bwd", "norm_kind"):
        for r in _shipped(table):
            sh = r["shape"]
            d = sh["dir"] if table == "norm_kind" else table[-3:]
            assert r["source"].startswith(f"rtckern tune {OP_OF[(d, sh['norm'])]} --dtype {sh['dtype']} "
                                          f"--shapes {sh['n']}"), (table, r["source"])


def test_tune_without_a_gpu_says_so_in_one_line():
    from rtckern.device import device_count

    if device_count() > 0:
        pytest.skip("a GPU is visible here")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "rtckern.cli", "tune", "rms_norm", "--dtype", "bf16", "--shapes",
                          "4096"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("rtckern tune: needs a live GPU to measure on; --device 0 asked, but no GPU")


def test_validate_refuses_a_problem_the_tables_are_not_keyed_by():
    t = tuning.get_tuner("rms_norm")
    t.validate(_req("rms_norm", 4096))
    t.validate(_req("rms_norm", 4096, vec="4"))
    with pytest.raises(ValueError, match=r"rms_norm: the norm tables are keyed by .* residual=True \(tabled: "
                                         r"False\)"):
        t.validate(_req("rms_norm", 4096, residual="1"))


def fake_seconds(config) -> float:
    """Injected timings: coop fastest of all (it must not win a kind choice at N <= 65536), then l2 with 512
    threads, then the other kinds; within a kind, fewer threads are faster."""
    kind = config["kind"]
    base = {"coop": 1e-6, "l2": 5e-6, "rows": 7e-6, "cluster": 8e-6}[kind]
    if kind == "l2" and config["threads"] == 512 and config["minb"] == 1 and config["opt"] == 0:
        base = 2e-6
    return base + (config.get("threads") or config.get("tpr")) * 1e-9


@pytest.fixture
def tuned(tmp_path, monkeypatch):
    """rtckern tune on a stand-in live H100 with injected timings; tables under tmp_path/user."""
    from rtckern.commands import tune as tune_cmd

    t = tuning.get_tuner("rms_norm")
    monkeypatch.setattr(t, "measure", lambda req, cfg: fake_seconds(cfg))
    monkeypatch.setattr(t, "prepare", lambda req, cfgs: None)
    monkeypatch.setattr(tune_cmd, "live_device", lambda ordinal, command: LIVE)
    with config.override(tuning_table_dir=tmp_path / "user"):
        yield tmp_path


def _run(argv, capsys):
    args = build_parser().parse_args(argv)
    rc = args.func(args)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


def test_tune_writes_each_kinds_fastest_config_and_the_fastest_kind(tuned, capsys):
    _run(["tune", "rms_norm", "--dtype", "bf16", "--shapes", "8192x4096,65536"], capsys)
    fwd = json.loads((tuned / "user" / "norm_fwd.json").read_text())
    kind = json.loads((tuned / "user" / "norm_kind.json").read_text())
    assert fwd["key_fields"] == ["kind", "norm", "dtype", "n", "vec"]
    assert kind["key_fields"] == ["dir", "norm", "dtype", "n"]
    by_key = {(r["shape"]["kind"], r["shape"]["n"]): r for r in fwd["rows"]}
    l2 = by_key[("l2", 4096)]
    assert l2["config"] == {"threads": 512, "minb": 1, "opt": 0} and l2["time_us"] == 2.51
    assert l2["source"] == "rtckern tune rms_norm --dtype bf16 --shapes 8192x4096"
    assert l2["shape"] == {"kind": "l2", "norm": "rms", "dtype": "bf16", "n": 4096, "vec": 8}
    assert l2["versions"]["device"] == LIVE.name and l2["gbps"] > 0 and l2["date"].endswith("Z")
    assert by_key[("rows", 4096)]["config"]["tpr"] == min(
        c["tpr"] for c in tuning.get_tuner("rms_norm").configs(_req("rms_norm", 4096)) if c["kind"] == "rows")
    assert ("coop", 65536) in by_key  # timed and recorded, ...
    kinds = {r["shape"]["n"]: r for r in kind["rows"]}
    assert kinds[4096]["config"] == {"kind": "l2"} and kinds[65536]["config"] == {"kind": "l2"}  # ... never chosen
    assert kinds[65536]["source"] == "rtckern tune rms_norm --dtype bf16 --shapes 65536"

    # The next lookup serves the user's rows.
    p = tune.table_problem("fwd", "rms", "bf16", 4096)
    assert configs.preferred_kind("fwd", p, H100) == "l2"
    assert configs.fwd_config(p, "l2", H100) == configs.cfg_from_json("l2", {"threads": 512, "minb": 1, "opt": 0})


def test_tune_into_a_directory_replaces_rows_in_place(tuned, capsys, monkeypatch):
    # on the GPU class the shipped rows were tuned on (an H200): its rows are replaced; an H100 would add its own
    from rtckern.commands import tune as tune_cmd

    monkeypatch.setattr(tune_cmd, "live_device", lambda ordinal, command: dataclasses.replace(LIVE, name="NVIDIA H200"))
    into = tuned / "tables"
    into.mkdir()
    for name in ("norm_fwd", "norm_kind"):
        (into / f"{name}.json").write_text((tuning.SHIPPED_DIR / f"{name}.json").read_text())
    before = json.loads((into / "norm_kind.json").read_text())["rows"]
    out = _run(["tune", "rms_norm", "--dtype", "bf16", "--shapes", "4096", "--into", str(into), "--json"], capsys)
    report = json.loads(out)
    assert report["tables"]["norm_kind"]["path"] == str(into / "norm_kind.json")
    after = json.loads((into / "norm_kind.json").read_text())["rows"]
    assert len(after) == len(before)
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    assert len(changed) == 1 and after[changed[0]]["shape"] == {"dir": "fwd", "norm": "rms", "dtype": "bf16",
                                                                   "n": 4096}
    assert not (tuned / "user").exists()


def test_tune_on_another_class_adds_its_rows_and_keeps_the_h200s(tuned, capsys):
    into = tuned / "tables"
    into.mkdir()
    for name in ("norm_fwd", "norm_kind"):
        (into / f"{name}.json").write_text((tuning.SHIPPED_DIR / f"{name}.json").read_text())
    before = json.loads((into / "norm_kind.json").read_text())["rows"]
    _run(["tune", "rms_norm", "--dtype", "bf16", "--shapes", "4096", "--into", str(into)], capsys)
    after = json.loads((into / "norm_kind.json").read_text())["rows"]
    assert after[:len(before)] == before and len(after) == len(before) + 1
    assert after[-1]["device_class"] == "h100-sxm" and after[-1]["shape"]["n"] == 4096


def test_tune_refuses_out_for_a_tuner_with_several_tables(tuned, capsys):
    args = build_parser().parse_args(["tune", "rms_norm", "--shapes", "4096", "--out", str(tuned / "x.json")])
    assert args.func(args) == 2
    assert "writes 2 tables (norm_fwd, norm_kind); give a directory with --into" in capsys.readouterr().err
