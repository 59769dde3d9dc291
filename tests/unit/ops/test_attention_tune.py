"""The attention tuner without a GPU: which candidate's tiles it times per device and head dim, that every tile it
offers fits the device's shared memory and is one the candidate reads back from a table row, and its table key."""
from __future__ import annotations

import pytest

import rtckern.ops  # noqa: F401  (registers the attention candidates and tuner)
from rtckern import tuning
from rtckern.registry import build_request, candidates


def tuner():
    return tuning.get_tuner("attention")


@pytest.mark.parametrize("arch, shape, impl", [("sm_90", (4, 4096, 16, 128), "attention.sm90a_ws"),
                                               ("sm_90", (96,), "attention.sm90a_ws"),
                                               ("sm_86", (96,), "attention.sm80_mma"),
                                               ("sm_80", (64,), "attention.sm80_mma"),
                                               ("sm_86", (256,), "attention.sm80_mma")])
@pytest.mark.parametrize("causal", ["0", "1"])
def test_configs_fit_and_read_back(arch, shape, impl, causal):
    req = build_request("attention", shape=shape, dtype="bf16", arch=arch, sm_count=132,
                        options={"causal": causal})
    key = tuner().key(req)
    assert key == {"impl": impl, "dtype": "bf16", "head_dim": shape[-1], "causal": int(causal)}
    cand = next(c for c in candidates("attention") if c.name == impl)
    cfgs = tuner().configs(req)
    assert len(cfgs) >= 2 and len({tuple(sorted(c.items())) for c in cfgs}) == len(cfgs)
    kernel_dim = 128 if (impl, shape[-1]) == ("attention.sm90a_ws", 96) else shape[-1]  # 96 runs the 128 kernel
    for c in cfgs:
        tile = cand.tile_from_config(c)
        assert tile is not None, c
        assert tile.smem_bytes(kernel_dim) <= req.device.max_smem_per_block_optin
    assert cand.tile_from_config(cfgs[0]) == cand.default_tile(shape[-1], causal == "1", req.device)


def test_full_shape_is_kept_for_timing():
    req = build_request("attention", shape=(2, 1024, 8, 64), dtype="fp16", arch="sm_90", sm_count=132)
    assert (req.dim("batch"), req.dim("seqlen"), req.dim("heads"), req.dim("head_dim")) == (2, 1024, 8, 64)
    assert tuner().key(req)["dtype"] == "fp16"


def test_timing_needs_a_live_gpu():
    req = build_request("attention", shape=(128,), dtype="bf16", arch="sm_90", sm_count=132)
    with pytest.raises(Exception, match="live GPU"):
        tuning.tune_request(tuner(), req)
