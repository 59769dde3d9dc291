import json

import pytest

from rtckern.fleet import ManifestError, load_manifest, load_preset, parse_lines, plan, preset_names
from rtckern.prefill import parse_archs


def test_lines_options_comments_and_duplicates(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('# a comment\n\n{"op": "axpy", "dtype": "bf16", "shape": [8, 4096], "aligned": true}\n'
                 '{"shape": [8, 4096], "aligned": true, "dtype": "bf16", "op": "axpy", "comment": "same"}\n'
                 '{"op": "axpy", "dtype": "fp32", "shape": [7], "vec": 4, "scale": 0.5}\n')
    entries = load_manifest(p)
    assert len(entries) == 2  # the second line is the first one with its keys in another order (and a comment)
    assert entries[0].options == (("aligned", "1"),) and entries[0].shape == (8, 4096)
    assert entries[1].options == (("scale", "0.5"), ("vec", "4"))
    assert entries[0].where == f"{p}:3"


@pytest.mark.parametrize("line, message", [
    ('{"op": "axpy", "shape": [4]}', r"missing field\(s\) \['dtype'\]; every line needs op, dtype and shape"),
    ('{"op": "axpy", "dtype": "bf17", "shape": [4]}', "dtype 'bf17' is not one of fp32, fp16, bf16"),
    ('{"op": "axpy", "dtype": "bf16", "shape": "8192x4096"}', "shape must be a non-empty list of positive ints"),
    ('{"op": "axpy", "dtype": "bf16", "shape": [0, 4]}', "shape must be a non-empty list of positive ints"),
    ('{"op": "axpy", "dtype": "bf16", "shape": [4], "opt": [1, 2]}', "option 'opt' = \\[1, 2\\]"),
    ('{"op": "", "dtype": "bf16", "shape": [4]}', "op must be a non-empty string"),
    ('{"op": "axpy", "dtype": "bf16", "shape": [4], "device": {"sm": 90}}', "device must be an object with"),
    ('{"op": "axpy", "dtype": "bf16", "shape": [4], "device": {"arch": "８.0"}}',
     "device unknown arch entry '８.0'; accepted forms"),
    ('{"op": "axpy", "dtype": "bf16", "shape": [4], "device": {"arch": "sm_90", "sm_count": -5}}',
     "device sm_count = -5: expected a positive int"),
    ('{"op": "axpy", "dtype": "bf16", "shape": [4], "device": {"arch": "sm_90", "sms": 132}}',
     r"device field\(s\) \['sms'\] unknown; a device has arch, name, sm_count, "),
    ('{"op": "attention", "dtype": "bf16", "shape": [128], "request": {"flags": {"causal": "0"}}}',
     r"request flag 'causal' = '0' is text; write the boolean as JSON false \(a string would count as true\)"),
    ('{"op": "attention", "dtype": "bf16", "shape": [128], "request": {"flags": {"causal": "On"}}}',
     r"request flag 'causal' = 'On' is text; write the boolean as JSON true"),
    ('{"op": "axpy", "dtype": "bf16", "shape": [4], "request": {"shape": {"n": true}}}',
     r"request shape 'n' = True: expected an int"),
    ('{"op": "axpy", "dtype": "bf16", "shape": [4], "request": {"flags": [1]}}',
     r"request flags must be an object of name: value, got \[1\]"),
    ('{"op": "axpy", dtype: bf16}', "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
])
def test_bad_lines_name_file_line_and_fix(line, message):
    with pytest.raises(ManifestError, match="^m.jsonl:2: " + message):
        parse_lines(['{"op": "axpy", "dtype": "bf16", "shape": [4]}', line], "m.jsonl")


def test_manifest_that_is_not_utf8(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_bytes('{"op": "axpy", "dtype": "bf16", "shape": [4], "comment": "é"}\n'.encode() + b'{"op": "\xe9"}\n')
    with pytest.raises(ManifestError, match=r"m.jsonl:2: not UTF-8 text \(byte 0xe9 at offset 71\); a manifest is "
                                            r"JSON lines in UTF-8$"):
        load_manifest(p)


def test_missing_file_and_unknown_preset(tmp_path):
    with pytest.raises(ManifestError, match="cannot read manifest .*nope.jsonl"):
        load_manifest(tmp_path / "nope.jsonl")
    with pytest.raises(ManifestError, match="no preset named 'gpt-9'; presets: common, "):
        load_preset("gpt-9")


def test_presets_ship_and_cover_the_common_shapes():
    names = preset_names()
    assert {"common", "llama-3.2-1b", "llama-3.1-8b", "qwen2.5-14b", "llama-3.1-70b"} <= set(names)
    common = load_preset("common")
    hidden = {e.shape[-1] for e in common if e.op == "rms_norm"}
    head_dims = {e.shape[-1] for e in common if e.op == "attention"}
    assert hidden == {2048, 4096, 5120, 8192} and head_dims == {64, 128}
    assert {e.shape[-1] for e in common if e.op == "attention_varlen"} == {64, 128}
    # GQA: the fused QKV projection of Llama-3.1-8B is (32 + 2 * 8) heads x 128 wide
    qkv = [e for e in load_preset("llama-3.1-8b") if e.op == "gemm" and e.shape[1:] == (6144, 4096)]
    assert len(qkv) == 3


def test_every_preset_line_builds_or_names_its_missing_op_family():
    """Each line either becomes a request through its op's registered builder, or fails only because its op
    family has not registered a builder yet. A line with a wrong option or shape for a registered op fails this."""
    import rtckern.ops  # noqa: F401  (the built-in op families register their builders)
    from rtckern.registry import default_registry

    reg = default_registry()
    for name in preset_names():
        for p in plan(load_preset(name), parse_archs("8.0;9.0a"), reg):
            if p.entry.op in reg.builder_ops():
                assert p.request is not None and not p.error, f"{name}: {p.describe()}: {p.error}"
                assert p.chain, f"{name}: {p.describe()}: no viable candidate"
            else:
                assert p.error.startswith(f"op {p.entry.op!r} has no request builder: its op family is not "
                                          "installed or has not registered yet"), p.error


def test_entry_json_roundtrip(tmp_path):
    e = parse_lines(['{"op": "axpy", "dtype": "bf16", "shape": [4], "aligned": false}'])[0]
    assert e.to_json() == {"op": "axpy", "dtype": "bf16", "shape": [4], "aligned": False}
    assert json.loads(e.canonical) == e.to_json()
