#!/usr/bin/env bash
# Session 4 device runs. PART=a: the GPU tests of softmax, norms, runtime, registry and the torch plugin (the
# masked head loop, causal zeros stored first, last session's untested host fixes), then bandwidth by traffic mix
# and one op on fresh allocations (benchmarks/memory_mix.py). PART=b: the one-pass softmax tables re-tuned where
# the kernels changed (masked forward with head-loop configs, causal forward and backward; bf16, the benchmark's
# kinds), then the softmax benchmark on them. Everything under $OUT is packed into one <part>.tgz (the device
# returns at most 8 files). PART=c: see below.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 RTCKERN_CACHE_DIR=/tmp/rtk-s4 RTCKERN_TUNING_DIR=${TUNING_DIR:-$OUT/tuning}
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
elif [ "$P" = d ]; then
  # Cache hints of the softmax kernels (each selected kernel built four ways), the op with a kept output, and
  # the softmax GPU tests of the masked kernels.
  timeout 300 python3 benchmarks/softmax_hints.py > $OUT/$P/hints.log 2>&1
  python3 - $OUT/$P/hints.log <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        print(r["op"][:24], r["n"], {k: v for k, v in r["vs_shipped"].items()}, r["kernel"][:60])
    elif "Error" in line or "Traceback" in line:
        print(line.rstrip()[:300])
PY
  tail -3 $OUT/$P/hints.log | grep -i error
  timeout 90 python3 benchmarks/memory_mix.py --allocations 1 > $OUT/$P/memory_mix.log 2>&1
  grep -A80 kept_output $OUT/$P/memory_mix.log | grep -E "dtype|kept_output|gbps" | tr -d ' \n'; echo
  timeout 120 python3 -m pytest -q -m gpu tests/gpu/ops/test_softmax.py -k "masked or head" -p no:cacheprovider \
    > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
elif [ "$P" = e1 ]; then
  # Register kernels with default-cached loads and stores (config `cached`): every kernel the tests and sweeps use
  # compiled in parallel, the softmax GPU tests, the plain forward re-tune (every dtype).
  timeout 150 python3 benchmarks/softmax.py --prefill --dtypes bf16,fp16,fp32 2>&1 | grep -E "prefill|FAILED" | tail -3
  timeout 200 python3 -m pytest -q -m gpu tests/gpu/ops/test_softmax.py -p no:cacheprovider > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  timeout 200 python3 benchmarks/softmax.py --tune --tune-no-ring --tune-dirs fwd --tune-kinds plain \
    --dtypes bf16,fp16,fp32 --name softmax_tune_plain_fwd > $OUT/$P/tune_plain_fwd.log 2>&1
  grep -E "best|FAIL|Error" $OUT/$P/tune_plain_fwd.log | cut -c1-250
elif [ "$P" = e2 ]; then
  # The plain backward (every dtype) and the causal forward and backward (bf16) re-tuned with the cached
  # variants, then the softmax benchmark on the tables of e1 and e2 (the same tuning dir).
  timeout 200 python3 benchmarks/softmax.py --tune --tune-no-ring --tune-dirs bwd --tune-kinds plain \
    --dtypes bf16,fp16,fp32 --name softmax_tune_plain_bwd > $OUT/$P/tune_plain_bwd.log 2>&1
  grep -E "best|FAIL|Error" $OUT/$P/tune_plain_bwd.log | cut -c1-250
  timeout 150 python3 benchmarks/softmax.py --tune --tune-no-ring --tune-dirs fwd,bwd --tune-kinds causal \
    --dtypes bf16 --name softmax_tune_causal > $OUT/$P/tune_causal.log 2>&1
  grep -E "best|FAIL|Error" $OUT/$P/tune_causal.log | cut -c1-250
  timeout 150 python3 benchmarks/softmax.py --bench --dtypes bf16,fp16,fp32 --name softmax_s4 \
    > $OUT/$P/softmax_bench.log 2>&1
  grep -v "tune " $OUT/$P/softmax_bench.log | tail -2 | cut -c1-300
elif [ "$P" = f ]; then
  # Final: the softmax GPU tests on the shipped tables (cached register configs, the masked head loop), then the
  # softmax benchmark twice (the second run measures the run-to-run spread).
  timeout 150 python3 benchmarks/softmax.py --prefill --dtypes bf16,fp16,fp32 2>&1 | grep -E "prefill|FAILED" | tail -3
  timeout 200 python3 -m pytest -q -m gpu tests/gpu/ops/test_softmax.py tests/gpu/plugins -p no:cacheprovider \
    > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  for name in softmax_s4 softmax_s4_repeat; do
    timeout 120 python3 benchmarks/softmax.py --bench --dtypes bf16,fp16,fp32 --name $name > $OUT/$P/$name.log 2>&1
    grep -v "tune " $OUT/$P/$name.log | tail -1 | cut -c1-300
  done
elif [ "$P" = g ]; then
  # The l2 backward with y and dy partly stashed: its GPU tests (and the forward stash's), the backward re-tune at
  # N = 65536 (plain and causal, every dtype), then the softmax benchmark.
  timeout 100 python3 -m pytest -q -m gpu tests/gpu/ops/test_softmax.py -k "stash" -p no:cacheprovider \
    > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  timeout 120 python3 benchmarks/softmax.py --tune --tune-no-ring --tune-dirs bwd --tune-kinds plain,causal \
    --tune-ns 65536 --dtypes bf16,fp16,fp32 --name softmax_tune_bwd_stash > $OUT/$P/tune_bwd.log 2>&1
  grep -E "best|FAIL|Error" $OUT/$P/tune_bwd.log | cut -c1-250
  timeout 120 python3 benchmarks/softmax.py --bench --dtypes bf16,fp16,fp32 --name softmax_s4g \
    > $OUT/$P/softmax_bench.log 2>&1
  grep -v "tune " $OUT/$P/softmax_bench.log | grep -E "n=65536|summary" | cut -c1-200
elif [ "$P" = h ]; then
  # Review fixes: the head loop stops after H heads when H < HEADS; the causal bound in the backward stash's
  # re-read tail. Their GPU tests, the benchmark's problem order for bf16 N = 4096, the bf16 benchmark.
  timeout 100 python3 -m pytest -q -m gpu tests/gpu/ops/test_softmax.py -k "head_loop or backward_stash" \
    -p no:cacheprovider > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  timeout 60 python3 scripts/probe_softmax4096.py order 2>&1 | tail -1 | tee $OUT/$P/probe_order.json
  timeout 60 python3 benchmarks/softmax.py --bench --dtypes bf16 --compile none --name softmax_s4h \
    > $OUT/$P/softmax_bench.log 2>&1
  grep -E "softmax bf16 n=4096|masked_softmax bf16 n=1024|summary" $OUT/$P/softmax_bench.log | cut -c1-160
fi
for f in $OUT/*; do [ "$f" != "$OUT/$P" ] && mv "$f" $OUT/$P/ 2>/dev/null; done
cd $OUT && tar czf /tmp/$P.tgz $P && rm -rf $P && mv /tmp/$P.tgz $OUT/$P.tgz && ls -la $OUT
