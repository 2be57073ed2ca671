#!/usr/bin/env bash
# Parts of the evaluation suite side by side on a several-GPU host, one GPU each: every part
# is benchmarks/device/run_eval_h200.sh pinned to its GPU by CUDA_VISIBLE_DEVICES, so its 4 replicas
# share that GPU under their own MPS daemon (private pipe directory: daemons never meet).
# Parts given the same GPU run one after another, in the order given.
# Usage (repository root, wheels in .whl/ as for run_h200.sh):
#   OUT=dir bash benchmarks/device/run_eval_parts.sh "GPU TAG PRESET BENCH [runner flags...]" ...
#   e.g. OUT=dir bash benchmarks/device/run_eval_parts.sh \
#          "0 _skew_r01 0.6b e2e --workloads load_skew,memory_skew --reps 2 --max-minutes 5" \
#          "1 _skew_r23 0.6b e2e --workloads load_skew,memory_skew --first-rep 2 --reps 2 --max-minutes 5"
# Every preset is prepared first (checkpoint, kernels), so no two parts write one checkpoint.
# Each part writes $OUT/eval_h200_<PRESET>_<BENCH><TAG>.json and .log (see run_eval_h200.sh).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: OUT=dir $0 \"GPU TAG PRESET BENCH [flags...]\" ..." >&2; exit 2; }
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
declare -A queue  # GPU -> its parts, newline-separated
for part in "$@"; do
  read -r gpu tag preset bench _ <<<"$part"
  [ -n "${bench:-}" ] || { echo "a part needs GPU TAG PRESET BENCH: '$part'" >&2; exit 2; }
  queue[$gpu]+="$part"$'\n'
  presets+=" $preset"
done
for preset in $(tr ' ' '\n' <<<"$presets" | sort -u); do
  OUT=$OUT bash benchmarks/device/run_eval_h200.sh "$preset" prep >"$OUT/prep_$preset.log" 2>&1 \
    || { tail -n 20 "$OUT/prep_$preset.log"; exit 1; }
done
for gpu in "${!queue[@]}"; do
  (
    while read -r _ tag preset bench flags; do
      [ -n "$bench" ] || continue
      # shellcheck disable=SC2086  # the runner's flags split on spaces, as typed
      CUDA_VISIBLE_DEVICES=$gpu TAG=$tag OUT=$OUT bash benchmarks/device/run_eval_h200.sh "$preset" "$bench" $flags \
        >/dev/null 2>&1
    done <<<"${queue[$gpu]}"
  ) &
done
wait
for log in "$OUT"/eval_*.log; do
  echo "== $log"
  tail -n 3 "$log"
done
