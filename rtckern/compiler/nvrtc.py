"""NVRTC: CUDA C++ source to cubin (or PTX), with no GPU and no driver needed."""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from pathlib import Path

from ..arch import nvrtc_unsupported_message
from ..cache import file_memo
from ..config import settings
from ..errors import ArchError, CompileError, RtckernError
from ..sources import kernel_sources_dir
from ..spec import KernelSpec, KeyInputs
from . import nvrtc_facts, toolkit
from .base import CompiledKernel, Compiler
from .nvrtc_facts import NvrtcFacts

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
    """CUDA headers (cuda_fp16.h, ...): the nvidia-cuda-runtime wheel (found as cuda-pathfinder finds it, without
    importing it: toolkit.wheel_headers), else cuda-pathfinder's answer, else CUDA_HOME."""
    tried = []
    found = toolkit.wheel_headers()
    if found is None:
        try:
            from cuda import pathfinder

            found = pathfinder.find_nvidia_header_directory("cudart")
        except Exception as e:  # pathfinder missing or failing: fall back
            tried.append(f"cuda-pathfinder: {e}")
    if found and (Path(found) / "cuda_fp16.h").is_file():
        return Path(found)
    if not tried:
        tried.append(f"cuda-pathfinder: {found}")
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
    """CUDA_VERSION from the headers' cuda.h (e.g. 13000): a header change changes every key. Remembered per file
    identity in the cache dir (cache/file_memo.py; the headers are installed, not edited, as NVRTC's library is),
    so a process on a warm cache does not read the header for it."""
    path = cuda_include_dir() / "cuda.h"
    try:
        ident = file_memo.file_identity(path)
    except OSError:
        return 0
    memo = file_memo.memo_path("toolchain", "cuda-h", json.dumps(ident, sort_keys=True), ".json")
    try:
        data = json.loads(file_memo.read(memo) or b"null")
    except ValueError:
        data = None
    if isinstance(data, dict) and data.get("header") == ident and type(data.get("cuda_version")) is int:
        return data["cuda_version"]
    version = _read_cuda_version(path)
    if version:
        file_memo.write(memo, json.dumps({"header": ident, "cuda_version": version}, sort_keys=True).encode())
    return version


def _read_cuda_version(path: Path) -> int:
    """The define sits near the top of a file of >1 MB: the first 64 KB are searched first, the whole file only if
    they lack it."""
    define = re.compile(r"#define\s+CUDA_VERSION\s+(\d+)")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
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
        self._lock = threading.RLock()
        self._identity: str | None = None
        self._facts: NvrtcFacts | None = None  # version and supported archs, from a memo or the library
        self._library: Path | None = None  # the wheel's libnvrtc the facts are of; None: pathfinder's choice
        self._checked = False  # the loaded library said what the facts say

    def version(self) -> tuple[int, int]:
        return self._known().version

    def supported_archs(self) -> tuple[int, ...]:
        return self._known().archs

    def _known(self) -> NvrtcFacts:
        """The facts of the NVRTC this process compiles with: remembered for its library file (nvrtc_facts),
        else read from the library, once per process."""
        f = self._facts
        if f is None:
            with self._lock:
                if self._facts is None:
                    self._library = toolkit.wheel_nvrtc()
                    known = nvrtc_facts.recall(self._library) if self._library is not None else None
                    self._facts = known or self._read_facts()
                f = self._facts
        return f

    def _read_facts(self) -> NvrtcFacts:
        """Load NVRTC, ask it, and remember its answer for its file when the file did not change meanwhile."""
        lib = self._library
        before = nvrtc_facts.file_identity(lib) if lib is not None else None
        facts = self._ask_library()
        self._checked = True
        if lib is not None and nvrtc_facts.file_identity(lib) == before:
            nvrtc_facts.remember(before, facts)
        return facts

    def _ask_library(self) -> NvrtcFacts:
        from cuda.bindings import nvrtc

        if self._library is not None:
            toolkit.preload_nvrtc(self._library)  # so cuda.bindings uses this very file (see nvrtc_facts)
        major, minor = _check(nvrtc.nvrtcVersion(), "version")
        archs = _check(nvrtc.nvrtcGetSupportedArchs(), "supported archs")
        return NvrtcFacts((int(major), int(minor)), tuple(int(a) for a in archs))

    def _ensure_loaded(self) -> None:
        """Before the first compile: NVRTC loaded from the file whose facts made this process's keys, and saying
        those facts. Remembered facts that the library contradicts (the file changed after they were read) are
        forgotten, and the compile refused: its binary would be stored under a key naming another NVRTC."""
        if self._checked:
            return
        with self._lock:
            known = self._known()
            if self._checked:
                return
            real = self._ask_library()
            if real != known:
                if self._library is not None:
                    nvrtc_facts.forget(self._library)
                raise RtckernError(
                    f"NVRTC at {self._library or 'the path cuda-pathfinder chose'} says version "
                    f"{real.version[0]}.{real.version[1]} (archs {list(real.archs)}), but this process computed "
                    f"its cache keys for {known.version[0]}.{known.version[1]} (archs {list(known.archs)}): the "
                    "library changed while the process ran. Restart the process.")
            self._checked = True

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

    def options_for(self, spec: KernelSpec) -> list[str]:
        """Every option of ``spec``'s compile: target, base, the spec's, the settings', include dirs."""
        arch = spec.arch
        opts = [f"--gpu-architecture={arch.compute if arch.ptx else arch.sm}", *BASE_OPTIONS, *spec.options,
                *self.setting_options()]
        return opts + [f"-I{d}" for d in self.include_dirs()]

    def compile(self, spec: KernelSpec) -> CompiledKernel:
        from cuda.bindings import nvrtc

        arch = spec.arch
        if arch.gfx:
            raise ArchError(f"NVRTC cannot compile for AMD target {arch.gfx}; that needs hiprtc")
        self._ensure_loaded()
        supported = self.supported_archs()
        if arch.number not in supported:
            raise ArchError(nvrtc_unsupported_message(arch, supported, self.version()))
        opts = self.options_for(spec)
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
