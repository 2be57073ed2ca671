"""Request bodies decoded by ``body`` give what FastAPI's body parameters gave: the same status
and the same 400 message for every body of a corpus (bad JSON, bad content types, bad fields,
bad prompts and conversations), whether decoded on the event loop or in the parsing process;
a list's errors stop at its first bad item; and the parsing process's pickles rebuild what
they packed. On the real app, over a stand-in pool."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI
from test_tokenize_off_loop import NotingPool

from lmpool.frontend.serve import body_worker
from lmpool.frontend.serve.app import create_app
from lmpool.frontend.serve.errors import install_handlers
from lmpool.frontend.serve.protocol import DEFAULT_COMPLETION_TOKENS, ChatCompletionRequest, CompletionRequest
from lmpool.frontend.serve.settings import HttpLimits, ServeSettings

JSON = "application/json"
CHAT = [{"role": "user", "content": "hi"}]


def reference_app() -> FastAPI:
    """The routes as they were: FastAPI decodes the body parameter, the handler reads it."""
    app = FastAPI()
    install_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        body.single_prompt()
        body.sampling_params(DEFAULT_COMPLETION_TOKENS)
        return {}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        body.conversation()
        body.sampling_params(1)
        return {}

    return app


def cases() -> list[tuple[str, bytes, str | None]]:
    def j(obj) -> bytes:
        return json.dumps(obj).encode()

    completions = [
        {"prompt": "hi"}, {"prompt": [1, 2, 3]}, {"prompt": [[1, 2]]}, {"prompt": ["hi"]}, {"prompt": "hi", "user": 1},
        {"prompt": "hi", "max_tokens": 0}, {"prompt": "hi", "temperature": -1}, {"prompt": "hi", "temperature": True},
        {"prompt": "hi", "temperature": "0.5"}, {"prompt": ""}, {"prompt": []}, {"prompt": ["a", "b"]},
        {"prompt": [[1], [2]]}, {"prompt": [1, "a", 2, "b"]}, {"prompt": [[1], [2, "x", "y"]]}, {"prompt": 5},
        {"prompt": None}, {}, {"messages": []}, {"prompt": "hi", "n": 2}, {"prompt": "hi", "echo": True},
        {"prompt": "hi", "logprobs": 0}, {"prompt": "hi", "stop": "x" * 4097}, {"prompt": "hi", "stop": [1, "a", 2]},
        {"prompt": "hi", "stop_token_ids": ["a", 1, "b"]}, {"prompt": "hi", "cache_salt": ""},
        {"prompt": "hi", "stream_options": {"include_usage": 1}}, {"prompt": "hi", "seed": 1.5, "top_k": "x"},
    ]
    chats = [
        {"messages": CHAT}, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, {"messages": []}, {"messages": "hi"},
        {"messages": [{"content": "hi"}, {"role": 1}, {}]}, {"messages": [{"role": "user", "content": [1, {}, 2]}]},
        {"messages": CHAT, "chat_template_kwargs": {"chat_template": "x"}},
        {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, {"messages": CHAT, "max_completion_tokens": "x"},
    ]
    out = [("completions", j(b), JSON) for b in completions] + [("chat/completions", j(b), JSON) for b in chats]
    raw = [b"", b"{not json", b"[1, 2", b'{"prompt": "x"} extra', b"\xff\xfe{", b"[" * 100_000, b"[]", b'"x"',
           b"5", b"null", b'{"prompt": NaN}']
    out += [("completions", body, JSON) for body in raw]
    for content_type in (None, "text/plain", "application/json; charset=utf-8", "application/vnd.lmpool+json",
                         "application/x-www-form-urlencoded"):
        out.append(("completions", j({"prompt": "hi"}), content_type))
    return out


async def answers(app, path: str, body: bytes, content_type: str | None) -> tuple[int, str | None]:
    headers = {"content-type": content_type} if content_type else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        response = await client.post(f"/v1/{path}", content=body, headers=headers)
    message = response.json()["error"]["message"] if response.status_code != 200 else None
    return response.status_code, message


@pytest.mark.parametrize("inline", [True, False], ids=["on the loop", "in the parsing process"])
async def test_the_same_answers_as_fastapi_s_body_parameters(inline):
    limits = HttpLimits() if inline else HttpLimits(inline_parse_bytes=0)
    app = create_app(ServeSettings(model="m", limits=limits))
    app.state.pool = NotingPool()
    reference = reference_app()
    try:
        for path, body, content_type in cases():
            expected = await answers(reference, path, body, content_type)
            assert await answers(app, path, body, content_type) == expected, (path, body[:80], content_type)
    finally:
        await app.state.body_parser.close()
        app.state.tokenizing.shutdown()


async def test_a_list_s_errors_stop_at_its_first_bad_item():
    """Every bad item, for each member of the union, was an error: 4 million for this 4 MB body,
    6 s and a gigabyte to build, and a 400 message of hundreds of megabytes."""
    body = json.dumps({"prompt": [1] * 2_000_000 + ["a", "b"]}).encode()
    with pytest.raises(body_worker.BodyInvalid) as refused:
        body_worker.decode(CompletionRequest, JSON, body)
    assert str(refused.value) == ("prompt.str: Input should be a valid string; prompt.list[int].2000000: Input should "
                                  "be a valid integer; prompt.list[str].0: Input should be a valid string; "
                                  "prompt.list[list[int]].0: Input should be a valid list")


def test_pieces_rebuild_what_was_packed():
    big = {"prompt": list(range(5000)), "text": "é" * (3 * body_worker.STR_PIECE + 7),
           "nested": [{str(i): [i] * 600 for i in range(600)}, [[1, 2]] * 1500], "small": [1, {"a": "b"}]}
    assert body_worker.unpack(body_worker.pack(big)) == big
    request = body_worker.decode(ChatCompletionRequest, JSON, json.dumps(
        {"messages": CHAT * 2000, "chat_template_kwargs": {"k": list(range(3000))}, "user": "x"}).encode())
    rebuilt = body_worker.unpack(body_worker.pack(request))
    assert rebuilt.conversation() == [{"role": "user", "content": "hi"}] * 2000
    assert rebuilt.chat_template_kwargs == {"k": list(range(3000))} and rebuilt.model_extra == {}


def test_resolved_requests_keep_their_accessors_errors():
    """The prompt and the conversation are extracted when the body is decoded, and an error of
    theirs is raised where the handler asks for them (after the model name is checked)."""
    many = body_worker.decode(CompletionRequest, JSON, b'{"prompt": [[1], [2]], "model": "other"}')
    assert many.model == "other" and many.prompt == ""
    with pytest.raises(ValueError, match="one prompt per request"):
        many.single_prompt()
    chat = body_worker.decode(ChatCompletionRequest, JSON,
                              json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode())
    assert chat.messages == []
    with pytest.raises(ValueError, match="only text content parts"):
        chat.conversation()
