"""Replay one trace against one running pool and record every request.

Arrival process (``Arrival``):
- ``window``: requests are handed to the pool in trace order as soon as fewer than
  ``window`` are in flight (0: no cap, the whole phase at once);
- ``poisson``: request i of a phase is due at the i-th point of a seeded Poisson process
  of ``rate`` requests/s from the phase's start, and still waits for a window slot.
Either way submission order is trace order: a request is only handed over after every
earlier one was. A request's arrival time is when it is handed to the pool. Phases are
barriers: the next starts when every request of the previous one has finished.

Every request is greedy with ``ignore_eos``, so it produces exactly its ``max_tokens``
tokens whatever the weights; the time of its first streamed output is its first token.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.stats.eval_metrics import OPTIONAL_FIELDS, RECORD_FIELDS
from lmpool.sampling_params import SamplingParams


@dataclass(frozen=True)
class Arrival:
    mode: str = "window"  # "window" or "poisson"
    window: int = 16  # most requests in flight; 0 = unlimited
    rate: float = 0.0  # requests/s, for "poisson"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("window", "poisson"):
            raise ValueError(f"arrival mode must be 'window' or 'poisson', got {self.mode!r}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if self.mode == "poisson" and not self.rate > 0:
            raise ValueError(f"a poisson arrival needs rate > 0, got {self.rate}")


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


async def replay(pool, trace, arrival: Arrival, on_done: Callable[[], None] = lambda: None) -> dict[str, list]:
    """Run ``trace`` on ``pool``; the per-request records as columns (``RECORD_FIELDS``)."""
    records: list[dict | None] = [None] * len(trace.requests)
    slots = asyncio.Semaphore(arrival.window or len(trace.requests))
    gaps = random.Random(f"arrival/{arrival.seed}/{trace.workload}/{trace.seed}")
    t0 = time.perf_counter()

    async def one(req) -> None:
        try:
            params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
            arrived = time.perf_counter()
            first = last = None
            async for out in pool.stream(req.prompt, params, rank=req.rank):
                if first is None:
                    first = time.perf_counter()
                last = out
            done = time.perf_counter()
            if last is None or last.finish_reason != "length":
                reason = None if last is None else last.finish_reason
                raise RuntimeError(f"request {req.index} ended with finish_reason {reason!r}")
            records[req.index] = {
                "index": req.index, "phase": req.phase, "group": req.group, "prompt_len": len(req.prompt),
                "max_tokens": req.max_tokens, "pinned_rank": req.rank, "rank": last.rank,
                # The rule that chose the rank, without its cost figures: "owner", "spill", ...
                "route": (getattr(last, "route", None) or "").split(" ", 1)[0] or None,
                # ... and the whole reason: the priced candidates' figures, to compare term by term.
                "route_reason": getattr(last, "route", None) or None,
                # The route's predicted time to first token (a pricing policy's), rounded as the times are.
                "predicted_ttft_s": _rounded(getattr(last, "predicted_ttft_s", None)),
                # Submission to hand-over to the rank: the pool's own front end, before any engine.
                "dispatch_s": _rounded(getattr(last, "dispatch_s", None)),
                # Its send's start to its arrival at the rank's engine: the link and the worker's loop.
                "intake_s": _rounded(getattr(last, "intake_s", None)),
                # Its rank's share of its TTFT: arrival there to its first step's launch, then to its token.
                "queued_s": _rounded(getattr(last, "queued_s", None)),
                "first_step_s": _rounded(getattr(last, "first_step_s", None)),
                "num_cached_tokens": last.num_cached_tokens, "output_len": len(last.token_ids),
                # Microseconds are far below any latency measured here, and keep the JSON small.
                "arrival_s": round(arrived - t0, 6), "first_token_s": round(first - t0, 6),
                "completion_s": round(done - t0, 6),
            }
        finally:
            slots.release()
        on_done()

    for phase in trace.phases:
        start = time.perf_counter()
        due = 0.0
        async with asyncio.TaskGroup() as tasks:
            for req in trace.phase_requests(phase):
                if arrival.mode == "poisson":
                    due += gaps.expovariate(arrival.rate)
                    await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
                await slots.acquire()
                tasks.create_task(one(req))
    missing = [i for i, r in enumerate(records) if r is None]
    if missing:
        raise RuntimeError(f"requests {missing[:5]} left no record")
    return {f: [r[f] for r in records] for f in (*RECORD_FIELDS, *OPTIONAL_FIELDS)}
