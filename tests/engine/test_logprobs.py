"""Logprobs of sampled and prompt tokens equal transformers' log_softmax of the same model's
logits (fp32 on CPU: a tight tolerance), serial and overlapped, through chunked prefill; a
request with prompt logprobs never starts from cached blocks; requests that do not ask get none."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM as HFQwen3

from lmpool import LLM, SamplingParams
from lmpool.engine.sequence import Sequence
from lmpool.errors import ArgumentTypeError
from lmpool.token_logprobs import MAX_LOGPROBS, TokenLogprobs

BLOCK = 16
TOLERANCE = 5e-4  # fp32 logits over a vocabulary of 151k, summed in another order than transformers
PROMPT_LENS = (1, 17, 40)


@pytest.fixture(scope="module")
def hf(tiny_model):
    return HFQwen3.from_pretrained(tiny_model, dtype=torch.float32).eval()


def reference(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' log-probabilities at every position of ``tokens`` (row p predicts token p + 1)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def check(entry: TokenLogprobs, logp_row: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - logp_row[token].item()) < TOLERANCE
    top = logp_row.topk(k)
    assert entry.top_ids == top.indices.tolist()
    assert all(abs(a - b) < TOLERANCE for a, b in zip(entry.top_logprobs, top.values.tolist()))


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("overlapped", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_transformers(tiny_model, hf, overlapped, temperature):
    # 24-token steps: the 40-token prompt prefills in chunks, one of them ending mid-prompt.
    with LLM(tiny_model, block_size=BLOCK, async_scheduling=overlapped, max_num_batched_tokens=24) as llm:
        params = SamplingParams(temperature=temperature, seed=5, max_tokens=6, ignore_eos=True, logprobs=3,
                                prompt_logprobs=2)
        outs = llm.generate(prompts(hf.config.vocab_size), params)
    for out in outs:
        tokens = out.prompt_token_ids + out.token_ids
        logp = reference(hf, tokens)
        n = len(out.prompt_token_ids)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
        for p in range(1, n):
            check(out.prompt_logprobs[p], logp[p - 1], tokens[p], 2)
        assert len(out.logprobs) == len(out.token_ids) == 6
        for i, entry in enumerate(out.logprobs):
            check(entry, logp[n + i - 1], out.token_ids[i], 3)


def test_prompt_logprobs_take_no_cached_prefix(tiny_model, hf):
    prompt = prompts(hf.config.vocab_size)[2]
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with LLM(tiny_model, block_size=BLOCK) as llm:
        llm.generate(prompt, plain)  # caches the prompt's complete blocks
        asked = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0))
        again = llm.generate(prompt, plain)
    assert asked[0].num_cached_tokens == 0
    assert again[0].num_cached_tokens == 32  # the cache itself still serves the others
    logp = reference(hf, prompt)
    for p in range(1, len(prompt)):
        check(asked[0].prompt_logprobs[p], logp[p - 1], prompt[p], 0)
    assert asked[0].logprobs is None and again[0].prompt_logprobs is None


def test_requests_that_do_not_ask_get_none(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        out = llm.generate(list(range(100, 120)), SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.logprobs is None and out.prompt_logprobs is None


def test_a_recomputed_prompt_keeps_the_logprobs_it_had():
    seq = Sequence("r", list(range(10, 16)), SamplingParams(prompt_logprobs=0), BLOCK)
    first = [TokenLogprobs(t, -1.0) for t in (11, 12)]
    seq.add_prompt_logprobs(1, first)
    assert seq.take_prompt_logprobs() is None  # incomplete: positions 3 to 5 missing
    seq.add_prompt_logprobs(1, [TokenLogprobs(t, -2.0) for t in (11, 12, 13, 14, 15)])  # preempted, computed again
    held = seq.take_prompt_logprobs()
    assert held == [None, *first, *(TokenLogprobs(t, -2.0) for t in (13, 14, 15))]
    assert seq.take_prompt_logprobs() is None  # sent once
    seq.add_prompt_logprobs(1, first)  # a recomputation after they were sent changes nothing
    assert seq.take_prompt_logprobs() is None


@pytest.mark.parametrize("field, value, error", [
    ("logprobs", MAX_LOGPROBS + 1, ValueError), ("logprobs", -1, ValueError), ("logprobs", True, ArgumentTypeError),
    ("prompt_logprobs", 2.0, ArgumentTypeError), ("presence_penalty", 2.5, ValueError),
    ("frequency_penalty", -3, ValueError), ("repetition_penalty", 0.0, ValueError),
    ("repetition_penalty", float("inf"), ValueError), ("presence_penalty", "1", ArgumentTypeError),
])
def test_bad_settings_refused(field, value, error):
    with pytest.raises(error, match=field):
        SamplingParams(**{field: value})
