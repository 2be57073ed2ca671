"""The pool's ``stream(prompt, params, rank=...)`` over HTTP: a gateway in front of
``lmpool serve`` hosts, as ``eval_driver.replay`` drives a pool.

- A request with ``rank=None`` goes to the gateway, which picks a host. A request pinned to a
  rank (a warm-up reading a document on its own replica) goes straight to that host's URL: a
  gateway cannot be told where to send one request, so its tree and its load counts never
  see a pinned request. That is how smg behaves over HTTP; the pool, in contrast, knows
  what a pinned request left in the replica's cache.
- Prompts travel as text, the codec of ``token_text`` (smg rejects token-id prompts).
  ``prepare(trace)`` spells every prompt before the replay and checks, with the hosts'
  tokenizer, that the text encodes back to the exact token ids, so neither costs a timed
  request anything (a 32k-token prompt takes tens of milliseconds); the host's own encoding
  of the text is timed, as in any deployment that sends text. Each stream then checks the
  host's ``usage.prompt_tokens`` against the prompt's length: a host runs exactly the prompt
  the pool runs would. ``checked`` counts the requests so verified.
- The serving host is read from ``system_fingerprint`` (``lmpool-<pid>`` of the server
  process; smg passes a worker's stream through byte for byte), and ``num_cached_tokens``
  from ``usage.prompt_tokens_details.cached_tokens`` of the stream's usage chunk.

Outputs are cumulative like the pool's: each token chunk yields one, and a last one carries
the finish reason and the cached-token count.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator

import httpx

from benchmarks.peers.token_text import text_of


@dataclasses.dataclass
class Output:
    rank: int | None = None
    route: str | None = None  # "gateway" or "pinned"
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int | None = None


class GatewayClient:
    def __init__(self, gateway_url: str, host_urls: list[str], fingerprints: dict[str, int], model_name: str,
                 tokenizer) -> None:
        self.gateway_url = gateway_url
        self.host_urls = host_urls
        self.fingerprints = fingerprints  # system_fingerprint -> rank
        self.model_name = model_name
        self.tokenizer = tokenizer  # the hosts' own (the codec), to check what they will run
        self.checked = 0
        self._texts: dict[int, str] = {}  # id() of a trace's prompt list -> its codec text
        # No pool limit and no timeout: the replay's window bounds what is in flight and
        # the suite's --run-timeout bounds the run.
        self.http = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None,
                                                                        max_keepalive_connections=None))

    async def aclose(self) -> None:
        await self.http.aclose()

    def prepare(self, trace) -> None:
        """Spell every prompt of ``trace`` and check that it encodes back to its ids."""
        for req in trace.requests:
            text = text_of(req.prompt)
            if self.tokenizer.encode(text, add_special_tokens=False) != list(req.prompt):
                raise RuntimeError(f"the codec text of request {req.index} does not encode back to its token ids")
            self._texts[id(req.prompt)] = text

    def _body(self, prompt, params) -> dict:
        text = self._texts.get(id(prompt))
        if text is None:
            raise RuntimeError("a prompt that prepare() did not check")
        return {"model": self.model_name, "prompt": text, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "ignore_eos": params.ignore_eos, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}

    async def stream(self, prompt, params, rank: int | None = None) -> AsyncIterator[Output]:
        base = self.gateway_url if rank is None else self.host_urls[rank]
        out = Output(route="gateway" if rank is None else "pinned")
        usage = None
        async with self.http.stream("POST", f"{base}/v1/completions", json=self._body(prompt, params)) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:500]!r}")
            async for chunk in _events(response):
                if "error" in chunk:
                    raise RuntimeError(f"the stream failed: {chunk['error']}")
                out.rank = self._rank_of(chunk, out.rank)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
                    if choice.get("token_ids"):
                        out.token_ids = out.token_ids + list(choice["token_ids"])
                        yield dataclasses.replace(out, finish_reason=None)
        if out.rank is None:
            raise RuntimeError("no chunk of the stream named its server (system_fingerprint)")
        if rank is not None and out.rank != rank:
            raise RuntimeError(f"a request pinned to rank {rank} was served by rank {out.rank}")
        if usage is None or usage.get("prompt_tokens") != len(prompt):
            raise RuntimeError(f"the host ran {usage and usage.get('prompt_tokens')} prompt tokens, not {len(prompt)}")
        self.checked += 1
        out.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        yield out

    def _rank_of(self, chunk: dict, known: int | None) -> int | None:
        fingerprint = chunk.get("system_fingerprint")
        if fingerprint is None:
            return known
        if fingerprint not in self.fingerprints:
            raise RuntimeError(f"a response came from an unknown server {fingerprint!r}")
        rank = self.fingerprints[fingerprint]
        if known is not None and rank != known:
            raise RuntimeError("one stream's chunks came from two servers")
        return rank


async def _events(response: httpx.Response) -> AsyncIterator[dict]:
    """The JSON objects of a server-sent event stream, up to ``[DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
