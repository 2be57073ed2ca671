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

from lmpool.config import RoutingConfig
from lmpool.config.transfer import TransferPolicyConfig


class EngineArgs(msgspec.Struct, kw_only=True):
    """The per-replica ``EngineConfig`` fields (minus the device, which is per rank)."""

    model: str
    dtype: str | None = None
    block_size: int = 256
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    use_kernels: bool = True
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9  # of each GPU, for all its replicas (``PoolConfig.engine_of``)
    cpu_kv_cache_bytes: int = 256 << 20
    seed: int = 0


class WorkerSpec(msgspec.Struct, kw_only=True):
    rank: int
    epoch: int
    device: str
    engine_end: str  # link end to the user process
    control_end: str  # link end to the control process
    engine_args: EngineArgs
    heartbeat_interval: float = 0.5
    world_size: int = 1
    transfer_rendezvous: str | None = None  # KV transfers between workers, when set
    gpu_transfer_path: str = "auto"  # between two GPUs: "auto" (pull where reachable) or "nccl"
    transfer_lease_s: float = 10.0  # a plan silent this long is aborted on the worker
    foreground_release: bool = False  # ask the control plane to move blocks before evicting them
    foreground_wait_s: float = 1.0  # how long admission waits for such a move
    foreground_retry_s: float = 1.0  # after a refused or failed move, evict for this long


class ControlSpec(msgspec.Struct, kw_only=True):
    world_size: int
    device: str  # "cpu" or "cuda": where the topology comes from
    block_size: int
    routing: str
    pairs: list[tuple[int, int]] | None  # logical NVLink pairs; None: every rank partners every other
    gpu_of_rank: list[int] | None
    engine_end: str
    worker_ends: list[str | None]  # None for a rank that is down
    transfers: bool = False  # workers can exchange KV blocks (they hold a transfer rendezvous)
    heartbeat_interval: float = 0.5
    pool_id: str = ""
    owner_pid: int = 0  # the user process
    started_at: float = 0.0  # wall-clock time the pool started
    board: str | None = None  # the pool-state board to publish on (``state_board``)
    worker_pids: list[int] = []
    routing_config: RoutingConfig = msgspec.field(default_factory=RoutingConfig)  # the policies' thresholds
    transfer_mode: str = "none"  # which automatic transfer policies run (``transfer_config``)
    background_copy_max_blocks: int = 8
    background_copy_batch_max_blocks: int = 128
    transfer_policy: TransferPolicyConfig = msgspec.field(default_factory=TransferPolicyConfig)
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
