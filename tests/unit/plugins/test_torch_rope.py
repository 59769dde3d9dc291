"""The rotary embedding in the PyTorch plugin without a GPU: opcheck and float64 gradcheck through the reference
kernels (the tables' own gradients included), FakeTensorMode on CUDA fake tensors, torch.compile with fullgraph, and
patch() on transformers-style attention modules: the probe, per-instance binding, deep copies, the fallback."""
from __future__ import annotations

import copy
import io
import sys
import types
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import rtckern.torch as rt  # noqa: E402
from rtckern import config  # noqa: E402
from rtckern.errors import UnsupportedRequestError  # noqa: E402
from rtckern.testing import torch_reference as R  # noqa: E402

ops = torch.ops.rtckern


pytestmark = pytest.mark.usefixtures("fresh_warnings")


def _hf(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb."""
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * c + R.rotate_half(q) * s, k * c + R.rotate_half(k) * s


def _inputs(dtype=torch.float64, axis=1):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 4, 8, generator=g, dtype=dtype), torch.randn(2, 5, 2, 8, generator=g, dtype=dtype)
    if axis == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = torch.randn(2, 5, 8, generator=g, dtype=dtype), torch.randn(2, 5, 8, generator=g, dtype=dtype)
    return q.requires_grad_(), k.requires_grad_(), cos, sin


@pytest.mark.parametrize("axis", (1, 2))
def test_reference_forward_and_gradients_match_transformers(axis):
    q, k, cos, sin = _inputs(axis=axis)
    with rt.reference_mode():
        for a, b in zip(rt.apply_rotary_pos_emb(q, k, cos, sin, axis), _hf(q, k, cos, sin, axis)):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
        c, s = cos.clone().requires_grad_(), sin[:1].clone().requires_grad_()  # a table shared by the sequences
        assert torch.autograd.gradcheck(lambda q, k, c, s: ops.rope(q, k, c, s, axis), (q, k, c, s))
        c2 = cos[0].clone().requires_grad_()  # (seqlen, head_dim)
        assert torch.autograd.gradcheck(lambda q, k, c: ops.rope(q, k, c, sin[0], axis), (q, k, c2))


def test_opcheck_and_fake_tensors():
    q, k, cos, sin = (t.detach().float() for t in _inputs())
    with rt.reference_mode():
        torch.library.opcheck(ops.rope.default, (q.requires_grad_(), k.requires_grad_(), cos, sin, 1))
        torch.library.opcheck(ops.rope_bwd.default, (q.detach(), k.detach(), cos, sin, 1))
    with FakeTensorMode():
        fq = torch.empty(2, 4, 5, 8, dtype=torch.bfloat16, device="cuda")
        fk = torch.empty(2, 2, 5, 8, dtype=torch.bfloat16, device="cuda")
        fc = torch.empty(2, 5, 8, dtype=torch.bfloat16, device="cuda")
        oq, ok = ops.rope(fq, fk, fc, fc, 1)
        assert oq.shape == fq.shape and ok.shape == fk.shape and oq.device.type == "cuda"


def test_torch_compile_fullgraph_forward_and_backward():
    q, k, cos, sin = _inputs(torch.float32)
    with rt.reference_mode():
        f = torch.compile(lambda q, k: rt.apply_rotary_pos_emb(q, k, cos, sin), fullgraph=True, backend="aot_eager")
        out = f(q, k)
        want = _hf(q, k, cos, sin)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(out, want))
        (out[0].sum() + out[1].sum()).backward()
    assert q.grad is not None and k.grad is not None


# ---- patch() on transformers-style modules -----------------------------------------------------------------------
_MODELING = '''
import torch
from rtckern.testing import torch_reference as R

def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + R.rotate_half(q) * sin, k * cos + R.rotate_half(k) * sin

class Attention(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)
'''
_INTERLEAVED = '''
import torch

def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # GPT-J pairs (2i, 2i + 1): not rotate-half
    def rot(x):
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin

class Attention(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)
'''


def _module(name: str, source: str):
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    exec(source, mod.__dict__)
    return mod


def test_patch_binds_each_attention_module_and_leaves_others_alone():
    hf = _module("rtckern_test_modeling_rope", _MODELING)
    gptj = _module("rtckern_test_modeling_gptj", _INTERLEAVED)
    model = torch.nn.ModuleDict({"a": hf.Attention(), "b": hf.Attention(), "j": gptj.Attention()})
    bystander = hf.Attention()
    report = rt.patch(model)
    assert sorted(p for p, _ in report.rope) == ["a", "b"]
    assert [(p, why[:40]) for p, _, why in report.rope_skipped] == \
        [("j", "apply_rotary_pos_emb computes something ")]
    assert "rotary embedding on rtckern in 2 modules" in str(report)
    assert rt.patch(model).rope == []  # already patched
    assert "forward" not in bystander.__dict__ and hf.apply_rotary_pos_emb.__name__ == "apply_rotary_pos_emb"
    fn = model["a"].forward._fn
    bound = fn.__globals__["apply_rotary_pos_emb"]
    assert bound.rtckern_original is hf.apply_rotary_pos_emb  # rtckern's op, in this instance's forward only
    assert fn.__code__ is hf.Attention.forward.__code__
    twin = copy.deepcopy(model)
    assert twin["a"].forward.module is twin["a"]
    buf = io.BytesIO()
    torch.save(model, buf)  # a whole pickled model keeps its patch
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded["a"].forward.module is loaded["a"]
    assert loaded["a"].forward._fn.__globals__["apply_rotary_pos_emb"].rtckern_original is hf.apply_rotary_pos_emb
    untouched = torch.nn.ModuleDict({"a": hf.Attention()})
    assert rt.patch(untouched, rope=False).rope == [] and "forward" not in untouched["a"].__dict__


def test_a_patched_module_compiles_with_fullgraph():
    """torch.compile guards a function's globals through its module's name: the patched forward's namespace is a
    module of its own (`<module>.rtckern_rope`), so the guards see rtckern's function, not transformers'."""
    hf = _module("rtckern_test_modeling_rope3", _MODELING)
    model = torch.nn.ModuleDict({"a": hf.Attention()})
    rt.patch(model)
    assert sys.modules["rtckern_test_modeling_rope3.rtckern_rope"].apply_rotary_pos_emb.rtckern_original is \
        hf.apply_rotary_pos_emb
    q, k, cos, sin = (t.detach().float() for t in _inputs())
    f = torch.compile(lambda q, k: model["a"](q, k, cos, sin), fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU tensors: the model's own function (traced without a warning)
        for a, b in zip(f(q, k), _hf(q, k, cos, sin)):
            assert torch.allclose(a, b, atol=1e-6)


def test_calls_the_kernel_cannot_take_run_the_models_function_with_one_warning():
    hf = _module("rtckern_test_modeling_rope2", _MODELING)
    model = torch.nn.ModuleDict({"a": hf.Attention()})
    rt.patch(model)
    q, k, cos, sin = (t.detach().float() for t in _inputs())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = model["a"](q, k, cos, sin)  # CPU tensors
    assert all(torch.equal(a, b) for a, b in zip(out, _hf(q, k, cos, sin)))
    assert any("rope" in str(w.message) and "tensors are on cpu" in str(w.message) for w in seen)
    with config.override(strict=True), pytest.raises(UnsupportedRequestError, match="tensors are on cpu"):
        model["a"](q, k, cos, sin)


_DECORATED = '''
import functools
import torch
from rtckern.testing import torch_reference as R

def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + R.rotate_half(q) * sin, k * cos + R.rotate_half(k) * sin

def renamed_kwarg(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper

class Attention(torch.nn.Module):
    @renamed_kwarg
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)
'''


def test_a_decorated_forward_is_reported_not_patched():
    """transformers 4.56-4.57 wrap attention forwards in @deprecate_kwarg: the wrapper's code does not call the
    function, the wrapped code cannot be rebound inside it, and the report says so."""
    hf = _module("rtckern_test_modeling_rope4", _DECORATED)
    model = torch.nn.ModuleDict({"a": hf.Attention()})
    report = rt.patch(model)
    assert report.rope == [] and [(p, why[:40]) for p, _, why in report.rope_skipped] == \
        [("a", "its forward calls apply_rotary_pos_emb i")]
