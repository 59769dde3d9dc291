"""Compilers: source in, binary out."""

from __future__ import annotations

import functools

from ..arch import Arch
from .base import CompiledKernel, Compiler
from .nvrtc import NvrtcCompiler

__all__ = ["CompiledKernel", "Compiler", "NvrtcCompiler", "compiler_for"]


@functools.lru_cache(maxsize=None)
def _instance(vendor: str) -> Compiler:
    if vendor == "nvidia":
        return NvrtcCompiler()
    if vendor == "amd":
        from .hiprtc import HiprtcCompiler  # provided by the HIP backend

        return HiprtcCompiler()
    raise ValueError(f"no compiler for vendor {vendor!r}; supported: nvidia (NVRTC), amd (hiprtc)")


def compiler_for(arch: Arch) -> Compiler:
    return _instance(arch.vendor)
