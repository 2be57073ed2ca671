"""Route-time pulls in a running CPU pool (gloo, ``transfer_mode="pull"``): with its owner
busy decoding past the bounded-load gate, a request for a cached document goes to the idle
rank, which first copies the document's blocks from the owner; its tokens equal a single ``LLM``'s (greedy). A pull that
aborts (an injected failure) recomputes on its rank; a source killed mid-pull loses no
request. Workers check their block manager's invariants after every transfer poll and the
control process its page table's and the pulls' bookkeeping after every report, ack and
route. Afterwards no plan, in-flight block, reservation or pinned block is left."""

from __future__ import annotations

import asyncio

import pool_waits
import pytest
import torch
import uvloop

from lmpool import LLM, SamplingParams
from lmpool.dataplane.faults import ENV, Fault, encode
from lmpool.frontend.api import AsyncLMPool

BLOCK = 16
DOC_BLOCKS = 48  # its recompute outlasts the two busy-owner steps the copy waits for
# Long enough that decoding beside the owner's batch costs more than copying the document away.
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
READ = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # completes no block past the document
BUSY = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)  # decodes until cancelled
# Requests decoding on rank 0 while the others ask: with two ranks, the bounded-load gate opens
# past the mean by 4 (9 > 4.5 + 4).
BUSY_REQUESTS = 9
DEADLINE_S = 120.0


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


DOC = tokens(DOC_BLOCKS * BLOCK, 1)
ASKS = [DOC + tokens(5, 10 + i) for i in range(3)]


@pytest.fixture(scope="module")
def expected(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        return [o.token_ids for o in llm.generate(ASKS, GREEDY)]


def leak_free(stats: dict) -> bool:
    t = stats["transfers"]
    return (t["plans_open"] == 0 and t["in_flight_blocks"] == 0 and t["reservations"] == 0
            and t["pulls_open"] == 0 and pool_waits.no_blocks_held(stats))


async def serve_with_busy_owner(pool: AsyncLMPool, asks: list[list[int]]) -> tuple[list, dict]:
    """Cache the document on rank 0, keep rank 0 decoding, ask ``asks`` one after the other;
    their outputs and the pool's stats once every request has ended and nothing is held."""
    await pool.generate(DOC + tokens(3, 9), READ, rank=0)
    await pool_waits.settled(pool, lambda s: s["ranks"][0]["cached_blocks"] >= DOC_BLOCKS, "the document cached",
                             limit=DEADLINE_S)
    busy = [asyncio.create_task(pool.generate(tokens(20, 99 + i), BUSY, rank=0)) for i in range(BUSY_REQUESTS)]
    await pool_waits.settled(pool, lambda s: s["ranks"][0]["num_running"] >= BUSY_REQUESTS, "rank 0 decoding",
                             limit=DEADLINE_S)
    outs = [await pool.generate(ask, GREEDY) for ask in asks]
    for task in busy:
        task.cancel()
    await asyncio.gather(*busy, return_exceptions=True)
    stats = await pool_waits.settled(pool, leak_free, "nothing held", limit=DEADLINE_S)
    stats["digests"] = [await pool.client.block_digests(r, DOC) for r in range(2) if stats["ranks"][r]["alive"]]
    return outs, stats


def run(tiny_model, monkeypatch, asks: list[list[int]], fault: Fault | None = None,
        mode: str = "pull") -> tuple[list, dict]:
    """``serve_with_busy_owner`` in a fresh two-rank pool of transfer mode ``mode`` checking
    its invariants, with ``fault`` injected into its workers."""
    monkeypatch.setenv("LMPOOL_CHECK_INVARIANTS", "1")
    if fault is not None:
        monkeypatch.setenv(ENV, encode([fault]))

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK, transfer_mode=mode) as pool:
            return await serve_with_busy_owner(pool, asks)

    return uvloop.run(main())


@pytest.mark.parametrize("mode", ["pull", "all"])
def test_a_pulled_request_runs_on_the_idle_rank_with_the_tokens_of_a_single_llm(tiny_model, expected, monkeypatch,
                                                                               mode):
    outs, stats = run(tiny_model, monkeypatch, ASKS, mode=mode)
    first = outs[0]
    assert first.rank == 1 and first.route.startswith(f"pull r1<-r0:{DOC_BLOCKS}b="), first.route
    assert first.route.endswith("pull landed") and "serve r0=" in first.route
    assert first.num_cached_tokens == DOC_BLOCKS * BLOCK, "the pulled blocks served the prefix"
    assert [o.token_ids for o in outs] == expected
    t = stats["transfers"]
    assert t["pulls_started"] >= 1 and t["pulls_landed"] == t["pulls_started"] and t["pulls_aborted"] == 0
    assert t["plans_committed"] == t["pulls_started"] + t["background_copies"] + t["foreground_moves"]
    # No routed prompt branched from the document before it was pulled: it was one reader's,
    # so it moved, and its source freed it (nothing there used it).
    assert t["pulls_moved"] == 1 and t["blocks_moved"] == DOC_BLOCKS
    phases = t["plan_phases_ms"]["pull"]  # [median ms, max ms, plans] from each plan's start
    ends = [phases[p][0] for p in ("prepared", "executed", "published", "finalized")]
    assert ends == sorted(ends) and ends[0] > 0 and phases["finalized"][2] == t["pulls_started"]
    assert 0 < phases["source_prepared"][0] <= ends[0] and 0 < phases["dest_prepared"][0] <= ends[0]
    # The part of each side's answer that its order waited for the worker's step loop, measured there.
    assert 0 <= phases["source_held"][0] <= phases["source_prepared"][0]
    assert 0 <= phases["dest_held"][0] <= phases["dest_prepared"][0]
    source, destination = stats["digests"]
    assert not any(source) and all(destination), "moved: on rank 1 only"


def test_an_aborted_pull_recomputes_on_its_rank(tiny_model, expected, monkeypatch):
    fault = Fault(rank=1, order="execute_recv", point="before", action="raise")
    (out,), stats = run(tiny_model, monkeypatch, ASKS[:1], fault)
    assert out.rank == 1 and "pull aborted: rank 1 failed executing" in out.route, out.route
    assert out.num_cached_tokens == 0 and out.token_ids == expected[0]
    t = stats["transfers"]
    assert (t["pulls_started"], t["pulls_aborted"], t["pulls_landed"]) == (1, 1, 0)


def test_a_source_killed_mid_pull_loses_no_request(tiny_model, expected, monkeypatch):
    fault = Fault(rank=0, order="execute_send", point="before", action="kill")
    (out,), stats = run(tiny_model, monkeypatch, ASKS[:1], fault)
    # The plan ends on whichever the control plane hears of first: rank 0's death or rank 1's
    # failed receive; either way the request runs on rank 1 and recomputes.
    assert out.rank == 1 and "; pull aborted: rank " in out.route, out.route
    assert out.token_ids == expected[0]
    assert [r["alive"] for r in stats["ranks"]] == [False, True]
    assert stats["transfers"]["pulls_aborted"] == 1


def test_a_request_cancelled_while_its_pull_runs_releases_its_reservation_at_once(tiny_model, monkeypatch):
    """A caller that gives up while its request waits on a route-time pull (a client that
    disconnected) ends the route's reservation on the pull's destination at once: left to
    expire, it priced that rank busier than it was for seconds. Reservations here last ten
    minutes, so only the release can end this one; the pull stays open meanwhile (the
    destination's prepare answer is dropped, so the plan waits for the watchdog)."""
    from lmpool.config import RoutingConfig

    monkeypatch.setenv("LMPOOL_CHECK_INVARIANTS", "1")
    monkeypatch.setenv(ENV, encode([Fault(rank=1, order="prepare_dest", point="after", action="drop")]))

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK,
                               routing_config=RoutingConfig(reservation_ttl_s=600.0)) as pool:
            await pool.generate(DOC + tokens(3, 9), READ, rank=0)
            await pool_waits.settled(pool, lambda s: s["ranks"][0]["cached_blocks"] >= DOC_BLOCKS,
                                     "the document cached", limit=DEADLINE_S)
            busy = [asyncio.create_task(pool.generate(tokens(20, 99 + i), BUSY, rank=0)) for i in range(BUSY_REQUESTS)]
            await pool_waits.settled(pool, lambda s: s["ranks"][0]["num_running"] >= BUSY_REQUESTS
                                     and s["transfers"]["reservations"] == 0, "rank 0 decoding", limit=DEADLINE_S)
            ask = asyncio.create_task(pool.generate(ASKS[0], GREEDY))
            opened = await pool_waits.settled(pool, lambda s: s["transfers"]["pulls_open"] == 1,
                                              "the pull opened", limit=DEADLINE_S)
            assert opened["transfers"]["reservations"] == 1, "the pulled request's route is reserved"
            ask.cancel()
            await asyncio.gather(ask, return_exceptions=True)
            await pool_waits.settled(pool, lambda s: s["transfers"]["reservations"] == 0,
                                     "the cancelled route's reservation released", limit=DEADLINE_S)
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
            return await pool_waits.settled(pool, leak_free, "nothing held", limit=DEADLINE_S)

    stats = uvloop.run(main())
    assert stats["transfers"]["pulls_started"] == 1
