#!/usr/bin/env bash
# Issue 11 on a machine with >= 2 GPUs: multi-device tests in one process, then torchrun ranks cold on one
# cache. Also re-validates the core runtime and the op families changed since their last GPU run.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee $OUT/gpus.txt
RTCKERN_CACHE_DIR=/tmp/rtk-multi-tests timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_multi_gpu.py \
  tests/gpu/test_runtime_gpu.py 2>&1 | tee $OUT/multi_gpu_tests.txt
N=$(nvidia-smi -L | wc -l)
rm -rf /tmp/rtk-shared
RTCKERN_CACHE_DIR=/tmp/rtk-shared timeout 150 torchrun --nproc_per_node=$N benchmarks/multi_gpu.py 2>&1 | tee $OUT/multi_gpu_log.txt
RTCKERN_CACHE_DIR=/tmp/rtk-ops timeout 200 python3 -m pytest -q -m gpu -x tests/gpu/ops/test_gemm.py tests/gpu/ops/test_attention.py 2>&1 | tail -30 | tee $OUT/ops_gpu_tests.txt
