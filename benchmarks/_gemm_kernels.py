"""Kernel-level GEMM checks on a live GPU, no registry (`python -m benchmarks gemm --check`): every kernel family
and tile config (sm80, the sm80 general path, simt, sm90 and its ping-pong schedule, split-K on both tensor-core
families, a B shared across the batch) is launched directly through rtckern.ops._gemm_launch and checked against a
float64 reference.

Correctness: fresh random inputs per case, output poisoned with NaN first, relative Frobenius error against a
float64 reference of the same (rounded) inputs, bound max(u_out, 2^-16) * sqrt(K) (u: unit roundoff of the
output dtype).
"""
from __future__ import annotations

import concurrent.futures as cf
import math
import time
import traceback

import torch

from rtckern.device import DeviceInfo
from rtckern.dtypes import unit_roundoff
from rtckern.manager import get_manager
from rtckern.ops import _gemm_launch as L
from rtckern.ops._gemm_plan import (GemmProblem, SimtConfig, Sm80Config, Sm90Config, kernel_specs, with_splits,
                                    workspace_bytes)

TORCH_DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _compile_one(spec):
    t0 = time.perf_counter()
    get_manager().compile(spec)
    return time.perf_counter() - t0


def precompile(specs, workers: int) -> None:
    """Compile every spec into the disk cache in parallel processes, so the checks only load."""
    uniq = list(dict.fromkeys(specs))
    t0 = time.perf_counter()
    errors = []
    with cf.ProcessPoolExecutor(max_workers=workers) as ex:
        futs = {ex.submit(_compile_one, s): s for s in uniq}
        for f in cf.as_completed(futs):
            try:
                f.result()
            except Exception as e:  # reported per spec; the case using it reports again
                errors.append(f"{futs[f].describe()}: {str(e)[:2000]}")
    print(f"precompiled {len(uniq)} kernels in {time.perf_counter() - t0:.1f}s, {len(errors)} errors", flush=True)
    for e in errors:
        print("COMPILE ERROR", e, flush=True)


class Case:
    def __init__(self, p: GemmProblem, cfg, dev: DeviceInfo, label: str = ""):
        self.p, self.dev = p, dev
        self.cfg = with_splits(cfg, p, dev.sm_count)
        arch = dev.arch.base().with_specific() if self.cfg.kind == "sm90" else dev.arch.base()
        self.specs = kernel_specs(p, self.cfg, arch)
        self.label = label or f"{self.cfg.as_dict()}"


def make_inputs(p: GemmProblem, gen, misalign: bool = False):
    dt = TORCH_DT[p.dtype]
    scale = 1.0 / math.sqrt(p.k)
    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float32)
    a = rnd(p.batch, p.m, p.k).to(dt)
    bshape = (p.n, p.k) if p.trans_b else (p.k, p.n)
    b = (rnd(p.batch if p.b_batched else 1, *bshape) * scale).to(dt)
    bias = rnd(p.n).to(dt) if p.bias else None
    res = rnd(p.batch, p.m, p.n).to(TORCH_DT[p.out_dtype]) if p.residual else None
    if misalign:  # shift A's base by one element so nothing is 16-byte aligned
        buf = torch.empty(a.numel() + 1, device="cuda", dtype=dt)
        buf[1:].copy_(a.reshape(-1))
        a = buf[1:].view(p.batch, p.m, p.k)
    return a, b, bias, res


def reference(p, a, b, bias, res):
    a64, b64 = a.double(), b.double()
    if p.trans_b:
        b64 = b64.transpose(-1, -2)
    y = torch.matmul(a64, b64)
    if bias is not None:
        y = y + bias.double()
    if p.activation == "gelu_tanh":
        y = torch.nn.functional.gelu(y, approximate="tanh")
    elif p.activation == "silu":
        y = torch.nn.functional.silu(y)
    if res is not None:
        y = y + res.double()
    return y


def operands(p, a, b, c, bias, res):
    return L.Operands(a=a.data_ptr(), b=b.data_ptr(), c=c.data_ptr(), lda=a.stride(-2), ldb=b.stride(-2),
                      ldc=c.stride(-2), stride_a=a.stride(0), stride_b=b.stride(0) if p.b_batched else 0,
                      stride_c=c.stride(0), bias=bias.data_ptr() if bias is not None else 0,
                      res=res.data_ptr() if res is not None else 0, ldr=res.stride(-2) if res is not None else 0,
                      stride_r=res.stride(0) if res is not None else 0)


def run_case(case: Case, kernels, a, b, bias, res, c=None, ws=None, stream=None):
    p = case.p
    if c is None:
        c = torch.full((p.batch, p.m, p.n), float("nan"), device="cuda", dtype=TORCH_DT[p.out_dtype])
    nbytes = workspace_bytes(p, case.cfg.splits)
    if nbytes and ws is None:
        ws = torch.empty(nbytes // 4, device="cuda", dtype=torch.float32)
    L.launch(kernels, p, case.cfg, operands(p, a, b, c, bias, res), stream=stream, sm_count=case.dev.sm_count,
             workspace=ws.data_ptr() if ws is not None else 0)
    return c, ws


def check(case: Case, gen, misalign=False) -> dict:
    p = case.p
    kernels = [get_manager().get(s, device=0) for s in case.specs]
    a, b, bias, res = make_inputs(p, gen, misalign)
    c, _ = run_case(case, kernels, a, b, bias, res)
    torch.cuda.synchronize()
    ref = reference(p, a, b, bias, res)
    out = c.double()
    nan = int(torch.isnan(out).sum().item())
    err = (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30)).item()
    tol = max(unit_roundoff(p.out_dtype), 2.0 ** -16) * math.sqrt(p.k)
    ok = nan == 0 and err <= tol
    return {"ok": ok, "rel_err": err, "tol": tol, "unwritten_or_nan": nan}


# -- the case lists -----------------------------------------------------------------------------------------------
def correctness_cases(dev: DeviceInfo):
    cases = []
    P = GemmProblem
    s80 = Sm80Config(128, 128, 64, 64, 32, 4)
    s80g = Sm80Config(64, 64, 64, 32, 32, 3)  # general (unaligned) path
    s90 = Sm90Config(128, 256, 4, 2)
    s90b = Sm90Config(128, 128, 6, 2)
    s90s = Sm90Config(64, 128, 6, 1)
    # aligned shapes: k % 8 == 0 and n % 8 == 0; odd m and tile edges everywhere
    al_shapes = [(1, 1, 8, 8), (1, 7, 64, 1000), (1, 63, 1000, 4104), (1, 1000, 1000, 64), (1, 4097, 72, 8),
                 (3, 129, 264, 200)]
    odd_shapes = [(1, 1, 1, 1), (1, 7, 63, 1000), (1, 63, 7, 4097), (1, 1000, 1000, 63), (1, 4097, 63, 7),
                  (2, 33, 65, 129)]
    epis = [("none", False, False), ("gelu_tanh", True, False), ("silu", False, True), ("gelu_tanh", True, True),
            ("none", True, True)]
    combos = [("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32"), ("fp16", "fp32"), ("fp16", "bf16")]
    i = 0
    for fam, cfg, shapes, aligned in (("sm80", s80, al_shapes, True), ("sm80g", s80g, odd_shapes, False),
                                      ("simt", SimtConfig(), odd_shapes, False), ("sm90", s90, al_shapes, True),
                                      ("sm90b", s90b, al_shapes[:3], True)):
        if fam.startswith("sm90") and not (dev.arch.major == 9 and dev.arch.minor == 0):
            continue
        for tb in (True, False):
            for j, (batch, m, n, k) in enumerate(shapes):
                act, bias, res = epis[(i + j) % len(epis)]
                din, dout = combos[(i + 2 * j) % len(combos)]
                p = P(batch, m, n, k, din, dout, tb, bias, act, res, aligned=aligned)
                cases.append((f"{fam} tb={tb} {din}->{dout} {batch}x{m}x{n}x{k} {act} bias={bias} res={res}",
                              Case(p, cfg, dev)))
            i += 1
    # the ping-pong schedule: both layouts, edges, epilogues, batches, split-K
    if dev.arch.major == 9:
        for tb in (True, False):
            for j, ((batch, m, n, k), cfg) in enumerate((
                    ((1, 1000, 1000, 64), Sm90Config(128, 128, 6, 2, pingpong=True)),
                    ((1, 63, 1000, 4104), Sm90Config(128, 128, 6, 2, pingpong=True)),
                    ((3, 129, 264, 200), Sm90Config(128, 128, 6, 2, pingpong=True)),
                    ((1, 777, 520, 1032), Sm90Config(64, 256, 5, 2, pingpong=True)),
                    ((1, 1000, 1000, 4096), Sm90Config(128, 128, 6, 2, pingpong=True, splits=3)),
                    ((1, 520, 2056, 1000), Sm90Config(64, 256, 5, 2, pingpong=True, splits=2)))):
                act, bias, res = epis[j % len(epis)]
                din, dout = combos[(j + int(tb)) % len(combos)]
                p = P(batch, m, n, k, din, dout, tb, bias, act, res, aligned=True)
                cases.append((f"sm90pp tb={tb} {din}->{dout} {batch}x{m}x{n}x{k} {act} bias={bias} res={res}",
                              Case(p, cfg, dev)))
    # split-K on both tensor-core families, both layouts, with and without epilogue
    for tb in (True, False):
        for cfg, tag in ((Sm80Config(64, 128, 64, 32, 32, 4, splits=0), "sm80 splitK"),
                         (Sm80Config(64, 64, 64, 32, 32, 3, splits=3), "sm80g splitK"),
                         (s90s.__class__(64, 128, 6, 1, splits=0), "sm90 splitK"),
                         (Sm90Config(128, 128, 6, 2, splits=4), "sm90 splitK4")):
            if cfg.kind == "sm90" and not (dev.arch.major == 9 and dev.arch.minor == 0):
                continue
            aligned = "sm80g" not in tag
            for (batch, m, n, k), (act, bias, res) in (((1, 16, 1024, 4096), ("gelu_tanh", True, True)),
                                                      ((2, 33, 520, 2000), ("none", False, False)),
                                                      ((1, 64, 4096, 1000 if not aligned else 1024),
                                                       ("silu", True, False))):
                if not aligned:
                    n, k = n - 1, k - 3
                p = P(batch, m, n, k, "bf16", "bf16", tb, bias, act, res, aligned=aligned)
                cases.append((f"{tag} tb={tb} {batch}x{m}x{n}x{k} {act}", Case(p, cfg, dev)))
    # shared B across the batch (weights), and the unaligned-base path
    p = P(4, 100, 256, 512, "bf16", "bf16", True, True, "none", False, aligned=True, b_batched=False)
    cases.append(("sm80 shared-B", Case(p, s80, dev)))
    if dev.arch.major == 9:
        cases.append(("sm90 shared-B", Case(p, s90, dev)))
        p2 = P(4, 100, 256, 512, "bf16", "bf16", False, False, "none", True, aligned=True, b_batched=False)
        cases.append(("sm90 shared-B nt", Case(p2, s90b, dev)))
    return cases


def run_checks(dev: DeviceInfo, workers: int, no_sm90: bool = False) -> list[dict]:
    """Every correctness case (compiled first, in parallel processes): one row per case, ok or not."""
    keep = (lambda c: c.cfg.kind != "sm90") if no_sm90 else (lambda c: True)
    checks = [(lbl, c) for lbl, c in correctness_cases(dev) if keep(c)]
    precompile([s for _, c in checks for s in c.specs], workers)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    results = []
    for label, case in checks:
        try:
            r = check(case, gen, misalign=("sm80g" in label or "simt" in label) and case.p.batch == 1
                      and case.p.m * case.p.k > 1)
        except Exception as e:  # recorded as a failed case; the others still run
            r = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1500], "tb": traceback.format_exc()[-1500:]}
        r.update(label=label, config=case.cfg.as_dict())
        results.append(r)
        print(("PASS " if r["ok"] else "FAIL ") + label + f" cfg={case.cfg.as_dict()} "
              + (f"err={r.get('rel_err', 0):.2e} tol={r.get('tol', 0):.1e} nan={r.get('unwritten_or_nan')}"
                 if "error" not in r else r["error"]), flush=True)
    print(f"checks: {sum(r['ok'] for r in results)}/{len(results)} passed", flush=True)
    return results
