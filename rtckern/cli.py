"""``rtckern`` command line: a dispatcher; each subcommand lives in ``rtckern/commands/<name>.py`` and exposes
``add_parser(subparsers)`` setting ``func(args) -> exit code``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in help order. A module that is missing (a family not installed) is skipped.
COMMANDS = ("info", "prefill", "cache", "explain", "tune", "selftest", "bench")


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line (what was wrong, where to read the options) and exit code 2; subcommand
    parsers are made of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="rtckern", description="Runtime JIT kernel service (NVRTC / hiprtc).")
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


def main(argv: list[str] | None = None) -> int:
    """Run one command; an RtckernError (bad configuration or input) is one line on stderr and exit code 2."""
    from .errors import RtckernError

    command = "rtckern"
    try:
        args = build_parser().parse_args(argv)
        command = f"rtckern {args.command}"
        from .config import settings

        settings()  # every variable checked before the command starts: a bad one is one line, whatever the command
        return int(args.func(args) or 0)
    except RtckernError as e:
        print(f"{command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
