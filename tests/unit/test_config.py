import dataclasses
import os
import re
from pathlib import Path

import pytest

from rtckern import config
from rtckern.config import Settings, override, settings
from rtckern.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_cache_dir_precedence(tmp_path):
    assert Settings.from_env({"RTCKERN_CACHE_DIR": str(tmp_path)}).cache_dir == tmp_path
    assert Settings.from_env({"XDG_CACHE_HOME": str(tmp_path)}).cache_dir == tmp_path / "rtckern"
    assert Settings.from_env({"HOME": str(tmp_path)}).cache_dir == tmp_path / ".cache" / "rtckern"
    assert Settings.from_env({}).cache_dir.name == "rtckern"  # no HOME: the passwd entry's home


def test_tilde_expands_with_the_given_home(tmp_path):
    s = Settings.from_env({"HOME": str(tmp_path), "RTCKERN_CACHE_DIR": "~/c",
                           "RTCKERN_CACHE_LAYERS": f"~/a{os.pathsep}/b"})
    assert s.cache_dir == tmp_path / "c" and s.read_only_layers == (tmp_path / "a", Path("/b"))


def test_typed_values():
    s = Settings.from_env({"RTCKERN_CACHE_MAX_BYTES": "1_048_576", "RTCKERN_DISK_CACHE": "off",
                           "RTCKERN_FORCE_IMPL": "rms_norm=rms_norm.rowwise; softmax=x", "RTCKERN_DISABLE_OPS": "gemm",
                           "RTCKERN_REMOTE_TIMEOUT_S": "2.5", "RTCKERN_REMOTE_CACHE": "rediss://u:pw@h:6380/1"})
    assert s.cache_max_bytes == 1 << 20 and s.disk_cache is False and s.remote_timeout_s == 2.5
    assert s.force_impl == {"rms_norm": "rms_norm.rowwise", "softmax": "x"}
    assert s.disabled_ops == {"gemm"} and s.remote_cache == "rediss://u:pw@h:6380/1"
    blank = Settings.from_env({k: " " for k in _variables()})  # empty means unset
    assert blank == dataclasses.replace(Settings.from_env({}), cache_dir=blank.cache_dir)


@pytest.mark.parametrize("value, size", [("1G", 1 << 30), ("512M", 512 << 20), ("1.5g", 3 << 29), ("2 GiB", 2 << 30),
                                         ("1048576", 1 << 20), ("4096K", 4 << 20), ("1T", 1 << 40), ("64MB", 64 << 20)])
def test_sizes_take_a_suffix(value, size):
    assert Settings.from_env({"RTCKERN_CACHE_MAX_BYTES": value}).cache_max_bytes == size


@pytest.mark.parametrize("value, size", [("0", 0), ("1G", 1 << 30), ("1GiB", 1 << 30), ("1gb", 1 << 30),
                                         ("10K", 10 << 10), ("3MiB", 3 << 20), ("2T", 2 << 40), ("1.5K", 1536)])
def test_parse_size_reads_the_sizes_of_settings_and_options(value, size):
    assert config.parse_size(value) == size


@pytest.mark.parametrize("value", ["", "G", "1X", "-1", "1e3", "1 G B", "１G"])
def test_parse_size_refuses(value):
    with pytest.raises(ValueError, match="is not a size"):
        config.parse_size(value)


def test_effective_settings_say_what_the_environment_sets_and_hide_the_password(tmp_path):
    env = {"RTCKERN_CACHE_DIR": str(tmp_path), "RTCKERN_REMOTE_CACHE": "redis://u:pw@h:1/0", "RTCKERN_STRICT": "yes"}
    rows = {r["name"]: r for r in config.effective(Settings.from_env(env), env)}
    assert set(rows) == {f.name for f in dataclasses.fields(Settings)}
    assert rows["cache_dir"] == {"name": "cache_dir", "env": "RTCKERN_CACHE_DIR", "value": str(tmp_path), "set": True}
    assert rows["remote_cache"]["value"] == "redis://u:***@h:1/0"
    assert (rows["strict"]["value"], rows["strict"]["set"]) == ("1", True)
    assert (rows["lineinfo"]["value"], rows["lineinfo"]["set"]) == ("0", False)
    assert rows["cuda_home"]["env"] == "CUDA_HOME, CUDA_PATH"


@pytest.mark.parametrize("value, message", [
    ("abc", "is not a size; give bytes or a number with a K/M/G/T suffix (1024-based), such as 10G or 512M, "
            "or unset it"),
    ("-1", "is not a size"), ("1e9", "is not a size"), ("１G", "is not a size"), ("1 G B", "is not a size"),
    ("0", "is 0 bytes, below the smallest accepted 1 MiB (1048576 bytes); give a larger size such as 10G, or unset it"),
    ("64K", "is 65536 bytes, below the smallest accepted 1 MiB"),
])
def test_bad_sizes(value, message):
    with pytest.raises(ConfigError, match=f"^RTCKERN_CACHE_MAX_BYTES={value!r} {re.escape(message)}"):
        Settings.from_env({"RTCKERN_CACHE_MAX_BYTES": value})


@pytest.mark.parametrize("value", ["abc", "inf", "1e9", "nan", "-1", "0", "61", "٣"])
def test_bad_timeouts(value):
    with pytest.raises(ConfigError, match=rf"^RTCKERN_REMOTE_TIMEOUT_S={re.escape(repr(value))} is not a number "
                                          r"of seconds in \(0, 60\]; give a positive number such as 0.5 \(the "
                                          r"default\)"):
        Settings.from_env({"RTCKERN_REMOTE_TIMEOUT_S": value})


@pytest.mark.parametrize("name", ["RTCKERN_DISK_CACHE", "RTCKERN_STRICT", "RTCKERN_LINEINFO"])
@pytest.mark.parametrize("value", ["maybe", "2", "-1", "yes please"])
def test_bad_booleans(name, value):
    with pytest.raises(ConfigError, match=rf"^{name}={re.escape(repr(value))} is not a boolean; set it to 1 or 0 "
                                          r"\(also accepted: true/false, yes/no, on/off\), or unset it for the "
                                          r"default \([01]\)$"):
        Settings.from_env({name: value})


ACCEPTED_URLS = "give redis://host:6379/0, rediss://host:6380/0 (TLS) or unix:///path/to/redis.sock"


@pytest.mark.parametrize("value, message", [
    ("http://x", f"'http://x': scheme 'http://' is not supported; {ACCEPTED_URLS}, or unset it for no remote tier"),
    ("garbage", f"'garbage' is not a URL; {ACCEPTED_URLS}"),
    ("redis://h:notaport/0", f"'redis://h:notaport/0' has a port that is not a number in 1..65535; {ACCEPTED_URLS}"),
    ("redis://h:70000/0", "'redis://h:70000/0' has a port that is not a number in 1..65535"),
    ("redis:///0", "'redis:///0' has no host"),
    ("redis://h:6379/zero", "'redis://h:6379/zero': the database 'zero' is not a number; give redis://host:6379/0"),
    ("unix://", "'unix://': a unix:// URL needs the socket's path, such as unix:///run/redis/redis.sock"),
    ("redis://admin:s3cret@h:notaport/0", "'redis://admin:***@h:notaport/0' has a port"),  # no password in messages
])
def test_bad_remote_urls(value, message):
    with pytest.raises(ConfigError, match=f"^RTCKERN_REMOTE_CACHE={re.escape(message)}") as ei:
        Settings.from_env({"RTCKERN_REMOTE_CACHE": value})
    assert "s3cret" not in str(ei.value)


@pytest.mark.parametrize("value, message", [
    ("nonsense", "'nonsense': entry 'nonsense' is not of the form op=candidate (example: "
                 "RTCKERN_FORCE_IMPL=rms_norm=rms_norm.l2)"),
    ("rms_norm=", "'rms_norm=': entry 'rms_norm=' is not of the form op=candidate"),
    ("=rms_norm.l2", "'=rms_norm.l2': entry '=rms_norm.l2' is not of the form op=candidate"),
    ("rms_norm=a,rms_norm=b", "'rms_norm=a,rms_norm=b' names two candidates for op 'rms_norm' ('a' and 'b'); keep one"),
])
def test_bad_force_impl(value, message):
    with pytest.raises(ConfigError, match=f"^RTCKERN_FORCE_IMPL={re.escape(message)}"):
        Settings.from_env({"RTCKERN_FORCE_IMPL": value})
    with pytest.raises(ConfigError, match=r"^RTCKERN_FORCE_IMPL: op or candidate 'rms norm' is not a name"):
        Settings.from_env({"RTCKERN_FORCE_IMPL": "rms norm=x"})
    with pytest.raises(ConfigError, match=r"^RTCKERN_DISABLE_OPS: op 'gemm!' is not a name \(letters, digits"):
        Settings.from_env({"RTCKERN_DISABLE_OPS": "softmax,gemm!"})


@pytest.mark.parametrize("value, level", [("", 0), ("0", 0), ("1", 1), ("2", 2), ("yes", 1), ("off", 0)])
def test_verbose_takes_a_level_or_a_boolean(value, level):
    assert Settings.from_env({"RTCKERN_VERBOSE": value}).verbose == level


def test_bad_verbose_names_the_levels():
    with pytest.raises(ConfigError, match=r"^RTCKERN_VERBOSE='3'; set it to 1 \(log compiles\), 2 \(also cache hits\) or "
                                          r"0, or unset it for the default \(0\)$"):
        Settings.from_env({"RTCKERN_VERBOSE": "3"})


def test_disable_jit_is_the_deprecated_name_of_disable_ops():
    with pytest.warns(FutureWarning, match=r"RTCKERN_DISABLE_JIT is deprecated; set RTCKERN_DISABLE_OPS=gemm instead"):
        assert Settings.from_env({"RTCKERN_DISABLE_JIT": "gemm"}).disabled_ops == {"gemm"}
    with pytest.raises(ConfigError, match=r"^RTCKERN_DISABLE_JIT='a' and RTCKERN_DISABLE_OPS='b' are both set; "
                                          r"RTCKERN_DISABLE_JIT is the deprecated name of RTCKERN_DISABLE_OPS: unset"):
        Settings.from_env({"RTCKERN_DISABLE_JIT": "a", "RTCKERN_DISABLE_OPS": "b"})


@pytest.mark.parametrize("value", ["1", "true", "off"])
@pytest.mark.parametrize("name", ["RTCKERN_DISABLE_OPS", "RTCKERN_DISABLE_JIT"])
def test_disable_ops_is_not_a_switch(value, name, recwarn):
    """FlashInfer's FLASHINFER_DISABLE_JIT=1 means "never compile"; ours names ops, so a boolean is refused, under
    the deprecated name too without first advising RTCKERN_DISABLE_OPS set to the same refused value."""
    with pytest.raises(ConfigError, match=rf"^{name}='{value}' is not a list of ops: it takes op names "
                                          r"\(rms_norm,gemm\) or 'all'.* It is not a switch that stops compiling"):
        Settings.from_env({name: value})
    assert not [w for w in recwarn if "deprecated" in str(w.message)]


def test_arch_list_is_checked_when_read_and_native_waits_for_its_use():
    assert Settings.from_env({}).arch_list is None
    assert Settings.from_env({"RTCKERN_ARCH_LIST": " 8.0;9.0a, sm_100 native "}).arch_list == "8.0;9.0a, sm_100 native"
    with pytest.raises(ConfigError, match=r"^RTCKERN_ARCH_LIST='8.0;sm_7x': unknown arch entry 'sm_7x'; accepted forms: "
                                          r".*; give a list such as '7.5;8.0;8.6;8.9;9.0a;10.0;12.0', or unset it"):
        Settings.from_env({"RTCKERN_ARCH_LIST": "8.0;sm_7x"})


def test_int_helper_for_new_settings():
    assert config._int("RTCKERN_X", " 1_024 ", None) == 1024 and config._int("RTCKERN_X", "", 7) == 7
    with pytest.raises(ConfigError, match=r"^RTCKERN_X='4.5' is not an integer; set it to a whole number such as 4$"):
        config._int("RTCKERN_X", "4.5", None)
    with pytest.raises(ConfigError, match=r"^RTCKERN_X='0' is out of range; give a whole number at least 1 and at most "
                                          r"8$"):
        config._int("RTCKERN_X", "0", None, minimum=1, maximum=8)
    with pytest.raises(ConfigError, match=r"^RTCKERN_X='9' is out of range; give a whole number at most 8$"):
        config._int("RTCKERN_X", "9", None, maximum=8)


# One bad value per variable: every variable a Settings field reads (and XDG_CACHE_HOME) must be listed here.
NO_SUCH_USER = "~no_such_user_rtckern/x"
BAD = {
    "RTCKERN_CACHE_DIR": NO_SUCH_USER, "XDG_CACHE_HOME": NO_SUCH_USER, "RTCKERN_DISK_CACHE": "maybe",
    "RTCKERN_CACHE_MAX_BYTES": "abc", "RTCKERN_CACHE_LAYERS": f"/ok{os.pathsep}{NO_SUCH_USER}",
    "RTCKERN_REMOTE_CACHE": "http://x", "RTCKERN_REMOTE_TIMEOUT_S": "inf", "RTCKERN_REMOTE_MAX_VALUE_BYTES": "12Q",
    "RTCKERN_RECORD_MANIFEST": NO_SUCH_USER, "RTCKERN_LOCK_TIMEOUT_S": "abc", "RTCKERN_LOCK_DIR": NO_SUCH_USER,
    "XDG_RUNTIME_DIR": NO_SUCH_USER,
    "CUDA_HOME": NO_SUCH_USER, "CUDA_PATH": NO_SUCH_USER, "RTCKERN_INCLUDE_DIRS": NO_SUCH_USER,
    "RTCKERN_LINEINFO": "2", "RTCKERN_FORCE_IMPL": "nonsense", "RTCKERN_DISABLE_OPS": "a b", "RTCKERN_DISABLE_JIT": "a b",
    "RTCKERN_ARCH_LIST": "8.0;sm_7x", "RTCKERN_STRICT": "2",
    "RTCKERN_NUMERICAL_PROBE": "sometimes", "RTCKERN_PERSIST_DECISIONS": "never", "RTCKERN_TUNING_DIR": NO_SUCH_USER,
    "RTCKERN_VERBOSE": "very", "RTCKERN_HIPRTC_LIBRARY": NO_SUCH_USER, "ROCM_PATH": NO_SUCH_USER,
    "RTCKERN_CACHE_SECRET_FILE": NO_SUCH_USER, "RTCKERN_BUNDLE_MAX_BYTES": "lots", "RTCKERN_BUNDLE_MAX_RATIO": "0",
    "CC": "gcc '-O2", "RTCKERN_NATIVE_LAUNCH": "sometimes", "CXX": "g++ '-O2", "RTCKERN_TORCH_NATIVE": "maybe",
}


def _variables() -> list[str]:
    return [v.strip() for f in dataclasses.fields(Settings) for v in f.metadata["env"].split(",")]


def test_every_field_declares_its_variable_and_has_a_bad_value_below():
    for f in dataclasses.fields(Settings):
        assert f.metadata.get("env") and f.metadata.get("doc") and f.metadata.get("default"), f.name
    missing = sorted(set(_variables()) - set(BAD))
    assert missing == [], f"add a bad value for {missing} to BAD (and make from_env refuse it)"


@pytest.mark.filterwarnings("ignore:rtckern. RTCKERN_DISABLE_JIT is deprecated:FutureWarning")
@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_of_each_variable_is_a_config_error_naming_it(name):
    with pytest.raises(ConfigError, match=f"^{name}(=|: )") as ei:
        Settings.from_env({name: BAD[name]})
    assert "\n" not in str(ei.value)
    if BAD[name].startswith("~"):
        assert f"cannot expand '~' (there is no user 'no_such_user_rtckern'); give an absolute path" in str(ei.value)


def test_override_restores(tmp_path):
    before = settings().cache_dir
    with override(cache_dir=tmp_path) as s:
        assert settings().cache_dir == tmp_path == s.cache_dir
    assert settings().cache_dir == before


def test_no_environ_reads_outside_config():
    root = REPO / "rtckern"
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "config.py" and re.search(r"os\.environ|os\.getenv|expanduser|Path\.home", p.read_text())]
    assert offenders == []


def test_env_doc_is_up_to_date():
    """docs/env.md is generated: python tools/gen_env_doc.py"""
    doc = config.env_doc()
    assert all(f"`{v}`" in doc for v in _variables())
    assert (REPO / "docs" / "env.md").read_text() == doc, "regenerate it: python tools/gen_env_doc.py"


@pytest.mark.parametrize("url, shown", [
    ("redis://u:pw@h:1/0", "redis://u:***@h:1/0"),
    ("redis://:s3cr/et@redis.internal:6379/0", "redis://:***@redis.internal:6379/0"),  # a '/' in the password
    ("redis://:p@ss@host/0?x=1", "redis://:***@host/0?x=1"),  # an '@' in the password
    ("rediss://:a:b@h/0?ssl_ca_certs=/x@y", "rediss://:***@h/0?ssl_ca_certs=/x@y"),
    ("redis://:pa?ss@h/0", "redis://:***@h/0"),  # a '?' in the password
    ("redis://u:p?w@h/0?db=1", "redis://u:***@h/0?db=1"),
    ("redis://:a#b@h/0", "redis://:***@h/0"),  # a '#'
    ("redis://reader@h/0", "redis://reader@h/0"),  # a user name alone is no secret
    ("redis://host:6379/0", "redis://host:6379/0"),
    ("unix:///tmp/redis.sock", "unix:///tmp/redis.sock"),
])
def test_a_password_never_shows_in_messages(url, shown):
    from rtckern.config import redact_url

    assert redact_url(url) == shown
