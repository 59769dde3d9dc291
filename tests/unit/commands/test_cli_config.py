"""Bad configuration at the command line: one line on stderr, exit code 2, never a traceback (real processes).
Also the cache directory of a process with no HOME, and prefill refusing to run when it could save nothing."""
import json
import os
import pwd
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CLEAN = {k: v for k, v in os.environ.items() if not k.startswith("RTCKERN_") and k not in ("HOME", "XDG_CACHE_HOME")}


def run(*args, env, code=None):
    cmd = [sys.executable, "-m", "rtckern", *args] if code is None else [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env={**CLEAN, "PYTHONPATH": str(REPO), **env},
                          cwd=tempfile.gettempdir())


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("var, value, message", [
    ("RTCKERN_CACHE_MAX_BYTES", "abc", " is not a size; give bytes or a number with a K/M/G/T suffix"),
    ("RTCKERN_CACHE_MAX_BYTES", "-1", " is not a size"),
    ("RTCKERN_CACHE_MAX_BYTES", "0", " is 0 bytes, below the smallest accepted 1 MiB"),
    ("RTCKERN_DISK_CACHE", "maybe", " is not a boolean; set it to 1 or 0"),
    ("RTCKERN_STRICT", "2", " is not a boolean; set it to 1 or 0"),
    ("RTCKERN_FORCE_IMPL", "nonsense", ": entry 'nonsense' is not of the form op=candidate"),
    ("RTCKERN_REMOTE_TIMEOUT_S", "abc", " is not a number of seconds in (0, 60]"),
    ("RTCKERN_REMOTE_TIMEOUT_S", "inf", " is not a number of seconds in (0, 60]"),
    ("RTCKERN_REMOTE_TIMEOUT_S", "1e9", " is not a number of seconds in (0, 60]"),
    ("RTCKERN_REMOTE_CACHE", "http://x", ": scheme 'http://' is not supported; give redis://host:6379/0"),
    ("RTCKERN_REMOTE_CACHE", "garbage", " is not a URL; give redis://host:6379/0"),
    ("RTCKERN_REMOTE_CACHE", "redis://h:notaport/0", " has a port that is not a number in 1..65535"),
    ("RTCKERN_CACHE_DIR", "~no_such_user_rtckern/c", ": cannot expand '~' (there is no user 'no_such_user_rtckern')"),
])
@pytest.mark.parametrize("command", [("info",), ("cache", "stats")])
def test_a_bad_variable_is_one_line_and_exit_code_2(tmp_path, command, var, value, message):
    r = run(*command, env={"RTCKERN_CACHE_DIR": str(tmp_path), var: value})
    assert r.returncode == 2
    assert one_line(r.stderr).startswith(f"rtckern {command[0]}: {var}={value!r}{message}")


@pytest.mark.parametrize("var, value, message", [
    ("RTCKERN_FORCE_IMPL", "rms_nrom=rms_norm.l2", "RTCKERN_FORCE_IMPL names op 'rms_nrom', which no registered "
                                                   "candidate serves; known ops: attention, attention_backward, "
                                                   "attention_varlen"),
    ("RTCKERN_FORCE_IMPL", "rms_norm=rms_norm.nope", "RTCKERN_FORCE_IMPL forces 'rms_norm.nope' for op 'rms_norm', "
                                                     "which is not one of its candidates: rms_norm.l2"),
    ("RTCKERN_DISABLE_OPS", "softmx", "RTCKERN_DISABLE_OPS names op 'softmx', which no registered candidate serves"),
])
def test_unknown_op_or_candidate_names_are_one_line(tmp_path, var, value, message):
    r = run("explain", "softmax", "--shape", "8x1024", "--arch", "9.0", env={"RTCKERN_CACHE_DIR": str(tmp_path),
                                                                             var: value})
    assert r.returncode == 2 and one_line(r.stderr).startswith(f"rtckern explain: {message}")
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"op": "softmax", "dtype": "fp16", "shape": [8, 1024]}) + "\n")
    r = run("prefill", "--manifest", str(m), "--arch", "8.0", env={"RTCKERN_CACHE_DIR": str(tmp_path), var: value})
    assert r.returncode == 2 and one_line(r.stderr).startswith(f"rtckern prefill: {message}")


# ---- no HOME ----------------------------------------------------------------------------------------------------
def test_no_home_uses_the_passwd_entry(tmp_path):
    r = run("info", "--json", env={})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["cache"]["dir"] == str(Path(pwd.getpwuid(os.getuid()).pw_dir) / ".cache" / "rtckern")


def _unknown_uid() -> int:
    uid = 54321
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


# The child imports what `info` needs, then drops to a uid with no passwd entry (as an arbitrary-UID container
# runs): the interpreter and site-packages may not be readable by that uid, the command still is.
AS_UNKNOWN_UID = """
import importlib.metadata, os, sys
import rtckern.cli as cli, rtckern.commands.info, rtckern.compiler.nvrtc, rtckern.device, rtckern.manager
import rtckern.cache.remote  # and ssl, before the uid that cannot read the interpreter's lib dir
cli.build_parser()
uid = int(os.environ["AS_UID"])
os.setgid(uid)
os.setuid(uid)
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.fixture
def shared_tmp():
    """A world-writable sticky temp dir (like /tmp) the unknown uid can reach."""
    d = Path(tempfile.mkdtemp(prefix="rtckern-nohome-", dir="/tmp"))
    d.chmod(0o1777)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to setuid to a uid with no passwd entry")
def test_no_home_and_no_passwd_entry_falls_back_to_a_private_temp_dir_with_one_warning(shared_tmp):
    uid = _unknown_uid()
    r = run("info", "--json", env={"AS_UID": str(uid), "TMPDIR": str(shared_tmp)}, code=AS_UNKNOWN_UID)
    assert r.returncode == 0, r.stderr
    cache = shared_tmp / f"rtckern-cache-{uid}"
    assert json.loads(r.stdout)["cache"]["dir"] == str(cache)
    warnings = [ln for ln in r.stderr.splitlines() if "ConfigWarning" in ln]
    assert len(warnings) == 1 and warnings[0].endswith(
        f"ConfigWarning: rtckern: there is no HOME and uid {uid} has no passwd entry; caching kernels in {cache}. "
        "Set RTCKERN_CACHE_DIR (or HOME or XDG_CACHE_HOME) to choose")
    st = cache.stat()
    assert st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o700
    r = run("info", "--json", env={"AS_UID": str(uid), "TMPDIR": str(shared_tmp), "RTCKERN_CACHE_DIR": "/x/c"},
            code=AS_UNKNOWN_UID)
    assert json.loads(r.stdout)["cache"]["dir"] == "/x/c" and "ConfigWarning" not in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to setuid to a uid with no passwd entry")
def test_no_home_fallback_someone_else_owns_is_refused_in_one_line(shared_tmp):
    uid = _unknown_uid()
    planted = shared_tmp / f"rtckern-cache-{uid}"
    planted.mkdir(mode=0o777)  # owned by root: another user could plant entries there
    planted.chmod(0o777)
    r = run("info", env={"AS_UID": str(uid), "TMPDIR": str(shared_tmp)}, code=AS_UNKNOWN_UID)
    assert r.returncode == 2
    assert one_line(r.stderr) == (
        f"rtckern info: there is no HOME and uid {uid} has no passwd entry, and the fallback cache directory "
        f"{planted} is not a private directory of this uid; set RTCKERN_CACHE_DIR (or HOME or XDG_CACHE_HOME)")


# ---- prefill that could save nothing ----------------------------------------------------------------------------
def test_prefill_with_the_disk_tier_off_fails(tmp_path):
    r = run("prefill", "--arch", "8.0", "--family", "core", "--out", str(tmp_path / "c"),
            env={"RTCKERN_DISK_CACHE": "0"})
    assert r.returncode == 2 and one_line(r.stderr) == (
        "rtckern prefill: RTCKERN_DISK_CACHE=0 turns the disk tier off, so prefill would compile kernels and save "
        "none; unset RTCKERN_DISK_CACHE (or set it to 1) for prefill")


def test_prefill_into_an_unwritable_cache_fails(tmp_path):
    (tmp_path / "file").write_text("")
    for env, args in (({}, ("--out", str(tmp_path / "file" / "c"))),
                      ({"RTCKERN_CACHE_DIR": str(tmp_path / "file" / "c")}, ())):
        r = run("prefill", "--arch", "8.0", "--family", "core", *args, env=env)
        assert r.returncode == 2 and one_line(r.stderr) == (
            f"rtckern prefill: cannot write the cache directory {tmp_path / 'file' / 'c'} (NotADirectoryError: Not a "
            "directory), so prefill would save nothing; give a writable --out DIR or RTCKERN_CACHE_DIR")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_prefill_into_a_read_only_cache_fails(tmp_path):
    (tmp_path / "c").mkdir(mode=0o500)
    r = run("prefill", "--arch", "8.0", "--family", "core", "--out", str(tmp_path / "c"), env={})
    assert r.returncode == 2 and "PermissionError" in one_line(r.stderr)


def test_prefill_that_could_not_save_a_kernel_exits_1(tmp_path):
    """An entry path taken by a directory: the write fails mid-run, prefill says how many kernels were not saved."""
    code = """
import sys
from rtckern.manager import KernelManager
from rtckern.prefill import builtin_specs, parse_archs
m = KernelManager(sys.argv[1], remote=None)
m.disk.entry_path(m.key(builtin_specs(parse_archs("8.0"), ["core"])[0])).mkdir(parents=True)
"""
    cache = tmp_path / "c"
    assert run(str(cache), env={}, code=code).returncode == 0
    r = run("prefill", "--arch", "8.0", "--family", "core", "--out", str(cache), "--json", "-j", "1", env={})
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["failed"] == 0 and out["unsaved"] >= 1
    assert r.stderr.strip().splitlines()[-1] == (
        f"rtckern prefill: {out['unsaved']} of 8 kernels are not in {cache} after the run (the disk tier stopped "
        "writing; see the warning above): fix the cache directory and run prefill again")
