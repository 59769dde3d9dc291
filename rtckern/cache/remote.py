"""Remote tier: a Redis server shared by many machines (``RTCKERN_REMOTE_CACHE=redis://host:6379/0``).

The manager reads through it (a remote hit is written into the local disk cache) and writes back after a
compile. Values are packed cache entries, which carry the sha256 of their body: a value that does not unpack is
a miss (warned once), and the compile that follows overwrites it.

A remote cache must never make a kernel call slower than a compile or make it fail: every call is bounded by
``RTCKERN_REMOTE_TIMEOUT_S`` (connect and read; no retries), a connection error or timeout is a miss with one
warning, and after one the tier is skipped for ``cooldown_s`` seconds so a dead server costs one timeout per
cooldown, not one per kernel.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from typing import Any
from urllib.parse import urlsplit

from . import entry as entry_format
from .disk import CacheWarning
from .stats import Stats

log = logging.getLogger(__name__)
SCHEMES = ("redis", "rediss", "unix")
KEY_PREFIX = "rtckern:v1:"


def _client(url: str, timeout_s: float) -> Any:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False,
        retry=Retry(NoBackoff(), 0), health_check_interval=0, socket_keepalive=True)


class RedisCache:
    """``get_packed(key) -> bytes | None`` and ``put_packed(key, data, meta) -> bool``, as the manager expects."""

    name = "remote"

    def __init__(self, url: str, *, timeout_s: float = 0.5, cooldown_s: float = 30.0, stats: Stats | None = None,
                 prefix: str = KEY_PREFIX, client: Any = None):
        scheme = urlsplit(url).scheme
        if scheme not in SCHEMES:
            raise ValueError(f"RTCKERN_REMOTE_CACHE={url!r}: scheme {scheme!r} is not supported; use "
                             "redis://host:6379/0 (or rediss:// with TLS, unix:///path/redis.sock)")
        if not timeout_s > 0:
            raise ValueError(f"remote cache timeout {timeout_s!r} s: must be positive (RTCKERN_REMOTE_TIMEOUT_S)")
        self.url = url
        self.timeout_s = timeout_s
        self.cooldown_s = cooldown_s
        self.prefix = prefix
        self.stats = stats or Stats()
        self._client = client if client is not None else _client(url, timeout_s)
        self._lock = threading.Lock()
        self._down_until = 0.0  # monotonic time until which the server is not tried
        self._down = False  # inside an outage (warned once at its start)
        self._warned_invalid: set[str] = set()

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
            msg = (f"remote cache {self._where()} is unreachable ({op}: {type(err).__name__}: {err}); treating it "
                   f"as a miss and retrying in {self.cooldown_s:g} s. Check RTCKERN_REMOTE_CACHE")
            log.warning(msg)
            warnings.warn(msg, CacheWarning, stacklevel=4)
        else:
            log.debug("remote cache still unreachable (%s: %s)", op, err)

    def _ok(self) -> None:
        if self._down:
            with self._lock:
                was, self._down = self._down, False
            if was:
                log.info("remote cache %s is reachable again", self._where())

    def _where(self) -> str:
        u = urlsplit(self.url)
        return f"{u.scheme}://{u.hostname or ''}{':' + str(u.port) if u.port else ''}{u.path}"  # no password

    # ---- the tier ----
    def get_packed(self, key: str) -> bytes | None:
        if self._skip():
            self.stats.bump(self.name, "misses")
            return None
        try:
            data = self._client.get(self.prefix + key)
        except Exception as e:  # redis.ConnectionError, TimeoutError, OSError, protocol errors: all misses
            self._failed("get", e)
            self.stats.bump(self.name, "misses")
            return None
        self._ok()
        if data is None:
            self.stats.bump(self.name, "misses")
            return None
        try:
            entry_format.unpack(data, key)
        except entry_format.InvalidEntry as e:
            self.stats.bump(self.name, "invalid")
            self.stats.bump(self.name, "misses")
            if key not in self._warned_invalid:
                self._warned_invalid.add(key)
                msg = (f"remote cache value for {key[:16]}… is invalid ({e}); recompiling, and the write-back "
                       "replaces it")
                log.warning(msg)
                warnings.warn(msg, CacheWarning, stacklevel=3)
            return None
        self.stats.bump(self.name, "hits")
        return bytes(data)

    def put_packed(self, key: str, data: bytes, meta: dict | None = None) -> bool:
        if self._skip():
            return False
        try:
            self._client.set(self.prefix + key, data)
        except Exception as e:
            self._failed("set", e)
            return False
        self._ok()
        self.stats.bump(self.name, "writes")
        return True

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:
            pass


_warned_no_client = False


def remote_from_settings(s: Any, stats: Stats | None = None) -> RedisCache | None:
    """The remote tier the settings ask for (``RTCKERN_REMOTE_CACHE``), or None. A missing ``redis`` package is
    a warning (kernels still compile), a malformed URL an error."""
    global _warned_no_client
    url = s.remote_cache
    if not url:
        return None
    try:
        import redis  # noqa: F401
    except ImportError:
        if not _warned_no_client:
            _warned_no_client = True
            msg = (f"RTCKERN_REMOTE_CACHE={url} is set but the redis package is not installed; running without the "
                   "remote tier. Install it: pip install 'rtckern[redis]'")
            log.warning(msg)
            warnings.warn(msg, CacheWarning, stacklevel=3)
        return None
    return RedisCache(url, timeout_s=s.remote_timeout_s, stats=stats)
