#!/usr/bin/env bash
# The one device-run driver: run a family's GPU tests and benchmark on the lent GPU from a checkout. The benchmark
# is the runner's (`python3 -m benchmarks FAMILY --out $OUT`): it leaves the family's current result set under $OUT
# as <family>_<gpu>.{json,md,png} (copy it to benchmarks/results/).
#
#   bash tools/device_run.sh FAMILY [PART...]     PART: tests, bench (default: both)
#   FAMILY: one of `python3 -m benchmarks --list` (attention attention_backward attention_varlen attention_kvcache norms softmax gemm
#           gemm_skinny rope swiglu cross_entropy plugin core multi_gpu op_overhead first_call cache_trust fleet)
#
# tests: pytest of the family's GPU tests with a junit XML ($OUT/FAMILY_tests.{log,xml});
# bench: the family's suite, its log in $OUT/FAMILY_bench.log. The device's copy keeps the git metadata it started
# with: pass BENCH_COMMIT=$(git rev-parse --short HEAD) from the checkout (after committing) so results name the commit.
set -uo pipefail
family=${1:?usage: tools/device_run.sh FAMILY [tests] [bench]}
shift
parts=${*:-tests bench}
out=${OUT:-/tmp/rtckern-out}
mkdir -p "$out"
export OUT=$out PYTHONPATH=. PYTHONUNBUFFERED=1 RTCKERN_CACHE_DIR=${RTCKERN_CACHE_DIR:-/tmp/rtckern-device-cache}
# torch.ops.rtckern through the native front (built once into the cache dir before the tests and benchmarks)
export RTCKERN_TORCH_NATIVE=${RTCKERN_TORCH_NATIVE:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ! python3 -m benchmarks --list | awk '{print $1}' | grep -qx "$family"; then
  echo "unknown family: $family ($(python3 -m benchmarks --list | awk '{print $1}' | tr '\n' ' '))"
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import rtckern.torch as rt; s = rt.native_status(); print('native front:', s['active'], s['why_not'] or '')"
junit=$out/${family}_tests.xml

# family -> its GPU tests | the suite's options for the device run (besides --out)
tests=""
args=""
case "$family" in
  attention)   tests="tests/gpu/ops/test_attention.py"; args="--check" ;;
  attention_backward) tests="tests/gpu/ops/test_attention_backward.py"; args="--deterministic" ;;
  attention_varlen) tests="tests/gpu/ops/test_attention_varlen.py tests/gpu/plugins/test_torch_attention_varlen_gpu.py" ;;
  attention_kvcache) tests="tests/gpu/ops/test_attention_kvcache.py" ;;
  norms)       tests="tests/gpu/ops/test_norms.py" ;;
  softmax)     tests="tests/gpu/ops/test_softmax.py"; args="--prefill" ;;
  gemm)        tests="tests/gpu/ops/test_gemm.py" ;;
  gemm_fp8)    tests="tests/gpu/ops/test_gemm_fp8.py" ;;
  grouped_gemm) tests="tests/gpu/ops/test_grouped_gemm.py tests/gpu/ops/test_grouped_gemm_fp8.py" ;;
  gemm_skinny) tests="tests/gpu/ops/test_gemm.py"; args="--host" ;;
  rope)        tests="tests/gpu/ops/test_rope.py tests/gpu/plugins/test_torch_rope_gpu.py" ;;
  swiglu)      tests="tests/gpu/ops/test_glu.py tests/gpu/plugins/test_torch_glu_gpu.py" ;;
  cross_entropy) tests="tests/gpu/ops/test_cross_entropy.py tests/gpu/plugins/test_torch_loss_gpu.py" ;;
  plugin)      tests="tests/gpu/plugins" ;;
  core)        tests="tests/gpu/test_runtime_gpu.py" ;;
  multi_gpu)   tests="tests/gpu/test_multi_gpu.py tests/gpu/test_runtime_gpu.py" ;;
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
      extra=$args
      [ "$family" = attention ] && [ -f "$junit" ] && extra="$extra --tests $junit"  # the test outcome, recorded
      log=$out/${family}_bench.log
      # shellcheck disable=SC2086
      timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks "$family" --out "$out" $extra > "$log" 2>&1
      echo "bench rc=$?"; tail -5 "$log" | cut -c1-200 ;;
    *) echo "unknown part: $part (tests, bench)"; exit 2 ;;
  esac
done
ls "$out"
