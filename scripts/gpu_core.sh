#!/usr/bin/env bash
# One device call for the core service: GPU tests, then the core benchmark. Results land in $OUT.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 RTCKERN_CACHE_DIR=/tmp/rtk-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pytest -q -m gpu tests/gpu/test_runtime_gpu.py 2>&1 | tee $OUT/core_gpu_tests.txt
python3 benchmarks/core.py 2>&1 | tee $OUT/core_bench_log.txt
