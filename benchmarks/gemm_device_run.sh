#!/bin/bash
# One device call: kernel checks, config sweep (tuned table), GPU tests, op benchmark. Logs go to $OUT/all.log;
# at most 8 files come back from $OUT, so logs are appended to one file.
# Usage (from the repo root on the device): bash benchmarks/gemm_device_run.sh COMMIT
export PYTHONUNBUFFERED=1 PYTHONPATH=. RTCKERN_CACHE_DIR=/tmp/rtkc RTCKERN_TUNING_DIR=/tmp/rtkt
COMMIT=${1:-unknown}
L=$OUT/all.log
step() { echo "=== $1" | tee -a $L; }
step compile
python3 benchmarks/gemm_kernels.py --phase compile --out $OUT > /tmp/s.log 2>&1; cat /tmp/s.log >> $L; grep -E "precompiled|COMPILE" /tmp/s.log | cut -c1-300
step checks
timeout 60 python3 benchmarks/gemm_kernels.py --phase checks --out $OUT > /tmp/s.log 2>&1; rc=$?; cat /tmp/s.log >> $L
echo "checks rc=$rc"; grep -E "FAIL|checks:" /tmp/s.log | cut -c1-220
PP=""
if [ $rc = 124 ] || grep -q "^FAIL sm90pp" /tmp/s.log; then PP=--no-pingpong; echo "ping-pong left out"; fi
step tune
timeout 150 python3 benchmarks/gemm.py --tune $PP --table-out $OUT/gemm_table.json --out $OUT --commit $COMMIT > /tmp/s.log 2>&1
echo "tune rc=$?"; cat /tmp/s.log >> $L; grep -E "TUNE|FAILED|precompiled|merged|Error|error" /tmp/s.log | cut -c1-260
step pytest
timeout 100 python3 -m pytest -q -m gpu tests/gpu/ops/test_gemm.py -p no:cacheprovider > /tmp/s.log 2>&1
echo "pytest rc=$?"; cat /tmp/s.log >> $L; grep -E "passed|failed|Error|FAILED" /tmp/s.log | tail -25 | cut -c1-300
step bench
timeout 90 python3 benchmarks/gemm.py --bench --out $OUT --commit $COMMIT > /tmp/s.log 2>&1
echo "bench rc=$?"; cat /tmp/s.log >> $L; grep -vE "^\{" /tmp/s.log | cut -c1-230
ls $OUT
