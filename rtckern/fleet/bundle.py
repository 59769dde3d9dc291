"""Bundles: one deterministic file with cache entries and an index of their digests, for shipping caches.

A bundle is a gzip-compressed ustar archive::

    rtckern-bundle.json            the index (first member): format, and per entry key, path, size, sha256, meta
    v1/<k[:2]>/<key>.rtk           entries, byte for byte as in the disk cache, sorted by key

Deterministic: members sorted, mtime 0, uid/gid 0, no user or group names, mode 0644, gzip header without name
or time, and the index holds no timestamps (compile times and creation dates stay out of it). The same entries
give the same bytes.

Import trusts nothing: every member must be a regular file named as above (no links, devices, directories,
absolute paths or ``..``), within the size limits, listed in the index exactly once with the size and sha256 of
its bytes, and a valid entry whose internal digest matches. The entries may add up to at most
``RTCKERN_BUNDLE_MAX_BYTES`` (default 4 GiB) and to at most ``RTCKERN_BUNDLE_MAX_RATIO`` (default 100) times the
bundle's file size (a few KB of gzip can expand to GBs); a truncated download or a malformed index is refused with
one line. Any problem rejects the whole bundle before anything is written. An entry already in the cache and
valid is never replaced by a different one.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import re
import tarfile
import warnings
import zlib
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from ..arch import Arch
from ..cache import CacheWarning, DiskCache, atomic_write
from ..cache import entry as entry_format
from ..errors import BundleError, ConfigError

INDEX_NAME = "rtckern-bundle.json"
FORMAT = "rtckern-bundle/1"
LAYOUT = "v1"
MAX_MEMBER_BYTES = 256 << 20  # the largest cubin rtckern makes is a few MB
MAX_INDEX_BYTES = 64 << 20
MAX_MEMBERS = 200_000
MAX_TOTAL_BYTES = 4 << 30  # defaults of RTCKERN_BUNDLE_MAX_BYTES and RTCKERN_BUNDLE_MAX_RATIO
MAX_RATIO = 100
RATIO_FLOOR_BYTES = 1 << 20  # a bundle may always expand to this much (tiny bundles compress oddly)
# Readable by all: a bundle is copied into images and onto machines where another (non-root) user imports it.
BUNDLE_FILE_MODE = 0o644
# Sidecar fields that describe the kernel; the others (compile_ms, created, via, size, digest, key) vary between
# builds of the same bytes or are recomputed, so they stay out of a deterministic bundle.
META_FIELDS = ("op", "kernel", "name_expression", "template_args", "defines", "options", "source", "arch", "kind",
               "compiler")
_ENTRY_NAME = re.compile(r"^v1/([0-9a-f]{2})/([0-9a-f]{64})\.rtk\Z")


def _strings(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# the types of the meta fields (rtckern.manager's sidecar): strings, lists of strings, defines as [name, value] pairs
_META_TYPES = {**{f: (lambda v: isinstance(v, str)) for f in META_FIELDS}, "template_args": _strings,
               "options": _strings, "defines": lambda v: isinstance(v, list) and all(_strings(d) and len(d) == 2
                                                                                     for d in v)}
_META_WORDS = {**{f: "a string" for f in META_FIELDS}, "template_args": "a list of strings",
               "options": "a list of strings", "defines": "a list of [name, value] string pairs"}
_INDEX_KEYS = {"format", "layout", "count", "entries", "signature"}
_RECORD_KEYS = {"key", "path", "size", "sha256", "meta"}
_HEX64 = re.compile(r"[0-9a-f]{64}", re.ASCII)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What an imported bundle may hold: bytes per member, members, total entry bytes, and entry bytes per byte
    of the bundle file (the expansion ratio; a bundle may always expand to RATIO_FLOOR_BYTES)."""

    max_member_bytes: int = MAX_MEMBER_BYTES
    max_members: int = MAX_MEMBERS
    max_total_bytes: int = MAX_TOTAL_BYTES
    max_ratio: int = MAX_RATIO

    @classmethod
    def from_settings(cls, **changes) -> "Limits":
        """The limits of the settings (RTCKERN_BUNDLE_MAX_BYTES, RTCKERN_BUNDLE_MAX_RATIO), with ``changes``."""
        from ..config import settings

        s = settings()
        for var, value in (("RTCKERN_BUNDLE_MAX_BYTES", s.bundle_max_bytes),
                           ("RTCKERN_BUNDLE_MAX_RATIO", s.bundle_max_ratio)):
            if value < 1:
                raise ConfigError(f"{var}={value} must be at least 1; unset it for the default "
                                  f"({MAX_TOTAL_BYTES if var.endswith('BYTES') else MAX_RATIO})")
        return dataclasses.replace(cls(max_total_bytes=s.bundle_max_bytes, max_ratio=s.bundle_max_ratio), **changes)

    def allowed_total(self, file_bytes: int) -> int:
        return min(self.max_total_bytes, max(self.max_ratio * file_bytes, RATIO_FLOOR_BYTES))


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


def _index_signature(index: dict, secret: bytes) -> str:
    """HMAC-SHA256 of the index without its signature: the index lists every member's sha256, so it signs them
    all (see docs/fleet.md, "What the cache protects against")."""
    import hmac

    body = json.dumps({k: v for k, v in index.items() if k != "signature"}, sort_keys=True).encode()
    return hmac.new(secret, b"rtckern-bundle-index\0" + body, hashlib.sha256).hexdigest()


def bundle_bytes(entries: Sequence[tuple[str, bytes, dict]], secret: bytes | None = None) -> bytes:
    """The bundle for ``entries`` (key, packed, meta), as bytes. Same entries (and secret), same bytes. With a
    secret the index carries its signature."""
    entries = sorted(entries, key=lambda e: e[0])
    index = {"format": FORMAT, "layout": LAYOUT, "count": len(entries), "entries": [
        {"key": k, "path": f"{LAYOUT}/{k[:2]}/{k}.rtk", "size": len(d), "sha256": hashlib.sha256(d).hexdigest(),
         "meta": {f: m[f] for f in META_FIELDS if f in m and _META_TYPES[f](m[f])}} for k, d, m in entries]}
    if secret is not None:
        index["signature"] = {"hmac-sha256": _index_signature(index, secret)}
    index_bytes = (json.dumps(index, indent=1, sort_keys=True) + "\n").encode()
    raw = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tf:
            tf.addfile(_tarinfo(INDEX_NAME, len(index_bytes)), io.BytesIO(index_bytes))
            for key, data, _ in entries:
                tf.addfile(_tarinfo(f"{LAYOUT}/{key[:2]}/{key}.rtk", len(data)), io.BytesIO(data))
    return raw.getvalue()


def write_bundle(path: str | Path, entries: Sequence[tuple[str, bytes, dict]]) -> dict:
    p = Path(path)
    if p.is_dir():
        raise BundleError(f"--bundle {p} is a directory; give a file path, e.g. {p / 'rtckern.bundle'}")
    data = bundle_bytes(entries, _secret())
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(p, data, mode=BUNDLE_FILE_MODE)
    except OSError as e:
        raise BundleError(f"cannot write bundle {p}: {e.strerror or e}; give a writable file path") from None
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
# What a damaged or truncated gzip/tar stream raises while it is read.
_READ_ERRORS = (tarfile.TarError, EOFError, zlib.error, OSError)


class _Budget:
    """What the inflated stream may have given so far: the members' own bytes (each checked against the limits
    before it is read, _members), a tar header and its padding per member, and the readers' look-ahead."""

    __slots__ = ("data", "members")

    def __init__(self):
        self.data = self.members = 0

    def allowed(self) -> int:
        return self.data + _HEADER_BYTES * (self.members + 2) + _LOOKAHEAD_BYTES


_HEADER_BYTES = 1024  # a 512-byte header and up to 511 bytes of padding per member
_LOOKAHEAD_BYTES = 256 << 10  # what the buffered reader and tarfile's stream read ahead of a member


class _Inflated(io.RawIOBase):
    """The decompressed stream of a bundle, refused (BundleError) once it holds more than its budget: tarfile reads
    some header kinds (GNU long names, pax records) whole into memory before any member size is seen, so a bomb
    there is stopped after a few hundred KB."""

    def __init__(self, gz: gzip.GzipFile, budget: _Budget, path: Path):
        self._gz, self._budget, self._path, self.count = gz, budget, path, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self._gz.readinto(b)
        self.count += n
        extra = self.count - self._budget.allowed()
        if extra > 0:
            raise BundleError(f"{self._path}: the archive holds {extra} bytes more than its members, their tar "
                              "headers and look-ahead allow (GNU long names or pax records: a bundle has neither); "
                              "refusing it")
        return n


def _open(f, path: Path, file_bytes: int, budget: _Budget) -> tarfile.TarFile:
    """The bundle in the open binary file ``f`` (``file_bytes`` long; read from its start) as a tar stream, read once
    front to back through ``budget``."""
    f.seek(0)
    try:
        raw = _Inflated(gzip.GzipFile(fileobj=f, mode="rb"), budget, path)
        return tarfile.open(fileobj=io.BufferedReader(raw, 1 << 16), mode="r|")  # a bundle is always gzip
    except EOFError as e:  # a gzip stream that ends early: a bundle cut short (the read runs ahead of the members)
        raise _damaged(path, e) from None
    except _READ_ERRORS as e:
        why = "empty file" if not file_bytes else "not a gzip file" if isinstance(e, gzip.BadGzipFile) else \
            (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise BundleError(f"{path} is not a readable bundle ({why}); make one with `rtckern cache export --bundle`"
                          ) from None


def _damaged(path: Path, e: BaseException) -> BundleError:
    return BundleError(f"{path}: truncated or damaged archive ({e or type(e).__name__}); download it again or "
                       "export it again")


def _members(tf: tarfile.TarFile, path: Path, limits: Limits, file_bytes: int, budget: _Budget
             ) -> Iterator[tuple[tarfile.TarInfo, bytes]]:
    """Every member, checked for type, name and size (its own, the running total and the expansion ratio) before
    its bytes are read; ``budget`` follows what was checked."""
    n = total = 0
    while True:
        try:
            m = tf.next()
        except _READ_ERRORS as e:
            raise _damaged(path, e) from None
        if m is None:
            return
        n += 1
        if n > limits.max_members + 1:
            raise BundleError(f"{path}: more than {limits.max_members} members; refusing the bundle")
        if m.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or m.pax_headers:
            kind = "a symbolic link" if m.issym() else "a hard link" if m.islnk() else \
                "a directory" if m.isdir() else "a sparse file" if m.issparse() else \
                "a file with pax or GNU extended headers" if m.isreg() else "a device or special file"
            raise BundleError(f"{path}: member {m.name!r} is {kind}; a bundle holds plain (ustar) regular files "
                              "only")
        if m.name != INDEX_NAME and not _ENTRY_NAME.match(m.name):
            raise BundleError(f"{path}: member {m.name!r} is not a bundle path (expected {INDEX_NAME} or "
                              f"{LAYOUT}/<2 hex>/<64 hex>.rtk); refusing it (path traversal or foreign file)")
        limit = MAX_INDEX_BYTES if m.name == INDEX_NAME else limits.max_member_bytes
        if m.size > limit:
            raise BundleError(f"{path}: member {m.name!r} is {m.size} bytes, above the limit of {limit}")
        total += m.size
        _check_total(path, total, file_bytes, limits)
        budget.data, budget.members = total, n
        try:
            f = tf.extractfile(m)
            data = f.read() if f is not None else b""
        except _READ_ERRORS as e:
            raise _damaged(path, e) from None
        if len(data) != m.size:
            raise BundleError(f"{path}: member {m.name!r} is truncated ({len(data)} of {m.size} bytes); download "
                              "it again or export it again")
        yield m, data


def _check_total(path: Path, total: int, file_bytes: int, limits: Limits) -> None:
    if total > limits.max_total_bytes:
        raise BundleError(f"{path}: members add up to more than {limits.max_total_bytes} bytes, the limit "
                          "(RTCKERN_BUNDLE_MAX_BYTES); refusing it")
    if total > limits.allowed_total(file_bytes):
        raise BundleError(f"{path}: members add up to more than {limits.max_ratio} times the bundle's "
                          f"{file_bytes} bytes (RTCKERN_BUNDLE_MAX_RATIO; a compression bomb?); refusing it")


def _secret() -> bytes | None:
    from ..cache.secret import read_secret
    from ..config import settings

    return read_secret(settings().cache_secret_file)


def _check_signature(index: dict, path: Path) -> None:
    """With a cache secret set, the index must carry a signature made with it; without one, it is not checked."""
    import hmac

    secret = _secret()
    if secret is None:
        return
    sig = index.get("signature")
    given = sig.get("hmac-sha256") if isinstance(sig, dict) else None
    if not isinstance(given, str):
        raise BundleError(f"{path}: the bundle is not signed, and a cache secret is set (RTCKERN_CACHE_SECRET_FILE); "
                          "export it with the same secret set")
    if not hmac.compare_digest(given, _index_signature(index, secret)):
        raise BundleError(f"{path}: the bundle's signature does not verify with this cache secret "
                          "(RTCKERN_CACHE_SECRET_FILE): made without the secret, or altered")


def _read_index(data: bytes, path: Path) -> dict[str, dict]:
    try:
        index = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError included; RecursionError: nesting too deep
        raise BundleError(f"{path}: index {INDEX_NAME} is not JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise BundleError(f"{path}: index format {index.get('format') if isinstance(index, dict) else None!r}; "
                          f"this rtckern reads {FORMAT}")
    if set(index) - _INDEX_KEYS or index.get("layout", LAYOUT) != LAYOUT:
        raise BundleError(f"{path}: index has fields {sorted(index)} and layout {index.get('layout')!r}; "
                          f"{FORMAT} has {sorted(_INDEX_KEYS)} and layout {LAYOUT!r}")
    entries = index.get("entries", [])
    if not isinstance(entries, list):
        raise BundleError(f"{path}: index entries is {type(entries).__name__}, not a list of objects")
    if "count" in index and index["count"] != len(entries):
        raise BundleError(f"{path}: index count {index['count']!r} but it lists {len(entries)} entries")
    out: dict[str, dict] = {}
    for i, e in enumerate(entries):
        key = _check_record(path, i, e)
        if key in out:
            raise BundleError(f"{path}: index lists key {key} twice")
        out[key] = e
    _check_signature(index, path)
    return out


def _check_record(path: Path, i: int, e: object) -> str:
    """One index entry: an object with key, path, size, sha256 and meta of the right types. Returns its key."""
    where = f"{path}: index entry {i}"
    if not isinstance(e, dict):
        raise BundleError(f"{where} is {type(e).__name__} {e!r:.80}, not an object with key, path, size, sha256")
    key = e.get("key")
    if not isinstance(key, str) or not _HEX64.fullmatch(key) or e.get("path") != f"{LAYOUT}/{key[:2]}/{key}.rtk":
        raise BundleError(f"{where} has a bad key or path ({e.get('key')!r:.80}, {e.get('path')!r:.80})")
    size, sha = e.get("size"), e.get("sha256")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not isinstance(sha, str) \
            or not _HEX64.fullmatch(sha):
        raise BundleError(f"{where} ({key}) has a bad size or sha256 ({size!r:.40}, {sha!r:.80})")
    meta = e.get("meta", {})
    if set(e) - _RECORD_KEYS or not isinstance(meta, dict) or set(meta) - set(META_FIELDS):
        raise BundleError(f"{where} ({key}) has fields {sorted(e)} and meta fields "
                          f"{sorted(meta) if isinstance(meta, dict) else type(meta).__name__}; a bundle entry has "
                          f"{sorted(_RECORD_KEYS)} and meta fields among {', '.join(META_FIELDS)}")
    for field, value in meta.items():  # as the manager writes them: the cache's readers (ls, export) rely on it
        if not _META_TYPES[field](value):
            raise BundleError(f"{where} ({key}) has meta {field}={value!r:.80}; it must be {_META_WORDS[field]}")
    return key


def bundle_file(path: str | Path) -> Path:
    """path as a Path; BundleError when it is not a file (missing, or a directory)."""
    p = Path(path)
    if not p.is_file():
        raise BundleError(f"{p}: {'a directory' if p.is_dir() else 'no such file'}; give a bundle file "
                          "(made by `rtckern cache export --bundle`)")
    return p


def verify_bundle(path: str | Path, limits: Limits | None = None) -> tuple[dict[str, dict], int]:
    """Check everything without writing: (index by key, entry bytes). Raises BundleError at the first problem.
    ``limits``: default ``Limits.from_settings()``."""
    p = bundle_file(path)
    with open(p, "rb") as f:
        return _verify(f, p, limits or Limits.from_settings())


def _entries(f, p: Path, limits: Limits) -> Iterator[tuple[tarfile.TarInfo, bytes]]:
    """The members of the bundle open in ``f``, from its start (each read checked: _members)."""
    budget, file_bytes = _Budget(), os.fstat(f.fileno()).st_size
    with _open(f, p, file_bytes, budget) as tf:
        yield from _members(tf, p, limits, file_bytes, budget)


def _verify(f, p: Path, limits: Limits) -> tuple[dict[str, dict], int]:
    index: dict[str, dict] | None = None
    seen: set[str] = set()
    nbytes = 0
    for m, data in _entries(f, p, limits):
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


def import_bundle(path: str | Path, cache: DiskCache | Callable[[], DiskCache],
                  limits: Limits | None = None) -> dict:
    """Verify the whole bundle, then add its entries to ``cache``. Returns counts: imported, present (same bytes
    already there), kept (a different valid entry already there: kept, with a warning). ``limits``: default
    ``Limits.from_settings()``. ``cache`` may be a callable that makes the cache, called once the bundle has
    verified: a bad bundle then leaves no new cache directory behind. Both passes read one open file, and every
    member of the second must be the verified one, so a bundle rewritten in place meanwhile is refused (what was
    imported before that is valid and stays)."""
    p = bundle_file(path)
    limits = limits or Limits.from_settings()
    with open(p, "rb") as f:
        index, _ = _verify(f, p, limits)
        if callable(cache) and not hasattr(cache, "put_packed"):  # a factory, not a cache
            cache = cache()
        if cache.read_only or not cache.enabled:
            raise BundleError(f"cannot import into {cache.root}: the cache is read-only or not writable")
        imported = present = 0
        kept: list[str] = []
        done: set[str] = set()
        for m, data in _entries(f, p, limits):
            if m.name == INDEX_NAME:
                continue
            key = _ENTRY_NAME.match(m.name).group(2)
            rec = index.get(key)
            # Verified above; checked again here because the file could have changed in between.
            if rec is None or key in done or hashlib.sha256(data).hexdigest() != rec["sha256"]:
                raise BundleError(f"{p}: member {m.name!r} changed while importing; import it again")
            done.add(key)
            meta = dict(rec.get("meta", {}), via=f"bundle:{p.name}")
            with cache.lock(key):
                have = cache.get_packed(key)
                if have == data:
                    present += 1
                    if not cache.has_sidecar(key, data):  # an entry whose sidecar was lost: written again
                        cache.put_packed(key, data, meta)
                    continue
                if have is not None:
                    kept.append(key)
                    continue
                if not cache.put_packed(key, data, meta):
                    raise BundleError(f"cannot write to cache directory {cache.root}")
                imported += 1
        if done != set(index):
            raise BundleError(f"{p}: changed while importing ({len(set(index) - done)} verified entries are no "
                              "longer in it); import it again")
    if kept:
        msg = (f"{len(kept)} entries of {p} differ from valid entries already in {cache.root} (first {kept[0]}); "
               "kept the existing ones. Same key, different bytes means a non-deterministic compile")
        warnings.warn(msg, CacheWarning, stacklevel=2)
    return {"bundle": str(p), "entries": len(index), "imported": imported, "present": present, "kept": len(kept),
            "cache_dir": str(cache.root)}
