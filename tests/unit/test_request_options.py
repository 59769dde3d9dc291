"""Request-builder options (rtckern.registry.options) and the built-in families' builders: unknown keys refused,
booleans parsed strictly, vec checked, every accepted spelling giving the same request (issue 20)."""
import pytest

import rtckern.ops  # noqa: F401  (registers the families' request builders)
from rtckern.errors import OptionError
from rtckern.registry import build_request
from rtckern.registry import options as opts


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "yes", "On", " on ", True, 1])
def test_true_spellings(text):
    assert opts.parse_bool("op", "f", text) is True


@pytest.mark.parametrize("text", ["0", "false", "No", "off", False, 0])
def test_false_spellings(text):
    assert opts.parse_bool("op", "f", text) is False


@pytest.mark.parametrize("value", ["", "2", "maybe", "y", "t", "１", 2, None, 1.0])
def test_anything_else_is_not_a_boolean(value):
    with pytest.raises(OptionError, match=rf"^op: option f={value!r} is not a boolean; write 1/0, true/false, "
                                          r"yes/no or on/off$"):
        opts.parse_bool("op", "f", value)


def test_ints_are_ascii_and_bounded():
    assert opts.parse_int("op", "n", " 12 ") == 12 and opts.parse_int("op", "n", 3) == 3
    for bad in ("１２", "1_2", "1.5", "0x10", "", True):
        with pytest.raises(OptionError, match=r"is not an integer"):
            opts.parse_int("op", "n", bad)
    with pytest.raises(OptionError, match=r"^op: option n=0 is below 1; write a whole number >= 1$"):
        opts.parse_int("op", "n", "0")


@pytest.mark.parametrize("op, shape, options", [
    ("rms_norm", "8x4096", {"residul": "1"}),
    ("layer_norm_backward", "8x4096", {"residual": "1"}),
    ("softmax", "8x4096", {"mask16": "1"}),
    ("scaled_masked_softmax", "8x4096", {"vek": "4"}),
    ("gemm", "64x64x64", {"bais": "1"}),
    ("attention", "128", {"casual": "1"}),
])
def test_every_family_refuses_unknown_keys(op, shape, options):
    with pytest.raises(OptionError, match=rf"^op '{op}' takes no option\(s\) \['{next(iter(options))}'\]; its "
                                          r"options: \["):
        build_request(op, shape=shape, dtype="fp16", arch="sm_90", options=options)


@pytest.mark.parametrize("op, shape, name", [
    ("rms_norm", "8x4096", "residual"), ("layer_norm_backward", "8x4096", "dresidual"),
    ("scaled_masked_softmax", "8x4096", "mask16"), ("gemm", "64x64x64", "bias"), ("attention", "128", "causal"),
])
def test_every_spelling_gives_one_request_and_bad_ones_are_refused(op, shape, name):
    on = {build_request(op, shape=shape, dtype="fp16", arch="sm_90", options={name: v})
          for v in ("1", "true", "yes", "on", True)}
    off = {build_request(op, shape=shape, dtype="fp16", arch="sm_90", options={name: v})
           for v in ("0", "false", "no", "off", False)}
    assert len(on) == len(off) == 1 and on != off
    with pytest.raises(OptionError, match=rf"option {name}='2' is not a boolean"):
        build_request(op, shape=shape, dtype="fp16", arch="sm_90", options={name: "2"})


@pytest.mark.parametrize("op, vec, message", [
    ("rms_norm", "3", r"^rms_norm: option vec=3 does not fit; vec is a power of two from 1 to 8 .* divides N=4096"),
    ("rms_norm", "16", r"option vec=16 does not fit; vec is a power of two from 1 to 8"),
    ("softmax", "-4", r"^softmax: option vec=-4 is below 1"),
    ("softmax", "0", r"^softmax: option vec=0 is below 1"),
    ("layer_norm", "abc", r"^layer_norm: option vec='abc' is not an integer"),
])
def test_vec_is_checked(op, vec, message):
    with pytest.raises(OptionError, match=message):
        build_request(op, shape="8x4096", dtype="fp16", arch="sm_90", options={"vec": vec})
    assert build_request(op, shape="8x4096", dtype="fp16", arch="sm_90", options={"vec": "2"}).dim("vec") == 2


@pytest.mark.parametrize("sm_count", [0, -5, True, "132", 1.5])
def test_a_described_device_needs_a_positive_sm_count(sm_count):
    from rtckern.device import DeviceInfo

    with pytest.raises(OptionError, match=rf"^sm_count={sm_count!r}: a described device needs a positive SM count"):
        DeviceInfo.for_arch("sm_90", sm_count=sm_count)
    assert DeviceInfo.for_arch("sm_90", sm_count=None).sm_count == 132
