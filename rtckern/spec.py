"""``KernelSpec``: the only input of a cache key."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Iterable, Mapping

from .arch import Arch
from .sources import read_source, resolve_includes

CACHE_FORMAT_VERSION = 2  # 2: entries bound to their key; settings' options and user headers in the key


@dataclasses.dataclass(frozen=True)
class KeyInputs:
    """What the compiler adds to a spec's own fields: its identity (name, version, header version, base options),
    the options the settings add (RTCKERN_LINEINFO's -lineinfo), and the include directories a header may come
    from. Headers under user include dirs (RTCKERN_INCLUDE_DIRS) are hashed by content, labelled by their path
    relative to that dir (never an absolute path, so keys are the same on every machine); headers found only in the
    system dirs (CUDA's) are covered by the identity's header version."""

    compiler_id: str
    setting_options: tuple[str, ...] = ()
    user_include_dirs: tuple[Path, ...] = ()
    system_include_dirs: tuple[Path, ...] = ()


def _render_template_arg(a: Any) -> str:
    if isinstance(a, bool):
        return "true" if a else "false"
    if isinstance(a, (int, str)):
        return str(a)
    raise TypeError(f"template argument {a!r} must be int, bool or str (a C++ type or constant expression)")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """What to compile. Frozen and hashable: the hot path uses it as a dict key without reading any file.

    ``source`` is a path under ``kernel_sources/``; ``code`` is inline source text (then ``source`` is only a
    display name). ``op`` is metadata for the cache sidecar and is not part of the key.
    """

    source: str
    name: str
    arch: Arch
    template_args: tuple = ()
    defines: tuple = ()
    options: tuple = ()
    code: str = ""
    op: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        set_ = object.__setattr__
        if isinstance(self.arch, str):
            set_(self, "arch", Arch.parse(self.arch))
        set_(self, "template_args", tuple(_render_template_arg(a) for a in self.template_args))
        defs: Iterable = self.defines.items() if isinstance(self.defines, Mapping) else self.defines
        set_(self, "defines", tuple(sorted({(str(k), str(v)) for k, v in defs})))
        set_(self, "options", tuple(sorted(set(str(o) for o in self.options))))
        for o in self.options:
            if o.startswith(("-arch", "--gpu-architecture", "--offload-arch")):
                raise ValueError(f"option {o!r}: the target is set by KernelSpec.arch, not by options")

    @property
    def name_expression(self) -> str:
        if not self.template_args:
            return self.name
        return f"{self.name}<{', '.join(self.template_args)}>"

    def source_text(self) -> str:
        return self.code if self.code else read_source(self.source)

    def program_text(self) -> str:
        """What the compiler sees: defines, then the source."""
        head = "".join(f"#define {k} {v}\n" for k, v in self.defines)
        return head + self.source_text()

    def key(self, inputs: KeyInputs | str) -> str:
        """Content key: source text plus every header it includes (project and user headers by content), kernel
        name and template args, defines, sorted options and the options the settings add, target arch, compiler
        identity and version, cache format version. ``inputs``: the compiler's KeyInputs (or its identity alone)."""
        if isinstance(inputs, str):
            inputs = KeyInputs(inputs)
        text = self.source_text()
        h = hashlib.sha256()

        def field(label: str, value: str) -> None:
            b = value.encode()
            h.update(f"{label}:{len(b)}:".encode())
            h.update(b)

        field("format", str(CACHE_FORMAT_VERSION))
        field("compiler", inputs.compiler_id)
        field("target", self.arch.sm + (":ptx" if self.arch.ptx else ":bin"))
        field("kernel", self.name_expression)
        for k, v in self.defines:
            field("define", f"{k}={v}")
        for o in self.options:
            field("option", o)
        for o in inputs.setting_options:
            field("setting_option", o)
        field("source", text)
        for rel, content in resolve_includes(text, self.source if not self.code else "",
                                             inputs.user_include_dirs, inputs.system_include_dirs):
            field("header", rel)
            field("header_text", content)
        return h.hexdigest()

    def describe(self) -> str:
        return f"{self.name_expression} [{self.source}] for {self.arch.sm}{' (PTX)' if self.arch.ptx else ''}"
