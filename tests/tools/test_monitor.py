"""The monitor's judgement and drawing without a pool (lmpool_tools.monitor, top): states
published by hand on a real board give the verdicts, rates and rows ``lmpool top`` shows;
a board with figures no pool publishes, or something else swapped in under a board's name
after the listing, is invalid to ``lmpool ps`` and ``lmpool top``, never a crash or a hang."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from planted import KINDS, fifo_guard, plant, remove

from lmpool.protocol.state_board import BOARD_LABEL, PoolState, RankRow, StateBoardWriter, board_capacity
from lmpool_ipc import IpcPool
from lmpool_ipc.names import SHM_DIR, board_name, new_pool_id
from lmpool_tools import monitor, ps, top
from lmpool_tools.monitor import PoolMonitor, PoolNotFound, find_pool
from lmpool_tools.top import ASCII_GLYPHS, bar, frame, sparkline


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def state(pool: IpcPool, generated: list[int], *, at: float, control_pid: int | None = None, worker_pid=None) -> PoolState:
    rows = [
        RankRow(rank=r, pid=worker_pid or os.getpid(), alive=True, epoch=1, snapshot_version=3, heartbeat_age_s=0.1,
                num_running=r, blocks_used=10, blocks_reclaimable=30, blocks_free=60, prompt_tokens=200,
                prefix_hit_tokens=50 * r, generated_tokens=g)
        for r, g in enumerate(generated)
    ]
    return PoolState(
        pool_id=pool.pool_id, owner_pid=pool.owner_pid, control_pid=control_pid or os.getpid(), started_at=time.time(),
        published=1, published_at=time.time(), monotonic=at, world_size=len(rows), route_queries=7, ranks=rows,
    )


@pytest.fixture
def board():
    with IpcPool.start() as pool:
        name = pool.create_board(BOARD_LABEL, board_capacity(2))
        with StateBoardWriter(name) as writer:
            yield pool, name, writer


def test_rates_rows_and_frame(board):
    pool, name, writer = board
    monitor = PoolMonitor(pool.pool_id, name)
    try:
        assert monitor.sample().verdict == "starting"
        now = time.monotonic()
        writer.publish(state(pool, [0, 0], at=now - 0.5))
        writer.publish(state(pool, [100, 50], at=now))
        monitor.sample()  # only the latest state is on the board: a rate needs two samples
        assert monitor.sample().tokens_per_s == 0
        writer.publish(state(pool, [300, 50], at=now + 0.5))
        view = monitor.sample()
    finally:
        monitor.close()
    assert view.verdict == "alive" and view.reason == ""
    assert [r.tokens_per_s for r in view.ranks] == [400.0, 0.0]
    assert view.tokens_per_s == 400.0
    assert [r.hit_rate for r in view.ranks] == [0.0, 0.25] and view.hit_rate == 0.125
    lines = [text for text, _ in frame(view, 160, glyphs=ASCII_GLYPHS)]
    assert any("ALIVE" in line and "ranks 2/2 alive" in line for line in lines)
    row = next(line for line in lines if line.split()[:4] == ["1", str(os.getpid()), "1", "alive"])
    assert "25.0%" in row and "0.0" in row.split()
    assert all(len(line) < 160 for line in lines)


def test_a_counter_that_restarts_gives_no_negative_rate(board):
    pool, name, writer = board
    monitor = PoolMonitor(pool.pool_id, name)
    try:
        now = time.monotonic()
        writer.publish(state(pool, [500, 500], at=now - 0.5))
        monitor.sample()
        writer.publish(state(pool, [20, 600], at=now, worker_pid=os.getppid()))  # new workers
        view = monitor.sample()
    finally:
        monitor.close()
    assert [r.tokens_per_s for r in view.ranks] == [40.0, 1200.0]


@pytest.mark.parametrize("case", ["control gone", "stale", "worker gone", "board gone"])
def test_dead_pools_and_ranks(board, case):
    pool, name, writer = board
    now = time.monotonic()
    if case == "control gone":
        writer.publish(state(pool, [1, 1], at=now, control_pid=dead_pid()))
    elif case == "stale":
        writer.publish(state(pool, [1, 1], at=now - 2.5))
    elif case == "worker gone":
        writer.publish(state(pool, [1, 1], at=now, worker_pid=dead_pid()))
    else:
        writer.publish(state(pool, [1, 1], at=now))
    monitor = PoolMonitor(pool.pool_id, name)
    try:
        if case == "board gone":
            pool.close()
        view = monitor.sample()
    finally:
        monitor.close()
    if case == "worker gone":
        assert view.verdict == "alive"
    else:
        assert view.verdict == "dead"
        assert {
            "control gone": "its control process", "stale": "has published nothing for", "board gone": "board is gone"
        }[case] in view.reason
    assert [r.alive for r in view.ranks] == [False, False]
    lines = [text for text, _ in frame(view, 160)]
    rows = [line.split() for line in lines if line.split()[:1] in (["0"], ["1"])]
    assert [row[3] for row in rows] == ["dead", "dead"] and [row[4] for row in rows] == ["-", "-"]


@pytest.mark.parametrize("bad", [{"started_at": float("nan")}, {"monotonic": float("inf")},
                                 {"route_p99_us": float("-inf")}, {"rank_step_ms": float("nan")}])
def test_a_board_with_non_finite_figures_is_invalid_not_a_crash(board, bad, capsys):
    """NaN or inf in a planted board's fields raised ValueError or OverflowError in ps and top."""
    pool, name, writer = board
    published = state(pool, [1, 1], at=time.monotonic())
    if "rank_step_ms" in bad:
        published.ranks[1].step_ms = bad["rank_step_ms"]
    else:
        published = msgspec.structs.replace(published, **bad)
    writer.publish(published)
    assert_invalid(pool.pool_id, name)


@pytest.mark.parametrize("bad", [{"route_queries": -1}, {"started_at": -1.0}, {"world_size": 1},
                                 {"rank_num_waiting": -3}, {"rank_heartbeat_age_s": -2.0}])
def test_a_board_with_out_of_range_figures_is_invalid(board, bad):
    """Negative counts and times, and a row of a rank the pool has not, are no pool's figures."""
    pool, name, writer = board
    published = state(pool, [1, 1], at=time.monotonic())
    for field, value in bad.items():
        if field.startswith("rank_"):
            setattr(published.ranks[1], field.removeprefix("rank_"), value)
        else:
            published = msgspec.structs.replace(published, **{field: value})
    writer.publish(published)
    assert_invalid(pool.pool_id, name)


def assert_invalid(pool_id: str, name: str) -> None:
    """``lmpool top``'s monitor calls the pool dead for it, and ``lmpool ps`` lists it invalid."""
    monitor = PoolMonitor(pool_id, name)
    try:
        view = monitor.sample()
    finally:
        monitor.close()
    assert view.verdict == "dead" and "holds no valid pool state" in view.reason
    assert "invalid" in ps.pool_line(pool_id, name)


@pytest.fixture
def swapped(board, monkeypatch):
    """A board name that ``lmpool ps`` and ``lmpool top`` have just listed, as if a regular
    file had been there, and its path, to put anything at before they open it."""
    _, real, _ = board
    pool_id = new_pool_id()
    name = board_name(pool_id, os.getpid(), BOARD_LABEL)
    path = Path(SHM_DIR + name)
    for tool in (ps, monitor):  # the listing they took, before the swap
        monkeypatch.setattr(tool, "pool_boards", lambda: {pool_id: name})
    yield pool_id, name, path, SHM_DIR + real
    remove(path)


@pytest.mark.parametrize("kind", KINDS)
def test_what_is_swapped_in_after_the_listing_is_invalid_not_waited_on(swapped, kind, caplog, capsys):
    """Root's ``lmpool ps`` hung on a FIFO swapped in for a board between its listing and its open."""
    pool_id, name, path, real = swapped
    plant(kind, path, link_to=real)  # a link to a real board is no board either
    with fifo_guard(path) if kind == "fifo" else contextlib.nullcontext():
        with caplog.at_level(logging.WARNING, logger="lmpool.ps"):
            assert ps.main([]) == 0
        assert top.main([pool_id, "--once"]) == 1
    out, err = capsys.readouterr()
    assert f"{pool_id:<32} {'?':>8} invalid" in out
    assert name in caplog.text and "is not an LMPool board" in caplog.text
    assert f"pool {pool_id} has no readable state board: {name} is not an LMPool board" in err


def test_find_pool(board):
    pool, name, _ = board
    assert find_pool(pool.pool_id[:10]) == (pool.pool_id, name)
    assert find_pool(pool.pool_id.upper()) == (pool.pool_id, name)
    with pytest.raises(PoolNotFound, match="no LMPool pool 'ffff-not-a-pool'"):
        find_pool("ffff-not-a-pool")
    with IpcPool.start() as other:
        other.create_board(BOARD_LABEL, 64)
        with pytest.raises(PoolNotFound, match="matches [0-9]+ pools"):
            find_pool("")


def test_bars_and_sparklines():
    assert bar(2, 3, 5, 10, ASCII_GLYPHS) == "##+++....."
    assert bar(0, 0, 0, 4, ASCII_GLYPHS) == "...."
    assert bar(1, 0, 0, 3, ASCII_GLYPHS) == "###"
    assert sparkline([0, 1, 2, 4], 4, ASCII_GLYPHS) == "_-=#"
    assert sparkline([9, 9, 0, 1, 2, 4], 4, ASCII_GLYPHS) == "_-=#"  # the latest values
    assert sparkline([0, 0], 4, ASCII_GLYPHS) == "__"
    assert sparkline([1, 2], 0, ASCII_GLYPHS) == ""


def test_two_states_a_hair_apart_give_no_infinite_rate(board):
    pool, _, _ = board
    before, after = state(pool, [0, 5], at=0.0), state(pool, [10**9, 5], at=5e-324)  # a subnormal apart
    assert monitor._token_rates(before, after) == {0: 0.0, 1: 0.0}
