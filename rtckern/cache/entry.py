"""The on-disk (and on-wire) format of one cache entry: a digest-checked envelope around a compiled kernel.

    b"RTKCACHE" | u32 format | 32-byte sha256 of body | u64 body length | body
    body = u32 header length | header JSON (kind, lowered_name) | binary

Any entry that is short, has the wrong magic or format, or whose digest does not match is invalid.
"""

from __future__ import annotations

import hashlib
import json
import struct

from ..compiler.base import CompiledKernel

MAGIC = b"RTKCACHE"
FORMAT = 1
_HEAD = struct.Struct("<8sI32sQ")


class InvalidEntry(ValueError):
    pass


def pack(ck: CompiledKernel) -> bytes:
    header = json.dumps({"kind": ck.kind, "lowered_name": ck.lowered_name}, sort_keys=True).encode()
    body = struct.pack("<I", len(header)) + header + ck.binary
    return _HEAD.pack(MAGIC, FORMAT, hashlib.sha256(body).digest(), len(body)) + body


def unpack(data: bytes) -> CompiledKernel:
    if len(data) < _HEAD.size:
        raise InvalidEntry(f"truncated ({len(data)} bytes, the header alone is {_HEAD.size})")
    magic, fmt, digest, n = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise InvalidEntry("not an rtckern cache entry (bad magic)")
    if fmt != FORMAT:
        raise InvalidEntry(f"entry format {fmt}, this rtckern reads {FORMAT}")
    body = data[_HEAD.size:]
    if len(body) != n:
        raise InvalidEntry(f"truncated body ({len(body)} of {n} bytes)")
    if hashlib.sha256(body).digest() != digest:
        raise InvalidEntry("digest mismatch (corrupt)")
    (hlen,) = struct.unpack_from("<I", body)
    try:
        header = json.loads(body[4:4 + hlen])
    except ValueError as e:
        raise InvalidEntry(f"bad header: {e}") from None
    return CompiledKernel(binary=bytes(body[4 + hlen:]), kind=header["kind"], lowered_name=header["lowered_name"])


def digest_of(data: bytes) -> str:
    """Hex digest stored in a packed entry (without re-hashing)."""
    if len(data) < _HEAD.size:
        raise InvalidEntry("truncated")
    return _HEAD.unpack_from(data)[2].hex()
