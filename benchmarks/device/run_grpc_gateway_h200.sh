#!/usr/bin/env bash
# smg in gRPC mode against smg over HTTP, in front of the same two `lmpool serve --grpc-port`
# hosts sharing one H200 (2 replicas each, each replica 1/4 of the SMs under MPS), on documents
# each host read directly before the gateways saw them (benchmarks/benchmark_grpc_gateway.py).
# Usage (repository root; .whl/ and .whl-serve/ carried):
#   OUT=dir bash benchmarks/device/run_grpc_gateway_h200.sh [runner flags...]
# .whl-serve/ holds the serve and grpc extras and smg for the device's Python, fetched with
#   pip download fastapi pydantic uvicorn httptools prometheus-client pyzmq httpx smg==1.13.0 \
#     smg-grpc-proto==0.4.28 smg-grpc-servicer==0.14.1 grpcio --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform any -d .whl-serve
# then smg's wheel stripped and xz-compressed (37 MB -> 21 MB, so the call carries under 64 MiB):
#   python3 -c "from pathlib import Path; import tempfile; from benchmarks.device import pack_dynamo as p; \
#     p.LIBRARY = 'smg/smg_rs.abi3.so'; w = next(Path('.whl-serve').glob('smg-*.whl')); \
#     t = tempfile.TemporaryDirectory(); p.repack(w, Path('.whl-serve'), Path(t.name)); w.unlink()"
set -uo pipefail
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
. benchmarks/device/setup.sh
model=/tmp/qwen3-0.6b
if [ ! -f "$model/config.json" ]; then
  python3 -m lmpool.cli make-model "$model" --preset 0.6b >/dev/null || exit 1
fi
build_kernels || exit 1
python3 -m benchmarks.benchmark_grpc_gateway --model "$model" --device cuda --dtype bfloat16 --mps \
  --json "$OUT/grpc_gateway_h200_0.6b.json" "$@" 2>&1 | tee "$OUT/grpc_gateway_h200_0.6b.log"
