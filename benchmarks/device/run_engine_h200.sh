#!/usr/bin/env bash
# The engine's kernels on one H200, in steps that each fit one device call (at most 10 minutes):
#   check     build the kernels, then every GPU test (`-m "gpu or nccl"`, the serve tests
#             apart); about 6 minutes with a cold kernel build (acfc2d5: 49 s, then 281 s)
#   kernels   the kernel benchmark's linear, decode, split, cascade and prefill cases (LMPool's
#             kernels beside cuBLAS and torch's FlashAttention on the same inputs); about 3 minutes
#   decode    profile_decode: a step at 1, 8 and 64 sequences of 2,048 tokens with the fused ops
#             against torch's (issue: 2x at 1 and 8), and one shared 16k document as a replica of
#             4 under MPS decodes it, cascades off and on; about 5 minutes
#   prefill   a 16k document's prefill (cold, and 8k after 8k cached) through LMPool's kernel and
#             FlashAttention, on the whole GPU and as one MPS client of 4, each with its device
#             time by kernel; about 4 minutes
#   early     the decode kernels started early (EngineConfig.dependent_launch) against plain
#             launches: as one MPS client of 4 at 1 and 8 sequences, on the whole GPU at 1-64 in
#             the order off, on, on, off, and 256 sequences' throughput; about 2 minutes
#   route     (first, before the kernel build, while the host is quiet) the route decision's
#             latency at 8 ranks and 1M entries (issue: p99 <= 100 us); under a minute
# Usage (from the repository root, with the wheels in .whl/), one device call each:
#   OUT=results_dir bash benchmarks/device/run_engine_h200.sh route check
#   OUT=results_dir bash benchmarks/device/run_engine_h200.sh kernels prefill
#   OUT=results_dir bash benchmarks/device/run_engine_h200.sh decode
# Every part runs under its own timeout and writes its log (and JSON) under OUT; a part that
# fails is reported and the next one runs. Set LMPOOL_GIT_REVISION to the revision copied.
set -uo pipefail
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
. benchmarks/device/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >> "$OUT/gpu.txt"

part() {  # part NAME SECONDS COMMAND...: run it under a timeout, log it, say how it ended
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - start)) s; $(tail -1 "$OUT/$name.log")"
}

if [ "${1:-}" = route ]; then  # first, on a quiet host: before the kernel build loads its CPUs
  shift
  LMPOOL_BENCH_JSON=$OUT/routing_h200_host.json part route_bench 150 \
    python3 -m pytest -q -s -p no:cacheprovider benchmarks/test_bench_routing.py
  [ $# -gt 0 ] || exit 0
fi
build_kernels > "$OUT/build.log" 2>&1 || { echo "kernel build failed: $OUT/build.log" >&2; tail -30 "$OUT/build.log"; exit 1; }

PRESET=(--preset 0.6b --device cuda --dtype bfloat16)
for step in ${*:-check}; do
  case $step in
    check)
      part gpu_tests 420 python3 -m pytest -q -p no:cacheprovider -m "gpu or nccl" tests --ignore=tests/serve \
        -rfE --durations=12 ;;
    kernels)
      LMPOOL_BENCH_JSON=$OUT/kernels.json part kernel_bench 240 python3 -m pytest --noconftest -q -s \
        -p no:cacheprovider benchmarks/test_bench_kernels.py -k "linear or decode or cascade or prefill" ;;
    decode)
      part decode_fusions 120 python3 -m tools.diagnostics.profile_decode "${PRESET[@]}" --batches 1,8,64 \
        --context 2048 --paths overlapped --norms torch,fused --json "$OUT/decode_fusions.json"
      for c in 0 65536; do
        part "decode_cascade$c" 120 python3 -m tools.diagnostics.profile_decode "${PRESET[@]}" --context 16384 \
          --shared-prefix 64 --batches 32,33,36,40,48 --paths overlapped --mps 4 --no-sync-debug \
          --cascade-min-saved-tokens "$c" --json "$OUT/decode_cascade$c.json"
      done ;;
    prefill)
      for m in 0 4; do
        part "prefill_mps$m" 150 python3 -m benchmarks.benchmark_throughput "${PRESET[@]}" --paths none \
          --prefill 16384,8192:8192 --prefill-attention lmpool,flash --prefill-kernels --mps "$m" --no-progress \
          --json "$OUT/prefill_mps$m.json"
      done ;;
    early)
      part early_mps4 90 python3 -m tools.diagnostics.profile_decode "${PRESET[@]}" --batches 1,8 --context 2048 \
        --paths overlapped --dependent-launch off,on --no-sync-debug --mps 4 --json "$OUT/early_mps4.json"
      part early_decode 150 python3 -m tools.diagnostics.profile_decode "${PRESET[@]}" --batches 1,4,8,64 \
        --context 2048 --paths overlapped --dependent-launch off,on,on,off --no-sync-debug --json "$OUT/early_decode.json"
      # The throughput paths with the decode kernels launched plainly and started early, by this
      # revision's names (``overlapped`` is the engine's default).
      paths=$(python3 -c "from benchmarks.benchmark_throughput import PATHS
print(','.join(p for p in ('plain', 'overlapped', 'early') if p in PATHS))")
      part early_throughput 150 python3 -m benchmarks.benchmark_throughput "${PRESET[@]}" --num-seqs 256 \
        --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --paths "$paths" --no-progress \
        --json "$OUT/early_throughput.json" ;;
    *) echo "unknown step $step (route first, then check, kernels, decode, prefill, early)" >&2; exit 2 ;;
  esac
done
