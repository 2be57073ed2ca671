"""Request bodies decoded in the body-parsing process give what decoding on the event loop gives:
the same status and message for every body of a corpus (bad JSON, content types, bad fields,
prompts and conversations), the same prompt, template arguments and sampling parameters for good
ones; answers in OpenAI's words, naming the field (also as ``param``), never pydantic's; a list's
errors stop at its first bad item; the prompt's pieces rebuild it exactly; a
parsing process that dies or overruns fails only its body and is replaced. On the real app, over
a stand-in pool."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pydantic
import pytest
from test_tokenize_off_loop import NotingPool

from lmpool.frontend.serve import body_parser
from lmpool.frontend.serve.app import create_app
from lmpool.frontend.serve.body import rebuild
from lmpool.frontend.serve.body_parser import BodyRefused, Decoded
from lmpool.frontend.serve.protocol import CompletionRequest, PromptList
from lmpool.frontend.serve.settings import HttpLimits, ServeSettings

JSON = "application/json"
CHAT = [{"role": "user", "content": "hi"}]


class RecordingPool(NotingPool):
    """``NotingPool`` noting what each request reached the pool with."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def encode(self, prompt) -> list[int]:
        self.seen.append(prompt)
        return super().encode(prompt)

    def encode_chat(self, messages, **template_kwargs) -> list[int]:
        self.seen.append(template_kwargs)
        return self.encode(messages)

    async def generate(self, prompt_ids, params, request_id):
        self.seen.append(params)
        return await super().generate(prompt_ids, params, request_id)


def cases() -> list[tuple[str, bytes, str | None]]:
    def j(obj) -> bytes:
        return json.dumps(obj).encode()

    completions = [
        {"prompt": "hi"}, {"prompt": [1, 2, 3]}, {"prompt": [[1, 2]]}, {"prompt": ["hi"]}, {"prompt": "hi", "user": 1},
        {"prompt": "é" * 3000, "stop": ["\n"], "temperature": 0.5, "seed": 3}, {"prompt": "hi", "max_tokens": 0},
        {"prompt": "hi", "temperature": -1}, {"prompt": "hi", "temperature": True},
        {"prompt": "hi", "temperature": "0.5"}, {"prompt": ""}, {"prompt": []}, {"prompt": ["a", "b"]},
        {"prompt": [[1], [2]]}, {"prompt": [1, "a", 2, "b"]}, {"prompt": [[1], [2, "x", "y"]]}, {"prompt": 5},
        {"prompt": None}, {}, {"messages": []}, {"prompt": "hi", "n": 2}, {"prompt": "hi", "echo": True},
        {"prompt": "hi", "logprobs": 0}, {"prompt": "hi", "n": 0}, {"prompt": "hi", "logprobs": True},
        {"prompt": "hi", "logprobs": 21}, {"prompt": "hi", "echo": True, "max_tokens": 0},
        {"prompt": ["a", [1, 2]], "n": 2}, {"prompt": "hi", "presence_penalty": 3}, {"prompt": "hi", "stop": "x" * 4097}, {"prompt": "hi", "stop": [1, "a", 2]},
        {"prompt": "hi", "stop_token_ids": ["a", 1, "b"]}, {"prompt": "hi", "cache_salt": ""},
        {"prompt": "hi", "stream_options": {"include_usage": 1}}, {"prompt": "hi", "seed": 1.5, "top_k": "x"},
        {"prompt": "hi", "model": "other"},
    ]
    chats = [
        {"messages": CHAT}, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"messages": CHAT * 3, "chat_template_kwargs": {"enable_thinking": False}, "max_completion_tokens": 5},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, {"messages": []}, {"messages": "hi"},
        {"messages": [{"content": "hi"}, {"role": 1}, {}]}, {"messages": [{"role": "user", "content": [1, {}, 2]}]},
        {"messages": CHAT, "chat_template_kwargs": {"chat_template": "x"}},
        {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, {"messages": CHAT, "max_completion_tokens": "x"},
        {"messages": CHAT, "logprobs": True, "top_logprobs": 3, "n": 2}, {"messages": CHAT, "top_logprobs": 2},
        {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, {"messages": CHAT, "repetition_penalty": 0},
    ]
    out = [("completions", j(b), JSON) for b in completions] + [("chat/completions", j(b), JSON) for b in chats]
    raw = [b"", b"  ", b"{not json", b"[1, 2", b'{"prompt": "x"} extra', b"\xff\xfe{", b"[" * 100_000, b"[]",
           b'"x"', b"5", b"null", b'{"prompt": NaN}']
    out += [("completions", body, JSON) for body in raw]
    for content_type in (None, "text/plain", "application/json; charset=utf-8", "application/vnd.lmpool+json",
                         "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        out.append(("completions", j({"prompt": "hi"}), content_type))
    return out


async def answers(app, path: str, body: bytes, content_type: str | None) -> tuple[int, tuple | None, list]:
    """Status, the error's message and param, and what reached the pool."""
    app.state.pool = pool = RecordingPool()
    headers = {"content-type": content_type} if content_type else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        response = await client.post(f"/v1/{path}", content=body, headers=headers)
    error = response.json()["error"] if response.status_code != 200 else None
    return response.status_code, error and (error["message"], error["param"]), pool.seen


def app_with(limits: HttpLimits):
    return create_app(ServeSettings(model="m", limits=limits))


async def closed(app) -> None:
    await app.state.body_parser.close()
    app.state.tokenizing.shutdown()


async def test_the_parsing_process_answers_as_the_event_loop_does():
    inline, process = app_with(HttpLimits()), app_with(HttpLimits(inline_parse_bytes=0))
    try:
        for path, body, content_type in cases():
            expected = await answers(inline, path, body, content_type)
            assert await answers(process, path, body, content_type) == expected, (path, body[:80], content_type)
    finally:
        await closed(inline)
        await closed(process)


PROMPT_TYPES = "a string, an array of integers, an array of strings or an array of arrays of integers"


async def test_the_answers_name_the_problem_in_plain_words():
    """OpenAI's wording, the field named in the message and as ``param``: never pydantic's ("Value
    error, ", "Input should be", union members such as ``list[int]``, "Invalid JSON: ")."""
    app = app_with(HttpLimits())
    try:
        for path, body, content_type, status, message, param in (
            ("completions", b'{"prompt": "hi"}', "text/plain", 415,
             "the body must be JSON (Content-Type: application/json), not 'text/plain'", None),
            ("completions", b"", JSON, 400, "the request has no body: send a JSON object", None),
            ("completions", b"[1, 2", JSON, 400,
             "The request body is not valid JSON (EOF while parsing a list at line 1 column 5).", None),
            ("completions", b"[1, 2]", JSON, 400, "The request body must be a JSON object.", None),
            ("completions", b"{}", JSON, 400, "Missing required parameter: 'prompt'.", "prompt"),
            ("completions", b'{"prompt": "hi", "n": 0}', JSON, 400, "Invalid value for 'n': n must be an integer in [1, 128], got 0.", "n"),
            ("completions", b'{"prompt": ["a", ""]}', JSON, 400, "prompt 1 is empty", None),
            ("completions", b'{"prompt": "hi", "max_tokens": 0}', JSON, 400, "max_tokens must be at least 1 (0 is allowed only with echo, for the prompt alone).", None),
            ("completions", b'{"prompt": "hi", "max_tokens": "4"}', JSON, 400,
             "Invalid type for 'max_tokens': expected an integer.", "max_tokens"),
            ("completions", b'{"prompt": {"text": "hi"}}', JSON, 400,
             f"Invalid type for 'prompt': expected {PROMPT_TYPES}.", "prompt"),
            ("completions", b'{"prompt": "hi", "stop": 5}', JSON, 400,
             "Invalid type for 'stop': expected a string or an array of strings.", "stop"),
            ("completions", b'{"prompt": "hi", "stop_token_ids": [1, "a"]}', JSON, 400,
             "Invalid type for 'stop_token_ids[1]': expected an integer.", "stop_token_ids[1]"),
            ("completions", b'{"prompt": "hi", "stream_options": {"include_usage": 1}}', JSON, 400,
             "Invalid type for 'stream_options.include_usage': expected a boolean.", "stream_options.include_usage"),
            ("chat/completions", b'{"messages": []}', JSON, 400,
             "Invalid value for 'messages': expected at least 1 item(s).", "messages"),
            ("chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', JSON, 400,
             "Invalid type for 'messages[0].content': expected a string or an array of objects.",
             "messages[0].content"),
            ("chat/completions", b'{"messages": [{"content": "hi"}]}', JSON, 400,
             "Missing required parameter: 'messages[0].role'.", "messages[0].role"),
        ):
            assert (await answers(app, path, body, content_type))[:2] == (status, (message, param)), body
        status, _, seen = await answers(app, "completions", b'{"prompt": "hi"}', None)  # no content type: JSON
        assert status == 200 and seen[0] == "hi"
    finally:
        await closed(app)


PYDANTIC_WORDS = ("Value error", "Input should", "Field required", "validation error", "JSON decode error",
                  "Invalid JSON", "list[", "[int]", "dict[", ".str", "model_type")


async def test_no_answer_is_in_pydantic_s_words():
    app = app_with(HttpLimits())
    try:
        for path, body, content_type in cases():
            status, error, _ = await answers(app, path, body, content_type)
            assert error is None or not any(w in error[0] for w in PYDANTIC_WORDS), (body[:80], error)
    finally:
        await closed(app)


def test_a_list_s_errors_stop_at_its_first_bad_item():
    """Every bad item, for each member of the union, was an error: 4 million for this 4 MB body,
    6 s and a gigabyte to build, and a 400 message of hundreds of megabytes. One per member now,
    and the message one sentence."""
    body = json.dumps({"prompt": [1] * 2_000_000 + ["a", "b"]}).encode()
    with pytest.raises(pydantic.ValidationError) as invalid:
        CompletionRequest.model_validate_json(body)
    assert invalid.value.error_count() == 4
    with pytest.raises(BodyRefused) as refused:
        body_parser.decode(CompletionRequest, JSON, body)
    assert (str(refused.value), refused.value.param) == (f"Invalid type for 'prompt': expected {PROMPT_TYPES}.",
                                                         "prompt")


@pytest.mark.parametrize("prompt", [
    "é" * (body_parser.TEXT_PIECE // 2 + 1) + "ab" * body_parser.TEXT_PIECE,  # a character split across pieces
    list(range(3 * body_parser.IDS_PIECE + 5)), [1],
    [{"role": "user", "content": str(i)} for i in range(2 * body_parser.MESSAGES_PIECE + 1)],
    PromptList(["a text", "another"]), PromptList([[1, 2, 3], list(range(body_parser.IDS_PIECE + 1))]),
])
async def test_pieces_rebuild_the_prompt(prompt):
    kind, size, pieces = body_parser.split(prompt)
    assert len(pieces) > 1 or size == 1
    rebuilt = await rebuild(Decoded(b"{}", kind, size, pieces))
    assert rebuilt == prompt and isinstance(rebuilt, PromptList) == isinstance(prompt, PromptList)


def test_a_head_over_its_limit_is_refused():
    stop_ids = list(range(body_parser.MAX_HEAD_BYTES // 4))
    job = body_parser.ParseJob("completions", JSON, json.dumps({"prompt": "hi", "stop_token_ids": stop_ids}).encode())
    reply = body_parser.answer(job)
    assert reply.status == 400 and "more than the 262144 allowed" in reply.message


async def test_a_parsing_process_that_dies_or_overruns_fails_only_its_body():
    app = app_with(HttpLimits(inline_parse_bytes=0, parse_timeout_s=60))
    parser = app.state.body_parser
    good = json.dumps({"prompt": [1, 2, 3]}).encode()
    try:
        assert (await answers(app, "completions", good, JSON))[0] == 200
        first = parser.process.pid
        os.kill(first, signal.SIGSTOP)  # overruns: the body waits past its timeout
        parser.timeout_s = 0.5
        status, error, _ = await answers(app, "completions", good, JSON)
        assert (status, error) == (413, ("the request body took longer than 0.5 s to parse", None))
        parser.timeout_s = 60
        assert (await answers(app, "completions", good, JSON))[0] == 200
        second = parser.process.pid
        assert second != first
        os.kill(second, signal.SIGKILL)
        await parser.process.wait()
        # A dead process is seen at the next body, and replaced for it.
        assert (await answers(app, "completions", good, JSON))[:2] == (200, None)
        assert parser.process.pid not in (first, second)
    finally:
        await closed(app)


async def test_a_handler_cancelled_mid_parse_leaves_the_next_body_its_own_answer():
    app = app_with(HttpLimits(inline_parse_bytes=0))
    parser = app.state.body_parser
    try:
        await parser.start()
        slow = body_parser.ParseJob("completions", JSON, json.dumps({"prompt": list(range(400_000))}).encode())
        task = asyncio.ensure_future(parser.parse(slow))
        await asyncio.sleep(0)  # under way
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        decoded = await parser.parse(body_parser.ParseJob("completions", JSON, b'{"prompt": [7, 8]}'))
        assert await rebuild(decoded) == [7, 8]
    finally:
        await closed(app)
