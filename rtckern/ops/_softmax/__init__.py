"""Softmax over the last dimension: plain, scaled + boolean mask, square and bottom-right causal; forward and
backward (the layout every family shares: rtckern/ops/__init__.py).

    api.py          the eight ops: argument checks, each op's row geometry, the full path
    plan.py         the hot path: a call signature's plan (output, geometry, launchers per alignment class), memoized
    geometry.py     row geometry, vector width, the one-pass and online kernels' configs, template and kernel args
    ring.py         the ring kernel's configs (sm_90+: bulk copies into a ring of shared-memory slots)
    configs.py      the tuned tables of each mask kind (one-pass and ring) and their lookups
    candidates.py   the registry candidates (ring, one-pass, online), launch helpers, selections, prefill specs
    selftest.py     the candidates' numerical probe against float64
    tune.py         the tuners of `rtckern tune softmax...` and the configs they time
"""
