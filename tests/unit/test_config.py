import pytest

from rtckern.config import Settings, override, settings


def test_cache_dir_precedence(tmp_path):
    assert Settings.from_env({"RTCKERN_CACHE_DIR": str(tmp_path)}).cache_dir == tmp_path
    assert Settings.from_env({"XDG_CACHE_HOME": str(tmp_path)}).cache_dir == tmp_path / "rtckern"
    assert Settings.from_env({}).cache_dir.name == "rtckern"


def test_typed_values_and_errors():
    s = Settings.from_env({"RTCKERN_CACHE_MAX_BYTES": "1_000", "RTCKERN_DISK_CACHE": "off",
                           "RTCKERN_FORCE_IMPL": "rms_norm=rms_norm.rowwise, softmax=x", "RTCKERN_DISABLE_JIT": "gemm"})
    assert s.cache_max_bytes == 1000 and s.disk_cache is False
    assert s.force_impl == {"rms_norm": "rms_norm.rowwise", "softmax": "x"}
    assert s.disable_jit == {"gemm"}
    with pytest.raises(ValueError, match=r"RTCKERN_CACHE_MAX_BYTES='lots' is not an integer"):
        Settings.from_env({"RTCKERN_CACHE_MAX_BYTES": "lots"})
    with pytest.raises(ValueError, match="expected a boolean"):
        Settings.from_env({"RTCKERN_STRICT": "maybe"})
    with pytest.raises(ValueError, match="not of the form op=name"):
        Settings.from_env({"RTCKERN_FORCE_IMPL": "rms_norm"})


def test_override_restores(tmp_path):
    before = settings().cache_dir
    with override(cache_dir=tmp_path) as s:
        assert settings().cache_dir == tmp_path == s.cache_dir
    assert settings().cache_dir == before


def test_no_environ_reads_outside_config():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "rtckern"
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "config.py" and re.search(r"os\.environ|os\.getenv", p.read_text())]
    assert offenders == []
