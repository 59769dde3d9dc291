"""Matrix multiply with fused epilogues (the layout every family shares: rtckern/ops/__init__.py).

    api.py          gemm: argument checks, layouts, the full path and the hot path's signature key
    plan.py         the hot path: CallPlan (output, prepared launches) and the memo of plans
    geometry.py     the problem record, the kernel families' tile configs, split-K rules, kernel specs
    configs.py      the tuned table (gemm) and the heuristics
    candidates.py   the registry candidates (sm90_wgmma, sm80_mma, simt), their costs and selections
    launch.py       LaunchPlan: grids, prepacked parameters, tensor maps, the split-K reduce
    tune.py         the tuner of `rtckern tune gemm` and the configs it times
    wgmma_gen.py    writes kernel_sources/gemm/wgmma_ops.cuh
"""
