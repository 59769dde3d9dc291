"""Kernel providers: what each kernel family needs compiled for a list of target archs, for `rtckern prefill`.

Op families register theirs at `import rtckern.ops` (`register_kernel_provider`), as they register candidates;
rtckern.prefill reads them (`kernel_providers`) and compiles what they return.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

from rtckern.arch import Arch
from rtckern.spec import KernelSpec

KernelProvider = Callable[[Sequence[Arch]], Iterable[KernelSpec]]

_providers: dict[str, KernelProvider] = {}


def register_kernel_provider(name: str, fn: KernelProvider) -> None:
    """``fn(archs) -> specs``: what family ``name`` needs compiled for ``archs`` (apply its ArchFilter)."""
    _providers[name] = fn


def kernel_providers() -> dict[str, KernelProvider]:
    """The registered providers by family name (a copy)."""
    return dict(_providers)
