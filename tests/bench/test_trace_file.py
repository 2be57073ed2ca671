"""A trace file (``benchmarks/workloads/trace_file.py``): requests in phases of first appearance, text
encoded, defaults filled; every malformed line refused naming the file and line."""

from __future__ import annotations

import json

import pytest

from benchmarks.workloads.trace_file import load_trace, trace_name

VOCAB, WORLD = 100, 2


def encode(text: str) -> list[int]:
    return [ord(c) % VOCAB for c in text]


def write(tmp_path, *lines) -> object:
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def load(path, encoder=encode):
    return load_trace(path, seed=3, vocab_size=VOCAB, encode=encoder, max_tokens=7, world_size=WORLD)


def test_requests_keep_file_order_within_phases_taken_in_order_of_first_appearance(tmp_path):
    path = write(tmp_path, {"prompt": [1, 2], "phase": "b"}, "# a comment", "", {"prompt": "hi", "phase": "a"},
                 {"prompt": [3], "phase": "b", "rank": 1, "max_tokens": 2, "group": "g"}, {"prompt": [4]})
    trace = load(path)
    assert trace.workload == trace_name(path) == "trace_mine" and trace.seed == 3
    assert trace.phases == ("b", "a", "main")
    assert [(r.index, r.phase, r.prompt, r.max_tokens, r.rank, r.group) for r in trace.requests] == [
        (0, "b", [1, 2], 7, None, ""), (1, "b", [3], 2, 1, "g"), (2, "a", encode("hi"), 7, None, ""),
        (3, "main", [4], 7, None, "")]
    assert trace.params == {"file": "mine.jsonl", "requests": 4, "phases": ["b", "a", "main"],
                            "prompt_tokens": 6, "pinned": 1}


@pytest.mark.parametrize("line, reason", [
    ("{not json", "Expecting property name"),
    ([1, 2], "a request is a JSON object"),
    ({"text": "hi"}, "unknown keys"),
    ({"max_tokens": 3}, "'prompt' must be text or a list of token ids"),
    ({"prompt": []}, "the prompt is empty"),
    ({"prompt": ""}, "the prompt is empty"),
    ({"prompt": [1, VOCAB]}, r"integers in \[0, 100\), got 100"),
    ({"prompt": [1, -1]}, "got -1"),
    ({"prompt": [1, 2.5]}, "got 2.5"),
    ({"prompt": [1], "max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"prompt": [1], "max_tokens": True}, "max_tokens must be a positive integer"),
    ({"prompt": [1], "rank": WORLD}, r"rank must be an integer in \[0, 2\)"),
    ({"prompt": [1], "phase": ""}, "'phase' must be a non-empty string"),
    ({"prompt": [1], "group": 4}, "'group' a string"),
])
def test_a_malformed_line_is_refused_naming_its_line(tmp_path, line, reason):
    path = write(tmp_path, {"prompt": [1]}, "# fine so far", line)
    with pytest.raises(ValueError, match=f"^mine.jsonl:3: .*{reason}"):
        load(path)


def test_text_needs_a_tokenizer_and_a_file_needs_a_request(tmp_path):
    with pytest.raises(ValueError, match="mine.jsonl:1: a text prompt needs the model's tokenizer"):
        load(write(tmp_path, {"prompt": "hi"}), encoder=None)
    with pytest.raises(ValueError, match="mine.jsonl: no requests"):
        load(write(tmp_path, "# nothing", ""))


def test_a_bad_trace_file_stops_the_runner_before_any_pool_starts(tiny_model, tmp_path):
    from benchmarks import benchmark_e2e

    from lmpool.model.config import ModelConfig

    args = ["--quick", "--model", tiny_model, "--json", str(tmp_path / "out.json"), "--trace"]
    bad = write(tmp_path, {"prompt": [1], "rank": 5})
    with pytest.raises(SystemExit, match=r"--trace <mine.jsonl>: mine.jsonl:1: rank must be an integer in \[0, 2\)"):
        benchmark_e2e.main([*args, str(bad)])
    longest = ModelConfig.from_pretrained(tiny_model).max_context
    write(tmp_path, {"prompt": [1] * longest})  # plus the output: one token too many
    with pytest.raises(SystemExit, match=f"a request needs {longest + 4} tokens .* more than the model's {longest}"):
        benchmark_e2e.main([*args, str(bad)])
    write(tmp_path, {"prompt": [1]})
    with pytest.raises(SystemExit, match="both run as trace_mine"):
        benchmark_e2e.main([*args, str(bad), "--trace", str(bad)])
    assert not (tmp_path / "out.json").exists()


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match="^mine.jsonl: not UTF-8 text"):
        load(path)
