#!/usr/bin/env bash
# lmpool serve with 4 replicas on the device's GPU(s) under streaming load from the openai
# client (benchmarks/benchmark_serve.py): start the server, run the benchmark, stop the server.
# Usage (repository root; the serve extra's wheels for the device's Python in .whl/):
#   OUT=results_dir bash benchmarks/device/run_serve_h200.sh
set -uo pipefail
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
. benchmarks/device/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
build_kernels || { echo "kernel build failed" >&2; exit 1; }
MODEL=/tmp/qwen3-0.6b
[ -f "$MODEL/config.json" ] || timeout 300 python3 -m lmpool.cli make-model "$MODEL" --preset 0.6b
PORT=8000
python3 -m lmpool.cli serve "$MODEL" --world-size 4 --device cuda --dtype bfloat16 --served-model-name qwen3-0.6b \
  --port $PORT --log-level warning >"$OUT/serve.log" 2>&1 &
SERVER=$!
# SIGTERM stops the server gracefully, which shuts its pool down.
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER' EXIT
python3 - "$PORT" "$SERVER" <<'PY' || { tail -30 "$OUT/serve.log"; exit 1; }
import os, sys, time, urllib.request
port, server = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 240
while time.monotonic() < deadline:
    os.kill(server, 0)  # raises once the server has exited
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit("the server never became healthy")
PY
timeout 240 python3 -m benchmarks.benchmark_serve --url "http://127.0.0.1:$PORT" --concurrency 1,16,64,256 \
  --prompt-len 512 --max-tokens 128 --json "$OUT/serve_h200_4x.json" 2>&1 | tee "$OUT/serve_bench.log"
