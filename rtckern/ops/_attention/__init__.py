"""Fused attention forward (the layout every family shares: rtckern/ops/__init__.py).

    api.py          attention: q / k / v checks, the scale, the full path
    plan.py         the hot path: a call signature's plan (the selection and its launch, prepared once), memoized
    configs.py      the kernels' tile configs: template arguments, grid, shared memory, per-head-dim defaults
    candidates.py   the registry candidates (sm90a_ws, sm90a_wgmma, sm80_mma, simt), tiles from the tuned table
    launch.py       the kernels' parameter list; the TMA kernel's tensor maps, launch and prepared parameter block
    wgmma_gen.py    writes kernel_sources/attention/sm90_wgmma.cuh
"""
