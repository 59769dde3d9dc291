"""Sidecars: the ``<key>.json`` beside each entry says what the entry is for (op, kernel, arch, compiler).

A sidecar is written with its entry but is not covered by the entry's digest, so nothing relies on it unchecked
(`cache ls` filters on it, `cache export --arch` picks entries by it). A sidecar is believed only if the key,
size and digest it records are those of the entry beside it, and the arch it names is the arch of the binary
itself (a cubin's ELF header, a PTX ``.target``). Otherwise the entry is described from the entry alone (kind and
arch) and ``cache verify`` reports the sidecar.
"""

from __future__ import annotations

import re
import struct

from ..compiler.base import CompiledKernel
from . import entry as entry_format

EM_CUDA = 190  # e_machine of CUDA cubins
_PTX_TARGET = re.compile(rb"^\s*\.target\s+(sm_\d+[af]?)", re.M)


def binary_arch(kind: str, binary: bytes) -> str | None:
    """The SM a binary is for: ``sm_90`` for a cubin (its ELF header holds major and minor, not the ``a``
    suffix), the PTX ``.target`` (``sm_90a``) for PTX; None when the binary does not say (hsaco, or not an ELF)."""
    if kind == "ptx":
        m = _PTX_TARGET.search(binary[:16384])
        return m.group(1).decode() if m else None
    if kind != "cubin" or len(binary) < 64 or binary[:4] != b"\x7fELF" or binary[5] != 1:  # little-endian ELF
        return None
    elf64 = binary[4] == 2
    (machine,) = struct.unpack_from("<H", binary, 18)
    if machine != EM_CUDA:
        return None
    (flags,) = struct.unpack_from("<I", binary, 48 if elf64 else 36)
    # CUDA's ELF ABI version 8 (CUDA 13 cubins) holds the SM in bits 8-15 of e_flags; earlier ones in bits 0-7.
    sm = (flags >> 8) & 0xFF if binary[8] >= 8 else flags & 0xFF
    return f"sm_{sm}" if sm >= 10 else None


def _base(arch: str) -> str | None:
    from ..arch import Arch

    try:
        return Arch.parse(arch).base().sm
    except Exception:  # noqa: BLE001 - any unparsable arch is simply "not this one"
        return None


def problem(sidecar: object, key: str, data: bytes, ck: CompiledKernel) -> str | None:
    """Why ``sidecar`` does not describe the entry ``data`` (stored under ``key``, unpacked as ``ck``), or None."""
    if not isinstance(sidecar, dict):
        return f"not a JSON object ({type(sidecar).__name__})"
    if sidecar.get("key") != key:
        return f"it names key {str(sidecar.get('key'))[:16]}…, the entry is {key[:16]}…"
    if sidecar.get("size") != len(data):
        return f"it records {sidecar.get('size')} bytes, the entry has {len(data)}"
    if sidecar.get("digest") != entry_format.digest_of(data):
        return "its digest is not the entry's"
    if sidecar.get("kind", ck.kind) != ck.kind:
        return f"it says kind {sidecar.get('kind')!r}, the entry holds {ck.kind!r}"
    actual = binary_arch(ck.kind, ck.binary)
    said = sidecar.get("arch")
    if actual is not None and (not isinstance(said, str) or _base(said) != _base(actual)):
        return f"it says arch {said!r}, the binary is for {actual}"
    return None


def from_entry(ck: CompiledKernel) -> dict:
    """What the entry itself says about it (for entries whose sidecar is missing or wrong)."""
    arch = binary_arch(ck.kind, ck.binary)
    return {"kind": ck.kind, **({"arch": arch} if arch else {})}
