"""Host cost per call of the rtckern ops (norms, softmax, attention, attention over a KV cache, gemm) at launch-bound
sizes, against torch's.

GPU (the real number):     python -m benchmarks op_overhead [--calls 5000]
    Eager loop of N calls per op on small inputs, torch.cuda.synchronize() once at the end, vs torch's own op on
    the same inputs, the loops of the compared calls alternating round by round; prints a markdown table of
    microseconds per call. At these sizes the kernels take ~2-5 us, so the loop measures the host side (what
    decode-time calls pay). Each op is timed twice: called directly
    (rtckern.ops.*) and through the torch plugin (torch.ops.rtckern.*, what a patched or compiled model calls),
    both against torch's own eager call. Two training rows: attention forward + backward through autograd (against
    SDPA's), and the floor any Python autograd formula pays on CUDA tensors (a bare autograd.Function that only
    allocates, in torch's column).

Plugin layers (no GPU):    python -m benchmarks op_overhead --plugin-stub [--calls 20000]
    torch.ops.rtckern.* on CPU tensors with real torch and rtckern.ops' functions replaced by a stand-in that
    allocates the output: the dispatcher and the plugin's own Python, per call, against the stand-in called
    directly (the "rtckern" column). Use it to compare registration forms; torch's column stays empty. Printed
    only (both CPU modes write no result files).

CPU harness (no GPU):      python -m benchmarks op_overhead --stub [--calls 10000] [--profile OP]
    The real Python path of each op with the GPU pieces stubbed (benchmarks/_cpu_stubs.py): a fake `torch` module
    (tensors that carry a shape, strides, dtype and an address; empty/zeros; the current stream), a fake libcuda
    behind the real cuda.bindings and the native launcher (an H200-like device; loads, attributes and occupancy
    answered, launches that do nothing), and the registry's probe replaced by "first candidate whose cheap checks
    pass". It measures our Python only: torch's own allocation and stream costs and the driver's launch (~4.8 us on
    the H200) are not in it. Use it to find and remove Python work; use the GPU mode for the number that matters.
"""
from __future__ import annotations

import contextlib
import importlib
import statistics
import time

from benchmarks._cpu_stubs import install_stubs
from benchmarks.runner import Result, Table, gpu_name, stored_data


# ---- cases ------------------------------------------------------------------------------------------------------
def cases(torch, stub: bool):
    """(name, rtckern call, torch's call or None) on decode-sized inputs."""
    import rtckern.ops as ops

    dev = "cuda"
    bf16 = torch.bfloat16

    def rnd(*shape, dtype=bf16):
        return torch.empty(shape, dtype=dtype, device=dev) if stub else torch.randn(shape, dtype=dtype, device=dev)

    x = rnd(4, 4096)
    w = rnd(4096)
    b = rnd(4096)
    dy = rnd(4, 4096)
    _, rstd = (None, rnd(4, dtype=torch.float32)) if stub else ops.rms_norm(x, w, return_rstd=True)
    ystat = (rnd(4, dtype=torch.float32), rnd(4, dtype=torch.float32)) if stub else \
        ops.layer_norm(x, w, b, return_stats=True)[1:]
    s = rnd(1, 32, 1, 1024)
    ys = rnd(1, 32, 1, 1024)
    c = rnd(32, 128, 128)
    q = rnd(1, 1, 32, 128)
    k = rnd(1, 1024, 8, 128)
    v = rnd(1, 1024, 8, 128)
    lens = torch.full((1,), 1024, dtype=torch.int32, device=dev) if not stub else rnd(1, dtype=torch.int32)
    qb = rnd(2, 128, 8, 64)
    lse_b = rnd(2, 8, 128, dtype=torch.float32) if stub else ops.attention(qb, qb, qb, causal=True, return_lse=True)[1]
    a1 = rnd(1, 1024)
    wl = rnd(1024, 1024)  # an nn.Linear weight (out, in): 2 MB, so the GEMV itself stays under the host time
    out = [
        ("rms_norm [4,4096] bf16", lambda: ops.rms_norm(x, w, 1e-6),
         None if stub else (lambda: torch.nn.functional.rms_norm(x, (4096,), w, 1e-6))),
        ("rms_norm +residual", lambda: ops.rms_norm(x, w, 1e-6, residual=dy), None),
        ("layer_norm [4,4096] bf16", lambda: ops.layer_norm(x, w, b, 1e-5),
         None if stub else (lambda: torch.nn.functional.layer_norm(x, (4096,), w, b, 1e-5))),
        ("rms_norm_backward", lambda: ops.rms_norm_backward(dy, x, w, rstd), None),
        ("layer_norm_backward", lambda: ops.layer_norm_backward(dy, x, w, b, ystat[0], ystat[1]),
         None if stub else (lambda: torch.ops.aten.native_layer_norm_backward(
             dy, x, (4096,), ystat[0].view(4, 1), ystat[1].view(4, 1), w, b, (True, True, True)))),
        ("softmax [1,32,1,1024] bf16", lambda: ops.softmax(s, 0.125),
         None if stub else (lambda: torch.softmax(s, -1))),
        ("softmax_backward", lambda: ops.softmax_backward(ys, s, 0.125),
         None if stub else (lambda: torch.ops.aten._softmax_backward_data(s, ys, -1, bf16))),
        ("causal softmax [32,128,128]", lambda: ops.scaled_upper_triang_masked_softmax(c, 0.125), None),
        ("attention decode q[1,1,32,128] kv 1024 GQA", lambda: ops.attention(q, k, v),
         None if stub else (lambda: torch.nn.functional.scaled_dot_product_attention(
             q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True))),
        ("attention_with_kvcache decode q[1,1,32,128] cache 1024 GQA",
         lambda: ops.attention_with_kvcache(q, k, v, lens),
         None if stub else (lambda: torch.nn.functional.scaled_dot_product_attention(
             q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True))),
        ("attention_backward [2,128,8,64] causal",
         lambda: ops.attention_backward(qb, qb, qb, qb, qb, lse_b, causal=True), None),
    ]
    if not stub:  # the CPU harness's fake torch has neither a GEMM path nor autograd
        out.append(("gemm M=1 [1,1024] x [1024,1024]^T bf16", lambda: ops.gemm(a1, wl, trans_b=True),
                    lambda: torch.nn.functional.linear(a1, wl)))
        out.extend(fp8_cases(torch, ops))
        out.append(training_attention(torch, ops))
        out.append(training_rms_norm(torch, ops))
        out.append((AUTOGRAD_FLOOR, None, python_function_floor(torch)))
    return out


AUTOGRAD_FLOOR = "autograd.Function floor [2,128,8,64] (empty_like only)"
GEMM_FP8 = "gemm_fp8 M=1 [1,4096] x [4096,4096]^T per-tensor"
QUANT = "quantize_fp8 [1,4096] group 128"
NORM_QUANT = "rms_norm_quant [1,4096] group 128"


def _fp8_inputs(torch, dev: str = "cuda"):
    """A decode step's fp8 operands: one token's activations (bf16 and e4m3), a 4096 x 4096 e4m3 weight (16 MB:
    the call stays host-bound), per-tensor scales, a norm weight."""
    e4m3 = torch.float8_e4m3fn
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev)
    return (x, x.to(e4m3), torch.randn(4096, 4096, device=dev).to(e4m3), torch.ones((), device=dev),
            torch.ones((), device=dev), torch.randn(4096, dtype=torch.bfloat16, device=dev))


def fp8_cases(torch, ops) -> list:
    """A decode step's fp8 calls: the GEMM against torch._scaled_mm (per-tensor scales, bf16 out: its fastest form),
    and the two activation quantizers (torch has no such op)."""
    x, a8, w8, sa, sb, nw = _fp8_inputs(torch)
    return [(GEMM_FP8, lambda: ops.gemm_fp8(a8, w8, sa, sb),
             lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)),
            (QUANT, lambda: ops.quantize_fp8(x), None),
            (NORM_QUANT, lambda: ops.rms_norm_quant(x, nw, 1e-6), None)]


def python_function_floor(torch):
    """What any op with a Python autograd formula pays on CUDA tensors before it launches anything: a bare
    torch.autograd.Function whose forward and backward only allocate their outputs, through torch.autograd.grad
    (the backward runs on autograd's device thread and takes the GIL there). In torch's column: torch's own cost."""
    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return torch.empty_like(q)

        @staticmethod
        def backward(ctx, do):
            q, k, v = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    q, k, v, do = (torch.randn(2, 128, 8, 64, dtype=torch.bfloat16, device="cuda").requires_grad_(i < 3)
                   for i in range(4))
    return lambda: torch.autograd.grad(Bare.apply(q, k, v), (q, k, v), do)


TRAINING_ATTENTION = "attention fwd+bwd [2,128,8,64] causal"


def training_attention(torch, ops):
    """A training step's attention at a launch-bound size: forward, then backward from a given dout. rtckern's
    column calls the two ops; torch's is SDPA through autograd (torch.autograd.grad, no .grad accumulation), what
    an unpatched HF model runs; the plugin column (plugin_calls) is torch.ops.rtckern.attention through autograd."""
    q, k, v, do = (torch.randn(2, 128, 8, 64, dtype=torch.bfloat16, device="cuda") for _ in range(4))

    def direct():
        o, lse = ops.attention(q, k, v, causal=True, return_lse=True)
        return ops.attention_backward(do, q, k, v, o, lse, causal=True)

    qt, kt, vt = (t.transpose(1, 2).requires_grad_() for t in (q, k, v))
    dot = do.transpose(1, 2)

    def sdpa():
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return torch.autograd.grad(o, (qt, kt, vt), dot)
    return TRAINING_ATTENTION, direct, sdpa


TRAINING_RMS_NORM = "rms_norm fwd+bwd [4,4096] bf16"


def training_rms_norm(torch, ops):
    """A training step's RMSNorm at a launch-bound size, forward then backward (dx and dweight) from a given dy:
    rtckern's column calls the two ops; torch's is F.rms_norm through autograd; the plugin column is
    torch.ops.rtckern.rms_norm through autograd."""
    x, w, dy = (torch.randn(s, dtype=torch.bfloat16, device="cuda") for s in ((4, 4096), (4096,), (4, 4096)))

    def direct():
        _, rstd = ops.rms_norm(x, w, 1e-6, return_rstd=True)
        return ops.rms_norm_backward(dy, x, w, rstd)

    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def eager():
        y = torch.nn.functional.rms_norm(xg, (4096,), wg, 1e-6)
        return torch.autograd.grad(y, (xg, wg), dy)
    return TRAINING_RMS_NORM, direct, eager


def _training_rms_norm_plugin(torch, x, w, dy):
    def call():
        return torch.autograd.grad(torch.ops.rtckern.rms_norm(x, w, 1e-6), (x, w), dy)
    return call


def _training_attention_plugin(torch, q, k, v, do):
    def call():
        o = torch.ops.rtckern.attention(q, k, v, True)
        return torch.autograd.grad(o, (q, k, v), do)
    return call


def plugin_calls(torch, case_names, dev: str = "cuda") -> dict:
    """The same calls through the torch plugin (torch.ops.rtckern.*), by case name, on the inputs of cases():
    one dispatcher call each, as a patched model or a torch.compile graph makes them."""
    importlib.import_module("rtckern.torch")  # registers torch.ops.rtckern

    r = torch.ops.rtckern
    bf16 = torch.bfloat16
    x, w, b = (torch.randn(s, dtype=bf16, device=dev) for s in ((4, 4096), (4096,), (4096,)))
    s = torch.randn(1, 32, 1, 1024, dtype=bf16, device=dev)
    c = torch.randn(32, 128, 128, dtype=bf16, device=dev)
    q = torch.randn(1, 1, 32, 128, dtype=bf16, device=dev)
    k, v = (torch.randn(1, 1024, 8, 128, dtype=bf16, device=dev) for _ in range(2))
    a1, wl = torch.randn(1, 1024, dtype=bf16, device=dev), torch.randn(1024, 1024, dtype=bf16, device=dev)
    dy, ys = torch.randn(4, 4096, dtype=bf16, device=dev), torch.randn(1, 32, 1, 1024, dtype=bf16, device=dev)
    mean, rstd = torch.randn(4, device=dev), torch.rand(4, device=dev) + 0.5
    qb = torch.randn(2, 128, 8, 64, dtype=bf16, device=dev)
    lse_b = r.attention_fwd(qb, qb, qb, True, None, True)[1]
    calls = {
        "rms_norm_backward": lambda: r.rms_norm_bwd(dy, x, w, rstd, False, True, None),
        "layer_norm_backward": lambda: r.layer_norm_bwd(dy, x, w, b, mean, rstd, False, True, True),
        "softmax_backward": lambda: r.softmax_bwd(ys, s, 0.125),
        "attention_backward [2,128,8,64] causal": lambda: r.attention_bwd(qb, qb, qb, qb, qb, lse_b, True, None, False),
        "rms_norm [4,4096] bf16": lambda: r.rms_norm(x, w, 1e-6),
        "rms_norm +residual": lambda: r.fused_add_rms_norm(x, x, w, 1e-6),
        "layer_norm [4,4096] bf16": lambda: r.layer_norm(x, w, b, 1e-5),
        "softmax [1,32,1,1024] bf16": lambda: r.softmax(s, 0.125),
        "causal softmax [32,128,128]": lambda: r.scaled_upper_triang_masked_softmax(c, 0.125),
        "attention decode q[1,1,32,128] kv 1024 GQA": lambda: r.attention(q, k, v),
        "gemm M=1 [1,1024] x [1024,1024]^T bf16": lambda: r.gemm(a1, wl, None, None, True),
        TRAINING_ATTENTION: _training_attention_plugin(
            torch, *(torch.randn(2, 128, 8, 64, dtype=bf16, device=dev).requires_grad_(i < 3) for i in range(4))),
    }
    calls[TRAINING_RMS_NORM] = _training_rms_norm_plugin(torch, x.clone().requires_grad_(),
                                                          w.clone().requires_grad_(), dy)
    if GEMM_FP8 in case_names:
        x1, a8, w8, sa, sb, nw = _fp8_inputs(torch, dev)
        calls[GEMM_FP8] = lambda: r.gemm_fp8(a8, w8, sa, sb, None, None, True)
        calls[QUANT] = lambda: r.quantize_fp8(x1, 128, "row")
        calls[NORM_QUANT] = lambda: r.rms_norm_quant(x1, nw, 1e-6, 128, "row", False)
    unknown = set(calls) - set(case_names)
    assert not unknown, f"plugin calls name no case: {unknown}"
    return calls


PLUGIN_CASES = ("rms_norm [4,4096] bf16", "rms_norm +residual", "layer_norm [4,4096] bf16", "rms_norm_backward",
                "layer_norm_backward", "softmax_backward", "attention_backward [2,128,8,64] causal",
                "softmax [1,32,1,1024] bf16", "causal softmax [32,128,128]",
                "attention decode q[1,1,32,128] kv 1024 GQA", "gemm M=1 [1,1024] x [1024,1024]^T bf16",
                TRAINING_ATTENTION, TRAINING_RMS_NORM)


def plugin_stub_rows(calls: int, repeats: int) -> list:
    """(name, stand-in us, None, torch.ops.rtckern us, None) per plugin case, on CPU with rtckern.ops' functions
    replaced by a stand-in kernel: the host cost of the dispatcher and the plugin's own layers."""
    import torch

    import rtckern.ops as ops

    def stand_in(x, *args, residual=None, return_rstd=False, return_stats=False, return_lse=False, **kwargs):
        out = (x.new_empty(x.shape),) + ((x.new_empty(x.shape),) if residual is not None else ())
        out += (x.new_empty(x.shape[:-1], dtype=torch.float32),) * (return_rstd + 2 * return_stats + return_lse)
        return out if len(out) > 1 else out[0]

    def backward_stand_in(dout, q, k, v, *args, **kwargs):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    for name in ("rms_norm", "layer_norm", "softmax", "scaled_upper_triang_masked_softmax", "attention", "gemm"):
        setattr(importlib.import_module(getattr(ops, name).__module__), name, stand_in)
    setattr(importlib.import_module("rtckern.ops._attention.api"), "attention_backward", backward_stand_in)
    x = torch.empty(4, 4096, dtype=torch.bfloat16)
    base = time_loop(lambda: stand_in(x), calls, lambda: None, repeats)
    unstubbed = ("rms_norm_backward", "layer_norm_backward", "softmax_backward", TRAINING_RMS_NORM)  # (ops run for real)
    return [(name, base, None, time_loop(fn, calls, lambda: None, repeats), None)
            for name, fn in plugin_calls(torch, PLUGIN_CASES, "cpu").items() if name not in unstubbed]


def profile(fn, calls: int) -> None:
    import cProfile
    import pstats

    for _ in range(100):
        fn()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)


def time_loop(fn, calls: int, sync, repeats: int) -> float:
    return time_interleaved([fn], calls, sync, repeats)[0]


def time_interleaved(fns: list, calls: int, sync, repeats: int, around: list | None = None) -> list[float]:
    """Microseconds per call of each of fns (None stays None): `repeats` rounds, each timing a loop of every fn in
    turn, the median round per fn. Rounds alternate between the calls compared, so a host that slows down or speeds
    up during the case moves every side alike (timing one side's loops, then the other's, put torch's own call at
    20.9 and 31.7 us in two back-to-back runs). around[i], where given, is a context manager factory entered around
    each of fn i's loops (outside the timed calls' own cost)."""
    live = [(f, (around or [None] * len(fns))[i] or contextlib.nullcontext) for i, f in enumerate(fns) if f is not None]
    for f, ctx in live:
        with ctx():
            for _ in range(max(10, calls // 20)):
                f()
    sync()
    times = [[] for _ in live]
    for _ in range(repeats):
        for (f, ctx), ts in zip(live, times):
            with ctx():
                t0 = time.perf_counter()
                for _ in range(calls):
                    f()
                sync()
                ts.append((time.perf_counter() - t0) / calls * 1e6)
    medians = iter([statistics.median(ts) for ts in times])
    return [next(medians) if f is not None else None for f in fns]


def add_args(ap) -> None:
    ap.add_argument("--stub", action="store_true", help="CPU harness with the GPU pieces stubbed")
    ap.add_argument("--plugin-stub", action="store_true", help="the torch plugin's layers on CPU, stand-in kernels")
    ap.add_argument("--calls", type=int, default=None, help="calls per timed loop (default 10000 stub, 5000 GPU)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", default=None, help="cProfile the case whose name starts with this (no result "
                    "files)")


def needs_gpu(a) -> bool:
    return not (a.stub or a.plugin_stub)


def run(a) -> Result | None:
    if a.stub:
        install_stubs()
    import torch

    sync = (lambda: None) if a.stub else torch.cuda.synchronize
    from rtckern.testing import without_direct_front  # (after the stubs: it imports rtckern)

    calls = a.calls or (10000 if a.stub or a.plugin_stub else 5000)
    rows = plugin_stub_rows(calls, a.repeats) if a.plugin_stub else []
    all_cases = [] if a.plugin_stub else cases(torch, a.stub)
    plugin = {} if a.stub or a.plugin_stub else plugin_calls(torch, [c[0] for c in all_cases])
    for name, fn, ref in all_cases:
        if a.profile and not name.startswith(a.profile):
            continue
        if a.profile:  # rtckern.ops' call, then the plugin's where the case has one
            for label, call in (("rtckern.ops", fn), ("torch.ops.rtckern", plugin.get(name)), ("torch", ref)):
                if call is not None:
                    print(f"---- {name}: {label}")
                    profile(call, calls)
            continue
        # the functions the plugin's native front serves from C++ (rtckern.ops._common.DIRECT_SLOTS) are timed on
        # their Python path too
        python_path = fn if plugin and name.split(" ")[0] in DIRECT_CASES else None
        us, ref_us, plugin_us, python_us = time_interleaved(
            [fn, ref, plugin.get(name), python_path], calls, sync, a.repeats, [None, None, None, without_direct_front])
        rows.append((name, us, ref_us, plugin_us, python_us))
    if a.profile:
        return None
    where = "CPU harness, GPU pieces stubbed (Python cost only)" if a.stub else \
        f"CPU, torch {torch.__version__}, rtckern.ops replaced by a stand-in kernel (plugin layers only)" \
        if a.plugin_stub else f"{torch.cuda.get_device_name()} (torch {torch.__version__})"

    data = {"where": where, "calls": calls, "repeats": a.repeats, "interleaved": True}
    if plugin:
        data["torch_ops_front"] = front_summary(importlib.import_module("rtckern.torch").native_status())
    result = to_result([{"op": n, "rtckern_us": u, "torch_us": r, "torch_ops_rtckern_us": p, "rtckern_python_us": y}
                        for n, u, r, p, y in rows], data)
    if a.stub or a.plugin_stub:  # CPU diagnostics: printed, no result set (benchmarks/results keeps the GPU's)
        for part in result.body:
            print(part if isinstance(part, str) else part.markdown(), end="\n\n", flush=True)
        return None
    return result


def front_summary(status: dict) -> str:
    """How the torch.ops.rtckern column's calls ran: through the native front (which ops replayed, which stayed on
    the Python kernels and why) or the Python kernels alone."""
    if not status["active"]:
        return f"torch.ops.rtckern through the Python kernels (native front inactive: {status['why_not']})"
    replayed = sorted(n for n, s in status["ops"].items() if s["recipes"] > 0)
    refused = sorted(f"{n} ({s['last_refusal']})" for n, s in status["ops"].items() if s["refused"] > 0)
    return ("torch.ops.rtckern through the native front: replayed in C++: " + (", ".join(replayed) or "none")
            + "; on the Python kernels: " + ("; ".join(refused) or "none") + ". The rtckern.ops column's norm, "
            "softmax (and causal) and fp8 calls, forward and backward, reach the same replays through the front's "
            "direct entry (one C call from the function); the last column times those functions' Python path")


SERIES = (("rtckern_us", "rtckern.ops"), ("torch_us", "torch"), ("torch_ops_rtckern_us", "torch.ops.rtckern"),
          ("rtckern_python_us", "rtckern.ops, Python path"))
# the cases whose rtckern.ops function the native front serves directly (rtckern.ops._common.DIRECT_SLOTS)
DIRECT_CASES = ("rms_norm", "layer_norm", "softmax", "softmax_backward", "causal", "rms_norm_backward",
                "layer_norm_backward", "gemm_fp8", "quantize_fp8", "rms_norm_quant")



def to_result(rows: list[dict], data: dict) -> Result:
    def us_cell(v):
        return f"{v:.1f}" if v is not None else "-"

    def ratio(v, ref):
        return f"{v / ref:.2f}x" if v is not None and ref else "-"

    table = Table(("op", "rtckern us/call", "torch us/call", "ratio", "torch.ops.rtckern us/call", "ratio",
                   "rtckern.ops Python path us/call", "ratio"),
                  [(r["op"], us_cell(r["rtckern_us"]), us_cell(r["torch_us"]), ratio(r["rtckern_us"], r["torch_us"]),
                    us_cell(r["torch_ops_rtckern_us"]), ratio(r["torch_ops_rtckern_us"], r["torch_us"]),
                    us_cell(r.get("rtckern_python_us")), ratio(r.get("rtckern_python_us"), r["torch_us"]))
                   for r in rows])
    return Result("Host cost per call", rows=rows, data=data,
                  body=[f"{data['where']}: {data['calls']} calls per loop, median of {data['repeats']} "
                        + ("rounds, each timing every column's loop in turn." if data.get("interleaved") else "loops."),
                        *([data["torch_ops_front"] + "."] if data.get("torch_ops_front") else []),
                        table],
                  plot=lambda plt, meta: plot(plt, meta, rows, data["where"]))


def render(payload: dict) -> Result:
    return to_result(payload["rows"], stored_data(payload))


def plot(plt, meta: dict, rows: list[dict], where: str):
    """Host us per call of each op: rtckern.ops, torch's own op and the torch plugin's torch.ops.rtckern."""
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 1.8))
    height = 0.8 / len(SERIES)
    for i, (key, label) in enumerate(SERIES):
        ys = [j + (i - 1.5) * height for j, r in enumerate(rows) if r.get(key) is not None]
        if not ys:  # a series this run has no value of (e.g. torch's under the plugin stub)
            continue
        bars = ax.barh(ys, [r[key] for r in rows if r.get(key) is not None], height=height, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=6, padding=2)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["op"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.margins(x=0.12)
    ax.set_xlabel("host us per call (eager loop, synchronized once at the end)")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(f"host cost per call on {gpu_name(meta)}" + ("" if meta.get("gpu_used", True) else f" ({where})"),
                 fontsize=10)
    fig.tight_layout()
    return fig
