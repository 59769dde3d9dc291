#!/usr/bin/env bash
# Final single-GPU validation: every GPU test, attention through the op's default path, per-call op overhead.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 RTCKERN_CACHE_DIR=/tmp/rtk-final
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 330 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -40 > $OUT/gpu_tests_final.txt
tail -8 $OUT/gpu_tests_final.txt
[ -f benchmarks/op_overhead.py ] && timeout 60 python3 benchmarks/op_overhead.py 2>&1 | tee $OUT/op_overhead.md | tail -20
timeout 120 python3 benchmarks/attention.py --bench --plot --reps 20 --out $OUT/attention_default --tag final 2>&1 | tail -25
ls $OUT $OUT/attention_default 2>/dev/null
