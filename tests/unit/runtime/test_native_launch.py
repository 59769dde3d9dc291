"""The native launcher (rtckern/runtime/native_launch.c), built with the real C compiler and driven against a fake
libcuda that records what cuLaunchKernel receives: parameter packing per kind, argument errors, driver errors, and
the context switch. Each case runs in a subprocess, because the launcher binds the driver's entry points once per
process."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rtckern import config
from rtckern.errors import LaunchError
from rtckern.runtime import native

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

FAKE_CUDA = r"""
#include <string.h>
#include <stdint.h>
unsigned char params_seen[16][128];
uintptr_t param_addr[16];
unsigned dims[7];
void* func_seen; void* stream_seen;
int nlaunch, npush, npop, fail_with, nexpect;  /* nexpect: how many params to record (the call does not say) */
void* current_ctx;
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned smem, void* stream, void** params, void** extra) {
  if (fail_with) return fail_with;
  func_seen = f; stream_seen = stream;
  unsigned d[7] = {gx, gy, gz, bx, by, bz, smem};
  memcpy(dims, d, sizeof d);
  for (int i = 0; i < nexpect && i < 16; ++i) { memcpy(params_seen[i], params[i], 128); param_addr[i] = (uintptr_t)params[i]; }
  ++nlaunch;
  return 0;
}
/* cuLaunchKernelEx: the config's dims and stream, the first attribute's id and value, then cuLaunchKernel's record */
int attr_seen[2], nattrs_seen, nlaunch_ex;
typedef struct { int id; char pad[4]; union { char bytes[64]; int allowed; void* align; } value; } attr_t;
typedef struct { unsigned d[7]; void* stream; attr_t* attrs; unsigned nattrs; } config_t;
int cuLaunchKernelEx(const config_t* c, void* f, void** params, void** extra) {
  nattrs_seen = (int)c->nattrs;
  if (c->nattrs) { attr_seen[0] = c->attrs[0].id; attr_seen[1] = c->attrs[0].value.allowed; }
  ++nlaunch_ex;
  return cuLaunchKernel(f, c->d[0], c->d[1], c->d[2], c->d[3], c->d[4], c->d[5], c->d[6], c->stream, params, extra);
}
int cuCtxGetCurrent(void** c) { *c = current_ctx; return 0; }
int cuCtxPushCurrent_v2(void* c) { ++npush; current_ctx = c; return 0; }
int cuCtxPopCurrent_v2(void** c) { ++npop; *c = current_ctx; current_ctx = 0; return 0; }
int cuGetErrorName(int e, const char** s) { if (e != 701) return 1; *s = "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"; return 0; }
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("native")
    so = d / native._artifact_name(native.SOURCE.read_bytes())
    native._build(so)
    (d / "fake.c").write_text(FAKE_CUDA)
    fake = d / "libfakecuda.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(fake), str(d / "fake.c")], check=True)
    return so, fake


def run(built, body: str) -> str:
    so, fake = built
    prog = textwrap.dedent(f"""
        import ctypes, struct, sys
        import numpy as np
        from rtckern.errors import LaunchError
        from rtckern.runtime.native import _load
        mod = _load({str(so)!r})
        mod.init({str(fake)!r}, LaunchError)
        fake = ctypes.CDLL({str(fake)!r})
        seen = (ctypes.c_ubyte * (16 * 128)).in_dll(fake, "params_seen")
        addr = (ctypes.c_size_t * 16).in_dll(fake, "param_addr")
        dims = (ctypes.c_uint * 7).in_dll(fake, "dims")
        def param(i, fmt):
            return struct.unpack_from(fmt, bytes(seen), i * 128)[0]
        def counter(name):
            return ctypes.c_int.in_dll(fake, name).value
        def expect(n):
            ctypes.c_int.in_dll(fake, "nexpect").value = n
    """) + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_parameters_are_packed_by_kind(built):
    out = run(built, """
        ctx = 0x7000
        ctypes.c_void_p.in_dll(fake, "current_ctx").value = ctx
        p = mod.Prepared(0x1234, ctx, (3, 2, 1), (128, 1, 1), 4096, "PqiIfdM", "k")
        tmap = bytes(range(128))
        expect(7)
        p(0xabc, 2**64 - 16, np.int64(-5), -7, 2**32 - 1, np.float32(0.5), 1.25, tmap)
        assert counter("nlaunch") == 1 and counter("npush") == 0  # its context was current
        expect(7)  # numpy's unsigned scalars (the attention kernels' np.uint64 pointers) pack as Python ints do
        p(0xabc, np.uint64(2**64 - 16), np.int64(-5), np.int32(-7), np.uint32(2**32 - 1), np.float32(0.5), 1.25, tmap)
        assert counter("nlaunch") == 2
        assert list(dims) == [3, 2, 1, 128, 1, 1, 4096]
        assert ctypes.c_void_p.in_dll(fake, "func_seen").value == 0x1234
        assert ctypes.c_void_p.in_dll(fake, "stream_seen").value == 0xabc
        assert param(0, "<Q") == 2**64 - 16 and param(1, "<q") == -5 and param(2, "<i") == -7
        assert param(3, "<I") == 2**32 - 1 and param(4, "<f") == 0.5 and param(5, "<d") == 1.25
        assert bytes(seen)[6 * 128:7 * 128] == tmap and addr[6] % 64 == 0  # a tensor map is 64-byte aligned
        print("ok", repr(p))
    """)
    assert out.startswith("ok <native launch of k: grid (3, 2, 1), block (128, 1, 1), smem 4096, 7 params>")


def test_a_dependent_launch_allows_programmatic_stream_serialization(built):
    out = run(built, """
        p = mod.Prepared(0x1234, 0, (5, 1, 1), (64, 1, 1), 512, "Pq", "merge", True)
        expect(2)
        p(0xabc, 7, 9)
        assert counter("nlaunch_ex") == 1 and counter("nlaunch") == 1
        attr = (ctypes.c_int * 2).in_dll(fake, "attr_seen")
        assert counter("nattrs_seen") == 1 and list(attr) == [6, 1]  # PROGRAMMATIC_STREAM_SERIALIZATION, allowed
        assert list(dims) == [5, 1, 1, 64, 1, 1, 512] and ctypes.c_void_p.in_dll(fake, "stream_seen").value == 0xabc
        assert param(0, "<Q") == 7 and param(1, "<q") == 9
        mod.Prepared(0x1234, 0, (5, 1, 1), (64, 1, 1), 512, "Pq", "merge")(0xabc, 7, 9)
        assert counter("nlaunch_ex") == 1 and counter("nlaunch") == 2  # not dependent: cuLaunchKernel
        print(repr(p))
    """)
    assert out.strip().endswith("2 params, dependent>")


def test_another_context_is_pushed_and_popped(built):
    run(built, """
        ctypes.c_void_p.in_dll(fake, "current_ctx").value = 0x1
        p = mod.Prepared(1, 0x2, (1, 1, 1), (32, 1, 1), 0, "P", "k")
        p(0, 5)
        assert (counter("npush"), counter("npop"), counter("nlaunch")) == (1, 1, 1)
    """)


def test_bad_arguments_name_the_argument(built):
    out = run(built, """
        p = mod.Prepared(1, 0, (1, 1, 1), (32, 1, 1), 0, "Pf", "mykernel")
        for args in [(0, 1), (0, 1, 2.0, 3), (0, "x", 1.0), (0, -1, 1.0), (0, 1, "y"), (0, 1.5, 1.0)]:
            try:
                p(*args)
            except (TypeError, OverflowError) as e:
                print(type(e).__name__, e)
        try:
            p(0, 1, 1.0, kw=2)
        except TypeError as e:
            print(e)
        try:
            mod.Prepared(1, 0, (1, 1, 1), (32, 1, 1), 0, "Px", "k")
        except ValueError as e:
            print(e)
        m = mod.Prepared(1, 0, (1, 1, 1), (32, 1, 1), 0, "M", "k")
        try:
            m(0, b"short")
        except ValueError as e:
            print(e)
        try:
            mod.Prepared(1, 0, (1, 1, 1), (32, 1, 1), 0, "P", "k", dependent=True)
        except TypeError as e:
            print(e)
        assert counter("nlaunch") == 0
    """)
    lines = out.splitlines()
    assert lines[0] == "TypeError launch of mykernel takes a stream and 2 kernel arguments; got 2 arguments"
    assert lines[1] == "TypeError launch of mykernel takes a stream and 2 kernel arguments; got 4 arguments"
    # the conversion's own reason follows, and an out-of-range value stays an OverflowError
    assert lines[2].startswith("TypeError argument 0 of mykernel (kind 'P'): cannot convert 'x' (")
    assert lines[3].startswith("OverflowError argument 0 of mykernel (kind 'P'): cannot convert -1 (")
    assert lines[4].startswith("TypeError argument 1 of mykernel (kind 'f'): cannot convert 'y' (")
    assert lines[5].startswith("TypeError argument 0 of mykernel (kind 'P'): cannot convert 1.5 (")
    assert lines[6] == "a prepared launch takes positional arguments only"
    assert lines[7] == "parameter kind 'x'; supported: P q i I f d M"
    assert lines[8] == "argument 0 of k: a tensor map is 128 bytes; got 5"
    assert lines[9].startswith("Prepared(func, ctx, grid, block, smem, kinds, label[, dependent[, owner]]) takes "
                               "positional arguments only")


def test_32_bit_kinds_refuse_values_outside_their_range(built):
    """'i' and 'I' refuse what does not fit (never a truncated value reaching the kernel) and pack their limits."""
    out = run(built, """
        p = mod.Prepared(1, 0, (1, 1, 1), (32, 1, 1), 0, "iI", "k")
        for args in [(2**31, 0), (-2**31 - 1, 0), (-2**40 - 3, 0), (0, 2**32), (0, 2**40), (0, -1)]:
            try:
                p(0, *args)
            except OverflowError as e:
                print(e)
        assert counter("nlaunch") == 0
        expect(2)
        p(0, -2**31, 2**32 - 1)
        assert counter("nlaunch") == 1 and param(0, "<i") == -2**31 and param(1, "<I") == 2**32 - 1
        p(0, 2**31 - 1, np.uint32(0))
        assert param(0, "<i") == 2**31 - 1 and param(1, "<I") == 0
    """)
    lines = out.splitlines()
    assert len(lines) == 6 and all(" (kind 'i'): cannot convert " in x for x in lines[:3]), out
    assert all(" (kind 'I'): cannot convert " in x for x in lines[3:]), out
    assert "2147483648 is outside int32" in lines[0] and "4294967296 is outside uint32" in lines[3]


def test_a_prepared_launch_keeps_its_owner_alive(built):
    """The owner (the kernel's Library, whose collection unloads the module) lives as long as the prepared launch."""
    run(built, """
        import gc, weakref
        class Library:
            pass
        lib = Library()
        alive = weakref.ref(lib)
        p = mod.Prepared(1, 0, (1, 1, 1), (32, 1, 1), 0, "P", "k", False, lib)
        del lib
        gc.collect()
        assert alive() is not None
        p(0, 1)
        del p
        gc.collect()
        assert alive() is None
    """)


def test_driver_error_is_a_launch_error(built):
    out = run(built, """
        p = mod.Prepared(1, 0, (4, 1, 1), (64, 1, 1), 0, "P", "k")
        for code in (701, 999):
            ctypes.c_int.in_dll(fake, "fail_with").value = code
            try:
                p(0, 1)
            except LaunchError as e:
                print(e)
    """)
    assert out.splitlines() == [
        "launch of k failed: cuLaunchKernel returned CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (701) (grid (4, 1, 1), "
        "block (64, 1, 1), shared memory 0)",
        "launch of k failed: cuLaunchKernel returned unknown CUresult (999) (grid (4, 1, 1), block (64, 1, 1), "
        "shared memory 0)"]


def test_unavailable_launcher_falls_back_or_raises(tmp_path):
    missing = str(tmp_path / "no-such-cc")
    with config.override(native_launch="auto", c_compiler=(missing,), cache_dir=tmp_path / "c"):
        if native._state.get("loaded") is None:  # a launcher loaded earlier in this process stays in use
            assert native.module() is None
            assert "LaunchError" in native.why() or "OSError" in native.why()
    with config.override(native_launch="off"):
        assert native.module() is None and native.why() == "RTCKERN_NATIVE_LAUNCH=0"


def test_artifact_name_follows_the_source():
    a = native._artifact_name(b"int x;")
    assert a != native._artifact_name(b"int y;") and a.startswith("rtckern_native_launch-")
    assert Path(a).suffix == ".so"


def test_build_failure_says_what_failed(tmp_path, monkeypatch):
    with config.override(c_compiler=("false",)):
        with pytest.raises(LaunchError, match="failed"):
            native._build(tmp_path / "x.so")


def test_only_a_private_build_is_loaded(tmp_path):
    """The launcher runs as host code: a build is loaded only when it is a regular file (not a link) of this user or
    root that no one else can write; elsewhere (a team's shared cache directory) rtckern builds its own."""
    import os

    own = tmp_path / "own.so"
    own.write_bytes(b"x")
    own.chmod(0o755)
    assert native._trusted(own)
    for mode in (0o775, 0o757):  # group- or world-writable
        own.chmod(mode)
        assert not native._trusted(own)
    own.chmod(0o755)
    link = tmp_path / "link.so"
    link.symlink_to(own)
    assert not native._trusted(link) and not native._trusted(tmp_path / "missing.so")
    if os.getuid() == 0:  # root: a file of another user is not trusted either
        os.chown(own, 12345, 12345)
        assert not native._trusted(own)


def test_a_float32_argument_out_of_range_is_refused(built):
    """'f' refuses a finite double float32 cannot hold (the C conversion would be undefined); inf and nan pass."""
    out = run(built, """
        p = mod.Prepared(1, 0, (1, 1, 1), (32, 1, 1), 0, "f", "k")
        try:
            p(0, 1e39)
        except OverflowError as e:
            print(e)
        assert counter("nlaunch") == 0
        expect(1)
        p(0, float("inf"))
        assert counter("nlaunch") == 1 and param(0, "<f") == float("inf")
        p(0, 3.0e38)
        assert counter("nlaunch") == 2
    """)
    assert "cannot convert 1e+39" in out and "outside float32" in out, out


def test_a_required_launcher_that_cannot_be_built_is_tried_once(tmp_path, monkeypatch):
    """RTCKERN_NATIVE_LAUNCH=1 without a working build: every launch raises, the build is tried once per settings
    (it could take the compiler's whole timeout each time)."""
    if native._state.get("loaded") is not None:
        pytest.skip("a launcher loaded earlier in this process stays in use")
    tries = []

    def fail():
        tries.append(1)
        raise LaunchError("no C compiler found")

    monkeypatch.setattr(native, "_open", fail)
    with config.override(native_launch="on", cache_dir=tmp_path / "c"):
        for _ in range(3):
            with pytest.raises(LaunchError, match="RTCKERN_NATIVE_LAUNCH=1 but the native launcher is unavailable: "
                                                  "LaunchError: no C compiler found"):
                native.module()
    assert len(tries) == 1
