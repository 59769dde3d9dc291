#!/bin/bash
# One device call (issue 7, skinny shapes and per-call cost; see benchmarks/results/gemm_notes.md):
#   GPU tests of the op (cluster split-K configs included), the skinny benchmark with the shipped table
#   ("before": the previous winners, through today's op), a tune of the skinny shapes (new candidate configs),
#   the skinny benchmark again with the tuned rows ("after") plus the per-call cost on host-bound shapes.
# At most 8 files come back from $OUT: log.txt, pytest.txt, gemm_skinny_{before,after}_*.{json,md},
# gemm_tune_trials.json, gemm_table.json. A short table is printed last.
# Usage (repo root, on the device): bash benchmarks/gemm_skinny_device_run.sh COMMIT
export PYTHONUNBUFFERED=1 PYTHONPATH=. RTCKERN_CACHE_DIR=/tmp/rtkc RTCKERN_TUNING_DIR=/tmp/rtkt
COMMIT=${1:-unknown}
L=$OUT/log.txt
step() { echo "=== $1 $(date +%T)" | tee -a $L; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader \
  | tee -a $L
# The sweep's kernels compile in the background while the tests run (the tune then finds them in the cache).
timeout 100 python3 benchmarks/gemm.py --skinny --precompile-only > /tmp/pre.log 2>&1 &
PRE=$!
step pytest
timeout 100 python3 -m pytest -q -m gpu tests/gpu/ops/test_gemm.py -p no:cacheprovider -o faulthandler_timeout=60 \
  > $OUT/pytest.txt 2>&1
echo "pytest rc=$?" | tee -a $L
grep -E "^(FAILED|ERROR)" $OUT/pytest.txt | cut -c1-240 | head -30
tail -3 $OUT/pytest.txt
wait $PRE; cat /tmp/pre.log >> $L; grep -E "precompiled|COMPILE FAILED" /tmp/pre.log | cut -c1-300 | head -8
step before
timeout 40 python3 benchmarks/gemm_skinny.py --bench --tag before --out $OUT --commit $COMMIT > /tmp/b.log 2>&1
echo "before rc=$?" | tee -a $L; cat /tmp/b.log >> $L
step tune
timeout 90 python3 benchmarks/gemm.py --tune --skinny --table-out $OUT/gemm_table.json --out $OUT --commit $COMMIT \
  > /tmp/tu.log 2>&1
echo "tune rc=$?" | tee -a $L; cat /tmp/tu.log >> $L
grep -E "TUNE|FAILED|Error|error" /tmp/tu.log | cut -c1-330 | head -40
step after
timeout 45 python3 benchmarks/gemm_skinny.py --bench --host --tag after --out $OUT --commit $COMMIT > /tmp/a.log 2>&1
echo "after rc=$?" | tee -a $L; cat /tmp/a.log >> $L
ls $OUT
echo "--- before (shipped table) ---"; grep -E "^before|^ERROR" /tmp/b.log | cut -c1-200
echo "--- after (tuned) ---"; grep -E "^after|^host|^ERROR" /tmp/a.log | cut -c1-200
