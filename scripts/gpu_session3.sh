#!/usr/bin/env bash
# Session 3 device runs. PART=exp: the norms forward l2 sweep with shared-memory stashes (rows of 32 KB and more,
# re-timing the shipped configs of the other kinds) and the softmax forward re-tune at N=65536 (l2 stash configs
# beside the others, one-pass and ring tables). PART=tests: the GPU tests of softmax, norms, runtime and registry.
# PART=bench: the norms and softmax benchmarks on the tables in the tree.
# Everything under $OUT is packed into one <part>.tgz (the device returns at most 8 files).
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 RTCKERN_CACHE_DIR=/tmp/rtk-s3 RTCKERN_TUNING_DIR=$OUT/tuning
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
P=${PART:-exp}
mkdir -p $OUT/$P
if [ "$P" = exp ]; then
  timeout 250 python3 benchmarks/norms.py sweep --kinds l2 --dirs fwd --ns ${NORM_NS:-16384,65536} \
    --sweep-budget 200 --out $OUT/$P > $OUT/$P/norms_sweep.log 2>&1
  grep -E "^sweep|FAILED|prefill" $OUT/$P/norms_sweep.log | cut -c1-400
  timeout 300 python3 benchmarks/softmax.py --tune --tune-dirs fwd --tune-ns ${SOFTMAX_NS:-65536} \
    --dtypes bf16,fp16,fp32 --name softmax_tune_s3 > $OUT/$P/softmax_tune.log 2>&1
  grep -E "best|FAIL|Error" $OUT/$P/softmax_tune.log | cut -c1-300
elif [ "$P" = exp2 ]; then
  # l2c clusters of 16 (non-portable) at N=65536, masked softmax rows in head order: tests first, then the sweeps.
  timeout 200 python3 -m pytest -q -m gpu tests/gpu/ops/test_softmax.py tests/gpu/ops/test_norms.py \
    tests/gpu/test_runtime_gpu.py -k "masked or stash or l2c_every_opt or cluster" -p no:cacheprovider \
    > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  timeout 200 python3 benchmarks/norms.py sweep --kinds l2c --dirs bwd --ns 65536 --sweep-budget 150 \
    --out $OUT/$P > $OUT/$P/norms_sweep.log 2>&1
  grep -E "^sweep|FAILED|prefill" $OUT/$P/norms_sweep.log | cut -c1-400
  timeout 150 python3 benchmarks/softmax.py --tune --tune-dirs fwd --tune-kinds masked --dtypes bf16 \
    --name softmax_tune_masked > $OUT/$P/softmax_tune.log 2>&1
  grep -E "best|FAIL|Error" $OUT/$P/softmax_tune.log | cut -c1-300
elif [ "$P" = exp3 ]; then
  # The cp.async-staged norms backward and the masked softmax head order past the L2 reuse distance.
  timeout 240 python3 -m pytest -q -m gpu tests/gpu/ops/test_norms.py tests/gpu/ops/test_softmax.py \
    -k "stage or head_order or backward_options or bitwise" -p no:cacheprovider > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  timeout 200 python3 benchmarks/norms.py sweep --kinds stage --dirs bwd --ns 4096,5120,8192,12288,16384 \
    --sweep-budget 150 --out $OUT/$P > $OUT/$P/norms_sweep.log 2>&1
  grep -E "^sweep|FAILED|prefill" $OUT/$P/norms_sweep.log | cut -c1-400
  timeout 100 python3 benchmarks/softmax.py --tune --tune-dirs fwd --tune-kinds masked --dtypes bf16 \
    --name softmax_tune_masked > $OUT/$P/softmax_tune.log 2>&1
  grep -E "best|FAIL|Error" $OUT/$P/softmax_tune.log | cut -c1-300
elif [ "$P" = exp4 ]; then
  # The cp.async-staged norms forward: its tests, then the sweep against the shipped kinds.
  timeout 240 python3 -m pytest -q -m gpu tests/gpu/ops/test_norms.py \
    -k "stage or forward_options or bitwise or many_rows or forward_every_kind" -p no:cacheprovider \
    > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  timeout 200 python3 benchmarks/norms.py sweep --kinds stage --dirs fwd --ns 4096,5120,8192,12288,16384 \
    --sweep-budget 150 --out $OUT/$P > $OUT/$P/norms_sweep.log 2>&1
  grep -E "^sweep|FAILED|prefill" $OUT/$P/norms_sweep.log | cut -c1-400
elif [ "$P" = final ]; then
  # The GPU tests of every op family touched this session (softmax, norms, runtime, registry, torch plugin), then
  # both benchmarks on the tables in the tree.
  timeout 260 python3 -m pytest -q -m gpu tests/gpu/ops/test_softmax.py tests/gpu/ops/test_norms.py \
    tests/gpu/test_runtime_gpu.py tests/gpu/test_registry_gpu.py tests/gpu/plugins -p no:cacheprovider \
    > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  timeout 170 python3 benchmarks/norms.py bench --out $OUT/$P --compile-budget 100 > $OUT/$P/norms_bench.log 2>&1
  tail -3 $OUT/$P/norms_bench.log | cut -c1-200
  timeout 120 python3 benchmarks/softmax.py --bench --dtypes bf16,fp16,fp32 --name softmax_s3 \
    > $OUT/$P/softmax_bench.log 2>&1
  grep -v "tune " $OUT/$P/softmax_bench.log | tail -2 | cut -c1-300
elif [ "$P" = exp5 ]; then
  # Wider sweeps with the kernels as they are (each config checked against float64 before it counts): the l2
  # forward with minb 4 / 8 at 128-256 threads, the stage backward at N = 5120 with 160 / 320 / 640 threads; the
  # tables rebuilt from every sweep in the tree plus these two, then the norms benchmark on them.
  R=benchmarks/results
  timeout 150 python3 benchmarks/norms.py sweep --kinds l2 --dirs fwd --ns 4096,5120,8192,12288,16384 \
    --sweep-budget 110 --out $OUT/$P/l2fwd > $OUT/$P/sweep_l2fwd.log 2>&1
  grep -E "^sweep|FAILED" $OUT/$P/sweep_l2fwd.log | cut -c1-300
  timeout 80 python3 benchmarks/norms.py sweep --kinds stage --dirs bwd --ns 5120 --sweep-budget 50 \
    --out $OUT/$P/stage5120 > $OUT/$P/sweep_stage5120.log 2>&1
  grep -E "^sweep|FAILED" $OUT/$P/sweep_stage5120.log | cut -c1-300
  python3 benchmarks/norms.py tables --sweep $R/norms_sweep_2026-11-26_h200.json.gz \
    --sweep $R/norms_sweep_l2_2026-11-26_h200.json.gz --sweep $R/norms_sweep_bwd_2026-11-26_h200.json.gz \
    --sweep $R/norms_sweep_stash_2026-11-26_h200.json.gz --sweep $R/norms_sweep_l2c16_2026-11-26_h200.json.gz \
    --sweep $R/norms_sweep_stage_2026-11-26_h200.json.gz --sweep $OUT/$P/l2fwd/norms_sweep.json \
    --sweep $OUT/$P/stage5120/norms_sweep.json
  timeout 170 python3 benchmarks/norms.py bench --out $OUT/$P --compile-budget 100 > $OUT/$P/norms_bench.log 2>&1
  tail -2 $OUT/$P/norms_bench.log | cut -c1-200
elif [ "$P" = tests ]; then
  timeout 150 python3 benchmarks/softmax.py --prefill --dtypes bf16 2>&1 | tail -2
  timeout 420 python3 -m pytest -q -m gpu tests/gpu/ops/test_softmax.py tests/gpu/ops/test_norms.py \
    tests/gpu/test_runtime_gpu.py tests/gpu/test_registry_gpu.py -p no:cacheprovider > $OUT/$P/gpu_tests.txt 2>&1
  tail -3 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
else
  timeout 280 python3 benchmarks/norms.py bench --out $OUT/$P --compile-budget 150 > $OUT/$P/norms_bench.log 2>&1
  tail -5 $OUT/$P/norms_bench.log
  timeout 250 python3 benchmarks/softmax.py --bench --dtypes bf16,fp16,fp32 --name softmax_s3 \
    > $OUT/$P/softmax_bench.log 2>&1
  grep -v "tune " $OUT/$P/softmax_bench.log | tail -3 | cut -c1-300
fi
for f in $OUT/*; do [ "$f" != "$OUT/$P" ] && mv "$f" $OUT/$P/ 2>/dev/null; done
cd $OUT && tar czf /tmp/$P.tgz $P && rm -rf $P && mv /tmp/$P.tgz $OUT/$P.tgz && ls -la $OUT
