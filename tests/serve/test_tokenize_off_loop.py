"""The server tokenizes prompts (and renders chat templates) off its event loop: a prompt of
megabytes takes seconds to tokenize, which on the loop stalled every other request's stream
and ``/health``. Checked on the real app over a stand-in pool that notes the thread it is
called on."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import httpx

from lmpool.frontend.serve.app import create_app
from lmpool.frontend.serve.settings import ServeSettings
from lmpool.outputs import RequestOutput


class NotingPool:
    """What the handlers use of ``AsyncLMPool``; ``threads`` are those encoding ran on."""

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.tokenizer = None  # logprobs name tokens by id
        rank = SimpleNamespace(alive=True, num_blocks=64)
        self.client = SimpleNamespace(max_model_len=1024, block_size=16, ranks=[rank])

    def encode(self, prompt) -> list[int]:
        self.threads.append(threading.get_ident())
        return [1, 2, 3]

    def encode_chat(self, messages, **template_kwargs) -> list[int]:
        return self.encode(messages)

    async def generate(self, prompt_ids, params, request_id):
        return RequestOutput(request_id=request_id, prompt_token_ids=prompt_ids, token_ids=[4], text="x",
                             finish_reason="length")


async def test_prompts_are_tokenized_off_the_event_loop():
    app = create_app(ServeSettings(model="m"))
    app.state.pool = pool = NotingPool()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        for path, body in (("completions", {"prompt": "hi"}),
                           ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            response = await client.post(f"/v1/{path}", json=body)
            assert response.status_code == 200, response.text
    assert len(pool.threads) == 2 and threading.get_ident() not in pool.threads
    app.state.tokenizing.shutdown()
