"""``rtckern`` command line: a dispatcher; each subcommand lives in ``rtckern/commands/<name>.py`` and exposes
``add_parser(subparsers)`` setting ``func(args) -> exit code``.

Exit codes: 0 success; 1 the command ran and found problems (failed kernels, corrupt entries); 2 bad input or
configuration (one line on stderr); 130 interrupted (Ctrl-C); 141 stdout closed early (``rtckern cache ls | head``),
as a process killed by SIGPIPE would report.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Subcommand modules, in help order. A module that is missing (a family not installed) is skipped.
COMMANDS = ("info", "ops", "prefill", "cache", "explain", "tune", "selftest", "bench", "completion")
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE

DESCRIPTION = """\
Runtime JIT kernel service (NVRTC / hiprtc): compile CUDA kernels at first use, cache them in memory, on disk,
in read-only layers and in a remote tier. The commands inspect the setup, prefill caches for fleets of
machines, maintain the disk cache and show or tune which implementation each op request gets.

`rtckern COMMAND --help` describes a command, with examples."""

EXAMPLES = """\
examples:
  rtckern info                                       versions, devices, caches, effective settings
  rtckern ops                                        every op: dtypes, limits, archs, candidates
  rtckern prefill --arch '8.0;9.0a' -j 8             compile the built-in kernel set for two archs
  rtckern cache ls --op rms_norm                     list cached kernels of one op
  rtckern explain rms_norm --shape 8192x4096 --arch sm_90"""


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line (what was wrong, where to read the options) and exit code 2; subcommand
    parsers are made of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .commands._help import HelpFormatter

    p = _Parser(prog="rtckern", description=DESCRIPTION, epilog=EXAMPLES, formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"rtckern {__version__}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"rtckern.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"rtckern.commands.{name}":
                continue
            raise
        mod.add_parser(sub)
    return p


def _stdout_closed() -> int:
    """The reader of stdout went away (``| head``): stop quietly. Further writes, including the interpreter's
    flush at exit, go to /dev/null so no second BrokenPipeError is printed."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


def main(argv: list[str] | None = None) -> int:
    """Run one command; an RtckernError (bad configuration or input) is one line on stderr and exit code 2."""
    from .errors import RtckernError

    command = "rtckern"
    try:
        args = build_parser().parse_args(argv)
        command = f"rtckern {args.command}"
        from .config import settings

        settings()  # every variable checked before the command starts: a bad one is one line, whatever the command
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        return code
    except RtckernError as e:
        print(f"{command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
