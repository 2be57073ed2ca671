"""What streaming text costs the application that embeds a pool: two ways side by side.

N concurrent ``AsyncLMPool.stream`` calls, each greedy with ``ignore_eos`` for M tokens,
against one pool; timed rounds alternate how each partial output's text is produced:
``incremental`` is the pool's ``Detokenizer`` (``lmpool.detokenizer``), ``whole`` stands in
for what LMPool did before it: decode the whole output again for every token. Every round
streams the same prompts after an untimed warm-up round, so both see the same cached
prefixes, and every stream's final text must be the whole decode of its tokens. Reported per way (medians over rounds): wall
seconds, output tokens/s, and the CPU seconds of this process (the event loop that consumes
the streams; workers and the control plane are other processes) per 1,000 output tokens.

    python -m benchmarks.benchmark_stream --preset tiny --streams 8 --max-tokens 256
    python -m benchmarks.benchmark_stream --model DIR --device cuda --dtype bfloat16 \\
        --streams 64 --max-tokens 2048 --json stream.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import uvloop

import lmpool.frontend.output_processor as pool_api
from lmpool.model.config import ModelConfig
from lmpool.model.make_model import make_model
from lmpool.frontend.api import AsyncLMPool
from lmpool.sampling_params import SamplingParams
from benchmarks.lib.revision import git_record

WAYS = ("whole", "incremental")


class WholeDecode:
    """The ``Detokenizer`` interface, decoding every token id so far on every call."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self._ids, self.text = tokenizer, [], ""

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    def extend(self, token_ids) -> str:
        self._ids.extend(token_ids)
        self.text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        return self.text

    def finish(self) -> str:
        return self.text


async def one_round(pool: AsyncLMPool, prompts: list[list[int]], params: SamplingParams) -> tuple[dict, list]:
    """The round's figures and each stream's final ``(token_ids, text)``."""
    async def one(prompt: list[int]) -> tuple[list[int], str]:
        last = None
        async for last in pool.stream(prompt, params):
            pass
        return last.token_ids, last.text

    cpu, wall = time.process_time(), time.perf_counter()
    outs = await asyncio.gather(*(one(p) for p in prompts))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(ids) for ids, _ in outs)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "cpu_s": cpu, "cpu_ms_per_1k_tokens": cpu / tokens * 1e6}, outs


async def run(args: argparse.Namespace, model: str) -> dict:
    vocab = ModelConfig.from_pretrained(model).vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.streams)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rounds: dict[str, list[dict]] = {way: [] for way in WAYS}
    same_tokens = []  # per timed round pair: streams whose tokens matched the other way's
    original = pool_api.Detokenizer
    async with AsyncLMPool(model, world_size=args.world_size, device=args.device, dtype=args.dtype,
                           max_num_seqs=max(args.streams, 1)) as pool:
        await one_round(pool, prompts, params)  # warm-up: caches, graphs, allocator
        try:
            for r in range(args.rounds):
                outs_by_way = {}
                for way in WAYS if r % 2 == 0 else WAYS[::-1]:  # ABBA: drift hits both alike
                    pool_api.Detokenizer = WholeDecode if way == "whole" else original
                    figures, outs = await one_round(pool, prompts, params)
                    rounds[way].append(figures)
                    for ids, text in outs:  # each way's text is its own tokens' whole decode
                        if text != pool.tokenizer.decode(ids, skip_special_tokens=True):
                            raise AssertionError(f"{way}: a stream's text is not the decode of its tokens")
                    outs_by_way[way] = outs
                    print(f"round {r} {way:>11}: {figures['wall_s']:7.2f} s, {figures['tokens_per_s']:8.0f} tok/s, "
                          f"{figures['cpu_ms_per_1k_tokens']:7.1f} ms CPU per 1k tokens", flush=True)
                same_tokens.append(sum(a[0] == b[0] for a, b in zip(outs_by_way["whole"], outs_by_way["incremental"])))
        finally:
            pool_api.Detokenizer = original
    summary = {way: {key: statistics.median(r[key] for r in rounds[way]) for key in rounds[way][0]} for way in WAYS}
    summary["ratio"] = {
        "tokens_per_s": summary["incremental"]["tokens_per_s"] / summary["whole"]["tokens_per_s"],
        "cpu_per_token": summary["whole"]["cpu_ms_per_1k_tokens"] / summary["incremental"]["cpu_ms_per_1k_tokens"],
    }
    # Greedy tokens can differ between rounds where batches form differently (bf16 sums in
    # another order break near-ties), which is why texts are checked against their own tokens.
    return {"rounds": rounds, "summary": summary, "streams_with_the_same_tokens_both_ways": same_tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Qwen3 directory (default: generate --preset)")
    ap.add_argument("--preset", default="tiny", help="generated model when --model is not given")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds per way")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if min(args.streams, args.max_tokens, args.prompt_len, args.rounds, args.world_size) < 1:
        ap.error("--streams, --max-tokens, --prompt-len, --rounds and --world-size must be positive")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_model(Path(tmp) / "model", preset=args.preset, seed=args.seed))
        result = uvloop.run(run(args, model))
    s = result["summary"]
    print(f"incremental / whole: x{s['ratio']['tokens_per_s']:.2f} tokens/s, "
          f"x{s['ratio']['cpu_per_token']:.1f} less CPU per token in this process")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "model", "preset")}
        config["model"] = Path(args.model).name if args.model else f"generated {args.preset}"
        args.json.write_text(json.dumps({
            "benchmark": "stream", "config": config, "git": git_record(),
            "host": platform.processor() or platform.machine(), "python": sys.version.split()[0], **result,
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
