"""`rtckern info`: every cache tier (disk, read-only layers, the remote tier with a short PING), hiprtc, and the
effective settings; sizes for people. Real processes, no GPU."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rtckern.cache import DiskCache
from rtckern.compiler.base import CompiledKernel

REPO = Path(__file__).resolve().parents[3]


def info(cache: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("RTCKERN_")}
    return subprocess.run([sys.executable, "-m", "rtckern", "info", *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=dict(e, PYTHONPATH=str(REPO), RTCKERN_CACHE_DIR=str(cache), **env))


def fill(root: Path, n: int) -> None:
    d = DiskCache(root)
    for i in range(n):
        d.put(hashlib.sha256(f"{root}{i}".encode()).hexdigest(), CompiledKernel(bytes(3000), "cubin", "k"),
              {"op": "x", "arch": "sm_90"})


def test_tiers_hiprtc_and_settings(tmp_path):
    fill(tmp_path / "c", 2)
    fill(tmp_path / "layer", 3)
    layers = os.pathsep.join([str(tmp_path / "layer"), str(tmp_path / "gone")])
    t0 = time.monotonic()
    r = info(tmp_path / "c", "--json", RTCKERN_CACHE_LAYERS=layers, RTCKERN_REMOTE_CACHE="redis://u:pw@127.0.0.1:1/0",
             RTCKERN_REMOTE_TIMEOUT_S="0.3")
    assert r.returncode == 0 and time.monotonic() - t0 < 60, r.stderr
    out = json.loads(r.stdout)
    c = out["cache"]
    assert (c["exists"], c["entries"], c["writable"]) == (True, 2, True)
    assert [(x["dir"], x["exists"], x["entries"]) for x in c["layers"]] == [
        (str(tmp_path / "layer"), True, 3), (str(tmp_path / "gone"), False, 0)]
    assert c["remote"] == "redis://127.0.0.1:1/0" and c["remote_status"]["reachable"] is False
    assert "refused" in c["remote_status"]["error"].lower()
    assert isinstance(out["hiprtc"]["available"], bool)
    settings = {s["env"]: s for s in out["settings"]}
    assert settings["RTCKERN_CACHE_DIR"] == {"name": "cache_dir", "env": "RTCKERN_CACHE_DIR",
                                             "value": str(tmp_path / "c"), "set": True}
    assert settings["RTCKERN_REMOTE_CACHE"]["value"] == "redis://u:***@127.0.0.1:1/0" and "pw@" not in r.stdout
    assert settings["RTCKERN_STRICT"]["set"] is False


def test_text_sizes_and_sections(tmp_path):
    fill(tmp_path, 2)
    out = info(tmp_path).stdout
    assert f"disk cache: {tmp_path}  (2 entries, " in out and " KiB)" in out
    assert "read-only layers: none" in out and "remote tier: none" in out
    assert "hiprtc" in out and "settings (* = set in the environment):" in out
    assert any(line.split()[:2] == ["*", "RTCKERN_CACHE_DIR"] for line in out.splitlines())
