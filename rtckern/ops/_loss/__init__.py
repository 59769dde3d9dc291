"""Losses: cross-entropy over rows of logits against integer labels, forward and backward (the layout every family
shares: rtckern/ops/__init__.py).

    api.py          cross_entropy, cross_entropy_backward: argument checks, the call plan's memo
    plan.py         the hot path: a call signature's outputs and prepared launch
    geometry.py     the kernel record, vector width, block size, launch grid and kernel specs
    candidates.py   the registry candidate, its request builder and prefill's kernels
"""
