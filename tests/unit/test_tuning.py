"""Tuning tables: keys across archs, duplicate detection, the lookup rule, merging, tuning with a stand-in timer."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import marshal
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rtckern
from rtckern import config, tuning
from rtckern.device import DeviceInfo
from rtckern.registry import OpRequest
from rtckern.tuning import Row, Tuner, TuningTableError, load_table, lookup, merge_rows, parse_table, shadowed_rows

REPO = Path(__file__).resolve().parents[2]
H200 = DeviceInfo.for_arch("sm_90", sm_count=132)
A100 = DeviceInfo.for_arch("sm_80", sm_count=108)


def row(arch, sms, dtype, n, block, **meta):
    return {"arch": arch, "sm_count": sms, "shape": {"dtype": dtype, "n": n}, "config": {"block": block}, **meta}


def write(path: Path, rows, op="norm", fields=("dtype", "n")) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": 1, "op": op, "key_fields": list(fields), "rows": rows}))
    return path


@pytest.fixture
def tdir(tmp_path):
    with config.override(tuning_table_dir=tmp_path / "user"):
        yield tmp_path


def table(tmp_path, rows, name="t.json"):
    return load_table(write(tmp_path / name, rows), "norm")


# -- keys and duplicates -----------------------------------------------------------------------------------------
def test_rows_of_several_archs_and_sm_counts_do_not_collide(tmp_path):
    t = table(tmp_path, [row("sm_90", 132, "bf16", 4096, 256), row("sm_80", 108, "bf16", 4096, 128),
                         row("sm_90", 114, "bf16", 4096, 512)])
    assert lookup("norm", H200, {"dtype": "bf16", "n": 4096}, tables_=[t]).config == {"block": 256}
    assert lookup("norm", A100, {"dtype": "bf16", "n": 4096}, tables_=[t]).config == {"block": 128}
    h100 = DeviceInfo.for_arch("sm_90", sm_count=114)
    got = lookup("norm", h100, {"dtype": "bf16", "n": 4096}, tables_=[t])
    assert (got.config, got.source, got.row.index) == ({"block": 512}, "exact", 2)


def test_arch_key_drops_the_feature_suffix(tmp_path):
    t = table(tmp_path, [row("sm_90", 132, "bf16", 4096, 256)])
    dev_a = dataclasses.replace(H200, arch=H200.arch.with_specific())
    assert lookup("norm", dev_a, {"dtype": "bf16", "n": 4096}, tables_=[t]).source == "exact"


def test_duplicate_keys_name_the_file_and_both_rows(tmp_path):
    path = write(tmp_path / "dup.json", [row("sm_90", 132, "bf16", 4096, 256), row("sm_80", 108, "bf16", 4096, 1),
                                         row("sm_90", 132, "bf16", 4096, 512)])
    with pytest.raises(TuningTableError) as ei:
        load_table(path, "norm")
    msg = str(ei.value)
    assert msg.startswith(f"{path}: rows 0 and 2 have the same key (arch=sm_90, sm_count=132, dtype=bf16, n=4096)")
    assert '"block": 256' in msg and '"block": 512' in msg


@pytest.mark.parametrize("data, match", [
    ({"format": 3, "op": "norm", "key_fields": [], "rows": []}, r"not a tuning table of format 1 or 2 \(format 3\)"),
    ({"format": 1, "op": "other", "key_fields": ["n"], "rows": []}, r"table is for op 'other', expected 'norm'"),
    ({"format": 1, "op": "norm", "key_fields": ["n", "n"], "rows": []}, r"key_fields must be a list of distinct"),
    ({"format": 1, "op": "norm", "key_fields": ["n"], "rows": [{"arch": "sm_90", "sm_count": 132,
                                                                 "shape": {"m": 1}, "config": {}}]},
     r"row 0: shape \{'m': 1\} must have exactly the key fields \['n'\]"),
    ({"format": 1, "op": "norm", "key_fields": ["n"], "rows": [{"arch": "90", "sm_count": 132,
                                                                 "shape": {"n": 1}, "config": {}}]},
     r"row 0: arch '90' should be like 'sm_90'"),
    ({"format": 1, "op": "norm", "key_fields": ["n"], "rows": [{"arch": "sm_90", "shape": {"n": 1},
                                                                 "config": {}}]},
     r"row 0 lacks \['sm_count'\]"),
])
def test_bad_tables_are_errors_naming_the_file(tmp_path, data, match):
    with pytest.raises(TuningTableError, match=match):
        parse_table(data, tmp_path / "x.json", "norm")


def test_invalid_json_is_an_error(tmp_path):
    p = tmp_path / "norm.json"
    p.write_text("{not json")
    with pytest.raises(TuningTableError, match=rf"{p}: not valid JSON"):
        load_table(p, "norm")


# -- the lookup rule ---------------------------------------------------------------------------------------------
NEAR = [row("sm_90", 132, "bf16", 2048, 1), row("sm_90", 132, "bf16", 16384, 2), row("sm_90", 132, "fp32", 4096, 3),
        row("sm_80", 108, "bf16", 4096, 4), row("sm_90", 114, "bf16", 8192, 5)]


@pytest.mark.parametrize("dtype, n, block, source", [
    ("bf16", 2048, 1, "exact"),
    ("bf16", 3000, 1, "nearest"),      # |log2 3000/2048| = 0.55 < |log2 3000/8192| = 1.45
    ("bf16", 8192, 5, "nearest"),      # exact shape on a 114-SM sm_90 beats a neighbour shape on 132 SMs
    ("bf16", 12000, 2, "nearest"),     # 0.45 from 16384 vs 0.55 from 8192
    ("fp32", 100000, 3, "nearest"),    # the only fp32 row, far as it is: dtype must match, distance need not
    ("fp16", 4096, None, None),        # no fp16 row, no heuristic
])
def test_nearest_shape_rule(tmp_path, dtype, n, block, source):
    got = lookup("norm", H200, {"dtype": dtype, "n": n}, tables_=[table(tmp_path, NEAR)])
    assert (got.config["block"], got.source) == (block, source) if block else got is None


def test_ties_prefer_the_larger_shape_then_the_user_table(tmp_path):
    t = table(tmp_path, [row("sm_90", 132, "bf16", 2048, 1), row("sm_90", 132, "bf16", 8192, 2)])
    assert lookup("norm", H200, {"dtype": "bf16", "n": 4096}, tables_=[t]).config == {"block": 2}
    user = table(tmp_path, [row("sm_90", 132, "bf16", 1024, 7)], "u.json")
    shipped = table(tmp_path, [row("sm_90", 132, "bf16", 4096, 8)], "s.json")
    # equal distance (1024 and 4096 are both one octave from 2048): the larger shape wins over the user table
    assert lookup("norm", H200, {"dtype": "bf16", "n": 2048}, tables_=[user, shipped]).config == {"block": 8}
    # same shape in both: the user table wins
    shipped2 = table(tmp_path, [row("sm_90", 132, "bf16", 1024, 9)], "s2.json")
    assert lookup("norm", H200, {"dtype": "bf16", "n": 2048}, tables_=[user, shipped2]).config == {"block": 7}


def test_other_archs_rows_are_never_used(tmp_path):
    t = table(tmp_path, [row("sm_80", 108, "bf16", 4096, 4)])
    assert lookup("norm", H200, {"dtype": "bf16", "n": 4096}, tables_=[t]) is None
    got = lookup("norm", H200, {"dtype": "bf16", "n": 4096}, tables_=[t],
                 heuristic=lambda key, dev: {"block": 64 if key["n"] < 8192 else 128})
    assert (got.config, got.source, got.row) == ({"block": 64}, "heuristic", None)


def test_valid_skips_neighbours_whose_config_cannot_serve(tmp_path):
    t = table(tmp_path, [row("sm_90", 132, "bf16", 4096, 1024), row("sm_90", 132, "bf16", 1024, 128)])
    ok = lambda cfg, key: key["n"] % cfg["block"] == 0  # noqa: E731
    assert lookup("norm", H200, {"dtype": "bf16", "n": 3968}, tables_=[t]).config == {"block": 1024}
    assert lookup("norm", H200, {"dtype": "bf16", "n": 3968}, tables_=[t], valid=ok).config == {"block": 128}


def test_lookup_with_missing_key_field_names_it(tmp_path):
    with pytest.raises(KeyError, match=r"lacks \['dtype'\]"):
        lookup("norm", H200, {"n": 1}, tables_=[table(tmp_path, NEAR)])


def test_user_table_comes_before_shipped(tdir, monkeypatch):
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tdir / "shipped")
    write(tdir / "shipped" / "norm.json", [row("sm_90", 132, "bf16", 4096, 1)])
    assert tuning.lookup("norm", H200, {"dtype": "bf16", "n": 4096}).config == {"block": 1}
    write(tdir / "user" / "norm.json", [row("sm_90", 132, "bf16", 4096, 2)])
    # tables are read once per process: a table another process wrote is seen after reload()
    assert tuning.lookup("norm", H200, {"dtype": "bf16", "n": 4096}).config == {"block": 1}
    tuning.reload()
    got = tuning.lookup("norm", H200, {"dtype": "bf16", "n": 4096})
    assert got.config == {"block": 2} and got.path == tdir / "user" / "norm.json"


def test_merge_rows_is_seen_by_the_next_lookup_and_tables_are_read_once(tdir, monkeypatch):
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tdir / "shipped")
    write(tdir / "shipped" / "norm.json", [row("sm_90", 132, "bf16", 4096, 1)])
    assert tuning.lookup("norm", H200, {"dtype": "bf16", "n": 4096}).config == {"block": 1}
    reads = []
    monkeypatch.setattr(tuning, "load_table", lambda *a, **k: reads.append(a))
    for _ in range(3):
        assert tuning.lookup("norm", H200, {"dtype": "bf16", "n": 4096}).config == {"block": 1}
    assert reads == []  # no stat, no parse after the first lookup
    monkeypatch.undo()
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tdir / "shipped")
    merge_rows("norm", ("dtype", "n"), [Row("sm_90", 132, (("dtype", "bf16"), ("n", 4096)), {"block": 5}, {})],
               tuning.user_table_path("norm"))
    assert tuning.lookup("norm", H200, {"dtype": "bf16", "n": 4096}).config == {"block": 5}


def test_table_index_keeps_the_first_row_of_a_key_and_file_order():
    rows = tuple(Row("sm_90", 132, (("n", n),), {"block": b}, index=i) for i, (n, b) in enumerate(
        [(4096, 1), (4096, 2), (1024, 3)]))
    t = tuning.Table("norm", ("n",), rows + (Row("sm_80", 108, (("n", 4096),), {"block": 4}, index=3),))
    assert t.exact[("sm_90", 132, None, (("n", 4096),))].config == {"block": 1}
    assert [r.config["block"] for r in t.by_arch["sm_90"]] == [1, 2, 3]
    assert lookup("norm", H200, {"n": 4096}, tables_=[t]).config == {"block": 1}
    assert lookup("norm", H200, {"n": 2048}, tables_=[t]).config == {"block": 1}  # nearest: first of equal rank


def test_default_user_dir_is_under_the_cache_dir(tmp_path):
    with config.override(tuning_table_dir=None, cache_dir=tmp_path):
        assert tuning.user_table_path("norm") == tmp_path / "tuning" / "norm.json"


# -- merging and tuning ----------------------------------------------------------------------------------------------
def test_merge_keeps_other_archs_and_replaces_same_key(tmp_path):
    p = write(tmp_path / "norm.json", [row("sm_80", 108, "bf16", 4096, 4), row("sm_90", 132, "bf16", 4096, 1)])
    new = [Row("sm_90", 132, (("dtype", "bf16"), ("n", 4096)), {"block": 9}, {"time_us": 1.0}),
           Row("sm_90", 132, (("dtype", "bf16"), ("n", 8192)), {"block": 10}, {"time_us": 2.0})]
    merged = merge_rows("norm", ("dtype", "n"), new, p)
    again = load_table(p, "norm")
    assert again == dataclasses.replace(merged, rows=again.rows) and len(again.rows) == 3
    got = {(r.arch, dict(r.shape)["n"]): dict(r.config) for r in again.rows}
    assert got == {("sm_80", 4096): {"block": 4}, ("sm_90", 4096): {"block": 9}, ("sm_90", 8192): {"block": 10}}
    with pytest.raises(TuningTableError, match=r"keyed by \['dtype', 'n'\], the tuner by \['n'\]"):
        merge_rows("norm", ("n",), [], p)


def test_merge_keep_order_replaces_in_place(tmp_path):
    # rows deliberately out of sorted order (as a merge with keep_order leaves them)
    p = write(tmp_path / "norm.json", [row("sm_90", 132, "bf16", 8192, 1), row("sm_90", 132, "bf16", 1024, 2)])
    new = [Row("sm_90", 132, (("dtype", "bf16"), ("n", 1024)), {"block": 7}, {}),
           Row("sm_90", 132, (("dtype", "bf16"), ("n", 100000)), {"block": 8}, {})]
    merge_rows("norm", ("dtype", "n"), new, p, keep_order=True)
    got = [(r["shape"]["n"], r["config"]["block"]) for r in json.loads(p.read_text())["rows"]]
    assert got == [(8192, 1), (1024, 7), (100000, 8)]
    merge_rows("norm", ("dtype", "n"), [], p)  # without keep_order: sorted by key
    assert [r["shape"]["n"] for r in json.loads(p.read_text())["rows"]] == [100000, 1024, 8192]  # key text order


def test_table_is_reread_after_it_changes(tmp_path):
    p = write(tmp_path / "norm.json", [row("sm_90", 132, "bf16", 4096, 1)])
    assert load_table(p, "norm").rows[0].config == {"block": 1}
    write(p, [row("sm_90", 132, "bf16", 4096, 22)])
    os.utime(p, ns=(1, 1))  # a different mtime even on coarse clocks
    assert load_table(p, "norm").rows[0].config == {"block": 22}


class FakeTuner(Tuner):
    """Times are a function of the config, so the winner is known; block 96 fails like a bad config would."""

    op, key_fields = "norm", ("dtype", "n")

    def key(self, req):
        return {"dtype": req.dtype("x"), "n": req.dim("n")}

    def configs(self, req):
        return [{"block": b} for b in (64, 96, 128, 256)]

    def measure(self, req, cfg):
        if cfg["block"] == 96:
            raise RuntimeError("block 96 is not a multiple of the vector width")
        return {64: 3e-6, 128: 1e-6, 256: 2e-6}[cfg["block"]]


def test_tune_request_picks_the_fastest_and_records_failures():
    live = dataclasses.replace(H200, ordinal=0, name="NVIDIA H200")
    req = OpRequest("norm", dtypes={"x": "bf16"}, shape={"n": 4096}, device=live)
    r, trials = tuning.tune_request(FakeTuner(), req)
    assert (r.arch, r.sm_count, dict(r.shape), dict(r.config)) == ("sm_90", 132, {"dtype": "bf16", "n": 4096},
                                                                   {"block": 128})
    assert r.meta["time_us"] == 1.0 and r.meta["configs_timed"] == 3
    assert r.meta["date"].endswith("Z") and r.meta["versions"]["device"] == "NVIDIA H200"
    assert r.meta["versions"]["rtckern"] and r.meta["versions"]["compiler"].startswith("nvrtc-")
    bad = [t for t in trials if t.seconds is None]
    assert len(bad) == 1 and bad[0].error == "RuntimeError: block 96 is not a multiple of the vector width"


def test_tune_needs_a_live_device():
    req = OpRequest("norm", dtypes={"x": "bf16"}, shape={"n": 4096}, device=H200)
    with pytest.raises(tuning.RtckernError, match=r"needs a live GPU"):
        tuning.tune_request(FakeTuner(), req)


def test_tuner_best_uses_table_then_heuristic(tdir):
    class T(FakeTuner):
        def heuristic(self, key, device):
            return {"block": 32}

    req = OpRequest("norm", dtypes={"x": "bf16"}, shape={"n": 4096}, device=H200)
    assert T().best(req).source == "heuristic"
    write(tdir / "user" / "norm.json", [row("sm_90", 132, "bf16", 4096, 512)])
    tuning.reload()  # written behind the process's back (merge_rows reloads by itself)
    assert (T().best(req).config, T().best(req).source) == ({"block": 512}, "exact")


def test_a_table_written_by_one_process_is_used_by_the_next(tdir):
    """What `rtckern tune` does on the GPU, with the measured rows stood in: merge, then a new process looks up."""
    p = tdir / "user" / "norm.json"
    merge_rows("norm", ("dtype", "n"), [Row("sm_90", 132, (("dtype", "bf16"), ("n", 4096)), {"block": 384})], p)
    code = ("from rtckern import tuning; from rtckern.device import DeviceInfo; "
            "t = tuning.lookup('norm', DeviceInfo.for_arch('sm_90'), {'dtype': 'bf16', 'n': 4000}); "
            "print(t.source, t.config['block'], t.path)")
    env = dict(os.environ, PYTHONPATH=str(REPO), RTCKERN_TUNING_DIR=str(tdir / "user"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["nearest", "384", str(p)]


def test_shipped_tables_load_and_carry_date_and_versions():
    """Every row checked (a process reads the shipped tables without the per-row checks: tuning.parse_table)."""
    for path in sorted(tuning.SHIPPED_DIR.glob("*.json")):
        t = tuning.parse_table(json.loads(path.read_text()), path, path.stem, check_rows=True)
        assert t.rows, path
        for r in t.rows:
            v = r.meta.get("versions") or {}
            # the GPU's name ("device"; the norms sweep writes "gpu") and at least one toolchain version
            assert r.meta.get("date") and (v.get("device") or v.get("gpu")) and len(v) >= 2, (path, r.index)


def test_a_table_path_that_is_no_file_is_absent_or_an_error_naming_it(tmp_path):
    """A tuning dir that is a file reads as no table; a table path that is a directory is a TuningTableError naming
    it (both were tracebacks from `rtckern explain`)."""
    (tmp_path / "afile").write_text("")
    assert load_table(tmp_path / "afile" / "norm_fwd.json", "norm_fwd") is None
    (tmp_path / "norm_fwd.json").mkdir()
    with pytest.raises(TuningTableError, match=r"norm_fwd.json: cannot read the tuning table \(Is a directory\)"):
        load_table(tmp_path / "norm_fwd.json", "norm_fwd")


def test_every_shipped_row_names_the_command_that_makes_it():
    """A shipped row can be made again: its source is an `rtckern tune` command of a registered tuner with --shapes
    (rows from before the command was recorded say so after it)."""
    import rtckern.ops  # noqa: F401 - registers the ops' tuners, as `rtckern tune` does

    for path in sorted(tuning.SHIPPED_DIR.glob("*.json")):
        for i, r in enumerate(json.loads(path.read_text())["rows"]):
            words = str(r.get("source", "")).split()
            assert words[:2] == ["rtckern", "tune"] and "--shapes" in words, (path.name, i, r.get("source"))
            tuning.resolve_tuner(words[2])  # raises for a name `rtckern tune` does not know


# -- device classes ------------------------------------------------------------------------------------------------
def crow(cls, n, block, sms=132, arch="sm_90", dtype="bf16"):
    r = row(arch, sms, dtype, n, block)
    if cls:
        r["device_class"] = cls
    return r


def write2(path, rows):
    path.write_text(json.dumps({"format": 2, "op": "norm", "key_fields": ["dtype", "n"], "rows": rows}))
    return load_table(path, "norm")


H100 = DeviceInfo.for_arch("sm_90", sm_count=132, device_class="h100-sxm")
H200C = DeviceInfo.for_arch("sm_90", sm_count=132, device_class="h200")


@pytest.mark.parametrize("name, memory, cls", [
    ("NVIDIA H100 80GB HBM3", 0, "h100-sxm"), ("NVIDIA H200", 0, "h200"), ("NVIDIA H100 PCIe", 0, "h100-pcie"),
    ("NVIDIA H100 NVL", 0, "h100-nvl"), ("NVIDIA A100-SXM4-80GB", 0, "a100-80g"),
    ("NVIDIA A100-SXM4-40GB", 40 << 30, "a100-40g"), ("NVIDIA A100 80GB PCIe", 80 << 30, "a100-80g"),
    ("NVIDIA GeForce RTX 4090", 0, "geforce-rtx-4090"), ("AMD Instinct MI300X", 0, "mi300x"), ("", 0, None)])
def test_class_of_a_device_name(name, memory, cls):
    from rtckern.device import class_of_name

    assert class_of_name(name, memory) == cls


def test_device_class_of_live_described_and_named_devices():
    from rtckern.device import device_class

    assert device_class(H200) is None  # described by arch alone
    assert device_class(H100) == "h100-sxm"
    live_like = dataclasses.replace(H200, name="NVIDIA H100 80GB HBM3", memory_bytes=80 << 30)
    assert device_class(live_like) == "h100-sxm"
    with pytest.raises(ValueError, match=r"device class 'H 1': use lowercase letters"):
        DeviceInfo.for_arch("sm_90", device_class="H 1")
    assert DeviceInfo.for_arch("sm_90", device_class="H200").device_class == "h200"


def test_lookup_prefers_the_device_class_then_falls_back_by_bandwidth(tmp_path):
    t = write2(tmp_path / "c.json", [crow("h200", 4096, 1), crow("h100-sxm", 8192, 2), crow("a100-80g", 4096, 3),
                                     crow(None, 2048, 4)])
    key = {"dtype": "bf16", "n": 4096}
    # the H100's own rows first: nearest shape among them (8192) beats the H200's exact shape
    got = lookup("norm", H100, key, tables_=[t])
    assert (got.config, got.source, got.match) == ({"block": 2}, "nearest", "class")
    assert "matches" not in got.describe() and "the device's class h100-sxm" in got.describe()
    # the H200 has its exact row
    got = lookup("norm", H200C, key, tables_=[t])
    assert (got.config, got.source, got.match) == ({"block": 1}, "exact", "class")
    # a class without rows: exact shape of another class, the nearest bandwidth (h200 4.8 vs a100 2.0 from 3.9)
    nvl = DeviceInfo.for_arch("sm_90", sm_count=132, device_class="h100-nvl")
    got = lookup("norm", nvl, key, tables_=[t])
    assert (got.config, got.source, got.match) == ({"block": 1}, "exact", "other")
    assert "no row of the device's class h100-nvl serves, fell back to class h200" in got.describe()
    pcie = DeviceInfo.for_arch("sm_90", sm_count=132, device_class="h100-pcie")  # 2.0 TB/s: the A100's row
    assert lookup("norm", pcie, key, tables_=[t]).config == {"block": 3}
    # a row of no class is preferred over other classes at the same shape
    t2 = write2(tmp_path / "d.json", [crow("h200", 4096, 1), crow(None, 4096, 9)])
    got = lookup("norm", nvl, key, tables_=[t2])
    assert (got.config, got.match) == ({"block": 9}, "any")


def test_a_device_without_class_gets_what_it_got_before_classes(tmp_path):
    old = table(tmp_path, NEAR)  # format 1: rows of any class
    migrated = write2(tmp_path / "m.json", [crow("h200", r["shape"]["n"], r["config"]["block"], sms=r["sm_count"],
                                                 arch=r["arch"], dtype=r["shape"]["dtype"]) for r in NEAR])
    for dtype, n in [("bf16", 2048), ("bf16", 3000), ("bf16", 8192), ("bf16", 12000), ("fp32", 100000),
                     ("fp16", 4096)]:
        for dev in (H200, H100):
            a = lookup("norm", dev, {"dtype": dtype, "n": n}, tables_=[old])
            b = lookup("norm", dev, {"dtype": dtype, "n": n}, tables_=[migrated])
            assert (a and (a.config, a.source)) == (b and (b.config, b.source))


def test_rows_of_two_classes_with_one_shape_are_not_duplicates_but_repeats_are_all_listed(tmp_path):
    write2(tmp_path / "ok.json", [crow("h200", 4096, 1), crow("h100-sxm", 4096, 2), crow(None, 4096, 3)])
    path = tmp_path / "dup.json"
    rows = [crow("h200", 4096, 1), crow("h200", 4096, 2), crow("h100-sxm", 1024, 3), crow("h200", 4096, 4),
            crow("h100-sxm", 1024, 5)]
    with pytest.raises(TuningTableError) as ei:
        write2(path, rows)
    msg = str(ei.value)
    assert msg.startswith(f"{path}: 2 duplicate keys: rows 0, 1 and 3 have the same key (arch=sm_90, sm_count=132, "
                          "device_class=h200, dtype=bf16, n=4096)")
    assert "rows 2 and 4 have the same key (arch=sm_90, sm_count=132, device_class=h100-sxm, dtype=bf16, n=1024)" in msg


def test_merge_refuses_duplicate_new_rows_and_keeps_other_classes(tmp_path):
    path = tmp_path / "norm.json"
    write2(path, [crow("h200", 4096, 1), crow("a100-80g", 4096, 7, sms=108, arch="sm_80")])
    new = [Row("sm_90", 132, (("dtype", "bf16"), ("n", 4096)), {"block": 2}, device_class="h100-sxm")]
    with pytest.raises(TuningTableError, match=r"the rows to merge hold rows 0 and 1 have the same key"):
        merge_rows("norm", ("dtype", "n"), new * 2, path)
    t = merge_rows("norm", ("dtype", "n"), new, path)
    assert sorted((r.device_class, r.config["block"]) for r in t.rows) == [("a100-80g", 7), ("h100-sxm", 2),
                                                                          ("h200", 1)]


def test_the_same_rows_give_the_same_bytes_in_any_order(tmp_path):
    rows = [Row("sm_90", 132, (("dtype", "bf16"), ("n", n)), {"block": n // 16}, {"time_us": 1.0}, device_class=c)
            for n in (1024, 4096) for c in ("h200", "h100-sxm", None)]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    merge_rows("norm", ("dtype", "n"), rows, a)
    merge_rows("norm", ("dtype", "n"), rows[::-1], b)
    assert a.read_bytes() == b.read_bytes()
    assert json.loads(a.read_text())["format"] == tuning.FORMAT == 2


def test_shipped_tables_are_migrated_deterministically_from_their_versions():
    from rtckern.device import class_of_name

    for path in sorted(tuning.SHIPPED_DIR.glob("*.json")):
        text = path.read_text()
        data = json.loads(text)
        assert data["format"] == 2, path
        assert json.dumps(data, indent=1) + "\n" == text, path  # the bytes `rtckern tune` writes
        classes = set()
        for r in data["rows"]:
            name = r["versions"].get("device") or r["versions"].get("gpu")
            assert r["device_class"] == class_of_name(name), (path, r)
            classes.add(r["device_class"])
        assert not tuning.duplicate_keys(load_table(path).rows)
        if classes != {"h200"}:  # tuned in format 2 (gemm_fp8 on the H100): nothing was migrated
            continue
        old = json.loads(text)
        old["format"] = 1
        for r in old["rows"]:
            del r["device_class"]
        assert json.dumps(tuning.migrate(old), indent=1) + "\n" == text, path
        assert not tuning.duplicate_keys(load_table(path).rows)


def test_importing_the_ops_imports_no_tuner_and_rtckern_tune_finds_every_one():
    """Tuners are declared at import (tuning.defer_tuners) and imported when asked for: no op call needs them."""
    code = ("import sys, rtckern.ops\n"
            "print(sorted(m for m in sys.modules if m.startswith('rtckern.ops.') and m.endswith('.tune')))\n"
            "from rtckern import tuning\n"
            "print(all(t in tuning.tuner_ops() for t in ('rms_norm', 'softmax', 'attention', 'gemm', 'gemm_fp8')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout


def test_exact_fields_keep_a_neighbour_to_its_own_head_dim(tmp_path):
    """`exact` names integer fields where distance means nothing (a head dim, a 0 / 1 flag): a neighbour must share
    them. The attention tile lookups passed a `valid` that read the head dim from the config, which holds none, so
    no neighbour ever served; on a device with no rows of its own (another SM count) the same head dim now does."""
    t = table(tmp_path, [row("sm_90", 132, "bf16", 64, 4), row("sm_90", 132, "bf16", 128, 8)])
    pcie = DeviceInfo.for_arch("sm_90", sm_count=114)
    assert lookup("norm", pcie, {"dtype": "bf16", "n": 128}, tables_=[t], exact=("n",)).config == {"block": 8}
    assert lookup("norm", pcie, {"dtype": "bf16", "n": 96}, tables_=[t], exact=("n",)) is None
    assert lookup("norm", pcie, {"dtype": "bf16", "n": 96}, tables_=[t]) is not None  # without it: nearest n


def test_the_decode_tile_of_another_sm_count_serves_the_same_head_dim():
    import rtckern.ops  # noqa: F401  (registers the op families' candidates)
    from rtckern.registry import build_request, candidates

    cand = next(c for c in candidates("attention_with_kvcache") if c.name == "attention_with_kvcache.sm80_mma")
    pcie = DeviceInfo.for_arch("sm_90", sm_count=114)
    h200 = DeviceInfo.for_arch("sm_90", sm_count=132)
    for hd in (64, 128):
        req = lambda d: build_request("attention_with_kvcache", shape=(hd,), dtype="bf16", device=d)  # noqa: E731
        assert cand.tile(req(pcie)) == cand.tile(req(h200)), hd  # the 132-SM row of that head dim


def test_one_own_row_far_away_does_not_outrank_another_devices_exact_shape(tmp_path):
    """A device whose SM count no shipped row has (an H100 PCIe) with one row of its own (a user tuned one shape):
    that row answers its neighbours, but a shape far from it takes another device's exact row, not the one row."""
    t = table(tmp_path, [row("sm_90", 132, "bf16", 64, 1, device_class="h100-sxm"),
                         row("sm_90", 132, "bf16", 4096, 2, device_class="h100-sxm"),
                         row("sm_90", 114, "bf16", 4096, 3, device_class="h100-pcie")])
    pcie = DeviceInfo.for_arch("sm_90", sm_count=114, device_class="h100-pcie")
    assert lookup("norm", pcie, {"dtype": "bf16", "n": 4096}, tables_=[t]).config == {"block": 3}  # its own, exact
    assert lookup("norm", pcie, {"dtype": "bf16", "n": 3000}, tables_=[t]).config == {"block": 3}  # own, near
    got = lookup("norm", pcie, {"dtype": "bf16", "n": 64}, tables_=[t])
    assert got.config == {"block": 1} and got.source == "nearest"  # the 132-SM exact row, not 64x away
    assert lookup("norm", pcie, {"dtype": "bf16", "n": 100}, tables_=[t]).config == {"block": 3}  # none exact


def test_a_users_row_of_no_class_beats_the_shipped_rows_of_the_devices_class(tdir, monkeypatch):
    """A user's row without a device class (hand-written, or an older rtckern's) with this exact shape serves a live
    H200 before the shipped h200 rows, exact or nearest; a near shape still takes the shipped h200 row."""
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tdir / "shipped")
    write(tdir / "shipped" / "norm.json", [row("sm_90", 132, "bf16", 4096, 1, device_class="h200"),
                                           row("sm_90", 132, "bf16", 2048, 4, device_class="h200")])
    write(tdir / "user" / "norm.json", [row("sm_90", 132, "bf16", 4096, 2), row("sm_90", 132, "bf16", 3000, 3)])
    tuning.reload()
    h200 = DeviceInfo.for_arch("sm_90", sm_count=132, device_class="h200")
    for n, block in ((4096, 2), (3000, 3), (2048, 4)):
        got = tuning.lookup("norm", h200, {"dtype": "bf16", "n": n})
        assert got.config == {"block": block} and got.source == "exact", (n, got)


def test_shadowed_rows_respect_the_exact_fields(tmp_path):
    """A row of another class is hidden only by an own row the lookup would serve in its place: one within a factor
    2 that shares the op's exact fields (a decode tile of head dim 64 does not hide another class's head dim 128)."""
    t = table(tmp_path, [row("sm_90", 132, "bf16", 64, 1, device_class="h200"),
                         row("sm_90", 132, "bf16", 128, 2, device_class="h100-sxm")])
    assert [r.config for r in shadowed_rows([t], "sm_90", 132, "h200")] == [{"block": 2}]
    assert shadowed_rows([t], "sm_90", 132, "h200", exact=("n",)) == []


def test_a_row_keyed_by_a_feature_arch_is_refused_at_load(tmp_path):
    """Rows are keyed by the compute capability: an 'sm_90a' row could never match, so the table is refused."""
    with pytest.raises(TuningTableError, match=r"arch 'sm_90a' should be like 'sm_90'.*without a feature suffix"):
        table(tmp_path, [row("sm_90a", 132, "bf16", 4096, 1)])


# -- the shipped tables' memo ------------------------------------------------------------------------------------
def _as_compared(t):
    return (t.op, t.key_fields, [(r.key, dict(r.config), dict(r.meta), r.index) for r in t.rows],
            {k: r.index for k, r in t.exact.items()}, {k: [r.index for r in rs] for k, rs in t.by_shape.items()})


def test_a_shipped_table_read_through_its_memo_equals_the_parsed_file(cache_dir, monkeypatch):
    """The first read parses the JSON and remembers the rows in the cache dir; the next process (here: the next read
    after the in-process cache is dropped) unmarshals them without parsing JSON, and gets the same table."""
    cache_dir.mkdir()
    path = tuning.shipped_table_path("norm_fwd")
    parsed = parse_table(json.loads(path.read_text()), path, "norm_fwd", check_rows=True)
    first = load_table(path, "norm_fwd", check_rows=False)
    (memo,) = (cache_dir / "tables").iterdir()
    assert memo.name.startswith("norm_fwd-") and memo.suffix == ".marshal"
    rtckern.clear_caches()
    monkeypatch.setattr(tuning, "parse_table", lambda *a, **k: pytest.fail("the memo was not used"))
    again = load_table(path, "norm_fwd", check_rows=False)
    assert again is not first and _as_compared(again) == _as_compared(first) == _as_compared(parsed)
    assert again.path == path and again.rows == parsed.rows  # Row equality compares the meta too
    r0 = parsed.rows[0]
    assert repr(again.rows[0].meta) == repr(dict(r0.meta)) and again.rows[0].meta.get("date") == r0.meta["date"]
    assert again.rows[0].to_json() == r0.to_json()


def test_the_memo_follows_the_contents_not_the_timestamp(cache_dir, tmp_path):
    """A table edited in place with its size and mtime kept is read anew: the memo is keyed by the bytes."""
    cache_dir.mkdir()
    p = write(tmp_path / "norm.json", [row("sm_90", 132, "bf16", 4096, 11)])
    assert load_table(p, "norm", check_rows=False).rows[0].config == {"block": 11}
    st = p.stat()
    write(p, [row("sm_90", 132, "bf16", 4096, 22)])
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    rtckern.clear_caches()
    assert load_table(p, "norm", check_rows=False).rows[0].config == {"block": 22}
    assert len(list((cache_dir / "tables").iterdir())) == 2


def test_a_damaged_or_foreign_memo_is_a_miss_and_is_rewritten(cache_dir, tmp_path):
    cache_dir.mkdir()
    p = write(tmp_path / "norm.json", [row("sm_90", 132, "bf16", 4096, 11)])
    load_table(p, "norm", check_rows=False)
    (memo,) = (cache_dir / "tables").iterdir()
    good = memo.read_bytes()
    other = marshal.dumps((1, "norm", ["dtype", "n"], [("sm_90",)]))  # a digest that matches, rows that do not
    for bad in (good[:-1] + bytes([good[-1] ^ 1]), good[:40], b"", good[:32] + b"\x00" * 8,
                hashlib.sha256(other).digest() + other):
        memo.write_bytes(bad)
        rtckern.clear_caches()
        assert load_table(p, "norm", check_rows=False).rows[0].config == {"block": 11}
        assert memo.read_bytes() == good
    rtckern.clear_caches()
    with pytest.raises(TuningTableError, match="table is for op 'norm', expected 'other'"):
        load_table(p, "other", check_rows=False)  # the memo of another op's table is not taken for this one


def test_no_memo_without_a_disk_cache_or_for_a_checked_table(cache_dir, tmp_path):
    cache_dir.mkdir()
    p = write(tmp_path / "norm.json", [row("sm_90", 132, "bf16", 4096, 11)])
    load_table(p, "norm")  # a user's table: checked row by row, never memoized
    with config.override(disk_cache=False):
        rtckern.clear_caches()
        load_table(p, "norm", check_rows=False)
    assert not (cache_dir / "tables").exists()
    with config.override(cache_dir=tmp_path / "absent"):
        rtckern.clear_caches()
        load_table(p, "norm", check_rows=False)
    assert not (tmp_path / "absent").exists()  # a cache dir that does not exist is not created for a memo


def test_a_memo_written_by_one_process_serves_the_next(cache_dir):
    """The memo's key names the parser's code by content (so another rtckern reads none of this one's memos): a
    fresh process, under another hash seed, reads the memo the first wrote instead of parsing the JSON."""
    cache_dir.mkdir()
    code = ("import json, sys; from rtckern import tuning\n"
            "if sys.argv[1] == 'read': json.loads = None  # any JSON parse fails\n"
            "t = tuning.load_table(tuning.shipped_table_path('norm_kind'), 'norm_kind', check_rows=False)\n"
            "print(len(t.rows), t.rows[0].meta['date'])")
    env = dict(os.environ, PYTHONPATH=str(REPO), RTCKERN_CACHE_DIR=str(cache_dir))
    outs = [subprocess.run([sys.executable, "-c", code, mode], env=dict(env, PYTHONHASHSEED=seed),
                           capture_output=True, text=True, timeout=60)
            for mode, seed in (("write", "1"), ("read", "2"))]
    assert [o.returncode for o in outs] == [0, 0], outs[1].stderr
    assert outs[0].stdout == outs[1].stdout and len(list((cache_dir / "tables").iterdir())) == 1
