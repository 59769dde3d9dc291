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
