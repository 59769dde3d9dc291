"""The native front of torch.ops.rtckern (_torch_native.cpp): a C++ kernel at AutogradCUDA that replays a plain
eager call's launches without entering Python, learning them from the op's Python implementation on the first call
of each argument signature.

    RTCKERN_TORCH_NATIVE=auto   load the library where it is built; otherwise build it in a background process for
                                the next process (CUDA builds of torch only), and use the Python kernels meanwhile
    RTCKERN_TORCH_NATIVE=1      build it at import (tens of seconds, once per machine and torch) or fail
    RTCKERN_TORCH_NATIVE=0      never

The library is built with the system C++ compiler (CXX, else c++ / g++ / clang++) against the installed torch's
headers, cached as the native launcher is (rtckern.runtime.native.built_artifact), and named by its source, torch's
version and ABI, the compiler and the platform, so a torch upgrade builds anew.

What is replayed: a call that needs no gradient, with plain dense CUDA tensors (no subclass, fake tensor, dispatch
mode or functorch layer) and 16-byte aligned inputs, whose first call of the same device, dtypes, shapes, strides,
storage sharing and scalars (`record`) allocated only its outputs and workspaces, zeroed some of them and made only
prepared launches (rtckern.runtime Kernel.prepare) whose addresses are its inputs', outputs' and workspaces' (tensor
maps included). The op's kernels, grid, block and constant arguments are then those of the Python path by
construction. Anything else (a buffer kept across calls, a torch op on the way, an unrecorded launch route, a
fallback to torch's implementation) marks the signature, and its calls go to the Python kernels as before. The kernel
sits at AutogradCUDA and at CUDA (calls under torch.inference_mode() skip the autograd keys); KernelOp calls without a
gradient go through it. `status()` says what each op holds. The recipes are dropped whenever the PlanCaches are
(settings changes, rtckern.clear_caches(), set_manager).

Calls needing a gradient of the ops in GRAD_FORMULAS (the norms, attention and variable-length attention, composites
and forward kernel ops, softmax, swiglu, rope and cross entropy) make a C++ autograd node (torch::autograd::Function)
instead of the Python autograd.Function: its forward calls the op below autograd (replayed, or the op's Python
implementation), its backward calls the backward op through the dispatcher (replayed as any call without a gradient),
so a training step's forward and backward of these ops never enter Python. The C++ formulas mirror the Python ones;
calls the front does not serve (tracing, modes, subclasses, reference_mode, rope tables that need a gradient) keep the
Python autograd.Function.

The op layer's own functions (and rtckern.torch's rms_norm / layer_norm entry points) that take their torch op's
arguments (rtckern.ops._common.DIRECT_SLOTS: rms_norm, with or without a residual, and layer_norm without statistics
or out_dtype, and their backwards; softmax and its masked and causal forms, forward and backward; gemm_fp8,
quantize_fp8, rms_norm_quant) reach the same recipes from Python through one C function (direct_call, installed as
rtckern.runtime.native.direct_front; built where Python's headers are): a call of such a function with torch tensors
replays its op's recipe without the function's Python path, the dispatcher or torch.ops' Python layer; a key not
learned yet is called through the dispatcher, which records it (with the fallback to torch off: an unsupported
request raises, as the function does); anything else runs the function's Python path.

Under torch.inference_mode(), make_fx records the composite ops (rms_norm, attention, ...) themselves rather than
their decomposition, since they have a CUDA kernel now; torch.compile and export still decompose them.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import struct
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import torch

from rtckern.caches import on_clear
from rtckern.config import settings
from rtckern.errors import LaunchError
from rtckern.ops._common import DIRECT_SLOTS
from rtckern.runtime.native import direct_front

from . import _torch_dispatch
from ._torch_dispatch import reference_hooks
from ._torch_eager import NATIVE_GRAD_OPS, NATIVE_OPS
from ._torch_lib import COMPOSITE_DIRECT, COMPOSITE_FN, KERNEL_OPS, LIB, QUALIFIED

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_torch_native.cpp")
SUBDIR = "torch_native"
RECORDER_PREFIX = "_native_record_"
PYTHON_PREFIX = "_native_python_"
MAX_RECIPES = 4096  # recipes and refused signatures over all ops; past it every one is dropped and relearned

_state: dict[str, object] = {}  # "lib" (ctypes handle), "ops" (names served), "why" (why there is none)
_held: list = []  # the prepared launches whose functions the recipes launch (each keeps its module loaded)
# what the recipes dropped by the last clear launched: kept until the next clear, since a replay running in another
# thread (which holds no GIL) may still launch one of them
_retired: list = []
_refusals: dict[str, str] = {}  # op -> why its last refused signature was refused
_record_lock = threading.Lock()
# The ops whose gradient formula the library has too (a C++ autograd node per call needing a gradient, instead of
# the Python autograd.Function): op -> (the formula, its backward op, the op that recomputes statistics the forward
# did not return; for a composite, its forward kernel op). Each C++ formula mirrors the op's Python one
# (_torch_norms.py, _torch_attention.py, _torch_attention_varlen.py, _torch_softmax.py, _torch_glu.py, _torch_rope.py,
# _torch_loss.py): change both.
GRAD_FORMULAS = {
    "rms_norm_fwd": ("rms_norm", "rms_norm_bwd", "rms_norm_fwd"),
    "fused_add_rms_norm_fwd": ("fused_add_rms_norm", "rms_norm_bwd", "rms_norm_fwd"),
    "layer_norm_fwd": ("layer_norm", "layer_norm_bwd", "layer_norm_fwd"),
    "attention_fwd": ("attention", "attention_bwd", "attention_fwd"),
    "attention_varlen_fwd": ("attention_varlen", "attention_varlen_bwd", "attention_varlen_fwd"),
    # the composites: one node for the whole call (their forward kernel op, with the statistics, below autograd)
    "rms_norm": ("rms_norm", "rms_norm_bwd", "rms_norm_fwd"),
    "fused_add_rms_norm": ("fused_add_rms_norm", "rms_norm_bwd", "fused_add_rms_norm_fwd"),
    "layer_norm": ("layer_norm", "layer_norm_bwd", "layer_norm_fwd"),
    "attention": ("attention", "attention_bwd", "attention_fwd"),
    "attention_varlen": ("attention_varlen", "attention_varlen_bwd", "attention_varlen_fwd"),
    **{op: ("softmax", op + "_bwd", op) for op in ("softmax", "scaled_masked_softmax",
                                                    "scaled_upper_triang_masked_softmax",
                                                    "scaled_aligned_causal_masked_softmax")},
    "swiglu": ("swiglu", "swiglu_bwd", "swiglu"),
    "rope": ("rope", "rope_bwd", "rope"),  # (tables that need a gradient keep the Python formula)
    "cross_entropy_fwd": ("cross_entropy", "cross_entropy_bwd", "cross_entropy_fwd"),
}


# ---- build and load ---------------------------------------------------------------------------------------------
def _cxx() -> list[str] | None:
    from rtckern.runtime.native import find_compiler

    return find_compiler(settings().cxx_compiler, ("c++", "g++", "clang++"))


def _torch_dir() -> Path:
    return Path(torch.__file__).parent


def _linked() -> str:
    """Size and mtime of the torch libraries the build links: a torch rebuilt under the same version builds anew."""
    out = []
    for name in ("libc10.so", "libtorch_cpu.so", "libtorch_python.so"):
        try:
            st = os.stat(_torch_dir() / "lib" / name)
            out.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            out.append(f"{name}:missing")
    return " ".join(out)


def artifact_name() -> str:
    """The library's file name: a hash of what the build depends on."""
    h = hashlib.sha256(SOURCE.read_bytes())
    cxx = _cxx() or ["none"]
    for part in (torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI), " ".join(cxx), str(_torch_dir()), _linked(),
                 sysconfig.get_platform(), platform.machine(), " ".join(platform.libc_ver()),
                 str(sysconfig.get_config_var("SOABI")), str(_python_headers())):
        h.update(b"\0" + part.encode())
    return f"rtckern_torch_native-{h.hexdigest()[:20]}.so"


def _missing_tools() -> str | None:
    """Why the library cannot be built here, or None."""
    if _cxx() is None:
        return "no C++ compiler found (set CXX, or install g++ or clang++)"
    if not (_torch_dir() / "include" / "torch" / "library.h").is_file():
        return f"torch's C++ headers are not at {_torch_dir() / 'include'} (a torch install without headers)"
    return None


def _python_headers() -> Path | None:
    """Python's C headers, which the direct entry (rtckern.ops' functions calling the front) is built against; the
    library is built without that entry where they are missing."""
    include = Path(sysconfig.get_paths()["include"])
    return include if (include / "Python.h").is_file() else None


def build(dest: Path) -> None:
    """Compile _torch_native.cpp into dest (atomically)."""
    from rtckern.runtime.native import compile_atomically

    why = _missing_tools()
    if why is not None:
        raise LaunchError(f"{why}: the native front of torch.ops.rtckern cannot be built; RTCKERN_TORCH_NATIVE=0 "
                          "turns it off")
    cxx, tdir, python = _cxx(), _torch_dir(), _python_headers()
    include = tdir / "include"
    lib = tdir / "lib"
    direct = [] if python is None else ["-DRTK_DIRECT", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
                                        f"-I{python}"]
    compile_atomically(dest, lambda out: [
        *cxx, "-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-I{include}", *direct, str(SOURCE),
        "-o", out, f"-L{lib}", "-lc10", "-ltorch_cpu", *(["-ltorch_python"] if python else []),
        f"-Wl,-rpath,{lib}", "-ldl"], timeout=600)


def _open(path: Path):
    """Load the library at path: through one descriptor, checked as runtime.native checks a build (a regular file of
    this user or root that no one else can write), so the file loaded is the file checked."""
    from rtckern.runtime.native import trusted_stat

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if not trusted_stat(os.fstat(fd)):
            raise LaunchError(f"{path}: not a file of this user that only it can write; not loaded")
        # dlopen through the descriptor (torch.ops.load_library would resolve the real path and load the file by
        # name again); the library registers nothing when loaded: rtk_register does
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    lib.rtk_init.argtypes = [ctypes.c_char_p]
    lib.rtk_register.argtypes = [ctypes.c_char_p] * 5
    lib.rtk_register_grad.argtypes = [ctypes.c_char_p] * 4
    lib.rtk_offer.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.rtk_size.restype = ctypes.c_size_t
    lib.rtk_count.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.rtk_count.restype = ctypes.c_long
    lib.rtk_test_device.argtypes = [ctypes.c_void_p]
    lib.rtk_bypass.argtypes = [ctypes.c_int]
    lib.rtk_grad_bypass.argtypes = [ctypes.c_int]
    if hasattr(lib, "rtk_direct_bind"):  # (built with Python's headers)
        lib.rtk_direct_bind.argtypes = [ctypes.c_int, ctypes.c_char_p]
    return lib


def direct_function(lib):
    """The library's direct entry (direct_call in _torch_native.cpp) as a Python function; None where the library
    was built without Python's headers."""
    if not hasattr(lib, "rtk_direct_function"):
        return None
    return ctypes.PYFUNCTYPE(ctypes.py_object)(("rtk_direct_function", lib))()


def direct_op(function: str) -> str:
    """The torch op (rtckern::<name>) an op-layer function of rtckern.ops._common.DIRECT_SLOTS is served by: the
    same arguments, in the op's order, and the same results (the norms' backward ops return empty placeholders where
    the function returns None; gemm_fp8's out_dtype None is the function's "bf16"); "fused_add_rms_norm" is
    rms_norm with a residual."""
    return function[:-len("_backward")] + "_bwd" if function.endswith("_backward") else function


def _library(build_now: bool):
    """The loaded library, building it first where build_now; None when it is not built."""
    from rtckern.runtime.native import built_artifact, find_artifact

    name = artifact_name()
    path = built_artifact(SUBDIR, name, build) if build_now else find_artifact(SUBDIR, name)
    return None if path is None else _open(path)


def _failure_stamp() -> Path:
    return settings().cache_dir / SUBDIR / (artifact_name() + ".failed")


def _build_in_background() -> str:
    """Start `python -m rtckern.plugins._torch_native` detached (niced): it builds the library for the next process.
    Returns why it was not started, or that it was; a build that failed before (its stamp) is not tried again."""
    why = _missing_tools()
    if why is not None:
        return why
    stamp = _failure_stamp()
    if stamp.exists():
        return f"its build failed before (see {stamp}; delete it to try again)"
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    try:
        subprocess.Popen([*nice, sys.executable, "-m", "rtckern.plugins._torch_native"], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        return f"its build could not be started ({e})"
    log.info("rtckern.torch: building the native front of torch.ops.rtckern in the background (once per machine and "
             "torch version); this process uses the Python kernels")
    return "a background build was started"


# ---- registration -------------------------------------------------------------------------------------------------
def activate() -> bool:
    """Load (or build, per RTCKERN_TORCH_NATIVE) the library and serve the eligible ops through it; True when it
    serves. Called by `import rtckern.torch`; once per process."""
    if "lib" in _state:
        return _state["lib"] is not None
    mode = settings().torch_native
    _state.update(lib=None, ops=(), why="RTCKERN_TORCH_NATIVE=0")
    if mode == "off":
        return False
    if torch.version.cuda is None and mode == "auto":
        _state["why"] = "a torch build without CUDA"
        return False
    try:
        lib = _library(build_now=mode == "on")
        if lib is None:
            _state["why"] = "not built: " + _build_in_background()
            return False
        from rtckern.runtime.libcuda import LIBCUDA

        if lib.rtk_init(LIBCUDA.encode()) != 0:
            raise LaunchError(f"{LIBCUDA} cannot be opened or lacks cuLaunchKernel / cuCtxGetCurrent")
        serve(lib, "CUDA")
    except (OSError, LaunchError, subprocess.SubprocessError, RuntimeError) as e:
        _state["why"] = f"{type(e).__name__}: {e}"
        if mode == "on":
            raise LaunchError(f"RTCKERN_TORCH_NATIVE=1 but the native front of torch.ops.rtckern is unavailable: "
                              f"{_state['why']}") from e
        log.info("rtckern.torch: torch.ops.rtckern calls go through Python (%s)", _state["why"])
        return _state["lib"] is not None  # (a registration that failed part way keeps the ops it served)
    return True


def serve(lib, backend: str) -> None:
    """Register lib's kernels for every eligible op at Autograd<backend> and <backend> (CUDA; CPU in the CPU tests),
    with its recorder twin and its python twin (the op's Python implementation, for the backend kernel's misses:
    calls under torch.inference_mode() reach the backend key without the autograd keys)."""
    served = []
    _state.update(lib=lib, ops=(), why=None)  # (the recorders read it: set before the first op is served)
    on_clear(clear)
    reference_hooks.append(lambda on: lib.rtk_bypass(int(on)))  # reference_mode: torch's implementations, no replay
    kernel_ops = [(n, op.fn, op.fn) for n, op in KERNEL_OPS.items()]
    composites = [(n, direct, COMPOSITE_FN[n]) for n, direct in COMPOSITE_DIRECT.items()]
    for name, direct, python in kernel_ops + composites:
        op = getattr(getattr(torch.ops, "rtckern"), name).default
        schema = str(op._schema)
        args = schema[schema.index("("):]
        recorder, twin = RECORDER_PREFIX + name, PYTHON_PREFIX + name
        LIB.define(recorder + args)
        LIB.impl(recorder, _recorder(name, direct, op), "CompositeImplicitAutograd")
        LIB.define(twin + args)
        LIB.impl(twin, python, "CompositeImplicitAutograd")
        if lib.rtk_register(*(s.encode() for s in (QUALIFIED + name, QUALIFIED + recorder, QUALIFIED + twin,
                                                    "Autograd" + backend, backend))) != 0:
            raise LaunchError(f"registering the native front of rtckern::{name} failed")
        served.append(name)
        _state["ops"] = tuple(served)
        NATIVE_OPS.add(name)  # rtckern.torch's eager entry points send calls needing no gradient through torch.ops
        if name in KERNEL_OPS:
            KERNEL_OPS[name].native = True  # KernelOp calls without a gradient (the backward formulas') go through it
    for name, (formula, backward, recompute) in GRAD_FORMULAS.items():
        if name not in served or backward not in KERNEL_OPS or recompute not in KERNEL_OPS:
            continue  # (a family whose ops are not registered)
        err = lib.rtk_register_grad((QUALIFIED + name).encode(), formula.encode(), (QUALIFIED + backward).encode(),
                                    (QUALIFIED + recompute).encode())
        if err == 0:
            if name in KERNEL_OPS:
                KERNEL_OPS[name].native_grad = True  # its calls needing a gradient go through the front too
            NATIVE_GRAD_OPS.add(name)  # and rtckern.torch's entry points send such calls to torch.ops
        else:  # a formula that does not fit its ops' schemas (-3): their gradients stay with the Python Function
            log.warning("rtckern.torch: no C++ autograd node for rtckern::%s (rtk_register_grad: %d)", name, err)
    # the op layer's own functions (rtckern.ops.softmax, ...) with torch tensors: one C call to the same recipes
    direct = direct_function(lib)
    for slot, function in enumerate(DIRECT_SLOTS if direct is not None else ()):
        name = direct_op(function)
        if name in served:
            err = lib.rtk_direct_bind(slot, (QUALIFIED + name).encode())
            if err != 0:
                raise LaunchError(f"binding rtckern.ops.{function} to the native front of rtckern::{name} failed "
                                  f"(rtk_direct_bind: {err})")
    if direct is not None:
        _torch_dispatch.direct_dispatching = lambda: lib.rtk_direct_dispatching() != 0
    direct_front.call = direct


@contextlib.contextmanager
def python_autograd():
    """Inside, this thread's calls needing a gradient take the Python autograd.Function rather than the C++ autograd
    nodes (KernelOp calls and torch.ops.rtckern calls alike; the replays stay): to compare the two."""
    lib = _state.get("lib")
    old = lib.rtk_grad_bypass(1) if lib is not None else 0
    try:
        yield
    finally:
        if lib is not None:
            lib.rtk_grad_bypass(old)


def clear() -> None:
    """Drop every recipe; what kept their functions loaded goes at the clear after this one."""
    global _held, _retired
    lib = _state.get("lib")
    if lib is not None:
        lib.rtk_clear()
    _retired, _held = _held, []


def status() -> dict:
    """Whether the native front serves, why not, and per op the recipes and refused signatures it holds (with the
    last refusal's reason)."""
    lib = _state.get("lib")
    out = {"active": lib is not None, "why_not": _state.get("why"), "ops": {}}
    if lib is not None:
        for name in _state["ops"]:
            q = (QUALIFIED + name).encode()
            out["ops"][name] = {"recipes": lib.rtk_count(q, 0), "refused": lib.rtk_count(q, 1),
                                "last_refusal": _refusals.get(name)}
    return out


# ---- recording --------------------------------------------------------------------------------------------------
def _recorder(name: str, direct, op):
    """The twin's implementation: run the op's eager path while watching it, and offer its launches."""
    defaults = tuple(a.default_value for a in op._schema.arguments)

    def record(*args):
        args += defaults[len(args):]  # the dispatcher leaves trailing defaults out of a Python kernel's arguments
        lib = _state["lib"]
        if lib.rtk_size() >= MAX_RECIPES:
            clear()
        if not _record_lock.acquire(blocking=False):  # another thread is recording: run, leave the key unlearned
            lib.rtk_offer(None, 0)
            return direct(*args)
        try:
            out, steps, allocated, why = _watch(direct, args)
        finally:
            _record_lock.release()
        outs = out if isinstance(out, tuple) else (out,)
        blob = None
        if why is None:
            blob, why = _describe(args, outs, steps, allocated)
        if blob is not None and lib.rtk_offer(blob, len(blob)) == 0:
            # (the table drops the recipe if a clear came meanwhile)
            _held.extend(p for p, _ in steps if not isinstance(p, str))
        else:
            why = why or ("the library refused the description (a tensor map without cuTensorMapReplaceAddress, or "
                          "more than 64 steps or workspaces or 48 parameters)")
            _refusals[name] = why
            log.debug("rtckern.torch: rtckern::%s with this signature stays on the Python kernels: %s", name, why)
        return out

    record.__name__ = f"{RECORDER_PREFIX}{name}"
    return record


_ALLOCATIONS = None  # aten overloads: allocations, allocations that zero, in-place zeroing (set at the first recording)


def _aten_sets():
    global _ALLOCATIONS
    if _ALLOCATIONS is None:
        a = torch.ops.aten
        _ALLOCATIONS = ({a.empty.memory_format, a.empty_like.default, a.empty_strided.default, a.new_empty.default,
                         a.new_empty_strided.default},
                        {a.zeros.default, a.zeros_like.default, a.new_zeros.default},
                        {a.zero_.default, a.fill_.Scalar})
    return _ALLOCATIONS


def _watch(direct, args):
    """(output, steps, allocations, None), or a reason in place of None when the call did more than allocate, zero
    what it allocated and make prepared launches. steps: in order, (prepared, args) for a launch (the native
    launcher's record) and ("Z", storage start) for a zeroing; allocations: {storage start: end}."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from rtckern.runtime import native

    allocs, zeroing_allocs, zero_fills = _aten_sets()
    mod = native.module()
    if mod is None:
        return direct(*args), [], {}, "the native launcher is unavailable: " + str(native.why())
    steps: list = []

    class Watch(TorchDispatchMode):
        other = None
        allocated: dict = {}

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            r = func(*a, **(kw or {}))
            if func in allocs or func in zeroing_allocs:
                st = r.untyped_storage()
                lo, hi = st.data_ptr(), st.data_ptr() + st.nbytes()
                if hi > lo and any(lo < e and s < hi for s, e in self.allocated.items()) and self.other is None:
                    self.other = "an allocation reusing memory the call allocated and freed before"
                if hi > lo:
                    self.allocated[lo] = hi
                if func in zeroing_allocs:
                    steps.append(("Z", lo))
            elif (func in zero_fills and (func is not zero_fills_fill or _is_zero(a[1]))
                  and _whole_allocation(a[0], self)):
                steps.append(("Z", a[0].untyped_storage().data_ptr()))
            elif not func.is_view and self.other is None:
                self.other = str(func)
            return r

    zero_fills_fill = torch.ops.aten.fill_.Scalar
    watch = Watch()
    watch.allocated = {}
    rec = native.recording
    rec.active, rec.tainted = True, False
    mod.record(steps)
    try:
        with watch:
            out = direct(*args)
    finally:
        mod.record(None)
        rec.active = False
    if watch.other is not None:
        return out, steps, watch.allocated, f"the call ran {watch.other}"
    if rec.tainted:
        return out, steps, watch.allocated, "a launch went through cuda.core or a packed parameter block (not recorded)"
    storages = set()
    for t in out if isinstance(out, tuple) else (out,):
        if not isinstance(t, torch.Tensor):
            return out, steps, watch.allocated, "an output is not a tensor"
        if not t.numel():
            continue
        base = t.untyped_storage().data_ptr()
        if base not in watch.allocated or not _covers_storage(t) or base in storages:
            return out, steps, watch.allocated, "an output is not a whole new allocation of its own"
        storages.add(base)
    return out, steps, watch.allocated, None


def _is_zero(v) -> bool:
    """v fills with all-zero bytes (not -0.0)."""
    return v == 0 and not (isinstance(v, float) and math.copysign(1.0, v) < 0)


def _whole_allocation(t, watch) -> bool:
    """t is all of a storage the watched call allocated (zeroing it is a step of the recipe)."""
    return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in watch.allocated and _covers_storage(t)


def _covers_storage(t: torch.Tensor) -> bool:
    """t starts its storage and spans all of it (so empty_strided of its sizes and strides gives the same extent),
    and no two of its elements share memory (a stride-0 view could not be zeroed through itself)."""
    if any(st == 0 and s > 1 for s, st in zip(t.shape, t.stride())):
        return False
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 0
    return t.storage_offset() == 0 and extent * t.element_size() == t.untyped_storage().nbytes()


def _device_address(v: int) -> bool:
    """Whether the driver knows v as a device address (an int64 argument that is one, of memory the call did not
    allocate, cannot be replayed as a constant). Asked only of values past 4 GiB: sizes and strides stay below."""
    if v < 1 << 32 or v >= 1 << 63:
        return False
    try:
        cuda = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return False
    kind = ctypes.c_uint(0)
    # CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2: succeeds only for an address the driver allocated or registered
    return cuda.cuPointerGetAttribute(ctypes.byref(kind), 2, ctypes.c_uint64(v)) == 0


_PACK = {"q": "<q", "i": "<i", "I": "<I", "f": "<f", "d": "<d"}


def _describe(args, outs, steps, allocated):
    """The call's steps serialized for rtk_offer (its comment in _torch_native.cpp has the layout), or (None, why).

    A 64-bit argument ('P', or 'q', which Kernel.launch gives Python ints, addresses included) equal to an input's
    address, or inside an output or a workspace the call allocated, becomes that address per call (an offset from
    the new buffer); one elsewhere inside an input's storage refuses the call, and so does a 'P' value no buffer
    holds. Other 'q' values are constants (sizes, strides, counts)."""
    if not any(not isinstance(s[0], str) for s in steps):
        return None, "the call made no prepared launch (a torch fallback or an unprepared path)"
    inputs = [(i, a.data_ptr()) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.numel()]
    input_spans = [(a.untyped_storage().data_ptr(), a.untyped_storage().data_ptr() + a.untyped_storage().nbytes())
                   for a in args if isinstance(a, torch.Tensor) and a.numel()]
    out_base = {t.untyped_storage().data_ptr(): j for j, t in enumerate(outs) if t.numel()}
    temps = [(lo, hi) for lo, hi in allocated.items() if lo not in out_base]
    buffers = [(2, j, lo, allocated[lo]) for lo, j in out_base.items()] + \
              [(3, t, lo, hi) for t, (lo, hi) in enumerate(temps)]

    def source(v: int):
        """(source, index, offset) of address v, or None. Inputs at one address are interchangeable, and an input's
        address inside another input's storage stands for itself: which arguments share a storage, and at what
        distance, is part of the call's key. An end address is no buffer's (the next allocation may start there)."""
        for i, p in inputs:
            if p == v:
                return 1, i, 0
        for src, idx, lo, hi in buffers:
            if lo <= v < hi:
                return src, idx, v - lo
        return None

    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    blob = [struct.pack("<I", len(temps)), *(struct.pack("<q", hi - lo) for lo, hi in temps),
            struct.pack("<I", len(steps))]
    for prepared, call in steps:
        if isinstance(prepared, str):  # ("Z", storage start)
            src = source(call)
            if src is None or src[0] == 1:
                return None, "the call zeroed a buffer it did not allocate"
            blob.append(struct.pack("<cBh", b"Z", src[0], src[1]))
            continue
        func, ctx, grid, block, smem, dependent, kinds, label = prepared.describe()
        if int(call[0]) != stream:
            return None, "a launch went to a stream other than torch's current one"
        label_b = label.encode()
        blob.append(b"L" + struct.pack("<QQ3I3IIiI", func, ctx, *grid, *block, smem, dependent, len(label_b)) + label_b)
        blob.append(struct.pack("<I", len(kinds)))
        for kind, v in zip(kinds, call[1:]):
            if kind == "M":  # a tensor map: which buffer's address it holds (replaced per call in C++)
                raw = bytes(v)
                words = {int.from_bytes(raw[o:o + 8], "little") for o in range(0, 128, 8)}
                src = next((s for s in ([(1, i, p) for i, p in inputs] + [(b[0], b[1], b[2]) for b in buffers
                                                                          if b[3] > b[2]])
                            if s[2] and s[2] in words), None)
                if src is None:
                    return None, f"{label} takes a tensor map of an address that is no input's, output's or workspace's"
                blob.append(struct.pack("<BBh", ord("M"), src[0], src[1]) + raw)
            elif kind in "Pq":
                v = int(v)
                src = None if v == 0 else source(v)
                if src is None and v and any(lo <= v <= hi for lo, hi in input_spans):
                    return None, f"{label} takes an address inside an input that is not the input's own"
                if src is None and v and (kind == "P" or _device_address(v)):
                    return None, f"{label} takes an address no buffer of the call holds (a workspace kept elsewhere)"
                if src is None:  # a 'q' constant, or a null address
                    blob.append(struct.pack("<BBh", ord(kind), 0, 0) + struct.pack("<q" if kind == "q" else "<Q", v))
                else:
                    blob.append(struct.pack("<BBhQ", ord(kind), *src))
            else:
                raw = struct.pack(_PACK[kind], float(v) if kind in "fd" else int(v)).ljust(8, b"\0")
                blob.append(struct.pack("<BBh", ord(kind), 0, 0) + raw)
    return b"".join(blob), None


def _main() -> int:
    """`python -m rtckern.plugins._torch_native`: build the library (the background build), once at a time."""
    import fcntl

    from rtckern.runtime.native import built_artifact

    try:
        lock_dir = settings().cache_dir / SUBDIR
        lock_dir.mkdir(parents=True, exist_ok=True)
        lock = open(lock_dir / ".build.lock", "a")
    except OSError:  # an unwritable cache dir: built_artifact builds under the temp dir; no lock then
        lock = None
    try:
        if lock is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return 0  # another process is building it
        try:
            built_artifact(SUBDIR, artifact_name(), build)
        except LaunchError as e:  # the compiler refused or tools are missing: the next imports do not try again
            try:
                _failure_stamp().write_text(f"{e}\n")
            except OSError:
                pass
            return 1
        except (OSError, subprocess.SubprocessError):  # a timeout, a killed compiler: tried again next time
            return 1
    finally:
        if lock is not None:
            lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
