"""`rtckern tune grouped_gemm` / `grouped_gemm_fp8` without a GPU: the tiles they time, their keys and refusals, the
shipped MoE shape lists, the rows they merge, and how the candidates read them (own rows exact then nearest, a row
whose tile cannot serve the call left for the rule, explain naming the row); the tiles the shipped rows name compile
without spills."""
from __future__ import annotations

import dataclasses
import json

import pytest

import rtckern.ops  # noqa: F401  (registers the grouped ops, their request builders and tuners)
from rtckern import config, tuning
from rtckern.cli import build_parser
from rtckern.device import DeviceInfo
from rtckern.registry import build_request, candidates

H100 = DeviceInfo.for_arch("sm_90", sm_count=132, device_class="h100-sxm")
LIVE = dataclasses.replace(H100, name="NVIDIA H100 80GB HBM3", ordinal=0, memory_bytes=80 << 30)
OPS = ("grouped_gemm", "grouped_gemm_fp8")


def _req(op, shape, device=H100, dtype=None, **opts):
    return build_request(op, shape=shape, dtype=dtype, device=device, options=opts)


def _run(argv, capsys, rc=0):
    args = build_parser().parse_args(argv)
    got = args.func(args)
    out = capsys.readouterr()
    assert got == rc, out.err
    return out


@pytest.mark.parametrize("op", OPS)
def test_the_sweep_leaves_out_padding_tiles_and_every_tile_serves(op):
    t = tuning.get_tuner(op)
    assert t.key(_req(op, "64x100x4096x7168")) == dict(
        {"mode": "contiguous"}, **({"dtype": "bf16", "layout": "tn"} if op == "grouped_gemm" else {}),
        out="bf16", groups=64, rows=128, n=4096, k=7168)
    sizes = {}
    for rows in (16, 64, 128, 256, 1024):
        req = _req(op, f"256x{rows}x4096x7168")
        cfgs = t.configs(req)
        assert cfgs and len({json.dumps(c, sort_keys=True) for c in cfgs}) == len(cfgs)
        assert all(t.valid(c, t.key(req)) for c in cfgs)
        tallest = max(c["bm"] for c in cfgs)
        assert tallest == (64 if rows <= 64 else 128 if rows <= 128 else 256), rows
        sizes[rows] = len(cfgs)
    assert sizes[16] < sizes[128] <= sizes[1024]
    # the rule's tile is among those timed, for both modes
    for mode in ("contiguous", "masked"):
        req = _req(op, "8x128x7168x2048", mode=mode)
        (cand,) = [c for c in candidates(op) if c.name.endswith("sm90a_wgmma")]
        with tables_off():
            assert cand.config(req).as_dict() in t.configs(req)


def tables_off():
    from rtckern.testing import without_tuning_tables

    return without_tuning_tables()


@pytest.mark.parametrize("op, device, opts, match", [
    ("grouped_gemm", DeviceInfo.for_arch("sm_89"), {}, r"wgmma tiles to tune on sm_90 .* only"),
    ("grouped_gemm", H100, {"aligned": "0"}, r"16-byte aligned operands"),
    ("grouped_gemm_fp8", DeviceInfo.for_arch("sm_80"), {}, r"tiles to tune on sm_90 .* only"),
])
def test_validate_refuses_what_has_no_tiles_to_tune(op, device, opts, match):
    with pytest.raises(ValueError, match=match):
        tuning.get_tuner(op).validate(_req(op, "8x128x4096x7168", device, **opts))


def test_the_shipped_moe_shape_lists_parse_as_grouped_shapes():
    from rtckern.commands.tune import read_shapes

    for name in ("deepseek-v3-moe", "deepseek-v3-moe-decode"):
        shapes, _ = read_shapes(name)
        dims = [tuple(int(x) for x in s.split("x")) for s in shapes]
        assert all(len(d) == 4 and d[3] % 16 == 0 for d in dims), name
        assert {(n, k) for _, _, n, k in dims} == {(4096, 7168), (7168, 2048)}
        for op in OPS:  # every shape builds a request (the tuner validates it before timing)
            tuning.get_tuner(op).validate(_req(op, shapes[0]))
    shapes, _ = read_shapes("deepseek-v3-moe")
    assert {"8x16x4096x7168", "256x128x4096x7168", "64x1024x7168x2048"} <= set(shapes)


def _fake_seconds(cfg) -> float:
    """Injected timings: wider tiles faster, deeper rings a little faster."""
    return 1e-3 / (cfg["bm"] * cfg["bn"]) - cfg["stages"] * 1e-9


@pytest.fixture
def tuned(tmp_path, monkeypatch):
    from rtckern.commands import tune as tune_cmd

    for op in OPS:
        t = tuning.get_tuner(op)
        monkeypatch.setattr(t, "measure", lambda req, cfg: _fake_seconds(cfg))
        monkeypatch.setattr(t, "prepare", lambda req, cfgs: None)  # no compiles: nothing is timed
    monkeypatch.setattr(tune_cmd, "live_device", lambda ordinal, command: LIVE)
    monkeypatch.setattr(tuning, "versions", lambda device: {"device": device.name})
    with tables_off(), config.override(tuning_table_dir=tmp_path / "user"):
        yield tmp_path


@pytest.mark.parametrize("op", OPS)
def test_tuned_rows_serve_their_class_exact_then_nearest_and_explain_names_them(op, tuned, capsys):
    _run(["tune", op, "--shapes", "64x128x4096x7168,8x16x4096x7168"], capsys)
    _run(["tune", op, "--shapes", "8x64x4096x7168", "--opt", "mode=masked"], capsys)
    doc = json.loads((tuned / "user" / f"{op}.json").read_text())
    assert doc["op"] == op and len(doc["rows"]) == 3
    assert all(r["device_class"] == "h100-sxm" and r["source"].startswith(f"rtckern tune {op} --") for r in doc["rows"])
    (cand,) = [c for c in candidates(op) if c.name.endswith("sm90a_wgmma")]

    def served(shape, **opts):
        req = _req(op, shape, LIVE, **opts)
        cfg, found = cand.tuned(req)
        return cfg.as_dict(), found

    cfg, found = served("64x128x4096x7168")
    assert (cfg["bm"], cfg["bn"], found.source, found.match) == (128, 256, "exact", "class")
    cfg, found = served("64x200x4096x7168")  # rows class 256: the nearest row (128 rows)
    assert (cfg["bm"], cfg["bn"], found.source) == (128, 256, "nearest")
    cfg, found = served("8x16x4096x7168")
    assert (cfg["bm"], found.source) == (64, "exact")
    cfg, found = served("8x64x4096x7168", mode="masked")
    assert (cfg["bm"], found.source) == (64, "exact")
    # a row whose tile cannot serve its call (a 4096-group tile prefix beside a ring that fills shared memory, as a
    # hand-edited table may hold): the rule serves instead
    deep = {"grouped_gemm": {"kind": "sm90", "bm": 128, "bn": 128, "stages": 7, "consumers": 2},
            "grouped_gemm_fp8": {"kind": "sm90", "bm": 128, "bn": 256, "stages": 4, "consumers": 2}}[op]
    big = tuning.get_tuner(op).key(_req(op, "4096x128x4096x7168"))
    tuning.merge_rows(op, tuning.get_tuner(op).key_fields, [tuning.Row(
        "sm_90", 132, tuple(big.items()), deep, device_class="h100-sxm")], tuned / "user" / f"{op}.json")
    with tables_off():
        rule = cand.config(_req(op, "4096x128x4096x7168", LIVE)).as_dict()
    cfg, found = served("4096x128x4096x7168")
    assert found is None and cfg == rule != {**rule, **deep}
    out = _run(["explain", op, "--shape", "64x128x4096x7168", "--arch", "sm_90", "--sm-count", "132",
                "--device-class", "h100-sxm", "--first"], capsys).out
    assert "from the exact row" in out and "class h100-sxm" in out
    out = _run(["explain", op, "--shape", "4096x128x4096x7168", "--arch", "sm_90", "--sm-count", "132",
                "--device-class", "h100-sxm", "--first"], capsys).out
    assert "by the rule" in out


def _shipped_tiles() -> list:
    """The kernels of every tile the shipped grouped tables name, for both modes (contiguous / masked) and every
    output dtype of the rows, on sm_90a."""
    specs = []
    for op in OPS:
        table = tuning.load_table(tuning.shipped_table_path(op), op)
        (cand,) = [c for c in candidates(op) if c.name.endswith("sm90a_wgmma")]
        for row in table.rows:
            shape = dict(row.shape)
            layout = {"trans_b": "1" if shape["layout"] == "tn" else "0"} if "layout" in shape else {}
            req = _req(op, (shape["groups"], shape["rows"], shape["n"], shape["k"]),
                       dataclasses.replace(H100, sm_count=row.sm_count, device_class=row.device_class),
                       shape.get("dtype"), mode=shape["mode"], out=shape["out"], **layout)
            cfg, found = cand.tuned(req)
            assert found is not None and dict(found.config) == dict(row.config)  # each row serves its own shape
            specs += cand.kernel_specs(req)
    return list(dict.fromkeys(specs))


@pytest.mark.compiles(builder=_shipped_tiles, no_spills=True)
def test_every_shipped_grouped_tile_compiles_without_spills():
    from rtckern.testing import compile_all

    specs = _shipped_tiles()
    assert {s.op for s in specs} == set(OPS) and len(specs) >= 10
    failures = compile_all(specs, no_spills=True)
    assert not failures, "\n".join(failures)
