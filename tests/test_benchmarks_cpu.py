"""The CPU benchmarks (and the CPU diagnostic of a transfer plan's bookkeeping) run end to end and
write the JSON they promise (figures are not asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.append(str(ROOT / "tools" / "diagnostics"))  # profile_plan_bookkeeping

import benchmark_stream  # noqa: E402
import benchmark_throughput  # noqa: E402
import profile_plan_bookkeeping  # noqa: E402


def test_throughput_benchmark_writes_json(tiny_model, tmp_path):
    out = tmp_path / "tp.json"
    benchmark_throughput.main([
        "--model", tiny_model, "--num-seqs", "4", "--min-input", "8", "--max-input", "40",
        "--min-output", "4", "--max-output", "12", "--block-size", "16", "--compare-hf", "--json", str(out),
    ])
    data = json.loads(out.read_text())
    assert data["lmpool"]["output_tokens"] > 0 and data["lmpool"]["output_tok_s"] > 0
    assert data["transformers"]["output_tok_s"] > 0
    assert data["speedup_vs_transformers"] > 0
    assert data["environment"]["torch"]


def test_plan_bookkeeping_moves_a_chain_back_and_forth():
    """Every move completes (the script raises otherwise) and takes some time."""
    assert profile_plan_bookkeeping.seconds_per_move(3, block_size=16, reps=4) > 0


def test_stream_benchmark_compares_both_ways_on_the_same_texts(tiny_model, tmp_path):
    """The script raises if a stream's text is not its tokens' decode; the JSON holds every round of both."""
    out = tmp_path / "stream.json"
    benchmark_stream.main(["--model", tiny_model, "--streams", "3", "--max-tokens", "24", "--rounds", "2",
                           "--json", str(out)])
    data = json.loads(out.read_text())
    for way in benchmark_stream.WAYS:
        assert [r["tokens"] for r in data["rounds"][way]] == [3 * 24] * 2
    assert data["summary"]["ratio"]["tokens_per_s"] > 0
    assert data["streams_with_the_same_tokens_both_ways"] == [3, 3]  # CPU fp32 greedy is batch-invariant here
    assert data["config"]["model"] == "model" and data["git"]["revision"]
