"""Helpers of the fleet tests: the registry's test candidates (op "axpy", tests/unit/registry_testkit.py) stand in
for an op family, and CLI runs import them with `--import registry_testkit_plugin`."""

import json
import os
import subprocess
import sys
from pathlib import Path

UNIT = Path(__file__).resolve().parents[1]
ROOT = UNIT.parents[1]
sys.path.insert(0, str(UNIT))

import registry_testkit as kit  # noqa: E402

# Requests with a known outcome (see registry_testkit's docstring): on sm_80 and sm_90.
LINES = [
    {"op": "axpy", "dtype": "bf16", "shape": [1048576]},             # persistent (sm_80), hopper (sm_90a)
    {"op": "axpy", "dtype": "fp32", "shape": [1000]},                # wide (sm_80), bigsmem (sm_90)
    {"op": "axpy", "dtype": "fp16", "shape": [4098], "aligned": 0},  # fallback
    {"op": "axpy", "dtype": "fp16", "shape": [4096], "aligned": True},  # wide
]


def write_manifest(path: Path, lines) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def cli(*args, cache=None, env=None, check=True, timeout=300):
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(UNIT), str(ROOT), e.get("PYTHONPATH", "")])
    if cache is not None:
        e["RTCKERN_CACHE_DIR"] = str(cache)
    e.update(env or {})
    r = subprocess.run([sys.executable, "-m", "rtckern", *args], capture_output=True, text=True, env=e,
                       timeout=timeout, cwd=ROOT)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def prefill_json(*args, **kw):
    r = cli("prefill", "--import", "registry_testkit_plugin", "--json", *args, **kw)
    return json.loads(r.stdout), r
