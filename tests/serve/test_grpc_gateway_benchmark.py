"""``benchmarks/benchmark_grpc_gateway.py`` end to end on the tiny model (two hosts, both gateways):
every request answered, the repetitions in ABBA order, the hosts' counters counting each burst,
the gRPC gateway's index holding each run's documents before its burst, every process stopped."""

from __future__ import annotations

import json
import signal

from serve_process import smg_binary

from benchmarks.benchmark_grpc_gateway import main


def test_the_grpc_gateway_benchmark(tiny_model, tmp_path):
    smg_binary()  # skip before starting anything
    out = tmp_path / "grpc_gateway.json"
    main(["--model", tiny_model, "--block-size", "16", "--num-kv-blocks", "512", "--documents", "2",
          "--document-tokens", "64", "--questions", "3", "--question-tokens", "8", "--max-tokens", "4",
          "--reps", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [(r["rep"], r["mode"]) for r in result["runs"]] == [(0, "grpc"), (0, "http"), (1, "http"), (1, "grpc")]
    for r in result["runs"]:
        assert (r["requests"], r["failed"], r["counters_complete"]) == (6, 0, True), r
        assert sum(r["prompt_tokens_by_host"]) >= 6 * 64
        blocks = r["gateway_stored_blocks"]
        assert all(read - before >= n for read, before, n in zip(blocks["read"], blocks["before"], blocks["expected"]))
        assert blocks["expected"] == [t // 16 for t in r["document_tokens"]]  # document d on host d
    assert {"requests_per_s", "ttft_mean_s", "cached_fraction"} <= set(result["summary"]["grpc_over_http"])
    # The gateways stop cleanly; a host's uvicorn re-raises the SIGTERM it drained on.
    codes = result["exit_codes"]
    assert (codes["smg-grpc"], codes["smg-http"]) == (0, 0)
    assert all(codes[f"host-{h}"] in (0, -signal.SIGTERM) for h in range(2))
