"""``lmpool ps``: the LMPool pools on this machine, one line each, found by their state boards
in ``/dev/shm``. A pool whose owner died stays listed, as dead, until the next pool start
sweeps its shared memory away. Anyone can plant a file named like a board in ``/dev/shm``:
a board of another user is listed as theirs, unread (also by root: ``lmpool_ipc.board`` maps
only its own user's), and anything else that is no board holding a valid pool state (a
FIFO, a link, a file of the wrong size) as ``invalid`` (and logged), never a crash or a hang.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import msgspec
import posix_ipc

from lmpool.protocol.state_board import StateBoardReader, pool_boards
from lmpool_ipc import BoardBusyError, RingCorruptError, pid_alive
from lmpool_tools.monitor import STALE_S, owner_of
from lmpool_tools.top import duration

log = logging.getLogger("lmpool.ps")

COLUMNS = f"{'POOL':<32} {'OWNER':>8} {'STATE':<8} {'RANKS':>5} {'RUN':>5} {'WAIT':>5} {'UPTIME':>9}"


def pool_line(pool_id: str, board: str) -> str:
    try:
        with StateBoardReader(board) as reader:
            owner = reader.owner_pid
            state = reader.read()
    except (PermissionError, posix_ipc.PermissionsError):
        return f"{pool_id:<32} {'?':>8} {'other user':<8}"
    except (FileNotFoundError, posix_ipc.ExistentialError, BoardBusyError):
        return f"{pool_id:<32} {'?':>8} {'unknown':<8}"
    except (RingCorruptError, msgspec.ValidationError, msgspec.DecodeError, ValueError, OSError) as e:
        return _invalid(pool_id, board, e)
    if owner != owner_of(board):  # a pool's owner writes its own pid in the name and the header
        return _invalid(pool_id, board, f"its header names owner {owner}, its name {owner_of(board)}")
    if state is None:
        status = "starting" if pid_alive(owner) else "dead"
        return f"{pool_id:<32} {owner:>8} {status:<8}"
    stale = time.monotonic() - state.monotonic > STALE_S
    alive = pid_alive(owner) and pid_alive(state.control_pid) and not stale
    end = time.time() if alive else state.published_at
    live = [r for r in state.ranks if alive and r.alive and pid_alive(r.pid)]
    ranks = f"{len(live)}/{state.world_size}"
    running = sum(r.num_running for r in live)  # a dead rank's last report is stale
    waiting = sum(r.num_waiting for r in live)
    return (
        f"{pool_id:<32} {owner:>8} {'alive' if alive else 'dead':<8} {ranks:>5} {running:>5} {waiting:>5}"
        f" {duration(end - state.started_at):>9}"
    )


def _invalid(pool_id: str, board: str, why) -> str:
    """A board named like a pool's that holds no valid pool state: planted, or garbage."""
    log.warning("%s is not a valid LMPool state board (%s); its figures are not shown", board, why)
    return f"{pool_id:<32} {'?':>8} {'invalid':<8}"


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
