"""Tests import only public names, or rtckern.testing: an AST scan of every test file under tests/.

A test that imports a private module (`rtckern.ops._norms.plan`, `rtckern.plugins._torch_ref`: any component of the
module path after `rtckern` that starts with "_") or a private name (`from rtckern.commands.selftest import
_example_args`) freezes today's file split: moving code between private modules breaks tests that check nothing
about the move. What a test needs from inside a family is either

- a public name: `rtckern.ops.*`, `rtckern.registry` (build_request: a family's requests as `rtckern explain`
  builds them; candidates(op); kernel_providers; explain), `rtckern.plugins.torch`, ...;
- a test helper worth keeping stable: re-exported from `rtckern.testing` (compile_all, torch_reference, ...),
  which is the one place to change when files move;
- or a family's internals that the test genuinely checks (a plan module's memo, a kernel-config table): listed in
  ALLOWED below, file -> module -> why. The list only shrinks: an entry no import uses any more fails the test too.

Every import counts: module level or inside a function, `import a.b`, `from a import b`, `from a import _b`, and
`importlib.import_module` / `__import__` with a literal name. Each violation is reported as file:line.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PKG = ROOT / "rtckern"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p) for p in PKG.rglob("*.py")}


def is_private(module: str) -> bool:
    """Any component after the package name starts with "_", dunders (`__version__`, `__main__`) aside."""
    return any(c.startswith("_") and not (c.startswith("__") and c.endswith("__")) for c in module.split(".")[1:])


def _imported(node: ast.AST) -> list[str]:
    """The rtckern names an import node brings in: module paths, or `module.name` for a name taken from a module."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
    if isinstance(node, ast.Call) and node.args:
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        arg = node.args[0]
        if name in ("import_module", "__import__") and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return [arg.value]
    return []


def private_imports(tests: Path = TESTS, root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(file relative to root, line, private rtckern module or name) for every such import under tests."""
    out = []
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in _imported(node):
                if name.startswith("rtckern.") and is_private(name):
                    out.append((rel, node.lineno, _owner(name)))
    return sorted(out)


def _owner(name: str) -> str:
    """`rtckern.a._b` -> itself when a module, else the first private module on the path (the deepest module of a
    private package: `rtckern.ops._norms.plan.lookup` -> `rtckern.ops._norms.plan`), else the whole name (a private
    name taken from a public module)."""
    parts = name.split(".")
    for i in range(2, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if parts[i - 1].startswith("_") and (prefix in MODULES or i == len(parts)):
            while i < len(parts) and ".".join(parts[:i + 1]) in MODULES:
                i += 1
            return ".".join(parts[:i])
    return name


# ---- the allowlist: file -> private module (or name) -> why the test needs it ----------------------------------
LAUNCH = ("the launch path (kernel.py, prepared.py, ops/_gemm/launch.py, ops/_attention/launch.py, the norms/softmax "
          "plans) is being rebuilt under issue 21 by another change; switch this import when that lands")
ALLOWED: dict[str, dict[str, str]] = {
    "tests/unit/plugins/test_torch_native.py": {
        "rtckern.plugins._torch_native": "builds the native front's library once per module for the subprocesses, "
                                         "which serve test ops through it at AutogradCPU (its CUDA registration's "
                                         "CPU stand-in)",
    },
    "tests/unit/ops/test_rms_norm_quant.py": {
        "rtckern.ops._norms.candidates": "rms_norm_quant's request builders and candidate refusals",
        "rtckern.ops._norms.geometry": "the fp8 row kernel's specs and row configs for the compile sweep",
    },
    "tests/unit/plugins/test_torch_grouped.py": {
        "rtckern.plugins._torch_dispatch": "reference_mode: the grouped GEMM ops through their torch references on CPU",
    },
    "tests/unit/plugins/test_torch_fp8.py": {
        "rtckern.plugins._torch_dispatch": "reference_mode: the fp8 ops through their torch references on CPU",
    },
    "tests/unit/ops/test_rope.py": {
        "rtckern.ops._rope.geometry": "the vector-width and block-size rules, the launch contract and every kernel "
                                      "variant (compiled without spills)",
    },
    "tests/unit/ops/test_glu.py": {
        "rtckern.ops._glu.geometry": "the vector-width and grid rules, the launch contract and every kernel variant "
                                     "(compiled without spills)",
    },
    "tests/unit/ops/test_cross_entropy.py": {
        "rtckern.ops._loss.geometry": "the vector-width, block-size and grid rules, the launch contract and every "
                                      "kernel variant (compiled without spills)",
    },
    "tests/unit/plugins/test_torch_loss.py": {
        "rtckern.plugins._torch_hf_loss": "causal_lm_loss: the function patch() sets as a model's loss_function",
    },
    "tests/unit/ops/test_gemm_fp8.py": {
        "rtckern.ops._fp8.api": "scale_layout: the scale-granularity inference on plain shapes, without arrays",
        "rtckern.ops._fp8.candidates": "request builders, candidates' refusals and the prefill provider",
        "rtckern.ops._fp8.geometry": "tile configs and the kernel specs of every variant (compiled without spills)",
        "rtckern.ops._fp8.configs": "the table row / rule choice of a tile config (a row that cannot serve a call)",
        "rtckern.ops._fp8.launch": "the clustered launch's grid and B map box with a recording kernel",
        "rtckern.ops._fp8.tune": "which tile configs the tuner's sweep offers (clusters only where M spans two tiles)",
        "rtckern.ops._fp8.grouped_geometry": "the grouped kernel refuses split-K configs",
        "rtckern.ops._gemm.wgmma_gen": "checks that the generated fp8 wgmma header is current",
    },
    "tests/gpu/ops/test_attention_kvcache.py": {
        "rtckern.ops._attention.kvcache_tune": "a short tuning run: fewer timing points and tiles than the tuner's",
    },
    "tests/gpu/ops/test_attention_backward.py": {
        "rtckern.ops._attention.backward_configs": "forces each head split of the wgmma backward (head_splits) "
                                                   "against the float64 reference",
    },
    "tests/gpu/ops/test_gemm_fp8.py": {
        "rtckern.ops._fp8.geometry": "the problem record the tuner's sweep takes (Fp8Problem)",
        "rtckern.ops._fp8.tune": "runs every tile config of the tuner's sweep through its checked measurement",
        "rtckern.ops._fp8.launch": "launches a given split-K tile config (GemmLaunch) as a table row would",
    },
    "tests/gpu/ops/test_gemm.py": {
        "rtckern.ops._gemm.candidates": "checks each kernel candidate (sm80 mma, sm90 wgmma) on the GPU, and the "
                                        "request a problem maps to",
        "rtckern.ops._gemm.launch": LAUNCH + " (launches a given config's Operands directly)",
        "rtckern.ops._gemm.geometry": "compiles and runs every config of the kernel-config table (GemmProblem, "
                                      "Sm80Config/Sm90Config, kernel_specs, with_splits)",
        "rtckern.ops._gemm.tune": "the tuner's own kernels_for and error_bound, checked against the GPU",
    },
    "tests/gpu/ops/test_norms.py": {
        "rtckern.ops._norms.geometry": "runs configs of the kernel-config records (L2Config, SplitConfig): the "
                                       "problem records the launchers take, their feasibility and kernel specs",
        "rtckern.ops._norms.launch": LAUNCH + " (forces one kernel kind with launch_fwd/launch_bwd)",
    },
    "tests/gpu/ops/test_softmax.py": {
        "rtckern.ops._softmax.candidates": "forces the one-pass candidate's kernel (launch_onepass) to check it "
                                           "against torch on shapes the registry would route elsewhere",
        "rtckern.ops._softmax.geometry": LAUNCH + " (row geometry: OnePass, RowGeometry, fits, vector_width)",
    },
    "tests/gpu/plugins/test_torch_attention_kvcache_gpu.py": {
        "rtckern.plugins._torch_hf_kvcache": "counts the KV-cache routes a transformers model takes (run), which no "
                                             "public name shows",
    },
    "tests/gpu/plugins/test_torch_attention_varlen_gpu.py": {
        "rtckern.plugins._torch_hf_varlen": "counts the varlen routes a transformers model takes (run), which no "
                                            "public name shows",
    },
    "tests/unit/compiler/test_hiprtc.py": {
        "rtckern.ops._gemm.geometry": "the SIMT gemm kernel and the split-k reduce on gfx90a (simt_spec, "
                                      "reduce_spec): no registry candidate serves the reduce on its own",
    },
    "tests/unit/ops/test_attention.py": {
        "rtckern.ops._attention.api": "the q/k/v validation and the scale parser (_check_qkv, _scale) on fake "
                                      "arrays, without a device",
        "rtckern.ops._attention.configs": "the kernel-config table (tiles, sources, kernel names, pick_tile)",
        "rtckern.ops._attention.launch": "the kernels' parameter list (kernel_args): order, strides, scale",
        "rtckern.ops._attention.wgmma_gen": "the code generator's output matches the shipped kernel source",
    },
    "tests/unit/ops/test_attention_backward.py": {
        "rtckern.ops._attention.backward": "the dout/out/lse validation (check_like_q, check_lse) on fake arrays, "
                                           "without a device",
        "rtckern.ops._attention.backward_candidates": "the candidates' request encoding and their prepared launches "
                                                      "(argument lists checked against the kernel sources)",
        "rtckern.ops._attention.backward_configs": "the kernel-config table (tiles, shared memory, sources, kernel "
                                                   "names)",
    },
    "tests/unit/ops/test_attention_varlen_backward.py": {
        "rtckern.ops._attention.backward_configs": "the kernel names and sources the candidates must compile",
        "rtckern.ops._attention.varlen_backward": "stops the op at its request (_request) to check its input "
                                                  "validation on fake arrays, without a device",
        "rtckern.ops._attention.varlen_backward_candidates": "the candidates' request encoding, workspace layout and "
                                                             "prepared launches (argument lists checked against the "
                                                             "kernel sources)",
    },
    "tests/unit/ops/test_gemm.py": {
        "rtckern.ops._gemm.candidates": "the candidates' plans, cost and request encoding; host_gemm fixture: "
                                        "patches the selection to record launches",
        "rtckern.ops._gemm.configs": "the tuned-table lookup and heuristic (tuned_config, heuristic, KEY_FIELDS)",
        "rtckern.ops._gemm.geometry": "the kernel-config table and split-k rules (configs, choose_splits, "
                                      "normalize_splits, kernel_specs)",
        "rtckern.ops._gemm.launch": LAUNCH + " (LaunchPlan, Operands)",
        "rtckern.ops._gemm.plan": "host_gemm fixture: runs rtckern.ops.gemm on CPU tensors with a fresh call-plan "
                                  "memo and a stub stream",
        "rtckern.ops._gemm.wgmma_gen": "the code generator's output matches the shipped kernel source",
    },
    "tests/unit/ops/test_grouped_gemm.py": {
        "rtckern.ops._gemm.grouped_candidates": "host fixture: the registry's choice with a recording kernel (select) "
                                                "and a fresh selection memo",
        "rtckern.ops._common": "host fixture: a stub stream for the plans' outputs (OutputPlan)",
        "rtckern.ops._gemm.grouped_plan": "host fixture: a fresh call-plan memo",
        "rtckern.ops._gemm.launch": "host fixture: records the tensor maps the prepared launch encodes (tensor_map), "
                                    "which the emulator reads",
    },
    "tests/unit/ops/test_grouped_gemm_fp8.py": {
        "rtckern.ops._fp8.grouped_candidates": "host fixture: the registry's choice with a recording kernel (select) "
                                               "and a fresh selection memo",
        "rtckern.ops._common": "host fixture: a stub stream for the plans' outputs (OutputPlan)",
        "rtckern.ops._fp8.grouped_plan": "host fixture: a fresh call-plan memo",
        "rtckern.ops._fp8.launch": "host fixture: records the tensor maps the prepared launch encodes (encode_tiled), "
                                   "which the emulator reads",
    },
    "tests/unit/ops/test_norms.py": {
        "rtckern.ops._norms.api": "the argument checks (_check_vector, _check_like, _check_stats, _eps) on fake "
                                  "arrays, without a device",
        "rtckern.ops._norms.configs": "the tuned-table lookups, the heuristics, the preferred kind and the configs' "
                                      "JSON form",
        "rtckern.ops._norms.geometry": "the problem and config records: smem/vector geometry, feasibility, template "
                                       "arguments and specs",
        "rtckern.ops._norms.launch": LAUNCH + " (launch_bwd's cluster launch, with a recording kernel)",
    },
    "tests/unit/ops/test_fp8_tune.py": {
        "rtckern.ops._fp8.candidates": "clears the candidates' memo of tuned configs after the table changes",
        "rtckern.ops._fp8.configs": "the tuned-table lookup (tuned, heuristic, KEY_FIELDS)",
        "rtckern.ops._fp8.tune": "the tuner's sweep (Fp8GemmTuner.configs)",
        "rtckern.ops._fp8.geometry": "the problem and tile-config records the tuner sweeps (Fp8Problem, Sm90Fp8Config)",
    },
    "tests/unit/ops/test_norms_tune.py": {
        "rtckern.ops._norms.configs": "config lookup and its JSON form (the tuner's round trip)",
        "rtckern.ops._norms.geometry": "the SplitConfig record the tuner sweeps and its feasibility",
        "rtckern.ops._norms.tune": "the tuner's sweep and table rows (sweep_configs, table_problem, config_dict)",
    },
    "tests/unit/ops/test_softmax.py": {
        "rtckern.ops._softmax.api": "the scale parser (_scale): the op parses scale on its first launch, "
                                    "which fake arrays do not reach",
        "rtckern.ops._softmax.candidates": "the candidates' configs memo and one-pass specs",
        "rtckern.ops._softmax.configs": "the tuned tables and their lookup (TABLES, KEY_FIELDS, tuned_onepass, "
                                        "config_dict)",
        "rtckern.ops._softmax.geometry": LAUNCH + " (row geometry, kernel names, template args)",
        "rtckern.ops._softmax.tune": "the tuner's sweep (sweep_configs): every config it times fits and compiles",
    },
    "tests/unit/ops/test_softmax_ring.py": {
        "rtckern.ops._softmax.configs": "the ring tables and their lookup (table, KEY_FIELDS, RING_KEY_FIELDS)",
        "rtckern.ops._softmax.geometry": LAUNCH + " (the geometry constants, the kernel source)",
        "rtckern.ops._softmax.ring": "the ring geometry (Ring, default_ring, fits, sweep_rings, kernel_name)",
        "rtckern.ops._softmax.tune": "the problem each mask kind is timed on (tune_problem)",
    },
    "tests/unit/plugins/test_torch_attention_kvcache.py": {
        "rtckern.plugins._torch_hf": "lets the transformers function take its rtckern path on CPU tensors (_why_not)",
        "rtckern.plugins._torch_hf_kvcache": "the transformers KV-cache route (serves, cache_lengths, why_not, run, "
                                             "as_sdpa_mask), a dispatch rule with no public name",
        "rtckern.plugins._torch_hf_varlen": "the mask builder (rtckern_mask) and mask_kind, which hand the cache "
                                            "lengths over",
    },
    "tests/unit/plugins/test_torch_attention_varlen.py": {
        "rtckern.plugins._torch_dispatch": "the reference mode: the varlen ops' forward and backward on CPU",
        "rtckern.plugins._torch_hf": "lets the transformers function take its rtckern path on CPU tensors (_why_not)",
        "rtckern.plugins._torch_hf_varlen": "the transformers varlen routes (route, run, the varlen_from_* prefix "
                                            "sums, the mask builder, mask_kind), a dispatch rule with no public name",
    },
    "tests/unit/plugins/test_torch_plugin.py": {
        "rtckern.plugins._torch_dispatch": "the dispatcher's reference mode and trace-time strictness",
        "rtckern.plugins._torch_hf": "why a HF module is not patched (_why_not)",
        "rtckern.plugins._torch_modules": "why a module is not jitted (_why_not_jit)",
    },
}


def violations() -> list[str]:
    out, used = [], set()
    for rel, line, name in private_imports():
        if name in ALLOWED.get(rel, {}):
            used.add((rel, name))
            continue
        out.append(f"{rel}:{line}: imports private {name}; use a public name or rtckern.testing (see this test's "
                   "docstring), or list it in ALLOWED in tests/unit/test_public_imports.py with a reason")
    for rel, mods in ALLOWED.items():
        for name in mods:
            if (rel, name) not in used:
                out.append(f"{rel}: ALLOWED lists {name}, which it no longer imports: remove the entry")
    return out


def test_tests_import_only_public_names():
    found = violations()
    assert not found, "private imports in tests:\n" + "\n".join(found)


def test_every_allowance_has_a_reason():
    missing = [f"{rel}: {name}" for rel, mods in ALLOWED.items() for name, why in mods.items()
               if len(why.strip()) < 20]
    assert not missing, "ALLOWED entries without a reason:\n" + "\n".join(missing)


def test_scanner_finds_every_kind_of_import(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import importlib\n"
        "import rtckern.ops\n"
        "from rtckern.ops import rms_norm\n"
        "from rtckern.ops._norms import plan as P\n"
        "import rtckern.ops._softmax.geometry\n"
        "def f():\n"
        "    from rtckern.ops._gemm.geometry import GemmProblem\n"
        "    importlib.import_module('rtckern.plugins._torch_ref')\n"
        "    from rtckern.commands.selftest import _example_args\n"
        "    from rtckern.testing import compile_all\n"
        "    from rtckern import __version__\n")
    found = sorted((line, name) for _, line, name in private_imports(tmp_path, tmp_path))
    assert found == [(4, "rtckern.ops._norms.plan"), (5, "rtckern.ops._softmax.geometry"),
                     (7, "rtckern.ops._gemm.geometry"), (8, "rtckern.plugins._torch_ref"),
                     (9, "rtckern.commands.selftest._example_args")]
    assert is_private("rtckern.ops._norms.plan") and not is_private("rtckern.ops") and not is_private(
        "rtckern.__main__")

