"""Op families. Importing this package registers every family's registry candidates, request builders, tuners and
kernel providers, and exports the ops:

    rtckern.ops.rms_norm / layer_norm (+ backward)    rtckern.ops.softmax and the masked/causal variants
    rtckern.ops.attention                             rtckern.ops.gemm
    rtckern.ops.attention_varlen (packed variable-length sequences; + backward)
    rtckern.ops.cross_entropy (+ backward)            and the others' families: fp8, rope, glu

Each family is a private subpackage, rtckern/ops/_<family>/ (private so that `rtckern.ops.softmax`, `.attention`
and `.gemm` are the ops, never a package that could shadow them), whose modules have the same name wherever they
have the same role:

    api.py          the public ops; its __all__ is what this package exports
    candidates.py   the registry candidates, request builders and kernel providers
    plan.py         the hot path: a validated call signature's plan and the memo of plans
    geometry.py     launch geometry and tile math (problem and config records, template arguments, specs)
    configs.py      kernel configs: the tuned-table lookups, heuristics and default tables
    tune.py         the product tuner registered with `rtckern tune`, and the configs it times
    launch.py       kernel launch helpers

(every family has api.py and candidates.py; the others where the family has that role), plus modules whose names say
what they hold: _softmax/ring.py and selftest.py, _attention/backward*.py (the attention backward op) and varlen*.py
(packed variable-length sequences), the wgmma_gen.py code generators. Families never import each other; what they share
lives in rtckern/ops/_common.py or below the op layer (runtime/, registry/, tuning). Every memo is a
rtckern.caches.PlanCache; no module here keeps other mutable state (tests/unit/ops/test_layout.py).
"""

from __future__ import annotations

import importlib
import logging
from types import MappingProxyType

log = logging.getLogger(__name__)

FAMILIES = ("norms", "softmax", "attention", "gemm", "fp8", "rope", "glu", "loss")


def _import_families() -> tuple[dict[str, object], dict[str, str]]:
    """(exported name -> op, family -> why it could not be imported): a family that cannot import does not take
    the others down."""
    exports: dict[str, object] = {}
    failed: dict[str, str] = {}
    for fam in FAMILIES:
        try:
            mod = importlib.import_module(f"{__name__}._{fam}.api")
        except ImportError as e:
            failed[fam] = f"{type(e).__name__}: {e}"
            log.warning("rtckern.ops.%s unavailable: %s", fam, e)
            continue
        for name in getattr(mod, "__all__", ()):
            exports[name] = getattr(mod, name)
    return exports, failed


_exports, _failed = _import_families()
globals().update(_exports)
unavailable = MappingProxyType(_failed)  # family -> why it could not be imported
__all__ = tuple(sorted(_exports))
del _exports, _failed
