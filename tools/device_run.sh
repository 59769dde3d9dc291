#!/usr/bin/env bash
# The one device-run driver: run a family's GPU tests and benchmark on the lent GPU from a checkout, and leave the
# family's current result set (JSON, markdown, PNG) under $OUT (the device tool returns at most 8 files).
#
#   bash tools/device_run.sh FAMILY [PART...]     FAMILY: attention; PART: tests, bench (default: both)
#
# tests: pytest of tests/gpu/ops/test_FAMILY.py with a junit XML, recorded by the benchmark in its result files;
# bench: the family's benchmark runner with its correctness grid, timings and plot.
set -uo pipefail
family=${1:?usage: tools/device_run.sh FAMILY [tests] [bench]}
shift
parts=${*:-tests bench}
out=${OUT:-/tmp/rtckern-out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 RTCKERN_CACHE_DIR=${RTCKERN_CACHE_DIR:-/tmp/rtckern-device-cache}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
junit=/tmp/rtckern-$family-junit.xml
rm -f "$junit"
for part in $parts; do
  case "$family:$part" in
    attention:tests)
      timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider "tests/gpu/ops/test_attention.py" \
        --junitxml="$junit" > "$out/attention_gpu_tests.log" 2>&1
      tail -3 "$out/attention_gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$out/attention_gpu_tests.log" | head -20 ;;
    attention:bench)
      args=(--check --bench --plot --out "$out")
      [ -f "$junit" ] && args+=(--tests "$junit")
      timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/attention.py "${args[@]}" > "$out/attention_bench.log" 2>&1
      grep -E "^(check|FAIL|hd|wrote)" "$out/attention_bench.log" | cut -c1-200 ;;
    *) echo "unknown family/part: $family $part (families: attention; parts: tests, bench)"; exit 2 ;;
  esac
done
ls "$out"
