"""The Redis tier against a real redis-server (started here on a free loopback port, on a unix socket, with TLS,
with a password; .ci/run installs it) and against hostile fake servers on loopback (rtckern.testing)."""

import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import tracemalloc
import warnings

import filelock
import pytest

from rtckern import config
from rtckern.errors import ConfigError
from rtckern.arch import Arch
from rtckern.cache import CacheWarning, DiskCache, pack, unpack
from rtckern.cache.remote import KEY_PREFIX, RedisCache, remote_from_settings
from rtckern.compiler.base import CompiledKernel
from rtckern.errors import ConfigError
from rtckern.manager import KernelManager
from rtckern.spec import KernelSpec
from rtckern.testing import HOSTILE_MODES, HostileRedis

# Skipped where redis-server is not installed, except under CI (CI=true), where .ci/run installs it: a missing
# server there is a failure, so these tests really run.
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None and not os.environ.get("CI"),
                                reason="redis-server not installed (apt-get install -y redis-server; .ci/run does)")
CK = CompiledKernel(binary=b"\x7fELF" + bytes(range(256)) * 4, kind="cubin", lowered_name="_Z1kv")
KEY = "ab" * 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server: on a free loopback port (``tls``: a TLS port instead, with the given cert/key files),
    or on a unix socket only (``unix``: the socket path); ``password`` sets requirepass."""

    def __init__(self, workdir, *, unix: str | None = None, tls: tuple[str, str] | None = None,
                 password: str | None = None):
        self.port = _free_port()
        self.workdir = workdir
        self.unix, self.tls, self.password = unix, tls, password
        self.proc = None

    @property
    def url(self) -> str:
        if self.unix:
            return f"unix://{self.unix}"
        auth = f":{self.password}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        args = ["redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                "--protected-mode", "yes"]
        if self.unix:
            args += ["--port", "0", "--unixsocket", self.unix, "--unixsocketperm", "700"]
        elif self.tls:
            cert, key = self.tls
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert, "--tls-key-file", key,
                     "--tls-ca-cert-file", cert, "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        if self.password:
            args += ["--requirepass", self.password]
        return args

    def start(self) -> None:
        self.proc = subprocess.Popen(self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {' '.join(self._args())}")
            try:
                self.client().ping()
                return
            except Exception:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start ({self.url})")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self, db: int = 0):
        import redis

        if self.unix:
            return redis.Redis(unix_socket_path=self.unix, db=db)
        if self.tls:
            return redis.Redis(host="127.0.0.1", port=self.port, db=db, ssl=True, ssl_cert_reqs="none",
                               password=self.password)
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, password=self.password)


@pytest.fixture
def redis_server(tmp_path):
    srv = RedisServer(tmp_path)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def spec():
    return KernelSpec("core/axpy.cuh", "axpy", Arch.parse("sm_80"), template_args=("float",), op="core")


def _spec(t: str) -> KernelSpec:
    return KernelSpec("core/axpy.cuh", "axpy", Arch.parse("sm_80"), template_args=(t,), op="core")


def test_roundtrip_values_carry_their_digest(redis_server):
    r = RedisCache(redis_server.url)
    key = "ab" * 32
    assert r.get_packed(key) is None
    assert r.put_packed(key, pack(CK, key))
    raw = redis_server.client().get(KEY_PREFIX + key)
    assert raw == pack(CK, key) and unpack(raw, key).binary == CK.binary  # the value is the self-checking entry
    assert r.get_packed(key) == pack(CK, key)
    assert r.stats.tiers["remote"].hits == 1 and r.stats.tiers["remote"].writes == 1


def _connections(srv) -> int:
    return srv.client().info("stats")["total_connections_received"]


def test_one_connection_serves_many_calls_and_a_restart_is_no_failure(redis_server):
    r = RedisCache(redis_server.url)
    n0 = _connections(redis_server)
    for i in range(50):
        assert r.put_packed(f"{i:064x}", pack(CK, f"{i:064x}")) and r.get_packed(f"{i:064x}") == pack(CK, f"{i:064x}")
    assert _connections(redis_server) - n0 == 2  # the tier's one pooled connection, plus this count's own
    redis_server.stop()
    redis_server.start()  # the pooled connection is now dead: noticed before use, replaced, no failure
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert r.put_packed(KEY, pack(CK, KEY)) and r.get_packed(KEY) == pack(CK, KEY)
    assert r.stats.tiers["remote"].errors == 0


def test_write_back_and_read_through(redis_server, cache_dir, tmp_path, spec):
    a = KernelManager(cache_dir, remote=RedisCache(redis_server.url))
    a.compile(spec)
    key = a.key(spec)
    assert redis_server.client().exists(KEY_PREFIX + key)  # written back after the compile
    # A second machine: empty local cache, same remote. Its lookup is a remote hit, written into local.
    other = tmp_path / "other"
    b = KernelManager(other, remote=RedisCache(redis_server.url))
    ck, tier = b.lookup(spec)
    assert tier == "remote" and ck.binary == a.compile(spec).binary
    assert DiskCache(other).get_packed(key) is not None and b.stats.compiles == 0
    c = KernelManager(other, remote=None)
    assert c.lookup(spec)[1] == "disk"


def _valid_digest_bad_header() -> bytes:
    import hashlib
    import struct

    from rtckern.cache import entry as entry_format

    body = struct.pack("<I", 2) + b"[]" + b"\x7fELF"
    return entry_format._HEAD.pack(entry_format.MAGIC, entry_format.FORMAT, hashlib.sha256(body).digest(),
                                   len(body)) + body


@pytest.mark.parametrize("damage", ["garbage", "flip", "truncate", "other_key", "bad_header"])
def test_corrupt_value_is_a_miss_then_replaced(redis_server, cache_dir, spec, damage):
    """other_key: a valid entry of another kernel written under this key (anyone who can write to the Redis tier
    could otherwise redirect a key to other GPU code); bad_header: a valid digest around a malformed header."""
    seed = KernelManager(cache_dir / "seed", remote=RedisCache(redis_server.url))
    seed.compile(spec)
    key, cl = seed.key(spec), redis_server.client()
    good = cl.get(KEY_PREFIX + key)
    bad = {"garbage": b"not an entry" * 10, "flip": good[:-5] + bytes([good[-5] ^ 1]) + good[-4:],
           "truncate": good[: len(good) // 2], "other_key": pack(CK, "f" * 64),
           "bad_header": _valid_digest_bad_header()}[damage]
    cl.set(KEY_PREFIX + key, bad)
    m = KernelManager(cache_dir / "fresh", remote=RedisCache(redis_server.url))
    with pytest.warns(CacheWarning, match="remote cache value .* is invalid"):
        ck = m.compile(spec)
    assert m.stats.compiles == 1 and m.remote.stats.tiers["remote"].invalid >= 1
    assert unpack(cl.get(KEY_PREFIX + key), key).binary == ck.binary  # the write-back replaced the bad value


def test_server_stopped_mid_run_is_a_miss_with_one_warning(redis_server, cache_dir):
    remote = RedisCache(redis_server.url, timeout_s=0.5, cooldown_s=0.5)
    m = KernelManager(cache_dir, remote=remote)
    m.compile(_spec("float"))
    assert remote.stats.tiers["remote"].writes == 1
    redis_server.stop()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        ck = m.compile(_spec("rtk_half"))  # remote get fails, then the cool-down skips the write-back
        first = time.monotonic() - t0
        m.compile(_spec("rtk_bf16"))
    msgs = [str(w.message) for w in got if issubclass(w.category, CacheWarning)]
    assert len(msgs) == 1 and re.search(r"failed \(get: ConnectionRefusedError: .*skipping it for 0.5 s", msgs[0]), msgs
    assert ck.binary and m.stats.compiles == 3
    assert DiskCache(cache_dir).get_packed(m.key(_spec("rtk_half"))) is not None  # compiled into local
    assert first < 3.0  # one bounded failure, then the tier is skipped during the cooldown
    # The server comes back on the same port: after the cooldown the tier works again, without a warning.
    redis_server.start()
    time.sleep(0.6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.compile(KernelSpec("core/axpy.cuh", "noop8", Arch.parse("sm_80"), op="core"))
    assert redis_server.client().exists(KEY_PREFIX + m.key(KernelSpec("core/axpy.cuh", "noop8", Arch.parse("sm_80"))))


def test_refused_connection_is_a_quick_miss(redis_server):
    port = redis_server.port
    redis_server.stop()
    r = RedisCache(f"redis://127.0.0.1:{port}/0", timeout_s=0.5, cooldown_s=60)
    with pytest.warns(CacheWarning, match=r"failed \(get: ConnectionRefusedError: .*Connection refused\); treating "
                      r"it as a miss and skipping it for 60 s"):
        assert r.get_packed("ef" * 32) is None
    t0 = time.monotonic()
    for _ in range(100):  # inside the cooldown: no network at all
        assert r.get_packed("ef" * 32) is None
    assert time.monotonic() - t0 < 0.05


def test_settings_wire_the_remote_tier(redis_server, cache_dir, spec):
    with config.override(remote_cache=redis_server.url, remote_timeout_s=0.25):
        m = KernelManager(cache_dir)
        assert isinstance(m.remote, RedisCache) and m.remote.timeout_s == 0.25
        assert m.remote.max_value_bytes == 64 << 20  # RTCKERN_REMOTE_MAX_VALUE_BYTES's default
        m.compile(spec)
        assert redis_server.client().exists(KEY_PREFIX + m.key(spec))
    with config.override(remote_cache="http://cache:80/"):
        with pytest.raises(ValueError, match="scheme 'http' is not supported; use redis://host:6379/0"):
            KernelManager(cache_dir)
    assert remote_from_settings(config.settings()) is None  # the fixture's settings have no remote


def test_lookup_order_layers_local_remote_and_compiles_go_local(redis_server, tmp_path):
    specs = {t: _spec(t) for t in ("float", "rtk_half", "rtk_bf16")}
    extra = KernelSpec("core/axpy.cuh", "noop0", Arch.parse("sm_80"), op="core")
    builder = KernelManager(tmp_path / "builder", remote=None)
    layer_dir, local_dir = tmp_path / "layer", tmp_path / "local"
    layer, local = DiskCache(layer_dir), DiskCache(local_dir)
    remote = RedisCache(redis_server.url)
    for t, s in specs.items():
        ck, key = builder.compile(s), builder.key(s)
        {"float": layer, "rtk_half": local, "rtk_bf16": remote}[t].put_packed(key, pack(ck, key), {"arch": "sm_80"})
    # The same key in the layer and the remote with other bytes: the layer must win (it is looked at first).
    fkey = builder.key(specs["float"])
    remote.put_packed(fkey, pack(CompiledKernel(b"\x7fELFother", "cubin", "x"), fkey))
    snapshot = sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in layer_dir.rglob("*"))

    m = KernelManager(local_dir, layers=(layer_dir,), remote=RedisCache(redis_server.url))
    assert m.lookup(specs["float"])[1] == "layer"
    assert m.lookup(specs["float"])[0].binary == builder.compile(specs["float"]).binary
    assert m.lookup(specs["rtk_half"])[1] == "disk"
    assert m.lookup(specs["rtk_bf16"])[1] == "remote"
    assert local.get_packed(m.key(specs["rtk_bf16"])) is not None  # read through into the local cache
    m.compile(extra)
    assert m.stats.compiles == 1
    assert local.get_packed(m.key(extra)) is not None  # new compiles go to the local layer
    assert redis_server.client().exists(KEY_PREFIX + m.key(extra))  # and are written back
    assert sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in layer_dir.rglob("*")) == snapshot


# ---- hostile servers: every call within the whole-call deadline ----
DEADLINE_S = 1.0
SLACK = 1.10  # the bar: no call longer than the deadline + 10 %
# What each server makes the call fail with (the warning names it).
HOSTILE_WHY = {
    ("trickle", "get"): r"get: DeadlineExceeded: reading the reply did not finish within the 1 s deadline",
    ("trickle", "put"): r"set: DeadlineExceeded: reading the reply did not finish within the 1 s deadline",
    ("blackhole", "get"): r"get: DeadlineExceeded: reading the reply did not finish within the 1 s deadline",
    ("blackhole", "put"): r"set: DeadlineExceeded: reading the reply did not finish within the 1 s deadline",
    ("no-accept", "get"): r"get: DeadlineExceeded: connecting to 127\.0\.0\.1:\d+ did not finish within the 1 s",
    ("no-accept", "put"): r"set: DeadlineExceeded: connecting to 127\.0\.0\.1:\d+ did not finish within the 1 s",
    ("huge", "get"): r"value for abababababababab… is invalid \(the value is 500000000 bytes, above the "
                     r"67108864-byte cap \(RTCKERN_REMOTE_MAX_VALUE_BYTES\)\)",
    ("huge", "put"): r"set: ProtocolError: SET got a 500000000-byte bulk reply where a status was due",
    ("garbage", "get"): r"get: ProtocolError: GET got a reply starting with b'HTTP/1.1 400 Bad Request', not RESP",
    ("garbage", "put"): r"set: ProtocolError: SET got a reply starting with b'HTTP/1.1 400 Bad Request', not RESP",
}
SLOW_MODES = ("trickle", "blackhole", "no-accept")  # these hold the call until the deadline


@pytest.mark.parametrize("op", ["get", "put"])
@pytest.mark.parametrize("mode", HOSTILE_MODES)
def test_hostile_server_call_ends_within_the_deadline(mode, op):
    with HostileRedis(mode) as srv:
        r = RedisCache(srv.url, timeout_s=DEADLINE_S, cooldown_s=0.0)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            t0 = time.monotonic()
            out = r.get_packed(KEY) if op == "get" else r.put_packed(KEY, pack(CK, KEY))
            took = time.monotonic() - t0
    assert out is (None if op == "get" else False)
    assert took <= DEADLINE_S * SLACK, f"{mode} {op}: {took:.3f} s"
    if mode in SLOW_MODES:
        assert took >= DEADLINE_S * 0.99  # the server really held the call: the deadline ended it
    msgs = [str(w.message) for w in got if issubclass(w.category, CacheWarning)]
    assert len(msgs) == 1 and re.search(HOSTILE_WHY[mode, op], msgs[0]), msgs
    t = r.stats.tiers["remote"]
    assert (t.misses, t.hits, t.writes) == ((1, 0, 0) if op == "get" else (0, 0, 0))
    # A bad value is the value's fault (no cool-down); anything else is the server's (cool-down).
    assert (t.invalid, t.errors) == ((1, 0) if (mode, op) == ("huge", "get") else (0, 1))


def test_hostile_server_costs_one_deadline_per_cooldown():
    with HostileRedis("trickle") as srv:
        r = RedisCache(srv.url, timeout_s=0.5, cooldown_s=60)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            t0 = time.monotonic()
            for i in range(50):
                assert r.get_packed(f"{i:064x}") is None
                assert r.put_packed(f"{i:064x}", pack(CK, f"{i:064x}")) is False
            took = time.monotonic() - t0
    assert 0.5 <= took <= 0.55, took  # the first get waited out its deadline; the rest skipped the server
    assert sum(1 for w in got if issubclass(w.category, CacheWarning)) == 1
    assert r.stats.tiers["remote"].errors == 1 and r.stats.tiers["remote"].misses == 50


def test_value_over_the_cap_is_refused_unread_and_not_written(redis_server):
    cap = 1 << 20
    cl = redis_server.client()
    big = pack(CompiledKernel(binary=b"\x7fELF" + os.urandom(2 << 20), kind="cubin", lowered_name="_Z1kv"), KEY)
    cl.set(KEY_PREFIX + KEY, big)
    r = RedisCache(redis_server.url, max_value_bytes=cap)
    tracemalloc.start()
    try:
        with pytest.warns(CacheWarning, match=rf"is invalid \(the value is {len(big)} bytes, above the "
                                              rf"{cap}-byte cap \(RTCKERN_REMOTE_MAX_VALUE_BYTES\)\)"):
            assert r.get_packed(KEY) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 << 10, peak  # refused on the length header: the 2 MiB value was never read
    assert r.stats.tiers["remote"].errors == 0  # not the server's fault: no cool-down
    with pytest.warns(CacheWarning, match=rf"not writing {'cd' * 8}… to the remote cache: the value is {len(big)} "):
        assert r.put_packed("cd" * 32, big) is False
    assert not cl.exists(KEY_PREFIX + "cd" * 32)
    # At the cap exactly, the value is read and served.
    r_exact = RedisCache(redis_server.url, max_value_bytes=len(big))
    assert r_exact.get_packed(KEY) == big and r_exact.put_packed("cd" * 32, big)


def test_value_cap_setting(redis_server):
    assert config.Settings.from_env({}).remote_max_value_bytes == 64 << 20
    assert config.Settings.from_env({"RTCKERN_REMOTE_MAX_VALUE_BYTES": "1M"}).remote_max_value_bytes == 1 << 20
    assert config.Settings.from_env({"RTCKERN_REMOTE_MAX_VALUE_BYTES": "65536"}).remote_max_value_bytes == 65536
    with pytest.raises(ConfigError, match=r"RTCKERN_REMOTE_MAX_VALUE_BYTES='0' is 0 bytes, below the smallest "
                                          r"accepted 1 KiB \(1024 bytes\)"):
        config.Settings.from_env({"RTCKERN_REMOTE_MAX_VALUE_BYTES": "0"})
    with config.override(remote_cache=redis_server.url, remote_max_value_bytes=4096):
        assert remote_from_settings(config.settings()).max_value_bytes == 4096


# ---- every URL scheme the docs name, against a real redis-server ----
@pytest.fixture
def short_tmp():
    d = tempfile.mkdtemp(prefix="rtk", dir="/tmp")  # unix socket paths must stay under ~100 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_unix_socket_url(short_tmp, cache_dir, spec):
    srv = RedisServer(short_tmp, unix=os.path.join(short_tmp, "redis.sock"))
    srv.start()
    try:
        r = RedisCache(srv.url)
        assert r.get_packed(KEY) is None and r.put_packed(KEY, pack(CK, KEY)) and r.get_packed(KEY) == pack(CK, KEY)
        assert srv.client().get(KEY_PREFIX + KEY) == pack(CK, KEY)
        r2 = RedisCache(srv.url + "?db=2")
        assert r2.put_packed(KEY, b"x" * 10)
        assert srv.client(db=2).get(KEY_PREFIX + KEY) == b"x" * 10 and srv.client().get(KEY_PREFIX + KEY) == pack(CK, KEY)
        m = KernelManager(cache_dir, remote=RedisCache(srv.url))
        m.compile(spec)
        assert srv.client().exists(KEY_PREFIX + m.key(spec)) and r.stats.tiers["remote"].errors == 0
    finally:
        srv.stop()


def test_password_and_database_in_the_url(redis_server, tmp_path):
    srv = RedisServer(tmp_path, password="s3cret")
    srv.start()
    try:
        r = RedisCache(f"redis://:s3cret@127.0.0.1:{srv.port}/3")
        assert r.put_packed(KEY, pack(CK, KEY)) and r.get_packed(KEY) == pack(CK, KEY)
        assert srv.client(db=3).get(KEY_PREFIX + KEY) == pack(CK, KEY) and not srv.client(db=0).exists(KEY_PREFIX + KEY)
        bad = RedisCache(f"redis://:wrong@127.0.0.1:{srv.port}/3")
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            assert bad.get_packed(KEY) is None
        msgs = [str(w.message) for w in got if issubclass(w.category, CacheWarning)]
        want = rf"redis://127.0.0.1:{srv.port}/3 failed \(get: ReplyError: AUTH: WRONGPASS"
        assert len(msgs) == 1 and re.search(want, msgs[0]), msgs
        assert "wrong" not in msgs[0].replace("WRONGPASS", "")  # the password is never printed
    finally:
        srv.stop()


def test_a_refused_write_stops_write_backs_not_reads(redis_server):
    """A write the server answers with an error (here an ACL user allowed GET only: -NOPERM; a read-only replica's
    -READONLY or -OOM are alike) is no outage: one warning, write-backs pause, and reads still hit."""
    redis_server.client().execute_command("ACL", "SETUSER", "reader", "on", ">pw", "~*", "+get", "+select", "+ping")
    writer = RedisCache(redis_server.url)
    assert writer.put_packed(KEY, pack(CK, KEY))
    reader = RedisCache(redis_server.url.replace("redis://", "redis://reader:pw@"))
    other = "c" * 64
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert not reader.put_packed(other, pack(CK, other))
        assert not reader.put_packed(other, pack(CK, other))  # paused: not asked again
        assert reader.get_packed(KEY) == pack(CK, KEY)  # reads go on
    msgs = [str(w.message) for w in got if issubclass(w.category, CacheWarning)]
    assert len(msgs) == 1 and "refused a write (SET: NOPERM" in msgs[0] and "still reading from it" in msgs[0], msgs
    assert "pw" not in msgs[0].replace("pw@", "")


@pytest.fixture
def tls_files(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed (needed to make a test certificate)")
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return cert, key


def test_rediss_url_with_tls(tmp_path, tls_files):
    cert, _ = tls_files
    srv = RedisServer(tmp_path, tls=tls_files)
    try:
        srv.start()
    except RuntimeError as e:
        pytest.skip(f"this redis-server has no TLS support ({e})")
    try:
        base = f"rediss://127.0.0.1:{srv.port}/0"
        r = RedisCache(f"{base}?ssl_ca_certs={cert}")  # verified: the test CA, hostname 127.0.0.1 in the SAN
        n0 = _connections(srv)
        for _ in range(20):
            assert r.put_packed(KEY, pack(CK, KEY)) and r.get_packed(KEY) == pack(CK, KEY)
        assert _connections(srv) - n0 == 2  # one TLS connection reused (plus the count's own)
        assert srv.client().get(KEY_PREFIX + KEY) == pack(CK, KEY)
        assert RedisCache(f"{base}?ssl_cert_reqs=none").get_packed(KEY) == pack(CK, KEY)  # encrypted, not verified
        unknown_ca = RedisCache(base)  # the system CAs do not know the test certificate: refused, a miss
        with pytest.warns(CacheWarning, match=r"failed \(get: SSLCertVerificationError: .*CERTIFICATE_VERIFY_FAILED"):
            assert unknown_ca.get_packed(KEY) is None
        plain = RedisCache(f"redis://127.0.0.1:{srv.port}/0", timeout_s=0.5)  # plain text to a TLS port
        t0 = time.monotonic()
        with pytest.warns(CacheWarning, match=r"failed \(get: "):
            assert plain.get_packed(KEY) is None
        assert time.monotonic() - t0 <= 0.55
    finally:
        srv.stop()


def test_tls_handshake_is_under_the_deadline():
    with HostileRedis("blackhole") as srv:
        r = RedisCache(f"rediss://127.0.0.1:{srv.port}/0", timeout_s=DEADLINE_S, cooldown_s=0)
        t0 = time.monotonic()
        with pytest.warns(CacheWarning, match=r"DeadlineExceeded: the TLS handshake did not finish within the 1 s "):
            assert r.get_packed(KEY) is None
        assert DEADLINE_S * 0.99 <= time.monotonic() - t0 <= DEADLINE_S * SLACK


@pytest.mark.parametrize("url, why", [
    ("http://cache:80/", r"scheme 'http' is not supported; use redis://host:6379/0 \(or rediss:// with TLS, "
                         r"unix:///path/redis.sock\)"),
    ("garbage", r"scheme '' is not supported"),
    ("redis://h:notaport/0", r"'redis://h:notaport/0': the port is not a number from 1 to 65535"),
    ("redis://h:6379/zero", r"database 'zero' is not a number from 0 up"),
    ("redis:///0", r"'redis:///0': no host; use redis://host:6379/0"),
    ("unix://", r"'unix://': no socket path; use unix:///path/redis.sock"),
    ("redis://:pw@h:6379/0?socket_timeout=5", r"'redis://:\*\*\*@h:6379/0\?socket_timeout=5': unknown query "
                                              r"parameter\(s\) socket_timeout; supported: db$"),
    ("rediss://h/0?ssl_cert_reqs=maybe", r"ssl_cert_reqs='maybe' is not supported; use required \(the default\) "
                                         r"or none"),
    ("rediss://h/0?ssl_ca_certs=/nonexistent.pem", r"cannot load the TLS files"),
])
def test_bad_urls_are_refused_at_construction(url, why):
    with pytest.raises(ConfigError, match=r"RTCKERN_REMOTE_CACHE=.*" + why):
        RedisCache(url)


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan"), 1e9])
def test_bad_deadlines_are_refused(timeout):
    with pytest.raises(ValueError, match=r"must be a number of seconds above 0 and at most 3600 "
                                         r"\(RTCKERN_REMOTE_TIMEOUT_S, a whole-call deadline; e.g. 0.5\)"):
        RedisCache("redis://127.0.0.1:6379/0", timeout_s=timeout)


# ---- no remote I/O under the per-key lock ----
class _LockWatchingRemote:
    """Wraps a RedisCache; on every call, records whether the key's disk lock is held (another flock on the
    same file, which conflicts even within one process). A test that probes the lock itself does it under
    ``probing``, so that neither probe takes the other's flock for the manager's."""

    def __init__(self, inner: RedisCache, disk: DiskCache):
        self.inner, self.disk = inner, disk
        self.calls: list[tuple[str, bool]] = []
        self.probing = threading.Lock()

    def _held(self, key: str) -> bool:
        probe = filelock.FileLock(str(self.disk.lock_path(key)), timeout=0)
        with self.probing:
            try:
                probe.acquire()
            except filelock.Timeout:
                return True
            probe.release()
        return False

    def get_packed(self, key):
        self.calls.append(("get", self._held(key)))
        return self.inner.get_packed(key)

    def put_packed(self, key, data, meta=None):
        self.calls.append(("put", self._held(key)))
        return self.inner.put_packed(key, data, meta)


def test_slow_remote_never_holds_the_per_key_lock(cache_dir, spec):
    deadline = 1.5
    with HostileRedis("blackhole") as srv:
        m = KernelManager(cache_dir)
        remote = _LockWatchingRemote(RedisCache(srv.url, timeout_s=deadline, cooldown_s=0.0), m.disk)
        m.remote = remote
        lock_path = str(m.disk.lock_path(m.key(spec)))
        done = threading.Event()
        held_since, longest = None, 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheWarning)
            th = threading.Thread(target=lambda: (m.compile(spec), done.set()))
            t0 = time.monotonic()
            th.start()
            # Meanwhile, another would-be compiler polls the lock: it must never wait as long as a remote call.
            while not done.is_set():
                probe = filelock.FileLock(lock_path, timeout=0)
                with remote.probing:
                    try:
                        probe.acquire()
                        probe.release()
                        held_since = None
                    except filelock.Timeout:
                        held_since = held_since or time.monotonic()
                        longest = max(longest, time.monotonic() - held_since)
                time.sleep(0.01)
            th.join()
            took = time.monotonic() - t0
    assert remote.calls == [("get", False), ("put", False)]  # one look before the lock, the write-back after it
    assert m.stats.compiles == 1 and took >= 2 * deadline  # both remote calls really waited out the deadline
    assert longest < deadline, longest  # the lock was held for the compile only


def test_with_a_secret_only_signed_values_are_served(redis_server, cache_dir, spec, tmp_path):
    """RTCKERN_CACHE_SECRET_FILE: writers sign, readers refuse unsigned values and other secrets' signatures (an
    attacker with write access to Redis can pack a valid, key-bound entry, but cannot sign it)."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.write_text("a-shared-secret-of-the-fleet-0001")
    theirs.write_text("somebody-elses-secret-000000000000")

    def tier(secret_file):
        with config.override(remote_cache=redis_server.url, cache_secret_file=secret_file):
            return remote_from_settings(config.settings())

    seed = KernelManager(cache_dir / "seed", remote=tier(ours))
    ck = seed.compile(spec)
    key, cl = seed.key(spec), redis_server.client()
    assert cl.get(KEY_PREFIX + key).startswith(b"RTKSEAL1")
    assert KernelManager(cache_dir / "a", remote=tier(ours)).lookup(spec)[1] == "remote"
    with pytest.warns(CacheWarning, match="signature does not verify with this cache secret"):
        assert KernelManager(cache_dir / "b", remote=tier(theirs)).lookup(spec) == (None, "")
    cl.set(KEY_PREFIX + key, pack(ck, key))  # a valid, key-bound, unsigned entry
    with pytest.warns(CacheWarning, match="not signed, and a cache secret is set"):
        assert KernelManager(cache_dir / "c", remote=tier(ours)).lookup(spec) == (None, "")
    assert KernelManager(cache_dir / "d", remote=tier(None)).lookup(spec)[1] == "remote"  # no secret: integrity only


def test_a_connection_idle_too_long_is_not_reused(redis_server, monkeypatch):
    """A pooled connection idle past MAX_IDLE_S is closed and a new one made (a NAT may have dropped the old one
    silently: a call on it would wait out the deadline and start a cool-down though the server is up)."""
    from rtckern.cache import resp

    r = RedisCache(redis_server.url)
    assert r.put_packed(KEY, pack(CK, KEY))
    (conn,) = r._client._idle
    assert r.get_packed(KEY) is not None and r._client._idle == [conn]  # reused while fresh
    monkeypatch.setattr(resp, "MAX_IDLE_S", 0.0)
    assert r.get_packed(KEY) is not None and r._client._idle != [conn]  # replaced once idle too long
