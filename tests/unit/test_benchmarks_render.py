"""`python -m benchmarks FAMILY --render JSON` on the CPU: every suite re-writes a small synthetic result set from its
stored rows alone (the JSON back byte for byte, the markdown under the recorded environment, the PNG where
matplotlib is installed), sets written before the runner get their environment as meta, and bad input is refused in
one line."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the benchmarks package lives beside rtckern, not inside it
    sys.path.insert(0, str(ROOT))

from benchmarks import runner  # noqa: E402
from benchmarks.env import legacy_meta  # noqa: E402

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
GPU = {"name": "NVIDIA H100 80GB HBM3", "count": 1, "sm_count": 132, "cc": "9.0", "memory_gib": 79.2}


def meta(command: str, gpu: bool = True) -> dict:
    return {"date": "2026-01-02T03:04:05Z", "commit": "abc1234", "dirty": False, "host": "box", "python": "3.12.3",
            "cpu": "x86_64", "cores": 2, "loadavg": [1.0, 1.0, 1.0], "packages": {"torch": "2.11.0"},
            "driver": "580.159.04" if gpu else None, "driver_cuda": "13.0" if gpu else None,
            "gpu": GPU if gpu else None, "torch": "2.11.0+cu130", "nvrtc": "13.0", "command": command,
            "gpu_used": gpu}


def payload(family: str, title: str, rows: list, command: str = "", gpu: bool = True, **data) -> dict:
    return {"family": family, "title": title, "meta": meta(f"python -m benchmarks {family} {command}".strip(), gpu),
            "rows": rows, **data}


def tflops_row(hd, seqlen, causal, **tflops) -> dict:
    return {"hd": hd, "heads": 16, "seqlen": seqlen, "batch": 16384 // seqlen, "causal": causal,
            "ms": {k: 1.0 for k in tflops}, "spread": {k: [0.9, 1.1] for k in tflops}, "tflops": tflops}


GEMM_ROW = {"m": 16, "n": 4096, "k": 4096, "dtype": "bf16", "trans_b": True, "group": "skinny", "us": 10.0,
            "tflops": 50.0, "torch_us": 9.0, "torch_tflops": 55.0, "ratio_vs_torch": 0.9, "eager_us": 18.0,
            "rel_err": 1.7e-3, "err_bound": 0.25, "ok": True, "candidate": "gemm.sm80_mma",
            "config": {"kind": "sm80", "bm": 16, "group_m": 8}, "config_source": "exact"}
SKINNY_ROW = {"m": 16, "n": 4096, "k": 4096, "layout": "tn", "rel_err": 1.7e-3, "err_bound": 0.25, "ok": True,
              "graph_us": 9.5, "torch_graph_us": 9.4, "rot_us": 13.1, "torch_rot_us": 13.3, "eager_submit_us": 18.2,
              "eager_us": 18.3, "torch_eager_submit_us": 14.9, "torch_eager_us": 15.0, "ratio_graph": 0.98,
              "ratio_rot": 1.01, "ratio_eager": 0.82, "hbm_tbs_rot": 2.57, "candidate": "gemm.sm80_mma",
              "config": {"kind": "sm80", "group_m": 8}, "config_source": "exact"}
NORMS_ROW = {"op": "rms", "dtype": "bf16", "n": 4096, "copy_gbps": 4000.0, "ours_fwd_gbps": 3900.0,
             "eager_fwd_gbps": 3000.0, "compile_fwd_gbps": None, "ours_bwd_gbps": 3500.0, "eager_bwd_gbps": 1800.0,
             "fwd_err": 1e-3, "bwd_err": 1e-3, "fwd_kind": "rms_norm.l2", "bwd_kind": "rms_norm_backward.rows"}
SOFTMAX_ROW = {"op": "softmax", "dtype": "bf16", "n": 4096, "shape": "32768x4096", "rtk_fwd_gbps": 4000.0,
               "fwd_vs_copy": 0.96, "eager_fwd_gbps": 1600.0, "eager_plain_fwd_gbps": 2600.0,
               "compile_fwd_gbps": 4100.0, "rtk_bwd_gbps": 4300.0, "bwd_vs_copy": 1.03, "eager_bwd_gbps": 1800.0,
               "impl_fwd": "softmax.onepass", "impl_bwd": "softmax_backward.onepass"}
CORE_LAUNCH = {"cuda_core_0args": 3.6, "cuda_core_8args": 4.3, "rtckern_0args": 4.1, "rtckern_8args": 4.7,
               "rtckern_8args_torch_stream_obj": 5.0, "cupy_rawkernel_8args": 5.7, "torch_add_": 6.3}
CORE_ROWS = [{"launcher": "cuda.core launch (raw)", "args0_us": 3.6, "args8_us": 4.3},
             {"launcher": "rtckern Kernel.launch (int stream)", "args0_us": 4.1, "args8_us": 4.7},
             {"launcher": "rtckern Kernel.launch (torch stream)", "args0_us": None, "args8_us": 5.0},
             {"launcher": "CuPy RawKernel", "args0_us": None, "args8_us": 5.7},
             {"launcher": "torch eager `add_`", "args0_us": 6.3, "args8_us": None}]
RANK = {"rank": 0, "device": "NVIDIA H200", "errors": {"rms_norm": 1.7e-3}, "ok": True, "first_output_s": 2.6,
        "compiles": ["k1"], "events": [["k1", "compile", 180.0, "rtk_norm_fwd_rows"], ["k1", "memory", 0.01,
                                                                                         "rtk_norm_fwd_rows"],
                                        ["k2", "disk", 250.0, "softmax_fwd_async"]]}
PLUGIN_E2E = {"part": "e2e", "model": "small",
              "config": {"num_hidden_layers": 2, "hidden_size": 64, "batch": 2, "seq": 256},
              "replaced": 5, "attention": "rtckern",
              "accuracy": {"logits_err_torch_bf16": 1e-2, "logits_err_rtckern_bf16": 1e-2,
                           "grad_err": {"lm_head.weight": {"torch_bf16": 1e-2, "rtckern_bf16": 1e-2}}},
              "accuracy_failures": [], "speed": {"forward_ms": {"torch": 2.0, "rtckern": 1.8, "speedup": 1.11},
                                                 "fwd_bwd_ms": {"torch": 6.0, "rtckern": 5.9, "speedup": 1.02}}}
ROPE_ROW = {"shape": "Llama 4L training step (issue 22)", "batch": 2, "seqlen": 2048, "heads_q": 16, "heads_k": 4,
            "head_dim": 128, "fwd_err_units": 1.0, "bwd_err_units": 1.0, "fwd_rel_l2": 1.6e-3, "bwd_rel_l2": 1.6e-3,
            "torch_fwd_rel_l2": 2.2e-3, "ok": True, "fwd_us": 14.1, "bwd_us": 14.6, "torch_fwd_us": 162.3,
            "autograd_fwd_bwd_us": 34.7, "torch_fwd_bwd_us": 356.4, "compiled_fwd_us": 16.3,
            "compiled_fwd_bwd_us": 68.8, "fwd_gbs": 3100.0, "bwd_gbs": 3000.0, "fwd_of_copy": 1.05,
            "bwd_of_copy": 1.01, "speedup_fwd_bwd_vs_torch": 10.3, "speedup_fwd_bwd_vs_compiled": 1.98}
SWIGLU_ROW = {"shape": "Llama 4L training step (issue 22)", "tokens": 4096, "n": 5632, "fwd_rel_l2": 1.6e-3,
              "bwd_rel_l2": 1.7e-3, "torch_fwd_rel_l2": 2.5e-3, "ok": True, "fwd_us": 50.0, "bwd_us": 80.0,
              "torch_fwd_us": 100.0, "autograd_fwd_bwd_us": 140.0, "torch_fwd_bwd_us": 400.0, "compiled_fwd_us": 52.0,
              "compiled_fwd_bwd_us": 170.0, "fwd_gbs": 2800.0, "bwd_gbs": 2900.0, "fwd_of_copy": 0.94,
              "bwd_of_copy": 0.97, "speedup_fwd_bwd_vs_torch": 2.9, "speedup_fwd_bwd_vs_compiled": 1.2}
CE_ROW = {"shape": "Llama 4L training step (issue 22)", "tokens": 4096, "n": 32000, "fwd_rel_l2": 3e-8,
          "bwd_rel_l2": 1.7e-3, "torch_bwd_rel_l2": 1.9e-3, "ok": True, "fwd_us": 100.0, "bwd_us": 190.0,
          "torch_fwd_us": 600.0, "autograd_fwd_bwd_us": 300.0, "torch_fwd_bwd_us": 1400.0, "extra_mb": 250.0,
          "torch_extra_mb": 1500.0, "compiled_fwd_us": 200.0, "compiled_fwd_bwd_us": 500.0, "compiled_extra_mb": 260.0,
          "fwd_gbs": 2600.0, "bwd_gbs": 2750.0, "fwd_of_copy": 0.87, "bwd_of_copy": 0.92,
          "speedup_fwd_bwd_vs_torch": 4.67, "speedup_fwd_bwd_vs_compiled": 1.67}
PREFILL_ROW = {"wall_s": 10.0, "cpu_s": 12.0, "kernels": 5, "archs": "9.0", "reported_s": 9.5, "processes": 2,
               "loadavg_1min": [1.0, 1.1]}

# file name -> a result JSON of the suite (every family, every kind of result set it writes)
SETS = {
    "attention_h100.json": payload(
        "attention", "Attention forward, TFLOP/s (rtckern engine)",
        [tflops_row(64, 1024, False, rtckern=300.0, sdpa_flash=250.0),
         tflops_row(64, 4096, True, rtckern=320.0, sdpa_flash=260.0)], engine="rtckern", checks=[]),
    "attention_backward_h100.json": payload(
        "attention_backward", "Attention backward: TFLOP/s against SDPA's flash and cuDNN backward",
        [tflops_row(128, 1024, False, rtckern=300.0, sdpa_flash=250.0, sdpa_cudnn=400.0)], "--reps 7"),
    "attention_backward.json": payload(
        "attention_backward", "Attention backward: cold compile per kernel",
        [{"candidate": "attention_backward.simt", "arch": "sm_90", "kernel": "k<64>", "seconds": 0.4}],
        "--compile-times", gpu=False),
    "attention_varlen_h100.json": payload(
        "attention_varlen", "Attention over packed variable-length sequences: TFLOP/s",
        [{"dist": "128-2k", "hd": 128, "heads": 16, "causal": False, "pass": "fwd", "tokens": 16384,
          "sequences": 20, "longest": 1991, "ms": {"rtckern_varlen": 1.0}, "spread": {"rtckern_varlen": [1.0, 1.1]},
          "tflops": {"rtckern_varlen": 400.0, "rtckern_dense_equal": 380.0, "torch_flash_varlen": 300.0}}],
        "--quick"),
    "attention_kvcache_h200.json": payload(
        "attention_kvcache", "Attention over a KV cache: decode bandwidth, chunked prefill, host cost",
        [{"kind": "decode", "hk": 4, "batch": 1, "ctx": 1024, "cache_mb": 2.0,
          "gbs": {"rtckern_contiguous": 200.0, "rtckern_paged16": 180.0, "sdpa": 280.0},
          "vs_copy": {"rtckern_contiguous": 0.05, "rtckern_paged16": 0.04, "sdpa": 0.07}},
         {"kind": "prefill", "sq": 512, "ctx": 4096, "tflops": {"rtckern_paged64": 500.0, "dense_op": 560.0}}],
        copy_gbs=4190.0, host_us={"rtckern": 30.8, "sdpa": 32.8}),
    "grouped_gemm_h200.json": payload(
        "grouped_gemm", "Grouped GEMM (MoE experts)",
        [{"kind": "contiguous", "dtype": "bf16", "n": 4096, "k": 7168, "groups": 64, "tokens": 128, "skewed": False,
          "tflops": {"rtckern": 410.0, "torch_grouped_mm": 454.0, "torch_loop": 363.0, "dense": 743.0}},
         {"kind": "contiguous", "dtype": "fp8", "n": 4096, "k": 7168, "groups": 64, "tokens": 128, "skewed": False,
          "tflops": {"rtckern": 776.0, "rtckern_loop": 218.0, "dense": 912.0}},
         {"kind": "masked", "dtype": "bf16", "n": 4096, "k": 7168, "groups": 32, "capacity": 64,
          "tflops": {"rtckern": 125.0, "torch_bmm": 122.0}}], "--quick"),
    "norms_h200.json": payload("norms", "rtckern norms benchmark", [NORMS_ROW], copy_gbps={"bf16": 4000.0}),
    "softmax_h200.json": payload("softmax", "Softmax benchmark", [SOFTMAX_ROW], copy_gbps={"bf16": 4170.0},
                                 copy_gbps_4gib=4200.0, elements=1 << 27, scale=0.125, summary={}),
    "gemm_h200.json": payload("gemm", "rtckern GEMM vs torch.matmul", [GEMM_ROW], "--check",
                              kernel_checks=[{"label": "sm80 16x128", "config": "bm=16", "ok": True}]),
    "gemm_skinny_h200.json": payload("gemm_skinny", "Skinny GEMM and per-call cost, rtckern vs torch.matmul",
                                     [SKINNY_ROW], tag="", host=[]),
    "gemm_skinny.json": payload("gemm_skinny", "GEMM host path per call, launches mocked (CPU)",
                                [{"case": "bf16 16x4096x4096", "us_per_call": 9.5, "min_us": 9.1,
                                  "launches_per_call": 1.0}], "--mock-host", gpu=False, tree="/x/rtckern/ops/_gemm",
                                calls=3000, rounds=5),
    "gemm_fp8_h100.json": payload(
        "gemm_fp8", "fp8 GEMM and quantization",
        [{"m": 128, "n": 28672, "k": 8192, "tflops": {"rtckern per-tensor": 627.0, "rtckern block": 600.0,
                                                     "torch._scaled_mm": 656.0}}], "--quick",
        quantize=[{"m": 4096, "k": 7168, "gbs": 1650.0, "copy_gbs": 3000.0}],
        sustained=[{"m": 8192, "n": 8192, "k": 8192, "seconds": 2.0,
                    "series": {"rtckern per-tensor": {"tflops": 1050.0, "mhz": 1312.5, "watts": 691.0},
                               "rtckern block": {"tflops": 950.0},
                               "torch._scaled_mm": {"tflops": 1136.0, "mhz": 1249.2, "watts": 692.5}}}]),
    "plugin_h100.json": payload(
        "plugin", "rtckern.torch end to end", [PLUGIN_E2E], device="NVIDIA H100 80GB HBM3",
        parts=["e2e", "decode", "overhead"], overhead_us={"rms_norm: torch.ops.rtckern.rms_norm": 12.5},
        decode={"config": {"num_hidden_layers": 2, "hidden_size": 64, "prompt": 32, "steps": 16}, "torch_ms": 5.0,
                "rtckern_ms": 4.5, "speedup": 1.11}),
    "core_h200.json": payload("core", "Core service benchmark", CORE_ROWS, device="device 0 NVIDIA H200",
                              copy_gbps=4228.7, cold_compile_ms=[110.8], warm_disk_load_ms=[0.9], memory_hit_us=0.5,
                              launch_us=CORE_LAUNCH, targets={"below_torch": True}),
    "multi_gpu_2xh200.json": payload(
        "multi_gpu", "Multi-GPU cold start: 2 ranks, one cache directory",
        [RANK, dict(RANK, rank=1, compiles=["k2"], events=[["k1", "disk", 150.0, "rtk_norm_fwd_rows"],
                                                         ["k2", "compile", 240.0, "softmax_fwd_async"]])],
        world=2, keys_compiled=2, max_compiles_per_key=1, every_key_compiled_once=True, all_ranks_correct=True),
    "op_overhead_h100.json": payload(
        "op_overhead", "Host cost per call",
        [{"op": "rms_norm [4,4096] bf16", "rtckern_us": 8.0, "torch_us": 9.1, "torch_ops_rtckern_us": 12.5},
         {"op": "rms_norm +residual", "rtckern_us": 16.1, "torch_us": None, "torch_ops_rtckern_us": None}],
        where="NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130)", calls=5000, repeats=5),
    "first_call_h100.json": payload(
        "first_call", "First call in a fresh process, warm cache",
        [{"op": "rms_norm", "gpu-rtckern": {"import_ms": 177.5, "first_ms": 195.5, "second_us": 181.5,
                                            "device": "NVIDIA H100 80GB HBM3"}, "gpu-torch": {"first_ms": 7.8}}],
        mode="gpu", repeats=3),
    "first_call.json": payload(
        "first_call", "First call in a fresh process, warm cache",
        [{"op": "rms_norm", "select": {"import_ms": 170.0, "nvrtc_ms": 40.0, "first_ms": 20.0, "second_us": 90.0,
                                       "chosen": "rms_norm.rows"},
          "call": {"imports_ms": 60.0, "first_ms": 15.0, "second_us": 30.0}}], "--cpu", gpu=False, mode="cpu",
        repeats=1),
    "cache_trust.json": payload(
        "cache_trust", "Cache trust",
        [{"server": "trickle", "get_max_s": 0.5015, "get_warnings_per_call": [1], "get_peak_alloc_bytes": 257559,
          "put_max_s": 0.5021, "put_warnings_per_call": [1], "put_peak_alloc_bytes": 140266, "max_s": 0.5021,
          "within": True}], "--quick", gpu=False,
        remote={"deadline_s": 0.5, "limit_s": 0.55, "calls_per_op": 1, "all_within": True,
                "redis_py_trickle_blocked_s": ">1"},
        race_processes=[{"processes": 2, "kernels": 5, "keys_in_cache": 5, "compiles": 5, "compiles_per_key": 1.0}],
        race_threads=[{"threads": 8, "kernels": 5, "compiles": 5, "compiles_per_key": 1.0}],
        damaged={"entries": 7, "found": {"byte flip": "digest mismatch (corrupt)", "orphan sidecar": 1},
                 "runtime_recompiled": 4, "runtime_served_right": True}),
    "fleet.json": payload(
        "fleet", "Fleet: prefill, bundles and warm starts",
        [{"preset": "quick", "prefill_j1": {"requests": 1, "served": 1, "compiled": 1, "wall_s": 1.2,
                                            "bundle_bytes": 9000},
          "compile_s_per_kernel_one_core": 0.3, "bundles_identical_j1_vs_jN": True, "failures": [],
          "per_arch": {"9.0a": {"entries": 1, "bundle_bytes": 9000, "entry_bytes": 30000, "import_process_s": 0.2}},
          "warm_start_sm90": {"local disk": {"process_s": 0.5, "import_s": 0.3, "select_s": 0.1, "kernels": 1,
                                             "compiles": 0}}}], "--quick", gpu=False,
        setup={"toolchain": "nvrtc-13.5|cuda-headers-13050", "archs": "9.0a", "jobs": 1}),
    "rope_h100.json": payload(
        "rope", "Rotary position embedding (rtckern.ops.rope) against transformers' formula", [ROPE_ROW],
        device="NVIDIA H100 80GB HBM3", copy_gbs=2987.0,
        host_us={"fwd rtckern": 25.5, "fwd torch": 145.4, "fwd+bwd rtckern": 200.8, "fwd+bwd torch": 700.8}),
    "swiglu_h100.json": payload(
        "swiglu", "SwiGLU (rtckern.ops.swiglu) against torch's silu(gate) * up", [SWIGLU_ROW],
        device="NVIDIA H100 80GB HBM3", copy_gbs=2987.0,
        host_us={"fwd rtckern": 20.0, "fwd torch": 15.0, "fwd+bwd rtckern": 150.0, "fwd+bwd torch": 160.0}),
    "cross_entropy_h100.json": payload(
        "cross_entropy", "Cross-entropy (rtckern.ops.cross_entropy) against torch's F.cross_entropy on fp32 logits",
        [CE_ROW], device="NVIDIA H100 80GB HBM3", copy_gbs=2987.0,
        host_us={"fwd rtckern": 30.0, "fwd torch": 40.0, "fwd+bwd rtckern": 180.0, "fwd+bwd torch": 250.0}),
    "prefill.json": payload(
        "prefill", "rtckern prefill: the built-in kernel set, cold and warm, in CPU-seconds",
        [dict(PREFILL_ROW, run="cold (empty cache)"), dict(PREFILL_ROW, run="warm 1 (all cached)", cpu_s=0.5)],
        "--quick", gpu=False, command_measured="rtckern prefill --arch 9.0 --family core", cores=2,
        cold_output="5 kernels for 9.0 in 9.5 s with 2 process(es)"),
}


def render(tmp_path: Path, name: str, doc: dict) -> tuple[int, Path]:
    src = tmp_path / name
    src.write_text(json.dumps(doc, indent=1) + "\n")
    return runner.main([doc.get("family") or name.split("_")[0], "--render", str(src)]), src


def test_every_suite_renders_and_every_suite_is_here():
    def defines_render(family: str) -> bool:  # read, not imported: the gemm suite imports torch at the top
        tree = ast.parse((ROOT / "benchmarks" / f"{family}.py").read_text(encoding="utf-8"))
        return any(isinstance(n, ast.FunctionDef) and n.name == "render" for n in tree.body)

    missing = [f for f in runner.SUITES if not defines_render(f)]
    assert not missing, f"suites without render(payload): {missing}"
    assert {doc["family"] for doc in SETS.values()} == set(runner.SUITES)


@pytest.mark.parametrize("name", sorted(SETS))
def test_a_stored_set_is_rewritten_from_its_rows(tmp_path, name, capsys):
    doc = SETS[name]
    if doc["family"] == "gemm":
        pytest.importorskip("torch")  # the gemm suite imports torch at the top
    rc, src = render(tmp_path, name, doc)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert src.read_text() == json.dumps(doc, indent=1) + "\n", "the JSON comes back byte for byte"
    md = src.with_suffix(".md").read_text().splitlines()
    assert md[0] == f"# {doc['title']}"
    assert md[2] == "- date: 2026-01-02T03:04:05Z, commit abc1234, host box", "the measuring run's environment"
    assert md[3].startswith("- GPU: NVIDIA H100 80GB HBM3 (132 SMs" if doc["meta"]["gpu_used"] else "- GPU: none")
    assert md[5] == f"- command: `{doc['meta']['command']}`"
    assert any(ln.startswith("| ") for ln in md[6:]), "the tables follow the metadata"
    png = src.with_suffix(".png")
    assert png.is_file() == HAVE_MATPLOTLIB, out
    if not HAVE_MATPLOTLIB:
        assert "no plot: matplotlib is not installed" in out


def test_settings_of_the_measuring_run_are_read_back_from_its_command(tmp_path):
    for name, text in (("attention_backward_h100.json", "over 7 back-to-back calls"),  # --reps 7
                       ("attention_varlen_h100.json", "over 5 back-to-back calls"),  # --quick: 5 reps
                       ("gemm_fp8_h100.json", "median of 10 CUDA-event timings")):  # --quick: 10 reps
        assert render(tmp_path, name, SETS[name])[0] == 0
        assert text in (tmp_path / name).with_suffix(".md").read_text(), name


def test_the_markdown_follows_the_stored_rows(tmp_path):
    doc = json.loads(json.dumps(SETS["op_overhead_h100.json"]))
    doc["rows"][0]["rtckern_us"] = 4.25
    render(tmp_path, "op_overhead_h100.json", doc)
    assert "| rms_norm [4,4096] bf16 | 4.2 | 9.1 | 0.47x | 12.5 | 1.37x |" in (
        tmp_path / "op_overhead_h100.md").read_text()


def test_the_sustained_gemm_fp8_table_compares_throughput_and_work_per_clock(tmp_path):
    render(tmp_path, "gemm_fp8_h100.json", SETS["gemm_fp8_h100.json"])
    md = (tmp_path / "gemm_fp8_h100.md").read_text()
    # per-tensor: 1050 / 1136 = 0.92x; per clock (1050 / 1312.5) / (1136 / 1249.2) = 0.88x; block sampled no clock
    assert "| 8192 | 8192 | 8192 | 1050 | 1312 | 691 | 800 | 950 | - | - | - | 1136 | 1249 | 692 | 909 | 0.92x | " \
        "0.84x | 0.88x | - |" in md, md


def test_out_puts_the_set_elsewhere_under_the_same_name(tmp_path):
    src = tmp_path / "op_overhead_h100.json"
    src.write_text(json.dumps(SETS["op_overhead_h100.json"], indent=1) + "\n")
    assert runner.main(["op_overhead", "--render", str(src), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "op_overhead_h100.md").is_file() and not (tmp_path / "op_overhead_h100.md").exists()


def test_a_set_from_before_the_runner_gets_its_environment_as_meta(tmp_path):
    old = {"env": {"date": "2026-11-26T16:30:58+00:00", "python": "3.12.3", "torch": "2.11.0+cu130",
                   "torch_cuda": "13.0", "gpu": "NVIDIA H100 80GB HBM3", "sm_count": 132, "cudnn": 91900,
                   "driver": "580.159.04", "nvrtc": "13.0", "rtckern": "0.1.0"},
           "engine": "rtckern", "checks": [], "bench": SETS["attention_h100.json"]["rows"],
           "gpu_tests": {"tests": 2, "passed": 2, "failed": 0, "errors": 0, "skipped": 0, "failing": [],
                         "seconds": 1.0, "date": "2026-11-26"}}
    assert render(tmp_path, "attention_h100.json", old)[0] == 0
    new = json.loads((tmp_path / "attention_h100.json").read_text())
    assert list(new)[:4] == ["family", "title", "meta", "rows"] and new["rows"] == old["bench"]
    assert new["gpu_tests"] == old["gpu_tests"] and new["engine"] == "rtckern"
    m = new["meta"]
    assert m["gpu"] == {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132} and m["driver"] == "580.159.04"
    assert m["date"] == old["env"]["date"] and m["packages"]["rtckern"] == "0.1.0" and m["cudnn"] == 91900
    md = (tmp_path / "attention_h100.md").read_text()
    assert "- GPU: NVIDIA H100 80GB HBM3 (132 SMs), driver 580.159.04\n" in md
    assert render(tmp_path, "attention_h100.json", new)[0] == 0  # and the converted set renders as it is
    assert json.loads((tmp_path / "attention_h100.json").read_text()) == new


def test_legacy_meta_reads_the_older_environment_forms():
    smi = legacy_meta({"date": "d", "nvidia_smi": "NVIDIA H200, 580.159.04, 143771 MiB, 1980 MHz\n"
                                                  "NVIDIA H200, 580.159.04, 143771 MiB, 1980 MHz",
                       "gpu": {"name": "NVIDIA H200", "sm_count": 132, "torch_cuda": "13.0"},
                       "packages": {"torch": "2.11.0"}}, gpu_used=True)
    assert smi["gpu"] == {"name": "NVIDIA H200", "sm_count": 132, "count": 2} and smi["driver"] == "580.159.04"
    assert smi["nvidia_smi"][1] == {"name": "NVIDIA H200", "driver": "580.159.04", "memory": "143771 MiB",
                                    "max_sm_clock": "1980 MHz"}
    assert smi["torch"] == "2.11.0" and smi["torch_cuda"] == "13.0"
    flat = legacy_meta({"gpu": "NVIDIA H200", "capability": "9.0", "nvrtc": "nvrtc-13.0", "rtckern_commit": "acb59aa",
                        "cuda_torch": "13.0", "cuda-core": "1.2.0", "arch": "sm_90"}, gpu_used=True)
    assert flat["gpu"] == {"name": "NVIDIA H200", "cc": "9.0"} and flat["nvrtc"] == "13.0"
    assert flat["commit"] == "acb59aa" and flat["torch_cuda"] == "13.0" and flat["packages"] == {"cuda-core": "1.2.0"}
    assert flat["arch"] == "sm_90", "a field the runner has no name for is kept as it was"
    cpu = legacy_meta({"date": "d"}, gpu_used=False)
    assert cpu["gpu"] is None and cpu["gpu_used"] is False and cpu["driver"] is None


def test_the_plot_is_stamped_with_the_environment():
    text = runner.stamp_text(meta("python -m benchmarks norms"), 400)
    lines = text.splitlines()
    assert lines[0] == "date: 2026-01-02T03:04:05Z, commit abc1234, host box"
    assert lines[1].startswith("GPU: NVIDIA H100 80GB HBM3") and "driver 580.159.04 (CUDA 13.0)" in lines[1]
    assert lines[2].startswith("versions: torch 2.11.0+cu130") and len(lines) == 3, "no command line"


def test_bad_input_is_refused_in_one_line(tmp_path, capsys):
    src = tmp_path / "x.json"
    src.write_text(json.dumps(SETS["prefill.json"]))
    assert runner.main(["fleet", "--render", str(src)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"benchmarks fleet: {src} is a result set of 'prefill', not of 'fleet'"
    assert runner.main(["fleet", "--render", str(tmp_path / "none.json")]) == 2
    assert capsys.readouterr().err.startswith("benchmarks fleet: cannot read")
    src.write_text(json.dumps({"family": "fleet", "rows": [{"preset": "p"}]}))
    assert runner.main(["fleet", "--render", str(src)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"benchmarks fleet: {src} is not a result set this suite can read (KeyError")
    assert len(err.splitlines()) == 1
