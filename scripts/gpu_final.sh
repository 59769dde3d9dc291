#!/usr/bin/env bash
# Final single-GPU validation. PART=tests: every GPU test (kernels compiled in parallel first by the softmax and
# norms prefills). PART=bench: the softmax benchmark on the shipped tables and the per-call op overhead.
# Outputs are packed into one final_<part>.tgz under $OUT (the device returns at most 8 files).
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 RTCKERN_CACHE_DIR=/tmp/rtk-final
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p $OUT/final
if [ "${PART:-tests}" = tests ]; then
  timeout 120 python3 benchmarks/softmax.py --prefill --dtypes bf16 2>&1 | tail -2
  timeout 470 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider > $OUT/final/gpu_tests_final.txt 2>&1
  tail -3 $OUT/final/gpu_tests_final.txt; grep -E "^(FAILED|ERROR)" $OUT/final/gpu_tests_final.txt | head -20
else
  timeout 200 python3 benchmarks/softmax.py --prefill --bench --dtypes bf16,fp16,fp32 --name softmax_final > $OUT/final/softmax_bench.log 2>&1
  grep -v "tune " $OUT/final/softmax_bench.log | tail -3 | cut -c1-300
  cp benchmarks/results/softmax_final.* $OUT/final/ 2>/dev/null; cp $OUT/softmax_final.* $OUT/final/ 2>/dev/null
  timeout 90 python3 benchmarks/op_overhead.py > $OUT/final/op_overhead.md 2>&1; tail -14 $OUT/final/op_overhead.md
fi
cd $OUT && tar czf /tmp/final.tgz final && rm -rf final softmax_final.* && mv /tmp/final.tgz $OUT/final_${PART:-tests}.tgz && ls $OUT
