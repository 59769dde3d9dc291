"""Argument types of the subcommands: numbers in ASCII digits within their range, refused by argparse as one
line naming the value and what is accepted."""
from __future__ import annotations

import argparse
import math
import re

_INT = re.compile(r"-?[0-9]+", re.ASCII)


def _int(text: str, minimum: int) -> int:
    t = text.strip()
    if not _INT.fullmatch(t) or int(t) < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {minimum}")
    return int(t)


def positive_int(text: str) -> int:
    return _int(text, 1)


def non_negative_int(text: str) -> int:
    return _int(text, 0)


def non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v >= 0) or not text.isascii():
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number >= 0")
    return v
