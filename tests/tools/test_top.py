"""``lmpool top`` and ``lmpool ps`` against real CPU pools: the live screen in tmux shows
every rank with its throughput; watching a pool does not change what it generates; a pool
whose owner was SIGKILLed shows dead, and a pool that is gone is reported, not waited for; a
real pool's board passes the readers' checks (what they refuse: ``test_monitor.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch
from tools_testkit import LMPOOL, PID, RUN, STATE, TOKS, lmpool, pool_tokens_per_s, rank_rows, wait_until

from lmpool import LMPool, SamplingParams
from lmpool.protocol.state_board import StateBoardReader, pool_boards
from lmpool_ipc import pid_alive, sweep_dead_pools
from lmpool_tools import ps

BLOCK = 16
OWNER_SCRIPT = Path(__file__).with_name("pool_owner.py")


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (20 + i % 17,), generator=g).tolist() for i in range(n)]


def test_top_shows_every_rank_and_its_throughput(tiny_model, tmux):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LMPool(tiny_model, world_size=2, block_size=BLOCK, routing="round_robin") as pool:
        stop = threading.Event()

        def keep_generating():  # throughput to show while the screen is captured
            batch = 0
            while not stop.is_set():
                pool.generate(prompts(6, batch), params)
                batch += 1

        load = threading.Thread(target=keep_generating)
        load.start()
        try:
            tmux.start(LMPOOL, "top", pool.pool_id, "--interval", "0.2")

            def busy_screen():
                screen = tmux.screen()
                rows = rank_rows(screen)
                if set(rows) == {0, 1} and all(float(r[TOKS]) > 0 for r in rows.values()) \
                        and pool_tokens_per_s(screen) > 0:
                    return screen
                assert tmux.running(), f"lmpool top exited: {tmux.stderr()}"
                return None

            screen = wait_until(busy_screen, "every rank with non-zero tokens/s", tmux.report)
            listing = lmpool("ps")
            for key, shown in (("s", "sort by waiting"), ("6", "sort by tok/s"), ("p", "(paused)")):
                tmux.keys(key)
                wait_until(lambda: shown in tmux.screen(), f"{shown!r} after key {key!r}", tmux.report)
        finally:
            stop.set()
            load.join()
        tmux.keys("q")
        wait_until(lambda: not tmux.running(), "lmpool top to quit on q")
        worker_pids = [rank.proc.pid for rank in pool.client.ranks]
        pool_id = pool.pool_id
    rows = rank_rows(screen)
    assert [int(rows[r][PID]) for r in (0, 1)] == worker_pids
    assert all(rows[r][STATE] == "alive" for r in (0, 1))
    assert f"pool {pool_id}  ALIVE" in screen and "ranks 2/2 alive" in screen
    assert "route p50" in screen and "p99" in screen and "q/s" in screen
    assert tmux.stderr() == ""
    line = next(line for line in listing.stdout.splitlines() if line.startswith(pool_id))
    assert line.split()[1:4] == [str(os.getpid()), "alive", "2/2"]


def test_watching_a_pool_does_not_change_its_outputs(tiny_model, tmux):
    # Long enough that the run is still in flight for many of the monitor's frames: with 24
    # tokens a cached run could end between two board publishes (0.25 s apart), unseen.
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    workload = prompts(64, 100)
    with LMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
        unwatched = pool.generate(workload, params)
        tmux.start(LMPOOL, "top", pool.pool_id, "--interval", "0.2")
        wait_until(lambda: len(rank_rows(tmux.screen())) == 2, "the monitor to attach", tmux.report)
        watched = []
        run = threading.Thread(target=lambda: watched.extend(pool.generate(workload, params)))
        run.start()
        try:
            # Detach while the run is in flight: the monitor saw requests running.
            wait_until(lambda: any(int(r[RUN]) > 0 for r in rank_rows(tmux.screen()).values()),
                       "the monitor to show the run", tmux.report)
            tmux.keys("q")
            wait_until(lambda: not tmux.running(), "the monitor to detach")
            once = lmpool("top", "--once", pool.pool_id)  # and a one-shot reader meanwhile
        finally:
            run.join()
        again = pool.generate(workload, params)
    assert once.returncode == 0, once.stderr
    assert [o.token_ids for o in watched] == [o.token_ids for o in unwatched]
    assert [o.token_ids for o in again] == [o.token_ids for o in unwatched]


def test_a_pool_whose_owner_is_sigkilled_shows_dead(tiny_model, tmux):
    owner = subprocess.Popen(
        [sys.executable, str(OWNER_SCRIPT), tiny_model], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        started = json.loads(owner.stdout.readline())
        pool_id, pool_pids = started["pool_id"], started["pids"]
        alive = lmpool("top", "--once", pool_id[:8])  # a unique prefix names the pool
        assert alive.returncode == 0, alive.stderr
        assert [rank_rows(alive.stdout)[r][STATE] for r in (0, 1)] == ["alive", "alive"]
        tmux.start(LMPOOL, "top", pool_id, "--interval", "0.2")
        wait_until(lambda: "ALIVE" in tmux.screen(), "the live screen", tmux.report)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
    finally:
        owner.kill()
        owner.wait()
        owner.stdin.close()
        owner.stdout.close()
    # Any pool start on this machine (another test run, say) sweeps a dead pool's shared
    # memory, so the board may vanish at any moment from here on: top must call the pool
    # dead either way, and name the cause it saw.
    board = Path(f"/dev/shm/lmpool-{pool_id}-{owner.pid}-board-state")
    killed = f"its owner process {owner.pid} is gone"
    swept = "its state board is gone"

    # The live screen says so, instead of freezing on the last numbers.
    def dead_screen():
        screen = tmux.screen()
        states = [row[STATE] for row in rank_rows(screen).values()]
        return screen if "DEAD" in screen and states == ["dead", "dead"] else None

    screen = wait_until(dead_screen, "the live screen to show the pool dead", tmux.report)
    assert killed in screen or swept in screen
    tmux.keys("q")
    wait_until(lambda: not tmux.running(), "lmpool top to quit")
    assert f"pool {pool_id} is dead" in tmux.stderr()  # and it exited with a reason
    # The workers and the control process follow their owner (PDEATHSIG).
    wait_until(lambda: not any(pid_alive(p) for p in pool_pids), "the pool's processes to die")

    dead = lmpool("top", "--once", pool_id)
    listing = lmpool("ps").stdout
    assert dead.returncode == 1
    if board.exists():  # so top read the dead pool's board, not nothing
        assert f"pool {pool_id} is dead: {killed}" in dead.stderr
        assert [row[STATE] for row in rank_rows(dead.stdout).values()] == ["dead", "dead"]
        listed = next(line for line in listing.splitlines() if line.startswith(pool_id))
        assert listed.split()[2] == "dead"

    sweep_dead_pools()  # what the next pool start does: now the board is gone too
    gone = lmpool("top", "--once", pool_id)
    assert gone.returncode == 1 and f"no LMPool pool {pool_id!r}" in gone.stderr
    assert pool_id not in lmpool("ps").stdout


def test_a_real_pools_board_reads(tiny_model):
    """A regular file of this user's, of a board's size, with figures in range: not refused."""
    with LMPool(tiny_model, world_size=1, block_size=BLOCK) as pool:
        board = pool_boards()[pool.pool_id]
        with StateBoardReader(board) as reader:
            state = wait_until(reader.read, "the control plane's first publish")

        def listed_alive():
            line = ps.pool_line(pool.pool_id, board)
            return line if line.split()[2:4] == ["alive", "1/1"] else None

        line = wait_until(listed_alive, "lmpool ps to list the pool alive")
    assert (state.pool_id, state.owner_pid, state.world_size, [r.rank for r in state.ranks]) == (
        pool.pool_id, os.getpid(), 1, [0])
    assert line.split()[:2] == [pool.pool_id, str(os.getpid())]


def test_top_of_a_pool_that_does_not_exist():
    for command in ([LMPOOL, "top", "0123abcd"], [LMPOOL + "-top", "--once", "0123abcd"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1
        assert "no LMPool pool '0123abcd' on this machine" in done.stderr
        assert done.stdout == ""
