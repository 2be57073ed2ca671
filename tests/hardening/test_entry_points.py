"""Every public entry point refuses bad input with the documented ``ValueError`` naming the
problem (a wrong type also a ``TypeError``), before any process starts or any request runs."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmpool import LLM, SamplingParams
from lmpool.cli import demo
from lmpool.config import EngineConfig
from lmpool.engine.validation import validate_request
from lmpool.errors import ArgumentTypeError
from lmpool.frontend.llm import prepare_batch
from lmpool.frontend.api import AsyncLMPool
from lmpool.tokenizer import encode_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=2)
VOCAB = 1000


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, block_size=16) as llm:
        yield llm


@pytest.mark.parametrize("prompts, match", [
    (None, "prompts must be text, token ids, or a list of them; got NoneType"),
    (b"\x01\x02\x03", "got bytes"),
    ({"prompt": "hello"}, "got dict"),
    (7, "got int"),
    ([b"\x01\x02"], "prompt 0 must be text or a sequence of token ids, got bytes"),
    (["fine", {"text": "no"}], "prompt 1 must be text or a sequence of token ids, got dict"),
])
def test_llm_generate_refuses_what_is_neither_text_nor_token_ids(llm, prompts, match):
    with pytest.raises(TypeError, match=match):
        llm.generate(prompts, GREEDY)
    assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids  # and serves on


def test_llm_generate_after_shutdown_says_so(tiny_model):
    llm = LLM(tiny_model, block_size=16)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="this LLM was shut down"):
        llm.generate([[1, 2, 3]], GREEDY)


@pytest.mark.parametrize("kwargs, match", [
    ({"cpu_kv_cache_bytes": -1}, "cpu_kv_cache_bytes must be an integer >= 1, got -1"),
    ({"block_size": "16"}, "block_size must be an integer >= 1, got '16'"),
    ({"max_num_seqs": True}, "max_num_seqs must be an integer >= 1, got True"),
    ({"enable_prefix_caching": 1}, "enable_prefix_caching must be True or False"),
    ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization must be a number"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"dependent_launch": "on"}, "dependent_launch must be True or False"),
    ({"prefill_attention": "sdpa"}, r"prefill_attention must be one of \['lmpool', 'flash'\], got 'sdpa'"),
])
def test_engine_settings_are_checked_by_type_and_value(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=tiny_model, **kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"world_size": "2"}, TypeError, "world_size must be an integer, got '2'"),
    ({"world_size": True}, TypeError, "world_size must be an integer, got True"),
    ({"world_size": 0}, ValueError, "world_size must be an integer >= 1, got 0"),
    ({"hang_timeout": math.inf}, ValueError, "hang_timeout must be a positive number.*it must be finite"),
    ({"hang_timeout": 1e-9}, ValueError, r"hang_timeout must be a positive number.*at least 2 s \(4 heartbeat"),
    ({"hang_timeout": "soon"}, TypeError, "hang_timeout must be a positive number of seconds"),
    ({"metrics_port": 70000}, ValueError, r"metrics_port must be a TCP port in \[0, 65535\]"),
    ({"metrics_port": True}, TypeError, "metrics_port must be an integer"),
    ({"cpu_kv_cache_bytes": -1}, ValueError, "cpu_kv_cache_bytes must be an integer >= 1"),
    ({"block_size": 24}, ValueError, "block_size must be a power of two"),
])
def test_pool_settings_are_refused_before_anything_starts(tiny_model, kwargs, error, match):
    with pytest.raises(error, match=match):
        AsyncLMPool(tiny_model, **kwargs)


def test_pool_rank_and_transfer_arguments_are_checked(tiny_model):
    pool = AsyncLMPool(tiny_model, world_size=2, block_size=16)  # never started: checks come first

    async def main():
        with pytest.raises(TypeError, match="rank must be an integer or None, got True"):
            await pool.client.add_request("r", [1, 2, 3], GREEDY, rank=True)
        for prompt, match in (([], "prompt is empty"), ([1, 10**9], "outside the vocabulary"),
                              ([1, 2.5], "not an integer token id")):
            with pytest.raises(ValueError, match=match):
                await pool.client.transfer(prompt, 0, 1)
        for src, dst in ((0, 2), (True, 1), (-1, 0)):
            with pytest.raises(ValueError, match="is not a rank of this pool"):
                await pool.client.transfer([1, 2, 3], src, dst)
        with pytest.raises(ValueError, match="move must be True or False"):
            await pool.client.transfer([1, 2, 3], 0, 1, move="yes")

    asyncio.run(main())


@pytest.mark.parametrize("request_id", [5, b"r", ["r"], {"r": 1}])
def test_a_request_id_must_be_a_string(tiny_model, request_id):
    """An int was taken (its outputs named by it), a list failed as unhashable."""
    pool = AsyncLMPool(tiny_model, world_size=1, block_size=16)  # never started: checks come first

    async def main():
        with pytest.raises(ArgumentTypeError, match="request_id must be a string or None"):
            await pool.submit([1, 2, 3], GREEDY, request_id=request_id)

    asyncio.run(main())


def test_demo_refuses_a_world_size_of_zero(capsys):
    with pytest.raises(SystemExit) as exit_:
        demo(["--world-size", "0"])
    assert exit_.value.code == 2
    assert "--world-size: must be at least 1, got 0" in capsys.readouterr().err


def test_a_wrong_type_is_also_the_documented_value_error():
    assert issubclass(ArgumentTypeError, ValueError) and issubclass(ArgumentTypeError, TypeError)


PROMPTISH = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 2**40), st.floats(), st.text(max_size=3),
              st.binary(max_size=3), st.just(np.int64(5)), st.just(np.bool_(True))),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                            st.dictionaries(st.text(max_size=2), inner, max_size=2)),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(PROMPTISH)
def test_whatever_is_passed_as_prompts_is_refused_by_name_or_valid_token_ids(prompts):
    """Arbitrary objects as ``generate``'s prompts (without a tokenizer, as text needs one):
    a TypeError/ValueError, or token ids every one of which the model knows."""
    def validate(ids, params):
        validate_request(ids, params, vocab_size=VOCAB, max_model_len=4096, block_size=16, max_blocks=1 << 20)

    try:
        token_lists, _ = prepare_batch(prompts, GREEDY, lambda p: encode_prompt(None, p), validate)
    except (TypeError, ValueError):
        return
    assert all(type(t) is int and 0 <= t < VOCAB for ids in token_lists for t in ids)
