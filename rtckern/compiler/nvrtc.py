"""NVRTC: CUDA C++ source to cubin (or PTX), with no GPU and no driver needed."""

from __future__ import annotations

import functools
import re
import threading
import time
from pathlib import Path

from ..arch import nvrtc_unsupported_message
from ..config import settings
from ..errors import ArchError, CompileError, RtckernError
from ..sources import kernel_sources_dir
from ..spec import KernelSpec, KeyInputs
from .base import CompiledKernel, Compiler

# Every compile gets these; they are part of the compiler identity (so of every key).
BASE_OPTIONS = ("-std=c++17", "--device-as-default-execution-space", "-DRTK_NVRTC=1")


def _check(result, what: str):
    from cuda.bindings import nvrtc

    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, msg = nvrtc.nvrtcGetErrorString(err)
        raise RtckernError(f"NVRTC {what} failed: {msg.decode() if isinstance(msg, bytes) else msg}")
    return result[1] if len(result) == 2 else result[1:]


@functools.lru_cache(maxsize=1)
def cuda_include_dir() -> Path:
    """CUDA headers (cuda_fp16.h, ...): the nvidia-cuda-runtime wheel via cuda-pathfinder, else CUDA_HOME."""
    tried = []
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found and (Path(found) / "cuda_fp16.h").is_file():
            return Path(found)
        tried.append(f"cuda-pathfinder: {found}")
    except Exception as e:  # pathfinder missing or failing: fall back
        tried.append(f"cuda-pathfinder: {e}")
    home = settings().cuda_home
    if home is not None:
        for cand in (home / "include", home / "targets" / "x86_64-linux" / "include"):
            if (cand / "cuda_fp16.h").is_file():
                return cand
        tried.append(f"CUDA_HOME={home}")
    raise RtckernError("CUDA headers (cuda_fp16.h) not found; tried " + "; ".join(tried)
                       + ". Install them with `pip install nvidia-cuda-runtime` or set CUDA_HOME.")


@functools.lru_cache(maxsize=1)
def cuda_header_version() -> int:
    """CUDA_VERSION from the headers' cuda.h (e.g. 13000): a header change changes every key. The define sits near
    the top of a file of >1 MB: the first 64 KB are searched first, the whole file only if they lack it."""
    define = re.compile(r"#define\s+CUDA_VERSION\s+(\d+)")
    try:
        with open(cuda_include_dir() / "cuda.h", encoding="utf-8", errors="replace") as f:
            head = f.read(1 << 16)
            m = define.search(head)
            if m is None or m.end() == len(head):  # not there, or its digits may go on past the chunk
                m = define.search(head + f.read())
    except OSError:
        return 0
    return int(m.group(1)) if m else 0


class NvrtcCompiler(Compiler):
    name = "nvrtc"
    vendor = "nvidia"

    def __init__(self):
        self._lock = threading.Lock()
        self._identity: str | None = None

    @functools.lru_cache(maxsize=1)
    def version(self) -> tuple[int, int]:
        from cuda.bindings import nvrtc

        major, minor = _check(nvrtc.nvrtcVersion(), "version")
        return int(major), int(minor)

    @functools.lru_cache(maxsize=1)
    def supported_archs(self) -> tuple[int, ...]:
        from cuda.bindings import nvrtc

        return tuple(int(a) for a in _check(nvrtc.nvrtcGetSupportedArchs(), "supported archs"))

    def identity(self) -> str:
        if self._identity is None:
            v = self.version()
            self._identity = (f"nvrtc-{v[0]}.{v[1]}|cuda-headers-{cuda_header_version()}|"
                              + " ".join(BASE_OPTIONS))
        return self._identity

    def include_dirs(self) -> list[Path]:
        return [kernel_sources_dir(), *settings().extra_include_dirs, cuda_include_dir()]

    def setting_options(self) -> tuple[str, ...]:
        """Options the settings add to every compile (they are in the key: see key_inputs)."""
        return ("-lineinfo",) if settings().lineinfo else ()

    def key_inputs(self) -> KeyInputs:
        return KeyInputs(self.identity(), self.setting_options(), tuple(settings().extra_include_dirs),
                         (cuda_include_dir(),))

    def compile(self, spec: KernelSpec) -> CompiledKernel:
        from cuda.bindings import nvrtc

        arch = spec.arch
        if arch.gfx:
            raise ArchError(f"NVRTC cannot compile for AMD target {arch.gfx}; that needs hiprtc")
        supported = self.supported_archs()
        if arch.number not in supported:
            raise ArchError(nvrtc_unsupported_message(arch, supported, self.version()))
        target = f"--gpu-architecture={arch.compute if arch.ptx else arch.sm}"
        opts = [target, *BASE_OPTIONS, *spec.options, *self.setting_options()]
        opts += [f"-I{d}" for d in self.include_dirs()]
        text = spec.program_text()
        prog_name = Path(spec.source).name or "kernel.cu"
        t0 = time.perf_counter()
        prog = _check(nvrtc.nvrtcCreateProgram(text.encode(), prog_name.encode(), 0, [], []), "create program")
        try:
            expr = spec.name_expression.encode()
            _check(nvrtc.nvrtcAddNameExpression(prog, expr), "add name expression")
            bopts = [o.encode() for o in opts]
            result = nvrtc.nvrtcCompileProgram(prog, len(bopts), bopts)
            log = self._log(prog)
            if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                raise CompileError(kernel=spec.name_expression, arch=arch.sm + (" (PTX)" if arch.ptx else ""),
                                   options=[o for o in opts if not o.startswith("-I")], log=log,
                                   source=text, source_name=prog_name, compiler="NVRTC %d.%d" % self.version())
            lowered = _check(nvrtc.nvrtcGetLoweredName(prog, expr), "lowered name")
            lowered = lowered.decode() if isinstance(lowered, bytes) else str(lowered)
            if arch.ptx:
                size = _check(nvrtc.nvrtcGetPTXSize(prog), "PTX size")
                buf = b" " * size
                _check(nvrtc.nvrtcGetPTX(prog, buf), "PTX")
                binary, kind = buf.rstrip(b"\x00") + b"\x00", "ptx"
            else:
                size = _check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
                buf = b" " * size
                _check(nvrtc.nvrtcGetCUBIN(prog, buf), "cubin")
                binary, kind = bytes(buf), "cubin"
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
        ms = (time.perf_counter() - t0) * 1e3
        return CompiledKernel(binary=binary, kind=kind, lowered_name=lowered, log=log, compile_ms=ms)

    @staticmethod
    def _log(prog) -> str:
        from cuda.bindings import nvrtc

        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        if size <= 1:
            return ""
        buf = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "log")
        return buf.rstrip(b"\x00").decode(errors="replace")
