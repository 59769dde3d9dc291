#!/usr/bin/env bash
# One device call for the cluster-split l2 backward (kind l2c): GPU tests (filter in $1, default the backward
# ones), the l2c sweep (re-timing the shipped rows / cluster / l2 backward configs in the same run), tables from
# the earlier sweeps plus this one, then the benchmark of the public ops in a fresh process (it reads the new
# tables). Everything lands in one $OUT/norms_l2c.tgz (the run tool brings back few files).
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 RTCKERN_CACHE_DIR=/tmp/rtk-norms
K="${1:-backward or bitwise or l2c}"
SWEEP_BUDGET="${2:-150}"
COMPILE_BUDGET="${3:-60}"
R=$OUT/r
mkdir -p $R
trap 'tar czf $OUT/norms_l2c.tgz -C $OUT r; echo packed' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
timeout 120 python3 -m pytest -q -m gpu tests/gpu/ops/test_norms.py -p no:cacheprovider -rs ${K:+-k "$K"} 2>&1 \
  | tee $R/norms_gpu_tests.log | tail -n 25
echo "tests done at $(( $(date +%s) - t0 )) s"
if [ "$SWEEP_BUDGET" != "0" ]; then
  timeout $(( SWEEP_BUDGET + 60 )) python3 benchmarks/norms.py sweep --kinds l2c --out $R \
    --sweep-budget "$SWEEP_BUDGET" 2>&1 | grep -v "^ *$" | tee $R/sweep.log | tail -n 40
  python3 benchmarks/norms.py tables --sweep benchmarks/results/norms_sweep_2026-11-26_h200.json.gz \
    --sweep benchmarks/results/norms_sweep_l2_2026-11-26_h200.json.gz --sweep $R/norms_sweep.json
  gzip -f $R/norms_sweep.json
  cp rtckern/tuning_tables/norm_*.json $R/
  echo "sweep done at $(( $(date +%s) - t0 )) s"
fi
timeout $(( 405 - ($(date +%s) - t0) )) python3 benchmarks/norms.py bench --out $R --compile-budget "$COMPILE_BUDGET" \
  2>&1 | tee $R/bench.log | tail -n 45
echo "bench done at $(( $(date +%s) - t0 )) s"
