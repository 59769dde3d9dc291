"""hiprtc: the same kernel sources to an AMD GPU code object (``hsaco``), with no GPU and no driver needed.

Bound with ``ctypes``, not hip-python. The oldest hip-python on PyPI (6.2) opens ``libhiprtc.so`` by that fixed
name, and Debian's ROCm 5.2 has no such library: there hiprtc lives inside ``libamdhip64.so.5`` (ROCm split it out
later). ``ctypes`` binds the eleven hiprtc functions wherever they are: ``libhiprtc.so*`` (newer ROCm) first,
then ``libamdhip64.so*``. hiprtc itself aborts the process (not an error code) when asked for a target its code
object manager does not know, so every target is checked first against comgr's ISA list.

Key identity: hiprtc API version, the HIP library's full version (its file name), comgr's version, the base
options, and the wavefront rule; the gfx target is in the key already, and with the rule it fixes the wavefront
size, which every compile also passes explicitly (``-mwavefrontsize64`` / ``-mno-wavefrontsize64`` and
``-DRTK_WAVEFRONT_SIZE``). ``identity_for(arch)`` spells both out.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import threading
import time
from pathlib import Path
from typing import Sequence

from ..config import settings
from ..errors import ArchError, CompileError, RtckernError
from ..sources import kernel_sources_dir
from ..spec import KernelSpec, KeyInputs
from .base import CompiledKernel, Compiler
from .hsaco import CodeObjectError, read_code_object

# Every compile gets these; they are part of the compiler identity (so of every key).
BASE_OPTIONS = ("-std=c++17", "-O3", "-DRTK_HIPRTC=1", "-Wno-pragma-once-outside-header")
# GCN/CDNA (gfx6..gfx9) run 64-wide wavefronts only; RDNA (gfx10..gfx12) default to 32 under HIP.
WAVEFRONT_RULE = "wave64:gfx6-gfx9;wave32:gfx10+"
_HIPRTC_SONAMES = ("libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6", "libhiprtc.so.5",
                   "libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5")
_COMGR_SONAMES = ("libamd_comgr.so", "libamd_comgr.so.3", "libamd_comgr.so.2")
INSTALL_HINT = ("install hiprtc: on Debian 12 `apt-get install libamdhip64-5 libhiprtc-builtins5` (ROCm 5.2), or a "
                "ROCm release from AMD; point RTCKERN_HIPRTC_LIBRARY at the library (or ROCM_PATH at the install) "
                "if it is not on the loader path")
# Targets newer than some hiprtc: what to install for them (shown when this hiprtc does not know the target).
_NEWER_TARGET_HINTS = {
    "gfx940": "MI300-series targets (gfx940/gfx941/gfx942) need hiprtc from ROCm 6.0 or newer",
    "gfx941": "MI300-series targets (gfx940/gfx941/gfx942) need hiprtc from ROCm 6.0 or newer",
    "gfx942": "MI300-series targets (gfx940/gfx941/gfx942) need hiprtc from ROCm 6.0 or newer",
}
# NVRTC spellings an op may pass, and their clang equivalents; NVRTC-only options with none are refused.
_NVRTC_OPTION_MAP = {"--use_fast_math": "-ffast-math", "-use_fast_math": "-ffast-math",
                     "--fmad=true": "-ffp-contract=fast", "--fmad=false": "-ffp-contract=off"}
_NVRTC_ONLY = ("--extra-device-vectorization", "-Xptxas", "--ptxas-options", "-maxrregcount", "--maxrregcount",
               "--device-as-default-execution-space", "-default-device", "-lineinfo", "--generate-line-info",
               "--relocatable-device-code", "-rdc", "--dopt")
_NAME_EXPRESSION_NOT_VALID = 10  # HIPRTC_ERROR_NAME_EXPRESSION_NOT_VALID
_COMGR_TMP = re.compile(r"/tmp/comgr-[^/\s]+/input/CompileSource")


class HiprtcUnavailable(RtckernError, ImportError):
    """No hiprtc library could be loaded on this machine."""


class UnsupportedOptionError(RtckernError, ValueError):
    """An NVRTC-only compile option in a spec built for an AMD target."""


class _Library:
    """The loaded hiprtc functions, the library file they came from, and comgr (for its target list)."""

    def __init__(self, lib: ctypes.CDLL, path: str, comgr: ctypes.CDLL | None):
        self.lib, self.path, self.comgr = lib, path, comgr
        c = ctypes
        lib.hiprtcGetErrorString.restype = c.c_char_p
        lib.hiprtcGetErrorString.argtypes = [c.c_int]
        sigs = {
            "hiprtcVersion": [c.POINTER(c.c_int), c.POINTER(c.c_int)],
            "hiprtcCreateProgram": [c.POINTER(c.c_void_p), c.c_char_p, c.c_char_p, c.c_int, c.c_void_p, c.c_void_p],
            "hiprtcDestroyProgram": [c.POINTER(c.c_void_p)],
            "hiprtcAddNameExpression": [c.c_void_p, c.c_char_p],
            "hiprtcCompileProgram": [c.c_void_p, c.c_int, c.POINTER(c.c_char_p)],
            "hiprtcGetLoweredName": [c.c_void_p, c.c_char_p, c.POINTER(c.c_char_p)],
            "hiprtcGetProgramLogSize": [c.c_void_p, c.POINTER(c.c_size_t)],
            "hiprtcGetProgramLog": [c.c_void_p, c.c_char_p],
            "hiprtcGetCodeSize": [c.c_void_p, c.POINTER(c.c_size_t)],
            "hiprtcGetCode": [c.c_void_p, c.c_char_p],
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, c.c_int

    def check(self, result: int, what: str) -> None:
        if result != 0:
            msg = self.lib.hiprtcGetErrorString(result)
            raise RtckernError(f"hiprtc {what} failed: {msg.decode() if msg else result}")


def _search_paths() -> list[str]:
    s = settings()
    if s.hiprtc_library is not None:
        return [str(s.hiprtc_library)]
    out = []
    for root in (s.rocm_path, Path("/opt/rocm")):
        if root is not None:
            out += [str(root / "lib" / n) for n in _HIPRTC_SONAMES]
    return out + list(_HIPRTC_SONAMES)  # then the loader's own search path


def _open_comgr(near: str) -> ctypes.CDLL | None:
    names = [str(Path(near).parent / n) for n in _COMGR_SONAMES if "/" in near] + list(_COMGR_SONAMES)
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            lib.amd_comgr_get_isa_count  # noqa: B018 - raises AttributeError if this is not comgr
            return lib
        except (OSError, AttributeError):
            continue
    return None


@functools.lru_cache(maxsize=1)
def load_library() -> _Library:
    """Open the first library that has hiprtc; raise ``HiprtcUnavailable`` (with what was tried) if none does."""
    tried = []
    for name in _search_paths():
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            tried.append(f"{name}: {str(e).split(':')[-1].strip()}")
            continue
        if not hasattr(lib, "hiprtcCreateProgram"):
            tried.append(f"{name}: has no hiprtcCreateProgram")
            continue
        path = _loaded_path(lib, name)
        return _Library(lib, path, _open_comgr(path))
    raise HiprtcUnavailable("no hiprtc library found (tried " + "; ".join(tried) + "). To compile for AMD GPUs, "
                            + INSTALL_HINT + ".")


def _loaded_path(lib: ctypes.CDLL, name: str) -> str:
    """The real file behind a loaded library (its name carries the full version: libamdhip64.so.5.2.21153)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1] if line.strip() else ""
                if p.startswith("/") and Path(p).name.startswith(Path(name).name.split(".so")[0] + ".so"):
                    return os.path.realpath(p)
    except OSError:
        pass
    return os.path.realpath(name) if "/" in name else name


def wavefront_size(gfx: str, options: Sequence[str] = ()) -> int:
    """Wavefront size of a compile: an explicit ``-m[no-]wavefrontsize64`` wins, else the target's default."""
    for o in reversed(tuple(options)):
        if o == "-mwavefrontsize64":
            return 64
        if o == "-mno-wavefrontsize64":
            return 32
    return 32 if re.match(r"^gfx1\d\d\d", gfx) else 64


def translate_options(options: Sequence[str]) -> list[str]:
    """NVRTC spellings to clang's; refuse NVRTC-only options instead of passing hiprtc something it rejects."""
    out = []
    for o in options:
        if o in _NVRTC_OPTION_MAP:
            out.append(_NVRTC_OPTION_MAP[o])
        elif o.startswith(_NVRTC_ONLY):
            raise UnsupportedOptionError(f"option {o!r} is NVRTC-only and has no hiprtc equivalent; leave it out of AMD specs "
                            f"(hiprtc takes clang options such as -ffast-math, -D..., -O2)")
        else:
            out.append(o)
    return out


def lowered_by_instantiation(binary: bytes, expr: str) -> str:
    """The mangled name of ``expr``'s kernel, found in the code object.

    hiprtc 5.2 finds a name expression by comparing its text with demangled names, so a typedef in the
    template arguments (``axpy<rtk_half>``, demangled ``axpy<__half>``) or a constant expression (``2*8``) is not
    found. The expression is the only thing that instantiates the template, so the code object holds exactly
    one kernel of that template: its mangled name starts ``_Z<len><name>I`` (``_ZN<len><ns>...I`` in a namespace).
    """
    base = expr.split("<", 1)[0].strip()
    parts = [p for p in base.split("::") if p]
    enc = "".join(f"{len(p)}{p}" for p in parts)
    prefix = ("_ZN" + enc if len(parts) > 1 else "_Z" + enc) + "I"
    found = sorted(k for k in read_code_object(binary).kernels if k.startswith(prefix))
    if len(found) != 1:
        raise RtckernError(f"hiprtc could not resolve the name expression {expr!r}, and the code object has "
                           f"{len(found)} instantiations of {base} ({found}); spell the template arguments as the "
                           "compiler prints them (no typedefs, no constant expressions)")
    return found[0]


class HiprtcCompiler(Compiler):
    name = "hiprtc"
    vendor = "amd"

    def __init__(self):
        self._lib = load_library()  # raises HiprtcUnavailable with the fix
        self._lock = threading.Lock()  # one compile at a time in a process: hiprtc 5.x runs clang in-process
        self._identity: str | None = None

    @property
    def library_path(self) -> str:
        return self._lib.path

    @functools.lru_cache(maxsize=1)
    def api_version(self) -> tuple[int, int]:
        """What ``hiprtcVersion`` says (HIP 5.2's answers 9.0, an NVRTC-style constant; newer ones the ROCm version)."""
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._lib.check(self._lib.lib.hiprtcVersion(ctypes.byref(major), ctypes.byref(minor)), "version")
        return major.value, minor.value

    @functools.lru_cache(maxsize=1)
    def library_version(self) -> str:
        """The full version in the library's file name (``5.2.21153``), or '' if it carries none."""
        m = re.search(r"\.so\.(\d+(?:\.\d+)*)$", self._lib.path)
        return m.group(1) if m else ""

    def version(self) -> tuple[int, int]:
        parts = self.library_version().split(".")
        if len(parts) >= 2:
            return int(parts[0]), int(parts[1])
        return self.api_version()

    @functools.lru_cache(maxsize=1)
    def comgr_version(self) -> str:
        cg = self._lib.comgr
        if cg is None:
            return "unknown"
        a, b = ctypes.c_size_t(), ctypes.c_size_t()
        cg.amd_comgr_get_version(ctypes.byref(a), ctypes.byref(b))
        return f"{a.value}.{b.value}"

    @functools.lru_cache(maxsize=1)
    def supported_archs(self) -> tuple[str, ...]:
        """The gfx targets this hiprtc's code object manager knows (empty if comgr's list is unreadable)."""
        cg = self._lib.comgr
        if cg is None:
            return ()
        n = ctypes.c_size_t()
        if cg.amd_comgr_get_isa_count(ctypes.byref(n)) != 0:
            return ()
        names = []
        for i in range(n.value):
            p = ctypes.c_char_p()
            if cg.amd_comgr_get_isa_name(ctypes.c_size_t(i), ctypes.byref(p)) == 0 and p.value:
                names.append(p.value.decode().rsplit("--", 1)[-1].split(":", 1)[0])
        return tuple(dict.fromkeys(names))

    def identity(self) -> str:
        if self._identity is None:
            api = "%d.%d" % self.api_version()
            lib = Path(self._lib.path).name
            self._identity = (f"hiprtc-{api}|{lib}|comgr-{self.comgr_version()}|{WAVEFRONT_RULE}|"
                              + " ".join(BASE_OPTIONS))
        return self._identity

    def identity_for(self, arch) -> str:
        """The identity with the target and its default wavefront size spelled out."""
        return f"{self.identity()}|{arch.gfx}|wave{wavefront_size(arch.gfx)}"

    def include_dirs(self) -> list[Path]:
        return [kernel_sources_dir(), *settings().extra_include_dirs]

    def key_inputs(self) -> KeyInputs:
        # RTCKERN_LINEINFO adds nothing here (-lineinfo is NVRTC-only), so no setting option is in the key.
        return KeyInputs(self.identity(), (), tuple(settings().extra_include_dirs))

    def check_target(self, gfx: str) -> None:
        if not gfx:
            raise ArchError("hiprtc compiles for AMD gfx targets (gfx90a, gfx942, ...); NVIDIA targets go to NVRTC")
        known = self.supported_archs()
        if known and gfx not in known:
            hint = _NEWER_TARGET_HINTS.get(gfx, "a newer ROCm may know it")
            v = self.library_version() or "%d.%d" % self.api_version()
            raise ArchError(f"hiprtc (HIP {v}, {Path(self._lib.path).name}) cannot target {gfx}; it targets "
                            f"{', '.join(known)}. {hint}; " + INSTALL_HINT + ".")

    def options_for(self, spec: KernelSpec) -> list[str]:
        gfx = spec.arch.gfx
        user = translate_options(spec.options)
        wave = wavefront_size(gfx, user)
        wave_flag = "-mwavefrontsize64" if wave == 64 else "-mno-wavefrontsize64"
        opts = [f"--offload-arch={gfx}", *BASE_OPTIONS, wave_flag, f"-DRTK_WAVEFRONT_SIZE={wave}", *user]
        return opts + [f"-I{d}" for d in self.include_dirs()]

    def compile(self, spec: KernelSpec) -> CompiledKernel:
        gfx = spec.arch.gfx
        self.check_target(gfx)  # before hiprtc: an unknown target aborts the process inside hiprtc 5.2
        opts = self.options_for(spec)
        text = spec.program_text()
        prog_name = Path(spec.source).name or "kernel.hip"
        with self._lock:
            t0 = time.perf_counter()
            binary, lowered, log, ok = self._run(text, prog_name, spec.name_expression, opts)
            ms = (time.perf_counter() - t0) * 1e3
        log = _COMGR_TMP.sub(prog_name, log)
        if not ok:
            raise CompileError(kernel=spec.name_expression, arch=gfx, options=[o for o in opts if not o.startswith("-I")],
                               log=log, source=text, source_name=prog_name,
                               compiler=f"hiprtc (HIP {self.library_version() or '%d.%d' % self.api_version()})")
        self._verify(binary, spec, lowered, opts)
        return CompiledKernel(binary=binary, kind="hsaco", lowered_name=lowered, log=log, compile_ms=ms)

    def _run(self, text: str, prog_name: str, expr: str, opts: list[str]) -> tuple[bytes, str, str, bool]:
        lib, c = self._lib, ctypes
        prog = c.c_void_p()
        lib.check(lib.lib.hiprtcCreateProgram(c.byref(prog), text.encode(), prog_name.encode(), 0, None, None),
                  "create program")
        try:
            lib.check(lib.lib.hiprtcAddNameExpression(prog, expr.encode()), "add name expression")
            arr = (c.c_char_p * len(opts))(*[o.encode() for o in opts])
            result = lib.lib.hiprtcCompileProgram(prog, len(opts), arr)
            log = self._log(prog)
            if result != 0:
                return b"", "", log, False
            size = c.c_size_t()
            lib.check(lib.lib.hiprtcGetCodeSize(prog, c.byref(size)), "code size")
            buf = c.create_string_buffer(size.value)
            lib.check(lib.lib.hiprtcGetCode(prog, buf), "code")
            binary = buf.raw[:size.value]
            lowered = c.c_char_p()
            if lib.lib.hiprtcGetLoweredName(prog, expr.encode(), c.byref(lowered)) == _NAME_EXPRESSION_NOT_VALID:
                return binary, lowered_by_instantiation(binary, expr), log, True
            return binary, (lowered.value or b"").decode(), log, True
        finally:
            lib.lib.hiprtcDestroyProgram(c.byref(prog))

    def _log(self, prog) -> str:
        lib, c = self._lib, ctypes
        size = c.c_size_t()
        lib.check(lib.lib.hiprtcGetProgramLogSize(prog, c.byref(size)), "log size")
        if size.value <= 1:
            return ""
        buf = c.create_string_buffer(size.value)
        lib.check(lib.lib.hiprtcGetProgramLog(prog, buf), "log")
        return buf.value.decode(errors="replace")

    @staticmethod
    def _verify(binary: bytes, spec: KernelSpec, lowered: str, opts: list[str]) -> None:
        """The code object is for the keyed target and wavefront size, and holds the kernel (cheap: one ELF note)."""
        try:
            info = read_code_object(binary)
            k = info.kernel(lowered)
        except CodeObjectError as e:
            raise RtckernError(f"hiprtc returned an unusable code object for {spec.describe()}: {e}") from None
        want = wavefront_size(spec.arch.gfx, opts)
        if info.gfx != spec.arch.gfx or k.wavefront_size != want:
            raise RtckernError(f"hiprtc built {info.target} with wavefront {k.wavefront_size} for {spec.describe()}, "
                               f"expected {spec.arch.gfx} with wavefront {want}: the cache key would be wrong")
