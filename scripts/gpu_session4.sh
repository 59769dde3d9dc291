#!/usr/bin/env bash
# Session 4 device runs. PART=a: the GPU tests of softmax, norms, runtime, registry and the torch plugin (the
# masked head loop, causal zeros stored first, last session's untested host fixes), then bandwidth by traffic mix
# and one op on fresh allocations (benchmarks/memory_mix.py). PART=b: the one-pass softmax tables re-tuned where
# the kernels changed (masked forward with head-loop configs, causal forward and backward; bf16, the benchmark's
# kinds), then the softmax benchmark on them. Everything under $OUT is packed into one <part>.tgz (the device
# returns at most 8 files). PART=c: see below.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 RTCKERN_CACHE_DIR=/tmp/rtk-s4 RTCKERN_TUNING_DIR=$OUT/tuning
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
P=${PART:-a}
mkdir -p $OUT/$P
if [ "$P" = a ]; then
  timeout 120 python3 benchmarks/softmax.py --prefill --dtypes bf16,fp16,fp32 2>&1 | grep -E "prefill|FAILED" | tail -3
  timeout 330 python3 -m pytest -q -m gpu tests/gpu/ops/test_softmax.py tests/gpu/ops/test_norms.py \
    tests/gpu/test_runtime_gpu.py tests/gpu/test_registry_gpu.py tests/gpu/plugins -p no:cacheprovider \
    > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  timeout 60 python3 benchmarks/memory_mix.py > $OUT/$P/memory_mix.log 2>&1; tail -c 1500 $OUT/$P/memory_mix.log
elif [ "$P" = b ]; then
  timeout 200 python3 benchmarks/softmax.py --tune --tune-no-ring --tune-dirs fwd --tune-kinds masked \
    --tune-ns 1024,4096,8192,16384 --dtypes bf16 --name softmax_tune_masked > $OUT/$P/tune_masked.log 2>&1
  grep -E "best|FAIL|Error" $OUT/$P/tune_masked.log | cut -c1-250
  timeout 200 python3 benchmarks/softmax.py --tune --tune-no-ring --tune-dirs fwd,bwd --tune-kinds causal \
    --dtypes bf16 --name softmax_tune_causal > $OUT/$P/tune_causal.log 2>&1
  grep -E "best|FAIL|Error" $OUT/$P/tune_causal.log | cut -c1-250
  timeout 150 python3 benchmarks/softmax.py --bench --dtypes bf16,fp16,fp32 --name softmax_s4 \
    > $OUT/$P/softmax_bench.log 2>&1
  grep -v "tune " $OUT/$P/softmax_bench.log | tail -2 | cut -c1-300
elif [ "$P" = c ]; then
  # The cp.async head loop: its GPU tests, the masked forward re-tune (bf16, every row length), the op timed
  # around a torch.compile, then the softmax benchmark on the new tables.
  timeout 120 python3 -m pytest -q -m gpu tests/gpu/ops/test_softmax.py -k "masked or head" -p no:cacheprovider \
    > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  timeout 200 python3 benchmarks/softmax.py --tune --tune-no-ring --tune-dirs fwd --tune-kinds masked \
    --dtypes bf16 --name softmax_tune_masked > $OUT/$P/tune_masked.log 2>&1
  grep -E "best|FAIL|Error" $OUT/$P/tune_masked.log | cut -c1-250
  timeout 90 python3 benchmarks/memory_mix.py --allocations 2 > $OUT/$P/memory_mix.log 2>&1
  grep -A30 after_compile $OUT/$P/memory_mix.log | grep -E "when|gbps|clock" | tr -d ' \n'; echo
  timeout 150 python3 benchmarks/softmax.py --bench --dtypes bf16,fp16,fp32 --name softmax_s4 \
    > $OUT/$P/softmax_bench.log 2>&1
  grep -v "tune " $OUT/$P/softmax_bench.log | tail -2 | cut -c1-300
fi
for f in $OUT/*; do [ "$f" != "$OUT/$P" ] && mv "$f" $OUT/$P/ 2>/dev/null; done
cd $OUT && tar czf /tmp/$P.tgz $P && rm -rf $P && mv /tmp/$P.tgz $OUT/$P.tgz && ls -la $OUT
