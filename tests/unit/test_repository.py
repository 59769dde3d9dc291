"""The repository holds the product: no session names, run logs, superseded results or one-off scripts.

benchmarks/ holds one runner (`python -m benchmarks FAMILY`: runner.py, env.py), one suite per family and the
suites' `_`-prefixed helpers; benchmarks/results/ keeps one current file set per family and GPU
(`<family>_<gpu>.{md,json,png}`, `<family>.{md,json,png}` for a run without a GPU, overwritten per run); git
history keeps the earlier runs, docs/performance.md the conclusions.
"""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A path that names a work session, a run, a before / after pair, a probe, a profile, a date, a log or a dump.
SESSION_OR_RUN = re.compile(r"session|run\d|_run_|_final|_before|_after|probe|profile|notes|\d{4}-\d\d-\d\d"
                            r"|\.log$|\.txt$|\.csv|\.gz$|\.tgz$", re.IGNORECASE)
RESULT_NAME = re.compile(r"[a-z0-9]+(_[a-z0-9]+)*\.(md|json|png)")
GPU_TAG = re.compile(r"(\d+x)?[a-z0-9]+")  # h100, h200, 2xh200
RUNNER_FILES = {"__init__.py", "__main__.py", "runner.py", "env.py"}


def suites() -> dict[str, str]:
    """benchmarks/runner.py's SUITES (family -> where it runs), read without importing the runner."""
    tree = ast.parse((ROOT / "benchmarks" / "runner.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SUITES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("benchmarks/runner.py defines no SUITES")


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


def test_benchmarks_hold_the_runner_its_suites_and_their_helpers():
    families = suites()
    bad = [p for p in tracked() if p.startswith("benchmarks/") and p.endswith(".py") and p.count("/") == 1
           and not (Path(p).name in RUNNER_FILES or Path(p).stem in families or Path(p).name.startswith("_"))]
    assert not bad, f"a benchmark is a suite of the runner (benchmarks/runner.py SUITES) or a _helper of one: {bad}"
    assert not [p for p in tracked() if p.startswith("benchmarks/") and p.count("/") > 1
                and not p.startswith("benchmarks/results/")], "benchmarks/ has no subfolders besides results/"
    missing = [f for f in families if not (ROOT / "benchmarks" / f"{f}.py").is_file()]
    assert not missing, f"SUITES names families without a suite module: {missing}"


def test_every_result_file_belongs_to_a_family():
    families = suites()

    def owner(name: str) -> str | None:
        stem = name.rsplit(".", 1)[0]
        for f in families:
            if stem == f or (stem.startswith(f + "_") and GPU_TAG.fullmatch(stem[len(f) + 1:])):
                return f
        return None

    bad = [p for p in tracked() if p.startswith("benchmarks/results/") and owner(Path(p).name) is None]
    assert not bad, f"results are <family>_<gpu>.* (<family>.* for a run without a GPU), family a suite: {bad}"


def test_every_result_set_is_complete():
    """Each result set is the JSON (the rows and the run's environment), its markdown and its plot; a set missing
    one was written by hand or half-deleted (`python -m benchmarks FAMILY --render JSON` rewrites the other two)."""
    sets: dict[str, set[str]] = {}
    for p in tracked():
        if p.startswith("benchmarks/results/"):
            stem, ext = Path(p).name.rsplit(".", 1)
            sets.setdefault(stem, set()).add(ext)
    bad = {stem: sorted(exts) for stem, exts in sets.items() if exts != {"json", "md", "png"}}
    assert not bad, f"result sets missing files (have): {bad}"


def test_no_scripts_folder():
    assert not any(p.startswith("scripts/") for p in tracked())
    assert not (ROOT / "scripts").exists()
