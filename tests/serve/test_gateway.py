"""Two ``lmpool serve`` hosts behind SGLang's model gateway (``smg``, from its pip package),
driven by the official ``openai`` client: completions, chat and streams give what one ``LLM``
gives; the gateway's cache-aware policy keeps prompts that share a prefix on one host; and a
host killed mid-run costs only its own streams, while the gateway serves on from the other.

smg consumes KV events only from gRPC workers; over HTTP its cache-aware policy keeps an
approximate prefix tree of the text it routed, which is the mode tested here.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from gateway_process import gateway_over
from serve_process import BLOCK, busy, metric, smg_binary, start_servers, wait_for

from lmpool import LLM, SamplingParams

PROMPT = "The harbour town woke slowly on winter mornings, and"
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
SHARED = "You are a careful storyteller. Continue the text below in the same voice, keep it short. Text: "


@pytest.fixture(scope="module")
def expected(tiny_model):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(tiny_model, block_size=BLOCK) as llm:
        return {"text": llm.generate(PROMPT, greedy)[0], "chat": llm.chat(CHAT, greedy)[0]}


@pytest.fixture(scope="module")
def hosts(tiny_model, tmp_path_factory):
    smg_binary()  # skip before starting anything
    tmp_path = tmp_path_factory.mktemp("hosts")
    servers = start_servers(2, tiny_model, tmp_path, "--world-size", "1", "--served-model-name", "tiny")
    with gateway_over(servers, [s.url for s in servers], tmp_path / "smg.log") as gateway:
        yield gateway, servers


GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


def prompt_tokens(server) -> float:
    return metric(server, "lmpool:prompt_tokens_total")


def settled(servers, generated: int) -> None:
    """Wait until the hosts' boards show ``generated`` tokens in all and nothing running."""
    wait_for(lambda: sum(metric(s, "lmpool:generation_tokens_total") for s in servers) >= generated
             and sum(busy(s) for s in servers) == 0, f"the hosts' boards showing {generated} tokens, idle")


def test_gateway_in_front_of_two_hosts(hosts, expected):
    gateway, servers = hosts
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    assert out.choices[0].text == expected["text"].text
    chat = client.chat.completions.create(model="tiny", messages=CHAT, **GREEDY)
    assert chat.choices[0].message.content == expected["chat"].text
    stream = client.completions.create(model="tiny", prompt=PROMPT, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected["text"].text
    chat_stream = client.chat.completions.create(model="tiny", messages=CHAT, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices) == expected["chat"].text

    # Cache-aware: once one host has served the shared prefix, the others follow it there.
    # The counters are read once the hosts' boards show every token generated so far (8 from
    # each request above, 2 from each below): an idle board can be one published before the
    # last requests began, and would leave their prompts to be counted as the prefix's.
    settled(servers, 4 * GREEDY["max_tokens"])
    before = [prompt_tokens(s) for s in servers]
    for i in range(4):
        client.completions.create(model="tiny", prompt=f"{SHARED}story number {i}.", max_tokens=2,
                                  extra_body={"ignore_eos": True})
    settled(servers, 4 * GREEDY["max_tokens"] + 4 * 2)
    grew = [prompt_tokens(s) > b for s, b in zip(servers, before)]
    assert grew.count(True) == 1, f"prefix-sharing prompts were spread over the hosts: {grew}"


def test_a_host_killed_mid_run(hosts):
    """Last in this module: it kills the first host."""
    gateway, servers = hosts
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(i: int) -> str:
        try:
            text = ""
            stream = await client.completions.create(model="tiny", prompt=f"request {i}: {PROMPT}", max_tokens=200,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                text += chunk.choices[0].text if chunk.choices else ""
            return "done"
        except (openai.APIError, httpx.HTTPError):
            return "failed"

    async def run() -> list[str]:
        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        loop = asyncio.get_running_loop()
        # Kill a host once both hosts are serving streams of this run.
        await loop.run_in_executor(None, wait_for, lambda: busy(servers[0]) > 0 and busy(servers[1]) > 0,
                                   "both hosts busy")
        await loop.run_in_executor(None, servers[0].kill)
        results = list(await asyncio.gather(*tasks))
        # The gateway serves on from the host that is left.
        after = [await client.completions.create(model="tiny", prompt=f"after {i}", max_tokens=4)
                 for i in range(6)]
        assert all(a.choices[0].finish_reason == "length" for a in after)
        await client.close()
        return results

    results = asyncio.run(run())
    assert "done" in results, results  # the surviving host's streams finished
    assert httpx.get(f"{servers[1].url}/health", timeout=60).status_code == 200
