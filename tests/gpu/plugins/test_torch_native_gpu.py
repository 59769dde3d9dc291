"""The native front of torch.ops.rtckern on a GPU (RTCKERN_TORCH_NATIVE=1 at import, as the device driver sets
it): the first call of a signature records, later calls replay in C++, and every op's replayed output equals the
Python path's bit for bit; the ops whose launches are plain (norms, softmax) are replayed; replays follow torch's
current stream and capture into CUDA graphs; a misaligned input still takes the Python kernels; calls needing a
gradient of the norms, attention (dense and variable-length), softmax and swiglu make C++ autograd nodes whose
gradients equal the Python Function's."""
from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

import rtckern.torch as rt  # noqa: E402
from rtckern.testing import python_autograd  # noqa: E402
from rtckern.testing import torch_op_python_path as P  # noqa: E402

pytestmark = pytest.mark.gpu
ops = torch.ops.rtckern
BF16 = torch.bfloat16
DEV = "cuda"


@pytest.fixture(autouse=True)
def native():
    s = rt.native_status()
    if not s["active"]:
        pytest.skip(f"the native front is not active: {s['why_not']} (run with RTCKERN_TORCH_NATIVE=1)")


def rand(*shape, dtype=BF16):
    return torch.randn(*shape, device=DEV, dtype=torch.float32).to(dtype)


# the keys of _cases(), so that collection makes no CUDA tensor (test_case_names_match checks them)
CASES = ("rms_norm_bwd", "layer_norm_bwd", "attention_bwd", "gemm M=128", "cross_entropy none", "rms_norm",
         "fused_add_rms_norm", "layer_norm", "rms_norm_fwd", "softmax", "scaled_upper_triang_masked_softmax",
         "scaled_masked_softmax", "softmax_bwd", "attention", "attention_fwd", "gemm", "gemm M=64", "swiglu",
         "cross_entropy")


def _cases():
    x, w, b = rand(4, 4096), rand(4096), rand(4096)
    s, c = rand(1, 32, 1, 1024), rand(32, 128, 128)
    mask = torch.rand(2, 1, 64, 64, device=DEV) < 0.2
    sm = rand(2, 4, 64, 64)
    q, kv = rand(1, 1, 32, 128), rand(1, 1024, 8, 128)
    qp, kvp = rand(2, 128, 8, 64), rand(2, 128, 2, 64)
    a1, wl = rand(1, 1024), rand(1024, 1024)
    a64 = rand(64, 1024)
    y = torch.softmax(s.float(), -1).to(BF16)
    gate, up = rand(8, 1024), rand(8, 1024)
    logits, labels = rand(16, 1000), torch.randint(0, 1000, (16,), device=DEV)
    dy = rand(4, 4096)
    rstd, mean = torch.rand(4, device=DEV) + 0.5, torch.randn(4, device=DEV)
    o, lse = P("attention_fwd")(qp, kvp, kvp, True, None, True)
    do = rand(2, 128, 8, 64)
    a128 = rand(128, 1024)
    return {
        "rms_norm_bwd": (lambda: ops.rms_norm_bwd(dy, x, w, rstd, False, True, None),
                         lambda: P("rms_norm_bwd")(dy, x, w, rstd, False, True, None)),
        "layer_norm_bwd": (lambda: ops.layer_norm_bwd(dy, x, w, b, mean, rstd, False, True, True),
                           lambda: P("layer_norm_bwd")(dy, x, w, b, mean, rstd, False, True, True)),
        "attention_bwd": (lambda: ops.attention_bwd(do, qp, kvp, kvp, o, lse, True, None, True),
                          lambda: P("attention_bwd")(do, qp, kvp, kvp, o, lse, True, None, True)),
        "gemm M=128": (lambda: ops.gemm(a128, wl, None, None, True),
                       lambda: P("gemm")(a128, wl, None, None, True, None, None)),
        "cross_entropy none": (lambda: ops.cross_entropy(logits, labels, -100, "none"),
                               lambda: P("cross_entropy")(logits, labels, -100, "none")),
        "rms_norm": (lambda: ops.rms_norm(x, w, 1e-6), lambda: P("rms_norm")(x, w, 1e-6, False, None)),
        "fused_add_rms_norm": (lambda: ops.fused_add_rms_norm(x, x, w, 1e-6),
                               lambda: P("fused_add_rms_norm")(x, x, w, 1e-6, False)),
        "layer_norm": (lambda: ops.layer_norm(x, w, b, 1e-5), lambda: P("layer_norm")(x, w, b, 1e-5, False, None)),
        "rms_norm_fwd": (lambda: ops.rms_norm_fwd(x, w, 1e-6, False, None, True),
                         lambda: P("rms_norm_fwd")(x, w, 1e-6, False, None, True)),
        "softmax": (lambda: ops.softmax(s, 0.125), lambda: P("softmax")(s, 0.125)),
        "scaled_upper_triang_masked_softmax": (
            lambda: ops.scaled_upper_triang_masked_softmax(c, 0.125),
            lambda: P("scaled_upper_triang_masked_softmax")(c, 0.125)),
        "scaled_masked_softmax": (lambda: ops.scaled_masked_softmax(sm, mask, 0.5),
                                  lambda: P("scaled_masked_softmax")(sm, mask, 0.5)),
        "softmax_bwd": (lambda: ops.softmax_bwd(y, s, 0.125), lambda: P("softmax_bwd")(y, s, 0.125)),
        "attention": (lambda: ops.attention(q, kv, kv), lambda: P("attention")(q, kv, kv, False, None)),
        "attention_fwd": (lambda: ops.attention_fwd(qp, kvp, kvp, True, None, True),
                          lambda: P("attention_fwd")(qp, kvp, kvp, True, None, True)),
        "gemm": (lambda: ops.gemm(a1, wl, None, None, True), lambda: P("gemm")(a1, wl, None, None,
                                                                                               True, None, None)),
        "gemm M=64": (lambda: ops.gemm(a64, wl, None, None, True),
                      lambda: P("gemm")(a64, wl, None, None, True, None, None)),
        "swiglu": (lambda: ops.swiglu(gate, up), lambda: P("swiglu")(gate, up)),
        "cross_entropy": (lambda: ops.cross_entropy(logits, labels),
                          lambda: P("cross_entropy")(logits, labels, -100, "mean")),
    }


def test_case_names_match():
    assert tuple(_cases()) == CASES


@pytest.mark.parametrize("case", CASES)
def test_replay_equals_the_python_path(case):
    """The first call records; later calls of the signature with other tensors (other addresses, other values)
    replay: each output equals the Python path's on the same inputs, and a replay leaves earlier outputs alone."""
    def tup(v):
        return v if isinstance(v, tuple) else (v,)

    with torch.no_grad():
        native, python = _cases()[case]
        want = tup(python())
        first = tup(native())  # recorded (or refused)
        for _ in range(3):
            native2, python2 = _cases()[case]  # new tensors of the same signature
            want2 = tup(python2())
            got = tup(native2())  # replayed where a recipe was learned
            torch.cuda.synchronize()
            for g, w in zip(got, want2, strict=True):
                assert g.shape == w.shape and g.dtype == w.dtype and g.stride() == w.stride()
                assert torch.equal(g, w), case
    for g, w in zip(first, want, strict=True):
        assert torch.equal(g, w), case
    if torch.cuda.get_device_capability()[0] == 9:  # every case replays on Hopper (measured on the H200)
        op = case.split(" ")[0]
        assert rt.native_status()["ops"][op]["recipes"] >= 1, (case, rt.native_status()["ops"][op])


# the rtckern.ops functions the front serves directly (rtckern.ops._common.DIRECT_SLOTS), by their torch op
DIRECT = ("rms_norm", "rms_norm residual", "rms_norm no weight zero_centered", "layer_norm", "layer_norm no bias",
          "softmax", "softmax_backward", "scaled_masked_softmax", "scaled_masked_softmax_backward",
          "scaled_upper_triang_masked_softmax", "scaled_upper_triang_masked_softmax_backward",
          "scaled_aligned_causal_masked_softmax", "scaled_aligned_causal_masked_softmax_backward",
          "rms_norm_backward", "rms_norm_backward no weight grad", "rms_norm_backward no weight",
          "rms_norm_backward dresidual", "rms_norm_backward zero_centered", "layer_norm_backward",
          "layer_norm_backward no bias", "layer_norm_backward no weight", "gemm_fp8", "gemm_fp8 block",
          "quantize_fp8", "quantize_fp8 col_tma", "rms_norm_quant")


def _direct_case(name):
    """(the rtckern.ops function's slot name, a call of it on fresh tensors, the torch op serving it, that op's
    arguments for the same call)"""
    import rtckern.ops as rops

    s, c, ca = rand(1, 32, 1, 1024), rand(32, 128, 128), rand(4, 64, 128)
    sm, mask = rand(2, 4, 64, 64), torch.rand(2, 1, 64, 64, device=DEV) < 0.2
    x, w, b, dy, dres = rand(4, 4096), rand(4096), rand(4096), rand(4, 4096), rand(4, 4096)
    rstd, mean = torch.rand(4, device=DEV) + 0.5, torch.randn(4, device=DEV)
    args = {"softmax": (s, 0.125), "scaled_masked_softmax": (sm, mask, 0.5),
            "scaled_upper_triang_masked_softmax": (c, 0.125), "scaled_aligned_causal_masked_softmax": (ca, 0.25)}
    base = name.split(" ")[0]
    if base in ("gemm_fp8", "quantize_fp8", "rms_norm_quant"):
        return _fp8_direct_case(name, base)
    if base == "rms_norm":
        wt, zc = (None, True) if "no weight" in name else (w, False)
        if "residual" in name:
            return ("fused_add_rms_norm", lambda: rops.rms_norm(x, wt, 1e-6, residual=dres), "fused_add_rms_norm",
                    (x, dres, wt, 1e-6, False))  # (rms_norm with a residual has its slot under the op's name)
        return base, lambda: rops.rms_norm(x, wt, 1e-6, zero_centered=zc), base, (x, wt, 1e-6, zc, None)
    if base == "layer_norm":
        bias = None if "no bias" in name else b
        return base, lambda: rops.layer_norm(x, w, bias, 1e-5), base, (x, w, bias, 1e-5, False, None)
    if base in args:
        return base, lambda: getattr(rops, base)(*args[base]), base, args[base]
    if base.endswith("softmax_backward"):
        fwd = base[:-len("_backward")]
        y = torch.softmax(args[fwd][0].float(), -1).to(BF16)
        a = (y, rand(*y.shape), args[fwd][-1])
        return base, lambda: getattr(rops, base)(*a), fwd + "_bwd", a
    wt = None if "no weight" in name and "grad" not in name else w
    if base == "rms_norm_backward":
        grad, zc = "no weight grad" not in name, "zero_centered" in name
        dr = dres if "dresidual" in name else None
        return (base, lambda: rops.rms_norm_backward(dy, x, wt, rstd, zero_centered=zc, dresidual=dr, weight_grad=grad),
                "rms_norm_bwd", (dy, x, wt, rstd, zc, grad, dr))
    bias = None if "no bias" in name else b
    return (base, lambda: rops.layer_norm_backward(dy, x, wt, bias, mean, rstd), "layer_norm_bwd",
            (dy, x, wt, bias, mean, rstd, False, True, True))


def _fp8_direct_case(name, base):
    import rtckern.ops as rops

    e4m3 = torch.float8_e4m3fn
    if base == "gemm_fp8":
        m = 64 if "block" in name else 8
        a, b = rand(m, 1024).to(e4m3), rand(512, 1024).to(e4m3)
        sa, sb = ((torch.rand(m, 8, device=DEV) + 0.5, torch.rand(4, 8, device=DEV) + 0.5) if "block" in name
                  else (torch.rand((), device=DEV) + 0.5, torch.rand((), device=DEV) + 0.5))
        return base, lambda: rops.gemm_fp8(a, b, sa, sb), base, (a, b, sa, sb, None, None, True)
    x, w = rand(8, 1024), rand(1024)
    if base == "quantize_fp8":
        fmt = "col_tma" if "col_tma" in name else "row"  # (8 rows: col_tma's scales need no padding rows)
        return base, lambda: rops.quantize_fp8(x, 128, fmt), base, (x, 128, fmt)
    return base, lambda: rops.rms_norm_quant(x, w, 1e-6), base, (x, w, 1e-6, 128, "row", False)


@pytest.mark.parametrize("name", DIRECT)
def test_op_functions_are_served_by_the_front_and_equal_their_python_path(name):
    """rtckern.ops' own functions with torch tensors: the first call of a signature goes through the dispatcher (and
    is recorded: the op's one recipe), later calls are replays from the front's direct entry (it answers, and learns
    nothing new); every result equals the function's Python path's bit for bit (None for the norms' gradients not
    asked for)."""
    from rtckern import clear_caches
    from rtckern.testing import direct_call, without_direct_front

    def tup(v):
        return v if isinstance(v, tuple) else (v,)

    def check(got, want):
        for g, w in zip(got, want, strict=True):
            if w is None:
                assert g is None, name
                continue
            assert g.shape == w.shape and g.dtype == w.dtype and g.stride() == w.stride()
            assert torch.equal(g, w), name

    if name.split(" ")[0] in ("gemm_fp8", "quantize_fp8", "rms_norm_quant") and \
            torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89 or newer")
    clear_caches()  # (the front's recipes too)
    function, call, op, _ = _direct_case(name)
    with torch.no_grad():
        first = tup(call())
        with without_direct_front():
            check(first, tup(call()))
        assert rt.native_status()["ops"][op]["recipes"] == 1, (name, rt.native_status()["ops"][op])
        for _ in range(3):
            _, call2, _, op_args = _direct_case(name)  # new tensors of the same signature: replayed
            assert direct_call(function, *op_args) is not None, name
            got = tup(call2())
            with without_direct_front():
                want = tup(call2())
            torch.cuda.synchronize()
            check(got, want)
    assert rt.native_status()["ops"][op]["recipes"] == 1  # the replays learned no new signature


def test_dropin_entry_points_take_the_direct_entry_and_keep_autograd():
    """rtckern.torch.rms_norm / layer_norm (the patched modules' calls) through the front's direct entry equal their
    route without it bit for bit; calls needing a gradient still build the autograd graph."""
    from rtckern.testing import without_direct_front

    x, w, b = rand(4, 4096), rand(4096), rand(4096)
    with torch.no_grad():
        for _ in range(3):
            got = (rt.rms_norm(x, w, 1e-6), rt.layer_norm(x, w, b, 1e-5), rt.rms_norm(x, None, 1e-6, True))
            with without_direct_front():
                want = (rt.rms_norm(x, w, 1e-6), rt.layer_norm(x, w, b, 1e-5), rt.rms_norm(x, None, 1e-6, True))
            for g, v in zip(got, want):
                assert torch.equal(g, v) and g.stride() == v.stride() and g.dtype == v.dtype
    wp = torch.nn.Parameter(w.clone())
    assert rt.rms_norm(x, wp, 1e-6).grad_fn is not None and rt.layer_norm(x, wp, None, 1e-5).grad_fn is not None


def test_an_address_the_python_path_refuses_is_not_replayed():
    """quantize_fp8 on fp32 groups of 256 reads 32-byte vectors: an x 16 bytes off a 32-byte boundary is refused
    (InputError), also after the same shape on an aligned x was learned: the key holds each address mod 32."""
    from rtckern import InputError
    import rtckern.ops as rops

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89 or newer")
    buf = torch.randn(4 * 1024 + 8, device=DEV)
    aligned, off = buf[:4 * 1024].view(4, 1024), buf[4:4 + 4 * 1024].view(4, 1024)  # (16 bytes off)
    with torch.no_grad():
        for _ in range(3):
            rops.quantize_fp8(aligned, 256)
            ops.quantize_fp8(aligned, 256, "row")
        with pytest.raises(InputError, match="aligned to 32 bytes"):
            rops.quantize_fp8(off, 256)
        with pytest.raises(Exception, match="aligned to 32 bytes"):
            ops.quantize_fp8(off, 256, "row")


def test_norms_and_softmax_are_replayed():
    """The ops whose launches are plain (prepared launches, workspaces allocated per call) learn a recipe."""
    x, w = rand(8, 2048), rand(2048)
    s = rand(2, 8, 4, 512)
    with torch.no_grad():
        for _ in range(2):
            ops.rms_norm(x, w, 1e-6)
            ops.layer_norm(x, w, None, 1e-5)
            ops.softmax(s, 1.0)
    st = rt.native_status()["ops"]
    for name in ("rms_norm", "layer_norm", "softmax"):
        assert st[name]["recipes"] >= 1, (name, st[name])


def test_replays_follow_the_current_stream_and_capture_into_graphs():
    x, w = rand(16, 4096), rand(4096)
    with torch.no_grad():
        want = P("rms_norm")(x, w, 1e-6, False, None)  # the Python path
        ops.rms_norm(x, w, 1e-6)  # recorded
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = ops.rms_norm(x, w, 1e-6)  # replayed on the side stream
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(got, want)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            captured = ops.rms_norm(x, w, 1e-6)
        x.copy_(rand(16, 4096))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, P("rms_norm")(x, w, 1e-6, False, None))


def test_gradients_make_cpp_nodes_and_misaligned_inputs_take_the_python_kernels():
    x, w = rand(4, 1024), rand(1024)
    with torch.no_grad():
        ops.rms_norm(x, w, 1e-6)
    before = rt.native_status()["ops"]["rms_norm"]["recipes"]
    xg = x.clone().requires_grad_()
    y = ops.rms_norm(xg, w, 1e-6)  # the composite, decomposed under autograd: rms_norm_fwd's C++ autograd node
    assert y.requires_grad and "RmsNormBackward" in y.grad_fn.name()
    y.float().sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    flat = rand(4 * 1024 + 1)
    xm = flat[1:].view(4, 1024)  # 2 bytes off 16
    with torch.no_grad():
        assert torch.equal(ops.rms_norm(xm, w, 1e-6), P("rms_norm")(xm, w, 1e-6, False, None))
    assert rt.native_status()["ops"]["rms_norm"]["recipes"] == before


def rope_inputs():
    """q, k (batch, heads, seq, head_dim) and the cos / sin tables (batch, seq, head_dim), as transformers passes them."""
    pos = torch.arange(64, device=DEV, dtype=torch.float32)
    freq = 1.0 / 10000 ** (torch.arange(0, 64, 2, device=DEV, dtype=torch.float32) / 64)
    ang = torch.cat([torch.outer(pos, freq)] * 2, -1)[None]
    return rand(2, 8, 64, 64), rand(2, 2, 64, 64), ang.cos().to(BF16), ang.sin().to(BF16)


def varlen_inputs(kv_heads: int = 2):
    """q, k, v packed (total, heads, head_dim) for sequences of 37, 100 and 64 tokens, and their prefix sums (int32),
    as transformers' packed batches give attention_varlen."""
    cu = torch.tensor([0, 37, 137, 201], device=DEV, dtype=torch.int32)
    return rand(201, 8, 64), rand(201, kv_heads, 64), rand(201, kv_heads, 64), cu, cu.clone()


def _grads(fn, inputs, native_grad: bool, requires=None):
    """(grad_fn name, outputs, gradients of inputs) of fn(*leaves) through the C++ autograd nodes, or (native_grad
    False) the Python autograd.Function, from one upstream gradient per output; requires: which inputs require a
    gradient (default: the floating ones)."""
    requires = requires or [t.is_floating_point() for t in inputs]
    with contextlib.nullcontext() if native_grad else python_autograd():
        leaves = [t.detach().clone().requires_grad_(r) for t, r in zip(inputs, requires)]
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        node = outs[0].grad_fn.name()
        g = torch.Generator(device=DEV).manual_seed(1)
        ups = [torch.randn(o.shape, device=DEV, generator=g).to(o.dtype) for o in outs]
        torch.autograd.backward([o for o in outs if o.requires_grad], [u for o, u in zip(outs, ups) if o.requires_grad])
        return node, [o.detach() for o in outs], [t.grad for t in leaves]


@pytest.mark.parametrize("name", ["rms_norm", "fused_add_rms_norm", "layer_norm", "layer_norm no weight",
                                  "attention", "attention gqa", "softmax", "scaled_masked_softmax",
                                  "scaled_upper_triang_masked_softmax", "swiglu", "rope", "attention_varlen",
                                  "attention_varlen mha",
                                  "rope tables with gradients", "cross_entropy mean",
                                  "cross_entropy none", "cross_entropy z-loss"])
def test_cpp_autograd_nodes_equal_the_python_function(name):
    """A call needing a gradient of the norms, attention, softmax or swiglu makes a C++ autograd node (its forward and
    backward replayed): outputs and every input's gradient equal the Python autograd.Function's bit for bit."""
    x, w, b, r = rand(8, 2048), rand(2048), rand(2048), rand(8, 2048)
    q, kv = rand(2, 128, 8, 64), rand(2, 128, 8, 64)
    cases = {
        "rms_norm": (lambda x, w: rt.rms_norm(x, w, 1e-6), (x, w), "RmsNormBackward"),
        "fused_add_rms_norm": (lambda x, r, w: ops.fused_add_rms_norm(x, r, w, 1e-6), (x, r, w), "AddRmsNormBackward"),
        "layer_norm": (lambda x, w, b: rt.layer_norm(x, w, b, 1e-5), (x, w, b), "LayerNormBackward"),
        "layer_norm no weight": (lambda x, b: rt.layer_norm(x, None, b, 1e-5), (x, b), "LayerNormBackward"),
        "attention": (lambda q, k, v: rt.attention(q, k, v, True), (q, kv, kv.clone()), "AttentionBackward"),
        "attention gqa": (lambda q, k, v: rt.attention(q, k, v, False), (q, rand(2, 128, 2, 64), rand(2, 128, 2, 64)),
                          "AttentionBackward"),
    }
    sm, mask = rand(2, 4, 64, 64), torch.rand(2, 1, 64, 64, device=DEV) < 0.2
    logits, labels = rand(16, 1000), torch.randint(0, 1000, (16,), device=DEV)
    labels[3] = -100  # an ignored row
    cases.update({
        "softmax": (lambda s: ops.softmax(s, 0.5), (sm,), "SoftmaxBackward"),
        "scaled_masked_softmax": (lambda s, m: ops.scaled_masked_softmax(s, m, 0.5), (sm, mask), "SoftmaxBackward"),
        "scaled_upper_triang_masked_softmax": (lambda s: ops.scaled_upper_triang_masked_softmax(s, 0.5), (sm,),
                                               "SoftmaxBackward"),
        "swiglu": (lambda g, u: rt.swiglu(g, u), (rand(8, 2048), rand(8, 2048)), "SwigluBackward"),
        "attention_varlen": (lambda q, k, v, cq, ck: rt.attention_varlen(q, k, v, cq, ck, 100, 100, True),
                             varlen_inputs(), "AttentionVarlenBackward"),
        "attention_varlen mha": (lambda q, k, v, cq, ck: ops.attention_varlen(q, k, v, cq, ck, 100, 100, False, 0.1),
                                 varlen_inputs(8), "AttentionVarlenBackward"),
        "rope": (lambda q, k, c, s: rt.apply_rotary_pos_emb(q, k, c, s), rope_inputs(), "RopeBackward",
                 [True, True, False, False]),
        "rope tables with gradients": (lambda q, k, c, s: rt.apply_rotary_pos_emb(q, k, c, s), rope_inputs(),
                                       None),
        "cross_entropy mean": (lambda x, y: rt.cross_entropy(x, y), (logits, labels), "CrossEntropyBackward"),
        "cross_entropy none": (lambda x, y: rt.cross_entropy(x, y, reduction="none"), (logits, labels),
                               "CrossEntropyBackward"),
        "cross_entropy z-loss": (lambda x, y: ops.cross_entropy_fwd(x, y, -100, "sum")[:2], (logits, labels),
                                 "CrossEntropyBackward"),
    })
    fn, inputs, node, *requires = cases[name]
    requires = requires[0] if requires else None
    for _ in range(2):  # the first calls record, the second replay
        got = _grads(fn, inputs, True, requires)
    want = _grads(fn, inputs, False, requires)
    assert "CppNode" not in want[0] and (node in got[0] if node else "CppNode" not in got[0]), (got[0], want[0])
    for a, e in zip(got[1] + got[2], want[1] + want[2]):
        assert (a is None and e is None) or torch.equal(a, e)  # (None: the mask's gradient)


@pytest.mark.parametrize("name", ["rms_norm weight frozen", "fused_add_rms_norm weight frozen",
                                  "layer_norm bias frozen", "layer_norm weight frozen", "rms_norm_fwd no rstd",
                                  "layer_norm_fwd no stats", "attention_fwd no lse", "attention_varlen_fwd no lse",
                                  "attention_varlen k frozen"])
def test_cpp_autograd_nodes_frozen_inputs_and_recomputed_statistics(name):
    """Inputs that need no gradient (a frozen weight or bias: the backward op is asked for fewer gradients) and a
    forward called without its statistics (the backward recomputes them): equal to the Python Function's bit for
    bit."""
    x, w, b, r = rand(8, 2048), rand(2048), rand(2048), rand(8, 2048)
    q, kv = rand(2, 128, 8, 64), rand(2, 128, 2, 64)
    cases = {
        "rms_norm weight frozen": (lambda x, w: rt.rms_norm(x, w, 1e-6), (x, w), [True, False]),
        "fused_add_rms_norm weight frozen": (lambda x, r, w: ops.fused_add_rms_norm(x, r, w, 1e-6), (x, r, w),
                                             [True, True, False]),
        "layer_norm bias frozen": (lambda x, w, b: rt.layer_norm(x, w, b, 1e-5), (x, w, b), [True, True, False]),
        "layer_norm weight frozen": (lambda x, w, b: rt.layer_norm(x, w, b, 1e-5), (x, w, b), [True, False, True]),
        "rms_norm_fwd no rstd": (lambda x, w: ops.rms_norm_fwd(x, w, 1e-6, False, None, False)[0], (x, w), None),
        "layer_norm_fwd no stats": (lambda x, w, b: ops.layer_norm_fwd(x, w, b, 1e-5, False, None, False)[0],
                                    (x, w, b), None),
        "attention_fwd no lse": (lambda q, k, v: ops.attention_fwd(q, k, v, True, None, False)[0], (q, kv, kv),
                                 None),
        "attention_varlen_fwd no lse": (
            lambda q, k, v, cq, ck: ops.attention_varlen_fwd(q, k, v, cq, ck, 100, 100, True, None, False)[0],
            varlen_inputs(), None),
        "attention_varlen k frozen": (lambda q, k, v, cq, ck: rt.attention_varlen(q, k, v, cq, ck, 100, 100, True),
                                      varlen_inputs(), [True, False, True, False, False]),
    }
    fn, inputs, requires = cases[name]
    for _ in range(2):
        got = _grads(fn, inputs, True, requires)
    want = _grads(fn, inputs, False, requires)
    assert "CppNode" in got[0] and "CppNode" not in want[0], (got[0], want[0])
    for a, e in zip(got[1] + got[2], want[1] + want[2]):
        assert (a is None and e is None) or torch.equal(a, e)


def test_cpp_autograd_node_computes_only_the_gradients_asked_for():
    """The node asks the engine which inputs this backward needs (as torch's own nodes do): autograd.grad of x alone
    does not compute the weight's gradient, and x's equals the one of a full backward."""
    x, w, dy = rand(8, 2048).requires_grad_(), rand(2048).requires_grad_(), rand(8, 2048)
    y = rt.rms_norm(x, w, 1e-6)
    assert "RmsNormBackward" in y.grad_fn.name()
    (dx_alone,) = torch.autograd.grad(y, [x], dy, retain_graph=True)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    assert dw is not None and torch.allclose(dx_alone.float(), dx.float(), rtol=1e-2, atol=1e-2)


def test_inference_mode_calls_replay():
    """Under torch.inference_mode() the dispatcher skips the autograd keys: the front's kernel at the CUDA key
    records and replays (bit-equal to the Python path), and a misaligned input takes the op's Python implementation."""
    with torch.inference_mode():
        x, w = rand(6, 3072), rand(3072)
        want = P("rms_norm")(x, w, 1e-5, False, None)
        before = rt.native_status()["ops"]["rms_norm"]["recipes"]
        for _ in range(3):
            assert torch.equal(ops.rms_norm(x, w, 1e-5), want)
        assert rt.native_status()["ops"]["rms_norm"]["recipes"] == before + 1
        xm = rand(6 * 3072 + 1)[1:].view(6, 3072)
        assert torch.equal(ops.rms_norm(xm, w, 1e-5), P("rms_norm")(xm, w, 1e-5, False, None))
