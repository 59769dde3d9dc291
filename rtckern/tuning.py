"""Tuned-config tables: the best launch/tile config per (arch, SM count, device class, shape key), and autotuning.

Tables
------
One JSON file per op: shipped defaults in ``rtckern/tuning_tables/<op>.json``, the user's in
``<tuning dir>/<op>.json`` (``RTCKERN_TUNING_DIR``, default ``<cache dir>/tuning``)::

    {"format": 2, "op": "rms_norm", "key_fields": ["dtype", "n"],
     "rows": [{"arch": "sm_90", "sm_count": 132, "device_class": "h200", "shape": {"dtype": "bf16", "n": 4096},
               "config": {"block": 256, "vec": 8}, "time_us": 6.1, "date": "2026-11-26T03:00:00Z",
               "versions": {"rtckern": "0.1.0", "nvrtc": "13.0", "driver": "13.0", "device": "NVIDIA H200"}}]}

A row's key is (arch, sm_count, device_class, the shape values in key_fields order); ``arch`` is the device's compute
capability without a feature suffix (``sm_90``), so rows for many archs, SM counts and device classes live in one
table without colliding. ``device_class`` (rtckern.device.device_class: "h100-sxm", "h200", "a100-80g", ..., else
the device name normalized) tells apart GPUs that (arch, SM count) does not: an H100 SXM and an H200 are both sm_90
with 132 SMs, yet 3.35 vs 4.8 TB/s moves the best config of memory-bound shapes. A row without it (format 1
tables; a row written by hand) serves any class. Rows with one key in one file are an error that names the file and
lists every duplicate; so are duplicate keys among the rows one merge writes.

Format 2 added ``device_class``; format 1 tables still load (their rows serve any class). `migrate` turns a format
1 table into format 2, giving each row the class of the device its ``versions`` name (``device`` or ``gpu``):
deterministic, so the shipped tables were migrated by it (tests/unit/test_tuning.py checks they stay so).
A process reads each op's tables once (``tables``); ``rtckern tune`` (``merge_rows``) reloads what it writes, and
``rtckern.clear_caches()`` makes a running process use tables another process changed (``reload()`` alone re-reads
them for later lookups; the ops keep the configs they memoized until clear_caches).

Lookup rule (``lookup``)
------------------------
1. The device's class, when it has one (a live device; a described one given ``device_class``): a row with the
   device's arch, SM count, class and shape key, or of no class with that key (a user's row written by hand or by
   an older rtckern), table by table (the user table before the shipped one); else the nearest shape
   (the rule of step 3) among rows of that arch, SM count and class, unless it is more than ``OWN_NEAREST_MAX``
   away (a factor 2 in one dimension) while a row of another class or SM count has this exact shape: then steps
   2 and 3 answer (one tuned shape on a new device does not take over every shape).
2. Any class, exact: a row with the device's arch, SM count and shape key, of no class ("any") or of another
   class; rows of no class first, then the class whose memory bandwidth is nearest the device's (|log2 ratio| of
   ``rtckern.device.CLASS_BANDWIDTH_TBPS``; classes of unknown bandwidth last), then the user table, then file
   order. Bandwidth, because it is what (arch, SM count) leaves out and what moves the best config of the
   memory-bound shapes (decode GEMMs, norms); compute-bound shapes want the same config on both.
3. Any class, nearest shape, among rows of the same arch whose non-integer key fields (dtype, layout) are equal and
   whose config the op accepts for this shape (``valid``): the smallest shape distance, the sum over integer fields
   of |log2(row) - log2(query)| (scale-free: 2048 is as far from 4096 as 4096 from 8192); ties go to the closer SM
   count, then to the nearer class (as in step 2), then to the row with fewer fields below the query's (a config
   tuned for a larger problem over one for a smaller), then to the user table, then to file order.
4. The op's heuristic, if it gave one; otherwise no config (None).
Rows of another arch are never used: a config tuned on sm_80 says nothing reliable about sm_90. A device without a
class (described by arch alone) starts at step 2: it gets what every device of its arch and SM count got before
classes existed. ``Tuned.describe()`` (in `rtckern explain`) names the row that served and whether its class
matched, and where step 1's nearest shape answered before another class's exact row of the key, that row
(``Tuned.hidden``; `rtckern tune` lists such rows after it merges: ``shadowed_rows``).

Autotuning
----------
An op registers a ``Tuner`` (its key fields, candidate configs for a request, and a timing hook);
``rtckern tune OP --shapes ...`` times every config on the live GPU, keeps the fastest per shape and merges the
winners into the user's table, replacing rows with the same key and keeping every other row. Each row's
``source`` names the ``rtckern tune`` command that made it; a tuner may write several tables (``table_rows``:
the norms write the fastest config of each kernel kind and the fastest kind).
"""
from __future__ import annotations

import collections.abc
import dataclasses
import datetime
import functools
import hashlib
import importlib
import json
import marshal
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rtckern import config
from rtckern.cache import file_memo
from rtckern.caches import PlanCache
from rtckern.errors import RtckernError

FORMAT = 2
READ_FORMATS = (1, 2)  # format 1: rows without device_class (any class)
SHIPPED_DIR = Path(__file__).resolve().parent / "tuning_tables"

KeyValue = int | str


class TuningTableError(RtckernError, ValueError):
    """A tuning table that cannot be used as written (bad format, duplicate keys)."""


@dataclass(frozen=True)
class Row:
    """One row of a tuning table: its key (arch, SM count, device class, shape) and config. `meta` is a Mapping: a
    dict from the JSON, or a read-only view that a shipped table's memo fills on first use (tuning._MemoMeta)."""
    arch: str
    sm_count: int
    shape: tuple[tuple[str, KeyValue], ...]  # in the table's key_fields order
    config: Mapping[str, Any]
    meta: Mapping[str, Any] = field(default_factory=dict)  # time_us, date, versions, ...
    index: int = -1  # position in its file, for messages
    device_class: str | None = None  # None: serves any class

    @property
    def key(self) -> tuple:
        return (self.arch, self.sm_count, self.device_class, self.shape)

    def to_json(self) -> dict[str, Any]:
        cls = {"device_class": self.device_class} if self.device_class else {}
        return {"arch": self.arch, "sm_count": self.sm_count, **cls, "shape": dict(self.shape),
                "config": dict(self.config), **dict(self.meta)}


@dataclass(frozen=True)
class Table:
    """One tuning table file, with its indexes."""
    op: str
    key_fields: tuple[str, ...]
    rows: tuple[Row, ...]
    path: Path | None = None
    # Indexes built once per table: exact rows by key (the first of a key wins), rows by (arch, SM count, shape) of
    # every class, and each arch's rows, in file order.
    exact: Mapping[tuple, Row] = field(init=False, repr=False, compare=False)
    by_shape: Mapping[tuple, tuple[Row, ...]] = field(init=False, repr=False, compare=False)
    by_arch: Mapping[str, tuple[Row, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        exact: dict[tuple, Row] = {}
        by_shape: dict[tuple, list[Row]] = {}
        by_arch: dict[str, list[Row]] = {}
        for r in self.rows:
            arch, sms, shape = r.arch, r.sm_count, r.shape
            exact.setdefault((arch, sms, r.device_class, shape), r)
            by_shape.setdefault((arch, sms, shape), []).append(r)
            by_arch.setdefault(arch, []).append(r)
        object.__setattr__(self, "exact", exact)
        object.__setattr__(self, "by_shape", {k: tuple(rs) for k, rs in by_shape.items()})
        object.__setattr__(self, "by_arch", {a: tuple(rs) for a, rs in by_arch.items()})

    def to_json(self) -> dict[str, Any]:
        rows = sorted(self.rows, key=lambda r: (r.arch, r.sm_count, r.device_class or "",
                                                [str(v) for _, v in r.shape]))
        return {"format": FORMAT, "op": self.op, "key_fields": list(self.key_fields),
                "rows": [r.to_json() for r in rows]}


@dataclass(frozen=True)
class Tuned:
    """A lookup's answer: the config, where it came from ("exact", "nearest", "heuristic"), the row, and how the
    row's class relates to the device's (`match`: "class" the device's own, "any" a row of no class, "other" a
    row of another class, the fallback; "" for the heuristic)."""

    config: Mapping[str, Any]
    source: str
    row: Row | None = None
    path: Path | None = None
    match: str = ""
    device_class: str | None = None  # the device's
    hidden: Row | None = None  # with a nearest own-class answer: another class's exact row of the key, not reached

    def describe(self) -> str:
        """One phrase for explain: which row served and whether it matched the device's class."""
        dev = f"class {self.device_class}" if self.device_class else "no class"
        if self.row is None:
            return f"the heuristic (no table row of this arch serves; device of {dev})"
        r = self.row
        where = f"{self.source} row {r.index} of {self.path.name if self.path else 'the table'}"
        what = ", ".join(f"{k}={v}" for k, v in r.shape)
        tuned = f"({r.arch}, {r.sm_count} SMs, class {r.device_class or 'any'}: {what})"
        if self.match == "class":
            how = f"the device's class {self.device_class}"
        elif self.device_class:
            how = f"no row of the device's class {self.device_class} serves, fell back to " + \
                  ("a row of any class" if self.match == "any" else f"class {r.device_class}")
        else:
            how = "a device of no class (described without --device-class): rows of any class serve"
        if self.hidden is not None:
            how += (f" (class {self.hidden.device_class or 'any'} has an exact row of this shape, which the nearest "
                    "own row answers before: tune this shape on this device's class)")
        return f"{where} {tuned}; {how}"


# -- loading -----------------------------------------------------------------------------------------------------
def parse_table(data: Any, path: Path | str, op: str | None = None, *, check_rows: bool = True) -> Table:
    """The table in `data` (a file's JSON). check_rows=False skips the per-row checks, for the shipped tables only:
    they are package data, checked row by row by tests/unit/test_tuning.py, and their checks were half the cost
    of an op's first call into the tuning tables."""
    where = str(path)
    if not isinstance(data, dict) or data.get("format") not in READ_FORMATS:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise TuningTableError(f"{where}: not a tuning table of format {' or '.join(map(str, READ_FORMATS))} "
                               f"(format {got!r})")
    table_op = data.get("op")
    if op is not None and table_op != op:
        raise TuningTableError(f"{where}: table is for op {table_op!r}, expected {op!r} (the file name picks the op)")
    fields = data.get("key_fields")
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields) or len(set(fields)) != len(fields):
        raise TuningTableError(f"{where}: key_fields must be a list of distinct names, got {fields!r}")
    raw_rows = data.get("rows")
    if not isinstance(raw_rows, list):
        raise TuningTableError(f"{where}: 'rows' must be a list")
    if check_rows:
        for i, raw in enumerate(raw_rows):
            _check_row(raw, i, fields, where)
    order = tuple(fields)
    rows = [_row(raw, i, fields, order) for i, raw in enumerate(raw_rows)]
    dups = duplicate_keys(rows) if check_rows else None
    if dups:
        raise TuningTableError(
            f"{where}: {_duplicates_text(dups, lambda r: json.dumps(raw_rows[r.index], sort_keys=True))}. Keep one "
            "row of each key (rtckern tune merges by key, so duplicates come from hand edits or concatenated files)")
    return Table(op=table_op, key_fields=tuple(fields), rows=tuple(rows), path=Path(path))


def duplicate_keys(rows: Sequence[Row]) -> list[list[Row]]:
    """Every group of rows sharing one key (arch, SM count, device class, shape), in order of first row."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.key, []).append(r)
    return [g for g in groups.values() if len(g) > 1]


def _duplicates_text(dups: list[list[Row]], show: Callable[[Row], str]) -> str:
    parts = []
    for g in dups:
        idx = [str(r.index) for r in g]
        which = f"{', '.join(idx[:-1])} and {idx[-1]}"
        parts.append(f"rows {which} have the same key ({_key_text(g[0])}); "
                     + "; ".join(f"row {r.index}: {show(r)}" for r in g))
    head = "" if len(dups) == 1 else f"{len(dups)} duplicate keys: "
    return head + " | ".join(parts)


def _check_row(raw: Any, i: int, fields: list[str], where: str) -> None:
    if not isinstance(raw, dict):
        raise TuningTableError(f"{where}: row {i} is not an object: {raw!r}")
    missing = [k for k in ("arch", "sm_count", "shape", "config") if k not in raw]
    if missing:
        raise TuningTableError(f"{where}: row {i} lacks {missing}: {json.dumps(raw, sort_keys=True)}")
    arch, sms, shape, cfg = raw["arch"], raw["sm_count"], raw["shape"], raw["config"]
    if not isinstance(arch, str) or not re.fullmatch(r"sm_\d+|gfx[0-9a-f]+", arch):
        raise TuningTableError(f"{where}: row {i}: arch {arch!r} should be like 'sm_90' or 'gfx90a' (rows are keyed "
                               "by the compute capability, without a feature suffix such as the a of sm_90a)")
    if not isinstance(sms, int) or isinstance(sms, bool) or sms <= 0:
        raise TuningTableError(f"{where}: row {i}: sm_count {sms!r} should be a positive integer")
    if not isinstance(shape, dict) or shape.keys() != set(fields):
        raise TuningTableError(f"{where}: row {i}: shape {shape!r} must have exactly the key fields {fields}")
    for k, v in shape.items():
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise TuningTableError(f"{where}: row {i}: shape[{k!r}] = {v!r} must be an int or a string")
    if not isinstance(cfg, dict):
        raise TuningTableError(f"{where}: row {i}: config must be an object, got {cfg!r}")
    cls = raw.get("device_class")
    if cls is not None and (not isinstance(cls, str) or not _CLASS_RE.fullmatch(cls)):
        raise TuningTableError(f"{where}: row {i}: device_class {cls!r} should be a short lowercase name like "
                               "'h100-sxm' or 'h200' (leave it out for a row that serves any class)")


_new_row = object.__new__


def _row(raw: dict, i: int, fields: list[str], order: tuple[str, ...]) -> Row:
    """A row of the table's JSON (checked by _check_row, or shipped); `order` is tuple(fields). Built by filling the
    frozen dataclass's attributes directly: its __init__ (one object.__setattr__ per field) was most of a shipped
    table's parse, ~3 us a row, which an op's first call pays for every row of its tables (gemm_fp8's 904)."""
    row = _new_row(Row)
    shape = raw["shape"]
    key = tuple(shape.items()) if tuple(shape) == order else tuple([(f, shape[f]) for f in fields])
    row.__dict__.update(arch=raw["arch"], sm_count=raw["sm_count"], shape=key,
                        config=raw["config"], meta={k: v for k, v in raw.items() if k not in _ROW_KEYS}, index=i,
                        device_class=raw.get("device_class"))
    return row


_CLASS_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}", re.ASCII)
_ROW_KEYS = frozenset(("arch", "sm_count", "device_class", "shape", "config"))


def _key_text(row: Row) -> str:
    cls = [f"device_class={row.device_class}"] if row.device_class else []
    return ", ".join([f"arch={row.arch}", f"sm_count={row.sm_count}"] + cls + [f"{k}={v}" for k, v in row.shape])


def migrate(data: Mapping[str, Any]) -> dict[str, Any]:
    """A table's JSON in the current format: a format 1 table's rows get the class of the device their `versions`
    name (``device``, else ``gpu``; a row that names none stays of any class), inserted after ``sm_count``; other
    fields keep their order. Deterministic; a current table is returned as it is (copied)."""
    out = json.loads(json.dumps(data))
    if out.get("format") == FORMAT:
        return out
    if out.get("format") not in READ_FORMATS:
        raise TuningTableError(f"cannot migrate a table of format {out.get('format')!r}")
    from rtckern.device import class_of_name

    rows = []
    for raw in out.get("rows", []):
        vers = raw.get("versions") if isinstance(raw.get("versions"), dict) else {}
        name = vers.get("device") or vers.get("gpu") or ""
        cls = raw.get("device_class") or (class_of_name(name) if name and not name.startswith("sm_") else None)
        new = {}
        for k, v in raw.items():
            if k == "device_class":
                continue
            new[k] = v
            if k == "sm_count" and cls:
                new["device_class"] = cls
        rows.append(new)
    out["format"] = FORMAT
    out["rows"] = rows
    return {k: out[k] for k in ("format", *[k for k in out if k != "format"])}


_cache = PlanCache("tuning.tables", 256)
_cache_lock = threading.Lock()


def load_table(path: Path | str, op: str | None = None, *, check_rows: bool = True) -> Table | None:
    """The table at path (None if the file does not exist); re-read when the file changes. check_rows: see
    parse_table; a table read without them (a shipped one) is remembered parsed in the cache dir (_memo_path)."""
    p = Path(path)
    try:
        st = p.stat()
    except (FileNotFoundError, NotADirectoryError):  # no file (or a file where a directory of the path should be)
        return None
    stamp = (st.st_mtime_ns, st.st_size)
    with _cache_lock:
        hit = _cache.get(p)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    try:
        text = p.read_bytes()
    except OSError as exc:  # a directory, or unreadable: an error naming the path, not a traceback
        raise TuningTableError(f"{p}: cannot read the tuning table ({exc.strerror or exc}); fix its permissions or "
                               "move it away") from None
    memo = _memo_path(p, text) if not check_rows else None
    table = _from_memo(file_memo.read(memo), p, op)
    if table is None:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise TuningTableError(f"{p}: not valid JSON ({exc}); fix or delete the file") from None
        table = parse_table(data, p, op, check_rows=check_rows)
        if memo is not None:
            file_memo.write(memo, _memo_bytes(table))
    with _cache_lock:
        _cache.put(p, (stamp, table))
    return table


# A shipped table's parsed rows, remembered in the cache dir (cache/file_memo.py) under a digest of the file's bytes:
# the next process unmarshals them (~3x faster than JSON and building the rows, the bulk of an op's first call into
# its tables), the rows' meta (time_us, date, versions, source: over half the bytes, which a lookup never reads) only
# when a row's meta is read. Keyed by contents, not by mtime: an edit in place is a new memo whatever its timestamp;
# and by this module's own bytes, so an rtckern whose parsing or memo format changed reads no other's memo. The
# memo's own bytes carry their sha256, so a damaged memo is a miss, never a wrong row.


class _Metas:
    """The memo's metas of every row, unmarshalled on first use."""

    __slots__ = ("_blob", "_list")

    def __init__(self, blob: bytes):
        self._blob, self._list = blob, None

    def get(self) -> list:
        got = self._list
        if got is None:
            got = self._list = marshal.loads(self._blob)
        return got


class _MemoMeta(collections.abc.Mapping):
    """A memoized row's meta, read from the table's _Metas when first asked for."""

    __slots__ = ("_metas", "_i")

    def __init__(self, metas: _Metas, i: int):
        self._metas, self._i = metas, i

    def __getitem__(self, key):
        return self._metas.get()[self._i][key]

    def __iter__(self):
        return iter(self._metas.get()[self._i])

    def __len__(self) -> int:
        return len(self._metas.get()[self._i])

    def __repr__(self) -> str:
        return repr(self._metas.get()[self._i])


def _memo_key(text: bytes) -> str:
    return f"{_parser_digest()}|{hashlib.sha256(text).hexdigest()}"


def _memo_path(p: Path, text: bytes) -> Path | None:
    return file_memo.memo_path("tables", p.stem, _memo_key(text), ".marshal") if _parser_digest() else None


@functools.lru_cache(maxsize=1)
def _parser_digest() -> str:
    """What else a memo's rows depend on: marshal's version and the code that parses tables and writes and reads
    memos, as the bytes of this module's file ("" where the file cannot be read: no memos)."""
    try:
        return f"{marshal.version}|{hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}"
    except OSError:
        return ""


def _memo_bytes(t: Table) -> bytes:
    rows = [(r.arch, r.sm_count, r.device_class, r.shape, dict(r.config)) for r in t.rows]
    metas = marshal.dumps([dict(r.meta) for r in t.rows])
    payload = marshal.dumps((t.op, list(t.key_fields), rows, metas))
    return hashlib.sha256(payload).digest() + payload


def _from_memo(blob: bytes | None, p: Path, op: str | None) -> Table | None:
    """The table in a memo written by _memo_bytes, or None (no memo, damaged, another structure, another op)."""
    if blob is None or hashlib.sha256(blob[32:]).digest() != blob[:32]:
        return None
    try:
        table_op, fields, raw_rows, metas = marshal.loads(blob[32:])
        if (op is not None and table_op != op) or type(metas) is not bytes:
            return None  # another op: parse_table says so
        rows, lazy = [], _Metas(metas)
        for i, (arch, sms, cls, shape, cfg) in enumerate(raw_rows):
            row = _new_row(Row)
            row.__dict__.update(arch=arch, sm_count=sms, shape=shape, config=cfg, meta=_MemoMeta(lazy, i), index=i,
                                device_class=cls)
            rows.append(row)
        return Table(op=table_op, key_fields=tuple(fields), rows=tuple(rows), path=p)
    except (ValueError, EOFError, TypeError, AttributeError):  # a memo of another structure (its digest matched)
        return None


def shipped_memo_names() -> set[str]:
    """The file names of the shipped tables' memos as the tables are now, in any cache dir (`rtckern cache prune
    --superseded` keeps these)."""
    return {file_memo.memo_name(p.stem, _memo_key(p.read_bytes()), ".marshal")
            for p in sorted(SHIPPED_DIR.glob("*.json"))}


def user_dir() -> Path:
    s = config.settings()
    return s.tuning_table_dir if s.tuning_table_dir is not None else s.cache_dir / "tuning"


def user_table_path(op: str) -> Path:
    return user_dir() / f"{op}.json"


def shipped_table_path(op: str) -> Path:
    return SHIPPED_DIR / f"{op}.json"


_op_tables = PlanCache("tuning.op_tables", 256)


def tables(op: str) -> list[Table]:
    """The op's tables in lookup order: the user's, then the shipped one.

    Read once per process (per settings: a settings change reads them again): a lookup neither stats nor parses a
    file after the first one of its op. `merge_rows` (so `rtckern tune`) reloads what it writes; a process that
    should see tables another process wrote calls `rtckern.clear_caches()`, which also drops the ops' configs
    memoized from the old rows (`reload()` alone re-reads the tables for lookups made after it)."""
    memo = (op, SHIPPED_DIR, user_dir())
    hit = _op_tables.get(memo)
    if hit is None:
        found = (load_table(user_table_path(op), op), load_table(shipped_table_path(op), op, check_rows=False))
        hit = _op_tables.put(memo, tuple(t for t in found if t is not None))
    return list(hit)


def reload() -> None:
    """Forget the tables read so far: the next lookup of each op reads its files again."""
    _op_tables.clear()


# -- lookup --------------------------------------------------------------------------------------------------------
def arch_key(device: Any) -> str:
    """The arch a row is keyed by: the device's compute capability, no feature suffix (sm_90, not sm_90a)."""
    return device.arch.base().sm if hasattr(device.arch, "base") else device.arch.sm


def class_key(device: Any) -> str | None:
    """The device class a row is keyed by (rtckern.device.device_class); None for a device of no known class."""
    from rtckern.device import device_class

    return device_class(device)


def class_distance(row_class: str | None, device_class_: str | None) -> float:
    """How far a row's class is from the device's, for the fallback to other classes (module docstring, lookup
    step 2): 0 for a row of no class, then 1 + |log2| of the ratio of their memory bandwidths; 1 for every class
    when the device has none; 1000 where a bandwidth is unknown (after every known class)."""
    from rtckern.device import CLASS_BANDWIDTH_TBPS

    if row_class is None:
        return 0.0
    if device_class_ is None:
        return 1.0
    a, b = CLASS_BANDWIDTH_TBPS.get(row_class), CLASS_BANDWIDTH_TBPS.get(device_class_)
    if a is None or b is None:
        return 1.0 if row_class == device_class_ else 1000.0
    return 1.0 + abs(math.log2(a / b))


def lookup(op: str, device: Any, key: Mapping[str, KeyValue], *,
           heuristic: Callable[[Mapping[str, KeyValue], Any], Mapping[str, Any]] | None = None,
           valid: Callable[[Mapping[str, Any], Mapping[str, KeyValue]], bool] | None = None,
           exact: Sequence[str] = (), tables_: Sequence[Table] | None = None) -> Tuned | None:
    """The config for `key` on `device` by the rule in this module's docstring (exact, nearest shape,
    heuristic). `valid(config, key)` rejects a neighbour's config that cannot serve this shape; `exact` names
    integer key fields a neighbour must share (a head dim, a flag stored as 0 / 1), where distance means nothing."""
    arch, sms, cls = arch_key(device), device.sm_count, class_key(device)
    ts = list(tables_) if tables_ is not None else tables(op)
    for t in ts:
        missing = [f for f in t.key_fields if f not in key]
        if missing:
            raise KeyError(f"tuning lookup for {op!r}: key {dict(key)} lacks {missing} (table {t.path} is keyed "
                           f"by {list(t.key_fields)})")

    def match(row: Row) -> str:
        return "class" if cls is not None and row.device_class == cls else ("any" if row.device_class is None
                                                                             else "other")

    if cls is not None:  # 1. the device's class: exact shape, then nearest among its (arch, SM count, class) rows
        for t in ts:  # (a table's row of no class with this exact shape, e.g. a user's older row, comes next)
            shape = tuple((f, key[f]) for f in t.key_fields)
            row = t.exact.get((arch, sms, cls, shape))
            if row is not None:
                return Tuned(row.config, "exact", row, t.path, "class", cls)
            row = t.exact.get((arch, sms, None, shape))
            if row is not None:
                return Tuned(row.config, "exact", row, t.path, "any", cls)
        found = _nearest(ts, arch, sms, cls, key, valid, lambda r: r.sm_count == sms and r.device_class == cls, exact)
        if found is not None and _distance(found[0], key) > OWN_NEAREST_MAX and \
                _exact_elsewhere(ts, arch, key, valid, exact):
            found = None  # a far own row (one tuned shape of a new device) does not outrank another's exact shape
        if found is not None:
            hidden = next((r for t in ts for r in t.by_shape.get((arch, sms, tuple((f, key[f]) for f in t.key_fields)),
                                                                 ()) if r.device_class != cls), None)
            return Tuned(found[0].config, "nearest", found[0], found[1], "class", cls, hidden)
    best: tuple | None = None  # 2. any class, exact shape: no class first, then the nearest class by bandwidth
    for ti, t in enumerate(ts):
        for row in t.by_shape.get((arch, sms, tuple((f, key[f]) for f in t.key_fields)), ()):
            if cls is not None and row.device_class == cls:
                continue  # seen in step 1
            rank = (class_distance(row.device_class, cls), ti, row.index)
            if best is None or rank < best[0]:
                best = (rank, row, t.path)
    if best is not None:
        return Tuned(best[1].config, "exact", best[1], best[2], match(best[1]), cls)
    found = _nearest(ts, arch, sms, cls, key, valid, None, exact)  # 3. any class, nearest shape
    if found is not None:
        return Tuned(found[0].config, "nearest", found[0], found[1], match(found[0]), cls)
    if heuristic is not None:
        return Tuned(dict(heuristic(key, device)), "heuristic", device_class=cls)
    return None


# How far (sum of |log2 ratio| over the shape's integers) the device's own nearest row may be and still answer before
# a row of another class or SM count with this exact shape: a factor 2 in one dimension.
OWN_NEAREST_MAX = 1.0


def _exact_elsewhere(ts: Sequence[Table], arch: str, key: Mapping[str, KeyValue],
                     valid: Callable[[Mapping[str, Any], Mapping[str, KeyValue]], bool] | None,
                     exact: Sequence[str]) -> bool:
    """Whether a row of this arch (any class, any SM count) has exactly this shape and may serve it."""
    return _nearest(ts, arch, 0, None, key, valid, lambda r: _distance(r, key) == 0, exact) is not None


def shadowed_rows(ts: Sequence[Table], arch: str, sms: int, cls: str | None, exact: Sequence[str] = ()) -> list[Row]:
    """Rows of other device classes (or of none) with this (arch, SM count) that a device of class `cls` no longer
    reads: its own class has no row of their shape but has one within OWN_NEAREST_MAX of it whose non-integer key
    fields (layout, dtype, mode, ...) match, so the lookup's first step (own class, nearest shape) answers before
    their exact shape is looked at. A partial shape list tuned for one class does this; tuning the shapes of these
    rows too ends it."""
    if cls is None:
        return []

    def kind(row: Row) -> tuple:
        return tuple((f, v) for f, v in row.shape if not isinstance(v, int) or isinstance(v, bool))

    def near(r: Row) -> bool:  # an own row of its kind within OWN_NEAREST_MAX answers before it (lookup, step 1),
        key = dict(r.shape)  # one sharing the op's exact fields (lookup's `exact`)
        return any(d is not None and d <= OWN_NEAREST_MAX for d in (
            _distance(m, key) for m in mine if not any(v != key[f] for f, v in m.shape if f in exact)))

    mine = [r for t in ts for r in t.by_arch.get(arch, ()) if r.sm_count == sms and r.device_class == cls]
    shapes, kinds = {r.shape for r in mine}, {kind(r) for r in mine}
    return [r for t in ts for r in t.by_arch.get(arch, ())
            if r.sm_count == sms and r.device_class != cls and r.shape not in shapes and kind(r) in kinds and near(r)]


def _nearest(ts: Sequence[Table], arch: str, sms: int, cls: str | None, key: Mapping[str, KeyValue],
             valid: Callable[[Mapping[str, Any], Mapping[str, KeyValue]], bool] | None,
             only: Callable[[Row], bool] | None, exact: Sequence[str] = ()) -> tuple[Row, Path | None] | None:
    """The nearest-shape row of the arch (among those `only` accepts and that share the `exact` fields' values),
    ranked as the module docstring says."""
    best: tuple | None = None
    for ti, t in enumerate(ts):
        for row in t.by_arch.get(arch, ()):
            if only is not None and not only(row):
                continue
            if exact and any(v != key[f] for f, v in row.shape if f in exact):
                continue
            score = _distance(row, key)
            if score is None or (valid is not None and not valid(row.config, key)):
                continue
            below = sum(1 for f, v in row.shape if isinstance(v, int) and v < key[f])
            rank = (score, abs(row.sm_count - sms), class_distance(row.device_class, cls), below, ti, row.index)
            if best is None or rank < best[0]:
                best = (rank, row, t.path)
    return None if best is None else (best[1], best[2])


def _distance(row: Row, key: Mapping[str, KeyValue]) -> float | None:
    """Sum of |log2 ratio| over integer fields; None when a non-integer field differs."""
    total = 0.0
    for f, v in row.shape:
        q = key[f]
        if isinstance(v, int) and isinstance(q, int) and not isinstance(q, bool):
            total += abs(math.log2(max(v, 1)) - math.log2(max(q, 1)))
        elif v != q:
            return None
    return total


# -- tuners -------------------------------------------------------------------------------------------------------
class Tuner:
    """What an op provides for autotuning.

    op: the op name. key_fields: request features that key its table rows (names looked up in the request's
    shape, then dtypes, then flags; override `key()` for anything else). `configs(req)` lists the configs to
    try for a request; `measure(req, config)` runs one config on req.device (live) and returns its median time
    in seconds (see `time_launches`); raise to mark a config as failing. `heuristic(key, device)` is the
    fallback when no row applies; `valid(config, key)` says whether a neighbour's config can serve a shape.
    """

    op: str = ""
    key_fields: tuple[str, ...] = ()
    exact_fields: tuple[str, ...] = ()  # integer key fields a neighbour's row must share (lookup's `exact`)
    request_ops: tuple[str, ...] = ()  # the ops whose requests it times, when they are not just `op` (its table)

    def ops(self) -> tuple[str, ...]:
        """The ops whose requests this tuner times (`rtckern tune OP` finds it by any of them)."""
        return self.request_ops or (self.op,)

    def key(self, req: Any) -> dict[str, KeyValue]:
        out: dict[str, KeyValue] = {}
        pools = (dict(req.shape), dict(req.dtypes), dict(req.flags))
        for f in self.key_fields:
            for pool in pools:
                if f in pool:
                    out[f] = pool[f]
                    break
            else:
                raise KeyError(f"tuner for {self.op!r}: request has no feature {f!r} ({req.describe()})")
        return out

    def configs(self, req: Any) -> list[dict[str, Any]]:
        raise NotImplementedError

    def measure(self, req: Any, config: Mapping[str, Any]) -> float:
        raise NotImplementedError

    def heuristic(self, key: Mapping[str, KeyValue], device: Any) -> Mapping[str, Any] | None:
        return None

    def valid(self, config: Mapping[str, Any], key: Mapping[str, KeyValue]) -> bool:
        return True

    def validate(self, req: Any) -> None:
        """Raise ValueError (one line: what was asked, what can be tuned) for a request this tuner cannot time or
        whose rows would be keyed wrongly; `rtckern tune` calls it before touching the GPU."""

    def prepare(self, req: Any, configs: Sequence[Mapping[str, Any]]) -> None:
        """Called once before `measure` runs the configs of req (e.g. to compile them all in parallel)."""

    def table_rows(self, req: Any, winner: Row, trials: Sequence["Trial"]) -> list[tuple[str, tuple[str, ...],
                                                                                          list[Row]]]:
        """The rows one tuned request writes, as (table, key fields, rows): by default the winner into the op's
        own table. A family whose tables are keyed otherwise (several tables, the config's kind in the key)
        overrides this."""
        return [(self.op, tuple(self.key_fields), [winner])]

    def table_names(self) -> list[str]:
        """The tables `table_rows` writes."""
        return [self.op]

    def best(self, req: Any) -> Tuned | None:
        """The table's (or the heuristic's) config for a request: what a candidate calls in kernel_specs()."""
        has_heuristic = type(self).heuristic is not Tuner.heuristic
        return lookup(self.op, req.device, self.key(req), valid=self.valid,
                      heuristic=(lambda k, d: self.heuristic(k, d)) if has_heuristic else None)


_tuners: dict[str, Tuner] = {}
_deferred: list[tuple[str, str]] = []  # (module, function) that registers tuners: called when tuners are asked for


def register_tuner(tuner: Tuner, *, replace: bool = False) -> Tuner:
    if not tuner.op or not tuner.key_fields:
        raise ValueError(f"tuner {tuner!r} needs op and key_fields")
    if tuner.op in _tuners and not replace:
        raise ValueError(f"op {tuner.op!r} already has a tuner ({_tuners[tuner.op]!r}); pass replace=True")
    _tuners[tuner.op] = tuner
    return tuner


def register_or_get_tuner(tuner: Tuner) -> Tuner:
    """Register `tuner`, or return the tuner its op has already: a family's tune module registers its one tuner on
    first use, and may be imported a second time under another name (so find the first module's tuner, not fail)."""
    try:
        return register_tuner(tuner)
    except ValueError:  # registered by an earlier import of the family's module under another name
        return get_tuner(tuner.op)


def defer_tuners(module: str, function: str = "register_tuners") -> None:
    """Tuners that ``module.function()`` registers, registered when tuners are first asked for (`rtckern tune`,
    completion, get_tuner): an op family declares its tuners at import without importing the tuner code, which no
    op call needs."""
    if (module, function) not in _deferred:
        _deferred.append((module, function))


def _registered() -> dict[str, Tuner]:
    while _deferred:
        module, function = _deferred.pop(0)
        getattr(importlib.import_module(module), function)()
    return _tuners


def get_tuner(op: str) -> Tuner:
    tuners = _registered()
    try:
        return tuners[op]
    except KeyError:
        raise KeyError(f"op {op!r} has no tuner; ops with one: {sorted(tuners) or '(none: import rtckern.ops)'}"
                       ) from None


def tuner_ops() -> list[str]:
    return sorted(_registered())


def tuners_for(op: str) -> list[Tuner]:
    """The tuners that time requests of ``op``, by name."""
    return sorted((t for t in _registered().values() if op in t.ops()), key=lambda t: t.op)


def resolve_tuner(name: str) -> tuple[Tuner, str]:
    """(tuner, the op of the requests it times) for `rtckern tune NAME`: NAME is a tuner (its table's name) or an
    op that exactly one tuner times. KeyError naming what exists otherwise."""
    tuners = _registered()
    if name in tuners:
        return tuners[name], tuners[name].ops()[0]
    found = tuners_for(name)
    if len(found) == 1:
        return found[0], name
    if found:
        names = ", ".join(t.op for t in found)
        raise KeyError(f"op {name!r} is timed by {len(found)} tuners, each writing its own table: {names}; name "
                       f"one, e.g. `rtckern tune {found[0].op} ...`")
    by_op: dict[str, list[str]] = {}
    for t in tuners.values():
        for op in t.ops():
            by_op.setdefault(op, []).append(t.op)
    listing = "; ".join(f"{op} ({', '.join(sorted(ts))})" for op, ts in sorted(by_op.items())) or \
        "none (import rtckern.ops)"
    raise KeyError(f"{name!r} is neither a tuner nor an op with one (its configs come from rules and the shipped "
                   f"tables); ops with tuners (tuner names): {listing}")


# -- measuring ------------------------------------------------------------------------------------------------------
def compile_ahead(specs: Sequence[Any], workers: int | None = None) -> int:
    """Compile specs into the disk cache over `workers` spawned processes (default: every core; safe after CUDA is
    initialized here), so a tuner's measurements find their kernels cached; returns how many failed (those configs
    fail again in measure, which records why)."""
    import multiprocessing as mp
    import os
    from concurrent.futures import ProcessPoolExecutor

    uniq = list(dict.fromkeys(specs))
    workers = max(1, min(workers or os.cpu_count() or 1, len(uniq)))
    if workers == 1 or len(uniq) < 4:
        return sum(1 for s in uniq if _compile_one(s))
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        return sum(1 for err in ex.map(_compile_one, uniq, chunksize=4) if err)


def _compile_one(spec: Any) -> str:
    from rtckern.manager import get_manager

    try:
        get_manager().compile(spec)
        return ""
    except Exception as exc:  # the config fails again in measure, which records why
        return f"{type(exc).__name__}: {exc}"[:300]


def time_launches(launch: Callable[[int], None], ordinal: int, *, warmup: int = 5, reps: int = 30,
                  inner: int = 1) -> float:
    """Median seconds of `launch(stream_handle)` on device `ordinal`, timed with CUDA events on a private
    stream: `warmup` untimed calls, then `reps` timed samples of `inner` back-to-back calls each. The caller
    rotates inputs inside `launch` if they would fit in L2."""
    from rtckern.runtime.driver import check, driver, on_device

    d = driver()
    with on_device(ordinal):
        stream = check(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        start = check(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")
        end = check(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")
        handle = int(stream)
        try:
            for _ in range(warmup):
                launch(handle)
            check(d.cuStreamSynchronize(stream), "cuStreamSynchronize")
            samples = []
            for _ in range(reps):
                check(d.cuEventRecord(start, stream), "cuEventRecord")
                for _ in range(inner):
                    launch(handle)
                check(d.cuEventRecord(end, stream), "cuEventRecord")
                check(d.cuEventSynchronize(end), "cuEventSynchronize")
                samples.append(float(check(d.cuEventElapsedTime(start, end), "cuEventElapsedTime")) / inner)
        finally:
            d.cuEventDestroy(start)
            d.cuEventDestroy(end)
            d.cuStreamDestroy(stream)
    import statistics

    return statistics.median(samples) / 1e3


# A memory-bound call (a decode GEMM: M of a few tokens against a weight) reads its weight from device memory in a
# model, where the other layers evict it from the L2 between its calls. A tuner times a weight smaller than this over
# rotating copies adding up to it (about three H200 L2s), as the benchmarks' small-weight tables do; timed on one
# copy, the weight would sit in the L2 and the tuner would pick the config that reads the L2 fastest.
ROTATION_BYTES = 200 << 20
DECODE_MAX_M = 64  # the decode range whose timing rotates weights


def weight_copies(m: int, weight_bytes: int) -> int:
    """How many copies of a weight of `weight_bytes` a tuner's timing of an M-row call cycles through (1: one)."""
    if m > DECODE_MAX_M or weight_bytes >= ROTATION_BYTES:
        return 1
    return -(-ROTATION_BYTES // max(1, weight_bytes))


class WeightRotation:
    """A weight and copies - 1 clones of it (weight_copies), handed out in turn by next_ptr(): the first call reads
    the weight itself (whose output a tuner checks), each later one the next copy."""

    __slots__ = ("copies", "_calls")

    def __init__(self, weight, copies: int):
        self.copies = [weight] + [weight.clone() for _ in range(copies - 1)]
        self._calls = 0

    def next_ptr(self) -> int:
        w = self.copies[self._calls % len(self.copies)]
        self._calls += 1
        return w.data_ptr()


def time_graphed(device, run, check=None, *, reps: int = 10, replays: int = 5) -> float:
    """Seconds per call of `run()` on torch device `device`: one warm-up call on a side stream, `check()` (raises
    when the output is wrong), then `reps` calls captured in one CUDA graph and replayed `replays` times (median),
    so that launch gaps do not hide the kernel time of small shapes. The tuners' shared timing."""
    import torch

    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if check is not None:
            check()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                run()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graph.replay()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3 / reps)
    import statistics

    return statistics.median(times)


@dataclass(frozen=True)
class Trial:
    """One config timed by a tuner (seconds None: it failed, error says why)."""
    config: Mapping[str, Any]
    seconds: float | None
    error: str = ""


def tune_request(tuner: Tuner, req: Any, *, source: str | None = None) -> tuple[Row, list[Trial]]:
    """Time every config of `tuner` for `req` on its live device; the winner as a table row (`source`: the
    command that made it, recorded in the row so that it can be made again)."""
    if req.device.ordinal is None:
        raise RtckernError(f"tuning {tuner.op!r} needs a live GPU; the request's device is described by hand "
                           f"({req.device.describe()})")
    configs = tuner.configs(req)
    if not configs:
        raise RtckernError(f"tuner for {tuner.op!r} offers no config for {req.describe()}")
    tuner.prepare(req, configs)
    trials: list[Trial] = []
    for cfg in configs:
        try:
            trials.append(Trial(cfg, float(tuner.measure(req, cfg))))
        except Exception as exc:  # a config that fails to compile, load or launch: recorded, not fatal
            trials.append(Trial(cfg, None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"))
    ok = [t for t in trials if t.seconds is not None]
    if not ok:
        raise RtckernError(f"every config failed for {req.describe()}: "
                           + "; ".join(f"{dict(t.config)}: {t.error}" for t in trials))
    win = min(ok, key=lambda t: t.seconds)
    key = tuner.key(req)
    meta = {"time_us": round(win.seconds * 1e6, 3), "configs_timed": len(ok),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "versions": versions(req.device)}
    if source:
        meta["source"] = source
    row = Row(arch=arch_key(req.device), sm_count=req.device.sm_count,
              shape=tuple((f, key[f]) for f in tuner.key_fields), config=dict(win.config), meta=meta,
              device_class=class_key(req.device))
    return row, trials


def versions(device: Any) -> dict[str, str]:
    import rtckern
    from rtckern.compiler import compiler_for

    out = {"rtckern": rtckern.__version__, "device": device.name or device.arch.sm}
    try:
        out["compiler"] = compiler_for(device.arch).identity().split("|")[0]
    except Exception as exc:  # no compiler for this vendor here: say so in the row rather than fail the tune
        out["compiler"] = f"unknown ({exc})"
    if device.ordinal is not None:
        try:
            from rtckern.runtime.driver import driver_version

            out["driver"] = "%d.%d" % driver_version()
        except Exception as exc:  # no driver here: the row still records what is known
            out["driver"] = f"unknown ({type(exc).__name__})"
    return out


def merge_rows(op: str, key_fields: Sequence[str], new_rows: Sequence[Row], path: Path | str, *,
               keep_order: bool = False) -> Table:
    """Merge rows into the table at path (created if missing): same key replaced, every other row kept. Rows are
    written sorted by key; with keep_order, in the file's order (a replaced row in place, new rows appended), so
    that a table written by another tool changes only where rows changed."""
    p = Path(path)
    old = load_table(p, op)
    if old is not None and tuple(old.key_fields) != tuple(key_fields):
        raise TuningTableError(f"{p}: table is keyed by {list(old.key_fields)}, the tuner by {list(key_fields)}; "
                               "move the old file away to start a new table")
    dups = duplicate_keys([dataclasses.replace(r, index=i) for i, r in enumerate(new_rows)])
    if dups:
        raise TuningTableError(f"{p}: the rows to merge hold {_duplicates_text(dups, lambda r: dict(r.config))} "
                               "(row numbers count the new rows); nothing was written. Tune each shape once")
    merged: dict[tuple, Row] = {r.key: r for r in (old.rows if old else ())}
    for r in new_rows:
        merged[r.key] = r
    table = Table(op=op, key_fields=tuple(key_fields), rows=tuple(merged.values()), path=p)
    doc = table.to_json()
    if keep_order:
        doc["rows"] = [r.to_json() for r in table.rows]
    _atomic_write(p, json.dumps(doc, indent=1) + "\n")
    reload()  # later lookups in this process see the rows just written
    return table


def _atomic_write(path: Path, text: str) -> None:
    from rtckern.cache.disk import atomic_write  # temp file, fsync, rename: the cache's one implementation

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text.encode())
