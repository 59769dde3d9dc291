import json
import subprocess
import sys


def rtckern(*args, env_cache=None, check=True):
    import os

    env = dict(os.environ)
    if env_cache is not None:
        env["RTCKERN_CACHE_DIR"] = str(env_cache)
    r = subprocess.run([sys.executable, "-m", "rtckern", *args], capture_output=True, text=True, env=env)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def test_info_json(tmp_path):
    info = json.loads(rtckern("info", "--json", env_cache=tmp_path).stdout)
    assert "sm_90" in info["nvrtc"]["archs"] and info["cache"]["dir"] == str(tmp_path)
    assert isinstance(info["devices"], list)
    # every key --help lists, driver_cuda_version too (null on a machine without a CUDA driver)
    assert list(info) == ["rtckern", "python", "packages", "nvrtc", "hiprtc", "devices", "driver_cuda_version", "cache",
                          "settings"]
    assert not info["devices"] or info["driver_cuda_version"]


def test_info_never_prints_the_remote_password(tmp_path, monkeypatch):
    monkeypatch.setenv("RTCKERN_REMOTE_CACHE", "redis://user:s3cret-pw@127.0.0.1:1/0")
    r = rtckern("info", "--json", env_cache=tmp_path)
    assert json.loads(r.stdout)["cache"]["remote"] == "redis://127.0.0.1:1/0"
    assert "s3cret-pw" not in r.stdout + r.stderr


def test_prefill_then_cached_then_cache_commands(tmp_path):
    first = json.loads(rtckern("prefill", "--arch", "8.0;9.0a", "--family", "core", "--json", "-j", "2",
                               env_cache=tmp_path).stdout)
    assert first["compiled"] == 16 and first["cached"] == 0 and first["failed"] == 0
    second = json.loads(rtckern("prefill", "--arch", "9.0a 8.0", "--family", "core", "--json",
                                env_cache=tmp_path).stdout)
    assert second["compiled"] == 0 and second["cached"] == 16
    stats = json.loads(rtckern("cache", "stats", "--json", env_cache=tmp_path).stdout)
    assert stats["entries"] == 16 and stats["bytes"] > 0
    ls = json.loads(rtckern("cache", "ls", "--arch", "sm_90", "--json", env_cache=tmp_path).stdout)
    assert len(ls) == 8 and all(r["arch"] == "sm_90" and r["op"] == "core" for r in ls)
    # damage one entry: verify finds and removes it
    victim = next((tmp_path / "v1").rglob("*.rtk"))
    victim.write_bytes(victim.read_bytes()[:100])
    v = json.loads(rtckern("cache", "verify", "--json", env_cache=tmp_path).stdout)
    assert (v["checked"], v["corrupt"], v["removed"]) == (16, 1, 1)
    third = json.loads(rtckern("prefill", "--arch", "8.0;9.0a", "--family", "core", "--json",
                               env_cache=tmp_path).stdout)
    assert third["compiled"] == 1 and third["cached"] == 15
    pr = json.loads(rtckern("cache", "prune", "--max-bytes", "0", "--json", env_cache=tmp_path).stdout)
    assert pr["removed"] == 16 and pr["bytes"] == 0


def test_prefill_bad_arch_exit_and_message(tmp_path):
    r = rtckern("prefill", "--arch", "8.0;hopper", env_cache=tmp_path, check=False)
    assert r.returncode == 2 and "unknown arch entry 'hopper'" in r.stderr


def test_prefill_failure_is_reported_and_nonzero(tmp_path):
    r = rtckern("prefill", "--arch", "7.0;8.0", "--family", "core", "--json", env_cache=tmp_path, check=False)
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["failed"] == 1 and out["compiled"] == 8
    assert out["failures"][0]["kernel"] == "every kernel for 7.0" and "dropped Volta" in out["failures"][0]["error"]


def test_prefill_table_output(tmp_path):
    r = rtckern("prefill", "--arch", "8.0", "--family", "core", "--no-progress", env_cache=tmp_path)
    assert "already cached" in r.stdout and "total" in r.stdout
