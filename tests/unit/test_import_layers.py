"""The import layers of rtckern, kept by an AST scan of every module under rtckern/.

Every import counts: module level or inside a function, `import a.b`, `from a import b`, `from . import b`,
`from ..x import y` (resolved to absolute names; `from p import n` is the module p.n when p/n is a module, else p)
and `importlib.import_module` / `__import__` with a literal name or an f-string whose literal prefix names a package.

    layer 0  core       config errors dtypes arch device spec sources events logs caches compiler/ cache/ runtime/ manager
    layer 1  registry   requests, candidates, ranking, probes, decisions, kernel providers
    layer 2  tuning     tuned tables and the tuner base (families register their tuners here; it never imports ops)
    layer 3  ops        the op families, the subpackages rtckern/ops/_<family>/; a family never imports another,
                        the shared modules (rtckern/ops/_common*.py) import none; the package's __init__ imports
                        them all
    layer 4  fleet, prefill   manifests, record mode (an events listener), replay, bundles; the built-in kernel set
    layer 5  plugins, torch   the framework plugins (rtckern.torch is rtckern.plugins.torch under a short name)
    layer 6  commands, cli, __main__
    facade   rtckern (the package's __init__) and rtckern.testing: may import any layer; no layer imports them
             (`import rtckern.config` is an import of rtckern.config; `rtckern.__version__` may be read anywhere)

A module imports only modules of its own layer or below. Each violation is reported as file:line.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "rtckern"

LAYERS: dict[str, int] = {}
for _rank, _names in enumerate((
        ("config", "errors", "dtypes", "arch", "device", "spec", "sources", "events", "logs", "caches", "compiler",
         "cache", "runtime", "manager"),
        ("registry",),
        ("tuning",),
        ("ops",),
        ("fleet", "prefill"),
        ("plugins", "torch"),
        ("commands", "cli", "__main__"),
)):
    for _n in _names:
        LAYERS[_n] = _rank
LAYER_NAMES = ("core", "registry", "tuning", "ops", "fleet/prefill", "plugins", "commands/cli")
FACADE = ("rtckern", "rtckern.testing")
# Names any layer may take from the root package (`from rtckern import __version__`, or `import rtckern` to read it
# at call time): the root package is loaded before any of its modules.
FACADE_NAMES = ("__version__",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def ops_families() -> tuple[str, ...]:
    """rtckern.ops.FAMILIES, read from the source (no import)."""
    for node in ast.parse((PKG / "ops" / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FAMILIES" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("rtckern/ops/__init__.py defines no FAMILIES tuple")


FAMILIES = ops_families()
# ops modules that belong to no family (shared by all of them); they import no family either.
OPS_SHARED = re.compile(r"^rtckern\.ops(\._common\w*)?$")


def family_of(mod: str) -> str | None:
    """The op family of an rtckern.ops module: the package rtckern/ops/_<family>/ or a module in it."""
    m = re.match(r"^rtckern\.ops\._([a-z0-9]+)(?:\.|$)", mod)
    if m is None:
        return None
    fam = m.group(1)
    return fam if fam in FAMILIES else None


def layer_of(mod: str) -> int | None:
    if mod in FACADE or not mod.startswith("rtckern."):
        return None
    return LAYERS.get(mod.split(".")[1])


def _resolve_from(mod: str, is_pkg: bool, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        pkg = ".".join(base + ([node.module] if node.module else []))
    else:
        pkg = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{pkg}.{alias.name}"
        if pkg == "rtckern" and alias.name in FACADE_NAMES:
            continue
        out.append(sub if sub in MODULES else pkg)
    return out


def _dynamic_name(mod: str, is_pkg: bool, arg: ast.expr) -> str | None:
    """The module a literal (or f-string with a literal package prefix) import_module argument names."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr):
        prefix = ""
        for part in arg.values:
            if isinstance(part, ast.Constant):
                prefix += part.value
            elif (isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name)
                  and part.value.id == "__name__" and not prefix):
                prefix += mod
            else:
                break
        pkg = prefix.rpartition(".")[0]
        return pkg or None
    return None


def imports_of(mod: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) for every rtckern import in the module."""
    is_pkg = path.name == "__init__.py"
    found = []
    bare: set[int] = set()  # lines with a plain `import rtckern` (the root package, loaded before any submodule)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
            bare.update(node.lineno for a in node.names if a.name == "rtckern" and a.asname is None)
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, n) for n in _resolve_from(mod, is_pkg, node)]
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__"):
                target = _dynamic_name(mod, is_pkg, node.args[0])
                if target:
                    found.append((node.lineno, target))
    return [(line, t) for line, t in found if t.startswith("rtckern.") or (t == "rtckern" and line not in bare)]


def violations() -> list[str]:
    out = []
    for mod, path in MODULES.items():
        rel = path.relative_to(ROOT)
        src_layer = layer_of(mod)
        if mod not in FACADE and src_layer is None:
            out.append(f"{rel}:1: {mod} is in no layer: add it to LAYERS in tests/unit/test_import_layers.py")
            continue
        src_fam = family_of(mod)
        if mod.startswith("rtckern.ops") and src_fam is None and not OPS_SHARED.match(mod):
            out.append(f"{rel}:1: {mod} belongs to no op family ({', '.join(FAMILIES)}) and is not shared "
                       "(rtckern/ops/_common*.py)")
        for line, target in imports_of(mod, path):
            if mod in FACADE or target == mod:
                continue
            if target in FACADE:
                if target == "rtckern":  # `import rtckern` / `from rtckern import <not a module>`
                    out.append(f"{rel}:{line}: {mod} imports the rtckern facade; import the module that defines "
                               "the name (rtckern.config, rtckern.errors, ...)")
                else:
                    out.append(f"{rel}:{line}: {mod} imports {target}, which is for tests only")
                continue
            dst_layer = layer_of(target)
            if dst_layer is None:
                continue  # a module not in the tree (the scan reports unknown rtckern modules below)
            if dst_layer > src_layer:
                out.append(f"{rel}:{line}: {mod} ({LAYER_NAMES[src_layer]}) imports {target} "
                           f"({LAYER_NAMES[dst_layer]}, a layer above)")
            dst_fam = family_of(target)
            if src_layer == LAYERS["ops"] and mod != "rtckern.ops" and dst_fam is not None and dst_fam != src_fam:
                who = f"family {src_fam}" if src_fam else "shared ops module"
                out.append(f"{rel}:{line}: {mod} ({who}) imports {target} (family {dst_fam}); families never "
                           "import each other: move what they share below ops (runtime/, registry/, tuning) "
                           "or into rtckern/ops/_common.py")
    return out


def test_import_layers():
    found = violations()
    assert not found, "import layer violations:\n" + "\n".join(found)


# ---- the scanner itself -------------------------------------------------------------------------------------------
def _scan(tmp_src: str, mod: str = "rtckern.registry.x", is_pkg: bool = False) -> list[str]:
    tree = ast.parse(tmp_src)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out += _resolve_from(mod, is_pkg, node)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.Call) and node.args:
            t = _dynamic_name(mod, is_pkg, node.args[0])
            if t:
                out.append(t)
    return out


@pytest.mark.parametrize("src, want", [
    ("from ..fleet import record", ["rtckern.fleet.record"]),
    ("from ..fleet.record import record_request", ["rtckern.fleet.record"]),
    ("from . import selector", ["rtckern.registry.selector"]),
    ("from .selector import Registry", ["rtckern.registry.selector"]),
    ("def f():\n    import rtckern.ops\n", ["rtckern.ops"]),
    ("import importlib\nimportlib.import_module('rtckern.fleet')", ["importlib", "rtckern.fleet"]),
    ("import importlib\nimportlib.import_module(f'rtckern.ops.{x}')", ["importlib", "rtckern.ops"]),
])
def test_scanner_resolves(src, want):
    assert _scan(src) == want


def test_scanner_catches_each_kind_of_violation():
    assert layer_of("rtckern.registry.selector") == 1 and layer_of("rtckern.fleet.record") == 4
    assert layer_of("rtckern.tuning") == 2 and layer_of("rtckern.prefill") == 4 and layer_of("rtckern.torch") == 5
    assert family_of("rtckern.ops._norms.plan") == "norms" and family_of("rtckern.ops._softmax.api") == "softmax"
    assert family_of("rtckern.ops._gemm") == "gemm" and family_of("rtckern.ops") is None
    assert family_of("rtckern.ops._common") is None and family_of("rtckern.ops.gemm") is None  # the op, no module
    # a family's relative imports resolve inside its package
    assert _scan("from . import plan", "rtckern.ops._norms.api") == ["rtckern.ops._norms.plan"]
    assert _scan("from .launch import launch_fwd", "rtckern.ops._norms.candidates") == ["rtckern.ops._norms.launch"]
    assert _scan("from .._common import parse_number", "rtckern.ops._norms.api") == ["rtckern.ops._common"]
    assert set(FAMILIES) >= {"norms", "softmax", "attention", "gemm"}


def test_no_op_is_shadowed_by_a_module():
    """`rtckern.ops.<op>` is the op: no module or package under rtckern/ops is named like an exported op (a family's
    API module is rtckern/ops/_<family>/api.py), so importing a submodule can never rebind an op's name."""
    import inspect

    import rtckern.ops as ops

    assert ops.__all__ and not ops.unavailable
    clashes = [n for n in ops.__all__ if (PKG / "ops" / f"{n}.py").exists() or (PKG / "ops" / n).is_dir()]
    assert not clashes, f"modules named like ops under rtckern/ops: {clashes}"
    for fam in FAMILIES:
        assert (PKG / "ops" / f"_{fam}" / "api.py").exists(), f"family {fam} has no rtckern/ops/_{fam}/api.py"
    for name in ("rms_norm", "layer_norm", "softmax", "attention", "gemm"):
        assert inspect.isfunction(getattr(ops, name)), name
