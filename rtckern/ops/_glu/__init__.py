"""Gated linear unit activations: SwiGLU, forward and backward (the layout every family shares:
rtckern/ops/__init__.py).

    api.py          swiglu, swiglu_backward: argument checks, the call plan's memo
    plan.py         the hot path: a call signature's outputs and prepared launch
    geometry.py     the kernel record, vector width, launch grid and kernel specs
    candidates.py   the registry candidate, its request builder and prefill's kernels
"""
