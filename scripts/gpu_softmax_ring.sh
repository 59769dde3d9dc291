#!/usr/bin/env bash
# Softmax on one GPU: prefill, GPU tests, tuning sweep (TUNE=--tune: one-pass and ring tables of every mask kind;
# --tune-ring: ring only), benchmark. Everything written under $OUT is packed into one softmax_out.tgz.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 RTCKERN_CACHE_DIR=/tmp/rtk-sm RTCKERN_TUNING_DIR=$OUT/tuning
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 python3 benchmarks/softmax.py --prefill --dtypes ${DTYPES:-bf16} 2>&1 | tail -8
timeout 240 python3 -m pytest -q -m gpu tests/gpu/ops/test_softmax.py -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} > $OUT/softmax_gpu_tests.txt 2>&1
tail -3 $OUT/softmax_gpu_tests.txt; grep -E "^(FAILED|ERROR)|Error" $OUT/softmax_gpu_tests.txt | head -20
timeout 300 python3 benchmarks/softmax.py ${TUNE:---tune-ring} --bench --dtypes ${DTYPES:-bf16} --compile ${COMPILE:-plain} --name ${NAME:-softmax_ring_run} > $OUT/softmax_bench.log 2>&1
grep -v "tune softmax" $OUT/softmax_bench.log | tail -40 | cut -c1-240
cd $OUT && tar czf /tmp/softmax_out.tgz . && find . -mindepth 1 -delete && mv /tmp/softmax_out.tgz $OUT/ && ls -la $OUT
