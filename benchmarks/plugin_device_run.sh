#!/bin/bash
# One device call for the PyTorch plugin: GPU tests (opcheck, references, compile, CUDA graphs, fallback, modules,
# CuPy, transformers end to end), then the end-to-end benchmark. Full logs in $OUT; a summary on stdout.
# Usage (repo root, on the device): bash benchmarks/plugin_device_run.sh [PYTEST_TIMEOUT_S] [BENCH_TIMEOUT_S]
export PYTHONUNBUFFERED=1 PYTHONPATH=. RTCKERN_CACHE_DIR=/tmp/rtkc
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tail -1
timeout ${1:-270} python3 -m pytest -q -m gpu tests/gpu/plugins -p no:cacheprovider -rfE --durations=12 \
  > $OUT/plugin_pytest.log 2>&1
echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|^E  " $OUT/plugin_pytest.log | head -60 | cut -c1-400
sed -n '/slowest/,/=====/p' $OUT/plugin_pytest.log | head -16
timeout ${2:-120} python3 benchmarks/plugin.py > $OUT/plugin_bench.log 2>&1
echo "bench rc=$?"
tail -30 $OUT/plugin_bench.log | cut -c1-400
