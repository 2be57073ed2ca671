"""Turns at the loop (``lmpool.frontend.turns``): a round's turns stop at the budget, the loop's
other work runs before the next round's, and waiting tasks go in the order they came."""

from __future__ import annotations

import asyncio

import pytest

from lmpool.frontend.turns import Turns


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def burst(turns: Turns, clock: Clock, work_s: list[float]) -> list[str]:
    """Tasks that each take a turn and spend ``work_s[i]`` in it, started at once, beside a
    callback that stands for the loop's I/O: it notes every round it runs in."""
    events: list[str] = []
    done = asyncio.Event()

    def io() -> None:
        events.append("io")
        if not done.is_set():
            asyncio.get_running_loop().call_soon(io)

    async def one(i: int) -> None:
        await turns.take()
        events.append(f"t{i}")
        clock.now += work_s[i]

    tasks = [asyncio.create_task(one(i)) for i in range(len(work_s))]
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


async def test_a_round_takes_turns_up_to_its_budget_and_the_loop_runs_between_rounds():
    clock = Clock()
    turns = Turns(budget_s=1.0, clock=clock)
    events = await burst(turns, clock, [0.4] * 7)
    # 0.4 s each against a 1 s budget: a round takes turns while under it (0, 0.4, 0.8 spent),
    # then the loop's other work runs before the next round's.
    assert turns_between_io(events) == [["t0", "t1", "t2"], ["t3", "t4", "t5"], ["t6"]]


async def test_a_turn_longer_than_the_budget_has_a_round_of_its_own():
    clock = Clock()
    turns = Turns(budget_s=1.0, clock=clock)
    events = await burst(turns, clock, [3.0, 0.1, 5.0, 0.1])
    assert turns_between_io(events) == [["t0"], ["t1", "t2"], ["t3"]]


async def test_a_turn_in_a_round_with_room_does_not_wait():
    clock = Clock()
    turns = Turns(budget_s=1.0, clock=clock)
    await turns.take()  # the first opens a round (it waits once)
    waited = turns.waits
    ran = []
    asyncio.get_running_loop().call_soon(ran.append, "io")
    clock.now += 0.5
    await turns.take()
    assert ran == [] and turns.waits == waited  # no loop round passed


def test_the_budget_must_be_positive():
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        Turns(budget_s=0)
