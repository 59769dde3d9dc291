"""The `rtckern` dispatcher: --version, help of every command, a closed stdout (`| head`) and Ctrl-C handling
shared by every command. Real `python -m rtckern` processes where the behaviour is about processes."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rtckern
from rtckern.cli import EXIT_BROKEN_PIPE, build_parser

REPO = Path(__file__).resolve().parents[2]


def env(cache: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), RTCKERN_CACHE_DIR=str(cache))


def test_version():
    r = subprocess.run([sys.executable, "-m", "rtckern", "--version"], capture_output=True, text=True,
                       env=env(REPO / "no-such-cache"), timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"rtckern {rtckern.__version__}", r.stdout + r.stderr


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:  # argparse has no public walk of subcommands
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _every_command() -> list[tuple[str, argparse.ArgumentParser]]:
    out = []
    for name, sp in _subparsers(build_parser()).items():
        out.append((name, sp))
        out += [(f"{name} {action}", ap) for action, ap in _subparsers(sp).items()]
    return out


@pytest.mark.parametrize("name, parser", _every_command(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_command_has_a_description_examples_and_help_on_each_option(name, parser):
    text = parser.format_help()
    assert parser.description and len(parser.description.split()) >= 8, name
    assert "examples:\n  rtckern " + name.split()[0] in text, text
    undocumented = [a.option_strings or a.dest for a in parser._actions
                    if a.help is None and not isinstance(a, argparse._SubParsersAction)]
    assert not undocumented, f"rtckern {name}: options without help: {undocumented}"


@pytest.mark.parametrize("argv", [["info"], ["explain", "--list"], ["cache", "ls"], ["ops"], ["--help"]])
def test_a_closed_stdout_is_no_traceback(tmp_path, argv):
    """The reader is gone before the command writes (what `| head -1` does to a long output)."""
    (tmp_path / "v1").mkdir()
    p = subprocess.Popen([sys.executable, "-m", "rtckern", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env(tmp_path))
    p.stdout.close()
    err = p.stderr.read().decode()
    code = p.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err and err == "", err
    assert code in (0, EXIT_BROKEN_PIPE)  # --help: argparse may finish writing into the pipe buffer first


def test_pipe_into_head(tmp_path):
    r = subprocess.run(f"{sys.executable} -m rtckern explain --list | head -1", shell=True, capture_output=True,
                       text=True, env=env(tmp_path), timeout=120)
    assert r.stdout.count("\n") == 1 and r.stderr == "", r.stderr
