"""`OpRequest`: everything about one op call that can change which implementation works.

A request is frozen and hashable: it is the in-memory memo key of a selection, and its canonical form (device
ordinal left out) is the key of a persisted decision. Probes see exactly these values (principle 6 of
DESIGN.md): an op puts every feature that can change whether a candidate compiles, fits or is correct into the
request, with its real value, never a stand-in such as batch 1.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

from rtckern.device import DeviceInfo

# Values a request may carry. Floats are allowed for flags (an epsilon that changes a code path), but most ops
# should keep runtime scalars out of the request: they do not change which candidate works.
_SCALARS = (bool, int, float, str, type(None))


def _by_name(pair: tuple[str, Any]) -> str:
    return pair[0]


def _pairs(field: str, value: Any, value_types: tuple[type, ...]) -> tuple[tuple[str, Any], ...]:
    """Normalize a mapping or a sequence of (name, value) pairs into a tuple sorted by name; check names and
    types. Ops build a request per call, so this stays a single cheap pass."""
    if type(value) is dict or (type(value) is not tuple and isinstance(value, Mapping)):
        value = tuple(value.items())
    out = list(value)
    for item in out:
        if not (type(item) is tuple and len(item) == 2 and type(item[0]) is str):
            raise TypeError(f"OpRequest.{field}: expected (name, value) pairs or a dict, got item {item!r}")
        if item[1].__class__ not in value_types and not isinstance(item[1], value_types):
            allowed = ", ".join(t.__name__ for t in value_types)
            raise TypeError(f"OpRequest.{field}[{item[0]!r}] = {item[1]!r} ({type(item[1]).__name__}); "
                            f"allowed: {allowed}")
    # Sorted by name, so two ops that list the same features in a different order make one key.
    if len(out) > 1:
        out.sort(key=_by_name)
        for a, b in zip(out, out[1:]):
            if a[0] == b[0]:
                raise ValueError(f"OpRequest.{field}: name {a[0]!r} given twice ({a[1]!r} and {b[1]!r})")
    return tuple(out)


@dataclass(frozen=True)
class OpRequest:
    """One op call's compile- and feasibility-relevant features.

    dtypes: (name, dtype) pairs, names per op ("x", "w", "y", "compute"), dtype names as in
        kernel_sources/common/dtypes.cuh ("fp32", "fp16", "bf16").
    shape: (name, int) pairs: every shape feature that is compiled in or decides feasibility (hidden size,
        head dim, alignment in elements, rows when a candidate has a size limit on them).
    flags: (name, value) pairs: layout, options, anything else that changes which candidate works.
    device: the DeviceInfo of the tensors' device (hand-built for a device that is not present).
    Mappings are accepted for dtypes/shape/flags and stored as sorted tuples of pairs.
    """

    op: str
    dtypes: tuple[tuple[str, str], ...] = ()
    shape: tuple[tuple[str, int], ...] = ()
    flags: tuple[tuple[str, Any], ...] = ()
    device: DeviceInfo | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.op, str) or not self.op:
            raise ValueError(f"OpRequest.op must be a non-empty string, got {self.op!r}")
        object.__setattr__(self, "dtypes", _pairs("dtypes", self.dtypes, (str,)))
        object.__setattr__(self, "shape", _pairs("shape", self.shape, (int,)))
        object.__setattr__(self, "flags", _pairs("flags", self.flags, _SCALARS))
        for name, val in self.shape:
            if val.__class__ is bool:
                raise TypeError(f"OpRequest.shape[{name!r}] = {val!r} is a bool; put booleans in flags")
        if self.device.__class__ is not DeviceInfo and not isinstance(self.device, DeviceInfo):
            raise TypeError(
                f"OpRequest.device must be a rtckern.device.DeviceInfo, got {self.device!r}; use "
                "DeviceInfo.from_device(ordinal) for a live device or DeviceInfo.for_arch('sm_90') for a "
                "hand-described one")

        # Hashed once: the request is the memo key of every select() call.
        object.__setattr__(self, "_hash", hash((self.op, self.dtypes, self.shape, self.flags, self.device)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    # -- accessors used by candidates -------------------------------------------------------------------------
    def dtype(self, name: str) -> str:
        return _get(self.dtypes, name, "dtypes", self.op)

    def dim(self, name: str) -> int:
        return _get(self.shape, name, "shape", self.op)

    def flag(self, name: str, default: Any = ...) -> Any:
        for key, val in self.flags:
            if key == name:
                return val
        if default is ...:
            raise KeyError(f"op {self.op!r} request has no flag {name!r}; flags: {dict(self.flags)}")
        return default

    @property
    def is_live(self) -> bool:
        """True when the request's device is a present GPU (probes load and check resources there)."""
        return self.device.ordinal is not None

    def with_device(self, device: DeviceInfo) -> "OpRequest":
        return dataclasses.replace(self, device=device)

    # -- canonical form --------------------------------------------------------------------------------------
    def to_dict(self, *, with_ordinal: bool = True) -> dict[str, Any]:
        dev = device_to_dict(self.device)
        if not with_ordinal:
            dev.pop("ordinal", None)
        return {"op": self.op, "dtypes": dict(self.dtypes), "shape": dict(self.shape),
                "flags": dict(self.flags), "device": dev}

    def digest(self) -> str:
        """Hex digest of the request without the device ordinal: the same request on two identical devices
        (or a hand-built twin of a live one) has one digest. The probe mode is keyed separately."""
        text = json.dumps(self.to_dict(with_ordinal=False), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.dtypes] + [f"{k}={v}" for k, v in self.shape]
        parts += [f"{k}={v}" for k, v in self.flags]
        dev = self.device
        label = dev.name if dev.name and dev.arch.sm in dev.name else f"{dev.name or 'device'} {dev.arch.sm}"
        where = f"{label.strip()}, {dev.sm_count} SMs"
        if dev.ordinal is not None:
            where += f", ordinal {dev.ordinal}"
        return f"{self.op}({', '.join(parts)}) on {where}"


def _get(pairs: tuple[tuple[str, Any], ...], name: str, field: str, op: str) -> Any:
    for key, val in pairs:
        if key == name:
            return val
    raise KeyError(f"op {op!r} request has no {field} entry {name!r}; it has {[k for k, _ in pairs]}")


def device_to_dict(device: DeviceInfo) -> dict[str, Any]:
    """DeviceInfo as plain JSON data (Arch as its `sm` string)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(device):
        val = getattr(device, f.name)
        if f.name in _OMIT_WHEN_UNSET and not val:
            continue  # unset: left out, so requests (digests, manifest lines) of devices without it are unchanged
        out[f.name] = getattr(val, "sm", val) if f.name == "arch" else val
    return out


_OMIT_WHEN_UNSET = ("memory_bytes", "device_class")
