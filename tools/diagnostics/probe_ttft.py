"""Where a request's time to first token goes, against what routing predicted for it.

A pool of ``--world-size`` replicas (under MPS with ``--mps``) serves, one request at a time,
a conversation's turns: turn 0 a ``--prompt``-token prompt, each later turn the previous
prompt plus ``--new`` tokens (its history cached). For each request it prints the measured
TTFT (client side), the route's predicted TTFT, the rank and its cached tokens; then each
rank's fitted step time (``stats()["ranks"][r]["step_fit"]``). A gap between the two that the
fit does not close is time outside the engine's steps.

    python -m tools.diagnostics.probe_ttft --preset 0.6b --device cuda --dtype bfloat16 --mps
"""

from __future__ import annotations

import argparse
import random
import time

import uvloop


from benchmarks.device.mps import mps_daemon

from lmpool import SamplingParams
from lmpool.cli import default_model
from lmpool.frontend.api import AsyncLMPool


async def probe(args: argparse.Namespace) -> None:
    model = args.model or str(default_model(args.preset))
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    kw = {"dtype": args.dtype} if args.dtype else {}
    async with AsyncLMPool(model, world_size=args.world_size, device=args.device, block_size=256,
                           num_kv_blocks=args.num_kv_blocks, **kw) as pool:
        for conversation in range(args.conversations):
            prompt = [rng.randrange(1000) for _ in range(args.prompt)]
            for turn in range(args.turns):
                start = time.perf_counter()
                first = None
                async for out in pool.stream(prompt, params):
                    if first is None:
                        first = time.perf_counter() - start
                    last = out
                predicted = last.predicted_ttft_s
                print(f"conv {conversation} turn {turn}: {len(prompt):6d} tokens, {last.num_cached_tokens:6d} cached, "
                      f"rank {last.rank}: ttft {first * 1e3:7.1f} ms, predicted "
                      f"{'-' if predicted is None else f'{predicted * 1e3:7.1f} ms'}  ({last.route.split(';')[0]})")
                prompt = prompt + last.token_ids + [rng.randrange(1000) for _ in range(args.new)]
        for row in (await pool.stats())["ranks"]:
            print(f"rank {row['rank']}: {row['step_fit']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--num-kv-blocks", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=3072)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--mps", action="store_true", help="each replica under MPS with 1/world-size of the SMs")
    args = ap.parse_args()
    if args.mps:
        with mps_daemon(args.world_size):
            uvloop.run(probe(args))
    else:
        uvloop.run(probe(args))


if __name__ == "__main__":
    main()
