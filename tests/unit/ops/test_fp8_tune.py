"""`rtckern tune gemm_fp8` without a GPU: the configs it times, its key, shape files, the rows it merges (device
class, other archs' and classes' rows kept, duplicates refused, same bytes for the same inputs) and how configs.py
reads them (own class, then any class, then the rule)."""
from __future__ import annotations

import dataclasses
import json

import pytest

import rtckern.ops  # noqa: F401  (registers gemm_fp8, its request builder and tuner)
from rtckern import config, tuning
from rtckern.cli import build_parser
from rtckern.device import DeviceInfo
from rtckern.ops._fp8 import candidates as cands
from rtckern.ops._fp8 import configs, tune
from rtckern.ops._fp8.geometry import Fp8Problem, Sm90Fp8Config

H100 = DeviceInfo.for_arch("sm_90", sm_count=132, device_class="h100-sxm")
PLAIN = DeviceInfo.for_arch("sm_90", sm_count=132)
LIVE = dataclasses.replace(DeviceInfo.for_arch("sm_90", sm_count=132), name="NVIDIA H100 80GB HBM3", ordinal=0,
                           memory_bytes=80 << 30)


def _req(shape, device=H100, **opts):
    from rtckern.registry import build_request

    return build_request("gemm_fp8", shape=shape, dtype=None, device=device, options=opts)


def test_the_tuner_is_registered_and_times_every_tile_the_kernel_accepts():
    t = tuning.get_tuner("gemm_fp8")
    assert t.key_fields == ("scale", "out", "m", "n", "k")
    big = t.configs(_req("4096x4096x4096"))
    assert big and all(Sm90Fp8Config(**{k: v for k, v in c.items() if k != "kind"}).invalid(
        Fp8Problem(4096, 4096, 4096)) is None for c in big)
    for rule in (Sm90Fp8Config(128, 128, 6, 2), Sm90Fp8Config(64, 128, 8, 1), Sm90Fp8Config(128, 256, 4, 2)):
        assert rule.as_dict() in big  # the rule's tiles are among those timed
    small = t.configs(_req("16x4096x4096"))
    assert small and all(c["bm"] == 64 for c in small) and len(small) < len(big)
    assert t.key(_req("16x4096x4096", scale="channel")) == {"scale": "tensor", "out": "bf16", "m": 16, "n": 4096,
                                                            "k": 4096}


@pytest.mark.parametrize("device, opts, match", [
    (DeviceInfo.for_arch("sm_89"), {}, r"tile configs to tune on sm_90 .* only"),
    (H100, {"bias": "bf16"}, r"keyed without bias"),
    (H100, {"scale": "channel"}, r"tune with --opt scale=tensor"),
])
def test_validate_refuses_what_the_table_is_not_keyed_by(device, opts, match):
    with pytest.raises(ValueError, match=match):
        tuning.get_tuner("gemm_fp8").validate(_req("128x4096x4096", device, **opts))


def fake_seconds(cfg) -> float:
    """Injected timings: 64 x 64 tiles fastest, then deeper rings."""
    return 1e-5 * (cfg["bm"] * cfg["bn"]) / 4096 - cfg["stages"] * 1e-8


@pytest.fixture
def tuned(tmp_path, monkeypatch):
    from rtckern.commands import tune as tune_cmd

    t = tuning.get_tuner("gemm_fp8")
    monkeypatch.setattr(t, "measure", lambda req, cfg: fake_seconds(cfg))
    monkeypatch.setattr(tune_cmd, "live_device", lambda ordinal, command: LIVE)
    monkeypatch.setattr(tuning, "versions", lambda device: {"device": device.name})
    with config.override(tuning_table_dir=tmp_path / "user"):
        yield tmp_path


def _run(argv, capsys, rc=0):
    args = build_parser().parse_args(argv)
    got = args.func(args)
    out = capsys.readouterr()
    assert got == rc, out.err
    return out


def test_tune_a_shape_file_records_the_live_class_and_keeps_other_rows(tuned, capsys):
    shapes = tuned / "model.txt"
    shapes.write_text("# a model\n16x4096x4096   # decode\n\n4096x4096x4096\n")
    path = tuned / "user" / "gemm_fp8.json"
    path.parent.mkdir(parents=True)
    other = {"arch": "sm_80", "sm_count": 108, "device_class": "a100-80g",
             "shape": {"scale": "tensor", "out": "bf16", "m": 16, "n": 4096, "k": 4096}, "config": {"bm": 64}}
    h200 = dict(other, arch="sm_90", sm_count=132, device_class="h200",
                config=Sm90Fp8Config(128, 128, 4, 2).as_dict())
    path.write_text(json.dumps({"format": 2, "op": "gemm_fp8", "key_fields": list(configs.KEY_FIELDS),
                                "rows": [other, h200]}))
    _run(["tune", "gemm_fp8", "--shapes", str(shapes)], capsys)
    rows = json.loads(path.read_text())["rows"]
    keys = sorted((r["arch"], r["device_class"], r["shape"]["m"]) for r in rows)
    assert keys == [("sm_80", "a100-80g", 16), ("sm_90", "h100-sxm", 16), ("sm_90", "h100-sxm", 4096),
                    ("sm_90", "h200", 16)]
    mine = [r for r in rows if r["device_class"] == "h100-sxm"]
    assert all(r["config"]["bm"] == 64 and r["config"]["bn"] == 64 for r in mine)
    assert mine[0]["source"].startswith("rtckern tune gemm_fp8 --shapes ")
    # the table serves the H100 its own rows, the H200 its own, a device of no class the nearest of any class
    tuning.reload()
    cands._configs.clear()
    cfg, found = configs.tuned(Fp8Problem(16, 4096, 4096), LIVE)
    assert (cfg.bm, cfg.bn, found.match, found.source) == (64, 64, "class", "exact")
    h200_dev = dataclasses.replace(PLAIN, device_class="h200")
    cfg, found = configs.tuned(Fp8Problem(16, 4096, 4096), h200_dev)
    assert (cfg.bm, cfg.stages, found.match) == (128, 4, "class")
    cfg, found = configs.tuned(Fp8Problem(20, 4096, 4096), H100)
    assert (cfg.bm, found.source, found.match) == (64, "nearest", "class")
    # explain names the row and its class
    out = _run(["explain", "gemm_fp8", "--shape", "16x4096x4096", "--arch", "sm_90", "--sm-count", "132",
                "--device-class", "h100-sxm", "--first"], capsys, rc=0).out
    assert "exact row" in out and "class h100-sxm" in out and "the device's class h100-sxm" in out


def test_retuning_the_same_inputs_gives_the_same_bytes(tuned, capsys, monkeypatch):
    import datetime as real

    fixed = real.datetime(2026, 1, 1, tzinfo=real.timezone.utc)
    monkeypatch.setattr(tuning, "datetime", type("M", (), {"timezone": real.timezone, "datetime": type(
        "D", (), {"now": staticmethod(lambda tz=None: fixed)})}))
    _run(["tune", "gemm_fp8", "--shapes", "16x4096x4096,4096x4096x4096"], capsys)
    path = tuned / "user" / "gemm_fp8.json"
    first = path.read_bytes()
    path.unlink()
    _run(["tune", "gemm_fp8", "--shapes", "4096x4096x4096,16x4096x4096"], capsys)
    assert path.read_bytes() == first


def test_a_shape_given_twice_is_an_error_naming_every_repeat(tuned, capsys):
    f = tuned / "dups.txt"
    f.write_text("16x4096x4096\n8x1024x1024\n16x4096x4096\n8x1024x1024\n32x1024x1024\n")
    err = _run(["tune", "gemm_fp8", "--shapes", str(f)], capsys, rc=2).err
    assert err.startswith(f"rtckern tune: --shapes '{f}': 2 shape(s) given more than once: 16x4096x4096 (2 times), "
                          "8x1024x1024 (2 times)")


def test_shipped_model_shape_lists_cover_the_decode_range_and_parse():
    from rtckern.commands.tune import read_shapes, shipped_shape_lists

    assert {"llama-3.1-8b", "llama-3.1-70b", "deepseek-v3"} <= set(shipped_shape_lists())
    for name in shipped_shape_lists():
        shapes, src = read_shapes(name)
        if name.endswith(("-moe", "-moe-decode")):  # grouped GEMMs: GxMxNxK (tests/unit/ops/test_grouped_tune.py)
            continue
        ms = {int(s.split("x")[0]) for s in shapes}
        assert {1, 2, 4, 8, 16, 32, 64, 128, 256} <= ms, name
        assert all(len(s.split("x")) == 3 and int(s.split("x")[2]) % 16 == 0 for s in shapes), name
    shapes, _ = read_shapes("deepseek-v3")
    assert "128x24576x1536" in shapes and "1x7168x16384" in shapes


def test_list_configs_needs_no_gpu_and_names_the_row_key(capsys):
    out = _run(["tune", "gemm_fp8", "--shapes", "llama-3.1-8b", "--list-configs", "--arch", "sm_90",
                "--sm-count", "132", "--device-class", "h100-sxm", "--json"], capsys).out
    doc = json.loads(out)
    assert doc["tables"] == ["gemm_fp8"] and len(doc["shapes"]) == 56
    first = doc["shapes"][0]
    assert first["key"] == {"arch": "sm_90", "sm_count": 132, "device_class": "h100-sxm", "scale": "tensor",
                            "out": "bf16", "m": 1, "n": 6144, "k": 4096}
    assert first["configs"] == tune.Fp8GemmTuner().configs(_req("1x6144x4096"))
    text = _run(["tune", "gemm_fp8", "--shapes", "16x4096x4096", "--list-configs", "--arch", "sm_90"], capsys).out
    assert "device_class=None" in text and "config(s) to time" in text
    err = _run(["tune", "gemm_fp8", "--shapes", "16x4096x4096", "--arch", "sm_90"], capsys, rc=2).err
    assert "--list-configs" in err


def test_without_rows_the_rule_serves_and_selection_is_unchanged(monkeypatch, tmp_path):
    from rtckern import tuning

    cands._configs.clear()
    for dev in (PLAIN, H100):
        cfg, found = configs.tuned(Fp8Problem(16, 4096, 4096), dev)
        assert found is None or found.row is not None
    # no table at all (neither shipped nor the user's): the rule
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path / "shipped")
    with config.override(tuning_table_dir=None):
        cfg, found = configs.tuned(Fp8Problem(4096, 4096, 4096), PLAIN)
    assert found is None and cfg == configs.heuristic(Fp8Problem(4096, 4096, 4096), 132)


def test_decode_shapes_are_timed_with_their_weight_from_device_memory():
    """M <= 64 with a weight under tuning.ROTATION_BYTES: timed over copies of b adding up to it (about three H200
    L2s), as a model's layers read their weights; larger weights and prefill shapes over b alone (the bf16 GEMM's
    tuner asks tuning.weight_copies the same, with its 2-byte weights)."""
    copies = tune.weight_copies
    assert copies(Fp8Problem(64, 4096, 4096)) == 13 and copies(Fp8Problem(1, 2112, 7168)) == 14
    assert copies(Fp8Problem(8, 28672, 8192)) == 1 and copies(Fp8Problem(65, 4096, 4096)) == 1
    for m, n, k in ((1, 1024, 4096), (64, 4096, 14336), (32, 7168, 2048)):
        c = copies(Fp8Problem(m, n, k))
        assert c * n * k >= tuning.ROTATION_BYTES > (c - 1) * n * k
    assert tuning.weight_copies(8, 2 * 4096 * 4096) == 7 and tuning.weight_copies(8, 2 * 28672 * 4096) == 1
