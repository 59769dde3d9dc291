"""The Redis tier against a real redis-server on loopback (started here on a free port; .ci/run installs it)."""

import os
import shutil
import socket
import subprocess
import threading
import time
import warnings

import pytest

from rtckern import config
from rtckern.arch import Arch
from rtckern.cache import CacheWarning, DiskCache, pack, unpack
from rtckern.cache.remote import KEY_PREFIX, RedisCache, remote_from_settings
from rtckern.compiler.base import CompiledKernel
from rtckern.manager import KernelManager
from rtckern.spec import KernelSpec

# Skipped where redis-server is not installed, except under CI (CI=true), where .ci/run installs it: a missing
# server there is a failure, so these tests really run.
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None and not os.environ.get("CI"),
                                reason="redis-server not installed (apt-get install -y redis-server; .ci/run does)")
CK = CompiledKernel(binary=b"\x7fELF" + bytes(range(256)) * 4, kind="cubin", lowered_name="_Z1kv")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, workdir):
        self.port = _free_port()
        self.workdir = workdir
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)


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
        ck = m.compile(_spec("rtk_half"))  # remote get, get again under the lock, put: all fail
        first = time.monotonic() - t0
        m.compile(_spec("rtk_bf16"))
    msgs = [str(w.message) for w in got if issubclass(w.category, CacheWarning)]
    assert len(msgs) == 1 and "unreachable" in msgs[0], msgs
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


def test_unresponsive_server_is_bounded_by_the_timeout():
    # A socket that accepts connections and never answers: every call must give up after the timeout.
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        lsock.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(lsock.accept()[0])
            except OSError:
                pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        r = RedisCache(f"redis://127.0.0.1:{lsock.getsockname()[1]}/0", timeout_s=0.3, cooldown_s=0.0)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            times = []
            for _ in range(3):
                t0 = time.monotonic()
                assert r.get_packed("cd" * 32) is None
                assert r.put_packed("cd" * 32, pack(CK, "cd" * 32)) is False
                times.append(time.monotonic() - t0)
        assert max(times) < 1.5, times  # two calls of at most ~0.3 s each
        assert sum(1 for w in got if issubclass(w.category, CacheWarning)) == 1
        assert r.stats.tiers["remote"].errors == 6
    finally:
        stop.set()
        th.join()
        for s in held:
            s.close()
        lsock.close()


def test_refused_connection_is_a_quick_miss(redis_server):
    port = redis_server.port
    redis_server.stop()
    r = RedisCache(f"redis://127.0.0.1:{port}/0", timeout_s=0.5, cooldown_s=60)
    with pytest.warns(CacheWarning, match="unreachable"):
        assert r.get_packed("ef" * 32) is None
    t0 = time.monotonic()
    for _ in range(100):  # inside the cooldown: no network at all
        assert r.get_packed("ef" * 32) is None
    assert time.monotonic() - t0 < 0.05


def test_settings_wire_the_remote_tier(redis_server, cache_dir, spec):
    with config.override(remote_cache=redis_server.url, remote_timeout_s=0.25):
        m = KernelManager(cache_dir)
        assert isinstance(m.remote, RedisCache) and m.remote.timeout_s == 0.25
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
