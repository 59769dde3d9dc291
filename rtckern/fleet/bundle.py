"""Bundles: one deterministic file with cache entries and an index of their digests, for shipping caches.

A bundle is a gzip-compressed ustar archive::

    rtckern-bundle.json            the index (first member): format, and per entry key, path, size, sha256, meta
    v1/<k[:2]>/<key>.rtk           entries, byte for byte as in the disk cache, sorted by key

Deterministic: members sorted, mtime 0, uid/gid 0, no user or group names, mode 0644, gzip header without name
or time, and the index holds no timestamps (compile times and creation dates stay out of it). The same entries
give the same bytes.

Import trusts nothing: every member must be a regular file named as above (no links, devices, directories,
absolute paths or ``..``), within the size limits, listed in the index exactly once with the size and sha256 of
its bytes, and a valid entry whose internal digest matches. Any problem rejects the whole bundle before anything
is written. An entry already in the cache and valid is never replaced by a different one.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import re
import tarfile
import warnings
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from ..arch import Arch
from ..cache import CacheWarning, DiskCache, atomic_write
from ..cache import entry as entry_format
from ..errors import CacheError

INDEX_NAME = "rtckern-bundle.json"
FORMAT = "rtckern-bundle/1"
LAYOUT = "v1"
MAX_MEMBER_BYTES = 256 << 20  # the largest cubin rtckern makes is a few MB
MAX_INDEX_BYTES = 64 << 20
MAX_MEMBERS = 200_000
MAX_TOTAL_BYTES = 16 << 30
# Sidecar fields that describe the kernel; the others (compile_ms, created, via, size, digest, key) vary between
# builds of the same bytes or are recomputed, so they stay out of a deterministic bundle.
META_FIELDS = ("op", "kernel", "name_expression", "template_args", "defines", "options", "source", "arch", "kind",
               "compiler")
_ENTRY_NAME = re.compile(r"^v1/([0-9a-f]{2})/([0-9a-f]{64})\.rtk$")


class BundleError(CacheError, ValueError):
    """A bundle that is refused: names the member and what is wrong with it."""


@dataclasses.dataclass(frozen=True)
class Limits:
    max_member_bytes: int = MAX_MEMBER_BYTES
    max_members: int = MAX_MEMBERS
    max_total_bytes: int = MAX_TOTAL_BYTES


# ---- selection of entries ----
def arch_matches(meta_arch: str, archs: Sequence[Arch] | None) -> bool:
    """An entry for sm_90a or sm_90 matches an arch list naming 9.0 or 9.0a: a bundle is for a kind of device."""
    if not archs:
        return True
    try:
        a = Arch.parse(meta_arch).base()
    except Exception:
        return False
    return any(a == dataclasses.replace(x.base(), ptx=False) for x in archs)


def select_entries(caches: Sequence[DiskCache], *, keys: Iterable[str] | None = None,
                   archs: Sequence[Arch] | None = None, op: str | None = None,
                   toolchain: str | None = None) -> tuple[list[tuple[str, bytes, dict]], list[str]]:
    """(key, packed bytes, meta) for the wanted entries, looked up in ``caches`` in order (the local cache, then
    read-only layers), and the keys asked for but not found valid anywhere."""
    found: dict[str, tuple[bytes, dict]] = {}
    missing: list[str] = []
    if keys is not None:
        for key in sorted(set(keys)):
            for c in caches:
                data = c.get_packed(key)
                if data is not None:
                    found[key] = (data, _read_meta(c, key))
                    break
            else:
                missing.append(key)
    else:
        for c in caches:
            for e in c.entries(meta=False):
                if e.key in found:
                    continue
                data = c.get_packed(e.key)
                if data is not None:
                    found[e.key] = (data, c.meta(e.key, data)[0])
    out = []
    for key in sorted(found):
        data, meta = found[key]
        if archs and not arch_matches(meta.get("arch", ""), archs):
            continue
        if op and meta.get("op") != op:
            continue
        if toolchain and toolchain not in meta.get("compiler", ""):
            continue
        out.append((key, data, meta))
    return out, missing


def _read_meta(cache: DiskCache, key: str) -> dict:
    return cache.meta(key)[0]  # the sidecar only if it checks out against the entry (arch from the binary)


# ---- writing ----
def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode, ti.type = size, 0, 0o644, tarfile.REGTYPE
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def bundle_bytes(entries: Sequence[tuple[str, bytes, dict]]) -> bytes:
    """The bundle for ``entries`` (key, packed, meta), as bytes. Same entries, same bytes."""
    entries = sorted(entries, key=lambda e: e[0])
    index = {"format": FORMAT, "layout": LAYOUT, "count": len(entries), "entries": [
        {"key": k, "path": f"{LAYOUT}/{k[:2]}/{k}.rtk", "size": len(d), "sha256": hashlib.sha256(d).hexdigest(),
         "meta": {f: m[f] for f in META_FIELDS if f in m}} for k, d, m in entries]}
    index_bytes = (json.dumps(index, indent=1, sort_keys=True) + "\n").encode()
    raw = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tf:
            tf.addfile(_tarinfo(INDEX_NAME, len(index_bytes)), io.BytesIO(index_bytes))
            for key, data, _ in entries:
                tf.addfile(_tarinfo(f"{LAYOUT}/{key[:2]}/{key}.rtk", len(data)), io.BytesIO(data))
    return raw.getvalue()


def write_bundle(path: str | Path, entries: Sequence[tuple[str, bytes, dict]]) -> dict:
    data = bundle_bytes(entries)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, data)
    return {"bundle": str(p), "entries": len(entries), "bytes": len(data),
            "entry_bytes": sum(len(d) for _, d, _ in entries), "sha256": hashlib.sha256(data).hexdigest()}


def export_bundle(path: str | Path, caches: Sequence[DiskCache], **select) -> dict:
    """Write the entries ``select_entries(caches, **select)`` finds; a key asked for but missing is an error."""
    entries, missing = select_entries(caches, **select)
    if missing:
        raise BundleError(f"{len(missing)} requested entries are not in the cache (first: {missing[0]}); "
                          "prefill them first, or check the cache directory")
    return write_bundle(path, entries)


# ---- reading ----
def _open(path: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(path, mode="r:*")
    except (OSError, tarfile.TarError) as e:
        raise BundleError(f"{path} is not a readable bundle ({e}); make one with `rtckern cache export --bundle`")


def _members(tf: tarfile.TarFile, path: Path, limits: Limits) -> Iterator[tuple[tarfile.TarInfo, bytes]]:
    """Every member, checked for type, name and size before its bytes are read."""
    n = total = 0
    while True:
        try:
            m = tf.next()
        except tarfile.TarError as e:
            raise BundleError(f"{path}: damaged archive ({e})") from None
        if m is None:
            return
        n += 1
        if n > limits.max_members + 1:
            raise BundleError(f"{path}: more than {limits.max_members} members; refusing the bundle")
        if not m.isreg():
            kind = "a symbolic link" if m.issym() else "a hard link" if m.islnk() else \
                "a directory" if m.isdir() else "a device or special file"
            raise BundleError(f"{path}: member {m.name!r} is {kind}; a bundle holds regular files only")
        if m.name != INDEX_NAME and not _ENTRY_NAME.match(m.name):
            raise BundleError(f"{path}: member {m.name!r} is not a bundle path (expected {INDEX_NAME} or "
                              f"{LAYOUT}/<2 hex>/<64 hex>.rtk); refusing it (path traversal or foreign file)")
        limit = MAX_INDEX_BYTES if m.name == INDEX_NAME else limits.max_member_bytes
        if m.size > limit:
            raise BundleError(f"{path}: member {m.name!r} is {m.size} bytes, above the limit of {limit}")
        total += m.size
        if total > limits.max_total_bytes:
            raise BundleError(f"{path}: members add up to more than {limits.max_total_bytes} bytes; refusing it")
        f = tf.extractfile(m)
        data = f.read() if f is not None else b""
        if len(data) != m.size:
            raise BundleError(f"{path}: member {m.name!r} is truncated ({len(data)} of {m.size} bytes)")
        yield m, data


def _read_index(data: bytes, path: Path) -> dict[str, dict]:
    try:
        index = json.loads(data)
    except ValueError as e:
        raise BundleError(f"{path}: index {INDEX_NAME} is not JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise BundleError(f"{path}: index format {index.get('format') if isinstance(index, dict) else None!r}; "
                          f"this rtckern reads {FORMAT}")
    out: dict[str, dict] = {}
    for e in index.get("entries", []):
        key = e.get("key", "")
        if not re.fullmatch(r"[0-9a-f]{64}", str(key)) or e.get("path") != f"{LAYOUT}/{key[:2]}/{key}.rtk":
            raise BundleError(f"{path}: index entry {e!r} has a bad key or path")
        if key in out:
            raise BundleError(f"{path}: index lists key {key} twice")
        out[key] = e
    return out


def verify_bundle(path: str | Path, limits: Limits = Limits()) -> tuple[dict[str, dict], int]:
    """Check everything without writing: (index by key, entry bytes). Raises BundleError at the first problem."""
    p = Path(path)
    index: dict[str, dict] | None = None
    seen: set[str] = set()
    nbytes = 0
    with _open(p) as tf:
        for m, data in _members(tf, p, limits):
            if index is None:
                if m.name != INDEX_NAME:
                    raise BundleError(f"{p}: the first member is {m.name!r}, not the index {INDEX_NAME}")
                index = _read_index(data, p)
                continue
            if m.name == INDEX_NAME:
                raise BundleError(f"{p}: a second index member")
            key = _ENTRY_NAME.match(m.name).group(2)
            if m.name[len(LAYOUT) + 1:len(LAYOUT) + 3] != key[:2]:
                raise BundleError(f"{p}: member {m.name!r} is in the wrong shard")
            _check_entry(p, m.name, key, data, index, seen)
            seen.add(key)
            nbytes += len(data)
    if index is None:
        raise BundleError(f"{p}: empty archive (no index {INDEX_NAME})")
    absent = sorted(set(index) - seen)
    if absent:
        raise BundleError(f"{p}: the index lists {len(absent)} entries the archive does not hold (first {absent[0]})")
    return index, nbytes


def _check_entry(p: Path, name: str, key: str, data: bytes, index: dict[str, dict], seen: set[str]) -> None:
    if key in seen:
        raise BundleError(f"{p}: member {name!r} appears twice")
    rec = index.get(key)
    if rec is None:
        raise BundleError(f"{p}: member {name!r} is not in the index")
    if rec.get("size") != len(data) or rec.get("sha256") != hashlib.sha256(data).hexdigest():
        raise BundleError(f"{p}: member {name!r} does not match its digest in the index (corrupt or altered)")
    try:
        entry_format.unpack(data, key)  # valid, and bound to the key it is shipped under
    except entry_format.InvalidEntry as e:
        raise BundleError(f"{p}: member {name!r} is not a valid cache entry ({e})") from None


def import_bundle(path: str | Path, cache: DiskCache, limits: Limits = Limits()) -> dict:
    """Verify the whole bundle, then add its entries to ``cache``. Returns counts: imported, present (same bytes
    already there), kept (a different valid entry already there: kept, with a warning)."""
    p = Path(path)
    index, _ = verify_bundle(p, limits)
    if cache.read_only or not cache.enabled:
        raise BundleError(f"cannot import into {cache.root}: the cache is read-only or not writable")
    imported = present = 0
    kept: list[str] = []
    with _open(p) as tf:
        for m, data in _members(tf, p, limits):
            if m.name == INDEX_NAME:
                continue
            key = _ENTRY_NAME.match(m.name).group(2)
            rec = index[key]
            # Verified above; checked again here because the file could have changed in between.
            if hashlib.sha256(data).hexdigest() != rec["sha256"]:
                raise BundleError(f"{p}: member {m.name!r} changed while importing")
            with cache.lock(key):
                have = cache.get_packed(key)
                if have == data:
                    present += 1
                    continue
                if have is not None:
                    kept.append(key)
                    continue
                meta = dict(rec.get("meta", {}), via=f"bundle:{p.name}")
                if not cache.put_packed(key, data, meta):
                    raise BundleError(f"cannot write to cache directory {cache.root}")
                imported += 1
    if kept:
        msg = (f"{len(kept)} entries of {p} differ from valid entries already in {cache.root} (first {kept[0]}); "
               "kept the existing ones. Same key, different bytes means a non-deterministic compile")
        warnings.warn(msg, CacheWarning, stacklevel=2)
    return {"bundle": str(p), "entries": len(index), "imported": imported, "present": present, "kept": len(kept),
            "cache_dir": str(cache.root)}
