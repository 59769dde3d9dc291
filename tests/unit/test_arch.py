import pytest
from hypothesis import given, strategies as st

from rtckern.arch import Arch, ArchFilter, choose_target, parse_arch_list, format_arch_list
from rtckern.errors import ArchError


@pytest.mark.parametrize("text, sm, ptx", [
    ("7.5", "sm_75", False), ("8.6+PTX", "sm_86", True), ("9.0a", "sm_90a", False), ("sm_90a", "sm_90a", False),
    ("compute_90", "sm_90", True), ("90", "sm_90", False), ("100a", "sm_100a", False), ("sm_120", "sm_120", False),
    ("gfx90a", "gfx90a", False), (" SM_80 ", "sm_80", False), ("12.0", "sm_120", False),
])
def test_parse_single(text, sm, ptx):
    a = Arch.parse(text)
    assert a.sm == sm and a.ptx == ptx


@pytest.mark.parametrize("bad", ["", "sm_", "8", "8.x", "gfx", "volta", "sm90", "9.0b", "compute_9"])
def test_parse_rejects_unknown(bad):
    with pytest.raises(ArchError, match="accepted forms"):
        parse_arch_list(bad) if bad == "" else Arch.parse(bad)


def test_unknown_entry_named_in_list():
    with pytest.raises(ArchError, match=r"unknown arch entry 'turing'.*accepted forms: '7.5'"):
        parse_arch_list("8.0;turing")


def test_list_separators_dedupe_and_order():
    archs = parse_arch_list("9.0 8.0,7.5;8.0 sm_80 8.6 8.6+PTX 9.0a")
    assert format_arch_list(archs) == "7.5;8.0;8.6+PTX;9.0;9.0a"


def test_native_uses_visible_devices():
    archs = parse_arch_list("native;8.0", native=lambda: [Arch(9, 0), Arch(9, 0)])
    assert [a.sm for a in archs] == ["sm_80", "sm_90"]
    with pytest.raises(ArchError, match="no GPU is visible"):
        parse_arch_list("native", native=lambda: [])


@given(st.lists(st.sampled_from(["7.5", "8.0", "sm_80", "8.6+PTX", "86", "9.0a", "compute_90", "gfx90a", "sm_100a"]),
                min_size=1, max_size=12), st.sampled_from([";", ",", " ", " ; "]))
def test_property_order_independent_and_deduplicated(entries, sep):
    a = parse_arch_list(sep.join(entries))
    b = parse_arch_list(sep.join(reversed(entries)))
    assert a == b
    keys = [(x.vendor, x.cc, x.suffix, x.gfx) for x in a]
    assert len(keys) == len(set(keys))
    assert parse_arch_list(format_arch_list(a)) == a


def test_filter_min_max_and_specific():
    archs = parse_arch_list("7.5;8.0;8.6;9.0;9.0a;10.0;gfx90a")
    f = ArchFilter.of(min_arch="8.0", max_arch="9.0")
    assert [t.sm for t in f.targets(archs)] == ["sm_80", "sm_86", "sm_90"]  # 9.0 and 9.0a collapse to one sm_90
    wg = ArchFilter.of(min_arch="9.0", max_arch="9.0", arch_specific=True)
    assert [t.sm for t in wg.targets(archs)] == ["sm_90a"]
    assert "below the minimum sm_80" in f.reason(Arch.parse("7.5"))
    assert "nvidia only" in f.reason(Arch.parse("gfx90a"))
    assert "arch-specific" in wg.reason(Arch.parse("8.6")) or "below" in wg.reason(Arch.parse("8.6"))
    amd = ArchFilter.of(vendors=("nvidia", "amd"))
    assert [t.sm for t in amd.targets(archs)][0] == "gfx90a"


def test_choose_target():
    sup = (75, 80, 86, 89, 90, 100, 120)
    assert choose_target(Arch(9, 0), sup).sm == "sm_90"
    assert choose_target(Arch(9, 0), sup, arch_specific=True).sm == "sm_90a"
    ptx = choose_target(Arch(12, 1), sup, nvrtc_version=(13, 0), driver_version=(13, 0))
    assert ptx.ptx and ptx.sm == "sm_120"
    with pytest.raises(ArchError, match="refuses PTX from a newer NVRTC"):
        choose_target(Arch(12, 1), sup, nvrtc_version=(13, 2), driver_version=(13, 0))
    with pytest.raises(ArchError, match=r"dropped Volta \(sm_70/sm_72\), and rtckern needs CUDA 13 \(cuda-bindings "
                                        r"13.x\): Volta is not supported; run torch's own ops there"):
        choose_target(Arch(7, 0), sup, nvrtc_version=(13, 0))


@pytest.mark.parametrize("text, what", [("native", "the visible GPUs"), ("8.0;9.0", "several archs"),
                                        ("8.0, 9.0", "several archs")])
def test_one_arch_refuses_what_only_an_arch_list_takes(text, what):
    """Where one arch is asked for (explain / ops / tune --arch), 'native' and lists are refused for what they are,
    not as unknown entries whose accepted forms name 'native' again."""
    with pytest.raises(ArchError, match=rf"^'{text}' names {what}, as an arch list does; give one arch here: '7.5', "
                                        r"'8.6\+PTX', '9.0a', 'sm_90a', 'compute_90', '90', 'gfx90a'$"):
        Arch.parse(text)
    assert [a.sm for a in parse_arch_list("8.0;9.0")] == ["sm_80", "sm_90"]


def test_can_run_on():
    assert Arch(8, 0).can_run_on(Arch(8, 6))
    assert not Arch(8, 6).can_run_on(Arch(8, 0))
    assert not Arch(9, 0, "a").can_run_on(Arch(10, 0))
    assert not Arch(8, 0).can_run_on(Arch(9, 0))
