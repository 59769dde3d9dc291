"""rtckern.testing.compile_all, which the every-variant tests rely on: kernels of one source compile as one NVRTC
program, and each kernel's verdict (error, warning, spills, ptxas notes of a performance loss) is still its own, as a
lone compile gives it; kernels queued by prefetch() or checked before are not compiled again. (Verdicts are kept for
the process: each test here compiles source text of its own.)"""
from __future__ import annotations

import pytest

from rtckern.arch import Arch
from rtckern.spec import KernelSpec
from rtckern.testing import compile_all, compile_name_expressions, kernel_parameters

pytest.importorskip("cuda.bindings.nvrtc")

SOURCE = r"""
template <int N>
__global__ void fill(float* y) {
  static_assert(N != 3, "N = 3 is refused");
  y[threadIdx.x] = N;
}

template <int N>
__global__ void unused(float* y) {
  int never_read = N;  // a warning (declared but never referenced) for every N
  y[0] = 1.0f;
}

template <int N>
__global__ void __launch_bounds__(256) pressure(const float* __restrict__ x, float* __restrict__ y, int k) {
  float acc[N];  // N = 64 spills (48 bytes on sm_80 with NVRTC 13), N = 2 does not
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = x[threadIdx.x * N + i];
  for (int r = 0; r < k; ++r) {
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = acc[i] * acc[(i + r) % N] + x[i];
  }
#pragma unroll
  for (int i = 0; i < N; ++i) y[threadIdx.x * N + i] = acc[i];
}
"""


def _spec(expr: str, arch: str = "sm_80", options=(), tag: str = "") -> KernelSpec:
    return KernelSpec("test/shared.cu", expr, Arch.parse(arch), code=SOURCE + f"// {tag}\n", options=options)


def test_one_bad_kernel_among_good_ones_is_the_only_failure():
    specs = [_spec(f"fill<{n}>") for n in (1, 2, 3, 4, 5)]
    failures = compile_all(specs, jobs=1)
    assert len(failures) == 1 and failures[0].startswith("fill<3>: ") and "N = 3 is refused" in failures[0]


def test_a_warning_names_its_kernel():
    failures = compile_all([_spec("fill<7>"), _spec("unused<1>"), _spec("fill<8>")], jobs=1)
    assert len(failures) == 1 and failures[0].startswith("unused<1>: warnings: ")


def test_spills_are_checked_per_kernel():
    opts = ("--maxrregcount=32",)
    small, big = _spec("pressure<2>", options=opts), _spec("pressure<64>", options=opts)
    assert compile_all([small], jobs=1, no_spills=True) == []
    failures = compile_all([small, big, _spec("pressure<3>", options=opts)], jobs=1, no_spills=True)
    assert len(failures) == 1 and failures[0].startswith("pressure<64> (sm_80): ") and "bytes spill" in failures[0]
    assert compile_all([big], jobs=1) == []  # without the spill check it compiles


def test_a_symbol_named_per_process_is_refused():
    """A namespace-scope variable that NVRTC leaves in the binary gets a name with the compiling process's id: the
    same source would compile to other bytes in every process. An enumerator leaves nothing behind."""
    code = "namespace n { %s }\n__global__ void scale(int* p) { p[threadIdx.x] *= n::kFactor; }\n"
    var = KernelSpec("test/named.cu", "scale", Arch.parse("sm_80"), code=code % "constexpr int kFactor = 4;")
    enum = KernelSpec("test/named.cu", "scale", Arch.parse("sm_80"), code=code % "enum : int { kFactor = 4 };")
    failures = compile_all([var, enum], jobs=1)
    assert len(failures) == 1 and failures[0].startswith("scale (sm_80): the binary holds an internal-linkage device "
                                                         "symbol")


def test_programs_spread_over_processes_give_the_same_verdicts():
    specs = [_spec(f"fill<{n}>", arch) for arch in ("sm_80", "sm_90") for n in range(10, 50)]
    specs += [_spec("fill<3>", "sm_90"), _spec("unused<2>", "sm_80")]
    failures = compile_all(specs, jobs=2)
    assert [f.split(":")[0] for f in failures] == ["fill<3>", "unused<2>"]


def test_name_expressions_of_a_kernel_source():
    assert compile_name_expressions("core/axpy.cuh", ["axpy<float>", "axpy<rtk_half>"], "sm_80") == []
    failures = compile_name_expressions("core/axpy.cuh", ["axpy<float>", "axpy<no_such_type>"], "sm_80", jobs=1)
    assert len(failures) == 1 and failures[0].startswith("axpy<no_such_type>: ")


def test_good_kernels_of_one_source_compile_as_one_program(monkeypatch):
    """The fast path holds: no lone compile when every kernel passes (the spill report is read per kernel)."""
    import rtckern.testing as testing

    def lone(spec, no_spills=False):
        raise AssertionError(f"{spec.name_expression} was compiled alone")

    monkeypatch.setattr(testing, "_compile_spec", lone)
    specs = [_spec(f"pressure<{n}>", "sm_90", tag="one") for n in (2, 4, 5, 6)]
    specs += [_spec(f"fill<{n}>", "sm_90", tag="one") for n in (1, 2)]
    assert compile_all(specs, jobs=1, no_spills=True) == []


def test_a_kernel_that_spills_among_good_ones_is_named_from_the_program(monkeypatch):
    """The spill report is read per kernel from the shared program, worded as a lone compile words it (no lone
    compile of the chunk: a known spill costs no recompiles)."""
    import rtckern.testing as testing

    opts = ("--maxrregcount=32",)
    big = _spec("pressure<64>", options=opts, tag="from the program")
    alone = testing._compile_spec(big, no_spills=True)
    assert alone and "bytes spill" in alone

    def lone(spec, no_spills=False):
        raise AssertionError(f"{spec.name_expression} was compiled alone")

    monkeypatch.setattr(testing, "_compile_spec", lone)
    specs = [_spec(e, options=opts, tag="from the program") for e in ("pressure<2>", "fill<5>")]
    specs.insert(1, big)
    assert compile_all(specs, jobs=1, no_spills=True) == [alone]


def test_a_kernel_is_checked_once(monkeypatch):
    import rtckern.testing as testing

    specs = [_spec(f"fill<{n}>", tag="once") for n in (1, 2, 3)]
    assert [f.split(":")[0] for f in compile_all(specs)] == ["fill<3>"]

    def again(chunk, no_spills):
        raise AssertionError("compiled again")

    monkeypatch.setattr(testing, "_check_chunk", again)
    assert [f.split(":")[0] for f in compile_all(specs[::-1])] == ["fill<3>"]
    with pytest.raises(AssertionError, match="compiled again"):  # another check is another verdict
        compile_all(specs[:1], jobs=1, no_spills=True)


def test_prefetched_kernels_are_taken_from_the_pool():
    from rtckern.testing import prefetch

    specs = [_spec(f"fill<{n}>", arch, tag="prefetch") for arch in ("sm_80", "sm_90") for n in range(60, 100)]
    specs.append(_spec("fill<3>", "sm_90", tag="prefetch"))
    prefetch(specs)  # returns at once; the pool compiles
    failures = compile_all(specs[::-1])  # waits for the pool's verdicts, and compiles what no worker has started
    assert [f.split(":")[0] for f in failures] == ["fill<3>"]


def test_sample_beyond_keeps_what_the_reference_lacks_and_samples_the_rest():
    from rtckern.testing import sample_beyond

    specs = [_spec(f"fill<{n}>", "sm_89") for n in range(10)]
    reference = [_spec(f"fill<{n}>", "sm_86") for n in range(2, 10)]  # another arch: the code is what counts
    reference.append(_spec("fill<1>", "sm_86", options=("--maxrregcount=32",)))  # other options: other code
    picked = [s.name_expression for s in sample_beyond(specs, reference, every=3)]
    assert picked == ["fill<0>", "fill<1>", "fill<2>", "fill<5>", "fill<8>"]


WGMMA_SOURCE = r"""
__device__ __forceinline__ void issue(float (&d)[4], unsigned long long da, unsigned long long db) {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, 0, 0;\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db));
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wait_groups() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Partial sums into two register sets in turn, each read once the wgmma after it is issued (wait_group 1).
// PENDING: the first set's next wgmma is left in flight across the loop's back edge, which makes ptxas serialize
// every wgmma (C7514, reported only with -v); otherwise each round drains (wait_group 0) before the next.
template <bool PENDING>
__global__ void turns(float* out, unsigned long long da, unsigned long long db, int n) {
  float q0[4] = {0.f, 0.f, 0.f, 0.f}, q1[4] = {0.f, 0.f, 0.f, 0.f}, acc = 0.f;
  if (PENDING) issue(q0, da, db);
  for (int i = 0; i < n; ++i) {
    if (!PENDING) issue(q0, da + i, db);
    issue(q1, da + 2 * i, db);
    wait_groups<1>();
    acc += q0[0] + q0[1] + q0[2] + q0[3];
    issue(q0, da + 3 * i, db);
    wait_groups<1>();
    acc += q1[0] + q1[1] + q1[2] + q1[3];
    issue(q1, da + 4 * i, db);
    wait_groups<1>();
    acc += q0[0] + q0[1] + q0[2] + q0[3];
    if (PENDING) {
      issue(q0, da + 5 * i, db);
      wait_groups<1>();
    } else {
      wait_groups<0>();
    }
    acc += q1[0] + q1[1] + q1[2] + q1[3];
  }
  wait_groups<0>();
  out[threadIdx.x] = acc + q0[0];
}
"""


def test_serialized_wgmmas_fail_the_no_spills_check():
    """ptxas's notes of a performance loss (C7514: wgmmas serialized), which only its -v log shows, fail a kernel as
    spills do: from the shared program and from a lone compile alike; without the check the kernel compiles."""
    import rtckern.testing as testing

    def spec(pending: str) -> KernelSpec:
        return KernelSpec("test/wgmma.cu", f"turns<{pending}>", Arch.parse("sm_90a"), code=WGMMA_SOURCE)

    bad, good = spec("true"), spec("false")
    failures = compile_all([good, bad], jobs=1, no_spills=True)
    assert len(failures) == 1 and failures[0].startswith("turns<true> (sm_90a): ptxas C7514: ")
    assert "serialized" in failures[0]
    assert testing._program_verdicts([good, bad], True) == [None, failures[0]]  # read from the shared program
    assert testing._compile_spec(bad, no_spills=True) == failures[0]
    assert compile_all([bad], jobs=1) == []


def test_kernel_parameters_expand_a_parameter_list_written_once():
    text = r"""
#define EXTRA_PARAMS , const int* __restrict__ cu
#define NO_PARAMS
#define PARAMS(T, EXTRA) const T* __restrict__ x, \
    long long n EXTRA
__global__ void __launch_bounds__(128) with_extra(PARAMS(float, EXTRA_PARAMS)) {}
__global__ void without(PARAMS(half, NO_PARAMS)) {}
__global__ void plain(int* p, float s) { p[0] = (int)s; }
"""
    assert kernel_parameters(text, "with_extra") == ["const float* __restrict__ x", "long long n",
                                                     "const int* __restrict__ cu"]
    assert kernel_parameters(text, "ns::without") == ["const half* __restrict__ x", "long long n"]
    assert kernel_parameters(text, "plain") == ["int* p", "float s"]
    with pytest.raises(AssertionError, match="EXTRA_PARAMS defined twice"):  # both branches of an #if left in
        kernel_parameters(text + "#define EXTRA_PARAMS , int other\n", "with_extra")
