import subprocess
import sys
from pathlib import Path

import pytest

from rtckern import sources
from rtckern.arch import Arch
from rtckern.spec import KernelSpec, KeyInputs

ID = "nvrtc-test|headers-1"


def test_key_stable_across_processes(axpy_spec):
    code = ("from rtckern.spec import KernelSpec; from rtckern.arch import Arch;"
            "print(KernelSpec('core/axpy.cuh','axpy',Arch.parse('sm_80'),template_args=('float',)).key('nvrtc-test|headers-1'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == axpy_spec.key(ID)


def test_option_order_and_duplicates_do_not_matter():
    a = KernelSpec("core/axpy.cuh", "axpy", Arch(8, 0), ("float",), options=("-DA=1", "--use_fast_math"))
    b = KernelSpec("core/axpy.cuh", "axpy", Arch(8, 0), ("float",), options=("--use_fast_math", "-DA=1", "-DA=1"))
    assert a == b and hash(a) == hash(b) and a.key(ID) == b.key(ID)


@pytest.mark.parametrize("change", [
    dict(arch=Arch(8, 6)), dict(arch=Arch(8, 0, ptx=True)), dict(template_args=("rtk_half",)),
    dict(defines=(("X", "1"),)), dict(options=("--use_fast_math",)), dict(name="noop0", template_args=()),
])
def test_key_sensitive_to_every_field(axpy_spec, change):
    import dataclasses

    assert dataclasses.replace(axpy_spec, **change).key(ID) != axpy_spec.key(ID)


def test_key_sensitive_to_compiler_identity(axpy_spec):
    assert axpy_spec.key(ID) != axpy_spec.key("nvrtc-other|headers-1")


def test_op_label_is_not_in_key(axpy_spec):
    import dataclasses

    assert dataclasses.replace(axpy_spec, op="other").key(ID) == axpy_spec.key(ID)


def test_changed_included_header_changes_key(tmp_path, monkeypatch):
    root = tmp_path / "ks"
    (root / "common").mkdir(parents=True)
    (root / "common" / "portability.cuh").write_text("#pragma once\n")
    (root / "fam").mkdir()
    (root / "fam" / "helper.cuh").write_text("#pragma once\n#define K 1\n")
    (root / "fam" / "deep.cuh").write_text('#pragma once\n#include "helper.cuh"\n')
    (root / "fam" / "k.cuh").write_text('#include "fam/deep.cuh"\n__global__ void k(){}\n')
    monkeypatch.setattr(sources, "kernel_sources_dir", lambda: root)
    spec = KernelSpec("fam/k.cuh", "k", Arch(8, 0))
    k1 = spec.key(ID)
    assert [rel for rel, _ in sources.resolve_includes(spec.source_text(), spec.source)] == [
        "fam/deep.cuh", "fam/helper.cuh"]
    (root / "fam" / "helper.cuh").write_text("#pragma once\n#define K 2\n")  # a transitive header
    # headers are read once per process: the edit is seen once the source caches are cleared (a new process, a
    # new KernelManager, rtckern.clear_caches())
    assert spec.key(ID) == k1
    import rtckern

    rtckern.clear_caches()
    k2 = spec.key(ID)
    assert k2 != k1
    (root / "fam" / "helper.cuh").write_text("#pragma once\n#define K 3\n")
    from rtckern.manager import KernelManager

    KernelManager(disk=False, remote=None)
    assert spec.key(ID) not in (k1, k2)


def test_edited_header_changes_the_key_in_a_new_process(tmp_path):
    """The per-process header cache never outlives its process: a fresh one reads the edited header."""
    inc = tmp_path / "inc"
    inc.mkdir()
    code = ("import sys; from pathlib import Path; from rtckern.spec import KernelSpec, KeyInputs; "
            "from rtckern.arch import Arch; "
            "s = KernelSpec('u.cu', 'k', Arch(8, 0), code='#include \"h.h\"\\n'); "
            "print(s.key(KeyInputs('id', user_include_dirs=(Path(sys.argv[1]),))))")

    def key() -> str:
        return subprocess.run([sys.executable, "-c", code, str(inc)], capture_output=True, text=True,
                              check=True).stdout.strip()

    (inc / "h.h").write_text("#define H 1\n")
    first = key()
    (inc / "h.h").write_text("#define H 2\n")
    assert key() != first


def test_cached_includes_give_the_same_keys_as_a_fresh_read(axpy_spec):
    """Memoized header texts and include lists change no key: a warm second computation equals a cold one."""
    import rtckern

    specs = [axpy_spec, KernelSpec("core/axpy.cuh", "noop0", Arch(9, 0)),
             KernelSpec("x.cu", "k", Arch(8, 0), code='#include "common/portability.cuh"\n')]
    rtckern.clear_caches()
    cold = [s.key(ID) for s in specs]
    assert [s.key(ID) for s in specs] == cold
    assert [(rel, len(t)) for rel, t in sources.resolve_includes(specs[2].code)] == [
        (rel, len(t)) for rel, t in sources._resolve(specs[2].code, "", sources.kernel_sources_dir(), [], ())]


def test_missing_include_is_an_error(tmp_path, monkeypatch):
    from rtckern.errors import RtckernError

    monkeypatch.setattr(sources, "kernel_sources_dir", lambda: tmp_path)
    with pytest.raises(RtckernError, match='includes "nope.cuh", which is not under'):
        KernelSpec("x.cuh", "k", Arch(8, 0), code='#include "nope.cuh"\n').key(ID)


def test_arch_flags_rejected_in_options():
    with pytest.raises(ValueError, match="target is set by KernelSpec.arch"):
        KernelSpec("core/axpy.cuh", "axpy", Arch(8, 0), options=("--gpu-architecture=sm_90",))


def test_name_expression():
    s = KernelSpec("core/axpy.cuh", "f", Arch(8, 0), template_args=("rtk_bf16", 4096, True))
    assert s.name_expression == "f<rtk_bf16, 4096, true>"


# ---- key completeness: the settings' options and user headers (issue: a key that misses compile inputs) ----
def test_every_setting_is_classified_and_the_key_ones_change_the_key(tmp_path, axpy_spec):
    """Walk every field of Settings: each says how it relates to the bytes (config.CODE_EFFECT); each one that
    claims to be in the key changes the key of a spec it can affect."""
    import dataclasses

    from rtckern import config
    from rtckern.compiler import compiler_for

    fields = {f.name for f in dataclasses.fields(config.Settings)}
    assert fields == set(config.CODE_EFFECT), "classify every setting in config.CODE_EFFECT"
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "user_k.h").write_text("#define USER_K 1\n")
    user_spec = KernelSpec("user.cu", "k", Arch(8, 0), code='#include "user_k.h"\n__global__ void k(){}\n')
    changes = {"lineinfo": (True, axpy_spec), "extra_include_dirs": ((inc,), user_spec)}
    key_fields = {n for n, why in config.CODE_EFFECT.items() if why.startswith("key:")}
    assert key_fields == set(changes)
    comp = compiler_for(axpy_spec.arch)
    for name, (value, spec) in changes.items():
        base_dirs = (tmp_path / "empty",) if name == "extra_include_dirs" else ()
        (tmp_path / "empty").mkdir(exist_ok=True)
        (tmp_path / "empty" / "user_k.h").write_text("#define USER_K 2\n")
        with config.override(lineinfo=False, extra_include_dirs=base_dirs):
            before = spec.key(comp.key_inputs())
        with config.override(**{name: value}):
            after = spec.key(comp.key_inputs())
        assert before != after, name


def test_lineinfo_reaches_the_compile_and_the_key(cache_dir, axpy_spec):
    from rtckern import config
    from rtckern.manager import KernelManager

    with config.override(lineinfo=False):
        m = KernelManager(cache_dir)
        plain = m.compile(axpy_spec)
    with config.override(lineinfo=True):
        m2 = KernelManager(cache_dir)
        with_lines = m2.compile(axpy_spec)
        assert m2.key(axpy_spec) != m.key(axpy_spec)
        assert m2.stats.compiles == 1  # not served the cached non-lineinfo cubin
    assert plain.binary != with_lines.binary  # -lineinfo adds line tables to the cubin


def test_user_include_dir_headers_are_found_and_hashed_by_content(cache_dir, tmp_path):
    from rtckern import config
    from rtckern.manager import KernelManager

    code = '#include "my.h"\n#include <sub/deep.h>\nextern "C" __global__ void k(float* p){ *p = VALUE + DEEP; }\n'
    spec = KernelSpec("user.cu", "k", Arch(8, 0), code=code)
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "sub").mkdir(parents=True)
        (d / "my.h").write_text("#define VALUE 1.0f\n")
        (d / "sub" / "deep.h").write_text("#define DEEP 2.0f\n")
    with config.override(extra_include_dirs=(a,)):
        m = KernelManager(cache_dir)
        first = m.compile(spec)  # `#include "my.h"` from a user include dir compiles (it was refused)
        key_a = m.key(spec)
    with config.override(extra_include_dirs=(b,)):
        assert KernelManager(cache_dir).key(spec) == key_a  # same content elsewhere: same key (no absolute paths)
    (a / "sub" / "deep.h").write_text("#define DEEP 3.0f\n")  # edit a transitively included user header
    with config.override(extra_include_dirs=(a,)):
        m2 = KernelManager(cache_dir)
        assert m2.key(spec) != key_a
        assert m2.compile(spec).binary != first.binary and m2.stats.compiles == 1


@pytest.mark.parametrize("spelling", [".", "./", "cwd/", "/"])
def test_user_headers_of_one_name_in_two_subdirs_both_change_the_key(tmp_path, monkeypatch, spelling):
    """A user include dir spelled as the working directory (".") or the root ("/") labels each header by its
    path under it, so two headers named alike in two subdirectories are both hashed: an edit of either changes the
    key (a label of the bare file name kept only the first)."""
    (tmp_path / "sub1").mkdir()
    (tmp_path / "sub2").mkdir()
    (tmp_path / "sub1" / "x.h").write_text("#define ONE 1\n")
    (tmp_path / "sub2" / "x.h").write_text("#define TWO 2\n")
    monkeypatch.chdir(tmp_path)
    where = {"cwd/": str(tmp_path) + "/", "/": "/"}.get(spelling, spelling)
    pre = str(tmp_path).lstrip("/") + "/" if spelling == "/" else ""
    code = f'#include <{pre}sub1/x.h>\n#include <{pre}sub2/x.h>\nextern "C" __global__ void k(int* p){{ *p = ONE + TWO; }}\n'
    spec = KernelSpec("user.cu", "k", Arch(8, 0), code=code)
    inputs = KeyInputs(ID, (), (Path(where),))
    sources.forget()
    before = spec.key(inputs)
    (tmp_path / "sub2" / "x.h").write_text("#define TWO 3\n")
    sources.forget()
    assert spec.key(inputs) != before


def test_unknown_quoted_include_names_the_search_dirs(tmp_path):
    from rtckern.errors import RtckernError

    spec = KernelSpec("user.cu", "k", Arch(8, 0), code='#include "nowhere.h"\n')
    with pytest.raises(RtckernError, match=r'includes "nowhere.h", which is not under .*; put it under a directory '
                                           r"of RTCKERN_INCLUDE_DIRS"):
        spec.key(ID)
