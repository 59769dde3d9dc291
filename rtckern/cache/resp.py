"""A small Redis client that keeps a deadline: RESP2 over one socket, nothing else.

Why not redis-py: its timeouts are per socket operation, so a server that trickles one byte every 0.3 s keeps a
``GET`` alive forever (each read succeeds in time), and a reply announcing a 400 MiB value is read whole before
anyone can refuse it. Here every call carries one :class:`Deadline` that bounds all of it: name resolution,
connect, the TLS handshake, AUTH/SELECT, sending, and every byte of the reply. Before each socket operation the
socket's timeout is set to the time left, and after each one the deadline is checked again, so a trickle ends
at the deadline. A bulk reply is refused on its ``$<length>`` header when the length passes the caller's cap,
before a byte of the value is read, and a value within the cap is read into one buffer of exactly that size.

Only what the cache tier needs is spoken: ``GET``, ``SET``, ``AUTH``, ``SELECT`` and their replies
(simple strings, errors, integers, bulk strings). URLs follow redis-py's forms:
``redis://[[user]:pass@]host[:port][/db]``; ``rediss://`` (TLS, verified against the system CAs unless
``?ssl_ca_certs=``; also ``ssl_cert_reqs=none|required``, ``ssl_certfile=``, ``ssl_keyfile=``,
``ssl_check_hostname=``); ``unix://[[user]:pass@]/path/redis.sock[?db=N]``. Other query parameters are refused.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import select
import socket
import ssl
import threading
import time
from urllib.parse import parse_qs, unquote, urlsplit

from ..config import redact_url
from ..errors import ConfigError

SCHEMES = ("redis", "rediss", "unix")
DEFAULT_PORT = 6379
MAX_LINE = 4096  # a status, error or length line longer than this is not Redis talking
_INT = re.compile(rb"-?[0-9]+")  # bytes patterns: ASCII digits only (int() alone would take "+5", " 5", "1_0")
_TLS_PARAMS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")


class RemoteError(Exception):
    """The server or the connection failed a call (the tier's cool-down applies)."""


class DeadlineExceeded(RemoteError, TimeoutError):
    """The call did not finish within its deadline."""


class ProtocolError(RemoteError):
    """The peer's bytes are not a RESP reply to the command sent."""


class ReplyError(RemoteError):
    """The server answered with an error (``-ERR ...``, ``-NOAUTH ...``, ``-OOM ...``)."""


class ValueTooLarge(Exception):
    """A value passes the size cap: refused on its announced length, before it is read."""

    def __init__(self, size: int, cap: int):
        self.size, self.cap = size, cap
        super().__init__(f"the value is {size} bytes, above the {cap}-byte cap (RTCKERN_REMOTE_MAX_VALUE_BYTES)")


class Deadline:
    """One wall-clock bound for a whole call."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self, doing: str) -> float:
        """Seconds left, or DeadlineExceeded naming what was still being done."""
        r = self.at - time.monotonic()
        if r <= 0:
            raise self.exceeded(doing)
        return r

    def exceeded(self, doing: str) -> DeadlineExceeded:
        return DeadlineExceeded(f"{doing} did not finish within the {self.seconds:g} s deadline "
                                "(RTCKERN_REMOTE_TIMEOUT_S)")


# ---- URLs ----
@dataclasses.dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str = ""
    port: int = DEFAULT_PORT
    path: str = ""  # unix socket path
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: tuple[tuple[str, str], ...] = ()  # the ssl_* query parameters of a rediss:// URL

    @classmethod
    def parse(cls, url: str) -> "Endpoint":
        """Parse a redis://, rediss:// or unix:// URL; anything else is a ConfigError naming the fix."""
        u = urlsplit(url)
        if u.scheme not in SCHEMES:
            raise ConfigError(f"RTCKERN_REMOTE_CACHE={redact_url(url)!r}: scheme {u.scheme!r} is not supported; "
                              "use redis://host:6379/0 (or rediss:// with TLS, unix:///path/redis.sock)")
        query = {k: v[-1] for k, v in parse_qs(u.query, keep_blank_values=True).items()}
        allowed = ("db",) + (_TLS_PARAMS if u.scheme == "rediss" else ())
        unknown = sorted(set(query) - set(allowed))
        if unknown:
            raise ConfigError(f"RTCKERN_REMOTE_CACHE={redact_url(url)!r}: unknown query parameter(s) "
                              f"{', '.join(unknown)}; supported: {', '.join(allowed)}")
        db = _db(url, u.path if u.scheme != "unix" else "", query.get("db"))
        user = unquote(u.username) if u.username else None
        password = unquote(u.password) if u.password is not None else None
        if u.scheme == "unix":
            if not u.path:
                raise ConfigError(f"RTCKERN_REMOTE_CACHE={redact_url(url)!r}: no socket path; use "
                                  "unix:///path/redis.sock")
            return cls("unix", path=unquote(u.path), db=db, username=user, password=password)
        try:
            port = u.port or DEFAULT_PORT
        except ValueError:
            raise ConfigError(f"RTCKERN_REMOTE_CACHE={redact_url(url)!r}: the port is not a number from 1 "
                              "to 65535; use redis://host:6379/0") from None
        if not u.hostname:
            raise ConfigError(f"RTCKERN_REMOTE_CACHE={redact_url(url)!r}: no host; use redis://host:6379/0")
        tls = tuple(sorted((k, v) for k, v in query.items() if k in _TLS_PARAMS))
        if u.scheme == "rediss":
            _tls_context(dict(tls), url)  # refuse bad TLS parameters now, not at the first call
        return cls(u.scheme, host=u.hostname, port=port, db=db, username=user, password=password, tls=tls)

    def where(self) -> str:
        """The endpoint for messages: never the password."""
        if self.scheme == "unix":
            return f"unix://{self.path}" + (f"?db={self.db}" if self.db else "")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/{self.db}"


def _db(url: str, path: str, query_db: str | None) -> int:
    text = query_db if query_db is not None else path.strip("/")
    if text == "":
        return 0
    if not _INT.fullmatch(text.encode("utf-8", "replace")) or int(text) < 0:
        raise ConfigError(f"RTCKERN_REMOTE_CACHE={redact_url(url)!r}: database {text!r} is not a number "
                          "from 0 up; use redis://host:6379/0")
    return int(text)


def _tls_context(params: dict[str, str], url: str) -> ssl.SSLContext:
    reqs = params.get("ssl_cert_reqs", "required").lower()
    if reqs not in ("none", "required"):
        raise ConfigError(f"RTCKERN_REMOTE_CACHE={redact_url(url)!r}: ssl_cert_reqs={reqs!r} is not "
                          "supported; use required (the default) or none")
    check = params.get("ssl_check_hostname", "true" if reqs == "required" else "false").lower()
    if check not in ("true", "false"):
        raise ConfigError(f"RTCKERN_REMOTE_CACHE={redact_url(url)!r}: ssl_check_hostname={check!r}; "
                          "use true or false")
    try:
        ctx = ssl.create_default_context(cafile=params.get("ssl_ca_certs") or None)
        if params.get("ssl_certfile"):
            ctx.load_cert_chain(params["ssl_certfile"], params.get("ssl_keyfile") or None)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"RTCKERN_REMOTE_CACHE={redact_url(url)!r}: cannot load the TLS files ({e}); "
                          "check ssl_ca_certs / ssl_certfile / ssl_keyfile") from None
    ctx.check_hostname = check == "true"
    if reqs == "none":
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


# ---- one connection ----
# A pooled connection idle longer than this is closed, not reused (middleboxes drop idle TCP flows silently).
MAX_IDLE_S = 30.0


class Connection:
    """One socket to the server, used by one thread at a time. Any error leaves it unusable: close it."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.pid = os.getpid()  # a connection inherited through fork() belongs to the parent
        self.idle_since = time.monotonic()  # set again each time the pool takes it back
        self._buf = bytearray()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def stale(self) -> bool:
        """An idle connection has nothing to read; if it has (EOF after a server restart or an idle timeout,
        or stray bytes), it cannot be reused. One poll, no waiting. One idle longer than MAX_IDLE_S is not reused
        either: a NAT or load balancer may have dropped it without a word, and a call on it would wait out its
        whole deadline (then a cool-down) although the server is up."""
        if self._buf or (isinstance(self.sock, ssl.SSLSocket) and self.sock.pending()):
            return True
        if time.monotonic() - self.idle_since > MAX_IDLE_S:
            return True
        p = select.poll()
        p.register(self.sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        try:
            return bool(p.poll(0))
        except OSError:
            return True

    def call(self, args: tuple[bytes, ...], deadline: Deadline, max_bulk: int | None = None) -> object:
        self._send(_encode(args), deadline)
        return self._reply(deadline, max_bulk, args[0].decode())

    def _send(self, data: bytes, deadline: Deadline) -> None:
        # One send at a time, each bounded by the time left (SSLSocket.sendall bounds each chunk separately).
        view = memoryview(data)
        while view:
            self.sock.settimeout(deadline.left("sending the command"))
            try:
                n = self.sock.send(view)
            except (socket.timeout, ssl.SSLWantWriteError):
                raise deadline.exceeded("sending the command") from None
            view = view[n:]

    def _recv_some(self, deadline: Deadline, doing: str) -> bytes:
        self.sock.settimeout(deadline.left(doing))
        try:
            chunk = self.sock.recv(65536)
        except (socket.timeout, ssl.SSLWantReadError):
            raise deadline.exceeded(doing) from None
        if not chunk:
            raise ConnectionError(f"the server closed the connection while {doing}")
        return chunk

    def _line(self, deadline: Deadline) -> bytes:
        while True:
            end = self._buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self._buf[:end])
                del self._buf[: end + 2]
                return line
            if len(self._buf) > MAX_LINE:
                raise ProtocolError(f"no line end in the first {MAX_LINE} bytes of the reply (not a Redis server?)")
            self._buf += self._recv_some(deadline, "reading the reply")

    def _exact(self, n: int, deadline: Deadline) -> bytes:
        """n bytes plus the CRLF after them, read into one buffer of that size."""
        out = bytearray(n + 2)
        have = min(len(self._buf), n + 2)
        out[:have] = self._buf[:have]
        del self._buf[:have]
        view = memoryview(out)
        while have < n + 2:
            self.sock.settimeout(deadline.left("reading the value"))
            try:
                got = self.sock.recv_into(view[have:])
            except (socket.timeout, ssl.SSLWantReadError):
                raise deadline.exceeded("reading the value") from None
            if not got:
                raise ConnectionError("the server closed the connection while sending the value")
            have += got
        view.release()
        if out[n:] != b"\r\n":
            raise ProtocolError("the value is not followed by CRLF (not a Redis server?)")
        del out[n:]
        return bytes(out)

    def _reply(self, deadline: Deadline, max_bulk: int | None, command: str) -> object:
        line = self._line(deadline)
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode("utf-8", "replace")
        if kind == b"-":
            raise ReplyError(f"{command}: {rest.decode('utf-8', 'replace')[:200]}")
        if kind == b":":
            return _integer(rest, line)
        if kind == b"$":
            n = _integer(rest, line)
            if n == -1:
                return None
            if n < 0:
                raise ProtocolError(f"bulk length {n} in reply line {line[:40]!r}")
            if max_bulk is None:
                raise ProtocolError(f"{command} got a {n}-byte bulk reply where a status was due (not a Redis server?)")
            if n > max_bulk:
                raise ValueTooLarge(n, max_bulk)
            return self._exact(n, deadline)
        raise ProtocolError(f"{command} got a reply starting with {line[:40]!r}, not RESP (not a Redis server?)")


def _integer(text: bytes, line: bytes) -> int:
    if not _INT.fullmatch(text):
        raise ProtocolError(f"bad number in reply line {line[:40]!r} (not a Redis server?)")
    return int(text)


def _encode(args: tuple[bytes, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        parts += [b"$%d\r\n" % len(a), a, b"\r\n"]
    return b"".join(parts)


# ---- connecting ----
def _resolve(host: str, port: int, deadline: Deadline) -> list[tuple]:
    """getaddrinfo under the deadline. It has no timeout of its own (a slow resolver can block for many
    seconds), so a name is resolved on a helper thread that is abandoned if the deadline passes."""
    try:
        ipaddress.ip_address(host)
        literal = True
    except ValueError:
        literal = False
    if literal:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    box: dict[str, object] = {}

    def work() -> None:
        try:
            box["ok"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            box["err"] = e

    th = threading.Thread(target=work, name="rtckern-resolve", daemon=True)
    th.start()
    th.join(deadline.left(f"resolving {host}"))
    if "err" in box:
        raise box["err"]  # type: ignore[misc]
    if "ok" not in box:
        raise deadline.exceeded(f"resolving {host}")
    return box["ok"]  # type: ignore[return-value]


def _open_tcp(ep: Endpoint, deadline: Deadline) -> socket.socket:
    last: Exception | None = None
    for family, kind, proto, _, addr in _resolve(ep.host, ep.port, deadline):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(deadline.left(f"connecting to {ep.host}:{ep.port}"))
            sock.connect(addr)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a dead peer shows as an error, in time
            return sock
        except socket.timeout:
            sock.close()
            raise deadline.exceeded(f"connecting to {ep.host}:{ep.port}") from None
        except OSError as e:
            sock.close()
            last = e
    raise last or OSError(f"{ep.host} resolved to no address")


def _open(ep: Endpoint, deadline: Deadline) -> socket.socket:
    if ep.scheme == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(deadline.left(f"connecting to {ep.path}"))
            sock.connect(ep.path)
        except socket.timeout:
            sock.close()
            raise deadline.exceeded(f"connecting to {ep.path}") from None
        except BaseException:
            sock.close()
            raise
        return sock
    sock = _open_tcp(ep, deadline)
    if ep.scheme == "rediss":
        ctx = _tls_context(dict(ep.tls), ep.where())
        try:
            sock = ctx.wrap_socket(sock, server_hostname=ep.host, do_handshake_on_connect=False)
            # The ssl module bounds one handshake call by the socket timeout as a whole (not per read).
            sock.settimeout(deadline.left("the TLS handshake"))
            sock.do_handshake()
        except socket.timeout:
            sock.close()
            raise deadline.exceeded("the TLS handshake") from None
        except BaseException:
            sock.close()
            raise
    return sock


def connect(ep: Endpoint, deadline: Deadline) -> Connection:
    """A connection that has authenticated and selected its database, all within ``deadline``."""
    conn = Connection(_open(ep, deadline))
    try:
        if ep.password is not None or ep.username:
            auth = (b"AUTH",) + ((ep.username.encode(),) if ep.username else ()) + ((ep.password or "").encode(),)
            conn.call(auth, deadline)
        if ep.db:
            conn.call((b"SELECT", str(ep.db).encode()), deadline)
    except BaseException:
        conn.close()
        raise
    return conn


# ---- the client ----
class Client:
    """``execute(args, timeout_s, max_bulk)``: one command under one whole-call deadline, on a pooled
    connection (kept only after a call that ended cleanly; a timed-out connection may have a reply in flight)."""

    def __init__(self, endpoint: Endpoint, max_idle: int = 4):
        self.endpoint = endpoint
        self.max_idle = max_idle
        self._idle: list[Connection] = []
        self._lock = threading.Lock()

    def execute(self, args: tuple[bytes, ...], timeout_s: float, max_bulk: int | None = None) -> object:
        """The reply to ``args``; ``max_bulk`` caps a bulk reply's length (None: a bulk reply is not expected)."""
        deadline = Deadline(timeout_s)
        conn = self._take() or connect(self.endpoint, deadline)
        try:
            reply = conn.call(args, deadline, max_bulk)
        except ReplyError:
            self._give(conn)  # the error reply was read whole: the connection is in step
            raise
        except BaseException:
            conn.close()
            raise
        self._give(conn)
        return reply

    def _take(self) -> Connection | None:
        pid = os.getpid()
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if conn.pid == pid and not conn.stale():
                    return conn
                conn.close()  # inherited through fork() (the parent's, never shared) or closed by the server
        return None

    def _give(self, conn: Connection) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle and conn.pid == os.getpid():
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()
