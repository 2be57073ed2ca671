"""What vLLM's clients and evaluation harnesses ask ``lmpool serve`` for, driven by the ``openai``
client against a real server of two replicas (started with vLLM's flag names): ``n`` choices,
lists of prompts, logprobs of completions and chat, ``echo`` with logprobs for a loglikelihood
request (``max_tokens`` 0 and 1), penalties, streams of several choices, ``/tokenize``,
``/detokenize`` and ``/version``; each equal to what ``LLM`` gives, bad values a 400 naming them."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest
from serve_process import BLOCK, openai_client, serving

from lmpool import LLM, SamplingParams

PROMPT = "The harbour town woke slowly on winter mornings, and"
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
TOLERANCE = 1e-4  # the same fp32 engine; only the batch around a request differs
CONTEXT, CONTINUATIONS = list(range(200, 230)), (list(range(40, 46)), list(range(900, 904)))


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with serving(tiny_model, tmp_path_factory.mktemp("serve"), "--data-parallel-size", "2", "--seed", "3",
                 "--served-model-name", "tiny", "--enable-version-route") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as client:
        yield client


def greedy(n: int = 8, **extra) -> dict:
    return {"temperature": 0, "max_tokens": n, "extra_body": {"ignore_eos": True, "return_token_ids": True, **extra}}


def close(got: list, expected: list) -> bool:
    return len(got) == len(expected) and all(
        (g is None and e is None) or abs(g - e) < TOLERANCE for g, e in zip(got, expected))


def test_the_vllm_flag_names_started_two_replicas(server):
    info = httpx.get(f"{server.url}/server_info", timeout=60).json()
    assert info["ranks"] == 2 == info["live_ranks"]


def test_completion_logprobs_equal_llm_s(client, llm):
    expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3))[0]
    choice = client.completions.create(model="tiny", prompt=PROMPT, logprobs=3, **greedy()).choices[0]
    lp = choice.logprobs
    assert choice.model_extra["token_ids"] == expected.token_ids
    assert lp.tokens == [llm.tokenizer.decode([t]) for t in expected.token_ids]
    assert close(lp.token_logprobs, [e.logprob for e in expected.logprobs])
    for top, entry, token in zip(lp.top_logprobs, expected.logprobs, lp.tokens):
        names = {llm.tokenizer.decode([i]) for i in entry.top_ids}
        assert set(top) == names | {token} and abs(top[token] - entry.logprob) < TOLERANCE
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]


def test_streamed_logprobs_are_the_whole_response_s_in_pieces(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, logprobs=2, **greedy()).choices[0].logprobs
    chunks = [c.choices[0] for c in client.completions.create(model="tiny", prompt=PROMPT, logprobs=2, stream=True,
                                                              **greedy())]
    pieces = [c.logprobs for c in chunks if c.logprobs is not None]
    assert sum((p.tokens for p in pieces), []) == whole.tokens
    assert close(sum((p.token_logprobs for p in pieces), []), whole.token_logprobs)
    assert sum((p.text_offset for p in pieces), []) == whole.text_offset


def test_chat_logprobs_equal_llm_s(client, llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    expected = llm.chat(CHAT, params)[0]
    out = client.chat.completions.create(model="tiny", messages=CHAT, logprobs=True, top_logprobs=2, **greedy())
    content = out.choices[0].logprobs.content
    assert close([c.logprob for c in content], [e.logprob for e in expected.logprobs])
    for item, entry in zip(content, expected.logprobs):
        assert item.token == llm.tokenizer.decode([entry.token_id]) and item.bytes == list(item.token.encode())
        assert [t.token for t in item.top_logprobs] == [llm.tokenizer.decode([i]) for i in entry.top_ids]
    plain = client.chat.completions.create(model="tiny", messages=CHAT, **greedy())
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_a_loglikelihood_request_as_evaluation_harnesses_send_it(server, llm, max_tokens):
    """lm-evaluation-harness's completions model scores a continuation by echoing context +
    continuation with logprobs=1 and reading the continuation's token logprobs and whether each
    was the greedy choice."""
    prompts = [CONTEXT + c for c in CONTINUATIONS]
    body = {"model": "tiny", "prompt": prompts, "echo": True, "max_tokens": max_tokens, "logprobs": 1,
            "temperature": 0, "seed": 1234}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    reference = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    assert [c["index"] for c in response["choices"]] == [0, 1]
    for choice, prompt, ref in zip(response["choices"], prompts, reference):
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["tokens"]) == len(prompt) + max_tokens == len(lp["token_logprobs"])
        assert close(lp["token_logprobs"][1:len(prompt)], [e.logprob for e in ref.prompt_logprobs[1:]])
        continuation = slice(len(CONTEXT), len(prompt))
        loglikelihood = sum(lp["token_logprobs"][continuation])
        assert abs(loglikelihood - sum(e.logprob for e in ref.prompt_logprobs[continuation])) < 1e-3
        is_greedy = all(max(top, key=top.get) == token for token, top in
                        zip(lp["tokens"][continuation], lp["top_logprobs"][continuation]))
        assert is_greedy == all(e.top_ids[0] == e.token_id for e in ref.prompt_logprobs[continuation])
        assert choice["text"].startswith(llm.decode(prompt)) and choice["finish_reason"] == "length"
    assert response["usage"]["completion_tokens"] == 2 * max_tokens
    assert response["usage"]["prompt_tokens"] == sum(map(len, prompts))


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_an_echoed_stream_is_the_whole_response_in_pieces(client, max_tokens):
    args = dict(model="tiny", prompt=PROMPT, echo=True, logprobs=1, temperature=0, max_tokens=max_tokens)
    whole = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **args)]
    assert "".join(c.text for c in chunks) == whole.text and whole.text.startswith(PROMPT)
    pieces = [c.logprobs for c in chunks if c.logprobs is not None]
    assert sum((p.tokens for p in pieces), []) == whole.logprobs.tokens
    assert close(sum((p.token_logprobs for p in pieces), []), whole.logprobs.token_logprobs)
    assert chunks[-1].finish_reason == whole.finish_reason == "length"


def test_chat_with_n_gives_n_messages(client, llm):
    out = client.chat.completions.create(model="tiny", messages=CHAT, n=2, **greedy(5))
    expected = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.message.content for c in out.choices] == [expected.text] * 2
    assert out.usage.completion_tokens == 10 and out.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_n_seeded_choices_are_those_of_seed_plus_j(client, llm):
    out = client.completions.create(model="tiny", prompt=PROMPT, n=3, seed=11, temperature=1.0, max_tokens=8,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    for j, choice in enumerate(out.choices):
        expected = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=11 + j, max_tokens=8, ignore_eos=True))
        assert choice.model_extra["token_ids"] == expected[0].token_ids
    assert len({tuple(c.model_extra["token_ids"]) for c in out.choices}) > 1
    assert out.usage.prompt_tokens == len(expected[0].prompt_token_ids) and out.usage.completion_tokens == 24


def test_a_list_of_prompts_with_n_gives_each_prompt_s_choices_in_order(client, llm):
    prompts = [PROMPT, "Another morning", "A third"]  # OpenAI's API: texts or token-id lists, not mixed
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    out = client.completions.create(model="tiny", prompt=prompts, n=2, **greedy(6))
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.model_extra["token_ids"] for c in out.choices] == [e.token_ids for e in expected for _ in range(2)]
    assert out.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)


def test_a_stream_of_several_choices_interleaves_them_by_index(client, llm):
    prompts = [PROMPT, "Another morning"]
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    texts, finished = defaultdict(str), {}
    chunks = list(client.completions.create(model="tiny", prompt=prompts, n=2, stream=True,
                                            stream_options={"include_usage": True}, **greedy(6)))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert dict(texts) == {i: expected[i // 2].text for i in range(4)}
    assert finished == dict.fromkeys(range(4), "length")
    assert chunks[-1].usage.completion_tokens == 24
    chat = list(client.chat.completions.create(model="tiny", messages=CHAT, n=2, stream=True, **greedy(4)))
    roles = [c.choices[0].index for c in chat if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]  # each choice's first chunk names the role


def test_penalties_give_llm_s_penalized_tokens(client, llm):
    settings = dict(presence_penalty=0.5, frequency_penalty=0.3)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.2, **settings)
    expected = llm.generate(PROMPT, params)[0]
    out = client.completions.create(model="tiny", prompt=PROMPT, **settings, **greedy(10, repetition_penalty=1.2))
    assert out.choices[0].model_extra["token_ids"] == expected.token_ids
    chat = client.chat.completions.create(model="tiny", messages=CHAT, **settings, **greedy(10, repetition_penalty=1.2))
    assert chat.choices[0].model_extra["token_ids"] == llm.chat(CHAT, params)[0].token_ids


@pytest.mark.parametrize("path, extra, words", [
    ("completions", {"logprobs": 21}, "logprobs must be an integer in [0, 20], got 21"),
    ("completions", {"logprobs": True}, "a number of alternatives per token"),
    ("completions", {"max_tokens": 0}, "0 is allowed only with echo"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0"),
    ("completions", {"n": 129}, "n must be an integer in [1, 128]"),
    ("completions", {"seed": 2**64 - 1, "n": 2}, "seed must lie in"),  # choice 1's seed + 1 is out of range
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 30}, "top_logprobs must be an integer in [0, 20]"),
    ("chat/completions", {"logprobs": 1}, "logprobs"),
])
def test_bad_values_are_a_400_naming_them(server, path, extra, words):
    body = {"prompt": PROMPT} if path == "completions" else {"messages": CHAT}
    response = httpx.post(f"{server.url}/v1/{path}", json={**body, "max_tokens": 2, **extra}, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 == error["code"] and error["type"] == "BadRequestError"
    assert words in error["message"]


def test_tokenize_and_detokenize(server, llm):
    tokenized = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": PROMPT,
                                                          "return_token_strs": True}, timeout=60).json()
    ids = llm.encode(PROMPT)
    assert tokenized["tokens"] == ids and tokenized["count"] == len(ids)
    assert tokenized["token_strs"] == llm.tokenizer.convert_ids_to_tokens(ids)
    assert tokenized["max_model_len"] == llm.engine.max_model_len
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}, timeout=60).json()
    assert chat["tokens"] == llm.chat(CHAT, SamplingParams(max_tokens=1))[0].prompt_token_ids
    assert chat["token_strs"] is None
    back = httpx.post(f"{server.url}/detokenize", json={"model": "tiny", "tokens": ids}, timeout=60).json()
    assert back == {"prompt": PROMPT}


@pytest.mark.parametrize("path, body, words", [
    ("tokenize", {}, "give either a prompt or messages"),
    ("tokenize", {"prompt": "a", "messages": CHAT}, "give either a prompt or messages"),
    ("tokenize", {"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt=false is not supported"),
    ("detokenize", {"tokens": [1, 10**7]}, "token 10000000 at position 1 is outside the vocabulary"),
    ("detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenizer_requests_are_a_400(server, path, body, words):
    response = httpx.post(f"{server.url}/{path}", json=body, timeout=60)
    assert response.status_code == 400 and words in response.json()["error"]["message"]


def test_version(server):
    response = httpx.get(f"{server.url}/version", timeout=60)
    assert response.status_code == 200 and isinstance(json.loads(response.text)["version"], str)
