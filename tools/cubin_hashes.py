"""Compile every kernel variant of one or more families and record the sha256 of each binary, or compare two
such records: the evidence that a change to shared device code left the cubins byte-identical.

    python tools/cubin_hashes.py write before.json [--family attention ...] [--arch sm_80 ...] [--match RE] [--jobs 2]
                                  [--ptx]
    python tools/cubin_hashes.py compare before.json after.json

Each record maps a variant label (family, arch, kernel name expression, defines) to its sha256, its register
count and its spill bytes (ptxas -v; -v changes the log, not the binary). `compare` lists every label whose
binary changed, whose registers went up, or that spills more, and exits 1 if any did. Run `write` on a clean
checkout before a change (e.g. `git archive HEAD | tar -x -C /tmp/base` and PYTHONPATH=/tmp/base) and on the
changed tree after it.

The variants are the ones the compile-everything tests walk (tests/unit/ops/test_*.py): every candidate of each
op over the dtypes, head dims / row lengths and flags it serves, for sm_75, sm_80, sm_86, sm_89 and sm_90 (the
sm_90 device also gets the sm_90a kernels; sm_89 and sm_90 for rms_norm_quant); gfx90a through hiprtc where it is installed (--arch gfx90a).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import re
import sys

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
HEAD_DIMS = (32, 64, 96, 128, 256)
FP = ("bf16", "fp16")


def _serving(cands, req):
    from rtckern.registry.candidate import arch_reason

    for c in cands:
        if arch_reason(c, req) is None and c.supports(req) is None:
            yield from c.kernel_specs(req)


def attention_specs(arch):
    from rtckern.device import DeviceInfo
    from rtckern.registry import build_request, candidates

    dev = DeviceInfo.for_arch(arch)
    for op in ("attention", "attention_varlen"):
        cands = candidates(op)
        for hd in HEAD_DIMS:
            for dt in FP:
                for causal in ("0", "1"):
                    yield from _serving(cands, build_request(op, shape=(hd,), dtype=dt, device=dev,
                                                             options={"causal": causal}))


def attention_backward_specs(arch):
    from rtckern.device import DeviceInfo
    from rtckern.registry import build_request, candidates

    dev = DeviceInfo.for_arch(arch)
    for op in ("attention_backward", "attention_varlen_backward"):
        cands = candidates(op)
        if not cands:  # an op this checkout does not have
            continue
        for hd in HEAD_DIMS:
            for dt in FP:
                for causal in ("0", "1"):
                    for det in ("0", "1"):
                        yield from _serving(cands, build_request(op, shape=(hd,), dtype=dt, device=dev,
                                                                 options={"causal": causal, "deterministic": det}))


def gemm_specs(arch):
    from rtckern.arch import Arch
    from rtckern.device import DeviceInfo
    from rtckern.ops._gemm import geometry, tune
    from rtckern.ops._gemm.geometry import GemmProblem

    dev = DeviceInfo.for_arch(arch)
    problems = [GemmProblem(1, m, n, k, dt, out, tb, bias, act, res, aligned=al)
                for m, n, k in ((16, 4096, 4096), (4096, 4096, 4096))
                for dt in FP for out in ("bf16", "fp16", "fp32") for tb in (True, False)
                for bias, act, res in ((False, "none", False), (True, "gelu_tanh", True), (False, "silu", False))
                for al in (True, False)]
    a = Arch.parse(arch)
    for p in problems:
        for cfg in tune.sweep_configs(p, dev):
            if cfg.invalid(p) is None:
                for spec in geometry.kernel_specs(p, cfg, a if cfg.kind != "sm90" else Arch.parse("sm_90a")):
                    yield spec


def gemm_fp8_specs(arch):
    """Every sm_90a tile of the tuner's sweep for both scale kinds, outputs and biases (on sm_90), the CUDA-core
    fallback and the quantizer (sm_89 and newer)."""
    from rtckern.arch import Arch
    from rtckern.ops._fp8 import geometry, tune
    from rtckern.ops._fp8.geometry import Fp8Problem

    a = Arch.parse(arch)
    if a.cc < (8, 9):
        return
    for scale in ("tensor", "block"):
        for out in geometry.OUTPUT_DTYPES:
            for bias in ("none",) + geometry.BIAS_DTYPES:
                for m in (16, 4096):
                    p = Fp8Problem(m, 4096, 4096, scale, out, bias)
                    if arch == "sm_90":
                        for cfg in tune.sweep_configs(p):
                            yield geometry.sm90_spec(p, cfg, Arch.parse("sm_90a"))
                    yield geometry.simt_spec(p, a)
    for dt in geometry.QUANT_DTYPES:
        for g in geometry.QUANT_GROUPS:
            yield geometry.quant_spec(dt, g, a)


def grouped_specs(arch):
    from rtckern.testing import grouped_gemm_variants

    return grouped_gemm_variants(arch)


def norms_specs(arch):
    from rtckern.testing import norms_variants

    return norms_variants(arch)


def rms_norm_quant_specs(arch):
    """rms_norm_quant's row kernels (sm_89 and newer): every input / weight dtype, group and the test's row lengths,
    at the config the candidate picks (tests/unit/ops/test_rms_norm_quant.py walks the same)."""
    from rtckern.arch import Arch
    from rtckern.device import DeviceInfo
    from rtckern.ops._norms import candidates as cands
    from rtckern.ops._norms import geometry

    if Arch.parse(arch).gfx or Arch.parse(arch).cc < (8, 9):
        return
    dev, cand = DeviceInfo.for_arch(arch), cands.RmsNormQuantRows()
    for x in geometry.DTYPES:
        for n in (256, 2048, 4096, 7168, 8192):
            for group in geometry.QUANT_GROUPS:
                for w in dict.fromkeys((x, "fp32", None)):
                    req = cands.quant_request(x, w, n, 4 if x == "fp32" else 8, group, False, dev)
                    if cand.supports(req) is None:
                        yield from cand.kernel_specs(req)


def softmax_specs(arch):
    from rtckern.arch import Arch
    from rtckern.device import DeviceInfo
    from rtckern.ops._softmax import candidates as cands
    from rtckern.ops._softmax import geometry, ring
    from rtckern.ops._softmax.geometry import BWD, CAUSAL, FWD, MASKED, PLAIN
    from rtckern.spec import KernelSpec

    yield from cands.prefill_specs([Arch.parse(arch)])
    if arch == "sm_90":  # the ring sweep (test_softmax_ring.py)
        a, smem = Arch.parse(arch), DeviceInfo.for_arch(arch).max_smem_per_block_optin
        for direction in (FWD, BWD):
            for dt in geometry.CTYPES:
                for n in (1024, 4096, 8192, 16384, 65536):
                    for kind in (PLAIN, MASKED, CAUSAL) if direction == FWD else (PLAIN,):
                        for r in ring.sweep_rings(direction, kind, dt, n, smem):
                            yield KernelSpec(geometry.SOURCE, ring.kernel_name(direction), a,
                                             template_args=tuple(r.template_args(direction, kind, dt)), op="softmax")


def attention_kvcache_specs(arch):
    """attention_with_kvcache: the mma.sync decode kernel at its default tiles with the split merge, append and
    gather (sm_80 and newer), their e4m3-cache forms (sm_89 and newer), and the portable kernel (every arch)."""
    from rtckern.arch import Arch
    from rtckern.testing import (kvcache_fp8_specs, kvcache_kernel_exprs, kvcache_simt_kernel_exprs,
                                 name_expression_specs)

    a = Arch.parse(arch)
    if a.gfx:
        return
    if a.cc >= (8, 0):
        yield from name_expression_specs(*kvcache_kernel_exprs(HEAD_DIMS), arch)
    if a.cc >= (8, 9):
        yield from kvcache_fp8_specs(HEAD_DIMS, arch)
    yield from name_expression_specs(*kvcache_simt_kernel_exprs(HEAD_DIMS), arch)


def core_specs(arch):
    from rtckern.arch import Arch
    from rtckern.prefill import _core_specs

    yield from _core_specs([Arch.parse(arch)])


FAMILIES = {"attention": attention_specs, "attention_backward": attention_backward_specs,
            "attention_kvcache": attention_kvcache_specs, "gemm": gemm_specs, "gemm_fp8": gemm_fp8_specs,
            "grouped_gemm": grouped_specs, "norms": norms_specs, "rms_norm_quant": rms_norm_quant_specs,
            "softmax": softmax_specs, "core": core_specs}


def label(family: str, spec) -> str:
    d = ",".join(f"{k}={v}" for k, v in spec.defines)
    return f"{family} {spec.arch.sm} {spec.name_expression}" + (f" [{d}]" if d else "")


_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def _compile(spec) -> dict:
    from rtckern.compiler import compiler_for

    if not spec.arch.gfx:
        spec = dataclasses.replace(spec, options=tuple(spec.options) + ("--ptxas-options=-v",))
    try:
        ck = compiler_for(spec.arch).compile(spec)
    except Exception as e:  # recorded: a variant that stops compiling is a change too
        return {"error": str(e)[:300]}
    log = ck.log or ""
    regs = [int(m.group(1)) for m in _REGS.finditer(log)]
    spills = [int(m.group(1)) + int(m.group(2)) for m in _SPILLS.finditer(log)]
    return {"sha256": hashlib.sha256(ck.binary).hexdigest(), "regs": max(regs, default=0),
            "spill_bytes": sum(spills)}


def _ptx(spec) -> dict:
    """The sha256 of the PTX NVRTC makes of spec (front end and NVVM, no ptxas): identical PTX gives identical
    cubins, so a change whose PTX is unchanged needs no cubin compile; one whose PTX changed does."""
    from cuda.bindings import nvrtc

    from rtckern.compiler import compiler_for

    opts = [re.sub(r"^(--gpu-architecture=|-arch=)sm_", r"\1compute_", o)
            for o in compiler_for(spec.arch).options_for(spec)]
    err, prog = nvrtc.nvrtcCreateProgram(spec.program_text().encode(), b"kernel.cu", 0, [], [])
    try:
        nvrtc.nvrtcAddNameExpression(prog, spec.name_expression.encode())
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return {"error": f"NVRTC {res}"}
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        ptx = b" " * size
        nvrtc.nvrtcGetPTX(prog, ptx)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return {"sha256": hashlib.sha256(ptx).hexdigest()}


def collect(families, archs, match: str | None = None) -> dict:
    importlib.import_module("rtckern.ops")  # registers the candidates

    pattern = re.compile(match) if match else None
    specs = {}
    for fam in families:
        for arch in archs:
            for spec in FAMILIES[fam](arch):
                lab = label(fam, spec)
                if pattern is None or pattern.search(lab):
                    specs.setdefault(lab, spec)
    return specs


def write(path, families, archs, jobs, match=None, ptx=False) -> None:
    specs = collect(families, archs, match)
    work = _ptx if ptx else _compile
    labels = sorted(specs)
    print(f"{len(labels)} variants ({', '.join(families)}; {', '.join(archs)}) on {jobs} processes", flush=True)
    if jobs == 1:
        results = list(map(work, (specs[k] for k in labels)))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
            results = list(ex.map(work, (specs[k] for k in labels), chunksize=4))
    out = dict(zip(labels, results))
    with open(path, "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
    errors = [k for k, v in out.items() if "error" in v]
    print(f"wrote {path}: {len(out)} variants, {len(errors)} failed to compile")


def compare(a_path, b_path) -> int:
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    common = sorted(set(a) & set(b))
    changed = [k for k in common if a[k].get("sha256") != b[k].get("sha256")]
    worse = [k for k in common if b[k].get("regs", 0) > a[k].get("regs", 0)
             or b[k].get("spill_bytes", 0) > a[k].get("spill_bytes", 0)]
    print(f"{len(common)} variants in both: {len(common) - len(changed)} byte-identical, {len(changed)} changed, "
          f"{len(worse)} with more registers or spills; {len(set(a) - set(b))} only in {a_path}, "
          f"{len(set(b) - set(a))} only in {b_path}")
    for k in changed:
        print(f"  changed: {k}  regs {a[k].get('regs')} -> {b[k].get('regs')}, spill bytes "
              f"{a[k].get('spill_bytes')} -> {b[k].get('spill_bytes')}")
    for k in worse:
        print(f"  worse: {k}")
    for k in sorted(set(a) ^ set(b)):
        print(f"  only in {a_path if k in a else b_path}: {k}")
    return 1 if changed or worse or set(a) != set(b) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="compile and record {variant: sha256, regs, spills}")
    w.add_argument("out")
    w.add_argument("--family", action="append", choices=sorted(FAMILIES), help="default: every family")
    w.add_argument("--arch", action="append", help=f"default: {', '.join(ARCHS)}")
    w.add_argument("--jobs", type=int, default=2)
    w.add_argument("--match", help="only the variants whose label matches this regular expression (e.g. the kernels "
                   "of the sources a change touched: 'sm_90a|_ck<')")
    w.add_argument("--list", action="store_true", help="print the labels only (no compile)")
    w.add_argument("--ptx", action="store_true", help="hash each variant's PTX instead (no ptxas: faster; identical "
                   "PTX means identical cubins, changed PTX needs the cubin check)")
    c = sub.add_parser("compare", help="compare two records; exit 1 if any binary changed")
    c.add_argument("before")
    c.add_argument("after")
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        return compare(args.before, args.after)
    families, archs = args.family or sorted(FAMILIES), tuple(args.arch or ARCHS)
    if args.list:
        specs = collect(families, archs, args.match)
        print("\n".join(sorted(specs)))
        print(f"{len(specs)} variants", file=sys.stderr)
        return 0
    write(args.out, families, archs, max(1, args.jobs), args.match, args.ptx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
