"""Cross-entropy in the PyTorch plugin without a GPU: each reduction against torch's F.cross_entropy, gradcheck and
opcheck through the reference kernels, FakeTensorMode on CUDA fake tensors, torch.compile with fullgraph, argument
errors, and patch() on a transformers causal LM: its loss_function replaced (and kept through copies and pickling),
other losses reported, the fallback for CPU logits."""
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
from rtckern.errors import InputError, UnsupportedRequestError  # noqa: E402

ops = torch.ops.rtckern


pytestmark = pytest.mark.usefixtures("fresh_warnings")


def _inputs(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 5, 11, generator=gen) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    labels[0, 1] = labels[1, 4] = -100
    return x, labels


@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_reductions_match_torch(reduction):
    x, labels = _inputs()
    want = nn.functional.cross_entropy(x.flatten(0, 1), labels.flatten(), reduction=reduction)
    want = want.view(2, 5) if reduction == "none" else want
    with rt.reference_mode():
        got = rt.cross_entropy(x, labels, reduction=reduction)
        via_op = ops.cross_entropy(x, labels, -100, reduction)
        (g,) = torch.autograd.grad(got.sum(), x)
    assert torch.allclose(got, want) and torch.allclose(via_op, want)
    (w,) = torch.autograd.grad(want.sum(), x)
    assert torch.allclose(g, w)


def test_gradcheck_opcheck_fake_tensors_and_errors():
    x, labels = _inputs()
    with rt.reference_mode():
        assert torch.autograd.gradcheck(lambda x: ops.cross_entropy(x, labels, -100, "mean"), (x,))
        assert torch.autograd.gradcheck(lambda x: rt.cross_entropy(x, labels, reduction="none").sum(0).sum(), (x,))
        xf = x.detach().float()
        for reduction in ("none", "mean", "sum"):
            torch.library.opcheck(ops.cross_entropy_fwd.default, (xf.detach().requires_grad_(), labels, -100,
                                                                  reduction))
        loss, lse, _ = ops.cross_entropy_fwd(xf.detach(), labels, -100, "none")
        torch.library.opcheck(ops.cross_entropy_bwd.default, (loss, xf.detach(), labels, lse, None, -100))
        mean, _, count = ops.cross_entropy_fwd(xf.detach(), labels, -100, "mean")
        torch.library.opcheck(ops.cross_entropy_bwd.default, (mean, xf.detach(), labels, lse, count, -100))
        with pytest.raises(InputError, match="reduction='avg'"):
            rt.cross_entropy(x, labels, reduction="avg")
    with FakeTensorMode():
        fx = torch.empty(4, 7, 32000, dtype=torch.bfloat16, device="cuda")
        fl = torch.empty(4, 7, dtype=torch.int64, device="cuda")
        fl4 = torch.empty(4, dtype=torch.int64, device="cuda")
        loss, lse, _ = ops.cross_entropy_fwd(fx, fl, -100, "none")
        assert loss.shape == lse.shape == (4, 7) and loss.dtype == torch.float32
        mean, _, count = ops.cross_entropy_fwd(fx, fl, -100, "mean")
        assert mean.shape == count.shape == ()
        assert ops.cross_entropy_bwd(loss, fx, fl, lse, None, -100).shape == (4, 7, 32000)
        assert ops.cross_entropy(fx, fl).shape == ()
        with pytest.raises(InputError, match="labels has dtype float32"):
            ops.cross_entropy_fwd(fx, fl.float(), -100, "none")
        with pytest.raises(InputError, match="labels has shape \\(4,\\)"):
            ops.cross_entropy_fwd(fx, fl4, -100, "none")


def test_a_loss_on_the_lse_reaches_the_logits():
    """A z-loss (on the lse output) differentiates through the softmax: alone, and beside the cross-entropy."""
    x, labels = _inputs()
    lse64 = torch.logsumexp(x, -1)
    ce64 = nn.functional.cross_entropy(x.transpose(1, 2), labels, reduction="none")
    for use_loss in (True, False):
        with rt.reference_mode():
            loss, lse, _ = ops.cross_entropy_fwd(x, labels, -100, "none")
            total = (loss.sum() if use_loss else 0) + 0.1 * (lse ** 2).sum()
            (g,) = torch.autograd.grad(total, x)
        want = (ce64.sum() if use_loss else 0) + 0.1 * (lse64 ** 2).sum()
        (w,) = torch.autograd.grad(want, x, retain_graph=True)
        assert torch.allclose(g, w), use_loss


def test_torch_compile_fullgraph_forward_and_backward():
    x, labels = _inputs(torch.float32)
    with rt.reference_mode():
        f = torch.compile(lambda x, l: rt.cross_entropy(x, l), fullgraph=True, backend="aot_eager")
        loss = f(x, labels)
        assert torch.allclose(loss, nn.functional.cross_entropy(x.flatten(0, 1), labels.flatten()))
        loss.backward()
    assert x.grad is not None and x.grad.shape == x.shape


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_patch_gives_a_causal_lm_rtckerns_loss_and_keeps_it():
    from rtckern.plugins._torch_hf_loss import causal_lm_loss

    model = _tiny_llama()
    ref = copy.deepcopy(model)
    report = rt.patch(model, norms=False, attention=False, rope=False, mlp=False)
    assert report.loss and model.loss_function is causal_lm_loss and "causal LM loss on rtckern" in str(report)
    assert rt.patch(model, norms=False, attention=False, rope=False, mlp=False).loss  # patched before
    assert copy.deepcopy(model).loss_function is causal_lm_loss
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=False).loss_function is causal_lm_loss
    ids = torch.randint(0, 64, (2, 9))
    labels = ids.clone()
    labels[0, :3] = -100
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # CPU logits: transformers' own loss, with a warning
        got = model(input_ids=ids, labels=labels).loss
    assert torch.equal(got, ref(input_ids=ids, labels=labels).loss)
    assert any("cross_entropy" in str(w.message) and "logits are on cpu" in str(w.message) for w in seen)
    with config.override(strict=True), pytest.raises(UnsupportedRequestError, match="logits are on cpu"):
        model(input_ids=ids, labels=labels)
    kept = _tiny_llama()
    assert not rt.patch(kept, loss=False).loss and "_loss_function" not in kept.__dict__


def test_other_losses_and_plain_modules_are_left_alone():
    model = _tiny_llama()

    def my_loss(logits, labels, vocab_size, **kwargs):
        return logits.sum()

    model.loss_function = my_loss
    report = rt.patch(model, norms=False, attention=False, rope=False, mlp=False)
    assert not report.loss and model.loss_function is my_loss
    assert report.loss_skipped == "its loss is my_loss, not transformers' causal LM loss (ForCausalLMLoss)"
    assert "loss skipped: its loss is my_loss" in str(report)
    plain = rt.patch(nn.Sequential(nn.Linear(4, 4)))
    assert not plain.loss and plain.loss_skipped == "" and "loss" not in str(plain)
    import transformers

    backbone = transformers.LlamaModel(model.config)  # computes no loss: nothing to patch or report
    report = rt.patch(backbone, norms=False, attention=False, rope=False, mlp=False)
    assert not report.loss and report.loss_skipped == "" and "_loss_function" not in backbone.__dict__
    classifier = transformers.LlamaForSequenceClassification(model.config)
    report = rt.patch(classifier, norms=False, attention=False, rope=False, mlp=False)
    assert report.loss_skipped == "its loss_type is ForSequenceClassification, not ForCausalLM"
