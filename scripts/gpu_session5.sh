#!/usr/bin/env bash
# Session 5 device runs. Everything under $OUT is packed into one <part>.tgz (the device returns at most 8 files).
# PART=a: the row-count probe at N = 65536 (norms and softmax; it failed on an import in this run), the long-row
# backward configs (N = 100000 and 262144, before / after a config growth rule that was then dropped: an earlier
# version of scripts/norms_long_rows.py), then the norms and softmax GPU tests on the current tables.
# PART=b: the row-count probe again, and the long-row backward sweep (scripts/norms_long_rows.py).
# PART=c: the l2 forward split over clusters: its GPU tests, then the l2 forward sweep at N = 16384 / 65536 (every
# l2 config, split or not, and the shipped configs of the other kinds re-timed), merged into the tables here
# (returned under tables/). PART=d: the norms GPU tests and the norms benchmark on the tables in the tree.
# PART=f: the l2 forward sweep with the L2 access-policy variants (OPT 256), merged into the tables (returned).
# PART=g: the same for the l2 backward, then the norms GPU tests and the norms benchmark on the merged tables.
# PART=h: softmax: the l2 kernels with L2 access policies re-tuned against the shipped configs (forward: plain,
# masked, causal; N = 8192 / 16384 / 65536; every dtype; rows under tuning/), and the norm-config probe (op vs
# direct launch). PART=i: the same re-tune for the backward, then the softmax GPU tests and the softmax benchmark
# (the new backward rows from this run's tuning dir, the forward ones merged into the tree).
# PART=j: norms: the l2c backward with the L2 access policies swept at N = 16384 / 65536 (merged, returned), the
# l2c GPU tests, then the norms benchmark on the merged tables.
# PART=k: norms: the LayerNorm l2 forward with its statistics behind one barrier (rtk_norm_block_mean_m2): the
# forward GPU tests, the l2 forward sweep with the policy variants (merged, returned), then the norms benchmark.
# PART=l: the causal softmax's traffic without its arithmetic (benchmarks/causal_traffic.py) next to the softmax.
# PART=m: after the review fixes (residual x / l2c stand-in loads under the policies, cluster check, softmax rows
# whose config a re-tune kept restored): the norms and softmax GPU tests and the softmax benchmark.
# PART=o: Nsight Compute on the causal softmax forward (4096) and the causal-traffic kernel of the same bytes.
# PART=p: the same at the boost clock (--clock-control none), kernels built with line info, per-instruction
# counters of the softmax (the SASS source page).
# PART=q: softmax: the cp.async forward with the full-occupancy register cap, re-tuned against the shipped configs
# (masked and causal, N = 4096 / 8192 / 16384, every dtype; rows under tuning/), the softmax GPU tests and the
# benchmark on those rows.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 RTCKERN_CACHE_DIR=/tmp/rtk-s5 RTCKERN_TUNING_DIR=${TUNING_DIR:-$OUT/tuning}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
P=${PART:-a}
mkdir -p $OUT/$P
if [ "$P" = a ] || [ "$P" = b ]; then
  timeout 150 python3 scripts/probe_row_count.py > $OUT/$P/row_count.log 2>&1; cat $OUT/$P/row_count.log | cut -c1-300
  timeout 240 python3 scripts/norms_long_rows.py --out $OUT/$P > $OUT/$P/long_rows.log 2>&1
  python3 - $OUT/$P/long_rows.log <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        r = json.loads(line)
        print(r["op"], r["dtype"], r["n"], r["kind"], r["config"], "shipped" if r["shipped"] else "",
              round(r.get("gbps") or 0), r.get("ok"), r.get("regs"), (r.get("infeasible") or r.get("error") or "")[:80])
    else:
        print(line.rstrip()[:200])
PY
fi
if [ "$P" = a ]; then
  timeout 330 python3 -m pytest -q -m gpu tests/gpu/ops/test_norms.py tests/gpu/ops/test_softmax.py \
    -p no:cacheprovider > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
fi
if [ "$P" = c ]; then
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/ops/test_norms.py -k "split or stash" -p no:cacheprovider \
    > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  timeout 400 python3 benchmarks/norms.py sweep --kinds l2 --dirs fwd --ns 16384,65536 --sweep-budget 300 \
    --out $OUT/$P > $OUT/$P/sweep.log 2>&1; grep -E "^sweep|FAILED|Error|prefill" $OUT/$P/sweep.log | cut -c1-400
  python3 benchmarks/norms.py tables --sweep $OUT/$P/norms_sweep.json --merge && mkdir -p $OUT/$P/tables && \
    cp rtckern/tuning_tables/norm_*.json $OUT/$P/tables/
elif [ "$P" = f ] || [ "$P" = g ] || [ "$P" = j ] || [ "$P" = k ]; then
  if [ "$P" = k ]; then
    timeout 200 python3 -m pytest -q -m gpu tests/gpu/ops/test_norms.py -k "forward or split or stash or repeatable" \
      -p no:cacheprovider > $OUT/$P/gpu_tests_fwd.txt 2>&1
    tail -2 $OUT/$P/gpu_tests_fwd.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests_fwd.txt | head -20
  fi
  D=fwd; KIND=l2; NS=1024,4096,5120,8192,12288,16384,65536
  [ "$P" = g ] && D=bwd
  [ "$P" = j ] && D=bwd && KIND=l2c && NS=16384,65536
  timeout 420 python3 benchmarks/norms.py sweep --kinds $KIND --dirs $D --ns $NS --l2-policy --sweep-budget 330 \
    --out $OUT/$P > $OUT/$P/sweep.log 2>&1; grep -E "^sweep|FAILED|Error|prefill|budget" $OUT/$P/sweep.log | cut -c1-400
  python3 benchmarks/norms.py tables --sweep $OUT/$P/norms_sweep.json --merge && mkdir -p $OUT/$P/tables && \
    cp rtckern/tuning_tables/norm_*.json $OUT/$P/tables/
fi
if [ "$P" = d ] || [ "$P" = g ] || [ "$P" = j ] || [ "$P" = k ]; then
  TESTS="tests/gpu/ops/test_norms.py tests/gpu/plugins"; [ "$P" = j ] && TESTS="tests/gpu/ops/test_norms.py -k l2c"
  if [ "$P" != k ]; then
    timeout 200 python3 -m pytest -q -m gpu $TESTS -p no:cacheprovider > $OUT/$P/gpu_tests.txt 2>&1
    tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  fi
  timeout 380 python3 benchmarks/norms.py bench --out $OUT/$P > $OUT/$P/bench.log 2>&1; tail -5 $OUT/$P/bench.log
  grep -E "^\| (rms|layer)" $OUT/$P/norms_bench.md | cut -c1-200
fi
if [ "$P" = h ] || [ "$P" = i ] || [ "$P" = q ]; then
  D=fwd; K=plain,masked,causal; KER=l2; NS=8192,16384,65536; NAME=softmax_tune_policy_fwd
  [ "$P" = i ] && D=bwd && K=plain,causal && NAME=softmax_tune_policy_bwd
  [ "$P" = q ] && K=masked,causal && KER=async && NS=4096,8192,16384 && NAME=softmax_tune_async_minb
  export RTCKERN_TUNING_DIR=$OUT/$P/tuning
  timeout 330 python3 benchmarks/softmax.py --tune --tune-no-ring --tune-dirs $D --tune-kinds $K --tune-kernels $KER \
    --tune-ns $NS --dtypes bf16,fp16,fp32 --name $NAME > $OUT/$P/tune.log 2>&1
  grep -E "best|FAIL|Error|failing" $OUT/$P/tune.log | cut -c1-260
fi
if [ "$P" = h ]; then
  timeout 200 python3 scripts/probe_norm_configs.py > $OUT/$P/probe_norm_configs.log 2>&1
  cut -c1-300 $OUT/$P/probe_norm_configs.log
elif [ "$P" = i ] || [ "$P" = q ]; then
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/ops/test_softmax.py -p no:cacheprovider > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  timeout 200 python3 benchmarks/softmax.py --bench --dtypes bf16,fp16,fp32 --name softmax_s5$P > $OUT/$P/bench.log 2>&1
  grep -v "tune " $OUT/$P/bench.log | tail -3 | cut -c1-300
fi
if [ "$P" = m ]; then
  timeout 300 python3 -m pytest -q -m gpu tests/gpu/ops/test_norms.py tests/gpu/ops/test_softmax.py \
    -p no:cacheprovider > $OUT/$P/gpu_tests.txt 2>&1
  tail -2 $OUT/$P/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/$P/gpu_tests.txt | head -20
  timeout 200 python3 benchmarks/softmax.py --bench --dtypes bf16,fp16,fp32 --name softmax_s5m > $OUT/$P/bench.log 2>&1
  grep -v "tune " $OUT/$P/bench.log | tail -2 | cut -c1-300
fi
if [ "$P" = o ]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  timeout 400 $NCU --set full -k regex:"softmax|causal_rows" --launch-skip 2 --launch-count 2 -o $OUT/$P/causal python3 scripts/profile_causal.py \
    > $OUT/$P/ncu.log 2>&1; tail -5 $OUT/$P/ncu.log
  $NCU --import $OUT/$P/causal.ncu-rep --page details --csv > $OUT/$P/causal_details.csv 2>&1
  $NCU --import $OUT/$P/causal.ncu-rep --page details > $OUT/$P/causal_details.txt 2>&1
  grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|L2 Hit|Stall|Issued Warp|Eligible|Theoretical Occ|Block Limit" \
    $OUT/$P/causal_details.txt | head -80
fi
if [ "$P" = p ]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  export RTCKERN_LINEINFO=1 RTCKERN_CACHE_DIR=/tmp/rtk-s5-lineinfo
  timeout 300 $NCU --set full --clock-control none --import-source yes -k regex:"softmax|causal_rows" \
    --launch-skip 2 --launch-count 2 -o $OUT/$P/causal python3 scripts/profile_causal.py > $OUT/$P/ncu.log 2>&1
  tail -3 $OUT/$P/ncu.log
  $NCU --import $OUT/$P/causal.ncu-rep --page details > $OUT/$P/causal_details.txt 2>&1
  $NCU --import $OUT/$P/causal.ncu-rep --page source --csv --print-source sass -k regex:softmax \
    > $OUT/$P/softmax_sass.csv 2>&1
  grep -E "Duration|DRAM Throughput|Issue Slots Busy|Issued Warp|excessive" $OUT/$P/causal_details.txt | head -20
  head -c 600 $OUT/$P/softmax_sass.csv; echo; wc -l $OUT/$P/softmax_sass.csv
fi
if [ "$P" = l ]; then
  timeout 120 python3 benchmarks/causal_traffic.py > $OUT/$P/causal_traffic.log 2>&1; cat $OUT/$P/causal_traffic.log
fi
find $OUT -maxdepth 1 -type f -exec mv {} $OUT/$P/ \;  # what the softmax benchmark writes into $OUT itself
cd $OUT && tar czf $P.tgz $P && rm -rf $P
