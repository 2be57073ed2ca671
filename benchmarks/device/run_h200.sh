#!/usr/bin/env bash
# One H200 session: GPU tests, KV-transfer benchmarks, the engine throughput benchmark
# against transformers.
# Usage (from the repository root, with msgspec/posix-ipc/pytest-asyncio wheels in .whl/):
#   OUT=results_dir bash benchmarks/device/run_h200.sh [steps...]
#   steps: tests transfer throughput (default: tests throughput). The CUDA extensions are
#   built first, so no test or timed run pays for the compile. Set LMPOOL_GIT_REVISION to
#   the revision copied (the copy may carry no, or stale, git metadata).
set -uo pipefail
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
. benchmarks/device/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
build_kernels || { echo "kernel build failed" >&2; exit 1; }
steps=${*:-tests throughput}
for step in $steps; do
  case $step in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_engine_gpu.py \
        tests/transfer/test_cuda_ipc_gpu.py tests/transfer/test_cuda_ipc_parts.py \
        tests/transfer/test_benchmark_kv_transfer.py tests/pool/test_transfer_gpu.py 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -15 ;;
    transfer)
      timeout 180 python3 -m benchmarks.benchmark_kv_transfer --kind cuda_ipc --preset 0.6b \
        --sizes 1,2,4,8,16,32,64,128 --reps 20 --json "$OUT/kv_transfer_h200_pull.json" 2>&1 \
        | tee "$OUT/kv_transfer_h200_pull.log" | tail -30
      timeout 200 python3 -m benchmarks.benchmark_kv_transfer --kind pool --preset 0.6b \
        --sizes 1,2,4,8,16,32,64 --reps 30 --profile "$OUT/kv_transfer_h200_pull.json" \
        --json "$OUT/kv_transfer_h200_pool.json" 2>&1 | tee "$OUT/kv_transfer_h200_pool.log" | tail -20 ;;
    throughput)
      python3 -m lmpool.cli make-model /tmp/qwen3-0.6b --preset 0.6b >/dev/null
      timeout 440 python3 -m benchmarks.benchmark_throughput --model /tmp/qwen3-0.6b --device cuda \
        --dtype bfloat16 --num-seqs 256 --min-input 100 --max-input 1024 --min-output 100 \
        --max-output 1024 --compare-hf --hf-batch 256 --json "$OUT/throughput_h200_0.6b.json" 2>&1 \
        | grep -v "Loading weights" | tee "$OUT/throughput.log"
      timeout 60 python3 -m benchmarks.benchmark_host_overhead --json "$OUT/host_overhead_h200.json" 2>&1 \
        | tee "$OUT/host_overhead.log" | tail -12 ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
