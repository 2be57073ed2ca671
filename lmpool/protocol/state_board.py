"""The pool-state board: a snapshot of the whole pool that the control process publishes a
few times a second, for monitors (``lmpool top``, ``lmpool ps``, the Prometheus exporter).

The board is the pool's ``lmpool_ipc`` board labelled ``state``: the user process creates
it with the pool's other shared-memory objects (so ``IpcPool.close`` and the sweeper remove
it), and the control process is its only writer. Readers map it read-only and take the
latest ``PoolState`` under a seqlock: however many monitors attach, and however slow they
are, the pool never waits for them and cannot tell they are there.

Invariants: ``published`` grows by one per publish of one control process (a restarted
control process starts again from 1); ``monotonic`` is ``CLOCK_MONOTONIC`` at the publish,
which every process on the machine shares, so a reader measures the board's age with its
own clock. Fields are named on the wire, so a reader tolerates fields it does not know.
A reader takes only a plausible state (counts and times not negative, figures finite, rank
numbers under the world size): anything else is a planted board's, or garbage.
"""

from __future__ import annotations

import math
import os
from typing import Annotated, Self

import msgspec

from lmpool.protocol import RankState
from lmpool_ipc import BoardReader, BoardWriter, boards
from lmpool_ipc.names import SHM_DIR

BOARD_LABEL = "state"
PUBLISH_INTERVAL_S = 0.25
# Upper bounds of the route-latency histogram's buckets, in seconds: a decision takes tens of
# microseconds on a small pool, milliseconds on a loaded large one.
ROUTE_LATENCY_BUCKETS_S = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
                           0.25, 1.0)

# What decoding checks (encoding does not): a negative count, pid or time is no pool's.
Count = Annotated[int, msgspec.Meta(ge=0)]
Version = Annotated[int, msgspec.Meta(ge=-1)]  # -1: none yet
Time = Annotated[float, msgspec.Meta(ge=0)]  # a time or a duration, in the unit its name says


class RankRow(msgspec.Struct, kw_only=True, gc=False):
    """One rank as the control plane sees it; load figures are the worker's last report."""

    rank: Count
    pid: Count  # the worker process
    alive: bool
    epoch: Version
    snapshot_version: Version
    heartbeat_age_s: Annotated[float, msgspec.Meta(ge=-1)]  # since the rank's last report; -1 before its first
    num_waiting: Count = 0
    num_running: Count = 0
    blocks_free: Count = 0
    blocks_reclaimable: Count = 0
    blocks_used: Count = 0
    cached_blocks: Count = 0  # ready blocks the page table lists for this rank
    prompt_tokens: Count = 0  # cumulative, this worker incarnation
    prefix_hit_tokens: Count = 0  # cumulative, this worker incarnation
    generated_tokens: Count = 0  # cumulative, this worker incarnation
    blocks_in_flight: Count = 0  # blocks a transfer is bringing here, not yet published
    leases: Count = 0  # placement leases steering routes here (not yet filled per rank)
    step_ms: Time = 0.0  # a decode step of its running batch, as its fitted step time predicts it

    @classmethod
    def from_state(cls, state: RankState, pid: int, blocks_in_flight: int) -> RankRow:
        load = state.load
        row = cls(
            rank=state.rank, pid=pid, alive=state.alive, epoch=state.epoch,
            snapshot_version=state.snapshot_version, heartbeat_age_s=state.heartbeat_age_s,
            num_waiting=load.num_waiting, num_running=load.num_running,
            blocks_free=load.blocks_free, blocks_reclaimable=load.blocks_reclaimable,
            blocks_used=load.blocks_used, cached_blocks=state.cached_blocks,
            prompt_tokens=load.prompt_tokens, prefix_hit_tokens=load.prefix_hit_tokens,
            generated_tokens=load.generated_tokens, blocks_in_flight=blocks_in_flight,
            step_ms=state.step_fit.base_ms + (state.step_fit.decode_us_per_seq * load.num_running
                                              + state.step_fit.context_us_per_token * load.context_tokens
                                              + state.step_fit.cascade_ns_per_pair * load.cascade_pairs / 1e3) / 1e3,
        )
        # A dead rank queues, runs and holds nothing: its last report is stale, not shown.
        return row if state.alive else msgspec.structs.replace(row, **dict.fromkeys(LIVE_FIGURES, 0))


# Figures of a rank's present state (the cumulative counters stay true after its death).
LIVE_FIGURES = ("num_waiting", "num_running", "blocks_free", "blocks_reclaimable", "blocks_used", "cached_blocks",
                "blocks_in_flight", "step_ms")


class PoolState(msgspec.Struct, kw_only=True, gc=False):
    pool_id: str
    owner_pid: Count  # the user process: the pool lives as long as it does
    control_pid: Count
    started_at: Time  # wall-clock time the pool started
    published: Count  # publish counter of this control process
    published_at: Time  # wall-clock time of this publish
    monotonic: Time  # CLOCK_MONOTONIC seconds at this publish
    world_size: Count
    route_queries: Count = 0  # cumulative, this control process
    route_p50_us: Time = 0.0  # over the last few thousand route decisions
    route_p99_us: Time = 0.0
    # Decisions at or below each bound of ROUTE_LATENCY_BUCKETS_S, and their seconds in all (this
    # control process; route_queries counts them all).
    route_latency_buckets: list[Count] = []
    route_latency_sum_s: Time = 0.0
    transfers_committed: Count = 0  # KV transfer plans that completed, cumulative, this control process
    blocks_transferred: Count = 0  # blocks those plans copied or moved
    ranks: list[RankRow] = []


def board_capacity(world_size: int) -> int:
    """Bytes a board needs for a pool of ``world_size`` ranks, with room to spare (an
    encoded row is about 300 bytes; untouched pages of the segment cost nothing)."""
    return 4096 + 1024 * world_size


class _BoardSide:
    """What both sides do alike: close their mapping, also as a context manager."""

    _board: BoardWriter | BoardReader

    def close(self) -> None:
        self._board.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StateBoardWriter(_BoardSide):
    """The control process's side: encode and publish. Never waits for readers."""

    _board: BoardWriter

    def __init__(self, name: str) -> None:
        self._board = BoardWriter(name)
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, state: PoolState) -> None:
        self._board.publish(self._encoder.encode(state))


class StateBoardReader(_BoardSide):
    """A monitor's side: the latest ``PoolState`` of one pool, read-only."""

    _board: BoardReader

    def __init__(self, name: str) -> None:
        self.name = name
        self._board = BoardReader(name)
        self._decoder = msgspec.msgpack.Decoder(PoolState)

    @property
    def owner_pid(self) -> int:
        return self._board.owner_pid

    def read(self) -> PoolState | None:
        """The latest published state; None before the first publish. Raises
        ``lmpool_ipc.BoardBusyError`` if the writer was mid-write at every try."""
        value = self._board.read()
        return None if value is None else _in_range(_finite(self._decoder.decode(value)))

    def removed(self) -> bool:
        """True once the board's name is gone (the pool shut down, or was swept): the
        mapping still shows the last state, but nothing will publish on it again."""
        return not os.path.exists(SHM_DIR + self.name)


def _finite(state: PoolState) -> PoolState:
    """``state`` if every figure in it is finite; a ``msgspec.ValidationError`` otherwise (NaN or
    inf, a planted board's, would crash a display that formats durations and rates)."""
    for struct in (state, *state.ranks):
        for name in struct.__struct_fields__:
            value = getattr(struct, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise msgspec.ValidationError(f"{type(struct).__name__}.{name} is {value}")
    return state


def _in_range(state: PoolState) -> PoolState:
    """``state`` if its rows are of ranks it has; a ``msgspec.ValidationError`` otherwise (the
    field types already refuse negative figures)."""
    ranks = [row.rank for row in state.ranks]
    if len(ranks) > state.world_size or any(rank >= state.world_size for rank in ranks):
        raise msgspec.ValidationError(f"rows of ranks {ranks[:8]} in a pool of {state.world_size}")
    return state


def pool_boards() -> dict[str, str]:
    """Pool id -> board name, for every pool on this machine with a state board."""
    return {b.parsed.pool_id: b.name for b in boards(BOARD_LABEL)}
