#!/usr/bin/env bash
# The one device-run driver: run a family's GPU tests and benchmark on the lent GPU from a checkout, and leave the
# family's current result set under $OUT as <family>_<gpu>.{json,md,png} (copy it to benchmarks/results/).
#
#   bash tools/device_run.sh FAMILY [PART...]     PART: tests, bench (default: both)
#   FAMILY: attention norms softmax gemm gemm_skinny plugin core multi_gpu op_overhead
#
# tests: pytest of the family's GPU tests with a junit XML ($OUT/FAMILY_tests.{log,xml});
# bench: the family's benchmark runner, its log in $OUT/FAMILY_bench.log.
set -uo pipefail
family=${1:?usage: tools/device_run.sh FAMILY [tests] [bench]}
shift
parts=${*:-tests bench}
out=${OUT:-/tmp/rtckern-out}
mkdir -p "$out"
export OUT=$out PYTHONPATH=. PYTHONUNBUFFERED=1 RTCKERN_CACHE_DIR=${RTCKERN_CACHE_DIR:-/tmp/rtckern-device-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed 's/NVIDIA//' | awk '{print tolower($1)}' \
  | tr -cd 'a-z0-9')  # 'NVIDIA H100 80GB HBM3' -> h100
ngpu=$(nvidia-smi -L | wc -l)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
junit=$out/${family}_tests.xml
name=${family}_$gpu

# family -> GPU tests | benchmark command | the stem it writes under $OUT (renamed to <family>_<gpu>)
case "$family" in
  attention)   tests="tests/gpu/ops/test_attention.py"
               bench="python3 benchmarks/attention.py --check --bench --plot --out $out --tests $junit"; stem=$name ;;
  norms)       tests="tests/gpu/ops/test_norms.py"
               bench="python3 benchmarks/norms.py bench --out $out"; stem=norms_bench ;;
  softmax)     tests="tests/gpu/ops/test_softmax.py"
               bench="python3 benchmarks/softmax.py --prefill --bench --dtypes bf16,fp16,fp32 --name $name"
               stem=$name ;;
  gemm)        tests="tests/gpu/ops/test_gemm.py"
               bench="python3 benchmarks/gemm.py --bench --out $out --commit $commit"; stem="gemm_NVIDIA_*" ;;
  gemm_skinny) tests="tests/gpu/ops/test_gemm.py"
               bench="python3 benchmarks/gemm_skinny.py --bench --host --tag current --out $out --commit $commit"
               stem="gemm_skinny_current_*" ;;
  plugin)      tests="tests/gpu/plugins"
               bench="python3 benchmarks/plugin.py"; stem="plugin_????-??-??" ;;
  core)        tests="tests/gpu/test_runtime_gpu.py"
               bench="python3 benchmarks/core.py"; stem=core ;;
  multi_gpu)   tests="tests/gpu/test_multi_gpu.py tests/gpu/test_runtime_gpu.py"; name=multi_gpu_${ngpu}x$gpu
               bench="env RTCKERN_CACHE_DIR=/tmp/rtckern-multi-cold torchrun --nproc_per_node=$ngpu
                 benchmarks/multi_gpu.py"
               stem=multi_gpu; rm -rf /tmp/rtckern-multi-cold ;;
  op_overhead) tests=""
               bench="python3 benchmarks/op_overhead.py --json $out/$name.json"; stem=$name ;;
  *) echo "unknown family: $family (attention norms softmax gemm gemm_skinny plugin core multi_gpu op_overhead)"
     exit 2 ;;
esac

for part in $parts; do
  case "$part" in
    tests)
      [ -z "$tests" ] && { echo "$family: no GPU tests"; continue; }
      # shellcheck disable=SC2086
      timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -m gpu -p no:cacheprovider $tests --junitxml="$junit" \
        > "$out/${family}_tests.log" 2>&1
      echo "tests rc=$?"; tail -3 "$out/${family}_tests.log"
      grep -E "^(FAILED|ERROR)" "$out/${family}_tests.log" | head -20 ;;
    bench)
      [ "$family" = attention ] && [ ! -f "$junit" ] && bench=${bench% --tests *}
      log=$out/${family}_bench.log
      if [ "$family" = op_overhead ]; then
        timeout "${BENCH_TIMEOUT:-300}" $bench > "$out/$name.md" 2> "$log"
      else
        timeout "${BENCH_TIMEOUT:-300}" $bench > "$log" 2>&1
      fi
      echo "bench rc=$?"; tail -5 "$log" | cut -c1-200
      for ext in json md png; do  # the newest file the runner wrote becomes the family's current one
        f=$(ls -t "$out"/$stem.$ext 2>/dev/null | head -1)
        [ -n "$f" ] && [ "$f" != "$out/$name.$ext" ] && mv "$f" "$out/$name.$ext"
      done ;;
    *) echo "unknown part: $part (tests, bench)"; exit 2 ;;
  esac
done
ls "$out"
