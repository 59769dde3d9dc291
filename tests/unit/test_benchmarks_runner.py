"""The benchmark runner (`python -m benchmarks`) on the CPU: the family list, the CPU-only suites end to end through
the runner into a temporary folder (their quickest settings: files, metadata, rows), a GPU suite refused in one line
where no GPU is visible, and the runner's naming of result files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the benchmarks package lives beside rtckern, not inside it
    sys.path.insert(0, str(ROOT))

from benchmarks import runner  # noqa: E402
from benchmarks.env import gpu_count, gpu_tag  # noqa: E402


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    env.pop("OUT", None)
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_list_names_every_family_with_where_it_runs_and_what_it_measures():
    r = bench("--list")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == list(runner.SUITES)
    for ln in lines:
        name, where, *description = ln.split()
        assert where == runner.SUITES[name] and description, ln


def check_result_set(out: Path, family: str, title: str, command: str) -> dict:
    assert sorted(p.name for p in out.iterdir()) == [f"{family}.json", f"{family}.md"]  # no GPU: no tag, no plot
    doc = json.loads((out / f"{family}.json").read_text())
    assert doc["family"] == family and doc["title"] == title and doc["rows"]
    meta = doc["meta"]
    for key in ("date", "commit", "python", "packages", "nvrtc", "driver", "gpu"):
        assert key in meta, key
    assert meta["command"] == command and meta["gpu_used"] is False
    md = (out / f"{family}.md").read_text().splitlines()
    assert md[0] == f"# {title}"
    assert [ln.split(":")[0] for ln in md[2:6]] == ["- date", "- GPU", "- versions", "- command"]
    assert md[3].startswith("- GPU: none used") and f"`{command}`" in md[5]
    assert any(ln.startswith("| ") for ln in md[6:]), "the tables follow the metadata"
    return doc


def test_cache_trust_through_the_runner(tmp_path):
    r = bench("cache_trust", "--quick", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = check_result_set(tmp_path, "cache_trust", "Cache trust", "python -m benchmarks cache_trust --quick")
    assert {row["server"] for row in doc["rows"]} == {"trickle", "blackhole", "huge", "garbage", "no-accept"}
    assert doc["race_processes"][0]["processes"] == 2 and doc["race_processes"][0]["compiles_per_key"] == 1.0
    assert doc["damaged"]["all_found"]


def test_fleet_through_the_runner(tmp_path):
    r = bench("fleet", "--quick", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = check_result_set(tmp_path, "fleet", "Fleet: prefill, bundles and warm starts",
                           "python -m benchmarks fleet --quick")
    (row,) = doc["rows"]
    assert row["preset"] == "quick" and row["prefill_j1"]["served"] == 1 and list(row["per_arch"]) == ["9.0a"]
    assert row["warm_start_sm90"]["local disk"]["compiles"] == 0
    assert doc["setup"]["archs"] == "9.0a"


def test_prefill_through_the_runner(tmp_path):
    r = bench("prefill", "--quick", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = check_result_set(tmp_path, "prefill", "rtckern prefill: the built-in kernel set, cold and warm, in "
                           "CPU-seconds", "python -m benchmarks prefill --quick")
    cold, warm = doc["rows"]
    assert cold["kernels"] == warm["kernels"] > 0 and cold["archs"] == "9.0" and cold["cpu_s"] > 0
    assert doc["command_measured"] == "rtckern prefill --arch 9.0 --family core"


@pytest.mark.skipif(gpu_count() > 0, reason="a GPU is visible here")
def test_a_gpu_suite_without_a_gpu_is_refused_in_one_line(tmp_path):
    r = bench("norms", "--out", str(tmp_path))
    assert r.returncode == 2
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("benchmarks norms: needs a CUDA GPU and none is visible")
    assert not list(tmp_path.iterdir())


def test_unknown_family_and_options_are_refused():
    r = bench("nosuch")
    assert r.returncode == 2 and r.stderr.startswith("benchmarks: unknown family 'nosuch'")
    r = bench("cache_trust", "--check")  # cache_trust offers no --check: argparse refuses it
    assert r.returncode == 2 and "unrecognized arguments: --check" in r.stderr
    assert bench("norms", "--help").returncode == 0  # --help needs no GPU


def test_gpu_tags_are_the_device_drivers():
    assert gpu_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_tag("NVIDIA H200") == "h200"
    assert gpu_tag(None) == "gpu"


def test_result_files_are_named_by_family_and_gpu(tmp_path):
    meta = {"date": "2026-01-01T00:00:00Z", "gpu": {"name": "NVIDIA H200", "count": 8}, "gpu_used": True}
    res = runner.Result("T", rows=[{"a": 1}], body=["text", runner.Table(("a", "b"), [(1, None)], title="t")], meta=meta)
    w = runner.Writer("norms", tmp_path, True, "python -m benchmarks norms", "2026-01-01T00:00:00Z", 0.0)
    paths = w(res)
    assert [p.name for p in paths] == ["norms_h200.json", "norms_h200.md"]  # no plot given: no PNG
    md = paths[1].read_text()
    assert "| a | b |\n|---|---|\n| 1 | - |" in md and "## t" in md and "\ntext\n" in md
    multi = runner.Writer("multi_gpu", tmp_path, True, "", "", 0.0)
    assert multi.stem(runner.Result("M", gpus=2), meta) == "multi_gpu_2xh200"
    assert runner.Writer("fleet", tmp_path, False, "", "", 0.0).stem(res, {}) == "fleet"


def test_out_defaults_to_OUT_else_the_results_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert runner.default_out() == tmp_path
    monkeypatch.delenv("OUT")
    assert runner.default_out() == ROOT / "benchmarks" / "results"
    assert runner.command_line("gemm", ["--out", "/x", "--quick", "--out=/y"]) == "python -m benchmarks gemm --quick"
