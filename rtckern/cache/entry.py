"""The on-disk (and on-wire) format of one cache entry: a digest-checked envelope around a compiled kernel, bound
to the cache key it was stored under.

    b"RTKCACHE" | u32 format | 32-byte sha256 of body | u64 body length | body
    body = u32 header length | header JSON | binary
    header = {"key": cache key, "spec": {kernel, arch, source, ...}, "kind": cubin|ptx|hsaco, "lowered_name": ...}

The key sits inside the digested part, so an entry copied, restored, swapped or written under another key (a file
mix-up, a hand-made bundle, a Redis value set under the wrong name) is refused: ``unpack(data, key)`` serves an
entry only under the key it was made for. Any entry that is short, has the wrong magic or format, a digest that
does not match, a header that is not what pack() writes, or another key, raises InvalidEntry: a miss, never a
crash. The digest proves integrity, not authorship: see docs/fleet.md for what signing adds.
"""

from __future__ import annotations

import hashlib
import json
import struct

from ..compiler.base import CompiledKernel

MAGIC = b"RTKCACHE"
FORMAT = 2  # 2: the key and the spec's identity inside the digested header
_HEAD = struct.Struct("<8sI32sQ")
_KINDS = ("cubin", "ptx", "hsaco")
# Spec fields recorded in the header (what the entry says it is; `rtckern cache verify` and export read them).
IDENTITY_FIELDS = ("name_expression", "arch", "source", "op")


class InvalidEntry(ValueError):
    pass


def identity(meta: dict | None) -> dict:
    """The spec identity kept inside an entry, from a sidecar-style metadata dict (manager._meta)."""
    meta = meta or {}
    return {f: str(meta[f]) for f in IDENTITY_FIELDS if meta.get(f) not in (None, "")}


def pack(ck: CompiledKernel, key: str, spec: dict | None = None) -> bytes:
    if not isinstance(key, str) or not key:
        raise ValueError(f"cache key {key!r}: a non-empty string is required to bind an entry")
    header = json.dumps({"key": key, "spec": dict(spec or {}), "kind": ck.kind, "lowered_name": ck.lowered_name},
                        sort_keys=True).encode()
    body = struct.pack("<I", len(header)) + header + ck.binary
    return _HEAD.pack(MAGIC, FORMAT, hashlib.sha256(body).digest(), len(body)) + body


def _body(data: bytes) -> bytes:
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
    return body


def _header(body: bytes) -> tuple[dict, int]:
    """The validated header and where the binary starts. Every malformation is an InvalidEntry."""
    if len(body) < 4:
        raise InvalidEntry("bad header: body shorter than its length field")
    (hlen,) = struct.unpack_from("<I", body)
    if hlen > len(body) - 4:
        raise InvalidEntry(f"bad header: length {hlen} runs past the body ({len(body) - 4} bytes)")
    try:
        header = json.loads(body[4:4 + hlen])
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; RecursionError: nested too deep
        raise InvalidEntry(f"bad header: {type(e).__name__ if isinstance(e, RecursionError) else e}") from None
    if not isinstance(header, dict):
        raise InvalidEntry(f"bad header: a JSON object was expected, got {type(header).__name__}")
    for f in ("key", "kind", "lowered_name"):
        if not isinstance(header.get(f), str) or not header[f]:
            raise InvalidEntry(f"bad header: field {f!r} missing or not a non-empty string")
    if header["kind"] not in _KINDS:
        raise InvalidEntry(f"bad header: kind {header['kind']!r} is not one of {', '.join(_KINDS)}")
    spec = header.get("spec", {})
    if not isinstance(spec, dict) or not all(isinstance(v, str) for v in spec.values()):
        raise InvalidEntry("bad header: 'spec' is not an object of strings")
    return header, 4 + hlen


def header(data: bytes) -> dict:
    """The digest-checked, validated header (key, spec identity, kind, lowered name) without the binary."""
    return _header(_body(data))[0]


def unpack(data: bytes, key: str) -> CompiledKernel:
    """The kernel of a packed entry, served only under the key it was made for."""
    body = _body(data)
    hdr, start = _header(body)
    if hdr["key"] != key:
        what = hdr.get("spec", {}).get("name_expression", "another kernel")
        raise InvalidEntry(f"bound to key {hdr['key'][:16]}… ({what}), read under key {key[:16]}…: an entry of "
                           "another kernel (copied, restored or written under the wrong name)")
    return CompiledKernel(binary=bytes(body[start:]), kind=hdr["kind"], lowered_name=hdr["lowered_name"])


def digest_of(data: bytes) -> str:
    """Hex digest stored in a packed entry (without re-hashing)."""
    if len(data) < _HEAD.size:
        raise InvalidEntry("truncated")
    return _HEAD.unpack_from(data)[2].hex()


# ---- authenticity: entries sealed with a shared secret (RTCKERN_CACHE_SECRET_FILE) ----
# The digest and the key binding prove that an entry is whole and made for its key, not who made it: anyone who can
# write to the Redis tier or hand out a bundle can pack an entry of their own for any key. With a shared secret the
# remote tier and bundles carry an HMAC-SHA256 over (key, entry), and readers refuse values without a valid one.
SEAL = b"RTKSEAL1"
_TAG = 32


def _tag(secret: bytes, key: str, data: bytes) -> bytes:
    import hmac

    return hmac.new(secret, b"rtckern-entry\0" + key.encode() + b"\0" + data, hashlib.sha256).digest()


def seal(data: bytes, key: str, secret: bytes) -> bytes:
    """A packed entry with an HMAC of (key, entry) in front: what the remote tier stores when a secret is set."""
    return SEAL + _tag(secret, key, data) + data


def is_sealed(data: bytes) -> bool:
    return data[:len(SEAL)] == SEAL


def open_sealed(data: bytes, key: str, secret: bytes | None) -> bytes:
    """The packed entry inside a sealed value. With a secret, the seal must be there and verify; without one, a
    sealed value is unwrapped (integrity still holds through the digest and key binding) and a plain one passed on."""
    import hmac

    if not is_sealed(data):
        if secret is not None:
            raise InvalidEntry("not signed, and a cache secret is set (RTCKERN_CACHE_SECRET_FILE): refused")
        return data
    if len(data) < len(SEAL) + _TAG:
        raise InvalidEntry("truncated signature")
    tag, inner = data[len(SEAL):len(SEAL) + _TAG], data[len(SEAL) + _TAG:]
    if secret is not None and not hmac.compare_digest(tag, _tag(secret, key, inner)):
        raise InvalidEntry("signature does not verify with this cache secret (RTCKERN_CACHE_SECRET_FILE): "
                           "written by someone without the secret, or for another key")
    return inner
