"""Progress of long commands on stderr: a tqdm bar (rate, ETA, as wide as the terminal) on a terminal; off one
(CI logs, files) a plain line every ~10% of the work or every 30 s, so a log is never silent for minutes. The
count is kept even when nothing is shown: an interrupted command says how far it got."""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

LINE_STEPS = 10  # a line at every tenth of the total
LINE_EVERY_S = 30.0


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """``progress(result)`` counts one finished item; ``add_total(n)`` announces n more (work found in rounds,
    as manifest prefill's fallbacks); ``close()`` ends the display.

    label: what the work is ("prefill"); unit: what is counted ("kernel"); show: False keeps count silently.
    """

    def __init__(self, label: str, unit: str, total: int = 0, *, show: bool = True, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.label, self.unit, self.total, self.n = label, unit, total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.started = self._last_line = clock()
        self._next_step = 1  # the next tenth of the total that prints a line
        self._last_n = 0  # the count the last line showed
        self.bar = None
        self.show_lines = False
        if show:
            self.bar = self._tqdm() if self.stream.isatty() else None
            self.show_lines = self.bar is None

    def _tqdm(self):
        try:
            from tqdm import tqdm
        except ImportError:  # a dependency; without it, the plain lines
            return None
        return tqdm(total=self.total or None, desc=self.label, unit=self.unit, file=self.stream, dynamic_ncols=True,
                    leave=False)

    def add_total(self, n: int) -> None:
        self.total += n
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def __call__(self, result=None) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
            status = getattr(result, "status", None)
            if status:
                self.bar.set_postfix_str(status, refresh=False)
        elif self.show_lines:
            now = self.clock()
            reached = self.total and self.n * LINE_STEPS >= self._next_step * self.total
            if reached or now - self._last_line >= LINE_EVERY_S:
                self._line(now)

    def count(self) -> str:
        """``[n/total]``, or ``[n]`` while the total is unknown."""
        return f"[{self.n}/{self.total}]" if self.total else f"[{self.n}]"

    def _line(self, now: float) -> None:
        elapsed = now - self.started
        rate = self.n / elapsed if elapsed > 0 else 0.0
        text = f"{self.label}: {self.count()} {self.unit}s"
        if self.total:
            text += f" ({100 * self.n // self.total}%)"
        text += f", {rate:.1f}/s, {_duration(elapsed)} elapsed"
        if self.total and rate > 0 and self.n < self.total:
            text += f", ETA {_duration((self.total - self.n) / rate)}"
        print(text, file=self.stream, flush=True)
        self._last_line, self._last_n = now, self.n
        if self.total:
            self._next_step = self.n * LINE_STEPS // self.total + 1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.show_lines and self.n != self._last_n:
            self._line(self.clock())  # where it ended, when the last line did not say it
        self.show_lines = False
