"""The registry's choice, pinned: for every family, on described devices (sm_90 with 132 SMs, sm_89, sm_86, sm_80,
sm_75) and every shape the benchmarks and the shipped tuning tables cover, the chosen candidate, its kernels
(source, name, template arguments, defines, options, target) and launch resources, and its config.

The expected choices (`selections.json` beside this file) were recorded before the registry ranked candidates by
expected cost (when candidates still declined for one another); ranking must not change them. Compiles are
stubbed (every kernel "compiles"): the choice on a described device is the one a compile-only probe makes when the
shipped sources compile, which the GPU suite and `rtckern prefill` check. Regenerate only for an intended change
of choice, and say why in the commit: `PYTHONPATH=. python3 tests/unit/test_selections.py --write`.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from rtckern.device import DeviceInfo

HERE = Path(__file__).resolve().parent
SNAPSHOT = HERE / "selections.json"

DEVICES = {"sm_90": dict(sm_count=132), "sm_89": {}, "sm_86": {}, "sm_80": {}, "sm_75": {}}
DTYPES = ("bf16", "fp16", "fp32")


def _table_values(name: str, field: str, **match) -> set:
    from rtckern import tuning

    out = set()
    for row in json.loads(tuning.shipped_table_path(name).read_text())["rows"]:
        shape = row["shape"]
        if all(shape.get(k) == v for k, v in match.items()) and field in shape:
            out.add(shape[field])
    return out


NORM_FWD = ("rms_norm", "layer_norm")
NORM_BWD = ("rms_norm_backward", "layer_norm_backward")
SOFTMAX_OPS = ("softmax", "scaled_masked_softmax", "scaled_upper_triang_masked_softmax",
               "scaled_aligned_causal_masked_softmax", "softmax_backward", "scaled_masked_softmax_backward",
               "scaled_upper_triang_masked_softmax_backward", "scaled_aligned_causal_masked_softmax_backward")
# the row lengths `rtckern prefill` builds softmax kernels for (powers of two from 128 to 131072, and 1023)
SOFTMAX_PREFILL_NS = tuple(1 << k for k in range(7, 18)) + (1023,)


def _request(op, shape, dtype, dev, **options):
    """The request `rtckern explain` builds (the family's registered request builder, default options filled in)."""
    from rtckern.registry import build_request

    return build_request(op, shape=shape, dtype=dtype, device=dev, options=options)


def _norm_requests():
    bench = {1024, 4096, 5120, 8192, 12288, 16384, 65536, 7, 1000, 100000, 262144}
    ns = sorted(bench | _table_values("norm_kind", "n") | _table_values("norm_fwd", "n")
                | _table_values("norm_bwd", "n"))
    for arch, kw in DEVICES.items():
        dev = DeviceInfo.for_arch(arch, **kw)
        for op in NORM_FWD + NORM_BWD:
            variants = [{}]
            if op in NORM_FWD:
                variants += [{"w": "none", "bias": "0"}, {"w": "fp32", "y": "fp32"}]
            for dt in DTYPES:
                for n in ns:
                    for opts in variants:
                        yield _request(op, (n,), dt, dev, **opts)


def _softmax_requests():
    ns = {1, 3, 1000, 1024, 4096, 8192, 16384, 65536, 100000} | set(SOFTMAX_PREFILL_NS)
    for t in ("softmax", "softmax_masked", "softmax_causal", "softmax_backward", "softmax_backward_causal",
              "softmax_ring", "softmax_ring_masked", "softmax_ring_causal", "softmax_ring_backward",
              "softmax_ring_backward_causal"):
        ns |= _table_values(t, "n")
    for arch, kw in DEVICES.items():
        dev = DeviceInfo.for_arch(arch, **kw)
        for op in SOFTMAX_OPS:
            for dt in DTYPES:
                for n in sorted(ns):
                    yield _request(op, (n,), dt, dev)  # vec: the widest that divides n


def _gemm_requests():
    shapes = {(4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 4096), (16, 4096, 4096), (16, 8192, 8192),
              (128, 4096, 4096), (128, 8192, 8192), (1, 4096, 4096), (4095, 4096, 4100)}
    from rtckern import tuning

    layouts = {}
    for row in json.loads(tuning.shipped_table_path("gemm").read_text())["rows"]:
        s = row["shape"]
        shapes.add((s["m"], s["n"], s["k"]))
        layouts.setdefault((s["m"], s["n"], s["k"]), set()).add(s["dtype"])
    for arch, kw in DEVICES.items():
        dev = DeviceInfo.for_arch(arch, **kw)
        for m, n, k in sorted(shapes):
            for dt in ("bf16", "fp16"):
                for trans_b in ("1", "0"):
                    yield _request("gemm", (m, n, k), dt, dev, trans_b=trans_b)
            yield _request("gemm", (m, n, k), "bf16", dev, aligned="0")
            yield _request("gemm", (2, m, n, k), "bf16", dev)


def _attention_requests():
    from rtckern.registry import build_request

    for arch, kw in DEVICES.items():
        for shape in ((64,), (128,), (1, 1, 32, 128), (4, 4096, 32, 128), (2, 1024, 16, 64)):
            for dt in ("bf16", "fp16"):
                for causal in ("0", "1"):
                    yield build_request("attention", shape=shape, dtype=dt, arch=arch, options={"causal": causal},
                                        **kw)


def _attention_backward_requests():
    from rtckern.registry import build_request

    for arch, kw in DEVICES.items():
        for hd in (32, 64, 96, 128, 256):
            for dt in ("bf16", "fp16"):
                for causal in ("0", "1"):
                    for det in ("0", "1"):
                        yield build_request("attention_backward", shape=(hd,), dtype=dt, arch=arch,
                                            options={"causal": causal, "deterministic": det}, **kw)


def _plain(v):
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return repr(v)


def _config_of(cand, req):
    fn = getattr(cand, "config", None)
    return repr(fn(req)) if callable(fn) else None


def _record(sel) -> str:
    """'<chosen> <digest of its kernels, launch resources and config>'."""
    cand, req = sel.candidate, sel.request
    res = cand.launch_resources(req)
    detail = {"specs": [[s.source, s.name, _plain(s.template_args), _plain(s.defines), list(s.options), s.arch.sm]
                        for s in sel.specs],
              "resources": None if res is None else [repr(r) for r in res],
              "config": _config_of(cand, req)}
    text = json.dumps(detail, sort_keys=True)
    return f"{cand.name} {hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _key(req) -> str:
    parts = [f"{k}={v}" for k, v in req.dtypes + req.shape + req.flags]
    return f"{req.device.arch.sm}/{req.device.sm_count} {req.op}({', '.join(parts)})"


def current_selections() -> dict[str, str]:
    """Every pinned request's selection, by a fresh registry holding the shipped candidates, with compiles
    stubbed out and decisions kept in memory."""
    import rtckern.ops  # noqa: F401  (registers the families)
    from rtckern.errors import UnsupportedRequestError
    from rtckern.registry import Registry, core_api, default_registry

    reg = Registry(store_dir=None, numeric=False)
    default = default_registry()
    for op in default.ops():
        for cand in default.candidates(op):
            reg.register(cand)
    saved = core_api.compile, core_api.cache_key
    core_api.compile = lambda spec: b""
    core_api.cache_key = lambda spec: repr(spec)
    out: dict[str, str] = {}
    try:
        for family in (_norm_requests, _softmax_requests, _gemm_requests, _attention_requests,
                           _attention_backward_requests):
            for req in family():
                key = _key(req)
                if key in out:  # a variant that names the defaults
                    continue
                try:
                    out[key] = _record(reg.select(req))
                except UnsupportedRequestError:
                    out[key] = "none"
    finally:
        core_api.compile, core_api.cache_key = saved
    return out


def test_the_choice_is_what_it_was(cache_dir):
    want = json.loads(SNAPSHOT.read_text())
    got = current_selections()
    assert sorted(got) == sorted(want), "the pinned request set changed: regenerate (see the module docstring)"
    changed = [f"{k}: {want[k]} -> {got[k]}" for k in sorted(want) if want[k] != got[k]]
    assert not changed, f"{len(changed)} of {len(want)} choices changed:\n" + "\n".join(changed[:20])
    # the pins cover every family and every kind of candidate
    chosen = {v.split()[0].rsplit(".", 1)[1] for v in want.values() if v != "none"}
    assert {"rows", "cluster", "l2", "l2c", "stage", "coop", "onepass", "ring", "online", "sm90_wgmma",
            "sm80_mma", "simt"} <= chosen


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    import tempfile

    from rtckern import config
    from rtckern.manager import set_manager

    with tempfile.TemporaryDirectory() as d, config.override(cache_dir=Path(d), read_only_layers=(),
                                                             remote_cache=None):
        set_manager(None)
        sel = current_selections()
    SNAPSHOT.write_text(json.dumps(sel, indent=0, sort_keys=True, ensure_ascii=True) + "\n")
    print(f"wrote {len(sel)} selections to {SNAPSHOT}")
