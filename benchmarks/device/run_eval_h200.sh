#!/usr/bin/env bash
# The evaluation suite on one H200: 4 replicas share the GPU, each under MPS with 1/4 of
# the SMs, its own KV budget and 256-token blocks; bf16 random-weight Qwen3 shapes.
# Usage (from the repository root; same wheels in .whl/ as benchmarks/device/run_h200.sh):
#   OUT=dir bash benchmarks/device/run_eval_h200.sh PRESET BENCH [runner flags...]
#     PRESET: 0.6b | 1.7b        BENCH: kv_routing | e2e | prep (model and kernels only)
# Writes $OUT/eval_h200_<PRESET>_<BENCH>[<TAG>].json and .log (TAG: env, to name a part; eval_h100_...
# where the card is an H100).
# MPS=0 (env) runs without MPS; WORLD (env, default 4) sets the replicas, e.g. MPS=0 WORLD=2
# for one replica per GPU on a two-GPU machine (replica r runs on cuda:r % GPUs).
# Extra flags go to the runner: --reps, --levels, --policies, --workloads, --first-rep,
# --max-minutes, --scale ... (see benchmarks/PAPER_RUNBOOK.md).
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: OUT=dir $0 PRESET BENCH [runner flags...]" >&2; exit 2; }
preset=$1 bench=$2
shift 2
OUT=${OUT:?set OUT to the folder the results go to}
TAG=${TAG:-}
mkdir -p "$OUT"
. benchmarks/device/setup.sh
model=/tmp/qwen3-$preset
if [ ! -f "$model/config.json" ]; then
  python3 -m lmpool.cli make-model "$model" --preset "$preset" >/dev/null || exit 1
fi
# Build the CUDA kernels once here, so no timed pool start pays for the compile.
build_kernels || exit 1
[ "$bench" = prep ] && exit 0
# Named by the card that ran it: a lease may give an H100 for the H200 asked for, and the
# committed H200 files (the standing table reads eval_h200*) must not take its numbers.
card=h200
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -q H100 && card=h100
name="eval_${card}_${preset}_${bench}${TAG}"
mps=--mps
[ "${MPS:-1}" = 0 ] && mps=
python3 -m "benchmarks.benchmark_${bench}" --device cuda --model "$model" --preset "$preset" \
  --world-size "${WORLD:-4}" --dtype bfloat16 --block-size 256 $mps --run-timeout 120 \
  --json "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.log"
