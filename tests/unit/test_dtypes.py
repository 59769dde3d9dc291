"""The one dtype table and its parser."""
from __future__ import annotations

import numpy as np
import pytest

from rtckern import dtypes
from rtckern.errors import InputError


def test_table_entries():
    assert [dtypes.ctype(n) for n in dtypes.FLOATS] == ["float", "rtk_half", "rtk_bf16"]
    assert [dtypes.itemsize(n) for n in dtypes.FLOATS] == [4, 2, 2]
    assert dtypes.itemsize("fp8_e4m3") == 1 and dtypes.lookup("fp8_e5m2").torch == "float8_e5m2"
    assert dtypes.itemsize("int64") == 8 and dtypes.ctype("bool") == "bool"
    assert dtypes.name_of_torch("bfloat16") == "bf16" and dtypes.name_of_torch("float64") == "float64"
    assert dtypes.name_of_numpy("float16") == "fp16" and dtypes.name_of_numpy("bfloat16") == "bf16"
    assert dtypes.describe(("bf16", "fp16")) == "bf16, fp16 (bfloat16, float16)"
    assert [dtypes.unit_roundoff(n) for n in dtypes.FLOATS] == [2.0 ** -24, 2.0 ** -11, 2.0 ** -8]


@pytest.mark.parametrize("value,name", [
    ("fp32", "fp32"), ("float32", "fp32"), ("float", "fp32"), ("FP16", "fp16"), ("half", "fp16"),
    ("bfloat16", "bf16"), (np.float16, "fp16"), (np.dtype("float32"), "fp32"), (np.bool_, "bool"),
    (dtypes.lookup("bf16"), "bf16"),
])
def test_parse_spellings(value, name):
    assert dtypes.parse_dtype(value, "out_dtype", allowed=dtypes.TABLE) == name


def test_parse_torch_dtypes():
    torch = pytest.importorskip("torch")
    assert dtypes.parse_dtype(torch.bfloat16, "out_dtype") == "bf16"
    assert dtypes.parse_dtype(torch.float32, "out_dtype") == "fp32"
    assert dtypes.torch_dtype("fp16") is torch.float16 and dtypes.torch_dtype("int32") is torch.int32
    for n, d in dtypes.TABLE.items():
        assert getattr(torch, d.torch).itemsize == d.itemsize, n


def test_parse_refuses_with_the_accepted_names():
    with pytest.raises(InputError, match=r"^out_dtype='int8' is not supported; pass one of fp32, fp16, bf16 "
                                         r"\(float32, float16, bfloat16\) as a string or a torch / numpy dtype, "
                                         r"or None for x's dtype$"):
        dtypes.parse_dtype("int8", "out_dtype", default="x's dtype")
    with pytest.raises(InputError, match=r"^dtype='int32' is not supported; pass one of bf16, fp16 "):
        dtypes.parse_dtype("int32", "dtype", allowed=("bf16", "fp16"))
    with pytest.raises(InputError, match=r"^out_dtype=dtype\(.float64.\) is not supported"):
        dtypes.parse_dtype(np.dtype("float64"), "out_dtype")
