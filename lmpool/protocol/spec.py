"""What a child process needs to know at start-up, passed as JSON on its command line.

A child reads its spec with ``read_spec``, which also ties its life to its parent's
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
    engine_end: str  # link end to the user process
    control_end: str  # link end to the control process
    pool: PoolConfig  # the whole tree: this rank's engine is ``pool.engine_of(rank)``
    transfer_rendezvous: str | None = None  # KV transfers between workers, when set


class ControlSpec(msgspec.Struct, kw_only=True):
    pool: PoolConfig
    engine_end: str
    worker_ends: list[str | None]  # None for a rank that is down
    gpu_of_rank: list[int] | None = None
    transfers: bool = False  # workers can exchange KV blocks (they hold a transfer rendezvous)
    pool_id: str = ""
    owner_pid: int = 0  # the user process
    started_at: float = 0.0  # wall-clock time the pool started
    board: str | None = None  # the pool-state board to publish on (``state_board``)
    worker_pids: list[int] = []
    kv_bytes_per_block: int = 0  # for the transfer cost model


PR_SET_PDEATHSIG = 1


def read_spec(spec_type: type) -> Any:
    """In a child: decode the spec from argv and tie the child's life to its parent's."""
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python -m {sys.argv[0]} SPEC_JSON")
    die_with_parent()
    return msgspec.json.decode(sys.argv[1], type=spec_type)


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)
