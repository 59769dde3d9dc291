"""Cache-trust figures (issue 20). CPU only: no GPU needed.

``remote_deadlines()``: the longest call the remote tier made against each hostile fake server
(rtckern.testing.HostileRedis) under a given whole-call deadline, next to the bar (deadline + 10 %); for the
trickling server also how long redis-py with the same per-read timeout stays blocked (what the tier did before).

    python3 benchmarks/cache_trust.py [--deadline 0.5] [--calls 5]
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import tracemalloc
import warnings

from rtckern.cache import CacheWarning, pack
from rtckern.cache.remote import RedisCache
from rtckern.compiler.base import CompiledKernel
from rtckern.testing import HOSTILE_MODES, HostileRedis

_CK = CompiledKernel(binary=b"\x7fELF" + bytes(range(256)) * 16, kind="cubin", lowered_name="_Z1kv")


def _one_call(url: str, op: str, deadline_s: float) -> tuple[float, int, int]:
    """(seconds, CacheWarnings raised, peak bytes allocated) for one get or put on a fresh tier."""
    r = RedisCache(url, timeout_s=deadline_s, cooldown_s=0.0)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        tracemalloc.start()
        t0 = time.monotonic()
        try:
            out = r.get_packed("ab" * 32) if op == "get" else r.put_packed("ab" * 32, pack(_CK, "ab" * 32))
        finally:
            took = time.monotonic() - t0
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    if out not in (None, False):
        raise AssertionError(f"a hostile server gave a {op} hit: {out!r}")
    r.close()
    return took, sum(1 for w in got if issubclass(w.category, CacheWarning)), peak


def _redis_py_blocked_s(url: str, per_read_timeout_s: float, give_up_s: float) -> float | None:
    """How long redis-py's GET stays blocked on a trickling server with a per-read timeout; None if it was
    still blocked after ``give_up_s`` (the server is then stopped, which ends the call)."""
    try:
        import redis
    except ImportError:
        return None
    client = redis.Redis.from_url(url, socket_timeout=per_read_timeout_s, socket_connect_timeout=per_read_timeout_s,
                                  retry_on_timeout=False)
    took: list[float] = []

    def call() -> None:
        t0 = time.monotonic()
        try:
            client.get("rtckern:v1:" + "ab" * 32)
        except Exception:
            pass
        took.append(time.monotonic() - t0)

    th = threading.Thread(target=call, daemon=True)
    th.start()
    th.join(give_up_s)
    return took[0] if took else None


def remote_deadlines(deadline_s: float = 0.5, calls: int = 5, *, redis_py_give_up_s: float = 10.0) -> dict:
    """Worst call duration of the remote tier against each hostile server, for get and put; ``within`` says
    whether every call stayed under deadline + 10 %, ``peak_alloc_bytes`` is the largest allocation peak of a
    call (the huge server announces 500 MB)."""
    limit = deadline_s * 1.10
    servers: dict[str, dict] = {}
    quiet = logging.getLogger("rtckern.cache.remote")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # one warning per call is expected: counted, not printed
    try:
        for mode in HOSTILE_MODES:
            servers[mode] = _against(mode, deadline_s, calls, limit)
    finally:
        quiet.setLevel(level)
    with HostileRedis("trickle") as srv:
        before = _redis_py_blocked_s(srv.url, deadline_s, redis_py_give_up_s)
    return {
        "deadline_s": deadline_s, "limit_s": round(limit, 4), "calls_per_op": calls, "servers": servers,
        "all_within": all(r["within"] for r in servers.values()),
        "redis_py_trickle_blocked_s": round(before, 3) if before is not None else f">{redis_py_give_up_s:g}",
    }


def _against(mode: str, deadline_s: float, calls: int, limit: float) -> dict:
    with HostileRedis(mode) as srv:
        row: dict[str, object] = {}
        for op in ("get", "put"):
            runs = [_one_call(srv.url, op, deadline_s) for _ in range(calls)]
            row[f"{op}_max_s"] = round(max(t for t, _, _ in runs), 4)
            row[f"{op}_warnings_per_call"] = sorted({w for _, w, _ in runs})
            row[f"{op}_peak_alloc_bytes"] = max(p for _, _, p in runs)
    row["max_s"] = max(row["get_max_s"], row["put_max_s"])
    row["within"] = row["max_s"] <= limit
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deadline", type=float, default=0.5)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args(argv)
    print(json.dumps(remote_deadlines(args.deadline, args.calls), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
