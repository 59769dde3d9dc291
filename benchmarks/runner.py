"""The one benchmark runner.

    python -m benchmarks --list
    python -m benchmarks FAMILY [--check] [--quick] [--out DIR] [the suite's own options]
    python -m benchmarks FAMILY --help
    python -m benchmarks FAMILY --render DIR/<family>_<gpu>.json [--out DIR2]

A suite is a module of this package (one per family in SUITES) with `add_args(parser)` for its own options,
`run(args) -> Result | None` and `render(payload) -> Result` (the Result of a result set's stored JSON: its rows and
data, body and plot built from them and nothing else); optional `CHECK` / `QUICK` (help texts: the suite offers
--check / --quick) and `needs_gpu(args)` (False for a mode that runs on the CPU). The runner does the common parts
once: it refuses a GPU run where no GPU is visible (one line, exit 2), runs the suite, and writes the result set

    DIR/<family>_<gpu>.json, .md, .png     (<gpu>: h100, h200; a multi-GPU suite: 2xh200)
    DIR/<family>.json, .md, .png           (a run that needs no GPU)

with the environment (benchmarks/env.py: date, commit, GPU, driver, versions) at the top of the markdown and
under "meta" in the JSON beside the rows. DIR: --out, else $OUT, else benchmarks/results. The PNG is drawn where
the suite gives a plot and matplotlib is installed (else one line says so); the runner stamps the environment
(date, GPU, driver, versions) under the suite's figure.

--render re-writes a result set from its JSON without a GPU and without measuring: the suite's render() rebuilds
the markdown and the plot from the stored rows, under the environment the JSON recorded (date, GPU, versions of
the measuring run). The files keep the JSON's name (beside it, or in --out); the JSON itself is written back in the
runner's form (unchanged where it already was; a set from before the runner gets its recorded environment as
"meta").
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import shlex
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

HERE = Path(__file__).resolve().parent

# family -> where it runs: "gpu" (one GPU; some suites have CPU modes, see --help), "gpus" (every visible GPU, one
# process each), "cpu" (no GPU involved)
SUITES = {
    "attention": "gpu",
    "attention_backward": "gpu",
    "attention_varlen": "gpu",
    "attention_kvcache": "gpu",
    "norms": "gpu",
    "softmax": "gpu",
    "gemm": "gpu",
    "gemm_skinny": "gpu",
    "gemm_fp8": "gpu",
    "grouped_gemm": "gpu",
    "rope": "gpu",
    "swiglu": "gpu",
    "cross_entropy": "gpu",
    "plugin": "gpu",
    "core": "gpu",
    "multi_gpu": "gpus",
    "op_overhead": "gpu",
    "first_call": "gpu",
    "cache_trust": "cpu",
    "fleet": "cpu",
    "prefill": "cpu",
}


@dataclass
class Table:
    """One markdown table: column names and rows of cells (None renders as '-'), an optional '## title' above."""
    columns: Sequence[str]
    rows: Sequence[Sequence[object]]
    title: str | None = None

    def markdown(self) -> str:
        def cell(v) -> str:
            return "-" if v is None else str(v).replace("|", "\\|").replace("\n", " ")

        out = [f"## {self.title}", ""] if self.title else []
        out.append("| " + " | ".join(str(c) for c in self.columns) + " |")
        out.append("|" + "---|" * len(self.columns))
        out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in self.rows]
        return "\n".join(out)


@dataclass
class Result:
    """What a suite measured. rows: one dict per measurement (the JSON's "rows"); body: the markdown after the
    metadata lines, in order (paragraphs and Tables); data: more JSON beside the rows; plot(plt, meta) -> Figure:
    the suite's figure (meta: the run's environment, for a title; the runner stamps the environment under it and
    saves it); rc: the exit status (e.g. 1 where a timed output failed its check); meta: the environment of an
    earlier run (re-rendering one); gpus: GPUs a multi-GPU suite used (its file tag)."""
    title: str
    rows: list = field(default_factory=list)
    body: list = field(default_factory=list)
    data: dict = field(default_factory=dict)
    plot: Callable | None = None
    rc: int = 0
    meta: dict | None = None
    gpus: int | None = None


RESERVED = ("family", "title", "meta", "rows")  # the runner's keys of a result JSON; the rest is the suite's data


def stored_data(payload: dict) -> dict:
    """A result JSON's data: everything beside the runner's own keys."""
    return {k: v for k, v in payload.items() if k not in RESERVED}


def recorded_args(payload: dict) -> argparse.Namespace:
    """The suite options of the run that measured a result set, parsed from the command it recorded (a setting that
    shaped the report, e.g. --reps, is read back from there rather than stored twice)."""
    family = payload["family"]
    argv = shlex.split((payload.get("meta") or {}).get("command") or "")[4:]  # after `python -m benchmarks FAMILY`
    args = make_parser(family, importlib.import_module(f"benchmarks.{family}")).parse_args(argv)
    args.quick = getattr(args, "quick", False)
    args.check = getattr(args, "check", False)
    return args


def gpu_name(meta: dict) -> str:
    """The GPU a result set ran on, for a plot's title ("CPU only" for a run without one)."""
    if not meta.get("gpu_used", True):
        return "CPU only"
    return (meta.get("gpu") or {}).get("name") or "GPU not recorded"


def say(family: str, message: str) -> None:
    print(f"benchmarks {family}: {message}", file=sys.stderr, flush=True)


def describe_suite(family: str) -> str:
    """The first line of a suite's docstring, read without importing it (no torch, no GPU)."""
    try:
        doc = ast.get_docstring(ast.parse((HERE / f"{family}.py").read_text(encoding="utf-8"))) or ""
    except (OSError, SyntaxError):
        return ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def default_out() -> Path:
    return Path(os.environ.get("OUT") or HERE / "results")


def make_parser(family: str, suite) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks {family}", description=suite.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common = ap.add_argument_group("runner options")
    common.add_argument("--out", type=Path, default=None,
                        help="folder for the result files (default: $OUT, else benchmarks/results)")
    if getattr(suite, "CHECK", None):
        common.add_argument("--check", action="store_true", help=suite.CHECK)
    if getattr(suite, "QUICK", None):
        common.add_argument("--quick", action="store_true", help=suite.QUICK)
    if hasattr(suite, "render"):
        common.add_argument("--render", type=Path, default=None, metavar="JSON",
                            help="re-write the markdown and PNG of this result JSON from its stored rows (no GPU, "
                                 "nothing measured; the files go beside it unless --out says otherwise)")
    if hasattr(suite, "add_args"):
        suite.add_args(ap.add_argument_group(f"{family} options"))
    return ap


def needs_gpu(family: str, suite, args) -> bool:
    if SUITES[family] == "cpu":
        return False
    check = getattr(suite, "needs_gpu", None)
    return True if check is None else bool(check(args))


def command_line(family: str, argv: Sequence[str]) -> str:
    """The command that reproduces the run (without --out, which names a folder of this machine)."""
    keep, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            keep.append(a)
    return " ".join(["python -m benchmarks", family, *keep])


class Writer:
    """Writes a suite's result set; the environment is taken once, at the first write."""

    def __init__(self, family: str, out: Path, gpu_run: bool, command: str, started: str, t0: float,
                 stem: str | None = None):
        self.family, self.out, self.gpu_run, self.command = family, out, gpu_run, command
        self.started, self.t0 = started, t0
        self.fixed_stem = stem  # a re-rendered set keeps its file name
        self.meta: dict | None = None

    def stem(self, result: Result, meta: dict) -> str:
        if self.fixed_stem:
            return self.fixed_stem
        if not meta.get("gpu_used", self.gpu_run):  # (an earlier run's meta says where that run ran)
            return self.family
        from benchmarks.env import gpu_tag

        gpu = meta.get("gpu") or {}
        tag = gpu_tag(gpu.get("name"))
        if SUITES[self.family] == "gpus":
            tag = f"{result.gpus or gpu.get('count') or 1}x{tag}"
        return f"{self.family}_{tag}"

    def __call__(self, result: Result, *, final: bool = True) -> list[Path]:
        from benchmarks.env import describe, environment

        if result.meta is not None:
            meta = result.meta
        else:
            if self.meta is None:
                self.meta = environment(self.started)
                self.meta.update(command=self.command, gpu_used=self.gpu_run)
            meta = dict(self.meta, seconds=round(time.perf_counter() - self.t0, 1))
        stem = self.stem(result, meta)
        clash = {"family", "title", "meta", "rows"} & set(result.data)
        if clash:
            raise ValueError(f"Result.data must not hold {sorted(clash)}")
        payload = {"family": self.family, "title": result.title, "meta": meta, "rows": result.rows, **result.data}
        md = [f"# {result.title}", "", *describe(meta, meta.get("command")), ""]
        for part in result.body:
            md += [part.markdown() if isinstance(part, Table) else str(part).rstrip("\n"), ""]
        self.out.mkdir(parents=True, exist_ok=True)
        paths = [self.out / f"{stem}.json", self.out / f"{stem}.md"]
        paths[0].write_text(json.dumps(payload, indent=1, default=str) + "\n")
        paths[1].write_text("\n".join(md).rstrip("\n") + "\n")
        if final and result.plot is not None:
            png = self.out / f"{stem}.png"
            if draw(result.plot, png, meta):
                paths.append(png)
        return paths


def stamp_text(meta: dict, width: int) -> str:
    """The environment lines of the markdown (date, GPU, driver, versions; not the command), wrapped to width."""
    from benchmarks.env import describe

    lines = [ln.removeprefix("- ") for ln in describe(meta)]
    return "\n".join(textwrap.fill(ln, width, subsequent_indent="    ") for ln in lines)


def draw(plot: Callable, path: Path, meta: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed ({path.name} not written)", flush=True)
        return False
    try:
        fig = plot(plt, meta)
        # under the figure, so that a PNG shown alone still says where and with what it was measured; the font
        # grows with a wide figure so the lines stay readable where the PNG is shown scaled down
        width_in = fig.get_figwidth()
        size = min(11.0, max(7.0, width_in * 0.45))
        fig.text(0.005, 0.0, stamp_text(meta, int(width_in * 72 / (0.62 * size))), fontsize=size, va="top",
                 ha="left", family="monospace", color="0.3")
        fig.savefig(path, dpi=110, bbox_inches="tight")
    except Exception as e:  # the JSON and markdown stand without the plot
        print(f"no plot: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} ({path.name} not written)",
              flush=True)
        return False
    finally:
        plt.close("all")
    return True


USAGE = """usage: python -m benchmarks FAMILY [--check] [--quick] [--out DIR] [suite options]
       python -m benchmarks FAMILY --render JSON [--out DIR]   (re-write a result set from its JSON, no GPU)
       python -m benchmarks FAMILY --help      (the suite's own options)
       python -m benchmarks --list             (the families)"""


def render_set(family: str, suite, path: Path, out: Path | None) -> int:
    """Re-writes the result set of a stored JSON (no GPU, nothing measured) under the environment it recorded."""
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        say(family, f"cannot read {path}: {type(e).__name__}: {e}")
        return 2
    if payload.get("family", family) != family:
        say(family, f"{path} is a result set of {payload['family']!r}, not of {family!r}")
        return 2
    try:
        result = suite.render(payload)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:  # a JSON of another shape
        say(family, f"{path} is not a result set this suite can read ({type(e).__name__}: {e})")
        return 2
    result.meta = result.meta or payload.get("meta")
    if not result.meta:
        say(family, f"{path} records no environment: nothing to render it under")
        return 2
    write = Writer(family, (out or path.parent).resolve(), False, "", "", 0.0, stem=path.stem)
    for p in write(result):
        print("wrote", p, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + "families: " + ", ".join(SUITES), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--list":
        if len(argv) > 1:
            print(f"benchmarks: --list takes no arguments (got {' '.join(argv[1:])})", file=sys.stderr)
            return 2
        for name, where in SUITES.items():
            print(f"{name:<12} {where:<4} {describe_suite(name)}")
        return 0
    family, rest = argv[0], argv[1:]
    if family not in SUITES:
        print(f"benchmarks: unknown family {family!r}; one of: {', '.join(SUITES)}", file=sys.stderr)
        return 2
    try:
        suite = importlib.import_module(f"benchmarks.{family}")
    except ImportError as e:
        say(family, f"cannot import the suite: {type(e).__name__}: {e}")
        return 2
    args = make_parser(family, suite).parse_args(rest)
    if getattr(args, "render", None) is not None:
        return render_set(family, suite, args.render, args.out)
    args.family = family
    args.check = getattr(args, "check", False)
    args.quick = getattr(args, "quick", False)
    gpu_run = needs_gpu(family, suite, args)
    if gpu_run:
        from benchmarks.env import gpu_count

        if gpu_count() == 0:
            say(family, "needs a CUDA GPU and none is visible (run it on a GPU machine, e.g. "
                        f"`bash tools/device_run.sh {family}`)")
            return 2
    args.out = (args.out or default_out()).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    from benchmarks.env import utc_now

    write = Writer(family, args.out, gpu_run, command_line(family, rest), utc_now(), time.perf_counter())
    args.partial = lambda result: write(result, final=False)  # a suite's report so far (a run cut short keeps it)
    result = suite.run(args)
    if result is None:  # a mode that writes no result set (profiles, tuning tables, sweeps)
        return 0
    paths = write(result)
    print(paths[1].read_text(), flush=True)
    for p in paths:
        print("wrote", p, flush=True)
    return result.rc
