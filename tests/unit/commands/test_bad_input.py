"""Bad command-line input: each is one line on stderr naming the value and what is accepted, exit code 2, never a
traceback and never silently accepted (issue 20). Real `python -m rtckern` processes, no GPU."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def rtckern(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), RTCKERN_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", "rtckern", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=REPO)


def refused(r: subprocess.CompletedProcess, match: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert re.search(match, r.stderr), r.stderr


def ex(op: str, *rest: str, shape: str = "8192x4096") -> tuple[str, ...]:
    return ("explain", op, "--shape", shape, "--arch", "sm_90", *rest)


@pytest.mark.parametrize("argv, match", [
    # unknown option keys of every family's request builder
    (ex("rms_norm", "--opt", "residul=1"),
     r"^rtckern explain: op 'rms_norm' takes no option\(s\) \['residul'\]; its options: \['vec', 'w', 'y', "
     r"'bias', 'residual', 'save_stats', 'zero_centered'\]$"),
    (ex("rms_norm_backward", "--opt", "residual=1"),
     r"op 'rms_norm_backward' takes no option\(s\) \['residual'\]; its options: \['vec', 'w', 'dx', 'dy', "),
    # an fp8 rms_norm output is rms_norm_quant's: the refusal names it
    (ex("rms_norm", "--opt", "y=fp8_e4m3"),
     r"^rtckern explain: rms_norm: option y='fp8_e4m3': an fp8 output is rms_norm_quant's .*"
     r"`rtckern explain rms_norm_quant --opt group=128`$"),
    (ex("softmax", "--opt", "mask16=1"),
     r"op 'softmax' takes no option\(s\) \['mask16'\]; its options: \['vec'\]$"),
    (ex("gemm", "--opt", "bais=1", shape="128x128x128"),
     r"op 'gemm' takes no option\(s\) \['bais'\]; its options: \['trans_b', 'out', 'bias', 'act', "),
    (ex("attention", "--opt", "casual=1", shape="128"),
     r"op 'attention' takes no option\(s\) \['casual'\]; its options: \['causal'\]$"),
    # booleans: 1/0, true/false, yes/no, on/off only
    (ex("attention", "--opt", "causal=maybe", shape="128"),
     r"^rtckern explain: attention: option causal='maybe' is not a boolean; write 1/0, true/false, yes/no or "
     r"on/off$"),
    (ex("gemm", "--opt", "trans_b=2", shape="128x128x128"),
     r"gemm: option trans_b='2' is not a boolean"),
    (ex("scaled_masked_softmax", "--opt", "mask16=y"), r"option mask16='y' is not a boolean"),
    (ex("gemm", "--opt", "act=relu", shape="128x128x128"),
     r"gemm: option act='relu' is not one of none, gelu_tanh, silu$"),
    # vec: a power of two that divides N and moves at most 16 bytes
    (ex("rms_norm", "--opt", "vec=-4"), r"rms_norm: option vec=-4 is below 1"),
    (ex("rms_norm", "--opt", "vec=3"),
     r"rms_norm: option vec=3 does not fit; vec is a power of two from 1 to 8 \(16 bytes per access at most\) "
     r"that divides N=4096; the default is 8$"),
    (ex("softmax", "--opt", "vec=0"), r"softmax: option vec=0 is below 1"),
    (ex("softmax", "--opt", "vec=abc"),
     r"softmax: option vec='abc' is not an integer; write a whole number >= 1 in ASCII digits$"),
    (ex("softmax", "--opt", "vec=１６"), r"option vec='１６' is not an integer"),
    (ex("rms_norm", "--opt", "novalue"), r"--opt 'novalue': write KEY=VALUE"),
    # numbers and strings of the command line
    (ex("rms_norm", "--sm-count", "-5"),
     r"^rtckern explain: argument --sm-count: '-5' is not a whole number >= 1 .*`rtckern explain --help` lists"),
    (("explain", "rms_norm", "--shape", "8192x4096", "--arch", "８.0"), r"unknown arch entry '８.0'; accepted forms"),
    (("explain", "rms_norm", "--shape", "8192x１２８", "--arch", "sm_90"),
     r"shape '8192x１２８': write dimensions joined by 'x', e.g. 8192x4096$"),
    (("explain", "rms_norm", "--shape", "8192x4096", "--device", "5"),
     r"^rtckern explain: --device probes on a live GPU; --device 5 asked, but (no GPU is visible|\d+ GPU)"),
    (ex("rms_norm", "--import", "nosuchmod"),
     r"^rtckern explain: --import nosuchmod: no module named 'nosuchmod'; give a module importable"),
    (("prefill", "--arch", "9.0", "-j", "0"), r"argument --jobs/-j: '0' is not a whole number >= 1"),
    (("prefill", "--arch", "9.0", "-j", "-1"), r"argument --jobs/-j: '-1' is not a whole number >= 1"),
    (("prefill", "--arch", ""), r"^rtckern prefill: empty arch list; give at least one entry"),
    (("prefill", "--arch", "9.0", "--family", "nosuch"),
     r"^rtckern prefill: unknown kernel family 'nosuch'; the families: core, "),
    (("prefill", "--arch", "9.0", "--family", "core", "--import", "nosuchmod"), r"--import nosuchmod: no module"),
    (("prefill", "--arch", "9.0", "--preset", "common", "--family", "core"),
     r"--family selects from the built-in kernel set"),
    (("prefill", "--arch", "9.0", "--family", "core", "--all-candidates"),
     r"--all-candidates applies to --manifest/--preset"),
    (("tune", "softmax", "--shapes", ","), r"--shapes ',' names no shape"),
    (("cache", "ls", "--arch", ""), r"^rtckern cache: empty arch list; give at least one entry"),
    (("cache", "export", "--bundle", "b", "--arch", ""), r"^rtckern cache: empty arch list; give at least one entry"),
    (("cache", "prune", "--max-bytes", "-1"), r"argument --max-bytes: '-1' is not a size; give bytes or a number "
                                              r"with a K/M/G/T suffix"),
    (("cache", "prune", "--max-bytes", "1X"), r"argument --max-bytes: '1X' is not a size"),
    (("cache", "prune"), r"^rtckern cache: prune needs at least one of --max-bytes SIZE \(e.g. 10G\), "
                         r"--older-than-days DAYS, --superseded"),
    (("cache", "prune", "--older-than-days", "nan"), r"argument --older-than-days: 'nan' is not a finite number"),
    (("cache", "import", "x.bundle", "--max-member-bytes", "0"),
     r"argument --max-member-bytes: '0' is 0 bytes; give a size of at least 1 byte"),
])
def test_refused_with_one_line(tmp_path, argv, match):
    refused(rtckern(*argv, cache=tmp_path / "cache"), match)


def test_manifest_that_is_not_utf8(tmp_path):
    bad = tmp_path / "m.jsonl"
    bad.write_bytes(b'{"op": "rms_norm", "dtype": "bf16", "shape": [8]}\n\xff\xfe\n')
    refused(rtckern("prefill", "--manifest", str(bad), "--arch", "9.0", cache=tmp_path / "c"),
            rf"^rtckern prefill: {re.escape(str(bad))}:2: not UTF-8 text \(byte 0xff at offset 50\); a manifest "
            r"is JSON lines in UTF-8$")


def test_export_into_a_directory(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "c" / "v1").mkdir(parents=True)  # an (empty) cache
    refused(rtckern("cache", "export", "--bundle", str(tmp_path / "out"), cache=tmp_path / "c"),
            rf"^rtckern cache: --bundle {re.escape(str(tmp_path / 'out'))} is a directory; give a file path, e.g. ")


def test_replayed_request_with_a_text_boolean(tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_text('{"op": "attention", "dtype": "bf16", "shape": [128], "request": {"dtypes": {"qkv": "bf16"}, '
                 '"shape": {"head_dim": 128}, "flags": {"causal": "0"}}}\n')
    refused(rtckern("prefill", "--manifest", str(m), "--arch", "9.0", cache=tmp_path / "c"),
            rf"^rtckern prefill: {re.escape(str(m))}:1: request flag 'causal' = '0' is text; write the boolean as "
            r"JSON false \(a string would count as true\)$")


def test_manifest_option_with_a_bad_boolean_fails_its_line(tmp_path):
    m = tmp_path / "m.jsonl"
    m.write_text('{"op": "attention", "dtype": "bf16", "shape": [128], "causal": "maybe"}\n')
    r = rtckern("prefill", "--manifest", str(m), "--arch", "9.0", "--no-progress", cache=tmp_path / "c")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert ("FAILED attention(bf16, 128, causal=maybe) on sm_90: OptionError: attention: option causal='maybe' is "
            "not a boolean; write 1/0, true/false, yes/no or on/off") in r.stderr.splitlines()


def test_an_unusable_cache_or_tuning_dir_is_no_traceback(tmp_path):
    """A cache dir that is a file: explain still answers (kernels and probe decisions kept in memory, with
    warnings) where it raised NotADirectoryError; a tuning table that is a directory: one line naming it, exit 2."""
    (tmp_path / "afile").write_text("")
    r = rtckern(*ex("rms_norm"), cache=tmp_path / "afile")
    assert r.returncode == 0 and "Traceback" not in r.stderr and "chosen" in r.stdout, r.stderr
    (tmp_path / "tuning" / "norm_fwd.json").mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), RTCKERN_CACHE_DIR=str(tmp_path / "c"),
               RTCKERN_TUNING_DIR=str(tmp_path / "tuning"))
    r = subprocess.run([sys.executable, "-m", "rtckern", *ex("rms_norm")], capture_output=True, text=True, env=env,
                       timeout=300, cwd=REPO)
    refused(r, r"norm_fwd.json: cannot read the tuning table \(Is a directory\); fix its permissions or move it away$")
