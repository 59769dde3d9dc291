"""`rtckern tune <norm op>` on the live GPU: every candidate config checked against float64 and timed, the rows
written into a fresh tuning dir name the command, and the next process serves them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("op,dtype,n,table", [("rms_norm", "bf16", 4096, "norm_fwd"),
                                              ("layer_norm_backward", "fp32", 16384, "norm_bwd")])
def test_tune_a_norm_shape(tmp_path, op, dtype, n, table):
    tdir = tmp_path / "tuning"
    env = dict(os.environ, PYTHONPATH=str(REPO), RTCKERN_CACHE_DIR=str(tmp_path / "cache"),
               RTCKERN_TUNING_DIR=str(tdir))
    out = subprocess.run([sys.executable, "-m", "rtckern.cli", "tune", op, "--dtype", dtype, "--shapes", str(n),
                          "--json"], env=env, capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    trials = report["shapes"][0]["trials"]
    failed = [t for t in trials if t["us"] is None]
    assert len(trials) >= 10 and len(failed) <= len(trials) // 10, failed[:5]
    source = f"rtckern tune {op} --dtype {dtype} --shapes {n}"
    cfg_rows = json.loads((tdir / f"{table}.json").read_text())["rows"]
    kind_rows = json.loads((tdir / "norm_kind.json").read_text())["rows"]
    assert cfg_rows and all(r["source"] == source and r["time_us"] > 0 for r in cfg_rows)
    assert len(kind_rows) == 1 and kind_rows[0]["source"] == source
    kind = kind_rows[0]["config"]["kind"]
    assert kind in {r["shape"]["kind"] for r in cfg_rows}
    code = ("import rtckern.ops; from rtckern.registry import build_request, select; "
            f"print(select(build_request({op!r}, shape=({n},), dtype={dtype!r}, device=0)).candidate.name)")
    chosen = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    assert chosen.stdout.strip() == f"{op}.{kind}"
