"""hiprtc: real compiles for AMD targets (no AMD GPU needed), the code objects they give, their cache keys, and the
disk cache round trip of every op family's portable (HIP) kernels.

Needs a hiprtc library (Debian: libamdhip64-5 + libhiprtc-builtins5, installed by .ci/run). Without one these tests
skip, except under CI (CI=true), where a missing hiprtc is a failure: there they must really run.
"""

from __future__ import annotations

import os

import pytest

from rtckern.arch import Arch
from rtckern.compiler.hsaco import CodeObjectError, read_code_object
from rtckern.errors import ArchError, CompileError
from rtckern.manager import KernelManager
from rtckern.spec import KernelSpec

GFX90A = Arch.parse("gfx90a")


@pytest.fixture(scope="module")
def hiprtc():
    from rtckern.compiler.hiprtc import HiprtcCompiler, HiprtcUnavailable

    try:
        return HiprtcCompiler()
    except HiprtcUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must have hiprtc (.ci/run installs it): {e}")
        pytest.skip(f"no hiprtc here: {e}")


def _check_code_object(binary: bytes, lowered: str, gfx: str, wave: int):
    info = read_code_object(binary)
    assert info.gfx == gfx
    k = info.kernel(lowered)
    assert k.wavefront_size == wave
    assert k.symbol == lowered + ".kd"
    return k


# ---- the compiler -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float", "rtk_half", "rtk_bf16"])
def test_real_compile_for_gfx90a(hiprtc, dtype):
    ck = hiprtc.compile(KernelSpec("core/axpy.cuh", "axpy", GFX90A, template_args=(dtype,)))
    assert ck.kind == "hsaco" and ck.binary[:4] == b"\x7fELF"
    assert ck.lowered_name.startswith("_Z4axpyI")
    _check_code_object(ck.binary, ck.lowered_name, "gfx90a", 64)


def test_typedef_template_arguments_resolve(hiprtc):
    # hiprtc 5.2 matches name expressions textually; rtk_half is a typedef of __half, so both must give one kernel.
    a = hiprtc.compile(KernelSpec("core/axpy.cuh", "axpy", GFX90A, template_args=("rtk_half",)))
    b = hiprtc.compile(KernelSpec("core/axpy.cuh", "axpy", GFX90A, template_args=("__half",)))
    assert a.lowered_name == b.lowered_name == "_Z4axpyI6__halfEvPKT_PS1_fx"


def test_block_reduction_uses_the_wavefront(hiprtc):
    """coop_sum reduces with rtk_block_sum: 64-wide on CDNA, 32-wide on RDNA (never a hard-coded 32)."""
    ck = hiprtc.compile(KernelSpec("core/axpy.cuh", "coop_sum", GFX90A))
    k = _check_code_object(ck.binary, ck.lowered_name, "gfx90a", 64)
    assert k.lds_bytes == 32 * 4  # the kernel's scratch[32]
    if "gfx1030" in hiprtc.supported_archs():
        rd = hiprtc.compile(KernelSpec("core/axpy.cuh", "coop_sum", Arch.parse("gfx1030")))
        _check_code_object(rd.binary, rd.lowered_name, "gfx1030", 32)


def test_wavefront_option_overrides_the_default_and_the_key(hiprtc, manager):
    if "gfx1030" not in hiprtc.supported_archs():
        pytest.skip("this hiprtc has no RDNA target")
    plain = KernelSpec("core/axpy.cuh", "coop_sum", Arch.parse("gfx1030"))
    wide = KernelSpec("core/axpy.cuh", "coop_sum", Arch.parse("gfx1030"), options=("-mwavefrontsize64",))
    ck = hiprtc.compile(wide)
    _check_code_object(ck.binary, ck.lowered_name, "gfx1030", 64)
    assert manager.key(plain) != manager.key(wide)


def test_deterministic_bytes(hiprtc):
    spec = KernelSpec("core/axpy.cuh", "smem_reverse", GFX90A)
    assert hiprtc.compile(spec).binary == hiprtc.compile(spec).binary


def test_identity_names_versions_and_the_wavefront_rule(hiprtc):
    ident = hiprtc.identity()
    major, minor = hiprtc.api_version()
    assert ident.startswith(f"hiprtc-{major}.{minor}|")
    assert "|comgr-" in ident and "wave64:gfx6-gfx9;wave32:gfx10+" in ident and "-std=c++17" in ident
    assert hiprtc.library_version() == "" or hiprtc.library_version() in ident
    assert hiprtc.identity_for(GFX90A).endswith("|gfx90a|wave64")
    assert hiprtc.identity_for(Arch.parse("gfx1100")).endswith("|gfx1100|wave32")


def test_keys_separate_targets_and_vendors(hiprtc, manager):
    keys = {manager.key(KernelSpec("core/axpy.cuh", "noop0", Arch.parse(a))) for a in ("gfx90a", "gfx908", "sm_90")}
    assert len(keys) == 3
    spec = KernelSpec("core/axpy.cuh", "noop0", GFX90A)
    assert manager.key(spec) == KernelManager(manager.cache_dir).key(spec)  # stable across managers


def test_gfx942_compiles_or_is_refused_before_hiprtc(hiprtc):
    """gfx942 (MI300) needs hiprtc from ROCm 6.0+. An older hiprtc aborts the whole process on an unknown target,
    so rtckern must refuse it first, from comgr's target list, and say what to install."""
    spec = KernelSpec("core/axpy.cuh", "axpy", Arch.parse("gfx942"), template_args=("rtk_bf16",))
    if "gfx942" in hiprtc.supported_archs():
        ck = hiprtc.compile(spec)
        _check_code_object(ck.binary, ck.lowered_name, "gfx942", 64)
    else:
        with pytest.raises(ArchError, match=r"cannot target gfx942; it targets .*gfx90a.*ROCm 6\.0 or newer"):
            hiprtc.compile(spec)


def test_nvidia_target_is_refused(hiprtc):
    with pytest.raises(ArchError, match="NVIDIA targets go to NVRTC"):
        hiprtc.compile(KernelSpec("core/axpy.cuh", "noop0", Arch.parse("sm_90")))


def test_compile_error_content(hiprtc):
    code = '#include "common/dtypes.cuh"\n\ntemplate <typename T>\n__global__ void broken(T* x) {\n  x[0] = undefined_name;\n}\n'
    spec = KernelSpec("broken.cu", "broken", GFX90A, template_args=("float",), code=code)
    with pytest.raises(CompileError) as ei:
        hiprtc.compile(spec)
    msg = str(ei.value)
    assert msg.startswith("hiprtc (HIP ") and "'broken<float>' for gfx90a" in msg
    assert "use of undeclared identifier 'undefined_name'" in msg
    assert "broken.cu:5:" in msg and "/tmp/comgr-" not in msg  # hiprtc's temp path replaced by the source name
    assert "> 5 |   x[0] = undefined_name;" in msg
    assert "--offload-arch=gfx90a" in msg and "-DRTK_WAVEFRONT_SIZE=64" in msg


def test_nvrtc_options_translated_or_refused(hiprtc):
    from rtckern.compiler.hiprtc import UnsupportedOptionError, translate_options

    assert translate_options(["--use_fast_math", "-DX=1"]) == ["-ffast-math", "-DX=1"]
    ck = hiprtc.compile(KernelSpec("core/axpy.cuh", "axpy", GFX90A, template_args=("float",),
                                   options=("--use_fast_math",)))
    assert ck.kind == "hsaco"
    with pytest.raises(UnsupportedOptionError, match="'-Xptxas=-v' is NVRTC-only"):
        hiprtc.compile(KernelSpec("core/axpy.cuh", "noop0", GFX90A, options=("-Xptxas=-v",)))


def test_code_object_reader_rejects_other_binaries(hiprtc):
    from rtckern.compiler.nvrtc import NvrtcCompiler

    cubin = NvrtcCompiler().compile(KernelSpec("core/axpy.cuh", "noop0", Arch.parse("sm_80"))).binary
    with pytest.raises(CodeObjectError, match="not AMDGPU"):
        read_code_object(cubin)
    with pytest.raises(CodeObjectError, match="not a 64-bit"):
        read_code_object(b"hello")


# ---- the cache ----------------------------------------------------------------------------------------------------
def test_disk_round_trip(hiprtc, manager):
    spec = KernelSpec("core/axpy.cuh", "axpy", GFX90A, template_args=("rtk_bf16",))
    ck = manager.compile(spec)
    again, tier = KernelManager(manager.cache_dir).lookup(spec)
    assert tier == "disk" and again.binary == ck.binary
    assert again.kind == "hsaco" and again.lowered_name == ck.lowered_name
    meta = next(e.meta for e in manager.disk.entries())
    assert meta["arch"] == "gfx90a" and meta["kind"] == "hsaco" and meta["compiler"] == hiprtc.identity()


# ---- every op family's portable kernels ---------------------------------------------------------------------------
def _norm_specs():
    import rtckern.ops  # noqa: F401  (registers the families)
    from rtckern.device import DeviceInfo
    from rtckern.registry import OpRequest, candidates

    dev = DeviceInfo.for_arch("gfx90a")
    fwd_flags = (("bias", True), ("residual", True), ("save_stats", True), ("weight", True),
                 ("zero_centered", False))
    bwd_flags = (("bias_grad", True), ("dresidual", False), ("weight", True), ("weight_grad", True),
                 ("zero_centered", False))
    specs = []
    cands = {c.name: c for op in ("layer_norm", "layer_norm_backward") for c in candidates(op)}
    for op, dtypes, flags in (("layer_norm", (("w", "bf16"), ("x", "bf16"), ("y", "bf16")), fwd_flags),
                              ("layer_norm_backward", (("dx", "bf16"), ("dy", "bf16"), ("w", "bf16"), ("x", "bf16")),
                               bwd_flags)):
        for n in (4096, 16384):
            req = OpRequest(op=op, dtypes=dtypes, shape=(("n", n), ("vec", 8)), flags=flags, device=dev)
            for kind in ("rows", "coop"):
                cand = cands[f"{op}.{kind}"]
                assert cand.supports(req) is None, (cand.name, n, cand.supports(req))
                specs += cand.kernel_specs(req)
    return specs


def _softmax_specs():
    import rtckern.ops  # noqa: F401  (registers the families)
    from rtckern.device import DeviceInfo
    from rtckern.registry import build_request, candidates
    from rtckern.registry.candidate import arch_reason

    dev = DeviceInfo.for_arch("gfx90a")
    specs = []
    for op in ("softmax", "scaled_upper_triang_masked_softmax_backward"):
        req = build_request(op, shape=(4096,), dtype="bf16", device=dev, options={"vec": "8"})
        for cand in candidates(op):
            if arch_reason(cand, req) is not None:  # NVIDIA-only candidates (the sm_90 ring)
                assert "amd" not in cand.vendors, cand.name
                continue
            assert cand.supports(req) is None, (cand.name, cand.supports(req))
            specs += cand.kernel_specs(req)
    return specs


def _attention_specs():
    import rtckern.ops  # noqa: F401  (registers the families)
    from rtckern.device import DeviceInfo
    from rtckern.registry import build_request, candidates

    simt = next(c for c in candidates("attention") if c.name == "attention.simt")
    specs = []
    for causal in (False, True):
        req = build_request("attention", shape=(128,), dtype="bf16", device=DeviceInfo.for_arch("gfx90a"),
                            options={"causal": str(int(causal))})
        assert simt.supports(req) is None, simt.supports(req)
        specs += simt.kernel_specs(req)
    return specs


def _gemm_specs():
    from rtckern.ops._gemm import geometry

    p = geometry.GemmProblem(batch=2, m=512, n=512, k=512, dtype="bf16", out_dtype="bf16", trans_b=True, bias=True,
                             residual=True)
    return [geometry.simt_spec(p, GFX90A), geometry.reduce_spec(p, GFX90A)]


def _provider_specs(op: str):
    """The gfx90a kernels of an op's kernel provider (its prefill set)."""
    def specs():
        import rtckern.ops  # noqa: F401  (registers the families)
        from rtckern.registry import kernel_providers

        return [s for s in kernel_providers()[op]([GFX90A]) if s.arch == GFX90A]
    return specs


FAMILIES = {"norms": _norm_specs, "softmax": _softmax_specs, "attention": _attention_specs, "gemm": _gemm_specs,
            "rope": _provider_specs("rope"), "glu": _provider_specs("swiglu"),
            "loss": _provider_specs("cross_entropy")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_portable_kernels_compile_for_gfx90a_and_round_trip(hiprtc, manager, family):
    specs = list(dict.fromkeys(FAMILIES[family]()))  # kernels shared by several requests, once
    assert specs, f"{family}: no portable kernel specs"
    for spec in specs:
        assert spec.arch == GFX90A, spec.describe()
        ck = manager.compile(spec)
        _check_code_object(ck.binary, ck.lowered_name, "gfx90a", 64)
    assert manager.stats.compiles == len(specs)
    fresh = KernelManager(manager.cache_dir)
    for spec in specs:
        again, tier = fresh.lookup(spec)
        assert tier == "disk", spec.describe()
        assert again.binary == manager.compile(spec).binary and again.kind == "hsaco"
    assert fresh.stats.compiles == 0
