"""Request-builder options: the strict parsing every op family's builder shares.

Options reach a builder as the text of ``--opt KEY=VALUE`` or of a manifest field (booleans as ``1``/``0``), or
as Python values from ``explain(..., options=...)``. A builder names the keys it takes (an unknown key is an
error, not a no-op: ``residul=1`` must not pass as a residual-free request), and reads each with these helpers,
which accept one spelling per meaning and refuse the rest with a line naming the value and what is accepted.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from rtckern.config import FALSE_WORDS as FALSE
from rtckern.config import TRUE_WORDS as TRUE
from rtckern.errors import OptionError

BOOL_WORDS = "1/0, true/false, yes/no or on/off"
_ASCII_INT = re.compile(r"-?[0-9]+", re.ASCII)


def check_keys(op: str, options: Mapping[str, Any], allowed: Iterable[str]) -> None:
    """Refuse option keys the builder of ``op`` does not take (a typo would otherwise be ignored)."""
    allowed = list(allowed)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise OptionError(f"op {op!r} takes no option(s) {unknown}; its options: {allowed or 'none'}")


def parse_bool(op: str, name: str, value: Any) -> bool:
    """``1/0, true/false, yes/no, on/off`` (any case), or a Python bool; anything else is an error."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower() if isinstance(value, str) else None
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise OptionError(f"{op}: option {name}={value!r} is not a boolean; write {BOOL_WORDS}")


def flag(op: str, options: Mapping[str, Any], name: str, default: bool) -> bool:
    return default if options.get(name) is None else parse_bool(op, name, options[name])


def parse_int(op: str, name: str, value: Any, *, minimum: int = 1) -> int:
    """An integer in ASCII digits (no '_', no other script's digits), at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise OptionError(f"{op}: option {name}={value!r} is not an integer; write a whole number >= {minimum}")
    if isinstance(value, str):
        text = value.strip()
        if not _ASCII_INT.fullmatch(text):
            raise OptionError(f"{op}: option {name}={value!r} is not an integer; write a whole number >= "
                              f"{minimum} in ASCII digits")
        value = int(text)
    if value < minimum:
        raise OptionError(f"{op}: option {name}={value} is below {minimum}; write a whole number >= {minimum}")
    return value


def parse_vec(op: str, options: Mapping[str, Any], n: int, elem_bytes: int, default: int) -> int:
    """``vec`` (elements per access): a power of two that divides the row length N and moves at most 16 bytes."""
    if options.get("vec") is None:
        return default
    widest = max(1, 16 // elem_bytes)
    vec = parse_int(op, "vec", options["vec"])
    if vec & (vec - 1) or vec > widest or n % vec:
        raise OptionError(f"{op}: option vec={vec} does not fit; vec is a power of two from 1 to {widest} "
                          f"(16 bytes per access at most) that divides N={n}; the default is {default}")
    return vec


def parse_choice(op: str, name: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise OptionError(f"{op}: option {name}={value!r} is not one of {', '.join(choices)}")
    return value
