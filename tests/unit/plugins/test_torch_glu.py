"""SwiGLU in the PyTorch plugin without a GPU: gradcheck and opcheck through the reference kernels, FakeTensorMode on
CUDA fake tensors, torch.compile with fullgraph, and patch() on gated MLPs: the probe (SiLU-gated replaced, a
GELU-gated one and other forms left alone and reported), per-instance binding, deep copies, the fallback."""
from __future__ import annotations

import copy
import io
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import rtckern.torch as rt  # noqa: E402
from rtckern import config  # noqa: E402
from rtckern.errors import UnsupportedRequestError  # noqa: E402

ops = torch.ops.rtckern


pytestmark = pytest.mark.usefixtures("fresh_warnings")


def test_reference_gradients_opcheck_and_fake_tensors():
    g = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    u = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    with rt.reference_mode():
        assert torch.allclose(rt.swiglu(g, u), nn.functional.silu(g) * u)
        assert torch.autograd.gradcheck(lambda g, u: ops.swiglu(g, u), (g, u))
        gf, uf = g.detach().float(), u.detach().float()
        torch.library.opcheck(ops.swiglu.default, (gf.requires_grad_(), uf.requires_grad_()))
        torch.library.opcheck(ops.swiglu_bwd.default, (gf.detach(), gf.detach(), uf.detach()))
    with FakeTensorMode():
        fg = torch.empty(4, 16, dtype=torch.bfloat16, device="cuda")
        assert ops.swiglu(fg, fg).shape == (4, 16)
        assert [t.shape for t in ops.swiglu_bwd(fg, fg, fg)] == [(4, 16), (4, 16)]


def test_torch_compile_fullgraph_forward_and_backward():
    g = torch.randn(4, 16, requires_grad=True)
    u = torch.randn(4, 16, requires_grad=True)
    with rt.reference_mode():
        f = torch.compile(lambda g, u: rt.swiglu(g, u), fullgraph=True, backend="aot_eager")
        out = f(g, u)
        assert torch.allclose(out, nn.functional.silu(g) * u, atol=1e-6)
        out.sum().backward()
    assert g.grad is not None and u.grad is not None


class _Mlp(nn.Module):
    def __init__(self, act=None, bias=False):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(16, 32, bias=bias), nn.Linear(16, 32, bias=bias)
        self.down_proj = nn.Linear(32, 16, bias=bias)
        self.act_fn = act or nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Kwargs(_Mlp):
    def forward(self, x, scale=1.0):
        return super().forward(x) * scale


def test_patch_replaces_silu_gated_mlps_and_reports_the_others():
    model = nn.ModuleDict({"llama": _Mlp(), "biased": _Mlp(bias=True), "gelu": _Mlp(nn.GELU(approximate="tanh")),
                           "kwargs": _Kwargs()})
    report = rt.patch(model)
    assert sorted(p for p, _ in report.mlp) == ["biased", "llama"]
    why = {p: w for p, _, w in report.mlp_skipped}
    assert why["gelu"].startswith("its forward computes something other than down_proj(silu(")
    assert why["kwargs"] == "forward takes ['x', 'scale'], not one input"
    assert "SwiGLU activation on rtckern in 2 MLPs" in str(report)
    assert rt.patch(model).mlp == []  # patched before
    twin = copy.deepcopy(model)
    assert twin["llama"].forward.module is twin["llama"]
    buf = io.BytesIO()
    torch.save(model, buf)  # a whole pickled model keeps its patch
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded["llama"].forward.module is loaded["llama"]
    x = torch.randn(3, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU tensors: the module's own formula, with a warning
        assert torch.equal(loaded["llama"](x), model["llama"](x))
    assert "forward" not in _Mlp().__dict__
    kept = nn.ModuleDict({"llama": _Mlp()})
    assert rt.patch(kept, mlp=False).mlp == [] and "forward" not in kept["llama"].__dict__


def test_cpu_activations_run_the_modules_own_formula_with_one_warning():
    mlp = _Mlp()
    ref = copy.deepcopy(mlp)
    rt.patch(mlp)
    x = torch.randn(3, 16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y = mlp(x)
    assert torch.equal(y, ref(x))
    assert any("swiglu" in str(w.message) and "tensors are on cpu" in str(w.message) for w in seen)
    with config.override(strict=True), pytest.raises(UnsupportedRequestError, match="tensors are on cpu"):
        mlp(x)


class _Dropout(_Mlp):
    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        return self.down_proj(self.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


def test_the_probe_runs_in_training_mode_and_restores_the_mode():
    """An MLP with dropout matches the formula in eval mode only: the probe runs it in training mode, so it is left
    alone, and every module keeps the mode it had."""
    model = nn.ModuleDict({"drop": _Dropout(), "plain": _Mlp()}).eval()
    report = rt.patch(model)
    assert [p for p, _ in report.mlp] == ["plain"]
    assert [p for p, _, _ in report.mlp_skipped] == ["drop"]
    assert not any(m.training for m in model.modules())
