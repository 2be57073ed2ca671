"""smg in gRPC mode (``--worker-urls grpc://...``) in front of two ``lmpool serve --grpc-port``
hosts, driven by the official ``openai`` client: completions, chat and streams give one ``LLM``'s
tokens; smg registers the hosts as vLLM engines and reads their loads; its cache-aware routes
follow the hosts' KV events (a prefix cached on a host directly, never routed by the gateway,
draws the prompts that share it to that host); a bounded load of concurrent streams, some
cancelled, completes with the right tokens and leaves the hosts holding no block; a host killed
mid-run costs only its own streams, and once restarted the gateway hears its events again.

The waits read the state they need: smg's ``smg_kv_event_blocks_total`` (blocks it applied from
a host's stream), the hosts' boards (``lmpool:prompt_tokens_total``, requests running).
"""

from __future__ import annotations

import asyncio
import glob
import os
import random
import tempfile

import httpx
import openai
import pytest
from gateway_process import Gateway, gateway_over
from grpc_hosts import channel, loads, start_grpc_hosts, stub
from serve_process import BLOCK, ServerProcess, busy, metric, smg_binary, wait_for

from lmpool import LLM, SamplingParams

PROMPT = "The harbour town woke slowly on winter mornings, and"
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
LOAD_PROMPTS = [f"Story {i}: the lighthouse keeper counted the ships that passed, and" for i in range(8)]


@pytest.fixture(scope="module")
def expected(tiny_model):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(tiny_model, block_size=BLOCK) as llm:
        text = llm.generate(PROMPT, greedy)[0].text
        stop = text[len(text) // 2:len(text) // 2 + 2]  # a stop string the output shows half way
        stopped = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop]))[0]
        return {"text": text, "chat": llm.chat(CHAT, greedy)[0].text, "stop": stop, "stopped": stopped.text,
                "load": [out.text for out in llm.generate(LOAD_PROMPTS, greedy)]}


@pytest.fixture(scope="module")
def hosts(tiny_model, tmp_path_factory):
    smg_binary()  # skip before starting anything
    tmp = tmp_path_factory.mktemp("grpc-hosts")
    servers = start_grpc_hosts(2, tiny_model, tmp, "--world-size", "2", "--served-model-name", "tiny")
    with gateway_over(servers, [s.grpc_url for s in servers], tmp / "smg.log") as gateway:
        yield gateway, servers, tmp


def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=300)


def prompt_tokens(servers) -> list[float]:
    return [metric(s, "lmpool:prompt_tokens_total") for s in servers]


def test_through_smg_the_tokens_of_one_llm(hosts, expected):
    gateway, _, _ = hosts
    c = client(gateway)
    assert c.completions.create(model="tiny", prompt=PROMPT, **GREEDY).choices[0].text == expected["text"]
    chat = c.chat.completions.create(model="tiny", messages=CHAT, **GREEDY)
    assert chat.choices[0].message.content == expected["chat"]
    stream = c.completions.create(model="tiny", prompt=PROMPT, stream=True, **GREEDY)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == expected["text"]
    chat_stream = c.chat.completions.create(model="tiny", messages=CHAT, stream=True, **GREEDY)
    assert "".join(ch.choices[0].delta.content or "" for ch in chat_stream if ch.choices) == expected["chat"]
    stopped = c.completions.create(model="tiny", prompt=PROMPT, stop=[expected["stop"]], **GREEDY).choices[0]
    assert (stopped.text, stopped.finish_reason) == (expected["stopped"], "stop")


def test_smg_reads_the_hosts_as_vllm_engines_with_their_loads(hosts):
    gateway, servers, _ = hosts

    def loads_read() -> bool:
        workers = gateway.workers()
        return all(w["runtime_type"] == "vllm" and w["connection_mode"] == "grpc"
                   and w.get("engine_load", {}).get("loads")
                   and w["engine_load"]["loads"][0]["max_total_num_tokens"] > 0 for w in workers.values())

    wait_for(loads_read, "smg's reading of the hosts' loads")


def cache_on(gateway: Gateway, server: ServerProcess, prefix: str) -> None:
    """Serve ``prefix`` on ``server`` directly (not through the gateway), and wait until the
    gateway has applied the blocks it cached from the host's KV-event stream."""
    before = gateway.metric("smg_kv_event_blocks_total", worker=server.grpc_url, op="stored")
    body = {"prompt": prefix, "max_tokens": 1}
    out = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    blocks = out["usage"]["prompt_tokens"] // BLOCK
    assert blocks >= 3
    wait_for(lambda: gateway.metric("smg_kv_event_blocks_total", worker=server.grpc_url, op="stored")
             >= before + blocks, "the gateway's reading of the host's KV events")


def routed_through(gateway: Gateway, servers, prefix: str, n: int = 4) -> list[bool]:
    """Send ``n`` prompts sharing ``prefix`` through the gateway, one at a time; which hosts
    computed prompts (their boards read once every prompt token sent is counted)."""
    before = prompt_tokens(servers)
    sent = 0
    for i in range(n):
        out = client(gateway).completions.create(model="tiny", prompt=f"{prefix} Part {i}.", max_tokens=1)
        sent += out.usage.prompt_tokens
    wait_for(lambda: sum(prompt_tokens(servers)) >= sum(before) + sent, "the hosts' boards counting the prompts")
    return [after > b for after, b in zip(prompt_tokens(servers), before)]


@pytest.mark.parametrize("target", [1, 0])
def test_routes_follow_the_hosts_kv_events(hosts, target):
    gateway, servers, _ = hosts
    prefix = (f"Host {target} alone has read this: a long instruction about tides, harbours and the "
              f"keeping of lights along a rocky coast, repeated so that it fills several blocks. ") * 2
    cache_on(gateway, servers[target], prefix)
    before = gateway.branches()
    grew = routed_through(gateway, servers, prefix)
    branches = {b: n - before[b] for b, n in gateway.branches().items() if n > before[b]}
    assert grew == [i == target for i in range(2)], \
        f"the prompts went to {grew}, not host {target} alone; the gateway's decisions: {branches}"
    assert branches == {"event_hit": 4}


def test_a_bounded_load_with_cancellations(hosts, expected):
    """300 concurrent streams through the gateway, one in five cancelled after its first chunk:
    every other one gives one ``LLM``'s text; then the hosts run nothing and hold no block."""
    gateway, servers, _ = hosts
    ac = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=600)

    async def one(i: int) -> str | None:
        k = i % len(LOAD_PROMPTS)
        stream = await ac.completions.create(model="tiny", prompt=LOAD_PROMPTS[k], stream=True, **GREEDY)
        text = ""
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            if i % 5 == 0:
                await stream.close()  # a client that goes away mid-stream
                return None
        assert text == expected["load"][k], f"stream {i}"
        return text

    async def run():
        order = list(range(300))
        random.Random(0).shuffle(order)
        try:
            return await asyncio.gather(*(one(i) for i in order))
        finally:
            await ac.close()

    results = asyncio.run(run())
    assert sum(r is not None for r in results) == 240
    for server in servers:
        wait_for(lambda: busy(server) == 0, "the host idle again")
        ch = channel(server)
        try:
            wait_for(lambda: loads(stub(ch))[0].num_used_tokens == 0, "the host holding no block for a request")
        finally:
            ch.close()


def test_a_host_killed_mid_run_then_restarted(hosts, tiny_model):
    """Last in this module: it kills a host, and starts it again on its ports."""
    gateway, servers, tmp = hosts
    ac = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i: int) -> str:
        try:
            stream = await ac.completions.create(model="tiny", prompt=f"request {i}: {PROMPT}", max_tokens=1000,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
            async for _ in stream:
                pass
            return "done"
        except (openai.APIError, httpx.HTTPError):
            return "failed"

    async def run() -> tuple[list[str], int, int]:
        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        loop = asyncio.get_running_loop()
        # Kill a host once all eight streams are running there: one serving some of them when
        # each host serves some (smg balances by load, but a loaded machine may see it send all
        # eight to one), else the idle one, whose death must then cost nothing.
        await loop.run_in_executor(None, wait_for, lambda: busy(servers[0]) + busy(servers[1]) == 8,
                                   "eight streams on the hosts", 300.0)
        counts = [busy(server) for server in servers]
        victim = 0 if all(counts) else counts.index(min(counts))
        await loop.run_in_executor(None, servers[victim].kill)
        results = list(await asyncio.gather(*tasks))
        await ac.close()
        return results, victim, counts[victim]

    results, victim, on_killed = asyncio.run(run())
    assert results.count("failed") <= on_killed and "done" in results, results
    # The gateway serves on from the other host.
    assert client(gateway).completions.create(model="tiny", prompt=PROMPT, max_tokens=4).choices[0].finish_reason

    # The host restarts on its ports: the gateway sees it healthy again and hears its KV events
    # (a new stream: smg's old position is not this host's, so it reads the state afresh).
    killed = servers[victim]
    reborn = ServerProcess(tiny_model, "--world-size", "2", "--served-model-name", "tiny", "--grpc-port",
                           str(killed.grpc_port), log=tmp / "serve-reborn.log", port=killed.port)
    reborn.grpc_port, reborn.grpc_url = killed.grpc_port, killed.grpc_url
    servers[victim] = reborn  # stopped by the fixture
    reborn.wait_ready()
    # The killed host's private KV-event sockets were swept by the restart.
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"lmpool-kv-{killed.proc.pid}-*"))
    wait_for(lambda: gateway.workers()[reborn.grpc_url]["is_healthy"], "the gateway's health check of the restart")
    prefix = ("After the restart: the keeper wrote the names of the ships in a ledger, one line each, "
              "and read them back at night. ") * 2
    cache_on(gateway, reborn, prefix)
    assert routed_through(gateway, servers, prefix) == [rank == victim for rank in range(2)]
