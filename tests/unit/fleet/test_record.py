import json
import multiprocessing
import warnings

from fleetkit import kit

from rtckern import config
from rtckern.device import DeviceInfo
from rtckern.fleet import load_manifest, plan
from rtckern.fleet.plan import build_request
from rtckern.fleet.record import append_line, forget, request_line
from rtckern.prefill import parse_archs

H200 = DeviceInfo.for_arch("sm_90", sm_count=132, name="NVIDIA H200")


def test_recorded_line_replays_the_exact_request(registry):
    req = kit.axpy_request(H200, n=12345, dtype="fp16", aligned=False)
    obj = json.loads(request_line(req))
    assert obj["op"] == "axpy" and obj["dtype"] == "fp16" and obj["device"]["arch"] == "sm_90"
    assert obj["request"] == {"dtypes": {"x": "fp16", "y": "fp16"}, "shape": {"n": 12345},
                              "flags": {"aligned": False}}
    assert "ordinal" not in obj["device"]
    from rtckern.fleet import parse_lines

    entry = parse_lines([request_line(req)])[0]
    assert build_request(registry, entry, H200) == req
    # On another arch the recorded request is kept, the device is a typical one of that arch.
    (p80,) = plan([entry], parse_archs("8.0"), registry)
    assert p80.request.dtypes == req.dtypes and p80.request.device.arch.sm == "sm_80"


def test_first_selection_is_recorded_once(tmp_path, cache_dir, registry):
    path = tmp_path / "rec" / "workload.jsonl"
    forget()
    with config.override(record_manifest=path):
        for _ in range(3):
            registry.select(kit.axpy_request(H200, n=1 << 20, dtype="bf16"))
        registry.select(kit.axpy_request(H200, n=4096, dtype="fp32"))
        # A second process (here: a second registry after forget()) deciding the same request adds nothing.
        forget()
        again = kit.make_registry(None)
        again.select(kit.axpy_request(H200, n=1 << 20, dtype="bf16"))
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    entries = load_manifest(path)
    assert [e.request["shape"]["n"] for e in entries] == [1 << 20, 4096]
    # Nothing is recorded without the setting.
    forget()
    kit.make_registry(None).select(kit.axpy_request(H200, n=8192, dtype="fp32"))
    assert len(path.read_text().splitlines()) == 2


def test_unrecordable_path_warns_once_and_never_breaks_the_call(tmp_path, cache_dir, registry):
    forget()
    target = tmp_path / "a_directory"
    target.mkdir()
    with config.override(record_manifest=target):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            sel = registry.select(kit.axpy_request(H200, n=1 << 20, dtype="bf16"))
            registry.select(kit.axpy_request(H200, n=4096, dtype="fp32"))
    assert sel.name == "axpy.hopper"
    assert len([w for w in got if "cannot record" in str(w.message)]) == 1


def _writer(args):
    path, wid, n = args
    from pathlib import Path

    for i in range(n):
        append_line(Path(path), json.dumps({"op": "axpy", "dtype": "fp32", "shape": [i], "w": wid}))
        append_line(Path(path), json.dumps({"op": "axpy", "dtype": "fp32", "shape": [i], "shared": 1}))


def test_concurrent_writers_lose_nothing_and_write_shared_lines_once(tmp_path):
    path = tmp_path / "m.jsonl"
    n = 60
    with multiprocessing.get_context("fork").Pool(8) as pool:
        pool.map(_writer, [(str(path), w, n) for w in range(8)])
    lines = path.read_text().splitlines()
    objs = [json.loads(x) for x in lines]  # every line intact
    assert len(lines) == len(set(lines)) == 8 * n + n
    assert sum(1 for o in objs if "shared" in o) == n


def test_record_mode_needs_only_rtckern_imported(tmp_path):
    """The registry imports no fleet: rtckern installs fleet's recorder as a SelectionEvent listener at import, so a
    program that imports only the registry (or rtckern.ops) records with the variable set, and imports no fleet
    without it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from fleetkit import kit\n"
            "from rtckern.device import DeviceInfo\n"
            "kit.make_registry(None).select(kit.axpy_request(DeviceInfo.for_arch('sm_90', sm_count=132), n=4096, "
            "dtype='fp32'))\n"
            "print('rtckern.fleet' in sys.modules)\n")
    path = tmp_path / "rec.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "RTCKERN_RECORD_MANIFEST"}
    env["RTCKERN_CACHE_DIR"] = str(tmp_path / "cache")
    plain = subprocess.run([sys.executable, "-c", code, str(here)], env=env, capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == "False" and not path.exists()
    env["RTCKERN_RECORD_MANIFEST"] = str(path)
    rec = subprocess.run([sys.executable, "-c", code, str(here)], env=env, capture_output=True, text=True)
    assert rec.returncode == 0, rec.stderr
    assert [e.request["shape"]["n"] for e in load_manifest(path)] == [4096]
