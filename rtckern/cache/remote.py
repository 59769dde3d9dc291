"""Remote tier: a Redis server shared by many machines (``RTCKERN_REMOTE_CACHE=redis://host:6379/0``, also
``rediss://`` with TLS and ``unix:///path/redis.sock``).

The manager reads through it (a remote hit is written into the local disk cache) and writes back after a
compile. Values are packed cache entries, which carry the sha256 of their body: a value that does not unpack is
a miss (warned once per key), and the compile that follows overwrites it.

A remote cache must never make a kernel call much slower than a compile, make it fail, or hold up other
processes:

- Every call (name resolution, connect, TLS handshake, AUTH/SELECT, the command and the whole reply) finishes
  within ``RTCKERN_REMOTE_TIMEOUT_S`` seconds: a whole-call deadline, not a per-read timeout, so a server that
  trickles bytes or never answers costs at most that (:mod:`rtckern.cache.resp` holds it; no retries).
- A value larger than ``RTCKERN_REMOTE_MAX_VALUE_BYTES`` is refused on its announced length, before it is read,
  and is a miss warned once per key; values that large are not written either.
- A failure (refused, unreachable, deadline passed, not a Redis reply, a server error) is a miss with one
  warning, and the tier is then skipped for ``cooldown_s`` seconds, so a dead or hostile server costs one
  deadline per cool-down, not one per kernel. A write the server answers with an error (a read-only replica's
  -READONLY, an ACL user without SET's -NOPERM, -OOM at maxmemory) is not an outage: reads go on, and only
  write-backs stop for ``cooldown_s`` (warned once per refusal kind).
- The manager never calls this tier while it holds a per-key compile lock (see ``KernelManager.compile``).

Integrity only: the digest catches damage, not a value written on purpose under another key by someone who can
write to the server (entries bound to their key close part of that; see docs/fleet.md).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from typing import Any

from . import entry as entry_format
from .disk import CacheWarning
from .resp import SCHEMES, Client, Endpoint, ReplyError, ValueTooLarge
from .stats import Stats

log = logging.getLogger(__name__)
__all__ = ["DEFAULT_MAX_VALUE_BYTES", "KEY_PREFIX", "SCHEMES", "RedisCache", "remote_from_settings"]
KEY_PREFIX = "rtckern:v1:"
DEFAULT_MAX_VALUE_BYTES = 64 << 20  # cubins are KBs to a few MB; 64 MiB leaves room and bounds memory
MAX_TIMEOUT_S = 3600.0


class RedisCache:
    """``get_packed(key) -> bytes | None`` and ``put_packed(key, data, meta) -> bool``, as the manager expects."""

    name = "remote"

    def __init__(self, url: str, *, timeout_s: float = 0.5, cooldown_s: float = 30.0, stats: Stats | None = None,
                 prefix: str = KEY_PREFIX, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                 client: Client | None = None, secret: bytes | None = None):
        """secret: the shared cache secret (RTCKERN_CACHE_SECRET_FILE): values are written signed with it and
        values without a valid signature are refused (see entry.seal)."""
        self.endpoint = Endpoint.parse(url)  # ConfigError for a bad URL, now rather than at the first call
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and 0 < timeout_s <= MAX_TIMEOUT_S):
            raise ValueError(f"remote cache timeout {timeout_s!r} s: must be a number of seconds above 0 and at "
                             f"most {MAX_TIMEOUT_S:g} (RTCKERN_REMOTE_TIMEOUT_S, a whole-call deadline; e.g. 0.5)")
        if not (isinstance(max_value_bytes, int) and max_value_bytes > 0):
            raise ValueError(f"remote cache value cap {max_value_bytes!r}: must be a positive number of bytes "
                             "(RTCKERN_REMOTE_MAX_VALUE_BYTES, e.g. 64M)")
        self.url = url
        self.timeout_s = float(timeout_s)
        self.cooldown_s = cooldown_s
        self.max_value_bytes = max_value_bytes
        self.prefix = prefix
        self.secret = secret
        self.stats = stats or Stats()
        self._client = client if client is not None else Client(self.endpoint)
        self._lock = threading.Lock()
        self._down_until = 0.0  # monotonic time until which the server is not tried
        self._down = False  # inside an outage (warned once at its start)
        self._writes_off_until = 0.0  # monotonic time until which write-backs are not tried (the server refused one)
        self._warned_invalid: set[str] = set()
        self._warned_refusals: set[str] = set()

    # ---- availability ----
    def _skip(self) -> bool:
        return self._down and time.monotonic() < self._down_until

    def _failed(self, op: str, err: Exception) -> None:
        self.stats.bump(self.name, "errors")
        with self._lock:
            first = not self._down
            self._down = True
            self._down_until = time.monotonic() + self.cooldown_s
        if first:
            msg = (f"remote cache {self.endpoint.where()} failed ({op}: {type(err).__name__}: {err}); treating it "
                   f"as a miss and skipping it for {self.cooldown_s:g} s. Check RTCKERN_REMOTE_CACHE and the server")
            warnings.warn(msg, CacheWarning, stacklevel=4)  # one channel: not logged as well (rtckern.logs)
        else:
            log.debug("remote cache still failing (%s: %s)", op, err)

    def _ok(self) -> None:
        if self._down:
            with self._lock:
                was, self._down = self._down, False
            if was:
                log.info("remote cache %s is reachable again", self.endpoint.where())

    def _warn_value(self, key: str, why: str) -> None:
        """A bad value is the value's problem, not the server's: a miss warned once per key, no cool-down."""
        self.stats.bump(self.name, "invalid")
        if key not in self._warned_invalid:
            self._warned_invalid.add(key)
            msg = (f"remote cache value for {key[:16]}… is invalid ({why}); recompiling, and the write-back "
                   "replaces it")
            warnings.warn(msg, CacheWarning, stacklevel=4)

    # ---- the tier ----
    def get_packed(self, key: str) -> bytes | None:
        """The value under ``key`` if it unpacks, else None; never raises, never takes longer than the deadline."""
        if self._skip():
            self.stats.bump(self.name, "misses")
            return None
        try:
            data = self._client.execute((b"GET", (self.prefix + key).encode()), self.timeout_s, self.max_value_bytes)
        except ValueTooLarge as e:
            self._ok()
            self.stats.bump(self.name, "misses")
            self._warn_value(key, str(e))
            return None
        except Exception as e:  # refused, deadline passed, not RESP, server error: all misses
            self._failed("get", e)
            self.stats.bump(self.name, "misses")
            return None
        self._ok()
        if data is None:
            self.stats.bump(self.name, "misses")
            return None
        try:
            if not isinstance(data, bytes):
                raise entry_format.InvalidEntry(f"GET answered {type(data).__name__}, not a bulk string")
            data = entry_format.open_sealed(data, key, self.secret)
            entry_format.unpack(data, key)
        except entry_format.InvalidEntry as e:
            self.stats.bump(self.name, "misses")
            self._warn_value(key, str(e))
            return None
        self.stats.bump(self.name, "hits")
        return data

    def _refused_write(self, err: ReplyError) -> None:
        """The server answered a SET with an error: it is up (reads go on); write-backs pause for the cool-down."""
        self.stats.bump(self.name, "errors")
        self._writes_off_until = time.monotonic() + self.cooldown_s
        kind = str(err).split(": ", 1)[-1].split(" ", 1)[0]  # READONLY, NOPERM, OOM, ...
        if kind not in self._warned_refusals:
            self._warned_refusals.add(kind)
            msg = (f"remote cache {self.endpoint.where()} refused a write ({err}); still reading from it, not writing "
                   f"for {self.cooldown_s:g} s at a time. A read-only replica or a user without SET is fine for "
                   "readers; point writers at the primary with a user allowed to SET")
            warnings.warn(msg, CacheWarning, stacklevel=4)

    def put_packed(self, key: str, data: bytes, meta: dict | None = None) -> bool:
        """Write ``data`` under ``key``; False (never an exception) when skipped, too large or failed."""
        if self._skip() or time.monotonic() < self._writes_off_until:
            return False
        if self.secret is not None:
            data = entry_format.seal(data, key, self.secret)
        if len(data) > self.max_value_bytes:
            # Every reader would refuse it; say so once (a kernel this large is worth knowing about).
            if key not in self._warned_invalid:
                self._warned_invalid.add(key)
                msg = f"not writing {key[:16]}… to the remote cache: {ValueTooLarge(len(data), self.max_value_bytes)}"
                warnings.warn(msg, CacheWarning, stacklevel=3)
            return False
        try:
            reply = self._client.execute((b"SET", (self.prefix + key).encode(), bytes(data)), self.timeout_s)
            if reply != "OK":
                raise ValueError(f"SET answered {reply!r}, not OK")
        except ReplyError as e:
            if not str(e).startswith("SET:"):  # AUTH / SELECT refused on connecting: the tier is not usable
                self._failed("set", e)
                return False
            self._ok()
            self._refused_write(e)
            return False
        except Exception as e:
            self._failed("set", e)
            return False
        self._ok()
        self.stats.bump(self.name, "writes")
        return True

    def ping(self, timeout_s: float | None = None) -> str | None:
        """None when the server answers PING within ``timeout_s`` (default: the tier's deadline), else why not,
        in one line (for `rtckern info`; no warning, no cool-down)."""
        try:
            reply = self._client.execute((b"PING",), timeout_s or self.timeout_s)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None if reply == "PONG" else f"PING answered {reply!r}, not PONG"

    def close(self) -> None:
        self._client.close()


def remote_from_settings(s: Any, stats: Stats | None = None) -> RedisCache | None:
    """The remote tier the settings ask for (``RTCKERN_REMOTE_CACHE``), or None; a malformed URL is a
    ConfigError. No client package is needed: the tier speaks RESP itself (rtckern.cache.resp)."""
    url = s.remote_cache
    if not url:
        return None
    from .secret import read_secret

    return RedisCache(url, timeout_s=s.remote_timeout_s, max_value_bytes=s.remote_max_value_bytes, stats=stats,
                      secret=read_secret(s.cache_secret_file))
