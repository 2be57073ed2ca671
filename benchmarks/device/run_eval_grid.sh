#!/usr/bin/env bash
# One step of the balanced-order, sweep and hot-context matrix (benchmarks/PAPER_RUNBOOK.md §6):
# eight parts side by side on an eight-GPU host, one GPU each (benchmarks/device/run_eval_parts.sh),
# each part 4 replicas under MPS, the policies in the Williams order, 1-2 repetitions.
# Usage (repository root):
#   OUT=dir LMPOOL_GIT_REVISION=<sha> bash benchmarks/device/run_eval_grid.sh STEP PRESET
#     STEP: hot-a | hot-b | hot-c | sessions | kv | window-e | window-f | poisson-g | poisson-h
#     PRESET: 0.6b | 1.7b (1.7b's transfer modes run without a calibration profile: none is committed)
# DRY=1 prints the parts instead of running them; ONLY=k runs part k alone on GPU 0 (a one-GPU host).
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: OUT=dir $0 STEP PRESET" >&2; exit 2; }
step=$1 m=$2
profile=
[ "$m" = 0.6b ] && profile="--transfer-profile benchmarks/results/kv_transfer_h200_pool.json"
H="--policies round_robin,least_loaded,sglang_cache_aware,dynamo_kv,lmpool-routing,lmpool,lmpool+all $profile --reps 1"
peers=round_robin,least_loaded,sglang_cache_aware,sglang_cache_aware_v0,dynamo_kv,dynamo_kv_v0,lmpool-routing,lmpool
R="--levels 5 --policies $peers --max-minutes 7"
E="--workloads load_skew,memory_skew --policies $peers --max-minutes 7"
a=()
add() { a+=("${#a[@]} $*"); }  # the next GPU, in order
case $step in
  hot-a) for c in 16384 4096; do for h in 1 2; do for r in 0 1; do
           add "_c${c}_h${h}_r$r $m hot_context --contexts $c --hot $h --first-rep $r $H"; done; done; done ;;
  hot-b) for h in 1 2; do for r in 0 1 2; do add "_c32768_h${h}_r$r $m hot_context --contexts 32768 --hot $h --first-rep $r $H"; done
           add "_c16384_h${h}_r2 $m hot_context --contexts 16384 --hot $h --first-rep 2 $H"; done ;;
  hot-c) for h in 1 2; do add "_c4096_h${h}_r2 $m hot_context --contexts 4096 --hot $h --first-rep 2 $H"; done
         for q in 16 64; do for r in 0 1 2; do
           add "_c16384_h2_p${q}_r$r $m hot_context --contexts 16384 --hot 2 --sweep arrival=poisson:$q --first-rep $r $H"; done; done ;;
  sessions) for b in 128 256; do for r in 0 1 2; do
              add "_agent_kv${b}_r$r $m e2e --workloads agent_sessions --sweep kv_budget=$b --first-rep $r --reps 1 --policies $peers"
            done; done
            for r in 0 1; do add "_chat_r$r $m e2e --workloads chat --first-rep $r --reps 1 --policies $peers"; done ;;
  kv) for b in 96 192 384 768; do add "_kv${b}_r01 $m kv_routing --sweep kv_budget=$b --reps 2 $R"
        add "_kv${b}_r2 $m kv_routing --sweep kv_budget=$b --first-rep 2 --reps 1 $R"; done ;;
  window-e) for w in 16 64 0; do add "_w${w}_r01 $m kv_routing --sweep window=$w --reps 2 $R"
              add "_w${w}_r01 $m e2e --sweep window=$w --reps 2 $E"; done
            for w in 16 64; do add "_w${w}_r2 $m kv_routing --sweep window=$w --first-rep 2 --reps 1 $R"; done ;;
  window-f) add "_w0_r2 $m kv_routing --sweep window=0 --first-rep 2 --reps 1 $R"
            for w in 16 64 0; do add "_w${w}_r2 $m e2e --sweep window=$w --first-rep 2 --reps 1 $E"; done ;;
  poisson-g) for q in 8 16 32; do add "_p${q}_r01 $m kv_routing --window 0 --sweep arrival=poisson:$q --reps 2 $R"
               add "_p${q}_r01 $m e2e --window 0 --sweep arrival=poisson:$q --reps 2 $E"; done
             for q in 8 16; do add "_p${q}_r2 $m kv_routing --window 0 --sweep arrival=poisson:$q --first-rep 2 --reps 1 $R"; done ;;
  poisson-h) add "_p32_r2 $m kv_routing --window 0 --sweep arrival=poisson:32 --first-rep 2 --reps 1 $R"
             for q in 8 16 32; do add "_p${q}_r2 $m e2e --window 0 --sweep arrival=poisson:$q --first-rep 2 --reps 1 $E"; done ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
if [ -n "${ONLY:-}" ]; then
  [ "$ONLY" -ge 0 ] 2>/dev/null && [ "$ONLY" -lt ${#a[@]} ] || { echo "ONLY must be 0..$((${#a[@]} - 1))" >&2; exit 2; }
  a=("0 ${a[$ONLY]#* }")
fi
if [ "${DRY:-0}" = 1 ]; then printf '%s\n' "${a[@]}"; exit 0; fi
OUT=${OUT:?set OUT to the folder the results go to} bash benchmarks/device/run_eval_parts.sh "${a[@]}"
