import time

import pytest

from rtckern.arch import Arch
from rtckern.compiler import NvrtcCompiler
from rtckern.errors import ArchError, CompileError
from rtckern.spec import KernelSpec


@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90", "sm_90a"])
def test_real_compile_each_arch(arch):
    spec = KernelSpec("core/axpy.cuh", "axpy", Arch.parse(arch), template_args=("rtk_bf16",))
    ck = NvrtcCompiler().compile(spec)
    assert ck.kind == "cubin"
    assert ck.binary[:4] == b"\x7fELF"  # a cubin is an ELF image
    assert "axpy" in ck.lowered_name and ck.lowered_name.startswith("_Z")


def test_ptx_target():
    ck = NvrtcCompiler().compile(KernelSpec("core/axpy.cuh", "noop0", Arch(8, 0, ptx=True)))
    assert ck.kind == "ptx" and b".target sm_80" in ck.binary


def test_deterministic_bytes():
    spec = KernelSpec("core/axpy.cuh", "coop_sum", Arch(9, 0))
    c = NvrtcCompiler()
    assert c.compile(spec).binary == c.compile(spec).binary


def test_arch_specific_instruction_needs_a_target():
    code = ('#include "common/portability.cuh"\n__global__ void k(){\n'
            '  asm volatile("wgmma.fence.sync.aligned;\\n");\n}\n')
    ok = NvrtcCompiler().compile(KernelSpec("wg.cu", "k", Arch(9, 0, "a"), code=code))
    assert ok.kind == "cubin"
    with pytest.raises(CompileError, match="sm_90"):
        NvrtcCompiler().compile(KernelSpec("wg.cu", "k", Arch(9, 0), code=code))


def test_compile_error_content():
    code = '#include "common/dtypes.cuh"\n\ntemplate <typename T>\n__global__ void broken(T* x) {\n  x[0] = undefined_name;\n}\n'
    spec = KernelSpec("broken.cu", "broken", Arch(8, 0), template_args=("float",), code=code,
                      options=("--use_fast_math",))
    with pytest.raises(CompileError) as ei:
        NvrtcCompiler().compile(spec)
    e = ei.value
    msg = str(e)
    assert "broken<float>" in msg and "sm_80" in msg
    assert "--use_fast_math" in msg and "-std=c++17" in msg
    assert 'identifier "undefined_name" is undefined' in msg
    assert "> 5 |   x[0] = undefined_name;" in msg  # numbered excerpt, error line marked
    assert msg.startswith("NVRTC 1")
    assert e.log and e.arch == "sm_80"


def test_volta_is_refused_clearly():
    with pytest.raises(ArchError, match=r"cannot target sm_70.*dropped Volta"):
        NvrtcCompiler().compile(KernelSpec("core/axpy.cuh", "noop0", Arch(7, 0)))


def test_cold_compile_is_fast():
    c = NvrtcCompiler()
    t0 = time.perf_counter()
    c.compile(KernelSpec("core/axpy.cuh", "axpy", Arch(9, 0), template_args=("rtk_half",)))
    assert time.perf_counter() - t0 < 5.0  # generous: CI machines vary; benchmarks record the real figure


@pytest.mark.parametrize("pad", [0, (1 << 16) - len("#define CUDA_VERSION 12"), 1 << 17])
def test_header_version_wherever_the_define_is(tmp_path, monkeypatch, cache_dir, pad):
    """cuda.h is searched in its first 64 KB first: a define past it, or whose digits cross it, is read whole."""
    from rtckern.compiler import nvrtc

    (tmp_path / "cuda.h").write_text(" " * pad + "#define CUDA_VERSION 12080\n#define CUDA_VERSION 1\n")
    monkeypatch.setattr(nvrtc, "cuda_include_dir", lambda: tmp_path)
    assert nvrtc.cuda_header_version.__wrapped__() == 12080


def test_header_version_is_remembered_per_file_identity(tmp_path, monkeypatch, cache_dir):
    """A process on a warm cache dir takes cuda.h's version from its memo; another cuda.h (a new identity) is read."""
    from rtckern.compiler import nvrtc

    cache_dir.mkdir()
    inc = tmp_path / "include"
    inc.mkdir()
    (inc / "cuda.h").write_text("#define CUDA_VERSION 12080\n")
    monkeypatch.setattr(nvrtc, "cuda_include_dir", lambda: inc)
    assert nvrtc.cuda_header_version.__wrapped__() == 12080
    assert len(list((cache_dir / "toolchain").glob("cuda-h-*.json"))) == 1
    real_read = nvrtc._read_cuda_version
    monkeypatch.setattr(nvrtc, "_read_cuda_version", lambda path: pytest.fail("read again despite the memo"))
    assert nvrtc.cuda_header_version.__wrapped__() == 12080
    (inc / "cuda.h").write_text("#define CUDA_VERSION 13000\n\n")  # another file: size and mtime differ
    monkeypatch.setattr(nvrtc, "_read_cuda_version", real_read)
    assert nvrtc.cuda_header_version.__wrapped__() == 13000
    reads = []
    monkeypatch.setattr(nvrtc, "_read_cuda_version", lambda path: reads.append(path) or real_read(path))
    for m in (cache_dir / "toolchain").glob("cuda-h-*.json"):
        m.write_text("{not json")
    assert nvrtc.cuda_header_version.__wrapped__() == 13000 and reads == [inc / "cuda.h"]  # a damaged memo: a miss
    assert nvrtc.cuda_header_version.__wrapped__() == 13000 and len(reads) == 1  # ... written again
