"""`rtckern prefill` as a process: progress on stderr (plain lines off a terminal, a bar that fits the terminal on
one, a total in manifest mode) and Ctrl-C (stops within a bound, says how far it got, keeps what was compiled)."""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
UNIT = REPO / "tests" / "unit"
LINE = re.compile(r"^prefill: \[(\d+)/(\d+)\] kernels \((\d+)%\), [0-9.]+/s, \d+:\d\d elapsed(, ETA \d+:\d\d)?$")
STOP_BOUND_S = 2.5  # from SIGINT to exit; measured ~0.1 s on a 2-core machine


def env(cache: Path) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(UNIT), str(REPO)]), RTCKERN_CACHE_DIR=str(cache))


def prefill(cache: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rtckern", "prefill", *args], capture_output=True, text=True,
                          env=env(cache), timeout=300, cwd=REPO, **kw)


def entries(cache: Path) -> int:
    return len(list(cache.glob("v1/*/*.rtk")))


def test_progress_off_a_terminal_is_a_line_every_tenth(tmp_path):
    r = prefill(tmp_path, "--arch", "8.0;9.0a", "--family", "core", "-j", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines and all(LINE.match(ln) for ln in lines), r.stderr
    counts = [int(LINE.match(ln).group(1)) for ln in lines]
    assert all(int(LINE.match(ln).group(2)) == 16 for ln in lines)
    assert counts == sorted(set(counts)) and counts[-1] == 16 and 2 <= len(lines) <= 10
    assert "\r" not in r.stderr  # no terminal control in a log
    quiet = prefill(tmp_path, "--arch", "8.0;9.0a", "--family", "core", "--no-progress")
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_manifest_progress_shows_a_total(tmp_path):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"op": "axpy", "dtype": "fp32", "shape": [1000]}) + "\n"
                        + json.dumps({"op": "axpy", "dtype": "bf16", "shape": [1048576]}) + "\n")
    r = prefill(tmp_path / "c", "--manifest", str(manifest), "--arch", "8.0;9.0a", "--import",
                "registry_testkit_plugin", "-j", "2")
    lines = r.stderr.splitlines()
    assert lines and all(LINE.match(ln) for ln in lines), r.stderr
    done, total = map(int, LINE.match(lines[-1]).groups()[:2])
    assert done == total >= 4  # a total, grown by the fallback round (axpy.broken fails to compile)


def test_progress_bar_on_a_terminal_fits_its_width(tmp_path):
    pytest.importorskip("tqdm")
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 60, 0, 0))
    try:
        r = subprocess.run([sys.executable, "-m", "rtckern", "prefill", "--arch", "8.0", "--family", "core", "-j", "2"],
                           stdout=subprocess.PIPE, stderr=child, env=env(tmp_path), timeout=300, cwd=REPO)
        os.close(child)
        out = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the other side is closed and drained
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(main)
    assert r.returncode == 0
    text = out.decode(errors="replace")
    frames = [f for f in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)) if f.strip()]
    assert any("kernel/s" in f or "s/kernel" in f for f in frames), text  # a rate
    assert any(re.search(r"\d+/8 \[", f) for f in frames), text  # count of the total, then elapsed<ETA
    assert all(len(f) <= 60 for f in frames), [f for f in frames if len(f) > 60]


@pytest.mark.parametrize("to", ["process", "group"])
def test_ctrl_c_stops_within_a_bound_and_keeps_compiled_kernels(tmp_path, to):
    """SIGINT to the process (kill -INT) or to its whole process group (what Ctrl-C on a terminal does)."""
    cache = tmp_path / "c"
    # SIGINT at its default in the child: a test run started in the background of a non-interactive shell inherits
    # it ignored, and Python then installs no KeyboardInterrupt handler (a terminal's Ctrl-C never meets that case)
    p = subprocess.Popen([sys.executable, "-m", "rtckern", "prefill", "--arch", "9.0a", "--family", "ops", "-j", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(cache), cwd=REPO,
                         start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while entries(cache) == 0 and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # compiles are running once the first kernel is saved
        assert p.poll() is None, p.communicate()
        sent = time.monotonic()
        if to == "group":
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130 and took < STOP_BOUND_S, (p.returncode, took, err)
    m = re.search(r"^rtckern prefill: interrupted: (\d+) of (\d+) done, compiled kernels kept$", err, re.M)
    assert m and "Traceback" not in err, err
    done, total = int(m.group(1)), int(m.group(2))
    assert done < total and out == ""  # a kernel saved may not have reported back yet: done can be 0
    kept = entries(cache)
    assert kept >= done
    time.sleep(2)
    assert entries(cache) == kept  # the queued and running compiles were stopped, not left running


def test_a_missing_manifest_creates_no_cache(tmp_path):
    """The manifest is read before the cache directory is made and probed for writing: a missing one is one line,
    exit 2, and leaves no empty cache behind."""
    cache = tmp_path / "new" / "cache"
    r = prefill(cache, "--manifest", str(tmp_path / "nope.jsonl"), "--arch", "8.0")
    assert r.returncode == 2 and r.stderr.strip() == f"rtckern prefill: cannot read manifest {tmp_path / 'nope.jsonl'}: " \
                                                      "No such file or directory", r.stderr
    assert not cache.exists()


@pytest.mark.parametrize("argv, message", [
    (["--family", "nosuch", "--arch", "8.0"], "unknown kernel family 'nosuch'; the families: "),
    (["--arch", "8.0;banana"], "banana"),
    (["--preset", "common", "--arch", "banana"], "banana"),
    (["--preset", "common", "--arch", "8.0", "--import", "no_such_module_here"], "no_such_module_here"),
])
def test_a_bad_builtin_request_creates_no_cache(tmp_path, argv, message):
    """Every input (families, the arch list, a preset's --import) is read before the cache directory is made: an
    unknown family, a malformed arch or a missing module is one line, exit 2, and leaves no empty cache behind."""
    cache = tmp_path / "new" / "cache"
    r = prefill(cache, *argv)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not cache.exists()


def test_prefill_out_copies_what_a_read_only_layer_already_holds(tmp_path):
    """With RTCKERN_CACHE_LAYERS set, kernels the layer holds count as cached and are copied into the cache being
    filled (with their metadata): prefill --out gives a complete cache, not an empty one that reported success."""
    layer, out = tmp_path / "layer", tmp_path / "out"
    assert prefill(layer, "--arch", "8.0", "--family", "core", "-j", "2").returncode == 0
    n = entries(layer)
    e = dict(env(tmp_path / "unused"), RTCKERN_CACHE_LAYERS=str(layer))
    r = subprocess.run([sys.executable, "-m", "rtckern", "prefill", "--arch", "8.0", "--family", "core", "-j", "2",
                        "--out", str(out), "--json", "--no-progress"], capture_output=True, text=True, env=e,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["compiled"] == 0 and summary["cached"] == n and entries(out) == n
    assert len(list(out.glob("v1/*/*.json"))) == n  # the sidecars came along
