"""Fused attention, forward and backward (the layout every family shares: rtckern/ops/__init__.py).

    api.py          attention (and attention_backward, from backward.py): q / k / v checks, the scale, the full path
    plan.py         the hot path: a call signature's plan (the selection and its launch, prepared once), memoized
    configs.py      the kernels' tile configs: template arguments, grid, shared memory, per-head-dim defaults
    candidates.py   the registry candidates (sm90a_ws, sm90a_wgmma, sm80_mma, simt), tiles from the tuned table
    launch.py       the kernels' parameter list; the TMA kernel's tensor maps, launch and prepared parameter block
    wgmma_gen.py    writes kernel_sources/attention/sm90_wgmma.cuh

The backward op has its own modules (their names clash with the forward's: Sm80Mma, Simt, request, ...):

    backward.py             attention_backward: its checks, its plan and memo
    backward_candidates.py  its registry candidates (sm80_mma, simt) and prepared launches
    backward_configs.py     its kernels' tile configs

Packed variable-length sequences (the same kernels compiled with RTK_ATTN_VARLEN=1):

    varlen.py, varlen_plan.py, varlen_candidates.py     attention_varlen (forward)
    varlen_backward.py, varlen_backward_candidates.py   attention_varlen_backward: its checks, plan, candidates and
                                                        workspace layout

Attention over a KV cache (serving: decode, speculative verification, chunked prefill):

    kvcache.py              attention_with_kvcache: checks, the plan (three prepared kernels) and its memo
    kvcache_candidates.py   its registry candidates, tile configs and the split-KV decision
"""
