"""Op families. Importing this package registers every family's registry candidates, request builders, tuners and
kernel providers, and exports the ops:

    rtckern.ops.rms_norm / layer_norm (+ backward)    rtckern.ops.softmax and the masked/causal variants
    rtckern.ops.attention                             rtckern.ops.gemm
    rtckern.ops.attention_varlen (packed variable-length sequences)

A family's API lives in rtckern/ops/_<family>_api.py (its other modules beside it, rtckern/ops/_<family>_*.py); the
module is private so that `rtckern.ops.softmax` (and .attention, .gemm) is the op, never a module it could shadow.
"""

from __future__ import annotations

import importlib
import logging

log = logging.getLogger(__name__)

FAMILIES = ("norms", "softmax", "attention", "attention_varlen", "gemm")
_exports: dict[str, object] = {}
unavailable: dict[str, str] = {}  # family -> why it could not be imported

for _fam in FAMILIES:
    try:
        _mod = importlib.import_module(f"{__name__}._{_fam}_api")
    except ImportError as _e:  # a family that cannot import does not take the others down
        unavailable[_fam] = f"{type(_e).__name__}: {_e}"
        log.warning("rtckern.ops.%s unavailable: %s", _fam, _e)
        continue
    for _name in getattr(_mod, "__all__", ()):
        _exports[_name] = getattr(_mod, _name)

globals().update(_exports)
__all__ = sorted(_exports)
