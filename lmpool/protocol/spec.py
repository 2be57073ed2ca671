"""What a child process needs to know at start-up, passed as JSON on its command line.

A child reads its spec (``LMPOOL_SPEC`` in its environment) with ``read_spec``, which also ties its life to its parent's
(Linux ``PR_SET_PDEATHSIG``), so no child outlives the user process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any

import msgspec

from lmpool.config.pool import PoolConfig


class WorkerSpec(msgspec.Struct, kw_only=True):
    rank: int
    epoch: int
    frontend_end: str  # link end to the user process
    control_end: str  # link end to the control process
    pool: PoolConfig  # the whole tree: this rank's engine is ``pool.engine_of(rank)``
    transfer_rendezvous: str | None = None  # KV transfers between workers, when set


class ControlSpec(msgspec.Struct, kw_only=True):
    pool: PoolConfig
    frontend_end: str
    worker_ends: list[str | None]  # None for a rank that is down
    transfers: bool = False  # workers can exchange KV blocks (they hold a transfer rendezvous)
    pool_id: str = ""
    owner_pid: int = 0  # the user process
    started_at: float = 0.0  # wall-clock time the pool started
    board: str | None = None  # the pool-state board to publish on (``state_board``)
    worker_pids: list[int] = []
    kv_bytes_per_block: int = 0  # for the transfer cost model
    # The key reads the ranks' cascades must save (``config.engine.cascade_min_saved``; 0: none),
    # for the pricing of a shared prefix read once.
    cascade_min_saved: int = 0


PR_SET_PDEATHSIG = 1
# The spec travels in the environment: it holds the shared-memory names of the pool's links,
# and a command line is readable by every user, an environment only by the process's own.
SPEC_VARIABLE = "LMPOOL_SPEC"


def read_spec(spec_type: type) -> Any:
    """In a child: decode the spec from the environment and tie the child's life to its parent's."""
    spec = os.environ.pop(SPEC_VARIABLE, None)  # not inherited by anything this child starts
    if spec is None:
        raise SystemExit(f"usage: {SPEC_VARIABLE}=SPEC_JSON python -m {sys.argv[0]}")
    die_with_parent()
    return msgspec.json.decode(spec, type=spec_type)


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)
