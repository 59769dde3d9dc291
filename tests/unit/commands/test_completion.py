"""`rtckern completion bash`: a script bash accepts, completing commands, cache actions, options and op names."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completion(tmp_path):
    script = tmp_path / "rtckern.bash"
    r = subprocess.run([sys.executable, "-m", "rtckern", "completion", "bash"], capture_output=True, text=True,
                       timeout=300, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr
    script.write_text(r.stdout)
    probe = f"""source {script}
t() {{ COMP_WORDS=("$@"); COMP_CWORD=$((${{#COMP_WORDS[@]}}-1)); _rtckern; echo "${{COMPREPLY[*]}}"; }}
t rtckern ca; t rtckern cache l; t rtckern cache prune --max; t rtckern explain rms_norm_b
t rtckern tune softmax_ring_m; t rtckern --vers"""
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.splitlines() == ["cache", "ls", "--max-bytes", "rms_norm_backward", "softmax_ring_masked",
                                       "--version"]
