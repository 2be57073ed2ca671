"""Faults injected into real worker processes at every phase boundary of a transfer plan
and while its bytes are in flight: an exception, a lost message (the watchdog's timeout)
or a SIGKILL, on the source or the destination (``lmpool/dataplane/faults.py``).

After each, in a running CPU pool over gloo, with every worker checking its block
manager's invariants after each transfer poll, and the control process its page table's
after every report and ack and every routing decision against it (never a reserved or
unpublished block): a violation ends the process, which the test sees.
- the plan ends (done or aborted) and the pool keeps serving transfers and requests;
- no pin or reservation outlives the plan on any live rank;
- the source keeps its blocks on abort (unless it had already finalized), and nothing
  is ever lost that no live rank had published;
- whatever the destination publishes is byte-equal to the source's blocks.

And the control process SIGKILLed while a plan stalls right after each phase: the engine
restarts it and retries the transfer under a new plan id; the stalled plan's pins and
reservations end with the workers' lease.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch
import uvloop

from lmpool import SamplingParams
from lmpool.frontend.api import AsyncLMPool
from lmpool.dataplane.faults import ACTIONS, ENV, Fault, encode
from pool_waits import no_blocks_held, settled, until

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SOURCE, DEST, SPARE = 0, 1, 2
RANK_OF = {"prepare_source": SOURCE, "execute_send": SOURCE, "finalize": SOURCE,
           "prepare_dest": DEST, "execute_recv": DEST, "publish": DEST}
CASES = [(order, point, action)
         for order in RANK_OF
         for point in ("before", "during", "after") if point != "during" or order.startswith("execute_")
         for action in ACTIONS]


def prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (3 * BLOCK + 5,), generator=g).tolist()


@pytest.mark.parametrize("order, point, action", CASES, ids=["-".join(c) for c in CASES])
def test_a_fault_at_each_point_leaves_consistent_ranks(tiny_model, monkeypatch, order, point, action):
    victim = RANK_OF[order]
    move = order in ("publish", "finalize")  # where a move differs from a copy
    monkeypatch.setenv(ENV, encode([Fault(rank=victim, order=order, point=point, action=action)]))
    monkeypatch.setenv("LMPOOL_CHECK_INVARIANTS", "1")
    text = prompt(1)

    async def main():
        async with AsyncLMPool(tiny_model, world_size=3, block_size=BLOCK, enable_transfers=True,
                               transfer_lease_s=3.0) as pool:
            engine = pool.client
            expected = (await pool.generate(text, GREEDY, rank=SOURCE)).token_ids
            source = await engine.block_digests(SOURCE, text)
            result = await pool.transfer(text, src=SOURCE, dst=DEST, move=move)
            def ended(stats) -> bool:  # the plan's holds released, a killed worker seen dead
                gone = action != "kill" or not stats["ranks"][victim]["alive"]
                return gone and no_blocks_held(stats)

            stats = await settled(pool, ended, "the release of every pin and reservation")
            alive = {r["rank"] for r in stats["ranks"] if r["alive"]}
            held = {r: await engine.block_digests(r, text) for r in sorted(alive)}

            # The pool goes on: a live holder copies to a live rank without the blocks,
            # and generation there hits them with the same tokens.
            holders = [r for r in sorted(alive) if held[r] == source]
            if not holders:  # only possible when the one holder was killed
                holders = [SPARE]
                await pool.generate(text, GREEDY, rank=SPARE)
            target = next(r for r in sorted(alive) if r not in holders)
            retry = await pool.transfer(text, src=holders[0], dst=target)
            after = await pool.generate(text, GREEDY, rank=target)
            final = await settled(pool, no_blocks_held, "the release after the retry")
            return result, source, stats, held, retry, after, expected, final

    result, source, stats, held, retry, after, expected, final = uvloop.run(main())
    alive = {r["rank"]: r for r in stats["ranks"] if r["alive"]}
    if action == "kill":
        assert victim not in alive, "the killed worker is reported dead"
        assert result.state == "aborted" or point == "after", result
    else:
        assert all(r["epoch"] == 1 for r in alive.values()), "no worker died (an invariant check would kill it)"
        assert set(alive) == {SOURCE, DEST, SPARE}
    if action != "kill" and point != "after":
        assert result.state == "aborted", f"a fault before the step completed must abort: {result}"
    for rank, digests in held.items():
        assert all(d in ("", s) for d, s in zip(digests, source)), f"rank {rank} holds bytes the source never had"
    finalized = order == "finalize" and point == "after"
    if SOURCE in alive and (result.state == "aborted" and not finalized or not move):
        assert held[SOURCE] == source, "the source keeps its blocks unless a move finalized"
    if result.state == "done":
        assert held[DEST] == source
    if move and SOURCE in alive and held[SOURCE] != source:
        assert held[DEST] == source, "a move frees the source only once the destination holds the blocks"
    assert retry.state == "done", retry.reason
    assert after.token_ids == expected and after.num_cached_tokens == 3 * BLOCK
    assert all(r["epoch"] == 1 for r in final["ranks"] if r["alive"])
    assert final["control_restarts"] == 0, "the control plane's invariant checks held (a violation ends it)"


@pytest.mark.parametrize("order", list(RANK_OF))
def test_control_killed_while_a_plan_stalls_after_each_phase(tiny_model, monkeypatch, tmp_path, order):
    fired = tmp_path / "fired"
    stall = Fault(rank=RANK_OF[order], order=order, point="after", action="drop", mark=str(fired))
    monkeypatch.setenv(ENV, encode([stall]))
    monkeypatch.setenv("LMPOOL_CHECK_INVARIANTS", "1")
    text = prompt(2)

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK, enable_transfers=True,
                               transfer_lease_s=2.0) as pool:
            engine = pool.client
            expected = (await pool.generate(text, GREEDY, rank=SOURCE)).token_ids
            source = await engine.block_digests(SOURCE, text)
            plan = asyncio.create_task(pool.transfer(text, src=SOURCE, dst=DEST))
            await until(fired.exists, f"the stall after {order}")
            old_control = engine.control_proc.pid
            os.kill(old_control, signal.SIGKILL)
            result = await plan
            stats = await settled(pool, no_blocks_held, "the end of the stalled plan's pins by lease")
            held = [await engine.block_digests(r, text) for r in (SOURCE, DEST)]
            after = await pool.generate(text, GREEDY, rank=DEST)
            return result, source, held, after, expected, stats, old_control, engine.control_proc.pid

    result, source, held, after, expected, stats, old_control, control = uvloop.run(main())
    assert control != old_control and stats["control_restarts"] == 1
    assert result.state == "done" or "already holds" in result.reason, result
    assert held == [source, source], "the source kept its blocks and the destination got them once"
    assert after.token_ids == expected and after.num_cached_tokens == 3 * BLOCK
    assert all(r["alive"] and r["epoch"] == 1 for r in stats["ranks"])
