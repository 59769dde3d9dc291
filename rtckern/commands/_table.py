"""Plain-text output of the CLI (no dependency): tables and sizes."""

from __future__ import annotations

import re
from typing import Sequence

ELLIPSIS = "…"
_NUMBER_TEXT = re.compile(r"[-+]?[0-9][0-9.,]*(?: ?[A-Za-z%]{1,3})?")  # 12.5, 1,024, 1.50 MiB, 3 ms, 40%


def _is_number(cell: object) -> bool:
    if isinstance(cell, bool):
        return False
    return isinstance(cell, (int, float)) or (isinstance(cell, str) and bool(_NUMBER_TEXT.fullmatch(cell)))


def _numeric_column(cells: Sequence[object]) -> bool:
    filled = [c for c in cells if c not in ("", None)]
    return bool(filled) and all(_is_number(c) for c in filled)


def shorten(text: str, width: int | None) -> str:
    """``text`` if it fits in ``width`` (None: any width), else its start and end around an ellipsis: the end
    (template arguments, tile sizes) is what tells two long kernel names apart."""
    if width is None or len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + ELLIPSIS + text[len(text) - (width - 1 - head):]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *,
          numeric: Sequence[bool] | None = None) -> str:
    """Columns of text left-aligned, of numbers right-aligned (a column is numeric when every filled cell is a
    number or reads as one, such as ``1.50 MiB``; or as ``numeric`` says). Cells are shown whole: cut them with
    ``shorten`` first, which marks the cut."""
    if numeric is None:
        numeric = [_numeric_column([r[i] for r in rows]) for i in range(len(headers))]
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def human_bytes(n: int | None) -> str:
    """1024-based, three significant digits: 1.50 MiB, 212 KiB, 980 B."""
    if n is None:
        return "-"
    size, unit = float(n), "B"
    for u in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, u
    if unit == "B":
        return f"{n} B"
    return f"{size:.3g} {unit}" if size >= 100 else f"{size:.2f} {unit}" if size < 10 else f"{size:.1f} {unit}"
