"""The ring softmax kernels' launch planning (rtckern/ops/_softmax/ring.py) and their per-kind tuning tables; the
kernels themselves are compiled by test_softmax.py's NVRTC tests and run by tests/gpu/ops/test_softmax.py."""
from __future__ import annotations

import json

import pytest

from rtckern import config, tuning
from rtckern.device import DeviceInfo
from rtckern.ops._softmax import configs, geometry, ring, tune
from rtckern.ops._softmax.geometry import BWD, CAUSAL, FWD, MASKED, PLAIN
from rtckern.registry import build_request, default_registry

H100_OPTIN = 232448


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path / "shipped")
    with config.override(tuning_table_dir=tmp_path / "tuning", persist_decisions=False):  # empties every memo
        yield tmp_path / "tuning"


def _request(op, n, vec, dev, mask16=None):
    options = {"vec": str(vec)} if mask16 is None else {"vec": str(vec), "mask16": str(int(mask16))}
    return build_request(op, shape=(n,), dtype="bf16", device=dev, options=options)


def test_ring_validates_its_shape():
    with pytest.raises(ValueError, match="rows must be a multiple"):
        ring.Ring(warps=8, group=32, items=4, rows=4, slots=2)
    with pytest.raises(ValueError, match="block-wide group takes one row"):
        ring.Ring(warps=8, group=256, items=2, rows=2, slots=4)
    with pytest.raises(ValueError, match="warps 1..16"):
        ring.Ring(warps=17, group=32, items=1, rows=17, slots=2)
    with pytest.raises(ValueError, match="at most 32"):
        ring.Ring(warps=16, group=16, items=1, rows=64, slots=2)


def test_shared_memory_and_grid_arithmetic():
    cfg = ring.Ring(warps=8, group=32, items=4, rows=8, slots=4)
    assert cfg.threads == 288 and cfg.chunk("bf16") == 1024 and cfg.chunk("fp32") == 512
    # barriers (2 x 4 x 8 B, rounded to 128) + 4 slots x 8 rows x 1024 keys x 2 B; a mask adds a byte per key.
    assert cfg.smem_bytes(FWD, PLAIN, "bf16") == 128 + 4 * 8 * 1024 * 2
    assert cfg.smem_bytes(FWD, MASKED, "bf16") == 128 + 4 * 8 * 1024 * 3
    assert cfg.smem_bytes(BWD, PLAIN, "bf16") == 128 + 4 * 8 * 1024 * 4
    assert cfg.grid(rows=1000, sm_count=132, blocks_per_sm=3) == 125  # 125 tiles of 8 rows: never more blocks
    assert cfg.grid(rows=1 << 20, sm_count=132, blocks_per_sm=3) == 396  # persistent: what fits at once


@pytest.mark.parametrize("direction,kind", [(FWD, PLAIN), (FWD, MASKED),
                                            (FWD, CAUSAL), (BWD, PLAIN)])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("n", [8, 1000, 1024, 4096, 16384, 65536, 100000])
def test_default_and_sweep_configs_hold_the_row(direction, kind, dtype, n):
    cfg = ring.default_ring(direction, kind, dtype, n, H100_OPTIN)
    row_bytes = n * (geometry.ELEM_BYTES[dtype] * (2 if direction == BWD else 1) + (kind == MASKED))
    if cfg is None:
        assert row_bytes > 150_000  # only rows that cannot share the ring with a chunk of the next are refused
        assert ring.sweep_rings(direction, kind, dtype, n, H100_OPTIN) == []
        return
    assert ring.fits(cfg, direction, kind, dtype, n, H100_OPTIN) is None
    for c in ring.sweep_rings(direction, kind, dtype, n, H100_OPTIN):
        assert ring.fits(c, direction, kind, dtype, n, H100_OPTIN) is None
        assert c.chunks_per_row(dtype, n) <= c.slots


def test_fits_names_the_limits():
    cfg = ring.Ring(warps=8, group=256, items=2, rows=1, slots=4)
    assert "takes 16 chunks" in ring.fits(cfg, FWD, PLAIN, "bf16", 65536, H100_OPTIN)
    big = ring.Ring(warps=8, group=256, items=2, rows=1, slots=40)
    assert "shared memory" in ring.fits(big, FWD, PLAIN, "bf16", 4096, H100_OPTIN)


def test_kind_tables_and_plain_fallback(fresh):
    assert configs.table(FWD, MASKED) == "softmax_masked"
    # the backward of a masked softmax is plain
    assert configs.table(BWD, MASKED) == "softmax_backward"
    assert configs.table(BWD, CAUSAL, True) == "softmax_ring_backward_causal"
    dev = DeviceInfo.for_arch("sm_90")

    def row(n, cfg, us):
        return tuning.Row(arch="sm_90", sm_count=132, shape=(("dtype", "bf16"), ("vec", 8), ("n", n)), config=cfg,
                          meta={"time_us": us})

    plain = {"threads": 128, "group": 32, "items": 4, "min_blocks": 8, "kernel": "regs"}
    causal = {"threads": 128, "group": 128, "items": 0, "min_blocks": 1, "kernel": "async"}
    tuning.merge_rows("softmax", configs.KEY_FIELDS, [row(1024, plain, 150.0)], fresh / "softmax.json")
    tuning.merge_rows("softmax_causal", configs.KEY_FIELDS, [row(1024, causal, 120.0)], fresh / "softmax_causal.json")
    assert configs.tuned_onepass(FWD, "bf16", 1024, 8, dev, CAUSAL)[0] == geometry.OnePass(**causal)
    assert configs.tuned_onepass(FWD, "bf16", 1024, 8, dev, MASKED)[0] == geometry.OnePass(**plain)
    assert json.loads((fresh / "softmax_causal.json").read_text())["op"] == "softmax_causal"


def test_the_ring_ranks_first_where_the_tables_measured_it_faster(fresh):
    from rtckern.registry import select

    dev = DeviceInfo.for_arch("sm_90")
    one = {"threads": 128, "group": 32, "items": 4, "min_blocks": 8, "kernel": "regs"}
    rng = {"warps": 8, "group": 32, "items": 4, "rows": 8, "slots": 4, "min_blocks": 1}

    def put(name, fields, shape, cfg, us):
        r = tuning.Row(arch="sm_90", sm_count=132, shape=shape, config=cfg, meta={"time_us": us})
        tuning.merge_rows(name, fields, [r], fresh / f"{name}.json")

    def ranking(req):
        return [(c.name.split(".")[1], cost and round(cost.value, 4)) for c, cost in default_registry().rank(req)[0]]

    put("softmax", configs.KEY_FIELDS, (("dtype", "bf16"), ("vec", 8), ("n", 1024)), one, 150.0)
    put("softmax_ring", configs.RING_KEY_FIELDS, (("dtype", "bf16"), ("n", 1024)), rng, 160.0)
    req = _request("softmax", 1024, 8, dev)
    assert ranking(req) == [("onepass", 1.0), ("ring", round(160 / 150, 4)), ("online", None)]
    assert select(req).name == "softmax.onepass"
    # The masked kind has its own measurements: the ring wins there; the one-pass kernel can still serve (next).
    put("softmax_masked", configs.KEY_FIELDS, (("dtype", "bf16"), ("vec", 8), ("n", 1024)), one, 190.0)
    put("softmax_ring_masked", configs.RING_KEY_FIELDS, (("dtype", "bf16"), ("n", 1024)), rng, 170.0)
    mreq = _request("scaled_masked_softmax", 1024, 8, dev)
    assert default_registry().get("scaled_masked_softmax.onepass").supports(mreq) is None
    assert ranking(mreq) == [("ring", 1.0), ("onepass", round(190 / 170, 4)), ("online", None)]
    cost = default_registry().get("scaled_masked_softmax.onepass").cost(mreq)
    assert cost.source == "table" and cost.detail == "tuned on sm_90 at n=1024 bf16: ring 170.0 us, one-pass 190.0 us"
    assert select(mreq).name == "scaled_masked_softmax.ring"
    # A row length between tuned ones compares the nearest row both tables hold (same problem size, same timing).
    near = _request("scaled_masked_softmax", 1280, 8, dev)
    assert "at n=1024" in default_registry().get("scaled_masked_softmax.onepass").cost(near).detail
    # Forced, or where the ring cannot serve (an unaligned mask), the one-pass kernel serves.
    with config.override(force_impl={"scaled_masked_softmax": "scaled_masked_softmax.onepass"}):
        assert select(mreq).name == "scaled_masked_softmax.onepass"
    unaligned = _request("scaled_masked_softmax", 1024, 8, dev, mask16=False)
    assert [name for name, _ in ranking(unaligned)] == ["onepass", "online"]
    assert select(unaligned).name == "scaled_masked_softmax.onepass"


def test_masked_ring_chunks_must_be_whole_bulk_copies():
    small = ring.Ring(warps=1, group=1, items=1, rows=32, slots=4)  # fp32 chunk of 4 keys: 4 mask bytes
    assert "multiples of 16" in ring.fits(small, FWD, MASKED, "fp32", 16, H100_OPTIN)
    assert ring.fits(small, FWD, PLAIN, "fp32", 16, H100_OPTIN) is None
    with pytest.raises(ValueError, match="rows, slots"):
        ring.Ring(warps=1, group=32, items=1, rows=0, slots=2)


def test_tune_problem_matches_the_benchmark_shapes():
    dev = DeviceInfo.for_arch("sm_90")
    g, mask_rows = tune.tune_problem(FWD, MASKED, 4096, dev)
    assert (g.sq, g.heads, mask_rows, g.rows, g.mask_batch_stride) == (1024, 16, 2048, 32768, 1024)  # 2x16x1024x4096
    g, _ = tune.tune_problem(FWD, CAUSAL, 16384, dev)
    assert (g.rows, g.sq, g.diag_offset) == (8192, 8192, 8192)  # 1 x 8192 x 16384, bottom-right aligned
    g, _ = tune.tune_problem(BWD, MASKED, 1024, dev)
    assert g.sq == 1 and g.rows == 131072  # the masked backward is the plain problem


def _ring_sweep_expressions() -> list[str]:
    """Every ring config the sweep times on sm_90 (each mask kind and dtype, the row lengths of the tuning tables)."""
    smem = DeviceInfo.for_arch("sm_90").max_smem_per_block_optin
    exprs = set()
    for direction in (FWD, BWD):
        for dt in geometry.CTYPES:
            for n in (1024, 4096, 8192, 16384, 65536):
                for kind in (PLAIN, MASKED, CAUSAL) if direction == FWD else (PLAIN,):
                    for r in ring.sweep_rings(direction, kind, dt, n, smem):
                        args = ", ".join(map(str, r.template_args(direction, kind, dt)))
                        exprs.add(f"{ring.kernel_name(direction)}<{args}>")
    return sorted(exprs)


def _ring_sample() -> list[str]:
    """A fixed 1-in-2 sample of the sweep's configs (CI under ten minutes on two cores; `rtckern tune` compiles and
    checks on the GPU every config it times)."""
    exprs = _ring_sweep_expressions()
    return exprs[::2] + exprs[-1:]


def _ring_sweep_specs() -> list:
    from rtckern.testing import name_expression_specs

    return name_expression_specs(geometry.SOURCE, _ring_sample(), "sm_90")


@pytest.mark.compiles(builder=_ring_sweep_specs)
def test_every_ring_variant_compiles_with_nvrtc():
    """The ring configs the sweep times on sm_90 (a fixed half of them), as name expressions, several to an NVRTC
    program, on every core (a real compile of each)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from rtckern.testing import compile_name_expressions

    assert len(_ring_sweep_expressions()) > 50
    failures = compile_name_expressions(geometry.SOURCE, _ring_sample(), "sm_90")
    assert not failures, "\n".join(failures)
