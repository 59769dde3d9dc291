"""The repository holds the product: no session names, run logs, superseded results or one-off scripts.

benchmarks/results/ keeps one current file set per family and GPU (`<family>_<gpu>.{md,json,png}`, overwritten
per run); git history keeps the earlier runs, docs/performance.md the conclusions.
"""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A path that names a work session, a run, a before / after pair, a probe, a profile, a date, a log or a dump.
SESSION_OR_RUN = re.compile(r"session|run\d|_run_|_final|_before|_after|probe|profile|notes|\d{4}-\d\d-\d\d"
                            r"|\.log$|\.txt$|\.csv|\.gz$|\.tgz$", re.IGNORECASE)
RESULT_NAME = re.compile(r"[a-z0-9]+(_[a-z0-9]+)*\.(md|json|png)")


def tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    return [p for p in out.stdout.decode().split("\0") if p]


def test_no_tracked_path_under_benchmarks_or_tools_names_a_session_or_run():
    bad = [p for p in tracked() if p.startswith(("benchmarks/", "tools/")) and SESSION_OR_RUN.search(p)]
    assert not bad, f"session / run / log files belong in git history, not the tree: {bad}"


def test_results_hold_only_current_markdown_json_and_png():
    bad = [p for p in tracked() if p.startswith("benchmarks/results/")
           and ("/" in p[len("benchmarks/results/"):] or not RESULT_NAME.fullmatch(Path(p).name))]
    assert not bad, f"benchmarks/results/ holds <family>_<gpu>.{{md,json,png}} only: {bad}"


def test_no_scripts_folder():
    assert not any(p.startswith("scripts/") for p in tracked())
    assert not (ROOT / "scripts").exists()
