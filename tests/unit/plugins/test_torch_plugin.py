"""The PyTorch plugin without a GPU: registration, schemas, fake-tensor shape inference (FakeTensorMode with CUDA
fake tensors, torch.export, torch.compile), error messages for bad inputs, autograd wiring and opcheck through the
torch reference kernels (reference_mode), the fallback/strict policy, the CUDA-graph capture guard, drop-in
modules, patch(), and the transformers attention function (when transformers is installed).
"""
from __future__ import annotations

import contextlib
import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import rtckern.torch as rt  # noqa: E402
from rtckern import config  # noqa: E402
from rtckern.device import DeviceInfo  # noqa: E402
from rtckern.errors import InputError, UnsupportedRequestError  # noqa: E402
from rtckern.plugins import _torch_dispatch as D  # noqa: E402
from rtckern.plugins import _torch_hf as HF  # noqa: E402
from rtckern.plugins import _torch_modules as M  # noqa: E402
from rtckern.testing import torch_reference as R  # noqa: E402
from rtckern.registry import OpRequest, default_registry  # noqa: E402

ops = torch.ops.rtckern
BF16, F32 = torch.bfloat16, torch.float32


pytestmark = pytest.mark.usefixtures("fresh_warnings")


def rand(*shape, dtype=F32, device="cpu", requires_grad=False):
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(requires_grad)


# ---- registration -----------------------------------------------------------------------------------------------
EXPECTED = ["rms_norm", "rms_norm_fwd", "rms_norm_bwd", "fused_add_rms_norm", "fused_add_rms_norm_fwd",
            "layer_norm", "layer_norm_fwd", "layer_norm_bwd", "softmax", "softmax_bwd", "scaled_masked_softmax",
            "scaled_masked_softmax_bwd", "scaled_upper_triang_masked_softmax",
            "scaled_upper_triang_masked_softmax_bwd", "scaled_aligned_causal_masked_softmax",
            "scaled_aligned_causal_masked_softmax_bwd", "attention", "attention_fwd", "attention_bwd", "attention_varlen",
            "attention_varlen_fwd", "attention_varlen_bwd", "attention_with_kvcache", "gemm", "gemm_fp8",
            "quantize_fp8", "rms_norm_quant", "grouped_gemm", "grouped_gemm_masked", "grouped_gemm_fp8",
            "grouped_gemm_fp8_masked", "rope", "rope_bwd", "swiglu",
            "swiglu_bwd", "cross_entropy", "cross_entropy_fwd", "cross_entropy_bwd"]
# ops that write some of their arguments in place (the schema's `Tensor(a!)`), and which
WRITES = {"attention_with_kvcache": ["k_cache", "v_cache"]}  # the append of k_new / v_new into the caches


def test_every_op_is_registered_under_the_rtckern_namespace():
    assert rt.skipped_ops == {}
    assert sorted(rt.registered_ops) == sorted(EXPECTED)
    for name in EXPECTED:
        schema = getattr(ops, name).default._schema
        assert schema.name == f"rtckern::{name}"
        written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        assert written == WRITES.get(name, []), f"{name} writes {written}"


def _signature(name):
    schema = getattr(ops, name).default._schema
    return [(a.name, str(a.type), a.default_value) for a in schema.arguments], [str(r.type) for r in schema.returns]


def test_public_schemas():
    assert _signature("rms_norm") == ([("x", "Tensor", None), ("weight", "Optional[Tensor]", None),
                                       ("eps", "float", pytest.approx(1e-6)), ("zero_centered", "bool", False),
                                       ("out_dtype", "Optional[int]", None)], ["Tensor"])
    assert _signature("attention") == ([("q", "Tensor", None), ("k", "Tensor", None), ("v", "Tensor", None),
                                        ("causal", "bool", False), ("softmax_scale", "Optional[float]", None)],
                                       ["Tensor"])
    args, rets = _signature("gemm")
    assert [a[0] for a in args] == ["a", "b", "bias", "activation", "trans_b", "out_dtype", "residual"]
    assert rets == ["Tensor"]
    assert _signature("softmax") == ([("x", "Tensor", None), ("scale", "float", 1.0)], ["Tensor"])
    assert _signature("fused_add_rms_norm")[1] == ["Tensor", "Tensor"]


def test_composite_ops_decompose_and_kernel_ops_have_autograd():
    composite = torch._C.DispatchKey.CompositeImplicitAutograd
    for name in ("rms_norm", "fused_add_rms_norm", "layer_norm", "attention"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"rtckern::{name}", composite), name
    for name in ("rms_norm_fwd", "fused_add_rms_norm_fwd", "layer_norm_fwd", "softmax", "scaled_masked_softmax",
                 "scaled_upper_triang_masked_softmax", "scaled_aligned_causal_masked_softmax", "attention_fwd",
                 "gemm"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"rtckern::{name}", "Autograd"), name


def test_import_alias_is_the_plugin():
    import rtckern.plugins.torch as plugin

    assert rt.RMSNorm is plugin.RMSNorm and rt.patch is plugin.patch
    assert set(rt.__all__) <= set(dir(rt))


def test_import_does_not_load_dynamo():
    """`import rtckern.torch` costs about what `import torch` does: torch._dynamo (seconds) loads only when
    something compiles."""
    import subprocess
    import sys

    code = ("import sys, rtckern.torch; heavy = [m for m in ('torch._dynamo', 'torch._inductor', 'transformers') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_strict_flag_is_marked_constant_as_torch_would():
    """_torch_dispatch marks _strict_at_trace_time by hand (the decorator imports dynamo): the same as torch's."""
    def probe():
        return True

    before = set(vars(probe))
    torch.compiler.assume_constant_result(probe)
    assert {k: vars(probe)[k] for k in set(vars(probe)) - before} == {"_dynamo_marked_constant": True}
    assert D._strict_at_trace_time._dynamo_marked_constant is True


def test_a_missing_op_module_is_skipped_with_a_reason(monkeypatch, caplog):
    import rtckern.plugins.torch as plugin

    monkeypatch.setattr(plugin, "skipped_ops", {})
    plugin._register_family("flux", "rtckern.ops.flux_capacitor", "rtckern.plugins._torch_flux")
    assert "rtckern.ops.flux_capacitor is not present" in plugin.skipped_ops["flux"]
    assert "flux_capacitor" in caplog.text


# ---- fake tensors: shape and dtype inference ---------------------------------------------------------------------
def _fake_cuda(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def test_fake_shapes_norms():
    with FakeTensorMode():
        x, w = _fake_cuda(2, 7, 4096), _fake_cuda(4096, dtype=F32)
        y = ops.rms_norm(x, w, 1e-6)
        assert (y.shape, y.dtype, y.device.type) == ((2, 7, 4096), BF16, "cuda")
        assert ops.rms_norm(x, w, 1e-6, False, F32).dtype == F32
        y, rstd = ops.rms_norm_fwd(x, w, 1e-6, False, None, True)
        assert rstd.shape == (2, 7) and rstd.dtype == F32
        assert ops.rms_norm_fwd(x, w, 1e-6, False, None, False)[1].shape == (0,)
        y, h = ops.fused_add_rms_norm(x, _fake_cuda(2, 7, 4096), w)
        assert y.shape == h.shape == (2, 7, 4096) and h.dtype == BF16
        y, mean, rstd = ops.layer_norm_fwd(x, w, w, 1e-5, False, None, True)
        assert mean.shape == rstd.shape == (2, 7)
        dx, dw, db = ops.layer_norm_bwd(x, x, w, w, mean, rstd, False, True, False)
        assert dx.shape == x.shape and dx.dtype == BF16 and dw.shape == (4096,) and dw.dtype == F32
        assert db.shape == (0,)


def test_fake_shapes_softmax_attention_gemm():
    with FakeTensorMode():
        s = _fake_cuda(2, 4, 100, 120)
        assert ops.softmax(s, 0.5).shape == s.shape
        assert ops.scaled_masked_softmax(s, _fake_cuda(1, 1, 100, 120, dtype=torch.bool), 0.5).shape == s.shape
        assert ops.scaled_aligned_causal_masked_softmax(s, 1.0).shape == s.shape
        assert ops.softmax_bwd(s, s, 1.0).shape == s.shape
        q, k = _fake_cuda(2, 100, 8, 128), _fake_cuda(2, 300, 2, 128)
        o = ops.attention(q, k, k, True)
        assert (o.shape, o.dtype) == ((2, 100, 8, 128), BF16)
        o, lse = ops.attention_fwd(q, k, k, False, None, True)
        assert lse.shape == (2, 8, 100) and lse.dtype == F32
        dq, dk, dv = ops.attention_bwd(o, q, k, k, o, lse, False, None)
        assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
        a, wt = _fake_cuda(3, 17, 64), _fake_cuda(96, 64)
        assert ops.gemm(a, wt, None, "silu", True).shape == (3, 17, 96)
        assert ops.gemm(_fake_cuda(17, 64), _fake_cuda(64, 96), out_dtype=F32).dtype == F32


def test_fake_shapes_with_symbolic_sizes_under_export():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = rt.RMSNorm(64, eps=1e-6)
            self.w = nn.Parameter(torch.randn(64, 64, dtype=BF16))

        def forward(self, x):
            h = ops.rms_norm(x, self.norm.weight, 1e-6)
            q = ops.gemm(h, self.w, trans_b=True).view(x.shape[0], x.shape[1], 4, 16)
            return ops.attention(q, q, q, True)

    x = torch.randn(2, 32, 64, dtype=BF16)
    ep = torch.export.export(Block(), (x,), dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert {"rtckern.rms_norm.default", "rtckern.gemm.default", "rtckern.attention.default"} <= set(targets)
    out = [n for n in ep.graph.nodes if n.op == "output"][0].args[0][0].meta["val"]
    assert out.dtype == BF16 and tuple(out.shape[1:]) == (32, 4, 16)
    assert not isinstance(out.shape[0], int)  # the batch stayed symbolic: no specialization in the fake kernels
    # decomposed, the composites become the kernel-carrying custom ops
    targets = {str(n.target) for n in ep.run_decompositions().graph.nodes if n.op == "call_function"}
    assert {"rtckern.rms_norm_fwd.default", "rtckern.gemm.default", "rtckern.attention_fwd.default"} <= targets


# ---- bad inputs ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, match", [
    (lambda: ops.rms_norm(_fake_cuda(4, 64), _fake_cuda(32)), r"weight has shape \(32,\); it must be \(64,\)"),
    (lambda: ops.rms_norm(_fake_cuda(4, 64, dtype=torch.int32)), r"x has dtype int32; supported: float32"),
    (lambda: ops.layer_norm(_fake_cuda(4, 64), None, _fake_cuda(8)), r"bias has shape \(8,\)"),
    (lambda: ops.fused_add_rms_norm(_fake_cuda(4, 64), _fake_cuda(4, 32)), r"residual has shape \(4, 32\)"),
    (lambda: ops.attention(_fake_cuda(2, 8, 6, 64), _fake_cuda(2, 8, 4, 64), _fake_cuda(2, 8, 4, 64)),
     r"heads_q=6 is not a multiple of heads_kv=4"),
    (lambda: ops.attention(_fake_cuda(2, 8, 64), _fake_cuda(2, 8, 4, 64), _fake_cuda(2, 8, 4, 64)),
     r"q has shape \(2, 8, 64\) \(3 dims\)"),
    (lambda: ops.attention(_fake_cuda(1, 8, 4, 64, dtype=F32), _fake_cuda(1, 8, 4, 64, dtype=F32),
                           _fake_cuda(1, 8, 4, 64, dtype=F32)), r"q has dtype float32; supported: bf16, fp16"),
    (lambda: ops.gemm(_fake_cuda(16, 64), _fake_cuda(32, 64)), r"inner dimensions disagree.*pass trans_b=True"),
    (lambda: ops.gemm(_fake_cuda(16, 64), _fake_cuda(64, 8), activation="gelu"), r"activation='gelu'"),
    (lambda: ops.scaled_masked_softmax(_fake_cuda(2, 4, 8, 8), _fake_cuda(2, 4, 8, 8, dtype=torch.bool)),
     r"mask has shape \(2, 4, 8, 8\); .* must be \(2, 1, 8, 8\) or \(1, 1, 8, 8\)"),
    (lambda: ops.scaled_masked_softmax(_fake_cuda(2, 4, 8, 8), _fake_cuda(2, 1, 8, 8)), r"it must be bool"),
    (lambda: ops.scaled_upper_triang_masked_softmax(_fake_cuda(2, 8, 9)), r"square score matrices"),
])
def test_bad_inputs_are_refused_at_trace_time(call, match):
    with FakeTensorMode(), pytest.raises(InputError, match=match):
        call()


@pytest.mark.parametrize("call, match", [
    (lambda: ops.rms_norm(rand(4, 64), rand(64)), r"x is on cpu, in host memory.*x\.cuda\(\)"),
    (lambda: ops.layer_norm(rand(4, 64)), r"x is on cpu, in host memory"),
    (lambda: ops.softmax(rand(4, 64)), r"x is on cpu, in host memory.*\.cuda\(\)"),
    (lambda: ops.attention(rand(1, 8, 2, 64, dtype=BF16), rand(1, 8, 2, 64, dtype=BF16),
                           rand(1, 8, 2, 64, dtype=BF16)), r"q is on cpu, in host memory"),
    (lambda: ops.gemm(rand(8, 64, dtype=BF16), rand(64, 8, dtype=BF16)), r"a is on cpu, in host memory"),
])
def test_bad_inputs_are_refused_by_the_kernels_with_the_ops_message(call, match):
    with pytest.raises(InputError, match=match):
        call()


# ---- autograd and opcheck through the reference kernels ------------------------------------------------------------
def _rms(x, w, eps, zc=False):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * ((w.float() + 1) if zc else w.float()))


def _grads(y, inputs, g):
    return torch.autograd.grad(y, [t for t in inputs if t.requires_grad], g)


def _assert_close_grads(got, want, tol=1e-4):
    for a, b in zip(got, want):
        assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol), (a - b).abs().max()


def test_inference_mode_records_no_graph_even_under_enable_grad():
    """Inference mode drops the autograd keys whatever grad mode says: inside it, with enable_grad and inputs that
    require grad, the ops' eager paths return plain results as the dispatcher (and F.rms_norm) do, rather than
    recording a backward that saves inference tensors (which raised)."""
    x, w = rand(3, 5, 64, requires_grad=True), rand(64, requires_grad=True)
    with torch.inference_mode(), torch.enable_grad(), D.reference_mode():
        for y in (ops.rms_norm(x, w, 1e-6), rt.rms_norm(x, w, 1e-6), ops.layer_norm(x, w, w, 1e-6),
                  ops.rms_norm_fwd(x, w, 1e-6, False, None, True)[0]):
            assert not y.requires_grad and y.grad_fn is None
    assert torch.allclose(y, _rms(x, w, 1e-6, False).detach(), atol=1e-5)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_autograd_matches_torch(zero_centered):
    x, w = rand(3, 5, 64, requires_grad=True), rand(64, requires_grad=True)
    with D.reference_mode():
        y = ops.rms_norm(x, w, 1e-6, zero_centered)
    ref = _rms(x, w, 1e-6, zero_centered)
    g = torch.randn_like(ref)
    assert torch.allclose(y, ref, atol=1e-5)
    with D.reference_mode():
        got = _grads(y, (x, w), g)
    _assert_close_grads(got, _grads(ref, (x, w), g))


def test_fused_add_rms_norm_autograd_matches_torch():
    x, r, w = rand(4, 64, requires_grad=True), rand(4, 64, requires_grad=True), rand(64, requires_grad=True)
    with D.reference_mode():
        y, h = ops.fused_add_rms_norm(x, r, w, 1e-6)
        gy, gh = torch.randn_like(y), torch.randn_like(h)
        got = torch.autograd.grad((y, h), (x, r, w), (gy, gh))
    h2 = x + r
    want = torch.autograd.grad((_rms(h2, w, 1e-6), h2), (x, r, w), (gy, gh))
    _assert_close_grads(got, want)


def test_layer_norm_autograd_matches_torch():
    x, w, b = rand(6, 48, requires_grad=True), rand(48, requires_grad=True), rand(48, requires_grad=True)
    with D.reference_mode():
        y = ops.layer_norm(x, w, b, 1e-5)
        g = torch.randn_like(y)
        got = torch.autograd.grad(y, (x, w, b), g)
    ref = torch.nn.functional.layer_norm(x, (48,), w, b, 1e-5)
    assert torch.allclose(y, ref, atol=1e-5)
    _assert_close_grads(got, torch.autograd.grad(ref, (x, w, b), g))


def _softmax_ref(name, x, scale, mask=None):
    s = x * scale
    sq, sk = x.shape[-2], x.shape[-1]
    if name == "scaled_masked_softmax":
        s = s.masked_fill(mask, float("-inf"))
    elif name != "softmax":
        keep = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0)


@pytest.mark.parametrize("name", ["softmax", "scaled_masked_softmax", "scaled_upper_triang_masked_softmax",
                                  "scaled_aligned_causal_masked_softmax"])
def test_softmax_autograd_matches_torch(name):
    shape = (2, 3, 6, 6) if name != "scaled_aligned_causal_masked_softmax" else (2, 3, 5, 9)
    x = rand(*shape, requires_grad=True)
    args = [x]
    mask = None
    if name == "scaled_masked_softmax":
        mask = torch.rand(2, 1, *shape[2:]) < 0.3
        mask[0, 0, 1] = True  # a fully masked row gives zeros
        args.append(mask)
    with D.reference_mode():
        y = getattr(ops, name)(*args, 0.7)
        g = torch.randn_like(y)
        (got,) = torch.autograd.grad(y, x, g)
    ref = _softmax_ref(name, x, 0.7, mask)
    assert torch.allclose(y, ref, atol=1e-6)
    (want,) = torch.autograd.grad(ref, x, g)
    assert torch.allclose(got, want, atol=1e-5)
    if mask is not None:
        assert (y[0, :, 1] == 0).all() and (got[0, :, 1] == 0).all()


@pytest.mark.parametrize("causal, sq, sk, hq, hk", [(False, 7, 11, 4, 2), (True, 9, 9, 4, 1), (True, 5, 12, 2, 2),
                                                    (True, 12, 5, 2, 1)])
def test_attention_autograd_matches_sdpa_math(causal, sq, sk, hq, hk):
    q = rand(2, sq, hq, 32, requires_grad=True)
    k, v = rand(2, sk, hk, 32, requires_grad=True), rand(2, sk, hk, 32, requires_grad=True)
    with D.reference_mode():
        o = ops.attention(q, k, v, causal, 0.3)
        g = torch.randn_like(o)
        got = torch.autograd.grad(o, (q, k, v), g)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kt, vt = kt.repeat_interleave(hq // hk, 1), vt.repeat_interleave(hq // hk, 1)
    mask = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq) if causal else None
    s = (qt @ kt.transpose(-1, -2)) * 0.3
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    ref = (torch.softmax(s, -1).nan_to_num(0.0) @ vt).transpose(1, 2)
    assert torch.allclose(o, ref, atol=1e-5)
    _assert_close_grads(got, torch.autograd.grad(ref, (q, k, v), g))


@pytest.mark.parametrize("act", [None, "gelu_tanh", "silu"])
@pytest.mark.parametrize("layout", ["nn", "nt", "batched_shared_b", "batched_b"])
def test_gemm_autograd_matches_torch(act, layout):
    m, n, k = 12, 10, 8
    if layout == "nn":
        a, b, trans_b, bias_shape, res_shape = rand(m, k), rand(k, n), False, (n,), (m, n)
    elif layout == "nt":
        a, b, trans_b, bias_shape, res_shape = rand(m, k), rand(n, k), True, (n,), (m, n)
    elif layout == "batched_shared_b":
        a, b, trans_b, bias_shape, res_shape = rand(3, m, k), rand(n, k), True, (n,), (m, n)
    else:
        a, b, trans_b, bias_shape, res_shape = rand(3, m, k), rand(3, k, n), False, (n,), (3, m, n)
    a.requires_grad_(True)
    b.requires_grad_(True)
    bias, res = rand(*bias_shape, requires_grad=True), rand(*res_shape, requires_grad=True)
    with D.reference_mode():
        y = ops.gemm(a, b, bias, act, trans_b, None, res)
        g = torch.randn_like(y)
        got = torch.autograd.grad(y, (a, b, bias, res), g)
    ref = R.activation(a @ (b.transpose(-1, -2) if trans_b else b) + bias, act) + res
    assert torch.allclose(y, ref, atol=1e-5)
    _assert_close_grads(got, torch.autograd.grad(ref, (a, b, bias, res), g), tol=1e-4)


def _attention_bwd_args(q, kv):
    with D.reference_mode():
        o, lse = ops.attention_fwd(q.detach(), kv.detach(), kv.detach(), True, 0.3, True)
    return (torch.randn_like(o), q.detach(), kv.detach(), kv.detach(), o, lse, True, 0.3, True)


def _opcheck_cases():
    x, w, b, r = rand(4, 32, requires_grad=True), rand(32, requires_grad=True), rand(32, requires_grad=True), \
        rand(4, 32, requires_grad=True)
    s = rand(2, 2, 5, 5, requires_grad=True)
    mask = torch.rand(2, 1, 5, 5) < 0.3
    q, kv = rand(1, 6, 4, 16, dtype=BF16, requires_grad=True), rand(1, 6, 2, 16, dtype=BF16, requires_grad=True)
    a, bt = rand(2, 6, 8, dtype=BF16, requires_grad=True), rand(4, 8, dtype=BF16, requires_grad=True)
    rstd = torch.rand(4) + 0.5
    return {
        "rms_norm": (x, w), "rms_norm_fwd": (x, w, 1e-6, False, None, True),
        "rms_norm_bwd": (r.detach(), x.detach(), w.detach(), rstd, False, True, None),
        "fused_add_rms_norm": (x, r, w), "fused_add_rms_norm_fwd": (x, r, w, 1e-6, True, None, True),
        "layer_norm": (x, w, b), "layer_norm_fwd": (x, w, b, 1e-5, False, None, True),
        "layer_norm_bwd": (r.detach(), x.detach(), w.detach(), b.detach(), torch.randn(4), rstd, False, True, True),
        "softmax": (s, 0.5), "softmax_bwd": (s.detach(), s.detach(), 0.5), "scaled_masked_softmax": (s, mask, 2.0),
        "scaled_upper_triang_masked_softmax": (s, 1.0), "scaled_aligned_causal_masked_softmax": (s, 1.0),
        "attention": (q, kv, kv, True), "attention_fwd": (q, kv, kv, False, 0.2, True),
        "attention_bwd": _attention_bwd_args(q, kv),
        "gemm": (a, bt, rand(4, dtype=BF16, requires_grad=True), "silu", True),
    }


@pytest.mark.parametrize("name", sorted(_opcheck_cases()))
def test_opcheck_through_the_reference_kernels(name):
    args = _opcheck_cases()[name]
    with D.reference_mode():
        torch.library.opcheck(getattr(ops, name).default, args)


def _block(x, w, wq, mask):
    h = ops.rms_norm(x, w, 1e-6)
    y, h2 = ops.fused_add_rms_norm(h, x, w, 1e-6)
    q = ops.gemm(y, wq, None, "gelu_tanh", True).view(x.shape[0], x.shape[1], 2, 16)
    o = ops.attention(q, q, q, True, None).reshape(x.shape)
    s = ops.scaled_masked_softmax(o.view(x.shape[0], 1, x.shape[1], -1)[..., : x.shape[1]], mask, 0.5)
    return ops.layer_norm(o + h2, w, None, 1e-5).sum() + ops.softmax(s, 2.0).sum()


def test_compile_fullgraph_no_graph_breaks_forward_and_backward():
    from torch._dynamo.testing import CompileCounterWithBackend

    x = rand(2, 8, 32, dtype=BF16, requires_grad=True)
    w = rand(32, dtype=BF16, requires_grad=True)
    wq = rand(32, 32, dtype=BF16, requires_grad=True)
    mask = torch.rand(2, 1, 8, 8) < 0.2
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(_block, backend=counter, fullgraph=True)
    with D.reference_mode():
        loss = fn(x, w, wq, mask)
        got = torch.autograd.grad(loss, (x, w, wq))
        ref = _block(x, w, wq, mask)
        want = torch.autograd.grad(ref, (x, w, wq))
    assert counter.frame_count == 1
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {f"rtckern.{name}" for name in ("rms_norm", "fused_add_rms_norm", "gemm", "attention",
                                           "scaled_masked_softmax", "layer_norm", "softmax")} <= targets
    assert torch.allclose(loss.float(), ref.float(), rtol=1e-3)
    _assert_close_grads(got, want, tol=2e-2)


# ---- eager fast path ---------------------------------------------------------------------------------------------
def test_plain_eager_only_outside_tracing_and_modes():
    x = rand(2, 8)
    assert rt.plain_eager(x, None, nn.Parameter(rand(8)))
    with FakeTensorMode() as mode:
        assert not rt.plain_eager(mode.from_tensor(x))
    with torch.device("cpu"):  # a torch-function mode
        assert not rt.plain_eager(x)
    assert not torch.func.vmap(lambda t: torch.tensor(float(rt.plain_eager(t))))(x).any()
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def traced(t):
        seen.append(rt.plain_eager(t))
        return t + 1

    traced(x)
    assert seen == [False]


@pytest.mark.parametrize("grad", [True, False])
def test_functional_entry_points_equal_the_ops(grad):
    x, w, b = rand(3, 40, requires_grad=grad), rand(40, requires_grad=grad), rand(40, requires_grad=grad)
    q, k = rand(2, 9, 4, 16, dtype=BF16, requires_grad=grad), rand(2, 9, 2, 16, dtype=BF16, requires_grad=grad)
    with D.reference_mode():
        pairs = [(rt.rms_norm(x, w, 1e-6, True), ops.rms_norm(x, w, 1e-6, True), (x, w)),
                 (rt.layer_norm(x, w, b, 1e-5), ops.layer_norm(x, w, b, 1e-5), (x, w, b)),
                 (rt.attention(q, k, k, True, 0.3), ops.attention(q, k, k, True, 0.3), (q, k))]
        for fast, op, inputs in pairs:
            assert torch.equal(fast, op)
            assert fast.requires_grad == op.requires_grad == grad
            if grad:
                g = torch.randn_like(fast)
                for a, c in zip(torch.autograd.grad(fast, inputs, g), torch.autograd.grad(op, inputs, g)):
                    assert torch.equal(a, c)


class _SeeOps(torch.utils._python_dispatch.TorchDispatchMode):
    """A pass-through dispatch mode: it turns the ops' eager fast path off (the dispatcher path runs, as under
    tracing) and records the rtckern ops it sees."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "rtckern":
            self.seen.append(func.name())
        return func(*args, **(kwargs or {}))


def _grad_inputs(args):
    return [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("name", sorted(_opcheck_cases()))
def test_eager_fast_path_equals_the_dispatched_path(name, grad):
    """Each op's eager call (the implementation run by the op's own kernel at the autograd level) gives what the
    full dispatch gives (autograd.Function around a redispatch to the backend kernel), outputs and gradients."""
    args = _opcheck_cases()[name]
    if not grad:
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    op = getattr(ops, name)
    results = []
    with D.reference_mode():
        for mode in (None, _SeeOps()):
            torch.manual_seed(0)
            with mode or contextlib.nullcontext():
                out = op(*args)
            outs = out if isinstance(out, tuple) else (out,)
            grads = ()
            if grad and _grad_inputs(args):
                loss = sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum()
                           for o in outs if o.numel() and o.requires_grad)
                grads = torch.autograd.grad(loss, _grad_inputs(args), allow_unused=True)
            results.append((outs, grads))
            if mode is not None:
                assert mode.seen, f"{name}: the mode saw no rtckern op"
    (fast, fast_g), (full, full_g) = results
    for a, b in zip(fast + fast_g, full + full_g):
        assert (a is None and b is None) or torch.equal(a, b), name
    assert [o.requires_grad for o in fast] == [o.requires_grad for o in full], name


@pytest.mark.parametrize("grad", [False, True])
def test_an_eager_call_is_one_dispatcher_op(jit_on_cpu, grad):
    """In plain eager code a composite calls rtckern's op itself: the profiler sees the public op only, not the
    kernel op it decomposes into under tracing; the modules skip the dispatcher altogether."""
    x, w = rand(4, 32, requires_grad=grad), rand(32)
    s = rand(2, 2, 5, 5, requires_grad=grad)
    norm = rt.RMSNorm(32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.rms_norm(x, w, 1e-6)
        ops.softmax(s, 0.5)
        norm(x)
    names = [e.name for e in prof.events() if e.name.startswith("rtckern::")]
    assert sorted(names) == ["rtckern::rms_norm", "rtckern::softmax"]
    with _SeeOps() as mode:
        ops.rms_norm(x, w, 1e-6)
    assert mode.seen == ["rtckern::rms_norm_fwd"]  # a mode sees the kernel op (the composite decomposed)


def test_backward_formulas_skip_the_dispatcher_in_eager_code(jit_on_cpu):
    """A backward formula runs its backward op's implementation itself in plain eager code: the profiler sees the
    public ops only; a dispatch mode still sees the backward ops (as tracing does)."""
    x, w = rand(4, 32, requires_grad=True), rand(32, requires_grad=True)
    q = rand(1, 8, 2, 16, dtype=BF16, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.rms_norm(x, w, 1e-6).sum().backward()
        ops.attention(q, q, q, True).float().sum().backward()
    names = {e.name for e in prof.events() if e.name.startswith("rtckern::")}
    assert names == {"rtckern::rms_norm", "rtckern::attention"}
    with _SeeOps() as mode:
        ops.rms_norm(x, w, 1e-6).sum().backward()
        ops.attention(q, q, q, True).float().sum().backward()
    assert {"rtckern::rms_norm_bwd", "rtckern::attention_bwd"} <= set(mode.seen)


def test_meta_and_inference_mode_take_the_dispatcher():
    """Meta tensors reach the fake kernels (the fast path is for real tensors); inference-mode tensors skip the
    autograd key and reach the backend kernel directly."""
    x, w, s = torch.empty(4, 32, device="meta"), torch.empty(32, device="meta"), torch.empty(2, 3, 5, device="meta")
    assert ops.rms_norm(x, w).device.type == "meta" and ops.softmax(s).shape == s.shape
    with D.reference_mode(), torch.inference_mode():
        xi, wi = rand(4, 32), rand(32)
        torch.testing.assert_close(ops.rms_norm(xi, wi, 1e-6), nn.functional.rms_norm(xi, (32,), wi, 1e-6))
        torch.testing.assert_close(ops.softmax(xi, 2.0), torch.softmax(2.0 * xi, -1))


def test_modules_and_functional_compile_to_the_custom_ops():
    from torch._dynamo.testing import CompileCounterWithBackend

    norm = rt.RMSNorm(32, eps=1e-6)
    q = rand(1, 8, 2, 16, dtype=BF16)

    def fn(x):
        return norm(x).sum() + rt.attention(q, q, q, True).float().sum() + rt.layer_norm(x, None, None).sum()

    counter = CompileCounterWithBackend("aot_eager")
    x = rand(4, 32)
    with D.reference_mode():
        # the modules' CPU check is a Python branch: traced as the fallback, so route the module to the op
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(M, "_why_not_jit", lambda *_: None)
            got = torch.compile(fn, backend=counter, fullgraph=True)(x)
            want = fn(x)
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {"rtckern.rms_norm", "rtckern.attention", "rtckern.layer_norm"} <= targets
    assert torch.allclose(got, want)


# ---- fallback policy ---------------------------------------------------------------------------------------------
def _unsupported(*_):
    raise UnsupportedRequestError("rms_norm of bf16 x (n=3)", {"rms_norm.rows": ["no config for n=3"]})


def test_no_jit_candidate_falls_back_to_torch_with_one_warning():
    with pytest.warns(RuntimeWarning, match=r"no JIT implementation serves 'rms_norm'.*RTCKERN_STRICT=1"):
        assert D.run("rms_norm", _unsupported, lambda v: v + 1, 1) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert D.run("rms_norm", _unsupported, lambda v: v + 1, 2) == 3  # once per op


def test_strict_turns_the_fallback_into_the_registry_error():
    with config.override(strict=True), pytest.raises(UnsupportedRequestError, match=r"rms_norm.rows: no config"):
        D.run("rms_norm", _unsupported, lambda v: v, 1)


def test_input_errors_are_not_fallen_back():
    def bad(*_):
        raise InputError("weight has shape (3,)")

    with pytest.raises(InputError):
        D.run("rms_norm", bad, lambda v: v, 1)


# ---- CUDA graph capture guard -------------------------------------------------------------------------------------
def test_first_call_during_capture_raises_a_clear_error(monkeypatch):
    assert rt.install_capture_guard() and rt.install_capture_guard()  # idempotent
    monkeypatch.setattr(D, "_capturing", lambda: True)
    req = OpRequest(op="rms_norm", dtypes=(("w", "bf16"), ("x", "bf16"), ("y", "bf16")),
                    shape=(("n", 4099), ("vec", 1)), flags=(("weight", True),),
                    device=DeviceInfo.for_arch("sm_90"))
    with pytest.raises(rt.GraphCaptureError, match=r"first time while a CUDA graph is being captured.*warm-up"):
        default_registry().select(req)


# ---- drop-in modules ----------------------------------------------------------------------------------------------
def test_modules_are_state_dict_compatible_both_ways():
    for torch_cls, rt_cls, kw in ((nn.RMSNorm, rt.RMSNorm, {"eps": 1e-5}), (nn.LayerNorm, rt.LayerNorm, {})):
        ref = torch_cls(64, **kw)
        with torch.no_grad():
            for p in ref.parameters():
                p.normal_()
        ours = rt_cls(64, **kw)
        assert isinstance(ours, torch_cls)
        assert ours.state_dict().keys() == ref.state_dict().keys()
        ours.load_state_dict(ref.state_dict())
        back = torch_cls(64, **kw)
        back.load_state_dict(ours.state_dict())
        for a, b in zip(back.parameters(), ref.parameters()):
            assert torch.equal(a, b)


def test_module_on_cpu_falls_back_to_torch_with_a_warning_and_strict_refuses():
    norm = rt.RMSNorm(32, eps=1e-6)
    x = rand(4, 32)
    with pytest.warns(RuntimeWarning, match=r"(?s)'rms_norm'.*x is on cpu"):
        y = norm(x)
    assert torch.allclose(y, nn.functional.rms_norm(x, (32,), norm.weight, 1e-6))
    with config.override(strict=True), pytest.raises(UnsupportedRequestError, match="rtckern's kernels run on CUDA"):
        rt.LayerNorm(32)(x)


def test_module_fallback_under_compile_traces_torch_and_strict_fails_the_compile():
    norm = rt.RMSNorm(16, eps=1e-6)
    x = rand(3, 16)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning from a compiled region (dynamo cannot emit one)
        y = torch.compile(norm, backend="eager", fullgraph=True)(x)
    assert torch.allclose(y, nn.functional.rms_norm(x, (16,), norm.weight, 1e-6))
    torch._dynamo.reset()
    with config.override(strict=True), pytest.raises(Exception, match=r"RTCKERN_STRICT=1.*x is on cpu"):
        torch.compile(rt.RMSNorm(16), backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()


@pytest.fixture
def jit_on_cpu(monkeypatch):
    """Let the modules and the transformers function take their rtckern path on CPU tensors, with the reference
    kernels standing in for the GPU ones: exercises the plugin's own logic (layouts, flags, dtype rules)."""
    real = M._why_not_jit
    monkeypatch.setattr(M, "_why_not_jit", lambda x, w, b: None if x.device.type == "cpu" else real(x, w, b))
    real_hf = HF._why_not

    def hf_why_not(module, q, k, v, mask, dropout, kwargs):
        why = real_hf(module, q, k, v, mask, dropout, kwargs)
        return None if why and "tensors are on cpu" in why else why

    monkeypatch.setattr(HF, "_why_not", hf_why_not)
    with D.reference_mode():
        yield


def test_modules_jit_path_multi_dim_shapes(jit_on_cpu):
    norm, ln = rt.RMSNorm((4, 8), eps=1e-6), rt.LayerNorm((4, 8))
    with torch.no_grad():
        norm.weight.normal_()
        ln.weight.normal_()
        ln.bias.normal_()
    x = rand(3, 5, 4, 8)
    assert torch.allclose(norm(x), nn.functional.rms_norm(x, (4, 8), norm.weight, 1e-6), atol=1e-5)
    assert torch.allclose(ln(x), nn.functional.layer_norm(x, (4, 8), ln.weight, ln.bias), atol=1e-5)


class LlamaStyleRMSNorm(nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, x):
        dt = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dt)


class GemmaStyleRMSNorm(nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class OddRMSNorm(LlamaStyleRMSNorm):
    def forward(self, x):  # not an RMSNorm: must be left alone
        return super().forward(x) * 2


class Toy(nn.Module):
    def __init__(self, n=32):
        super().__init__()
        self.a = LlamaStyleRMSNorm(n)
        self.b = GemmaStyleRMSNorm(n)
        self.c = nn.LayerNorm(n)
        self.d = nn.RMSNorm(n, eps=1e-5)
        self.e = OddRMSNorm(n)
        self.layers = nn.ModuleList([self.a, nn.Linear(n, n)])  # self.a appears twice

    def forward(self, x):
        for m in (self.a, self.b, self.c, self.d, self.e, self.layers[1], self.layers[0]):
            x = m(x)
        return x


def test_patch_swaps_norms_in_place_keeping_parameters_and_semantics(jit_on_cpu):
    model = Toy()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.5, 0.3)
    ref_model = copy.deepcopy(model)
    params_before = {name: p for name, p in model.named_parameters()}
    report = rt.patch(model)
    assert sorted(p for p, _ in report.replaced) == ["a", "b", "c", "d"]
    assert [(p, why) for p, _, why in report.skipped] == \
        [("e", "its forward computes neither x * rsqrt(mean(x^2) + eps) * weight nor the same with (1 + weight)")]
    assert model.layers[0] is model.a and isinstance(model.a, rt.RMSNorm)
    assert model.b.zero_centered and not model.a.zero_centered and model.a.out_dtype_rule == "promote"
    assert model.b.out_dtype_rule == "input" and model.a.variance_epsilon == 1e-6
    assert type(model.e) is OddRMSNorm
    assert {name: p for name, p in model.named_parameters()} == params_before  # same Parameter objects
    assert model.state_dict().keys() == ref_model.state_dict().keys()
    x = rand(3, 32)
    assert torch.allclose(model(x), ref_model(x), atol=1e-4)
    # bf16 activations with fp32 weights keep each class's output dtype
    xb = x.bfloat16()
    assert model.a(xb).dtype == ref_model.a(xb).dtype == F32
    assert model.b(xb).dtype == ref_model.b(xb).dtype == BF16
    assert rt.patch(model).replaced == []  # idempotent


def test_patch_fallback_uses_the_original_forward_on_the_current_weight():
    model = Toy()
    rt.patch(model)
    with torch.no_grad():
        model.b.weight.fill_(0.25)
    x = rand(2, 32)
    with pytest.warns(RuntimeWarning):
        y = model.b(x)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * 1.25
    assert torch.allclose(y, expected, atol=1e-5)


def test_patch_refuses_a_lone_norm():
    with pytest.raises(ValueError, match=r"use rtckern.torch.convert\(module\)"):
        rt.patch(nn.RMSNorm(8))
    assert isinstance(rt.convert(nn.RMSNorm(8)), rt.RMSNorm)


# ---- transformers ------------------------------------------------------------------------------------------------
def _tiny_llama(**kw):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_transformers_patch_registers_and_selects_rtckern_attention():
    model = _tiny_llama()
    ref = copy.deepcopy(model)
    report = rt.patch(model)
    assert report.attention == "rtckern" and len(report.replaced) == 2 * 2 + 1
    from transformers import AttentionInterface

    assert AttentionInterface._global_mapping["rtckern"] is rt.rtckern_attention_forward
    ids = torch.randint(0, 128, (2, 16))
    with pytest.warns(RuntimeWarning):  # CPU: every op falls back to transformers' / torch's own
        got = model(ids).logits
    assert torch.equal(got, ref(ids).logits)


def test_patch_norms_only_or_attention_only():
    model, norms_only, attention_only = _tiny_llama(), _tiny_llama(), _tiny_llama()
    rms_cls = type(model.model.norm)
    report = rt.patch(norms_only, attention=False)
    assert len(report.replaced) == 2 * 2 + 1 and report.attention is None
    assert norms_only.config._attn_implementation == model.config._attn_implementation != "rtckern"
    assert isinstance(norms_only.model.norm, rt.RMSNorm)
    report = rt.patch(attention_only, norms=False)
    assert report.replaced == [] and report.skipped == [] and report.attention == "rtckern"
    assert attention_only.config._attn_implementation == "rtckern"
    assert type(attention_only.model.norm) is rms_cls
    assert not any(isinstance(m, rt.RMSNorm) for m in attention_only.modules())
    assert rt.patch(attention_only, attention=False).replaced  # the other half later: the full patch
    assert attention_only.config._attn_implementation == "rtckern"
    toy = Toy()
    assert rt.patch(toy, norms=False).replaced == [] and type(toy.a) is LlamaStyleRMSNorm  # not a transformers model


def test_transformers_attention_function_layout_and_causality(jit_on_cpu):
    model = _tiny_llama()
    ref = copy.deepcopy(model)
    rt.patch(model)
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    # padding: the mask builder hands over the 2D mask and the attention takes the varlen path (no fallback)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :3] = 0
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", RuntimeWarning)
        got = model(ids, attention_mask=mask).logits
    want = ref(ids, attention_mask=mask).logits
    assert torch.allclose(got[mask.bool()], want[mask.bool()], atol=1e-4)
    # a custom 4D mask is a pattern the kernels do not take: sdpa with a warning, and still matches
    custom = torch.rand(2, 1, 16, 16) < 0.7
    custom |= torch.eye(16, dtype=torch.bool)
    with pytest.warns(RuntimeWarning, match="attention mask was given"), torch.no_grad():
        got = model(ids, attention_mask=custom).logits
    assert torch.allclose(got, ref(ids, attention_mask=custom).logits, atol=1e-4)


def test_transformers_from_config_with_attn_implementation_rtckern():
    transformers = pytest.importorskip("transformers")
    assert rt.register_transformers()
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="rtckern")
    assert model.config._attn_implementation == "rtckern"


def test_a_gradient_through_the_statistics_alone_reaches_nothing():
    """The statistics' gradients (rstd, mean, lse) are not materialized as zeros for the formulas (which ignore
    them); a loss on a statistic alone gives the inputs no gradient instead of a backward launch on zeros."""
    x, w, b = rand(4, 8, requires_grad=True), rand(8, requires_grad=True), rand(8, requires_grad=True)
    q = rand(1, 6, 2, 8, requires_grad=True)
    with rt.reference_mode():
        _, rstd = ops.rms_norm_fwd(x, w, 1e-6, False, None, True)
        assert torch.autograd.grad(rstd.sum(), (x, w), allow_unused=True) == (None, None)
        _, mean, rstd = ops.layer_norm_fwd(x, w, b, 1e-5, False, None, True)
        assert torch.autograd.grad(mean.sum() + rstd.sum(), (x, w, b), allow_unused=True) == (None, None, None)
        _, lse = ops.attention_fwd(q, q, q, True, None, True)
        assert torch.autograd.grad(lse.sum(), (q,), allow_unused=True) == (None,)
        y, rstd = ops.rms_norm_fwd(x, w, 1e-6, False, None, True)  # both used: the output's gradient flows
        gx, gw = torch.autograd.grad(y.sum() + rstd.sum(), (x, w))
        want = torch.autograd.grad(R.rms_norm_fwd(x, w, 1e-6, False, None, False)[0].sum(), (x, w))
        assert torch.allclose(gx, want[0], atol=1e-5) and torch.allclose(gw, want[1], atol=1e-5)
