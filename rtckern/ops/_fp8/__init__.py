"""fp8 GEMM and quantization (the layout every family shares: rtckern/ops/__init__.py).

    api.py          gemm_fp8 and quantize_fp8: argument checks, scale-granularity inference, the hot paths
    plan.py         the hot path: CallPlan (output, prepared launches) and the memo of plans
    geometry.py     the problem records, the sm_90a tile config, kernel specs
    configs.py      the tile config: the tuned table gemm_fp8 (own device class, any class), else the rule
    tune.py         the tuner of `rtckern tune gemm_fp8` (--shapes MxNxK,... or a model's shape list) and its sweep
    candidates.py   the registry candidates (gemm_fp8.sm90a_wgmma, gemm_fp8.simt, quantize_fp8.warp), request
                    builders, the prefill kernel provider
    launch.py       the prepared launches (Kernel.prepare) and tensor maps
"""
