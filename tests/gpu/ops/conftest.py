"""What the ops' GPU tests share: outputs that start as NaN, so an element a kernel does not write fails the test.
A test module asks for one with `pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_outputs")]`."""
from __future__ import annotations

import pytest


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output an op allocates through rtckern's allocator (runtime.arrays.empty, torch or CuPy) starts as NaN."""
    from rtckern.runtime import arrays as arr

    real = arr.empty

    def poisoned(like, shape, dtype):
        out, ptr = real(like, shape, dtype)
        (out.fill_ if hasattr(out, "fill_") else out.fill)(float("nan"))  # torch / CuPy
        return out, ptr

    monkeypatch.setattr(arr, "empty", poisoned)


@pytest.fixture
def poisoned_torch_outputs(monkeypatch):
    """Every floating-point tensor torch.empty / torch.empty_strided makes starts as NaN: for the ops whose memoized
    hot path allocates with torch directly."""
    import torch

    for name in ("empty", "empty_strided"):
        def poisoned(*args, _real=getattr(torch, name), **kwargs):
            out = _real(*args, **kwargs)
            return out.fill_(float("nan")) if out.is_floating_point() else out

        monkeypatch.setattr(torch, name, poisoned)


@pytest.fixture
def nan_guarded():
    """guarded(rows, heads, head_dim) -> a random bf16 (rows, heads, head_dim) tensor on the GPU that is a view
    between 64 NaN rows on each side: a kernel reading a row outside it brings NaN into its result."""
    import torch

    def guarded(rows: int, heads: int, head_dim: int, guard: int = 64):
        buf = torch.full((rows + 2 * guard, heads, head_dim), float("nan"), device="cuda", dtype=torch.bfloat16)
        buf[guard:guard + rows] = torch.randn(rows, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        return buf[guard:guard + rows]
    return guarded
