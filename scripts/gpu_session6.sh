#!/usr/bin/env bash
# Session 6 device runs. Everything under $OUT is packed into one <part>.tgz.
# PART=a: the norm operand probe (scripts/probe_norm_operands.py: the shipped forward kernels with and without
# their weight and bias, N = 65536 and 16384).
# PART=b: the persistent cluster forward with the weight / bias held per block (OPT 512): its GPU tests, then the
# cluster forward sweep at N = 16384 / 65536 (the shipped configs of the other kinds re-timed), merged into the
# tables here (returned under tables/). Run twice: the second run timed a variant that read the weight / bias
# from shared memory one pack at a time in the write (slower for fp32: reverted), the tables are the first run's.
# Then (same PART b): a register-capped variant (reverted), y as two FMAs (no gain: reverted), and the pipelined
# statistics (OPT 1024): the tables of that last run are shipped.
# A last PART b run timed OPT 2048 (the row two ahead in shared memory through cp.async instead of registers):
# slower nearly everywhere, reverted (norms_sweep_session6_ahead_*); its tables were not taken.
# PART=c: the norms and plugin GPU tests and the norms benchmark on those tables, then the operand probe again.
# PART=d: Nsight Compute on the 65536 forwards below 0.90x copy (scripts/profile_norms_long.py) and the SASS
# instruction counts of each kernel.
# PART=e: softmax: the cp.async backward's GPU tests, its configs re-tuned against the shipped ones (plain and
# causal, N = 1024-16384, every dtype; rows under tuning/), and the causal backward ring re-tuned at 4096 / 8192
# (bf16) in the same run, for the one-pass / ring choice. PART=f: the softmax and norms GPU tests and the softmax
# benchmark on the merged tables. PART=g: the final norms (+ plugin) and softmax GPU tests, each in its own time limit.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 RTCKERN_CACHE_DIR=/tmp/rtk-s6 RTCKERN_TUNING_DIR=${TUNING_DIR:-$OUT/tuning}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
P=${PART:-a}
mkdir -p $OUT/$P
if [ "$P" = a ]; then
  timeout 200 python3 scripts/probe_norm_operands.py > $OUT/$P/operands.log 2>&1; cat $OUT/$P/operands.log | cut -c1-300
fi
if [ "$P" = b ]; then
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/ops/test_norms.py -k "affine_held or split_over or pipe_few" \
    -p no:cacheprovider > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)|Error" $OUT/$P/gpu_tests.txt | head -20
  timeout 400 python3 benchmarks/norms.py sweep --kinds cluster --dirs fwd --ns 16384,65536 --sweep-budget 330 \
    --out $OUT/$P > $OUT/$P/sweep.log 2>&1; grep -E "^sweep|FAILED|Error|prefill" $OUT/$P/sweep.log | cut -c1-400
  python3 benchmarks/norms.py tables --sweep $OUT/$P/norms_sweep.json --merge && mkdir -p $OUT/$P/tables && \
    cp rtckern/tuning_tables/norm_*.json $OUT/$P/tables/
fi
if [ "$P" = c ]; then
  timeout 220 python3 -m pytest -q -m gpu tests/gpu/ops/test_norms.py tests/gpu/plugins -p no:cacheprovider \
    > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  timeout 300 python3 benchmarks/norms.py bench --out $OUT/$P > $OUT/$P/bench.log 2>&1; tail -3 $OUT/$P/bench.log
  grep -E "^\| (rms|layer)" $OUT/$P/norms_bench.md | cut -c1-200
  timeout 60 python3 scripts/probe_norm_operands.py > $OUT/$P/operands.log 2>&1; cat $OUT/$P/operands.log | cut -c1-300
fi
if [ "$P" = d ]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu); CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
  timeout 300 $NCU --set full -k regex:rtk_norm_fwd -o $OUT/$P/norms python3 scripts/profile_norms_long.py $OUT/$P/cubin \
    > $OUT/$P/ncu.log 2>&1; tail -8 $OUT/$P/ncu.log
  $NCU --import $OUT/$P/norms.ncu-rep --page details > $OUT/$P/norms_details.txt 2>&1
  grep -E "^  rtk_norm|Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Achieved Occupancy|Registers Per|L1/TEX Hit|L2 Hit|Issue Slots Busy|No Eligible|Theoretical Occ|Block Limit Sh" \
    $OUT/$P/norms_details.txt | cut -c1-150 | head -90
  $NCU --import $OUT/$P/norms.ncu-rep --page raw --csv > $OUT/$P/norms_raw.csv 2>&1
  for f in $OUT/$P/cubin/*.cubin; do $CUOBJ -sass $f > ${f%.cubin}.sass 2>&1; echo "$(basename $f): $(grep -cE '^\s+/\*[0-9a-f]{4}\*/' ${f%.cubin}.sass) instructions"; \
    grep -oE '^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P[0-9T] )?[A-Z0-9_.]+' ${f%.cubin}.sass | awk '{print $NF}' | sed 's/\..*//' | sort | uniq -c | sort -rn | head -14 | tr '\n' ' '; echo; done
fi
if [ "$P" = e ]; then
  timeout 100 python3 -m pytest -q -m gpu tests/gpu/ops/test_softmax.py -k "async_backward or l2_backward" \
    -p no:cacheprovider > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  export RTCKERN_TUNING_DIR=$OUT/$P/tuning
  timeout 240 python3 benchmarks/softmax.py --tune --tune-no-ring --tune-dirs bwd --tune-kinds causal,plain \
    --tune-kernels async --tune-ns 1024,4096,8192,16384 --dtypes bf16,fp16,fp32 --name softmax_tune_bwd_async \
    > $OUT/$P/tune.log 2>&1; grep -E "best|FAIL|Error|failing" $OUT/$P/tune.log | cut -c1-260
  timeout 200 python3 benchmarks/softmax.py --tune --tune-ring --tune-dirs bwd --tune-kinds causal --tune-ns 4096,8192 \
    --dtypes bf16 --name softmax_tune_bwd_ring > $OUT/$P/tune_ring.log 2>&1
  grep -E "best|FAIL|Error|failing" $OUT/$P/tune_ring.log | cut -c1-260
  find $OUT -maxdepth 1 -type f -exec mv {} $OUT/$P/ \;
fi
if [ "$P" = f ]; then
  timeout 200 python3 -m pytest -q -m gpu tests/gpu/ops/test_softmax.py tests/gpu/ops/test_norms.py -p no:cacheprovider \
    > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  timeout 250 python3 benchmarks/softmax.py --bench --dtypes bf16,fp16,fp32 --name softmax_session6 > $OUT/$P/bench.log 2>&1
  grep -v "tune " $OUT/$P/bench.log | tail -3 | cut -c1-300
  find $OUT -maxdepth 1 -type f -exec mv {} $OUT/$P/ \;
fi
if [ "$P" = g ] || [ "$P" = h ]; then
  timeout 260 python3 -m pytest -q -m gpu tests/gpu/ops/test_norms.py tests/gpu/plugins -p no:cacheprovider \
    > $OUT/$P/gpu_tests_norms.txt 2>&1
  tail -2 $OUT/$P/gpu_tests_norms.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests_norms.txt | head -20
  [ "$P" = g ] && timeout 260 python3 -m pytest -q -m gpu tests/gpu/ops/test_softmax.py -p no:cacheprovider \
    > $OUT/$P/gpu_tests_softmax.txt 2>&1
  [ "$P" = g ] && tail -2 $OUT/$P/gpu_tests_softmax.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests_*.txt | head -20
fi
cd $OUT && tar czf $P.tgz $P && rm -rf $P
