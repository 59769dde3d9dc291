"""Reading an AMD GPU code object (HSA code object, ``.hsaco``) without a GPU.

hiprtc returns an ELF whose ``NT_AMDGPU_METADATA`` note (MessagePack) names the target (``gfx90a``), and for
every kernel its symbol, wavefront size, register counts, LDS and scratch sizes. rtckern reads it to check what
hiprtc built (target and wavefront size really are what the key says) and to report a kernel's resources on a
machine with no AMD GPU. Only the few MessagePack types the metadata uses are decoded.
"""

from __future__ import annotations

import dataclasses
import struct

_ELF_MAGIC = b"\x7fELF"
_EM_AMDGPU = 224
_SHT_NOTE = 7
_NT_AMDGPU_METADATA = 32


class CodeObjectError(ValueError):
    """Bytes that are not an AMD GPU code object rtckern can read."""


@dataclasses.dataclass(frozen=True)
class KernelResources:
    name: str  # the (mangled) kernel name; the loadable symbol is ``name`` (``symbol`` has a ``.kd`` suffix)
    symbol: str
    wavefront_size: int
    sgpr_count: int
    vgpr_count: int
    agpr_count: int
    lds_bytes: int  # static group segment (shared memory)
    scratch_bytes: int  # private segment per work-item (register spills, local arrays)
    max_flat_workgroup_size: int
    sgpr_spill_count: int
    vgpr_spill_count: int


@dataclasses.dataclass(frozen=True)
class CodeObjectInfo:
    target: str  # e.g. "amdgcn-amd-amdhsa--gfx90a" (feature suffixes such as ":xnack-" when set)
    kernels: dict

    @property
    def gfx(self) -> str:
        """The processor name without features: ``gfx90a``."""
        return self.target.rsplit("--", 1)[-1].split(":", 1)[0]

    def kernel(self, name: str) -> KernelResources:
        try:
            return self.kernels[name]
        except KeyError:
            raise CodeObjectError(f"kernel {name!r} is not in this code object; it has {sorted(self.kernels)}") from None


def read_code_object(binary: bytes) -> CodeObjectInfo:
    """Target and per-kernel resources of an AMD GPU code object."""
    meta = _metadata(binary)
    kernels = {}
    for k in meta.get("amdhsa.kernels", ()):
        r = KernelResources(
            name=k.get(".name", ""), symbol=k.get(".symbol", ""), wavefront_size=int(k.get(".wavefront_size", 0)),
            sgpr_count=int(k.get(".sgpr_count", 0)), vgpr_count=int(k.get(".vgpr_count", 0)),
            agpr_count=int(k.get(".agpr_count", 0)), lds_bytes=int(k.get(".group_segment_fixed_size", 0)),
            scratch_bytes=int(k.get(".private_segment_fixed_size", 0)),
            max_flat_workgroup_size=int(k.get(".max_flat_workgroup_size", 0)),
            sgpr_spill_count=int(k.get(".sgpr_spill_count", 0)), vgpr_spill_count=int(k.get(".vgpr_spill_count", 0)))
        kernels[r.name] = r
    return CodeObjectInfo(target=str(meta.get("amdhsa.target", "")), kernels=kernels)


def _metadata(binary: bytes) -> dict:
    b = bytes(binary)
    if len(b) < 64 or b[:4] != _ELF_MAGIC or b[4] != 2 or b[5] != 1:
        raise CodeObjectError("not a 64-bit little-endian ELF (an AMD GPU code object is one)")
    (machine,) = struct.unpack_from("<H", b, 18)
    if machine != _EM_AMDGPU:
        raise CodeObjectError(f"ELF machine {machine}, not AMDGPU ({_EM_AMDGPU}): not an AMD GPU code object")
    shoff, = struct.unpack_from("<Q", b, 40)
    shentsize, shnum = struct.unpack_from("<HH", b, 58)
    for i in range(shnum):
        off = shoff + i * shentsize
        sh_type, = struct.unpack_from("<I", b, off + 4)
        if sh_type != _SHT_NOTE:
            continue
        sec_off, sec_size = struct.unpack_from("<QQ", b, off + 24)
        for name, ntype, desc in _notes(b[sec_off:sec_off + sec_size]):
            if name == b"AMDGPU" and ntype == _NT_AMDGPU_METADATA:
                value, _ = _unpack(desc, 0)
                if not isinstance(value, dict):
                    raise CodeObjectError("AMDGPU metadata note is not a map")
                return value
    raise CodeObjectError("no AMDGPU metadata note (code object v3 or newer expected)")


def _notes(data: bytes):
    pos = 0
    while pos + 12 <= len(data):
        namesz, descsz, ntype = struct.unpack_from("<III", data, pos)
        pos += 12
        name = data[pos:pos + namesz].rstrip(b"\x00")
        pos += (namesz + 3) & ~3
        desc = data[pos:pos + descsz]
        pos += (descsz + 3) & ~3
        yield name, ntype, desc


def _unpack(d: bytes, i: int):
    """Decode one MessagePack value at ``d[i]``; return (value, next index)."""
    t = d[i]
    i += 1
    if t <= 0x7F:
        return t, i
    if t >= 0xE0:
        return t - 0x100, i
    if 0x80 <= t <= 0x8F:
        return _map(d, i, t & 0x0F)
    if 0x90 <= t <= 0x9F:
        return _array(d, i, t & 0x0F)
    if 0xA0 <= t <= 0xBF:
        n = t & 0x1F
        return d[i:i + n].decode("utf-8", "replace"), i + n
    simple = {0xC0: None, 0xC2: False, 0xC3: True}
    if t in simple:
        return simple[t], i
    fixed = {0xCC: "<B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q",
             0xCA: ">f", 0xCB: ">d"}
    if t in fixed:
        fmt = fixed[t]
        return struct.unpack_from(fmt, d, i)[0], i + struct.calcsize(fmt)
    lengths = {0xD9: (">B", "str"), 0xDA: (">H", "str"), 0xDB: (">I", "str"), 0xC4: (">B", "bin"),
               0xC5: (">H", "bin"), 0xC6: (">I", "bin"), 0xDC: (">H", "array"), 0xDD: (">I", "array"),
               0xDE: (">H", "map"), 0xDF: (">I", "map")}
    if t not in lengths:
        raise CodeObjectError(f"unsupported MessagePack type byte 0x{t:02x} in the AMDGPU metadata")
    fmt, kind = lengths[t]
    n = struct.unpack_from(fmt, d, i)[0]
    i += struct.calcsize(fmt)
    if kind == "str":
        return d[i:i + n].decode("utf-8", "replace"), i + n
    if kind == "bin":
        return bytes(d[i:i + n]), i + n
    return (_array if kind == "array" else _map)(d, i, n)


def _array(d: bytes, i: int, n: int):
    out = []
    for _ in range(n):
        v, i = _unpack(d, i)
        out.append(v)
    return out, i


def _map(d: bytes, i: int, n: int):
    out = {}
    for _ in range(n):
        k, i = _unpack(d, i)
        v, i = _unpack(d, i)
        out[k] = v
    return out, i
