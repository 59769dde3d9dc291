"""Every op family has a HIP candidate: on a described gfx90a device the registry chooses one after a real
hiprtc compile (compile-only probe). Skips without hiprtc, except under CI where .ci/run installs it."""

import os

import pytest

import rtckern
import rtckern.ops  # noqa: F401 - registers the families


@pytest.fixture(scope="module", autouse=True)
def hiprtc():
    from rtckern.compiler.hiprtc import HiprtcCompiler, HiprtcUnavailable

    try:
        HiprtcCompiler()
    except HiprtcUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must have hiprtc (.ci/run installs it): {e}")
        pytest.skip(f"no hiprtc here: {e}")


@pytest.mark.parametrize("op, shape, chosen", [
    ("rms_norm", "1024x4096", "rms_norm.rows"), ("layer_norm", "1024x4096", "layer_norm.rows"),
    ("softmax", "1024x4096", "softmax.onepass"), ("attention", "2x128x8x64", "attention.simt"),
    ("gemm", "256x256x256", "gemm.simt"),
])
def test_each_family_has_a_hip_candidate(cache_dir, op, shape, chosen):
    e = rtckern.explain(op, dtype="fp16", shape=shape, arch="gfx90a")
    assert e.chosen == chosen
    nvidia_only = [r for r in e.results if not r.accepted]
    assert all(any("nvidia only" in str(x) for x in r.reasons) for r in nvidia_only), nvidia_only
