"""Streaming detokenization cost (``python -m pytest benchmarks/test_bench_detokenize.py -s``).

A stream shows the cumulative text after every token. Side by side on the same token ids:
decoding the whole output again per token (what LMPool did before ``lmpool.detokenizer``)
and ``Detokenizer`` (a window of a few tokens per step). Host CPU seconds for one request's
whole stream, at several output lengths, for English text and for arbitrary token ids (what
a random-weight model emits, full of partial UTF-8). The tokenizer is the generated tiny
model's, or the one in ``LMPOOL_BENCH_TOKENIZER`` (a model directory, e.g. a real Qwen3).
Results go to ``benchmarks/results/detokenize_cpu.json`` (or ``LMPOOL_BENCH_JSON``).
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from pathlib import Path

import pytest

from lmpool.detokenizer import Detokenizer
from lmpool.model.make_model import make_model
from lmpool.tokenizer import load_tokenizer

LENGTHS = (256, 1024, 4096)
RESULT = Path(os.environ.get("LMPOOL_BENCH_JSON", Path(__file__).parent / "results" / "detokenize_cpu.json"))
ENGLISH = ("Paged attention keeps each sequence's keys and values in fixed-size blocks, so a "
           "prefix shared by many requests is stored once and reused — naïve copies cost 3× more. ")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    source = os.environ.get("LMPOOL_BENCH_TOKENIZER")
    if source is None:
        source = make_model(tmp_path_factory.mktemp("tok") / "model", preset="tiny", seed=0)
    # Named by its directory alone: a result names no machine path.
    return load_tokenizer(source), Path(source).name if "LMPOOL_BENCH_TOKENIZER" in os.environ else "generated tiny"


def full_redecode(tokenizer, ids: list[int]) -> str:
    text = ""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
    return text


def incremental(tokenizer, ids: list[int]) -> str:
    detok = Detokenizer(tokenizer)
    for token in ids:
        detok.extend([token])
    return detok.finish()


def seconds(fn, *args) -> tuple[float, str]:
    start = time.process_time()
    out = fn(*args)
    return time.process_time() - start, out


def test_detokenize_stream(tokenizer):
    tok, name = tokenizer
    sentence = tok.encode(ENGLISH, add_special_tokens=False)
    english = sentence * (max(LENGTHS) // len(sentence) + 1)
    rng = random.Random(0)
    arbitrary = [rng.randrange(len(tok)) for _ in range(max(LENGTHS))]
    rows = []
    for kind, source in (("english", english), ("arbitrary ids", arbitrary)):
        for n in LENGTHS:
            ids = source[:n]
            full_s, full_text = seconds(full_redecode, tok, ids)
            inc_s, inc_text = seconds(incremental, tok, ids)
            assert inc_text == full_text  # the same text, at a fraction of the cost
            rows.append({"text": kind, "tokens": n, "full_redecode_s": full_s, "incremental_s": inc_s,
                         "incremental_us_per_token": inc_s / n * 1e6, "speedup": full_s / inc_s})
            print(f"{kind:>13} {n:5d} tokens: full re-decode {full_s * 1e3:8.1f} ms, "
                  f"incremental {inc_s * 1e3:6.1f} ms ({inc_s / n * 1e6:5.1f} us/token), x{full_s / inc_s:.0f}")
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({
        "benchmark": "detokenize_stream", "tokenizer": name, "vocab": len(tok),
        "host": platform.processor() or platform.machine(), "timer": "process_time", "rows": rows,
    }, indent=2) + "\n")
