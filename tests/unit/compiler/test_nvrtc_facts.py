"""NVRTC's facts remembered per library file (rtckern.compiler.nvrtc_facts), and NvrtcCompiler's use of them: a
memo is used only for the very file it was read from, and a compile refuses facts the loaded library contradicts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from rtckern import config
from rtckern.arch import Arch
from rtckern.compiler import nvrtc, nvrtc_facts
from rtckern.compiler.nvrtc_facts import NvrtcFacts
from rtckern.errors import RtckernError
from rtckern.spec import KernelSpec

FACTS = NvrtcFacts((13, 5), (75, 80, 90))


@pytest.fixture
def library(tmp_path):
    lib = tmp_path / "lib" / "libnvrtc.so.13"
    lib.parent.mkdir()
    lib.write_bytes(b"\x7fELF one build of NVRTC")
    (tmp_path / "cache").mkdir()
    with config.override(cache_dir=tmp_path / "cache", disk_cache=True):
        yield lib


def _remember(lib, facts=FACTS):
    nvrtc_facts.remember(nvrtc_facts.file_identity(lib), facts)


def test_remembered_for_the_same_file(library):
    assert nvrtc_facts.recall(library) is None
    _remember(library)
    assert nvrtc_facts.recall(library) == FACTS
    (memo,) = (library.parent.parent / "cache" / "toolchain").iterdir()
    assert json.loads(memo.read_text())["library"]["path"] == os.path.realpath(library)


def test_a_rewritten_file_is_a_miss(library):
    _remember(library)
    st = os.stat(library)
    library.write_bytes(b"\x7fELF another build of NVRTC, longer")  # new size
    assert nvrtc_facts.recall(library) is None
    _remember(library)
    library.write_bytes(b"\x7fELF another build of NVRTC, LONGER")  # same size, new mtime
    os.utime(library, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert nvrtc_facts.recall(library) is None


def test_a_replaced_file_is_a_miss(library):
    """pip installs a new file in place of the old (a new inode), even when size and mtime are kept."""
    _remember(library)
    st = os.stat(library)
    new = library.with_name("new")
    new.write_bytes(library.read_bytes())
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, library)
    assert nvrtc_facts.recall(library) is None


def test_another_path_is_a_miss(library, tmp_path):
    _remember(library)
    other = tmp_path / "other" / "libnvrtc.so.13"
    other.parent.mkdir()
    other.write_bytes(library.read_bytes())
    assert nvrtc_facts.recall(other) is None


@pytest.mark.parametrize("content", ["not json", "[]", '{"format": 1}', None])
def test_a_bad_or_foreign_memo_is_a_miss(library, content):
    _remember(library)
    memo = nvrtc_facts.memo_path(nvrtc_facts.file_identity(library))
    if content is None:  # a memo of this name holding another file's identity
        data = json.loads(memo.read_text())
        data["library"]["size"] += 1
        content = json.dumps(data)
    memo.write_text(content)
    assert nvrtc_facts.recall(library) is None


def test_no_cache_dir_is_created_for_a_memo(library, tmp_path):
    with config.override(cache_dir=tmp_path / "not" / "there"):
        _remember(library)
        assert nvrtc_facts.recall(library) is None
    assert not (tmp_path / "not").exists()


def test_forget_and_no_disk_cache(library):
    _remember(library)
    nvrtc_facts.forget(library)
    assert nvrtc_facts.recall(library) is None
    with config.override(disk_cache=False):
        _remember(library)
        assert nvrtc_facts.recall(library) is None
    assert nvrtc_facts.recall(library) is None  # nothing was written


# ---- NvrtcCompiler ------------------------------------------------------------------------------------------------
def _compiler(monkeypatch, library, answers):
    """An NvrtcCompiler whose wheel library is `library` and whose library answers come from `answers` (a list
    that records each time the library is asked)."""
    monkeypatch.setattr(nvrtc.toolkit, "wheel_nvrtc", lambda: library)
    c = nvrtc.NvrtcCompiler()

    def ask():
        answers.append("asked")
        return answers[0]
    monkeypatch.setattr(c, "_ask_library", ask)
    return c


def test_compiler_reads_the_library_once_then_remembers(monkeypatch, library):
    answers = [FACTS]
    c = _compiler(monkeypatch, library, answers)
    assert c.version() == (13, 5) and c.supported_archs() == (75, 80, 90)
    assert answers.count("asked") == 1 and nvrtc_facts.recall(library) == FACTS
    c2 = _compiler(monkeypatch, library, answers)  # a new process: the memo answers
    assert c2.version() == (13, 5) and answers.count("asked") == 1
    library.write_bytes(b"\x7fELF an upgraded NVRTC")  # the file changes: asked again
    c3 = _compiler(monkeypatch, library, answers)
    assert c3.version() == (13, 5) and answers.count("asked") == 2


def test_compile_refuses_facts_the_library_contradicts(monkeypatch, library):
    _remember(library, NvrtcFacts((13, 4), (75, 80, 90)))
    c = _compiler(monkeypatch, library, [FACTS])
    assert c.version() == (13, 4)  # from the memo: the library was not asked
    with pytest.raises(RtckernError, match=r"says version 13\.5 .* keys for 13\.4 .* Restart the process"):
        c.compile(KernelSpec("core/axpy.cuh", "noop0", Arch(9, 0)))
    assert nvrtc_facts.recall(library) is None  # the wrong memo is gone


def test_a_cached_process_never_loads_nvrtc(tmp_path):
    """Real NVRTC: the first process reads and remembers its facts; the next one has the same identity without
    loading libnvrtc, and loads it (from the same file, with the same answers) when it compiles."""
    code = textwrap.dedent("""
        import sys
        from rtckern.arch import Arch
        from rtckern.compiler.nvrtc import NvrtcCompiler
        from rtckern.spec import KernelSpec
        c = NvrtcCompiler()
        print(c.identity(), c.supported_archs())
        print("nvrtc loaded:", "libnvrtc" in open("/proc/self/maps").read())
        if sys.argv[1] == "compile":
            c.compile(KernelSpec("core/axpy.cuh", "noop0", Arch(9, 0)))
            print("compiled")
    """)
    (tmp_path / "cache").mkdir()
    env = dict(os.environ, RTCKERN_CACHE_DIR=str(tmp_path / "cache"))

    def run(mode):
        r = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    first = run("ask")
    if not list((tmp_path / "cache").glob("toolchain/nvrtc-*.json")):
        pytest.skip("NVRTC does not come from an NVIDIA wheel here: nothing is remembered")
    second = run("compile")
    assert second[0] == first[0]
    assert second[1] == "nvrtc loaded: False" and second[2] == "compiled"
