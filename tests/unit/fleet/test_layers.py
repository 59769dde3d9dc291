"""A bundle unpacked into a read-only layer (a container image, a shared filesystem) serves a fresh machine:
nothing compiles, nothing is written to the layer, new compiles land in the local cache."""

from fleetkit import LINES, cli, prefill_json, write_manifest

from rtckern.cache import DiskCache


def _snapshot(root):
    return sorted((str(p.relative_to(root)), p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*"))


def test_bundle_as_read_only_layer_serves_a_fresh_machine(tmp_path):
    m = write_manifest(tmp_path / "m.jsonl", LINES)
    out, _ = prefill_json("--manifest", str(m), "--arch", "8.0;9.0a", "-j", "2", "--out", str(tmp_path / "build"),
                          "--bundle", str(tmp_path / "fleet.bundle"))
    layer = tmp_path / "image-layer"
    cli("cache", "import", str(tmp_path / "fleet.bundle"), cache=layer)
    layer.chmod(0o555)  # as in an image: not writable (root ignores this, hence the snapshot check too)
    before = _snapshot(layer)
    local = tmp_path / "node-local"
    env = {"RTCKERN_CACHE_LAYERS": str(layer)}
    warm, _ = prefill_json("--manifest", str(m), "--arch", "8.0;9.0a", cache=local, env=env)
    assert (warm["compiled"], warm["cached"], warm["failed"]) == (0, out["compiled"], 0)
    assert not list(DiskCache(local).entries())  # served from the layer, nothing copied
    # A request the bundle does not hold compiles into the local cache, never into the layer.
    m2 = write_manifest(tmp_path / "m2.jsonl", [{"op": "axpy", "dtype": "fp32", "shape": [4098], "aligned": 0}])
    new, _ = prefill_json("--manifest", str(m2), "--arch", "8.0", cache=local, env=env)
    assert new["compiled"] == 1 and len(list(DiskCache(local).entries())) == 1
    assert _snapshot(layer) == before
    layer.chmod(0o755)
