"""`rtckern tune OP`: OP is an op name or a tuner name; an op with several tuners or none is one line naming
them. --list-configs runs without a GPU on a described device."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rtckern.ops  # noqa: F401  (the families register their tuners)
from rtckern import tuning

REPO = Path(__file__).resolve().parents[3]


def test_op_names_and_tuner_names_both_resolve():
    assert tuning.resolve_tuner("rms_norm")[0].op == "rms_norm"
    tuner, op = tuning.resolve_tuner("softmax_masked")  # a tuner named after its table
    assert (tuner.op, op) == ("softmax_masked", "scaled_masked_softmax")
    tuner, op = tuning.resolve_tuner("softmax_ring_causal")
    assert op == "scaled_upper_triang_masked_softmax"
    with pytest.raises(KeyError, match=r"op 'scaled_masked_softmax' is timed by 2 tuners, each writing its own "
                                       r"table: softmax_masked, softmax_ring_masked; name one"):
        tuning.resolve_tuner("scaled_masked_softmax")
    assert tuning.resolve_tuner("attention")[0].op == "attention"
    with pytest.raises(KeyError, match=r"'attention_backward' is neither a tuner nor an op with one .* ops with "
                                       r"tuners \(tuner names\): (.*; )?gemm \(gemm\); .*rms_norm \(rms_norm\); "):
        tuning.resolve_tuner("attention_backward")
    assert [t.op for t in tuning.tuners_for("softmax")] == ["softmax", "softmax_ring"]


@pytest.mark.parametrize("name, request_op", [("rms_norm", "rms_norm"), ("softmax_masked", "scaled_masked_softmax")])
def test_list_configs_without_a_gpu(tmp_path, name, request_op):
    r = subprocess.run([sys.executable, "-m", "rtckern", "tune", name, "--shapes", "8192x4096", "--list-configs",
                        "--arch", "sm_90", "--json"], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO), RTCKERN_CACHE_DIR=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["op"] == name and out["shapes"][0]["configs"]


def test_a_partial_shape_list_says_which_rows_of_other_classes_it_hides(tmp_path, monkeypatch, capsys):
    """Rows tuned on an H100 for some nn shapes hide the H200's nn rows of nearby shapes (within a factor 2) from
    H100s (the lookup answers with the H100's nearest shape first): `rtckern tune` names them on stderr, and tuning
    them too ends it; a far shape hides nothing."""
    import dataclasses

    import rtckern
    from rtckern import config
    from rtckern.cli import build_parser
    from rtckern.commands import tune as tune_cmd
    from rtckern.device import DeviceInfo

    live = dataclasses.replace(DeviceInfo.for_arch("sm_90", sm_count=132), name="NVIDIA H100 80GB HBM3", ordinal=0,
                               memory_bytes=80 << 30)
    cfg = {"kind": "sm90", "bm": 128, "bn": 256, "stages": 4, "consumers": 2, "splits": 1, "group_m": 8,
           "pingpong": False, "cluster": False}
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    h200 = [{"arch": "sm_90", "sm_count": 132, "device_class": "h200", "config": cfg,
             "shape": {"dtype": "bf16", "layout": layout, "m": m, "n": 4096, "k": 4096}}
            for layout in ("nn", "tn") for m in (16, 4096)]
    table = {"format": 2, "op": "gemm", "key_fields": ["dtype", "layout", "m", "n", "k"], "rows": h200}
    (shipped / "gemm.json").write_text(json.dumps(table))
    monkeypatch.setattr(tuning, "SHIPPED_DIR", shipped)
    tuner = tuning.get_tuner("gemm")
    monkeypatch.setattr(tuner, "measure", lambda req, c: 1e-3 if c == cfg else 2e-3)
    monkeypatch.setattr(tune_cmd, "live_device", lambda ordinal, command: live)

    def tune(shapes):
        args = build_parser().parse_args(["tune", "gemm", "--shapes", shapes, "--opt", "trans_b=0"])
        assert args.func(args) == 0
        return capsys.readouterr().err

    def explain():
        args = build_parser().parse_args(["explain", "gemm", "--shape", "16x4096x4096", "--opt", "trans_b=0", "--arch",
                                          "sm_90", "--sm-count", "132", "--device-class", "h100-sxm", "--first"])
        args.func(args)
        return capsys.readouterr().out

    with config.override(tuning_table_dir=tmp_path / "user"):
        assert "note:" not in tune("4096x4096x4096")  # 256x away from m=16: the H200's exact row still serves
        err = tune("32x4096x4096")  # a factor 2 away: the H100's row answers first
        assert "note: 1 gemm row(s) of other device classes" in err and "layout=nn m=16 n=4096 k=4096" in err
        assert "layout=tn" not in err  # no H100 row of the tn layout: the H200's tn rows still serve
        # explain says so where it happens: the H100's nearest row answers before the H200's exact one
        assert "nearest row" in explain() and "class h200 has an exact row of this shape" in explain()
        assert "note:" not in tune("16x4096x4096")
        rtckern.clear_caches()  # as a new process would: the candidates' configs memoized above go
        assert "exact row" in explain() and "has an exact row of this shape" not in explain()


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "8192x4096,1024x4096", "--list-configs", "--arch", "sm_90"],
     "rtckern tune: --shapes gives 1 row key(s) more than once: 8192x4096, 1024x4096 all give the row dir=fwd "
     "dtype=bf16 n=4096 norm=rms; rms_norm's rows are keyed by dir, norm, dtype, n: tune one shape per row"),
    (["--shapes", "8192x4096", "--list-configs", "--sm-count", "114"],
     "rtckern tune: --sm-count / --device-class describe a device together with --arch"),
    (["--shapes", "8192x4096", "--list-configs"],
     "rtckern tune: needs a device to list configs for; --device 0 asked, but no GPU is visible (no driver or no "
     "device). For a device that is not here, `rtckern tune ... --list-configs --arch sm_90` lists them without one."),
])
def test_what_a_run_would_refuse_late_or_ignore_is_refused_first(argv, message, capsys, monkeypatch):
    """Shapes that give one row key (refused after timing every config before), --sm-count / --device-class
    without --arch (ignored before), and --list-configs without a GPU or --arch (which pointed at explain): one
    line, exit 2, before any timing."""
    from rtckern import device
    from rtckern.cli import build_parser

    monkeypatch.setattr(device, "device_count", lambda: 0)
    args = build_parser().parse_args(["tune", "rms_norm", *argv])
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err, err
