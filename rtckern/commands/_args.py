"""Argument types of the subcommands: numbers in ASCII digits within their range and sizes with unit suffixes,
refused by argparse as one line naming the value and what is accepted."""
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


def size(text: str) -> int:
    """Bytes: plain (``1073741824``) or with a 1024-based suffix (``512M``, ``1G``, ``1GiB``, ``2T``), the syntax
    of the RTCKERN_*_BYTES variables."""
    from ..config import parse_size

    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; give bytes or a number with a K/M/G/T suffix "
                                         "(1024-based; KiB and KB read the same), e.g. 1G or 512M") from None


def positive_size(text: str) -> int:
    n = size(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is 0 bytes; give a size of at least 1 byte, e.g. 256M")
    return n
