"""Test helpers shared by the test suite and the benchmarks (not used by the library itself).

:class:`HostileRedis` is a fake Redis server on loopback that misbehaves in one chosen way, to check that the
remote tier's whole-call deadline and value cap hold (tests/unit/cache/test_remote.py,
benchmarks/cache_trust.py).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading

HOSTILE_MODES = ("trickle", "blackhole", "huge", "garbage", "no-accept")


class HostileRedis:
    """A listening socket on 127.0.0.1 whose every connection gets one kind of bad treatment:

    - ``trickle``: answers a bulk header announcing 1 MB and then the value, one byte every ``interval_s``,
      forever (each read succeeds in time, so a per-read timeout never fires);
    - ``blackhole``: accepts and reads, never answers;
    - ``huge``: announces a ``huge_bytes`` value (``$500000000``) and streams zeros as fast as the client reads;
    - ``garbage``: answers with an HTTP error line and random bytes (a wrong port, a proxy);
    - ``no-accept``: never accepts; its backlog is filled at start, so new connects get no SYN-ACK and hang.

    Use as a context manager; ``url`` is the redis:// URL that reaches it.
    """

    def __init__(self, mode: str, *, interval_s: float = 0.3, huge_bytes: int = 500_000_000):
        if mode not in HOSTILE_MODES:
            raise ValueError(f"hostile mode {mode!r}: use one of {', '.join(HOSTILE_MODES)}")
        self.mode = mode
        self.interval_s = interval_s
        self.huge_bytes = huge_bytes
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> "HostileRedis":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self.mode == "no-accept":
            self._listener.listen(0)
            self._fill_backlog()
            return
        self._listener.listen(64)
        self._spawn(self._accept_loop)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            s.close()
        self._listener.close()

    # ---- internals ----
    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name=f"hostile-redis-{self.mode}")
        self._threads.append(t)
        t.start()

    def _keep(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.append(s)

    def _fill_backlog(self) -> None:
        # Linux queues backlog+1 finished handshakes; once full, further SYNs are dropped and connect() waits.
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", self.port))
            except BlockingIOError:
                pass
            self._keep(s)

    def _accept_loop(self) -> None:
        self._listener.settimeout(0.05)
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            self._keep(conn)
            self._spawn(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(0.05)
        try:
            self._read_some(conn)
            if self.mode == "trickle":  # every byte of the reply, the header's too, one at a time
                reply = b"$1000000\r\n"
                for i in itertools.count():
                    if self._stop.wait(self.interval_s):
                        break
                    conn.sendall(reply[i:i + 1] if i < len(reply) else b"x")
            elif self.mode == "blackhole":
                while not self._stop.is_set():
                    self._read_some(conn)
            elif self.mode == "huge":
                conn.sendall(b"$%d\r\n" % self.huge_bytes)
                chunk, sent = bytes(1 << 16), 0
                while not self._stop.is_set() and sent < self.huge_bytes:
                    try:
                        sent += conn.send(chunk)
                    except socket.timeout:
                        continue
            elif self.mode == "garbage":
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + os.urandom(8192))
                while not self._stop.is_set():
                    self._read_some(conn)
        except OSError:
            pass  # the client gave up and closed: that is the point

    def _read_some(self, conn: socket.socket) -> None:
        try:
            if conn.recv(65536) == b"":
                raise ConnectionError("client closed")
        except socket.timeout:
            pass
