"""The pool path of a KV transfer, timed end to end with two replicas on one GPU (or two
CPU replicas over gloo with ``--device cpu``): what ``benchmark_kv_transfer.py --kind pool``
runs.

For each block count n, a prompt of n complete blocks is prefilled on rank 0, then moved
back and forth between the ranks (0->1, 1->0, ...), ``--warmup`` untimed moves and then
``--reps`` timed ones. Moves, because a copy to a rank that already holds the chain is
refused: ping-pong needs no new prefill per repetition. Each move is one plan through the
real control process and workers: prepare (the source pins, the destination reserves),
execute (the destination pulls the blocks through CUDA IPC), publish, finalize (the
source frees its copy). Two spans are timed per move: ``request``, from the plan's
request in the user process (``TransferChain`` to the control process, chain hashes
computed beforehand) until its result is back, and ``plan``, prepare -> finalize as the
control process clocks it (from sending the prepare orders to the finalize
acknowledgement, ``TransferResult.seconds``): ``request`` is ``plan`` plus one request and
one reply between the user process and the control process. The first warm-up move of
every size checks the bytes: SHA-256 of every block's KV on the source before and on the
destination after.

With ``--profile`` (a data-path profile of the same machine, from ``--kind cuda_ipc``), the
output is that profile plus this run (``pool``) and, per pair and size, the residual the
cost model adds to the data path: ``max(0, pool p95 - data path p95)`` (``residual_p95_s``).
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.transfer.record import environment, percentile, shape

GOAL_ONE_BLOCK_P50_S = 2e-3


async def measure(args, model: str) -> tuple[dict, dict]:
    """{span: {pair: {n: [seconds]}}} of the timed moves (spans: request, plan), and {n: bytes
    equal} of the checked ones."""
    from lmpool import SamplingParams
    from lmpool.engine.hashing import chain_hashes
    from lmpool.frontend.api import AsyncLMPool
    from lmpool.protocol import TransferChain

    times: dict[str, dict[str, dict[str, list[float]]]] = {"request": {}, "plan": {}}
    equal: dict[str, bool] = {}
    device = "cpu" if args.device == "cpu" else "cuda"
    async with AsyncLMPool(model, world_size=2, device=device, enable_transfers=True, block_size=args.block_size,
                           dtype=args.dtype, num_kv_blocks=2 * max(args.sizes) + 8, max_num_seqs=8,
                           use_kernels=not args.reference_ops) as pool:
        client = pool.client
        for n in args.sizes:
            prompt = torch.randint(0, 1000, (n * args.block_size + 1,),
                                   generator=torch.Generator().manual_seed(n)).tolist()
            await pool.generate(prompt, SamplingParams(temperature=0, max_tokens=1), rank=0)
            hashes = chain_hashes(prompt, args.block_size)
            assert len(hashes) == n, (len(hashes), n)
            src, dst = 0, 1
            for rep in range(-args.warmup, args.reps):
                before = await client.block_digests(src, prompt) if rep == -args.warmup else None
                t0 = time.perf_counter()
                result = await client.control_request(TransferChain(src, dst, hashes, True))
                seconds = time.perf_counter() - t0
                if result.state != "done":
                    raise RuntimeError(f"the move of {n} blocks {src}->{dst} ended {result.state}: {result.reason}")
                if before is not None:
                    equal[str(n)] = all(before) and await client.block_digests(dst, prompt) == before
                if rep >= 0:
                    for span, value in (("request", seconds), ("plan", result.seconds)):
                        times[span].setdefault(f"{src}->{dst}", {}).setdefault(str(n), []).append(value)
                src, dst = dst, src
    return times, equal


def residuals(pool: dict, pairs: dict) -> dict:
    """{pair: {n: seconds}}: what a transaction adds to its data path at the P95, for every
    pair and size measured both ways (never negative: the two runs' noise can cross)."""
    return {pair: {n: max(0.0, point["p95_s"] - pairs[pair][n]["p95_s"])
                   for n, point in points.items() if n in pairs.get(pair, {})}
            for pair, points in pool.items()}


def pool_main(args, argv: list[str]) -> int:
    from lmpool.model.make_model import make_model

    if args.device != "cpu" and not torch.cuda.is_available():
        print("--kind pool needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    m = shape(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_model(Path(tmp) / "model", preset=args.preset, dtype=args.dtype))
        times, equal = asyncio.run(measure(args, model))
    def summary(ts: list[float], n: str) -> dict:
        return {"p50_s": percentile(sorted(ts), 0.5), "p95_s": percentile(sorted(ts), 0.95),
                "bytes": int(n) * m["kv_bytes_per_block"], "bytes_equal": equal[n]}

    pool = {pair: {n: summary(ts, n) for n, ts in by_size.items()} for pair, by_size in times["request"].items()}
    plan = {pair: {n: summary(ts, n) for n, ts in by_size.items()} for pair, by_size in times["plan"].items()}
    out = {"kind": "pool", "model": m, "sizes": args.sizes, "repetitions": args.reps}
    if args.profile is not None:
        profile = json.loads(args.profile.read_text())
        if profile["model"]["kv_bytes_per_block"] != m["kv_bytes_per_block"]:
            print(f"{args.profile} was measured for another KV shape: {profile['model']}", file=sys.stderr)
            return 2
        out = {**profile, "residual_p95_s": residuals(pool, profile["pairs"]),
               "data_path_environment": profile.get("environment")}
    out["pool"] = pool  # the request span: what the cost model's residual is taken from
    out["pool_plan"] = plan  # prepare -> finalize
    out["environment"] = {**environment(args), "command": "python -m benchmarks.benchmark_kv_transfer "
                          + shlex.join(argv)}
    print(f"pool path, two replicas on {out['environment'].get('gpu', args.device)}, {m['preset']} "
          f"({m['kv_bytes_per_block']} B per block): moves timed from the plan's request to its result "
          "(request) and from prepare to finalize (plan)")
    print(f"{'pair':>5} {'blocks':>6} {'MiB':>9} {'request p50':>12} {'p95 ms':>9} {'plan p50':>9} {'p95 ms':>9} "
          f"{'residual p95':>13} {'bytes':>6}")
    for pair, points in pool.items():
        for n, point in points.items():
            residual = out.get("residual_p95_s", {}).get(pair, {}).get(n)
            inner = plan[pair][n]
            print(f"{pair:>5} {n:>6} {point['bytes'] / 2**20:>9.2f} {point['p50_s'] * 1e3:>12.3f} "
                  f"{point['p95_s'] * 1e3:>9.3f} {inner['p50_s'] * 1e3:>9.3f} {inner['p95_s'] * 1e3:>9.3f} "
                  f"{'' if residual is None else f'{residual * 1e3:.3f} ms':>13} "
                  f"{'equal' if point['bytes_equal'] else 'DIFFER':>6}")
    for span, points_by_pair in (("request", pool), ("prepare -> finalize", plan)):
        one = [points["1"]["p50_s"] for points in points_by_pair.values() if "1" in points]
        if one:
            print(f"one block, {span}, p50 (the larger of the two directions): {max(one) * 1e3:.3f} ms "
                  f"(goal for prepare -> finalize <= {GOAL_ONE_BLOCK_P50_S * 1e3:.0f} ms)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    if not all(equal.values()):
        print(f"bytes differ after a move: {equal}", file=sys.stderr)
        return 1
    return 0
