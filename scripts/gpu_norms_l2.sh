#!/usr/bin/env bash
# One device call for the norm kernels' L2 re-read kinds: GPU tests (filter in $1, default all), the l2 sweep
# (re-timing the shipped rows / cluster configs in the same run), tables from it, then the benchmark of the public
# ops in a fresh process (so it reads the new tables). Results land in $OUT (a few files: see the run tool's limits).
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 RTCKERN_CACHE_DIR=/tmp/rtk-norms
K="${1:-}"
SWEEP_BUDGET="${2:-100}"
COMPILE_BUDGET="${3:-150}"
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
timeout 150 python3 -m pytest -q -m gpu tests/gpu/ops/test_norms.py -p no:cacheprovider ${K:+-k "$K"} 2>&1 \
  | tee $OUT/norms_gpu_tests.log | tail -n 25
echo "tests done at $(( $(date +%s) - t0 )) s"
if [ "$SWEEP_BUDGET" != "0" ]; then
  timeout 200 python3 benchmarks/norms.py sweep --kinds l2 --out $OUT/r --sweep-budget "$SWEEP_BUDGET" 2>&1 \
    | grep -v "^ *$" | tail -n 60
  python3 benchmarks/norms.py tables --sweep benchmarks/results/norms_sweep_2026-11-26_h200.json.gz \
    --sweep $OUT/r/norms_sweep.json
  gzip -f $OUT/r/norms_sweep.json
  echo "sweep done at $(( $(date +%s) - t0 )) s"
fi
timeout $(( 400 - ($(date +%s) - t0) )) python3 benchmarks/norms.py bench --out $OUT/r --compile-budget "$COMPILE_BUDGET" 2>&1 | tail -n 50
echo "bench done at $(( $(date +%s) - t0 )) s"
tar czf $OUT/r/tables.tgz rtckern/tuning_tables/norm_*.json
