"""A running ``lmpool serve`` under streaming load from the official ``openai`` client.

At each concurrency level C, ``--requests-per-level`` streaming completions (random token-id
prompts, ``ignore_eos`` so each runs exactly ``--max-tokens``) are sent with at most C in
flight, after an untimed warm-up. Reported per level: requests/s and output tokens/s over
the level's wall time, TTFT (request sent to first token) and TPOT (time per output token
after the first) as mean, p50 and p99 over requests, and any failures. JSON to ``--json``; each
level's line on stdout as it ends, and a bar on stderr counting requests (``--no-progress``: none).

    lmpool serve DIR --world-size 4 --device cuda --port 8000 &
    python -m benchmarks.benchmark_serve --url http://127.0.0.1:8000 --concurrency 1,16,64,256 \\
        --json serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai

from benchmarks.lib.progress import NoBar, bar
from benchmarks.lib.progress import add_argument as add_progress_argument
from benchmarks.lib.revision import git_record

WARM_UP = 4  # untimed requests first


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default="unused")
    p.add_argument("--concurrency", default="1,8,32,128", help="comma-separated levels")
    p.add_argument("--requests-per-level", type=int, default=0,
                   help="requests at each level (default: 4 x concurrency, at least 32)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="leading prompt tokens all requests share")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--token-range", default="100,1000", help="prompt token ids are drawn from [lo, hi)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    add_progress_argument(p)
    return p.parse_args(argv)


def prompts(args, n: int, rng: random.Random) -> list[list[int]]:
    lo, hi = (int(x) for x in args.token_range.split(","))
    shared = [rng.randrange(lo, hi) for _ in range(args.shared_prefix_len)]
    rest = args.prompt_len - len(shared)
    return [shared + [rng.randrange(lo, hi) for _ in range(rest)] for _ in range(n)]


async def one(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"ttft": first - start, "tpot": (end - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens}


async def level(client, model: str, batch: list[list[int]], concurrency: int, max_tokens: int,
                shown=NoBar()) -> dict:
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt):
        async with gate:
            try:
                return await one(client, model, prompt, max_tokens)
            except (openai.APIError, httpx.HTTPError) as e:
                return {"error": f"{type(e).__name__}: {e}"}
            finally:
                shown.update()

    start = time.perf_counter()
    results = await asyncio.gather(*(gated(p) for p in batch))
    wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    return {"concurrency": concurrency, "requests": len(batch), "failed": len(batch) - len(ok),
            "errors": sorted({r["error"] for r in results if "error" in r})[:5], "wall_s": wall,
            "requests_per_s": len(ok) / wall, "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_s": summary([r["ttft"] for r in ok]), "tpot_s": summary([r["tpot"] for r in ok if r["tpot"]])}


def summary(values: list[float]) -> dict | None:
    if not values:
        return None
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"mean": statistics.fmean(ordered), "p50": pick(0.5), "p99": pick(0.99)}


async def run(args, transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """Every level against ``args.url`` (through ``transport`` when given: an app in process)."""
    levels = [int(c) for c in args.concurrency.split(",")]
    counts = [args.requests_per_level or max(32, 4 * c) for c in levels]
    rng = random.Random(args.seed)
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=max(levels) + 8), timeout=600, transport=transport)
    client = openai.AsyncOpenAI(base_url=f"{args.url}/v1", api_key=args.api_key, http_client=http, max_retries=0)
    model = (await client.models.list()).data[0].id
    out = []
    with bar(WARM_UP + sum(counts), "requests", unit="req", enabled=not args.no_progress) as shown:
        await level(client, model, prompts(args, WARM_UP, rng), WARM_UP, args.max_tokens, shown)  # untimed
        for c, n in zip(levels, counts):
            result = await level(client, model, prompts(args, n, rng), c, args.max_tokens, shown)
            shown.write(json.dumps({k: result[k] for k in ("concurrency", "requests_per_s", "output_tokens_per_s",
                                                           "ttft_s", "tpot_s", "failed")}), file=sys.stdout)
            out.append(result)
    await client.close()
    config = {k: v for k, v in vars(args).items() if k not in ("json", "api_key")}
    return {"benchmark": "serve", "model": model, "config": config, "levels": out, "git": git_record(),
            "host": platform.node()}


def main(argv=None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(lv["failed"] == 0 for lv in report["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
