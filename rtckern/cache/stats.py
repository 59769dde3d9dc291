"""Per-tier counters."""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass
class TierStats:
    """Counters of one cache tier."""
    hits: int = 0
    misses: int = 0
    writes: int = 0
    invalid: int = 0  # missing pieces, truncated, corrupt: treated as misses
    quarantined: int = 0
    errors: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class Stats:
    """Counters for every tier plus compiles, safe to bump from several threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self.tiers: dict[str, TierStats] = {}
        self.compiles = 0
        self.compile_ms = 0.0
        self.loads = 0

    def bump(self, tier: str, field: str, n: int = 1) -> None:
        with self._lock:
            t = self.tiers.setdefault(tier, TierStats())
            setattr(t, field, getattr(t, field) + n)

    def compiled(self, ms: float) -> None:
        with self._lock:
            self.compiles += 1
            self.compile_ms += ms

    def as_dict(self) -> dict:
        with self._lock:
            return {"tiers": {k: v.as_dict() for k, v in self.tiers.items()}, "compiles": self.compiles,
                    "compile_ms": round(self.compile_ms, 3), "loads": self.loads}
