"""The CPU benchmarks (and the CPU diagnostic of a transfer plan's bookkeeping) run end to end and
write the JSON they promise (figures are not asserted). Those that run longer than a few seconds
(throughput, IPC, serve) show progress on stderr while they run: a bar that ends at its total
(every token, round or request counted), and none with ``--no-progress``."""

from __future__ import annotations

import asyncio
import json
import types

import httpx
import pytest

from benchmarks import benchmark_ipc, benchmark_stream, benchmark_throughput
from lmpool.outputs import RequestOutput
from tools.diagnostics import profile_decode, profile_launch, profile_plan_bookkeeping


def finished_bar(stderr: str, desc: str, total: int) -> bool:
    """Whether ``stderr`` shows tqdm's bar ``desc`` at ``total`` of ``total``."""
    return any(line.strip().startswith(f"{desc}: 100%") and f"{total}/{total}" in line
               for line in stderr.replace("\r", "\n").splitlines())


def test_throughput_benchmark_writes_json(tiny_model, tmp_path, capsys):
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
    stderr = capsys.readouterr().err
    tokens = data["lmpool"]["output_tokens"]
    assert finished_bar(stderr, "lmpool serial", tokens) and finished_bar(stderr, "lmpool overlapped", tokens)
    assert finished_bar(stderr, "transformers", 4)


def test_no_progress_draws_no_bar(tiny_model, capsys):
    benchmark_throughput.main(["--model", tiny_model, "--num-seqs", "2", "--min-input", "8", "--max-input", "8",
                               "--min-output", "2", "--max-output", "2", "--block-size", "16", "--paths", "serial",
                               "--no-progress"])
    assert "lmpool serial" not in capsys.readouterr().err


def test_ipc_benchmark_shows_its_rounds(tmp_path, capsys):
    out = tmp_path / "ipc.json"
    benchmark_ipc.main(["--rtt-count", "20", "--warmup", "2", "--burst", "20", "--rounds", "2", "--json", str(out)])
    assert set(json.loads(out.read_text())) == {"shm_ring", "mp_queue", "mp_pipe"}
    rounds = len(benchmark_ipc.SIZES) * 3 * (2 + 1)  # each size: every transport's warm-up and rounds
    assert finished_bar(capsys.readouterr().err, "ipc", rounds)


class StreamingPool:
    """What the server's completion handler uses of a pool, streaming ``max_tokens`` tokens."""

    def __init__(self) -> None:
        rank = types.SimpleNamespace(alive=True, num_blocks=64)
        self.client = types.SimpleNamespace(max_model_len=1024, block_size=16, ranks=[rank])

    def encode(self, prompt) -> list[int]:
        return list(prompt)

    async def stream(self, prompt_ids, params, request_id):
        for n in range(1, params.max_tokens + 1):
            yield RequestOutput(request_id=request_id, prompt_token_ids=prompt_ids, token_ids=[7] * n,
                                text="x" * n, finish_reason="length" if n == params.max_tokens else None)


def test_serve_benchmark_shows_its_requests(tmp_path, capsys):
    """Against the real app over a streaming stand-in pool, in process: every request, warm-up
    included, counted on the bar; each level's line on stdout."""
    # Imported here: the serve stack and the openai client are the serve extra's and dev's, which
    # a GPU machine running only the gpu-marked tests may lack, and this module is collected there.
    from benchmarks import benchmark_serve
    from lmpool.frontend.serve.app import create_app
    from lmpool.frontend.serve.settings import ServeSettings

    app = create_app(ServeSettings(model="m", served_model_name="tiny"))
    app.state.pool = StreamingPool()
    out = tmp_path / "serve.json"
    args = ["--url", "http://serve", "--concurrency", "1,3", "--requests-per-level", "5", "--prompt-len", "8",
            "--max-tokens", "3", "--json", str(out)]
    report = asyncio.run(benchmark_serve.run(benchmark_serve.parse_args(args), httpx.ASGITransport(app=app)))
    app.state.tokenizing.shutdown()
    assert [(lv["concurrency"], lv["requests"], lv["failed"]) for lv in report["levels"]] == [(1, 5, 0), (3, 5, 0)]
    captured = capsys.readouterr()
    assert finished_bar(captured.err, "requests", benchmark_serve.WARM_UP + 2 * 5)
    assert [json.loads(line)["concurrency"] for line in captured.out.splitlines()] == [1, 3]


def test_plan_bookkeeping_moves_a_chain_back_and_forth():
    """Every move completes (the script raises otherwise) and takes some time."""
    assert profile_plan_bookkeeping.seconds_per_move(3, block_size=16, reps=4) > 0


def test_the_launch_profile_times_each_wave_s_prefill_over_the_cached_document(tiny_model, tmp_path):
    """Each wave's questions prefill only their own tokens (the document is cached), one step a
    wave, then decode until every request is done; each step's three host times are recorded."""
    out = tmp_path / "launch.json"
    profile_launch.main(["--model", tiny_model, "--context", "256", "--block-size", "16", "--waves", "3",
                         "--questions", "2", "--question-tokens", "8", "--max-tokens", "3", "--json", str(out)])
    data = json.loads(out.read_text())
    read = [s for s in data["steps"] if s["passed"] == "read"]
    steps = [s for s in data["steps"] if s["passed"] != "read"]
    assert sum(s["prefill_tokens"] for s in read) == 256 + 1  # the document and its one extra token
    assert [s["prefill_tokens"] for s in steps[:3]] == [16] * 3 and not any(s["prefill_tokens"] for s in steps[3:])
    assert steps[-1]["decode_seqs"] == 0 and sum(s["decode_seqs"] for s in steps) == 6 * 2  # 2 tokens decoded each
    assert all(s[k] >= 0 for s in steps for k in ("launch_ms", "wait_ms", "read_back_ms"))
    launches = data["prefill_launch_ms"]
    assert data["syncs"] == [] and set(launches) == {"late"} and launches["late"]["steps"] == 3
    assert launches["late"]["max"] >= launches["late"]["mean"] > 0
    assert {s["passed"] for s in steps} == {0} and data["runtime_calls"] == {} and data["allocator"] == {}
    # the sampler saw the launches, per kind of step: each row is a "file:line function" and a positive count
    stacks = data["launch_stacks"]
    assert stacks and set(stacks) <= {"read", "prefill", "decode"}
    assert all(count > 0 and ":" in where for rows in stacks.values() for where, count in rows)
    # one read-back order by default: each question's first token counted once
    assert set(data["first_token_ms"]) == {"late"} and data["first_token_ms"]["late"]["questions"] == 3 * 2


def test_profile_launch_times_first_tokens_in_both_read_back_orders(tiny_model, tmp_path):
    """Passes take the orders in turn, and each order counts each of its questions' first tokens
    once: in the step call after the question's launch, before that call's launch (early) or
    after it (late)."""
    out = tmp_path / "launch.json"
    profile_launch.main(["--model", tiny_model, "--context", "256", "--block-size", "16", "--waves", "2",
                         "--questions", "1", "--question-tokens", "8", "--max-tokens", "3", "--passes", "2",
                         "--orders", "late,early", "--json", str(out)])
    data = json.loads(out.read_text())
    assert [s["order"] for s in data["steps"] if s["passed"] != "read"][0] == "late"
    assert {s["order"] for s in data["steps"] if s["passed"] == 1} == {"early"}
    firsts = data["first_token_ms"]
    assert set(firsts) == {"late", "early"} and all(f["questions"] == 2 and f["mean"] > 0 for f in firsts.values())
    late = [s for s in data["steps"] if s["passed"] == 0]
    early = [s for s in data["steps"] if s["passed"] == 1]
    assert not late[0]["first_tokens"] and early[1]["first_tokens"] == 1 and late[1]["first_tokens"] == 1


def test_profile_launch_pieces_are_labelled_only_where_the_engine_captured_them(tiny_model, tmp_path):
    """A CPU engine captures no piecewise graphs: passes asked to run them run as the others do,
    under their order's plain label; an unknown setting is refused."""
    out = tmp_path / "launch.json"
    profile_launch.main(["--model", tiny_model, "--context", "256", "--block-size", "16", "--waves", "1",
                         "--questions", "2", "--question-tokens", "8", "--max-tokens", "2", "--passes", "2",
                         "--orders", "early", "--pieces", "on,off", "--json", str(out)])
    data = json.loads(out.read_text())
    assert {s["order"] for s in data["steps"] if s["passed"] != "read"} == {"early"}
    assert set(data["prefill_launch_ms"]) == {"early"} and data["prefill_launch_ms"]["early"]["steps"] == 2
    with pytest.raises(SystemExit):
        profile_launch.main(["--pieces", "on,maybe"])


def test_profile_launch_passes_vary_their_shapes(tiny_model, tmp_path):
    """Each pass has one question fewer a wave, so its shapes are new; a trace sums runtime calls."""
    out = tmp_path / "launch.json"
    profile_launch.main(["--model", tiny_model, "--context", "256", "--block-size", "16", "--waves", "2",
                         "--questions", "3", "--question-tokens", "8", "--max-tokens", "2", "--passes", "2",
                         "--trace", "--json", str(out)])
    steps = json.loads(out.read_text())["steps"]
    first = {p: next(s["prefill_tokens"] for s in steps if s["passed"] == p) for p in ("read", 0, 1)}
    assert first == {"read": 256 + 1, 0: 3 * 8, 1: 2 * 8}


def test_profile_decode_with_a_shared_prefix_reads_the_document_once(tiny_model, tmp_path):
    """With a shared document, every sequence but the first finds all of the document's full
    blocks in the prefix cache, and each window's steps run the whole batch."""
    out = tmp_path / "decode.json"
    profile_decode.main(["--model", tiny_model, "--batches", "3", "--context", "64", "--block-size", "16",
                         "--steps", "2", "--shared-prefix", "8", "--paths", "overlapped", "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["cached_prompt_tokens"] == 2 * 64
    assert row["batch_sizes_timed"] == row["batch_sizes_profiled"] == [3, 3]
    assert row["attention_splits"] is None  # CPU: no CUDA kernels to split


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


def test_throughput_benchmark_times_long_prefills_alone(tiny_model, tmp_path):
    """``--paths none --prefill``: only the prefill cases, a cached prefix found cached, FLOPs
    counted from the model's shape (one layer's linear and causal attention work, by hand)."""
    from benchmarks import prefill_rate
    from lmpool.model.config import ModelConfig

    out = tmp_path / "prefill.json"
    benchmark_throughput.main(["--model", tiny_model, "--paths", "none", "--prefill", "40,24:32", "--block-size",
                               "16", "--prefill-reps", "2", "--prefill-kernels", "--no-progress", "--json", str(out)])
    data = json.loads(out.read_text())
    assert "lmpool" not in data
    rows = data["prefill"]
    assert [(r["new_tokens"], r["cached_tokens"], len(r["seconds"])) for r in rows] == [(40, 0, 2), (24, 32, 2)]
    assert all(r["tflops"] > 0 for r in rows)
    assert all(r["kernels_ms"] == [] for r in rows)  # a CPU's profile has operators, no kernels
    c = ModelConfig.from_pretrained(tiny_model)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    linear = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    pairs = 24 * 32 + 24 * 25 // 2
    want = c.num_hidden_layers * (2 * linear * 24 + 4 * q * pairs) + 2 * c.hidden_size * c.vocab_size
    assert prefill_rate.prefill_flops(c, 24, 32) == want
    with pytest.raises(SystemExit):
        benchmark_throughput.main(["--model", tiny_model, "--paths", "none"])  # nothing to run


def test_a_kernel_table_keeps_the_largest_and_sums_the_rest():
    from benchmarks.lib.kernel_table import top

    kernels = {"gemm": 5.0, "attention": 3.0, "norm": 0.5, "rope": 0.25}
    assert top(kernels, 2) == [("gemm", 5.0), ("attention", 3.0), ("(the rest)", 0.75)]
    assert top(kernels, 4) == list(kernels.items()) and top({}, 3) == []
