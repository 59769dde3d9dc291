"""The one dtype table: each element type rtckern's kernels read or write, by its canonical name ("fp32",
"fp16", "bf16", ...), with its C++ storage type (what a kernel template is instantiated with), its size, its
torch and numpy / CuPy names and the spellings a caller may use for it; and the one parser, `parse_dtype`.

    from rtckern import dtypes
    dtypes.ctype("bf16")                      # "rtk_bf16"
    dtypes.itemsize("fp32")                   # 4
    dtypes.parse_dtype(torch.float16, "out_dtype")   # "fp16"; also "half", "float16", numpy.float16, ...

Core module: imports neither torch nor numpy (a dtype object is read through its attributes).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from rtckern.errors import InputError

__all__ = ["DType", "TABLE", "FLOATS", "parse_dtype", "ctype", "itemsize", "ctypes", "itemsizes", "unit_roundoff", "lookup",
           "name_of_torch", "name_of_numpy", "torch_dtype", "numpy_dtype", "describe"]


@dataclasses.dataclass(frozen=True)
class DType:
    """One dtype of the table: its names in every library and its C++ storage type."""
    name: str  # canonical: what requests, specs' callers, tables and messages use
    ctype: str  # C++ storage type in kernel templates (common/dtypes.cuh maps the rtk_ types per vendor)
    itemsize: int  # bytes
    torch: str | None  # attribute of the torch module (torch.<torch>), None where torch has none
    numpy: str | None  # numpy / CuPy dtype name (bf16 and fp8 through ml_dtypes), None where there is none
    aliases: tuple[str, ...] = ()  # other spellings accepted by parse_dtype (lower case)
    ptx: str | None = None  # PTX type of the tensor-core instructions (wgmma / mma operands)
    mantissa: int | None = None  # stored fraction bits of a float type (unit roundoff 2^-(mantissa + 1))


TABLE: dict[str, DType] = {d.name: d for d in (
    DType("fp32", "float", 4, "float32", "float32", ("float32", "float", "f32"), "f32", 23),
    DType("fp16", "rtk_half", 2, "float16", "float16", ("float16", "half", "f16"), "f16", 10),
    DType("bf16", "rtk_bf16", 2, "bfloat16", "bfloat16", ("bfloat16",), "bf16", 7),
    # fp8 storage (the fp8 GEMM issue): common/dtypes.cuh gains the rtk_fp8_* typedefs with the first kernel
    DType("fp8_e4m3", "rtk_fp8_e4m3", 1, "float8_e4m3fn", "float8_e4m3fn", ("float8_e4m3fn", "e4m3"), "e4m3", 3),
    DType("fp8_e5m2", "rtk_fp8_e5m2", 1, "float8_e5m2", "float8_e5m2", ("float8_e5m2", "e5m2"), "e5m2", 2),
    DType("int32", "int", 4, "int32", "int32", ("i32",)),
    DType("int64", "long long", 8, "int64", "int64", ("i64",)),
    DType("uint8", "unsigned char", 1, "uint8", "uint8", ("u8",)),
    DType("bool", "bool", 1, "bool", "bool", ("bool_",)),
)}

FLOATS = ("fp32", "fp16", "bf16")  # the activations' dtypes of the norm, softmax and GEMM ops

_BY_SPELLING: dict[str, str] = {}
for _d in TABLE.values():
    for _s in (_d.name, *_d.aliases):
        _BY_SPELLING[_s] = _d.name
_BY_TORCH = {d.torch: d.name for d in TABLE.values() if d.torch}
_BY_NUMPY = {d.numpy: d.name for d in TABLE.values() if d.numpy}
_TORCH_DTYPES: dict[str, Any] = {}


def lookup(name: str) -> DType:
    """The table entry of a canonical name (KeyError for anything else: names from requests are canonical)."""
    return TABLE[name]


def ctype(name: str) -> str:
    return TABLE[name].ctype


def itemsize(name: str) -> int:
    return TABLE[name].itemsize


def name_of_torch(torch_name: str) -> str:
    """Canonical name of a torch dtype given its name without "torch." ("bfloat16" -> "bf16"); the torch name
    itself for a dtype outside the table (so a message names what was given)."""
    return _BY_TORCH.get(torch_name, torch_name)


def name_of_numpy(numpy_name: str) -> str:
    """Canonical name of a numpy / CuPy dtype name ("float16" -> "fp16"); the name itself outside the table."""
    return _BY_NUMPY.get(numpy_name, numpy_name)


def unit_roundoff(name: str) -> float:
    """2^-(mantissa + 1): the largest relative error of rounding to a float dtype."""
    return 2.0 ** -(TABLE[name].mantissa + 1)


def ctypes(names: Iterable[str]) -> dict[str, str]:
    """{name: C++ storage type} for a family's dtypes (a plain dict for its hot loops)."""
    return {n: TABLE[n].ctype for n in names}


def itemsizes(names: Iterable[str]) -> dict[str, int]:
    """{name: size in bytes} for a family's dtypes."""
    return {n: TABLE[n].itemsize for n in names}


def torch_dtype(name: str):
    """torch's dtype object for a canonical name (torch imported on first use)."""
    t = _TORCH_DTYPES.get(name)
    if t is None:
        import torch

        t = _TORCH_DTYPES[name] = getattr(torch, TABLE[name].torch)
    return t


def numpy_dtype(name: str):
    """numpy's dtype for a canonical name (bf16 / fp8 need ml_dtypes); None where this installation has none."""
    import numpy as np

    spelled = TABLE[name].numpy
    try:
        return np.dtype(spelled)
    except TypeError:
        try:
            import ml_dtypes
        except ImportError:
            return None
        return np.dtype(getattr(ml_dtypes, spelled))


def describe(names: Iterable[str]) -> str:
    """"fp32, fp16, bf16 (float32, float16, bfloat16)": the canonical names, then torch's names for them."""
    names = tuple(names)
    return f"{', '.join(names)} ({', '.join(TABLE[n].torch or n for n in names)})"


def parse_dtype(value: Any, what: str, allowed: Iterable[str] = FLOATS, default: str = "") -> str:
    """The canonical name of `value` (argument `what`): a canonical name or alias ("bf16", "bfloat16", "half"),
    a torch dtype (torch.float16), a numpy / CuPy dtype or scalar type (numpy.float32, numpy.dtype("float16")).
    InputError naming the value and the accepted names when it is none of them or not in `allowed`; `default`
    says what None means where None is accepted by the caller (e.g. "x's dtype")."""
    allowed = tuple(allowed)
    name = _spelled(value)
    if name is None or name not in allowed:
        tail = f", or None for {default}" if default else ""
        raise InputError(f"{what}={value!r} is not supported; pass one of {describe(allowed)} as a string or a "
                         f"torch / numpy dtype{tail}")
    return name


def _spelled(value: Any) -> str | None:
    if isinstance(value, DType):
        return value.name
    if isinstance(value, str):
        return _BY_SPELLING.get(value.strip().lower())
    s = str(value)
    if s.startswith("torch."):  # a torch dtype: str() is "torch.float16"
        return _BY_TORCH.get(s[6:])
    name = getattr(value, "name", None)  # a numpy / CuPy dtype
    if not isinstance(name, str):
        name = getattr(value, "__name__", None)  # a numpy scalar type (numpy.float16) or ml_dtypes.bfloat16
        if name == "bool_":
            name = "bool"
    return _BY_NUMPY.get(name) if isinstance(name, str) else None
