"""RMSNorm and LayerNorm, forward and backward (the layout every family shares: rtckern/ops/__init__.py).

    api.py          rms_norm, layer_norm, rms_norm_backward, layer_norm_backward: argument checks, the full path
    plan.py         the hot path: a call signature's plan (outputs, strides, launchers per alignment class), memoized
    geometry.py     problem and config records, launch geometry, feasibility, template arguments and kernel specs
    configs.py      the tuned tables (norm_fwd, norm_bwd, norm_kind), the heuristics, the preferred kernel kind
    candidates.py   the registry candidates of each kernel kind and their request builders
    launch.py       occupancy queries and the forward / backward launches
    tune.py         the tuner of `rtckern tune rms_norm|layer_norm|...` and the configs it times
"""
