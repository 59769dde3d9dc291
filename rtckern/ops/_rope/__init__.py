"""Rotary position embedding of q and k, forward and backward (the layout every family shares:
rtckern/ops/__init__.py).

    api.py          rope, rope_backward: argument checks, the call plan's memo
    plan.py         the hot path: a call signature's outputs and prepared launch
    geometry.py     the request's record, vector width, block size and kernel specs
    candidates.py   the registry candidate, its request builder and prefill's kernels
"""
