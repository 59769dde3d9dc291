"""Manifests: JSON lines, one op request per line. The format presets, hand-written files and record mode share.

A line is a JSON object::

    {"op": "rms_norm", "dtype": "bf16", "shape": [8192, 4096], "residual": true}

``op``, ``dtype`` (the main input's dtype) and ``shape`` (the main input's shape, a list of positive ints) are
required. Every other top-level field is an option of the op's request builder (``rtckern explain --list`` names
them), passed as a string the way ``--opt KEY=VALUE`` does. Three fields are reserved:

``request``  the exact request (``{"dtypes": {...}, "shape": {...}, "flags": {...}}``), as record mode writes it.
             When present it is replayed as is and the builder is not called (the recorder cannot know the main
             input's full shape, only the request's compile-relevant features).
``device``   the device the line was recorded on (``{"arch": "sm_90", "sm_count": 132, ...}``). When prefill
             targets that arch, the recorded device's limits are used; other archs get typical ones.
``comment``  free text, ignored.

Blank lines and lines starting with ``#`` are skipped (presets use them to say where their shapes come from).
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from ..arch import Arch
from ..device import DeviceInfo
from ..errors import ArchError, ManifestError
from ..registry.options import FALSE, TRUE

RESERVED = ("op", "dtype", "shape", "request", "device", "comment")
DTYPES = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclasses.dataclass(frozen=True)
class ManifestEntry:
    """One request line. ``options``: builder options (strings); ``request``/``device``: see the module doc."""

    op: str
    dtype: str
    shape: tuple[int, ...]
    options: tuple[tuple[str, str], ...] = ()
    request: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False, hash=False)
    device: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False, hash=False)
    where: str = dataclasses.field(default="", compare=False, hash=False)  # "file:line" for messages
    canonical: str = dataclasses.field(default="", compare=True)  # canonical JSON: identity and sort key

    def describe(self) -> str:
        opts = "".join(f", {k}={v}" for k, v in self.options)
        return f"{self.op}({self.dtype}, {'x'.join(map(str, self.shape))}{opts})" + (" [exact request]"
                                                                                    if self.request else "")

    def to_json(self) -> dict[str, Any]:
        return json.loads(self.canonical)


def _option_text(value: Any) -> str:
    # Builders take options as the strings `--opt KEY=VALUE` would give; booleans as 1/0.
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float, str)):
        return str(value)
    raise TypeError(f"{value!r} ({type(value).__name__}); options are strings, numbers or booleans")


def canonical_line(obj: Mapping[str, Any]) -> str:
    """One line of JSON with sorted keys and no spaces: equal requests give equal text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def parse_entry(obj: Any, where: str = "") -> ManifestEntry:
    at = f"{where}: " if where else ""
    example = '{"op": "rms_norm", "dtype": "bf16", "shape": [8192, 4096]}'
    if not isinstance(obj, dict):
        raise ManifestError(f"{at}expected a JSON object such as {example}, got {type(obj).__name__}")
    missing = [f for f in ("op", "dtype", "shape") if f not in obj]
    if missing:
        raise ManifestError(f"{at}missing field(s) {missing}; every line needs op, dtype and shape, e.g. {example}")
    op, dtype, shape = obj["op"], obj["dtype"], obj["shape"]
    if not isinstance(op, str) or not op:
        raise ManifestError(f"{at}op must be a non-empty string, got {op!r}")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ManifestError(f"{at}dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if (not isinstance(shape, list) or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise ManifestError(f"{at}shape must be a non-empty list of positive ints (the main input's shape, "
                            f"e.g. [8192, 4096]), got {shape!r}")
    options = []
    for k in sorted(set(obj) - set(RESERVED)):
        try:
            options.append((k, _option_text(obj[k])))
        except TypeError as e:
            raise ManifestError(f"{at}option {k!r} = {e}") from None
    request = obj.get("request")
    if request is not None:
        _check_request(request, at)
    device = obj.get("device")
    if device is not None:
        _check_device(device, at)
    clean = {k: v for k, v in obj.items() if k != "comment"}
    return ManifestEntry(op=op, dtype=dtype, shape=tuple(shape), options=tuple(options), request=request,
                         device=device, where=where, canonical=canonical_line(clean))


def _check_request(request: Any, at: str) -> None:
    """The exact request as record mode writes it: dtypes {name: str}, shape {name: int}, flags {name: scalar},
    booleans as JSON true/false (a flag "0" would be a non-empty string, that is true)."""
    if not isinstance(request, dict) or set(request) - {"dtypes", "shape", "flags"}:
        raise ManifestError(f"{at}request must be an object with dtypes, shape and flags (as record mode "
                            f"writes it), got {request!r}")
    kinds = {"dtypes": (str,), "shape": (int,), "flags": (bool, int, float, str, type(None))}
    for part, types in kinds.items():
        values = request.get(part, {})
        if not isinstance(values, dict):
            raise ManifestError(f"{at}request {part} must be an object of name: value, got {values!r}")
        for name, v in values.items():
            if not isinstance(v, types) or (part == "shape" and isinstance(v, bool)):
                want = {"dtypes": "a dtype name", "shape": "an int", "flags": "a JSON scalar"}[part]
                raise ManifestError(f"{at}request {part} {name!r} = {v!r}: expected {want}")
            if part == "flags" and isinstance(v, str) and v.strip().lower() in TRUE + FALSE:
                raise ManifestError(f"{at}request flag {name!r} = {v!r} is text; write the boolean as JSON "
                                    f"{'true' if v.strip().lower() in TRUE else 'false'} (a string would count "
                                    "as true)")


# The limits of a recorded device (every DeviceInfo field but arch, name and the live-only ordinal): positive ints.
_DEVICE_INTS = tuple(f.name for f in dataclasses.fields(DeviceInfo) if f.name not in ("arch", "name", "ordinal"))


def _check_device(device: Any, at: str) -> None:
    """The recorded device: an arch that parses, positive ints for its limits, a name; nothing else."""
    example = '{"arch": "sm_90", "sm_count": 132}'
    if not (isinstance(device, dict) and isinstance(device.get("arch"), str)):
        raise ManifestError(f"{at}device must be an object with at least an arch, e.g. {example}, got {device!r}")
    unknown = sorted(set(device) - {"arch", "name", *_DEVICE_INTS})
    if unknown:
        raise ManifestError(f"{at}device field(s) {unknown} unknown; a device has arch, name, "
                            f"{', '.join(_DEVICE_INTS)}")
    try:
        Arch.parse(device["arch"])
    except ArchError as e:
        raise ManifestError(f"{at}device {e}") from None
    for k in _DEVICE_INTS:
        v = device.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ManifestError(f"{at}device {k} = {v!r}: expected a positive int")
    if not isinstance(device.get("name", ""), str):
        raise ManifestError(f"{at}device name = {device['name']!r}: expected a string")


def parse_lines(lines: Iterable[str], name: str = "<manifest>") -> list[ManifestEntry]:
    """Entries in first-seen order, duplicates (same canonical line) dropped."""
    out: dict[str, ManifestEntry] = {}
    for i, raw in enumerate(lines, 1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise ManifestError(f"{name}:{i}: not valid JSON ({e}); each line is one JSON object") from None
        entry = parse_entry(obj, f"{name}:{i}")
        out.setdefault(entry.canonical, entry)
    return list(out.values())


def load_manifest(path: str | Path) -> list[ManifestEntry]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ManifestError(f"cannot read manifest {p}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        line = p.read_bytes()[:e.start].count(b"\n") + 1
        raise ManifestError(f"{p}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                            "a manifest is JSON lines in UTF-8") from None
    return parse_lines(text.splitlines(), str(p))


# ---- presets: rtckern/presets/<name>.jsonl, shipped in the package ----
def _preset_dir():
    return resources.files("rtckern") / "presets"


def preset_names() -> list[str]:
    d = _preset_dir()
    if not d.is_dir():
        return []
    return sorted(p.name[: -len(".jsonl")] for p in d.iterdir() if p.name.endswith(".jsonl"))


def load_preset(name: str) -> list[ManifestEntry]:
    names = preset_names()
    if name not in names:
        raise ManifestError(f"no preset named {name!r}; presets: {', '.join(names) or '(none installed)'}")
    text = (_preset_dir() / f"{name}.jsonl").read_text(encoding="utf-8")
    return parse_lines(text.splitlines(), f"preset:{name}")


def iter_json(entries: Iterable[ManifestEntry]) -> Iterator[str]:
    for e in entries:
        yield e.canonical
