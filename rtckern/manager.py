"""``KernelManager``: the glue of compiler, cache tiers and runtime.

``get(spec, device)`` is the hot path after the first call: one dict lookup. The first call goes
memory -> read-only layers -> local disk -> remote -> compile under a per-key lock (with a second look after
taking it), then loads the binary on the device.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from . import events, sources
from .cache import DiskCache, MemoryCache, Stats
from .cache.entry import identity, pack
from .compiler import compiler_for
from .compiler.base import CompiledKernel
from .config import settings
from .device import DeviceInfo
from .errors import LaunchError, LoadError
from .spec import KernelSpec

log = logging.getLogger(__name__)


class KernelManager:
    def __init__(self, cache_dir: Path | str | None = None, *, disk: bool | None = None,
                 max_bytes: int | None = None, layers: tuple = (), remote=...):
        """remote: an object with get_packed/put_packed (rtckern.cache.remote.RedisCache); by default the one
        RTCKERN_REMOTE_CACHE names, if any; None for no remote tier."""
        s = settings()
        self.stats = Stats()
        self.cache_dir = Path(cache_dir) if cache_dir is not None else s.cache_dir
        self.memory = MemoryCache()
        use_disk = s.disk_cache if disk is None else disk
        self.disk: DiskCache | None = (
            DiskCache(self.cache_dir, stats=self.stats, max_bytes=max_bytes if max_bytes is not None else s.cache_max_bytes)
            if use_disk else None)
        layer_dirs = layers if layers else s.read_only_layers
        self.layers = [DiskCache(Path(p), stats=self.stats, read_only=True, name=f"layer:{p}") for p in layer_dirs]
        if remote is ... and not s.remote_cache:
            remote = None  # no remote tier: its module (sockets, TLS) is not imported
        elif remote is ...:
            from .cache.remote import remote_from_settings

            remote = remote_from_settings(s, self.stats)
        self.remote = remote
        self._loaded: dict[tuple, object] = {}
        self._keys: dict[KernelSpec, str] = {}
        self._key_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        sources.forget()  # a new manager reads sources and headers afresh (then once per process: rtckern.sources)

    # ---- keys ----
    def key(self, spec: KernelSpec) -> str:
        k = self._keys.get(spec)
        if k is None:
            k = spec.key(compiler_for(spec.arch).key_inputs())
            self._keys[spec] = k
        return k

    def _key_lock(self, key: str) -> threading.Lock:
        with self._lock:
            lk = self._key_locks.get(key)
            if lk is None:
                lk = self._key_locks[key] = threading.Lock()
            return lk

    # ---- compile through the tiers ----
    def lookup(self, spec: KernelSpec) -> tuple[CompiledKernel | None, str]:
        """Look in every tier without compiling: (compiled kernel or None, tier name). A hit is logged at DEBUG."""
        ck, tier = self._lookup_local(spec)
        if ck is None:
            ck, tier = self._lookup_remote(spec)
        if ck is not None:
            _log_hit(spec, tier)
        return ck, tier

    def _lookup_local(self, spec: KernelSpec) -> tuple[CompiledKernel | None, str]:
        """Memory, read-only layers, local disk: the tiers that are cheap to look at under the per-key lock."""
        key = self.key(spec)
        ck = self.memory.get(key)
        if ck is not None:
            self.stats.bump("memory", "hits")
            return ck, "memory"
        self.stats.bump("memory", "misses")
        for layer in self.layers:
            ck = layer.get(key)
            if ck is not None and not (self.disk is not None and self.disk.refused(key, ck.binary)):
                self.memory.put(key, ck)
                return ck, "layer"
        if self.disk is not None:
            ck = self.disk.get(key)
            if ck is not None:
                self.memory.put(key, ck)
                return ck, "disk"
        return None, ""

    def _lookup_remote(self, spec: KernelSpec) -> tuple[CompiledKernel | None, str]:
        if self.remote is None:
            return None, ""
        key = self.key(spec)
        packed = self.remote.get_packed(key)
        if packed is None:
            return None, ""
        from .cache.entry import InvalidEntry, unpack

        try:
            ck = unpack(packed, key)
        except InvalidEntry:
            return None, ""
        if self.disk is not None:
            self.disk.put_packed(key, packed, self._meta(spec, ck, source="remote"))
        self.memory.put(key, ck)
        return ck, "remote"

    def compile(self, spec: KernelSpec, *, force: bool = False) -> CompiledKernel:
        """The binary for ``spec``: from the caches, or compiled once (per key, across threads and processes).

        The remote tier is consulted before the per-key lock and written after it is released, never under it:
        a slow remote (up to RTCKERN_REMOTE_TIMEOUT_S per call) must not stall every process waiting for the lock.
        """
        t0 = time.perf_counter()
        key = self.key(spec)
        if not force:
            ck, tier = self.lookup(spec)
            if ck is not None:
                events.emit(events.CacheEvent(spec, key, tier, (time.perf_counter() - t0) * 1e3))
                return ck
        with self._key_lock(key):
            lock_cm = self.disk.lock(key) if self.disk is not None else _null()
            with lock_cm:
                if not force:  # second look, local tiers only: another thread or process may have compiled it
                    ck, tier = self._lookup_local(spec)
                    if ck is not None:
                        _log_hit(spec, tier)
                        events.emit(events.CacheEvent(spec, key, tier, (time.perf_counter() - t0) * 1e3))
                        return ck
                ck = compiler_for(spec.arch).compile(spec)
                self.stats.compiled(ck.compile_ms)
                log.info("compiled %s in %.1f ms (key %s)", spec.describe(), ck.compile_ms, key[:16])
                meta = self._meta(spec, ck, source="compile")
                packed = pack(ck, key, identity(meta))
                if self.disk is not None:
                    self.disk.put_packed(key, packed, meta)
                self.memory.put(key, ck)
        if self.remote is not None:  # write-back outside the locks, the same bytes the disk got
            self.remote.put_packed(key, packed, meta)
        events.emit(events.CacheEvent(spec, key, "compile", (time.perf_counter() - t0) * 1e3))
        return ck

    def _meta(self, spec: KernelSpec, ck: CompiledKernel, source: str) -> dict:
        return {
            "op": spec.op, "kernel": spec.name, "name_expression": spec.name_expression,
            "template_args": list(spec.template_args), "defines": [list(d) for d in spec.defines],
            "options": list(spec.options), "source": spec.source, "arch": spec.arch.sm, "kind": ck.kind,
            "compiler": compiler_for(spec.arch).identity(), "compile_ms": round(ck.compile_ms, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "via": source,
        }

    # ---- load on a device ----
    def get(self, spec: KernelSpec, device: int | DeviceInfo = 0):
        """The kernel loaded on ``device`` (an ordinal or a live DeviceInfo). Hot path: one dict lookup."""
        ordinal = device if isinstance(device, int) else device.ordinal
        k = self._loaded.get((spec, ordinal))
        if k is not None:
            return k
        return self._load(spec, ordinal)

    def _load(self, spec: KernelSpec, ordinal: int | None):
        from .runtime import load_kernel

        if ordinal is None:
            raise LaunchError(f"{spec.describe()}: cannot load on a described (not live) device; "
                              "use compile() for compile-only work")
        if spec.arch.gfx:  # AMD: load through the HIP runtime (hip-python)
            from .runtime import hip as hip_runtime

            info = hip_runtime.device_info(ordinal)
            load_kernel = hip_runtime.load_kernel  # noqa: F811 - same interface as the CUDA loader
        else:
            info = DeviceInfo.from_device(ordinal)
        if not spec.arch.ptx and not spec.arch.can_run_on(info.arch):
            raise LaunchError(f"{spec.describe()} cannot run on {info.describe()}: a {spec.arch.sm} cubin needs "
                              f"a device of arch {spec.arch.sm}; build the spec with device.arch")
        ck = self.compile(spec)
        label = spec.name_expression
        try:
            kernel = load_kernel(ck.binary, ck.kind, ck.lowered_name, info, label)
        except LoadError as e:
            if not getattr(e, "refused", False):
                raise
            # The driver refused the image: set it aside where it came from, recompile once, and give up if that
            # fails too. A read-only layer's entry is passed over on this machine from now on; the local disk's copy
            # is quarantined only when it is the refused one (a good one, recompiled earlier, stays).
            key = self.key(spec)
            if self.disk is not None:
                for layer in self.layers:
                    lk = layer.get(key)
                    if lk is not None and lk.binary == ck.binary:
                        self.disk.refuse_elsewhere(key, ck.binary, f"read-only layer {layer.root}", str(e))
                        break
                mine = self.disk.get(key)
                if mine is not None and mine.binary == ck.binary:
                    self.disk.quarantine(key, str(e))
            self.memory.drop(key)
            ck = self.compile(spec, force=True)
            kernel = load_kernel(ck.binary, ck.kind, ck.lowered_name, info, label)
        self.stats.loads += 1
        with self._lock:
            self._loaded[(spec, ordinal)] = kernel
        return kernel

    def clear_memory(self) -> None:
        """Forget loaded kernels and in-memory binaries (the disk tier stays), and every plan that holds them."""
        with self._lock:
            self._loaded.clear()
            self._keys.clear()
        self.memory.clear()
        from .caches import clear_all

        clear_all()


def _log_hit(spec: KernelSpec, tier: str) -> None:
    if log.isEnabledFor(logging.DEBUG):  # describe() only when someone reads it
        log.debug("cache hit (%s) %s", tier, spec.describe())


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


_manager: KernelManager | None = None
_manager_lock = threading.Lock()
_factory: Callable[[], KernelManager] | None = None


def get_manager() -> KernelManager:
    """The process-wide manager, built from the settings on first use."""
    global _manager
    m = _manager
    if m is None:
        with _manager_lock:
            if _manager is None:
                _manager = (_factory or KernelManager)()
            m = _manager
    return m


def set_manager(manager: KernelManager | None) -> KernelManager | None:
    """Replace the process-wide manager (tests, embedding); returns the previous one."""
    global _manager
    with _manager_lock:
        old, _manager = _manager, manager
    from .caches import clear_all

    clear_all()  # plans hold kernels loaded by the old manager
    return old


def set_manager_factory(factory: Callable[[], KernelManager] | None) -> None:
    """How get_manager() builds its manager (the fleet layer adds a remote tier this way)."""
    global _factory
    _factory = factory
