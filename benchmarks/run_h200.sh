#!/usr/bin/env bash
# One H200 session: GPU tests, then the engine throughput benchmark against transformers.
# Usage (from the repository root, with msgspec/posix-ipc/pytest-asyncio wheels in .whl/):
#   OUT=results_dir bash benchmarks/run_h200.sh [steps...]   steps: tests throughput (default: both)
set -uo pipefail
OUT=${OUT:-benchmarks/results/h200}
mkdir -p "$OUT"
mkdir -p /tmp/site
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
fi
# Without an install, the folders that install under other import names need links.
ln -sfn "$PWD/ipc" /tmp/site/lmpool_ipc
ln -sfn "$PWD/kernels" /tmp/site/lmpool_kernels
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 LMPOOL_KERNEL_CACHE=/tmp/lmpool-kernels
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
steps=${*:-tests throughput}
for step in $steps; do
  case $step in
    tests)
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_engine_gpu.py 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -5 ;;
    throughput)
      python3 -m lmpool.cli make-model /tmp/qwen3-0.6b --preset 0.6b >/dev/null
      timeout 440 python3 benchmarks/benchmark_throughput.py --model /tmp/qwen3-0.6b --device cuda \
        --dtype bfloat16 --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 \
        --max-output 1024 --compare-hf --hf-batch 256 --json "$OUT/throughput_h200_0.6b.json" 2>&1 \
        | grep -v "Loading weights" | tee "$OUT/throughput.log" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
