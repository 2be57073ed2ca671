"""Turns at the loop (``lmpool.frontend.turns``): one turn per loop round, the loop's other work
between turns, waiting tasks in the order they came, each woken once, and cancellations that
neither stall the queue nor lose a turn."""

from __future__ import annotations

import asyncio

from lmpool.frontend.turns import Turns


async def burst(turns: Turns, n: int) -> list[str]:
    """``n`` tasks that each take a turn, started at once, beside a callback that stands for
    the loop's I/O: it notes every round it runs in."""
    events: list[str] = []
    done = asyncio.Event()

    def io() -> None:
        events.append("io")
        if not done.is_set():
            asyncio.get_running_loop().call_soon(io)

    async def one(i: int) -> None:
        await turns.take()
        events.append(f"t{i}")

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    asyncio.get_running_loop().call_soon(io)
    await asyncio.gather(*tasks)
    done.set()
    return events


def turns_between_io(events: list[str]) -> list[list[str]]:
    rounds, current = [], []
    for e in events:
        if e == "io":
            if current:
                rounds.append(current)
            current = []
        else:
            current.append(e)
    return rounds + ([current] if current else [])


async def test_a_burst_takes_one_turn_a_round_in_order_with_the_loop_s_work_between():
    turns = Turns()
    events = await burst(turns, 6)
    assert turns_between_io(events) == [[f"t{i}"] for i in range(6)]
    # Each waiting task was woken once: a queue that polled would count a wait per poll.
    assert turns.waits == 5


async def test_a_turn_in_a_round_where_none_was_taken_does_not_wait():
    turns = Turns()
    await turns.take()
    await asyncio.sleep(0)  # a later round: the turn taken above has ended
    await asyncio.sleep(0)
    ran = []
    asyncio.get_running_loop().call_soon(ran.append, "io")
    await turns.take()
    assert ran == [] and turns.waits == 0  # no loop round passed


async def take_and_note(turns: Turns, order: list[int], i: int) -> None:
    await turns.take()
    order.append(i)


async def test_a_cancelled_waiter_leaves_the_queue_and_the_rest_go_on():
    turns = Turns()
    order: list[int] = []
    tasks = [asyncio.create_task(take_and_note(turns, order, i)) for i in range(4)]
    await asyncio.sleep(0)  # t0 took the round's turn; t1-t3 wait
    tasks[2].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [0, 1, 3] and tasks[2].cancelled()


async def test_a_waiter_cancelled_once_woken_passes_its_turn_on():
    turns = Turns()
    order: list[int] = []
    tasks = [asyncio.create_task(take_and_note(turns, order, i)) for i in range(3)]
    await asyncio.sleep(0)  # t0 ran; the end of its turn is scheduled for the next round
    await asyncio.sleep(0)  # ... which has woken t1, to run the round after
    assert turns._queue and not tasks[1].done()
    tasks[1].cancel()  # woken, not yet run
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [0, 2] and tasks[1].cancelled()
