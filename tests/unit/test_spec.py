import subprocess
import sys

import pytest

from rtckern import sources
from rtckern.arch import Arch
from rtckern.spec import KernelSpec

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
    assert spec.key(ID) != k1


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
