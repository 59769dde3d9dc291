"""Compiler interface: source in, binary out. No caching, no loading (the manager owns both)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ..spec import KernelSpec, KeyInputs


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """A compiler's output: the binary and the symbol to look up once it is loaded."""
    binary: bytes
    kind: str  # "cubin", "ptx" or "hsaco"
    lowered_name: str  # the symbol to look up in the loaded module
    log: str = ""
    compile_ms: float = 0.0


class Compiler:
    """Subclasses turn a ``KernelSpec`` into bytes, and say who they are (for the cache key)."""

    name = "base"
    vendor = "nvidia"

    def identity(self) -> str:
        """Compiler name and version, header version, and the base options every compile gets."""
        raise NotImplementedError

    def key_inputs(self) -> KeyInputs:
        """Everything besides the spec that can change the bytes this compiler produces (see KeyInputs)."""
        return KeyInputs(self.identity())

    def version(self) -> tuple[int, int]:
        raise NotImplementedError

    def supported_archs(self) -> Sequence[int]:
        raise NotImplementedError

    def compile(self, spec: KernelSpec) -> CompiledKernel:
        raise NotImplementedError
