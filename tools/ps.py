"""``lmpool ps``: the LMPool pools on this machine, one line each, found by their state boards
in ``/dev/shm``. A pool whose owner died stays listed, as dead, until the next pool start
sweeps its shared memory away.
"""

from __future__ import annotations

import argparse
import sys
import time

from lmpool.protocol.state_board import StateBoardReader, pool_boards
from lmpool_ipc import BoardBusyError, pid_alive
from lmpool_tools.monitor import STALE_S
from lmpool_tools.top import duration

COLUMNS = f"{'POOL':<32} {'OWNER':>8} {'STATE':<8} {'RANKS':>5} {'RUN':>5} {'WAIT':>5} {'UPTIME':>9}"


def pool_line(pool_id: str, board: str) -> str:
    try:
        with StateBoardReader(board) as reader:
            owner = reader.owner_pid
            state = reader.read()
    except PermissionError:
        return f"{pool_id:<32} {'?':>8} {'other user':<8}"
    except (FileNotFoundError, BoardBusyError):
        return f"{pool_id:<32} {'?':>8} {'unknown':<8}"
    if state is None:
        status = "starting" if pid_alive(owner) else "dead"
        return f"{pool_id:<32} {owner:>8} {status:<8}"
    stale = time.monotonic() - state.monotonic > STALE_S
    alive = pid_alive(owner) and pid_alive(state.control_pid) and not stale
    end = time.time() if alive else state.published_at
    ranks = f"{sum(r.alive and pid_alive(r.pid) for r in state.ranks) if alive else 0}/{state.world_size}"
    running = sum(r.num_running for r in state.ranks)
    waiting = sum(r.num_waiting for r in state.ranks)
    return (
        f"{pool_id:<32} {owner:>8} {'alive' if alive else 'dead':<8} {ranks:>5} {running:>5} {waiting:>5}"
        f" {duration(end - state.started_at):>9}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmpool ps", description="List the LMPool pools on this machine.")
    parser.parse_args(sys.argv[1:] if argv is None else argv)
    pools = pool_boards()
    if not pools:
        print("no LMPool pools on this machine")
        return 0
    print(COLUMNS)
    for pool_id, board in sorted(pools.items()):
        print(pool_line(pool_id, board))
    return 0


if __name__ == "__main__":
    sys.exit(main())
