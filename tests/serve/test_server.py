"""``lmpool serve`` as a process, driven over HTTP by the official ``openai`` client and by
raw requests: the OpenAI endpoints give what ``LLM`` gives, streams end with ``[DONE]``, bad
input gets a 400 body, a client that leaves aborts its request, and a pool without a live rank
answers 503 while the server stays up."""

from __future__ import annotations

import json
import os
import signal
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_process import BLOCK, busy, metric, openai_client, serving, start_server, wait_for

from lmpool import LLM, SamplingParams

PROMPT = "The harbour town woke slowly on winter mornings, and"
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        return {"text": llm.generate(PROMPT, GREEDY)[0], "chat": llm.chat(CHAT, GREEDY)[0],
                "ids": llm.generate(list(range(100, 140)), GREEDY)[0]}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with serving(tiny_model, tmp_path_factory.mktemp("serve"), "--world-size", "2",
                 "--served-model-name", "tiny") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as client:
        yield client


def greedy(**extra) -> dict:
    return {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True, "return_token_ids": True, **extra}}


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_gives_what_llm_gives(client, expected):
    out = client.completions.create(model="tiny", prompt=PROMPT, **greedy())
    choice = out.choices[0]
    assert choice.text == expected["text"].text and choice.finish_reason == "length"
    assert choice.model_extra["token_ids"] == expected["text"].token_ids
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens == len(expected["text"].prompt_token_ids)


def test_token_id_prompt(client, expected):
    out = client.completions.create(model="tiny", prompt=list(range(100, 140)), **greedy())
    assert out.choices[0].model_extra["token_ids"] == expected["ids"].token_ids


def test_chat_uses_the_chat_template(client, expected):
    out = client.chat.completions.create(model="tiny", messages=CHAT, **greedy())
    assert out.choices[0].message.content == expected["chat"].text
    assert out.choices[0].model_extra["token_ids"] == expected["chat"].token_ids


def test_streams_deliver_the_same_text_then_usage(client, expected):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **greedy()))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["text"].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    chat = list(client.chat.completions.create(model="tiny", messages=CHAT, stream=True, **greedy()))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat) == expected["chat"].text
    assert [c.choices[0].finish_reason for c in chat][-1] == "length"


def test_every_object_names_the_serving_process(server, client):
    """``system_fingerprint`` is ``lmpool-<pid>`` of the server, in whole responses and in every
    stream chunk (a gateway in front passes it through, so a client can tell hosts apart)."""
    mine = f"lmpool-{server.proc.pid}"
    assert client.completions.create(model="tiny", prompt=PROMPT, **greedy()).system_fingerprint == mine
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **greedy()))
    assert {c.system_fingerprint for c in chunks} == {mine}


def test_raw_stream_ends_with_done(server):
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_stop_string_and_seeded_sampling(client, expected):
    text = expected["text"].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    out = client.completions.create(model="tiny", prompt=PROMPT, stop=[stop], **greedy())
    assert out.choices[0].text == text[:text.index(stop)] and out.choices[0].finish_reason == "stop"
    sampled = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9,
                                         seed=7, extra_body={"top_k": 50}).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_cache_salt_is_a_string(server, client):
    out = client.completions.create(model="tiny", prompt=PROMPT, **greedy(cache_salt="tenant-a"))
    assert out.choices[0].finish_reason == "length"
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "cache_salt": 7}, timeout=60)
    assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]


@pytest.mark.parametrize("body, words", [
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": [7] * 4096, "max_tokens": 0, "echo": True}, "leaves no room in max_model_len 4096 for the one token"),
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "top_p": 2}, "top_p"),
    ({"prompt": [5000000]}, "vocabulary"),
    ({"prompt": ""}, "empty"),
    ({"prompt": ["a", ""]}, "prompt 1 is empty"),
    ({"prompt": PROMPT, "n": 0}, "n must be an integer in [1, 128]"),
    ({"prompt": ["a"] * 65, "n": 2}, "65 prompts times n=2"),
    ({"prompt": PROMPT, "max_tokens": 100000}, ""),
    ({"messages": []}, "prompt"),
    ({"prompt": PROMPT, "stop": "x" * 4097}, "4097 characters, more than the 4096 allowed"),
    ({"prompt": PROMPT, "stop": ["ab"] * 100_000}, "200000 characters"),  # searched on the event loop per token
])
def test_bad_input_is_a_400_body(server, body, words):
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 == error["code"] and words in error["message"]


@pytest.mark.parametrize("path, extra", [
    ("completions", {"top_logprobs": 2}), ("completions", {"best_of": 2}), ("completions", {"suffix": "end"}), ("completions", {"prompt_logprobs": 1}),
    ("completions", {"logit_bias": {"5": 100}}), ("completions", {"min_tokens": 4}),
    ("completions", {"skip_special_tokens": False}), ("completions", {"allowed_token_ids": [5]}),
    ("chat/completions", {"echo": True}), ("chat/completions", {"response_format": {"type": "json_object"}}),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}),
    ("chat/completions", {"chat_template": "{{ messages }}"}),
    ("chat/completions", {"chat_template_kwargs": {"chat_template": "{{ messages }}"}}),
])
def test_fields_that_would_change_the_output_are_refused_not_ignored(server, path, extra):
    """These were accepted and ignored: the caller got an answer other than the one asked for."""
    body = {"prompt": PROMPT} if path == "completions" else {"messages": CHAT}
    response = httpx.post(f"{server.url}/v1/{path}", json={**body, "max_tokens": 2, **extra}, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 == error["code"]
    assert ("its own chat template" if "chat_template_kwargs" in extra else "not supported") in error["message"]


@pytest.mark.parametrize("kwargs, words", [
    ({"messages": [{"role": "user", "content": "x"}]}, "chat template kwargs cannot set messages"),
    ({"tokenize": True}, "chat template kwargs cannot set tokenize"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools in chat_template_kwargs: not supported"),
])
def test_template_kwargs_that_the_server_sets_or_refuses_are_a_400(server, kwargs, words):
    """``messages`` there was a 500 (a TypeError: the argument twice), and ``tools`` reached the
    template although a request's own ``tools`` is refused."""
    body = {"messages": CHAT, "max_tokens": 2, "chat_template_kwargs": kwargs}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 == error["code"] and words in error["message"]


def test_template_kwargs_named_like_the_server_s_own_arguments_are_template_variables(server):
    body = {"messages": CHAT, "max_tokens": 2, "chat_template_kwargs": {"request": 1, "encode": 2}}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


def test_no_op_values_of_unsupported_fields_and_unknown_fields_are_accepted(client):
    """What clients send as defaults leaves the output unchanged, so it is served."""
    out = client.completions.create(model="tiny", prompt=PROMPT, presence_penalty=0, frequency_penalty=0.0,
                                    best_of=1, echo=False, logit_bias={}, user="u", **greedy(my_field=[1]))
    assert out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="tiny", messages=CHAT, logprobs=False, tool_choice="none", **greedy())
    assert chat.choices[0].finish_reason == "length"


def test_max_completion_tokens_wins_over_max_tokens(server):
    """OpenAI's successor field wins where a client sends both, as in vLLM (max_tokens won)."""
    body = {"messages": CHAT, "max_tokens": 2, "max_completion_tokens": 3, "ignore_eos": True}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_an_empty_model_name_is_the_served_model(server):
    """As vLLM takes it (it was a 404: "The model `` does not exist")."""
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "", "prompt": PROMPT, "max_tokens": 2},
                          timeout=60)
    assert response.status_code == 200 and response.json()["model"] == "tiny"


def test_null_stream_and_n_mean_their_defaults(server):
    """OpenAI's API documents both as nullable; they were refused as not a boolean or integer."""
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": None, "n": None}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] is not None


@pytest.mark.parametrize("value", [True, "0.5"])
def test_a_bool_or_a_string_is_not_a_temperature(server, value):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "temperature": value}, timeout=60)
    assert response.status_code == 400 and "temperature" in response.json()["error"]["message"]


def test_malformed_json_unknown_model_and_route(server):
    bad = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", timeout=60,
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    unknown = httpx.post(f"{server.url}/v1/completions", json={"model": "other", "prompt": "x"}, timeout=60)
    assert unknown.status_code == 404 and "other" in unknown.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/nothing", timeout=60).json()["error"]["code"] == 404


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_aborts_its_request(server, stream):
    """The request would run 4000 tokens; the client leaves while it runs, and the pool ends
    up idle having generated fewer tokens than that."""
    wait_for(lambda: busy(server) == 0, "an idle pool")
    before = metric(server, "lmpool:generation_tokens_total")
    body = (b'{"prompt": [1, 2, 3, 4], "max_tokens": 4000, "ignore_eos": true, "stream": %s}'
            % (b"true" if stream else b"false"))
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: busy(server) == 1, "the request running")
    wait_for(lambda: busy(server) == 0, "the request's abort")
    assert metric(server, "lmpool:generation_tokens_total") - before < 4000


def test_chat_without_max_tokens_runs_to_the_end_of_a_small_kv_cache(tiny_model, tmp_path):
    """A chat request's default length is what the context allows: where the replicas' KV cache
    holds fewer tokens than the context, that is the cache (it was the context, and every chat
    request that named no max_tokens was refused as one that could never run)."""
    server = start_server(tiny_model, tmp_path, "--world-size", "1", "--num-kv-blocks", "8")
    try:
        body = {"messages": CHAT, "ignore_eos": True, "temperature": 0}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        out = response.json()
        assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["total_tokens"] == 8 * BLOCK
    finally:
        server.stop()


def _long_request(server, stream: bool) -> list[str]:
    """The response of a request that runs until it is stopped: its body's lines."""
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 4000, "ignore_eos": True, "stream": stream}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
        return [str(response.status_code)] + [line for line in response.iter_lines() if line]


def test_sigterm_fails_running_requests_with_an_openai_error(tiny_model, tmp_path):
    """Requests still running when the grace period ends get a 503 body, or for a stream an
    in-band error and [DONE] (they were cancelled: a plain-text 500, a stream cut short)."""
    server = start_server(tiny_model, tmp_path, "--world-size", "1", "--shutdown-grace", "0")
    try:
        with ThreadPoolExecutor(2) as threads:
            whole, streamed = (threads.submit(_long_request, server, stream) for stream in (False, True))
            wait_for(lambda: busy(server) == 2, "both requests running")
            server.proc.send_signal(signal.SIGTERM)
            status, body = whole.result()
            assert status == "503" and json.loads(body)["error"]["code"] == 503
            lines = streamed.result()
            assert lines[0] == "200" and lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == 503
    finally:
        server.stop()


def test_health_and_no_live_rank_is_503(tiny_model, tmp_path):
    """Last: kills a server's only worker; the server answers 503 and serves its other routes."""
    server = start_server(tiny_model, tmp_path, "--world-size", "1")
    try:
        assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
        [worker] = server.worker_pids()
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{server.url}/health", timeout=60).status_code == 503, "the rank's death")
        for _ in range(3):
            response = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT}, timeout=60)
            assert response.status_code == 503 and response.json()["error"]["code"] == 503
        assert httpx.get(f"{server.url}/v1/models", timeout=60).status_code == 200
    finally:
        server.stop()
