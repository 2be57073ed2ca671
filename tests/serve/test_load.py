"""500 concurrent streaming requests through the HTTP server, in this process (uvicorn on the
test's loop, the official ``openai`` client on the same loop): every request that is not
cancelled streams the tokens one ``LLM`` gives greedily; the cancelled ones free their blocks;
and once the client is closed the server holds no connection, task or request state more than
before."""

from __future__ import annotations

import asyncio
import os
import socket

import httpx
import openai
import pytest
import uvicorn
import uvloop
from serve_process import BLOCK, owned_shm, pool_children
from waiting import until

from lmpool import LLM, SamplingParams
from lmpool.frontend.serve.app import create_app
from lmpool.frontend.serve.settings import ServeSettings

N = 500
MAX_TOKENS = 6
CANCEL_EVERY = 5  # every fifth stream leaves after its first chunk
INSTRUCTIONS = ["You are a careful storyteller. Text: ", "You are a patient teacher. Idea: ",
                "Answer in one short line. Question: "]
PROMPTS = [f"{INSTRUCTIONS[i % 3]}item number {i} of the list" for i in range(24)]


def established(port: int) -> int:
    """Open TCP connections whose local end is ``port`` (the server's side of them)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


async def stream_one(client: openai.AsyncOpenAI, i: int) -> list[int] | None:
    """The streamed token ids of request ``i``, or None for a request this client cancels."""
    cancel = i % CANCEL_EVERY == 0
    stream = await client.completions.create(
        model="tiny", prompt=PROMPTS[i % len(PROMPTS)], stream=True, temperature=0,
        max_tokens=10 * MAX_TOKENS if cancel else MAX_TOKENS,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    tokens: list[int] = []
    async for chunk in stream:
        tokens += chunk.choices[0].model_extra["token_ids"] if chunk.choices else []
        if cancel:
            await stream.close()  # the connection closes; the server aborts the request
            return None
    return tokens


async def serve_and_load(model: str) -> dict:
    app = create_app(ServeSettings(model=model, served_model_name="tiny",
                                   pool_args={"world_size": 2, "block_size": BLOCK}))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", backlog=2 * N))
    serving = asyncio.create_task(server.serve(sockets=[sock]))

    async def started() -> bool:
        assert not serving.done(), "the server stopped"
        return server.started

    try:
        await until(started, "the server's start", limit=300)
        baseline = established(port)
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=N + 10), timeout=300)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", http_client=http,
                                    max_retries=0)
        results = await asyncio.gather(*(stream_one(client, i) for i in range(N)))
        await client.close()
        pool = app.state.pool

        async def idle() -> bool:
            stats = await pool.stats()
            return all(r["blocks_used"] == 0 and r["num_running"] == 0 and r["num_waiting"] == 0
                       for r in stats["ranks"])

        async def connections_closed() -> bool:
            return established(port) == baseline

        await until(idle, "the cancelled requests freeing their blocks", limit=120)
        await until(connections_closed, "the server's connections closing", limit=120)
        # Nothing of the load is held any more: no request in the pool's table, no connection
        # or task in the server's state.
        assert pool.client.requests == {}
        assert not server.server_state.connections and not server.server_state.tasks
        return {"results": results, "stats": await pool.stats()}
    finally:
        server.should_exit = True
        await serving
        sock.close()


@pytest.fixture
def own_leaks():
    """This process's pool leaves no process and no shared memory behind. (Counted as this
    process's children and objects, so that pools of other runs on the machine never count.)"""
    yield
    assert pool_children(os.getpid()) == [], "a pool process outlived its test"
    assert owned_shm(os.getpid()) == [], "the pool left shared memory behind"


def test_five_hundred_concurrent_streams(tiny_model, own_leaks):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    expected = [o.token_ids for o in outs]

    got = uvloop.run(serve_and_load(tiny_model))
    results = got["results"]
    for i, tokens in enumerate(results):
        if i % CANCEL_EVERY:
            assert tokens == expected[i % len(PROMPTS)], f"request {i}"
        else:
            assert tokens is None
    assert sum(r["prompt_tokens"] > 0 for r in got["stats"]["ranks"]) == 2  # both replicas served
