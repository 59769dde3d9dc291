"""Persisted probe outcomes, so a later process neither re-probes nor retries a known failure.

One JSON file per (request without device ordinal, probe mode, toolchain), under `<cache dir>/decisions/<op>/`.
It holds, per candidate, the cache keys of the kernels it was probed with and the outcome of the costly stages
(compile, load, resources, numeric). An outcome is reused only while the candidate's kernels still have those
cache keys, so an edited source, a new compiler or new options probe again. The cheap stages (arch range,
supports) always run in-process: they are code, and code may change between versions.

A rejection is reused whatever its stage, a numerical-probe failure included: a candidate that computed a wrong
result with these exact kernels stays out even when the numerical probe is later switched off (clear_decisions()
forgets). An acceptance is reused only if it passed every check the current mode asks for.

Writes go to a temp file, fsync, os.replace; a file that does not parse is a miss, reported once.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from rtckern.registry.results import ProbeResult, Reason

log = logging.getLogger(__name__)

FORMAT = 1
# Process-wide: a bad file is reported once, and in-process writers of one file merge in turn.
_lock = threading.RLock()  # save() holds it while load() may report a bad file
_reported: set[Path] = set()


class DecisionStore:
    def __init__(self, root: str | os.PathLike[str] | None) -> None:
        # root None: persistence off (decisions live in memory only).
        self.root = Path(root) if root is not None else None

    def path(self, op: str, request_digest: str, mode: str, toolchain: dict[str, Any]) -> Path | None:
        if self.root is None:
            return None
        text = json.dumps({"request": request_digest, "mode": mode, "toolchain": toolchain}, sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()[:40]
        return self.root / _safe(op) / f"{digest}.json"

    def load(self, path: Path | None) -> dict[str, dict[str, Any]]:
        """Candidate name -> stored entry; {} when missing or unreadable."""
        if path is None:
            return {}
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT or not isinstance(data.get("candidates"), dict):
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
            return data["candidates"]
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, AttributeError) as exc:
            with _lock:
                if path not in _reported:
                    _reported.add(path)
                    log.warning("rtckern: ignoring unreadable probe decision file %s (%s); probing again", path, exc)
            return {}

    def save(self, path: Path | None, header: dict[str, Any], results: list[ProbeResult]) -> None:
        """Merge the costly-stage outcomes of `results` into the file (other candidates' entries are kept)."""
        if path is None:
            return
        entries = {r.name: to_entry(r) for r in results if r.probed and not r.from_store and _costly(r)}
        if not entries:
            return
        with _lock:  # in-process writers merge in turn; across processes the last writer wins, which
            # only costs a later process one more probe of the lost entry.
            merged = dict(self.load(path))
            merged.update(entries)
            data = dict(header, format=FORMAT, candidates=merged)
            try:
                _atomic_write(path, json.dumps(data, indent=1, sort_keys=True))
            except OSError as exc:  # an unwritable cache dir: decisions stay in memory (the disk tier says the same)
                if path not in _reported:
                    _reported.add(path)
                    log.warning("rtckern: cannot save probe decisions to %s (%s); they are kept in memory only",
                                path, exc)


def decisions_dir() -> Path:
    """Where select() persists decisions by default: `<cache dir>/decisions`."""
    from rtckern import config

    return config.settings().cache_dir / "decisions"


def clear_decisions(root: str | os.PathLike[str] | None = None) -> int:
    """Delete persisted decisions (every op's); returns how many files went. The next select() per request
    probes again. In-memory decisions of a running process are not touched (Registry.reset())."""
    base = Path(root) if root is not None else decisions_dir()
    n = 0
    if base.is_dir():
        for p in base.rglob("*.json"):
            with _lock:
                try:
                    p.unlink()
                    n += 1
                except OSError:
                    pass
    return n


def _costly(r: ProbeResult) -> bool:
    """Outcomes worth persisting: accepted ones, and rejections at a stage after the cheap checks."""
    return bool(r.cache_keys) and (r.accepted or any(x.stage in ("compile", "load", "resources", "numeric")
                                                     for x in r.reasons))


def to_entry(r: ProbeResult) -> dict[str, Any]:
    return {"cache_keys": list(r.cache_keys), "accepted": r.accepted, "checks": list(r.checks),
            "reasons": [x.to_dict() for x in r.reasons]}


def entry_matches(entry: dict[str, Any] | None, cache_keys: tuple[str, ...], required: tuple[str, ...]) -> bool:
    """A stored entry is valid for these kernels when their keys are unchanged and it ran every required check
    (or it was a rejection: a failure at an earlier stage stays a failure)."""
    if not entry or tuple(entry.get("cache_keys", ())) != tuple(cache_keys):
        return False
    if not entry.get("accepted"):
        return True
    return set(required) <= set(entry.get("checks", ()))


def entry_reasons(entry: dict[str, Any]) -> tuple[Reason, ...]:
    return tuple(Reason.from_dict(d) for d in entry.get("reasons", ()))


def _safe(op: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in op)


def _atomic_write(path: Path, text: str) -> None:
    from rtckern.cache.disk import atomic_write  # temp file, fsync, rename: the cache's one implementation

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text.encode())
