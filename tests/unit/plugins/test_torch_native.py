"""The native front of torch.ops.rtckern (rtckern/plugins/_torch_native.cpp), built with the real C++ compiler
against the installed torch and served at AutogradCPU and CPU (its CUDA keys' stand-ins) for test ops whose
"kernels" are prepared launches of the real native launcher against the fake libcuda: the first call of a signature
is recorded, later ones replayed in C++ (a hook stands in for the driver and computes on the host), and every call
that must not be replayed reaches the Python kernels. The cases run in one subprocess (the fake libcuda and the
registrations are per process)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")

PRELUDE = r"""
import ctypes, json, sys
from typing import Optional
import torch
from torch import Tensor
from rtckern.testing import use_fake_libcuda
FAKE = use_fake_libcuda()
from rtckern import clear_caches, config
from rtckern.runtime import native
from rtckern.errors import UnsupportedRequestError
from rtckern.plugins import _torch_dispatch as TD, _torch_lib as TL, _torch_native as TN

mod = native.module()
assert mod is not None, native.why()
count = {"fn": 0, "replay": 0}


def host_scale(xp, yp, n, s):  # what the "kernel" computes, on host memory
    x = (ctypes.c_float * n).from_address(xp)
    y = (ctypes.c_float * n).from_address(yp)
    for i in range(n):
        y[i] = x[i] * s


def host_add(xp, zp, yp, n):
    x, z, y = ((ctypes.c_float * n).from_address(p) for p in (xp, zp, yp))
    for i in range(n):
        y[i] = x[i] + z[i]


def scale(x: Tensor, s: float) -> Tensor:
    count["fn"] += 1
    y = torch.empty_like(x)
    go = mod.Prepared(0x3000, 0xC0, (1, 1, 1), (32, 1, 1), 0, "PPqf", "scale", False, None)
    go(0, x.data_ptr(), y.data_ptr(), x.numel(), s)
    host_scale(x.data_ptr(), y.data_ptr(), x.numel(), s)
    return y


def add(x: Tensor, z: Tensor) -> Tensor:
    y = torch.empty_like(x)
    go = mod.Prepared(0x3000, 0xC0, (1, 1, 1), (32, 1, 1), 0, "PPPq", "add", False, None)
    go(0, x.data_ptr(), z.data_ptr(), y.data_ptr(), x.numel())
    host_add(x.data_ptr(), z.data_ptr(), y.data_ptr(), x.numel())
    return y


def mapped(x: Tensor) -> Tensor:  # a kernel reading x through a "tensor map" (the fake keeps the address first)
    y = torch.empty_like(x)
    go = mod.Prepared(0x3000, 0xC0, (1, 1, 1), (32, 1, 1), 0, "MPq", "mapped", False, None)
    go(0, x.data_ptr().to_bytes(8, "little") + bytes(range(120)), y.data_ptr(), x.numel())
    host_scale(x.data_ptr(), y.data_ptr(), x.numel(), 1.0)
    return y


def scale_q(x: Tensor, s: float) -> Tensor:  # Kernel.launch's kinds: addresses as Python ints ('q')
    count["fn"] += 1
    y = torch.empty_like(x)
    go = mod.Prepared(0x3000, 0xC0, (1, 1, 1), (32, 1, 1), 0, "qqqf", "scale", False, None)
    go(0, x.data_ptr(), y.data_ptr(), x.numel(), s)
    host_scale(x.data_ptr(), y.data_ptr(), x.numel(), s)
    return y


def interior(x: Tensor) -> Tensor:  # an address inside x, not x's own: not replayable
    y = torch.empty_like(x)
    mod.Prepared(0x3000, 0xC0, (1, 1, 1), (32, 1, 1), 0, "qq", "interior", False, None)(0, x.data_ptr() + 4,
                                                                                         y.data_ptr())
    return y


def via_core(x: Tensor) -> Tensor:  # a launch the recorder cannot see (cuda.core or a packed block)
    y = torch.empty_like(x)
    native.note_unrecorded_launch()
    mod.Prepared(0x3000, 0xC0, (1, 1, 1), (32, 1, 1), 0, "PP", "core", False, None)(0, x.data_ptr(), y.data_ptr())
    return y


def twice(x: Tensor) -> tuple[Tensor, Tensor]:  # one new storage returned twice
    y = torch.empty_like(x)
    mod.Prepared(0x3000, 0xC0, (1, 1, 1), (32, 1, 1), 0, "PP", "twice", False, None)(0, x.data_ptr(), y.data_ptr())
    return y, y


first_time = [True]


def warming(x: Tensor, s: float) -> Tensor:  # its first call runs a torch op (as a first call's probe may)
    if first_time[0]:
        first_time[0] = False
        torch.ones(1)
    return scale(x, s)


def clearing(x: Tensor, s: float) -> Tensor:  # the caches are cleared while the call is being recorded
    clear_caches()
    return scale(x, s)


def copying(x: Tensor) -> Tensor:
    count["fn"] += 1
    y = torch.empty_like(x)
    y.copy_(x)  # a torch op on the way: not a recipe
    mod.Prepared(0x3000, 0xC0, (1, 1, 1), (32, 1, 1), 0, "PP", "copying", False, None)(0, x.data_ptr(), y.data_ptr())
    return y


PERSISTENT = torch.empty(64, dtype=torch.uint8)


def persistent(x: Tensor) -> Tensor:  # a buffer the call did not allocate: not replayable
    y = torch.empty_like(x)
    mod.Prepared(0x3000, 0xC0, (1, 1, 1), (32, 1, 1), 0, "PPP", "persistent", False, None)(
        0, x.data_ptr(), PERSISTENT.data_ptr(), y.data_ptr())
    return y


def host_plus_one(xp, wp, yp, n):  # the "kernel" of workspace(): checks its zeroed workspace, y = x + 1
    x, ws, y = ((ctypes.c_float * n).from_address(p) for p in (xp, wp, yp))
    assert all(v == 0.0 for v in ws), list(ws)
    for i in range(n):
        y[i] = x[i] + 1
        ws[i] = 7.0  # dirty it: the next call's workspace must be zeroed again


def workspace(x: Tensor) -> Tensor:  # a zeroed workspace, addressed 16 bytes in
    y = torch.empty_like(x)
    ws = torch.zeros(x.numel() + 4, dtype=torch.float32)
    mod.Prepared(0x3000, 0xC0, (1, 1, 1), (32, 1, 1), 0, "PqPq", "ws", False, None)(
        0, x.data_ptr(), ws.data_ptr() + 16, y.data_ptr(), x.numel())
    host_plus_one(x.data_ptr(), ws.data_ptr() + 16, y.data_ptr(), x.numel())
    return y


def host_accumulate(xp, yp, n):  # the "kernel" of zeroed_out(): y += 2 x on a y that must have been zeroed
    x, y = ((ctypes.c_float * n).from_address(p) for p in (xp, yp))
    assert all(v == 0.0 for v in y), list(y)
    for i in range(n):
        y[i] += 2 * x[i]


def raising(x: Tensor) -> Tensor:  # refuses every call
    raise ValueError("tn_raising refuses x")


def interrupted(x: Tensor) -> Tensor:
    raise KeyboardInterrupt


def tagged(x: Tensor, tag: str, dtype: Optional[torch.dtype] = None) -> Tensor:  # string and optional arguments
    return scale(x, 2.0 if tag == "two" else 3.0)


def unsupported(x: Tensor) -> Tensor:  # as a torch op's body: torch's implementation where rtckern has none
    def jit(t):
        raise UnsupportedRequestError("tn_unsupported", {"test": ["no kernel serves it"]})
    return TD.run("tn_unsupported", jit, lambda t: t * 2, x)


def failing(x: Tensor) -> Tensor:  # its replayed launch fails (the hook returns an error)
    count["fn"] += 1
    y = torch.empty_like(x)
    mod.Prepared(0x3000, 0xC0, (1, 1, 1), (32, 1, 1), 0, "PPq", "failing", False, None)(
        0, x.data_ptr(), y.data_ptr(), x.numel())
    host_scale(x.data_ptr(), y.data_ptr(), x.numel(), 1.0)
    return y


def zeroed_out(x: Tensor) -> Tensor:  # zeroes its output, then accumulates into it
    y = torch.empty_like(x)
    y.zero_()
    mod.Prepared(0x3000, 0xC0, (1, 1, 1), (32, 1, 1), 0, "PPq", "accum", False, None)(
        0, x.data_ptr(), y.data_ptr(), x.numel())
    host_accumulate(x.data_ptr(), y.data_ptr(), x.numel())
    return y


def pair(x: Tensor, z: Tensor) -> Tensor:  # reads x 16 bytes in: the address of z when z is x[4:]
    count["fn"] += 1
    y = torch.empty_like(z)
    mod.Prepared(0x3000, 0xC0, (1, 1, 1), (32, 1, 1), 0, "qqq", "pair", False, None)(
        0, x.data_ptr() + 16, z.data_ptr(), y.data_ptr())
    return y


def ends(x: Tensor) -> Tensor:  # passes the end of x (a bound): not x's own address
    y = torch.empty_like(x)
    mod.Prepared(0x3000, 0xC0, (1, 1, 1), (32, 1, 1), 0, "qqq", "ends", False, None)(
        0, x.data_ptr(), x.data_ptr() + x.numel() * 4, y.data_ptr())
    return y


def sc(x: Tensor, s: float) -> Tensor:  # one "scale" launch: x * s
    y = torch.empty_like(x)
    mod.Prepared(0x3000, 0xC0, (1, 1, 1), (32, 1, 1), 0, "PPqf", "scale", False, None)(0, x.data_ptr(), y.data_ptr(),
                                                                                       x.numel(), s)
    host_scale(x.data_ptr(), y.data_ptr(), x.numel(), s)
    return y


# ops of rms_norm_fwd / _bwd's and layer_norm_fwd / _bwd's schemas whose "gradients" are constants: y = 2x (dx = 2 dy),
# dweight = 5 dy; layer norm: y = 3x, dweight = 5 dy, dbias = 7 dy; the statistics are copies of x
def rms_fwd(x: Tensor, weight: Optional[Tensor], eps: float, zero_centered: bool, out_dtype: Optional[torch.dtype],
            return_rstd: bool) -> tuple[Tensor, Tensor]:
    count["fn"] += 1
    return sc(x, 2.0), (sc(x, 1.0) if return_rstd else torch.empty(0))


weight_grads = []  # rms_bwd's weight_grad argument, call by call


def rms_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor, zero_centered: bool, weight_grad: bool,
            dresidual: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    count["fn"] += 1
    weight_grads.append(weight_grad)
    assert rstd.numel() == x.numel()  # recomputed where the forward did not return it
    return sc(dy, 2.0), (sc(dy, 5.0) if weight_grad else torch.empty(0))


def ln_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, zero_centered: bool,
           out_dtype: Optional[torch.dtype], return_stats: bool) -> tuple[Tensor, Tensor, Tensor]:
    return sc(x, 3.0), *((sc(x, 1.0), sc(x, 1.0)) if return_stats else (torch.empty(0), torch.empty(0)))


def ln_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor, rstd: Tensor,
           zero_centered: bool, weight_grad: bool, bias_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    return sc(dy, 3.0), (sc(dy, 5.0) if weight_grad else torch.empty(0)), (sc(dy, 7.0) if bias_grad else torch.empty(0))


krms_fwd, krms_bwd = TL.KernelOp("tn_rms_fwd", rms_fwd), TL.KernelOp("tn_rms_bwd", rms_bwd)
kln_fwd, kln_bwd = TL.KernelOp("tn_ln_fwd", ln_fwd), TL.KernelOp("tn_ln_bwd", ln_bwd)


def rms_setup(ctx, inputs, output):  # the Python formulas (what reference_mode and the fallback run)
    ctx.save_for_backward(inputs[0], inputs[1], output[1])
    ctx.set_materialize_grads(False)


def rms_backward(ctx, dy, _drstd):
    x, w, rstd = ctx.saved_tensors
    want_w = w is not None and ctx.needs_input_grad[1]
    if rstd.numel() == 0:
        rstd = krms_fwd(x, w, 1e-6, False, None, True)[1]
    dx, dw = krms_bwd(dy.contiguous(), x, w, rstd, False, want_w, None)
    return dx, (dw if want_w else None), None, None, None, None


def ln_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2], output[1], output[2])
    ctx.set_materialize_grads(False)


def ln_backward(ctx, dy, _dmean, _drstd):
    x, w, b, mean, rstd = ctx.saved_tensors
    want_w, want_b = w is not None and ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2]
    dx, dw, db = kln_bwd(dy.contiguous(), x, w, b, mean, rstd, False, want_w, want_b)
    return dx, (dw if want_w else None), (db if want_b else None), None, None, None, None


krms_fwd.register_autograd(rms_backward, setup_context=rms_setup)
kln_fwd.register_autograd(ln_backward, setup_context=ln_setup)
TN.GRAD_FORMULAS.update(tn_rms_fwd=("rms_norm", "tn_rms_bwd", "tn_rms_fwd"), tn_ln_fwd=("layer_norm", "tn_ln_bwd",
                                                                                        "tn_ln_fwd"),
                        tn_scale=("rms_norm", "tn_rms_bwd", "tn_rms_fwd"),  # tn_scale: not rms_norm_fwd's schema
                        tn_rms=("rms_norm", "tn_rms_bwd", "tn_rms_fwd"))  # a composite of rms_norm's schema


# ops of attention_varlen_fwd / _bwd's schemas: o = 2q, lse a copy of q; dq = 2 dout, dk = 3k, dv = 4v (constants)
varlen_calls = []  # what the backward op got: (max_q, max_k, causal, scale, deterministic, cu_q's last, cu_k's last)
varlen_lse_asked = []  # the forward op's return_lse, call by call


def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool,
               scale_: Optional[float], return_lse: bool) -> tuple[Tensor, Tensor]:
    varlen_lse_asked.append(return_lse)
    return sc(q, 2.0), (sc(q, 1.0) if return_lse else torch.empty(0))


def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_q: Tensor, cu_k: Tensor,
               max_q: int, max_k: int, causal: bool, scale_: Optional[float],
               deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    varlen_calls.append((max_q, max_k, causal, scale_, deterministic, int(cu_q[-1]), int(cu_k[-1])))
    assert lse.numel() == q.numel() and torch.equal(o, q * 2)  # recomputed where the forward did not return them
    return sc(dout, 2.0), sc(k, 3.0), sc(v, 4.0)


kvarlen_fwd, kvarlen_bwd = TL.KernelOp("tn_varlen_fwd", varlen_fwd), TL.KernelOp("tn_varlen_bwd", varlen_bwd)
TN.GRAD_FORMULAS["tn_varlen_fwd"] = ("attention_varlen", "tn_varlen_bwd", "tn_varlen_fwd")
TN.GRAD_FORMULAS["tn_varlen"] = ("attention_varlen", "tn_varlen_bwd", "tn_varlen_fwd")  # the composite's schema
TL.define_composite("tn_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt "
                    "max_seqlen_q, SymInt max_seqlen_k, bool causal=False, float? softmax_scale=None) -> Tensor",
                    lambda q, k, v, cq, ck, mq, mk, c=False, s=None:
                    kvarlen_fwd(q, k, v, cq, ck, mq, mk, c, s, True)[0],
                    lambda q, k, v, cq, ck, mq, mk, c, s: varlen_fwd(q, k, v, cq, ck, mq, mk, c, s, False)[0])


def add_rms_fwd(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, zero_centered: bool,
                out_dtype: Optional[torch.dtype], return_rstd: bool) -> tuple[Tensor, Tensor, Tensor]:
    assert out_dtype is None and return_rstd  # what the composite's node passes (None padded, the rstd asked for)
    return sc(x, 2.0), sc(residual, 1.0), sc(x, 1.0)


kadd_rms_fwd = TL.KernelOp("tn_add_rms_fwd", add_rms_fwd)
TN.GRAD_FORMULAS["tn_add_rms"] = ("fused_add_rms_norm", "tn_rms_bwd", "tn_add_rms_fwd")  # a composite: padded
TL.define_composite("tn_add_rms(Tensor x, Tensor residual, Tensor? weight=None, float eps=1e-06, "
                    "bool zero_centered=False) -> (Tensor, Tensor)",
                    lambda x, r, w=None, eps=1e-6, zc=False: tuple(kadd_rms_fwd(x, r, w, eps, zc, None, True)[:2]),
                    lambda x, r, w, eps, zc: tuple(add_rms_fwd(x, r, w, eps, zc, None, True)[:2]))
TL.define_composite("tn_rms(Tensor x, Tensor? weight=None, float eps=1e-06, bool zero_centered=False, "
                    "ScalarType? out_dtype=None) -> Tensor", lambda x, w=None, eps=1e-6, zc=False, od=None:
                    krms_fwd(x, w, eps, zc, od, True)[0], lambda x, w, eps, zc, od: rms_fwd(x, w, eps, zc, od, False)[0])
kscale = TL.KernelOp("tn_scale", scale)
kscale.register_fake(lambda x, s: torch.empty_like(x))
TL.KernelOp("tn_add", add)
TL.KernelOp("tn_mapped", mapped)
TL.KernelOp("tn_copying", copying)
TL.KernelOp("tn_persistent", persistent)
TL.KernelOp("tn_zeroed_out", zeroed_out)
TL.KernelOp("tn_pair", pair)
TL.KernelOp("tn_failing", failing)
TL.KernelOp("tn_raising", raising)
TL.KernelOp("tn_interrupted", interrupted)
TL.KernelOp("tn_tagged", tagged)
TL.KernelOp("tn_unsupported", unsupported)
TL.KernelOp("tn_ends", ends)
TL.KernelOp("tn_scale_q", scale_q)
TL.KernelOp("tn_interior", interior)
TL.KernelOp("tn_via_core", via_core)
TL.KernelOp("tn_twice", twice)
TL.KernelOp("tn_warming", warming)
TL.KernelOp("tn_clearing", clearing)
TL.KernelOp("tn_workspace", workspace)
TL.define_composite("tn_double(Tensor x) -> Tensor", lambda x: kscale(x, 2.0), lambda x: scale(x, 2.0))

HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))


def on_launch(label, n, params):
    count["replay"] += 1
    word = lambda i, t: ctypes.cast(params[i], ctypes.POINTER(t))[0]
    if label == b"scale":
        host_scale(word(0, ctypes.c_uint64), word(1, ctypes.c_uint64), word(2, ctypes.c_int64), word(3, ctypes.c_float))
    elif label == b"pair":
        pass
    elif label == b"failing":
        return 719  # as the driver after a kernel fault
    elif label == b"accum":
        host_accumulate(word(0, ctypes.c_uint64), word(1, ctypes.c_uint64), word(2, ctypes.c_int64))
    elif label == b"ws":
        host_plus_one(word(0, ctypes.c_uint64), word(1, ctypes.c_uint64), word(2, ctypes.c_uint64),
                      word(3, ctypes.c_int64))
    elif label == b"add":
        host_add(word(0, ctypes.c_uint64), word(1, ctypes.c_uint64), word(2, ctypes.c_uint64), word(3, ctypes.c_int64))
    else:
        assert label == b"mapped", label
        m = ctypes.string_at(params[0], 128)
        assert m[8:] == bytes(range(120)) and params[0] % 64 == 0, m  # the template, its address replaced
        host_scale(int.from_bytes(m[:8], "little"), word(1, ctypes.c_uint64), word(2, ctypes.c_int64), 1.0)
    return 0


hook = HOOK(on_launch)
lib = TN._open(sys.argv[1])
assert lib.rtk_init(FAKE.encode()) == 0
lib.rtk_test_device(ctypes.cast(hook, ctypes.c_void_p))
TN.serve(lib, "CPU")
ops = torch.ops.rtckern


def counts(name):
    return TN.status()["ops"][name]
"""


# The cases run one after another in one subprocess (each starts from no recipes and zeroed counters): one
# interpreter with torch and one native launcher build instead of one per case.
CASES: dict[str, str] = {}


def case(body: str):
    """Register the decorated test's subprocess body under the test's name."""
    def mark(fn):
        assert fn.__name__ not in CASES, fn.__name__
        CASES[fn.__name__] = textwrap.dedent(body)
        return fn
    return mark


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """{case name: "ok" or the traceback} from one subprocess running every case."""
    from rtckern.plugins import _torch_native

    d = tmp_path_factory.mktemp("torch_native")
    so = d / _torch_native.artifact_name()
    _torch_native.build(so)
    prog = [PRELUDE, "import traceback", "outcomes = {}"]
    for name, body in CASES.items():
        prog.append(f"def {name}():\n" + textwrap.indent(body, "    "))
        prog.append(f"clear_caches()\ncount.update(fn=0, replay=0)\ntry:\n    {name}()\n    outcomes[{name!r}] = 'ok'\n"
                    f"except Exception:\n    outcomes[{name!r}] = traceback.format_exc()")
    prog.append("print(json.dumps(outcomes))")
    r = subprocess.run([sys.executable, "-c", "\n".join(prog), str(so)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "RTCKERN_CACHE_DIR": str(d / "cache"), "RTCKERN_TORCH_NATIVE": "0"})
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def check(outcomes, name: str) -> None:
    assert outcomes.get(name) == "ok", outcomes.get(name, "the case did not run")


@case("""
        x = torch.arange(8, dtype=torch.float32)
        with torch.no_grad():
            y1 = ops.tn_scale(x, 3.0)
            assert count == {"fn": 1, "replay": 0}, count
            assert counts("tn_scale") == {"recipes": 1, "refused": 0, "last_refusal": None}
            y2 = ops.tn_scale(x, 3.0)
            y3 = ops.tn_scale.default(x * 1, 3.0)  # another tensor of the same signature
        assert count == {"fn": 1, "replay": 2}, count
        assert torch.equal(y1, x * 3) and torch.equal(y2, x * 3) and torch.equal(y3, x * 3)
        assert y2.data_ptr() != y1.data_ptr() and y2.dtype == x.dtype and y2.stride() == x.stride()
        with torch.no_grad():
            y4 = ops.tn_scale(x, 0.5)  # another scalar: another signature, recorded
            y5 = ops.tn_scale(x.reshape(2, 4), 0.5)  # another shape
        assert count == {"fn": 3, "replay": 2}, count
        assert torch.equal(y4, x * 0.5) and torch.equal(y5, (x * 0.5).reshape(2, 4))
        y6 = ops.tn_scale(x, 3.0)  # grad mode on, nothing requires grad: replayed
        assert count["replay"] == 3 and torch.equal(y6, x * 3)
        y7 = kscale(x, 3.0)  # KernelOp.__call__ (how the backward formulas call their ops) goes through the front
        assert count == {"fn": 3, "replay": 4} and torch.equal(y7, x * 3), count
        xg = x.clone().requires_grad_()
        # a gradient: the autograd.Function in Python, whose forward (grad mode off inside) replays
        assert kscale(xg, 3.0).requires_grad and count == {"fn": 3, "replay": 5}, count
    """)
def test_first_call_records_then_replays_in_cpp(outcomes):
    check(outcomes, "test_first_call_records_then_replays_in_cpp")


@case("""
        from rtckern.torch import reference_mode
        x, w = torch.arange(8, dtype=torch.float32), torch.ones(8)
        grads = []
        for _ in range(2):  # recorded, then replayed: forward and backward
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            y, rstd = ops.tn_rms_fwd(xg, wg, 1e-6, False, None, True)
            assert "RmsNormBackward" in y.grad_fn.name() and rstd.requires_grad, y.grad_fn.name()
            assert torch.equal(y, x * 2)
            y.sum().backward()
            grads.append((xg.grad, wg.grad))
        assert count == {"fn": 2, "replay": 4}, count  # each op recorded once, then its two launches replayed
        assert all(torch.equal(gx, torch.full((8,), 2.0)) and torch.equal(gw, torch.full((8,), 5.0))
                   for gx, gw in grads), grads
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = ops.tn_rms_fwd(xg, wg, 1e-6, False, None, True)[0]
        weight_grads.clear()
        clear_caches()  # (no recipes: each backward call below runs, and records, the Python implementation)
        torch.autograd.grad(y.sum(), [xg], retain_graph=True)  # the engine needs no weight gradient: not asked for
        torch.autograd.grad(y.sum(), [xg, wg])
        assert weight_grads == [False, True], weight_grads
        assert not kscale.native_grad and krms_fwd.native_grad  # a formula whose schema does not fit is refused
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = ops.tn_rms(xg, wg)  # a composite: one node, its forward kernel op asked for the statistics
        assert "RmsNormBackward" in y.grad_fn.name() and torch.equal(y, x * 2), y.grad_fn.name()
        y.sum().backward()
        assert torch.equal(xg.grad, torch.full((8,), 2.0)) and torch.equal(wg.grad, torch.full((8,), 5.0))
        xg, rg = x.clone().requires_grad_(), torch.ones(8, requires_grad=True)
        y, h = ops.tn_add_rms(xg, rg, w)  # fused_add_rms_norm's composite form: out_dtype padded with None
        assert "AddRmsNormBackward" in y.grad_fn.name() and torch.equal(y, x * 2) and torch.equal(h, rg.detach())
        y.sum().backward()  # dx goes to x and to the residual
        assert torch.equal(xg.grad, torch.full((8,), 2.0)) and torch.equal(rg.grad, torch.full((8,), 2.0))
        xg = x.clone().requires_grad_()
        y, _ = krms_fwd(xg, w, 1e-6, False, None, False)  # KernelOp.__call__; no rstd; the weight needs no gradient
        assert "RmsNormBackward" in y.grad_fn.name()
        y.sum().backward()  # the rstd recomputed by the op itself (through the dispatcher), dweight not asked for
        assert torch.equal(xg.grad, torch.full((8,), 2.0)) and w.grad is None
        bg = torch.zeros(8, requires_grad=True)  # layer norm without a weight: the bias's input edge is the second
        xg = x.clone().requires_grad_()
        y, mean, rstd = kln_fwd.call_direct(xg, None, bg, 1e-5, False, None, True)
        assert "LayerNormBackward" in y.grad_fn.name()
        (y * 2).sum().backward()
        assert torch.equal(xg.grad, torch.full((8,), 6.0)) and torch.equal(bg.grad, torch.full((8,), 14.0))
        with reference_mode():  # this thread's calls take the Python kernels: the Python autograd.Function
            xr, br = x.clone().requires_grad_(), torch.zeros(8, requires_grad=True)
            y = kln_fwd.call_direct(xr, None, br, 1e-5, False, None, True)[0]
            assert "LayerNormBackward" not in y.grad_fn.name()
            (y * 2).sum().backward()
        assert torch.equal(xr.grad, xg.grad) and torch.equal(br.grad, bg.grad)
        from torch.utils._python_dispatch import TorchDispatchMode

        class Seen(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))
        with Seen():  # a dispatch mode must see the op: the Python autograd.Function
            y = ops.tn_rms_fwd(x.clone().requires_grad_(), w, 1e-6, False, None, True)[0]
        assert "RmsNormBackward" not in y.grad_fn.name(), y.grad_fn.name()
        from rtckern.testing import python_autograd
        with python_autograd():  # the Python Function on request (KernelOp and torch.ops calls alike), replays kept
            for call in (ops.tn_rms_fwd, krms_fwd):
                y = call(x.clone().requires_grad_(), w, 1e-6, False, None, True)[0]
                assert "RmsNormBackward" not in y.grad_fn.name() and torch.equal(y, x * 2), y.grad_fn.name()
        assert "RmsNormBackward" in ops.tn_rms_fwd(x.clone().requires_grad_(), w, 1e-6, False, None, True)[0] \
            .grad_fn.name()
        xg = x.clone().requires_grad_()
        y = ops.tn_rms_fwd(xg[1:], None, 1e-6, False, None, True)[0]  # misaligned: not replayed, still a C++ node
        assert "RmsNormBackward" in y.grad_fn.name() and torch.equal(y, x[1:] * 2)
        y.sum().backward()
        assert torch.equal(xg.grad, torch.tensor([0.0] + [2.0] * 7)), xg.grad
        with torch.no_grad():
            assert ops.tn_rms_fwd(xg, None, 1e-6, False, None, True)[0].grad_fn is None
    """)
def test_calls_needing_a_gradient_make_a_cpp_autograd_node(outcomes):
    """Ops with a formula in the library (rms_norm_fwd, layer_norm_fwd, fused_add_rms_norm_fwd, attention_fwd; here
    test ops of their schemas) get a C++ autograd node per call needing a gradient: the forward replayed below
    autograd, the backward op called through the dispatcher (replayed too), a statistic the forward did not return
    recomputed, and only the gradients the inputs need (a call the front does not replay runs the op's Python
    implementation inside the node); reference_mode keeps the Python autograd.Function, with the same gradients."""
    check(outcomes, "test_calls_needing_a_gradient_make_a_cpp_autograd_node")


@case("""
        q, k, v = torch.arange(8, dtype=torch.float32), torch.ones(8), torch.full((8,), 2.0)
        cu_q, cu_k = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 5, 7], dtype=torch.int32)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        o, lse = ops.tn_varlen_fwd(qg, kg, vg, cu_q, cu_k, 5, 5, True, 0.5, True)
        assert "AttentionVarlenBackward" in o.grad_fn.name() and torch.equal(o, q * 2), o.grad_fn.name()
        o.sum().backward()
        assert torch.equal(qg.grad, torch.full((8,), 2.0)) and torch.equal(kg.grad, k * 3) and \
            torch.equal(vg.grad, v * 4)
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        o = kvarlen_fwd(qg, kg, v, cu_q, cu_k, 5, 4, False, None, False)[0]  # no lse (recomputed), v frozen
        assert "AttentionVarlenBackward" in o.grad_fn.name()
        torch.use_deterministic_algorithms(True)
        try:
            (o * 3).sum().backward()
        finally:
            torch.use_deterministic_algorithms(False)
        assert torch.equal(qg.grad, torch.full((8,), 6.0)) and torch.equal(kg.grad, k * 3)
        assert varlen_calls == [(5, 5, True, 0.5, False, 8, 7), (5, 4, False, None, True, 8, 7)], varlen_calls
        assert kvarlen_fwd.native_grad
        qg = q.clone().requires_grad_()
        _, lse = ops.tn_varlen_fwd(qg, k, v, cu_q, cu_k, 5, 5, True, None, True)
        lse.sum().backward()  # only the lse used: nothing reaches q (the formula ignores the lse's gradient)
        assert qg.grad is None and len(varlen_calls) == 2, (qg.grad, varlen_calls)
        assert varlen_lse_asked == [True, False, True, True], varlen_lse_asked  # the recompute asked for the lse
        qg, vg = q.clone().requires_grad_(), v.clone().requires_grad_()
        o = ops.tn_varlen(qg, k, vg, cu_q, cu_k, 6, 6, True)  # the composite: one node, its forward op gives the lse
        assert "AttentionVarlenBackward" in o.grad_fn.name() and torch.equal(o, q * 2), o.grad_fn.name()
        o.sum().backward()
        assert torch.equal(qg.grad, torch.full((8,), 2.0)) and torch.equal(vg.grad, v * 4)
        assert varlen_calls[2] == (6, 6, True, None, False, 8, 7), varlen_calls
        assert varlen_lse_asked[4:] == [True], varlen_lse_asked  # asked once, with the lse: no recompute
    """)
def test_variable_length_attention_gets_its_cpp_autograd_node(outcomes):
    """attention_varlen_fwd's formula (here test ops of its and its composite's schemas): one C++ node per call
    needing a gradient, the prefix sums, maximum lengths, causal flag, scale and the deterministic setting handed to
    the backward op, the lse recomputed where the forward did not return it, no backward where only the lse is used,
    and only q, k, v's gradients."""
    check(outcomes, "test_variable_length_attention_gets_its_cpp_autograd_node")


@case("""
        x, z = torch.arange(8, dtype=torch.float32), torch.full((8,), 10.0)
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(ops.tn_add(x, x), x * 2)
                assert torch.equal(ops.tn_add(x, z), x + z)
            assert counts("tn_add")["recipes"] == 2 and count["replay"] == 2, (counts("tn_add"), count)
            x2 = x + 1
            assert torch.equal(ops.tn_add(x2, x2), x2 * 2) and torch.equal(ops.tn_add(z, x2), z + x2)
            assert count["replay"] == 4, count
            ops.tn_mapped(x)
            for t in (x2, z):
                assert torch.equal(ops.tn_mapped(t), t)
        assert counts("tn_mapped")["recipes"] == 1 and count["replay"] == 6, (counts("tn_mapped"), count)
    """)
def test_aliased_arguments_and_tensor_maps(outcomes):
    """Which arguments share an address is part of the key (a call passing one tensor twice has its own recipe); a
    tensor map is replayed from its template with the argument's address put in (cuTensorMapReplaceAddress)."""
    check(outcomes, "test_aliased_arguments_and_tensor_maps")


@case("""
        x = torch.arange(8, dtype=torch.float32)
        with torch.no_grad():
            y1 = ops.tn_scale_q(x, 2.0)
            x2 = x + 100
            y2 = ops.tn_scale_q(x2, 2.0)  # replayed: x2's address and a new output's, not the first call's
        assert count == {"fn": 1, "replay": 1}, count
        assert torch.equal(y2, x2 * 2) and torch.equal(y1, x * 2)
        with torch.no_grad():
            for _ in range(2):
                ops.tn_interior(x)
        c = counts("tn_interior")
        assert (c["recipes"], c["refused"]) == (0, 1) and "inside an input" in c["last_refusal"], c
        x16 = torch.arange(16, dtype=torch.float32)
        with torch.no_grad():
            for _ in range(2):
                ops.tn_ends(x)
            assert torch.equal(ops.tn_scale_q(x16[4:], 2.0), x16[4:] * 2)  # a view inside its storage: its own address
            count.update(fn=0, replay=0)
            ops.tn_pair(x16, x16[4:])  # x + 16 bytes is z's address: z and x share a storage 16 bytes apart
            x2 = x16 + 1
            ops.tn_pair(x2, x2[4:])  # the same layout: replayed (x2 + 16 is z's address again)
            assert count == {"fn": 1, "replay": 1}, count
            ops.tn_pair(x16, x2[4:])  # unrelated tensors: another key, whose x + 16 is no argument's own address
            c = counts("tn_pair")
            assert count == {"fn": 2, "replay": 1} and c["recipes"] == 1 and "inside an input" in c["last_refusal"], c
        e = counts("tn_ends")
        assert e["recipes"] == 0 and "inside an input" in e["last_refusal"], e
""")
def test_addresses_passed_as_int64_are_mapped_or_refused(outcomes):
    """Kernel.launch passes Python ints as 'q': an input's or output's address is mapped like a pointer; one inside
    a storage the call sees refuses the signature."""
    check(outcomes, "test_addresses_passed_as_int64_are_mapped_or_refused")


@case("""
        from rtckern.torch import reference_mode
        x = torch.arange(8, dtype=torch.float32)
        with torch.no_grad():
            for _ in range(2):
                ops.tn_via_core(x)
                ops.tn_twice(x)
            c, t = counts("tn_via_core"), counts("tn_twice")
            assert c["recipes"] == 0 and "cuda.core" in c["last_refusal"], c
            assert t["recipes"] == 0 and "of its own" in t["last_refusal"], t
            ops.tn_warming(x, 2.0)  # refused once (a torch op on the way), then recorded
            assert counts("tn_warming")["refused"] == 1
            ops.tn_warming(x, 2.0)
            w = counts("tn_warming")
            assert w == {"recipes": 1, "refused": 0, "last_refusal": "the call ran aten.ones.default"}, w
            ops.tn_clearing(x, 2.0)  # a clear while recording: nothing is stored
            assert counts("tn_clearing")["recipes"] == 0
            ops.tn_scale(x, 3.0)
            ops.tn_scale(x, 3.0)
            assert count["replay"] == 1
            with reference_mode():  # this thread's calls take the Python kernels
                ops.tn_scale(x, 3.0)
            assert count["replay"] == 1
            ops.tn_scale(x, 3.0)
            assert count["replay"] == 2
""")
def test_untracked_launches_shared_outputs_retries_clears_and_reference_mode(outcomes):
    """A launch that bypasses the recorder, one storage returned twice: refused; a refusal is retried once; a clear
    during a recording drops it; reference_mode bypasses the replay."""
    check(outcomes, "test_untracked_launches_shared_outputs_retries_clears_and_reference_mode")


@case("""
        x = torch.arange(8, dtype=torch.float32)
        with torch.no_grad():
            for i in range(3):  # recorded, then replayed: a new zeroed workspace each call (the kernel dirties it)
                xi = x + i
                assert torch.equal(ops.tn_workspace(xi), xi + 1)
                assert torch.equal(ops.tn_zeroed_out(xi), xi * 2)
        assert counts("tn_workspace")["recipes"] == 1 and counts("tn_zeroed_out")["recipes"] == 1
        assert count["replay"] == 4, count
""")
def test_workspaces_and_zeroed_buffers_are_replayed(outcomes):
    """A workspace the call allocates (addressed at an offset) is allocated per replay; a buffer the call zeroes
    (torch.zeros, zero_) is zeroed per replay, in order with the launches."""
    check(outcomes, "test_workspaces_and_zeroed_buffers_are_replayed")


@case("""
        x = torch.arange(8, dtype=torch.float32)
        with torch.inference_mode():  # no autograd keys: the backend key's kernel records and replays
            assert torch.equal(ops.tn_scale(x, 5.0), x * 5)
            assert torch.equal(ops.tn_scale(x, 5.0), x * 5)
            assert torch.equal(ops.tn_double(x), x * 2)
            assert torch.equal(ops.tn_double(x), x * 2)
            assert count == {"fn": 2, "replay": 2}, count
            xs = torch.arange(9, dtype=torch.float32)[1:]  # misaligned: the op's Python implementation
            assert torch.equal(ops.tn_scale(xs, 5.0), xs * 5) and count == {"fn": 3, "replay": 2}, count
            for _ in range(3):  # refused twice (recorded twice), then its Python implementation through the twin
                ops.tn_copying(x)
            assert counts("tn_copying")["refused"] == 1 and count["fn"] == 6, count
            xs8 = torch.arange(9, dtype=torch.float32)[1:]  # a composite's misaligned call: its own function
            assert torch.equal(ops.tn_double(xs8), xs8 * 2) and count["replay"] == 2, count
""")
def test_inference_mode_calls_are_served_at_the_backend_key(outcomes):
    """Under torch.inference_mode() (serving) the dispatcher skips the autograd keys: the kernel at the backend key
    records and replays, and sends what it does not serve to the op's Python implementation."""
    check(outcomes, "test_inference_mode_calls_are_served_at_the_backend_key")


@case("""
        x = torch.arange(8, dtype=torch.float32)
        with torch.no_grad():
            ops.tn_failing(x)  # recorded
            y = ops.tn_failing(x)  # the replayed launch fails: the Python path runs the call
            assert torch.equal(y, x) and count == {"fn": 2, "replay": 1}, count
            assert counts("tn_failing") == {"recipes": 0, "refused": 1, "last_refusal": None}
            ops.tn_failing(x)  # and serves the signature from then on
            assert count == {"fn": 3, "replay": 1}, count
""")
def test_a_failed_replay_hands_the_call_to_the_python_path(outcomes):
    """A replayed launch that fails (a launch error) drops the recipe and runs the call through the Python path,
    which reports a failure as rtckern's LaunchError rather than a bare RuntimeError."""
    check(outcomes, "test_a_failed_replay_hands_the_call_to_the_python_path")


@case("""
        from torch.utils._python_dispatch import TorchDispatchMode
        x = torch.arange(8, dtype=torch.float32)
        ops.tn_scale(x, 3.0)
        ops.tn_scale(x, 3.0)
        assert count == {"fn": 1, "replay": 1}, count
        # a gradient needed: the Python autograd kernel (an autograd.Function, whose forward replays)
        xg = x.clone().requires_grad_()
        y = ops.tn_scale(xg, 3.0)
        assert count == {"fn": 1, "replay": 2} and y.requires_grad and y.grad_fn is not None, count

        class Seen(TorchDispatchMode):
            names = []
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.names.append(str(func))
                return func(*args, **(kwargs or {}))
        with Seen() as m:  # a dispatch mode sees the op itself, as before; what it calls (the op) replays
            ops.tn_scale(x, 3.0)
        assert m.names == ["rtckern.tn_scale.default"] and count == {"fn": 1, "replay": 3}, (m.names, count)
        xs = torch.arange(9, dtype=torch.float32)[1:]  # 4 bytes off 16: the Python kernels, not recorded
        with torch.no_grad():
            assert torch.equal(ops.tn_scale(xs, 3.0), xs * 3)
        assert count == {"fn": 2, "replay": 3} and counts("tn_scale")["recipes"] == 1, count
        fake = torch._subclasses.fake_tensor.FakeTensorMode()
        with fake:
            assert ops.tn_scale(fake.from_tensor(x), 3.0).shape == x.shape
        assert count == {"fn": 2, "replay": 3}, count
    """)
def test_calls_that_must_not_replay_reach_the_python_kernels(outcomes):
    check(outcomes, "test_calls_that_must_not_replay_reach_the_python_kernels")


@case("""
        x = torch.arange(8, dtype=torch.float32)
        with torch.no_grad():
            for _ in range(2):
                ops.tn_copying(x)
                ops.tn_persistent(x)
        z, w = counts("tn_copying"), counts("tn_persistent")
        assert (z["recipes"], z["refused"]) == (0, 1) and "copy_" in z["last_refusal"], z
        assert (w["recipes"], w["refused"]) == (0, 1) and "no buffer of the call holds" in w["last_refusal"], w
        assert count["replay"] == 0
""")
def test_calls_that_do_more_than_allocate_and_launch_are_refused(outcomes):
    check(outcomes, "test_calls_that_do_more_than_allocate_and_launch_are_refused")


@case("""
        x = torch.arange(8, dtype=torch.float32)
        with torch.no_grad():
            ops.tn_double(x)
            assert torch.equal(ops.tn_double(x), x * 2)
        assert count == {"fn": 1, "replay": 1} and counts("tn_double")["recipes"] == 1, count
        assert len(TN._held) == 1
        clear_caches()  # as a settings change or set_manager: the recipes go with the plans
        assert counts("tn_double")["recipes"] == 0 and not TN._held
        with torch.no_grad():
            ops.tn_double(x)
            ops.tn_double(x)
        assert count == {"fn": 2, "replay": 2}, count
        with config.override(strict=True):
            assert counts("tn_double")["recipes"] == 0
        # dynamo traces a KernelOp call (the front's routing must not run under it): fullgraph, grad mode on
        compiled = torch.compile(lambda t: kscale(t, 2.0), backend="eager", fullgraph=True)
        assert torch.equal(compiled(x), x * 2)
    """)
def test_composites_and_clear_caches(outcomes):
    check(outcomes, "test_composites_and_clear_caches")


@case("""
        from rtckern import InputError
        from rtckern.ops import softmax
        from rtckern.runtime.native import direct_front
        from rtckern.torch import reference_mode
        direct = direct_front.call  # installed by serve(): the op layer's functions are bound to their torch ops
        assert direct is not None
        assert lib.rtk_direct_bind(63, b"rtckern::tn_scale") == 0
        assert lib.rtk_direct_bind(64, b"rtckern::tn_scale") == -2 and lib.rtk_direct_bind(62, b"rtckern::nope") == -1
        assert lib.rtk_direct_bind(61, b"aten::broadcast_tensors") == -3  # a list argument and result
        assert lib.rtk_direct_bind(61, b"rtckern::tn_varlen") == 0  # SymInt arguments: Python ints
        assert lib.rtk_direct_bind(63, b"rtckern::tn_add") == -4 and lib.rtk_direct_bind(63, b"rtckern::tn_scale") == 0
        x = torch.arange(8, dtype=torch.float32)
        y1 = direct(63, x, 3.0)  # not learned yet: called through the dispatcher, which records it
        assert count == {"fn": 1, "replay": 0} and counts("tn_scale")["recipes"] == 1, count
        y2 = direct(63, x * 1, 3)  # an int for the float argument: the same key, replayed in C++
        assert count == {"fn": 1, "replay": 1}, count
        assert torch.equal(y1, x * 3) and torch.equal(y2, x * 3) and y2.data_ptr() != y1.data_ptr()
        # not served here (None: the function's Python path runs): not a tensor, not the schema's kinds, the wrong
        # number of arguments, an unbound slot, a gradient needed, an address off 16 bytes, reference_mode
        class Sub(torch.Tensor):  # may override what the Python path calls
            pass

        class Mode(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        nested = torch.nested.nested_tensor([torch.ones(8), torch.ones(3)])  # (its sizes() throws in C++)
        for args in ((63, x.numpy(), 3.0), (63, x, "3"), (63, x, True), (63, x), (63, x, 3.0, 1), (60, x, 3.0),
                     ("63", x, 3.0), (63, x.clone().requires_grad_(), 3.0), (63, torch.zeros(9)[1:], 3.0),
                     (63, x.as_subclass(Sub), 3.0), (63, nested, 3.0)):
            assert direct(*args) is None, args
        with reference_mode():
            assert direct(63, x, 3.0) is None
        with Mode():
            assert direct(63, x, 3.0) is None

        def traced(t):  # torch.jit.trace records the op only through the dispatcher: the entry stays out of it
            assert direct(63, t, 3.0) is None
            return t + 1

        with torch.no_grad():
            torch.jit.trace(traced, x, check_trace=False)  # (the check reruns it untraced)
        assert count == {"fn": 1, "replay": 1}, count
        assert torch.equal(direct(63, torch.nn.Parameter(x, requires_grad=False), 3.0), x * 3)  # a Parameter: served
        assert count == {"fn": 1, "replay": 2}, count
        # a refused key: recorded twice through the dispatcher, then left to the Python path
        assert lib.rtk_direct_bind(59, b"rtckern::tn_via_core") == 0
        assert direct(59, x) is not None and direct(59, x) is not None and direct(59, x) is None
        assert counts("tn_via_core")["refused"] == 1
        # a replay that fails to launch: the key is refused, the call left to the Python path
        assert lib.rtk_direct_bind(58, b"rtckern::tn_failing") == 0
        assert direct(58, x) is not None and direct(58, x) is None and counts("tn_failing")["refused"] == 1
        # an error on the way is the Python path's to raise (the function runs it after None), as it always has
        assert lib.rtk_direct_bind(57, b"rtckern::tn_raising") == 0
        assert direct(57, x) is None
        # an unsupported request raises (None: the function raises it), where torch.ops falls back to torch's result
        assert lib.rtk_direct_bind(56, b"rtckern::tn_unsupported") == 0
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert [direct(56, x) for _ in range(3)] == [None] * 3 and not caught, caught
            assert torch.equal(ops.tn_unsupported(x), x * 2)
        # KeyboardInterrupt (a BaseException) propagates
        assert lib.rtk_direct_bind(55, b"rtckern::tn_interrupted") == 0
        try:
            direct(55, x)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("KeyboardInterrupt was swallowed")
        assert lib.rtk_direct_dispatching() == 0  # (the fallback to torch is back on in this thread)
        # a string and an optional argument (passed as None only)
        assert lib.rtk_direct_bind(54, b"rtckern::tn_tagged") == 0
        fn = count["fn"]
        assert torch.equal(direct(54, x, "two", None), x * 2) and torch.equal(direct(54, x, "two", None), x * 2)
        assert torch.equal(direct(54, x, "three", None), x * 3) and count["fn"] == fn + 2  # one recording each

        class Str(str):
            pass

        for args in ((54, x, Str("two"), None), (54, x, "two", torch.float32), (54, x, b"two", None),
                     (54, x, chr(0xD800), None)):  # a subclass, a value for the optional, bytes, a lone surrogate
            assert direct(*args) is None, args
        try:
            softmax(x, 1.0)  # (its slot is unbound in this process: no family's ops are registered)
        except InputError as e:
            assert "move it to the GPU" in str(e), e
        else:
            raise AssertionError("no InputError")
    """)
def test_the_op_layer_functions_call_the_front_directly(outcomes):
    check(outcomes, "test_the_op_layer_functions_call_the_front_directly")


def test_activate_follows_the_setting(tmp_path):
    """RTCKERN_TORCH_NATIVE=0 never loads it; a CPU build of torch under auto neither builds nor loads it."""
    prog = textwrap.dedent("""
        import rtckern.torch as rt
        s = rt.native_status()
        print(s["active"], s["why_not"])
    """)
    import torch

    cases = [("0", "False RTCKERN_TORCH_NATIVE=0")]
    if torch.version.cuda is None:  # (a CUDA build of torch would start the background build under auto)
        cases.append(("auto", "False a torch build without CUDA"))
    for value, want in cases:
        r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "RTCKERN_CACHE_DIR": str(tmp_path / "c"),
                                "RTCKERN_TORCH_NATIVE": value})
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == want
    assert not (tmp_path / "c" / "torch_native").exists()
