#!/usr/bin/env bash
# One several-GPU session (nvidia-h200-x2 or larger): the NCCL pair transport's two-rank
# tests, the CUDA IPC pull across two GPUs, and the packed-NCCL vs raw torch.distributed vs
# peer-pull transfer benchmark.
# Usage (from the repository root, with the wheels in .whl/ as for run_h200.sh):
#   OUT=results_dir bash benchmarks/device/run_h200x2.sh [steps...]
#   steps: tests bench variants profile pool gpu demo (default: tests bench). gpu: every GPU
#   and NCCL test of the suite, the two-GPU ones included. demo: the README's demo on both
#   GPUs, then on one (two replicas sharing it). variants: the packed
#   transfer with other chunk counts and pack/unpack grid caps (--pack-variants). profile:
#   where one pull's time goes. pool: the pool path across the two GPUs, calibrated by the
#   bench step's JSON (run bench first): the transfer profile of one replica per GPU.
set -uo pipefail
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
. benchmarks/device/setup.sh
# NVLink multicast (NVLS) stays off: the lent machines do not support it.
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
nvidia-smi topo -m | tee "$OUT/topo.txt"
build_kernels || { echo "kernel build failed" >&2; exit 1; }
steps=${*:-tests bench}
for step in $steps; do
  case $step in
    tests)
      RUN_NCCL_INTEGRATION=1 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/transfer/test_nccl_gpu.py tests/transfer/test_streams.py \
        tests/transfer/test_nccl_lib.py "tests/kernels/test_kernels_gpu.py::test_pack_unpack_round_trip" 2>&1 \
        | tee "$OUT/nccl_tests.log" | tail -15
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/transfer/test_cuda_ipc_gpu.py -k two_gpus 2>&1 \
        | tee "$OUT/cuda_ipc_two_gpus.log" | tail -8
      # The pool's own transfers across the two GPUs: pulled (auto) and packed over NCCL.
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/pool/test_transfer_gpu.py 2>&1 \
        | tee "$OUT/pool_transfer_two_gpus.log" | tail -8 ;;
    bench)
      timeout 260 python3 -m benchmarks.benchmark_kv_transfer --kind nccl --preset 0.6b \
        --sizes "${SIZES:-1,2,4,8,10,12,16,32,64}" --reps "${REPS:-20}" --pack-variants "${BENCH_VARIANTS:-auto:132,auto/1}" --json "$OUT/kv_transfer_h200x2_nccl.json" 2>&1 \
        | tee "$OUT/kv_transfer_h200x2_nccl.log" | tail -40 ;;
    variants)
      timeout 300 python3 -m benchmarks.benchmark_kv_transfer --kind nccl --preset 0.6b --sizes 1,4,16,64 \
        --reps 15 --pack-variants "${VARIANTS:-auto:0,taper,t3,t5,4}" \
        --json "$OUT/kv_transfer_h200x2_nccl_variants.json" 2>&1 \
        | tee "$OUT/kv_transfer_h200x2_nccl_variants.log" | tail -60 ;;
    profile)
      timeout 120 python3 -m tools.diagnostics.profile_pull --preset 0.6b --sizes 1,8,64,128 \
        --json "$OUT/pull_profile_h200.json" 2>&1 | tee "$OUT/pull_profile_h200.log" | tail -8 ;;
    pool)
      timeout 150 python3 -m benchmarks.benchmark_kv_transfer --kind pool --preset 0.6b --sizes 1,2,4,8,16,32,64 \
        --reps 30 --profile "$OUT/kv_transfer_h200x2_nccl.json" --json "$OUT/kv_transfer_h200x2_pool.json" 2>&1 \
        | tee "$OUT/kv_transfer_h200x2_pool.log" | tail -12 ;;
    gpu)
      RUN_NCCL_INTEGRATION=1 timeout 420 python3 -m pytest -q -p no:cacheprovider -m "gpu or nccl" tests 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -15 ;;
    demo)
      for visible in 0,1 0; do
        CUDA_VISIBLE_DEVICES=$visible LMPOOL_CACHE=/tmp/lmpool-demo timeout 240 python3 -m lmpool.cli demo 2>&1 \
          | tee "$OUT/demo_gpus_${visible/,/}.log" | tail -12
      done ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
