"""Following one pool's state board over time: rates, recent history and a liveness verdict.

A ``PoolMonitor`` reads the board (read-only: the pool cannot tell it is there) each time
it is sampled and keeps the last few distinct states, from which it derives tokens/s and
route queries/s. Counters restart when a worker or the control process does; a rate never
goes negative because of that.

Verdict: a pool is ``dead`` when its board was removed, its owner or control process is
gone, or nothing was published for ``STALE_S`` (a frozen or stopped control plane looks
exactly like that); ``starting`` before the first publish; ``alive`` otherwise. A rank is
alive only in a live pool, with the control plane counting it alive and its worker pid
running, so a pool killed with SIGKILL shows dead rows rather than its last numbers. A
board whose contents do not decode as a pool state (planted, or garbage) is ``dead`` too,
with that reason.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

from lmpool.protocol.state_board import PoolState, RankRow, StateBoardReader, pool_boards
from lmpool_ipc import BoardBusyError, pid_alive

STALE_S = 2.0  # no publish for this long: the control plane is gone or frozen
RATE_WINDOW = 9  # samples a rate is taken over: 2 s of publishes, to smooth one step's jitter
TREND = 120  # rates kept per rank for the sparklines


class PoolNotFound(LookupError):
    """No pool matches what was asked for; the message says what to do."""


@dataclass
class RankView:
    row: RankRow
    alive: bool
    tokens_per_s: float
    trend: deque

    @property
    def hit_rate(self) -> float | None:
        return self.row.prefix_hit_tokens / self.row.prompt_tokens if self.row.prompt_tokens else None


@dataclass
class PoolView:
    pool_id: str
    owner_pid: int
    verdict: str  # "alive", "dead" or "starting"
    reason: str  # why dead; empty otherwise
    state: PoolState | None
    age_s: float  # since the latest publish
    tokens_per_s: float = 0.0
    route_qps: float = 0.0
    trend: deque = field(default_factory=deque)
    ranks: list[RankView] = field(default_factory=list)

    @property
    def hit_rate(self) -> float | None:
        prompt = sum(r.row.prompt_tokens for r in self.ranks)
        return sum(r.row.prefix_hit_tokens for r in self.ranks) / prompt if prompt else None


def find_pool(prefix: str | None) -> tuple[str, str]:
    """(pool id, board name) of the pool whose id starts with ``prefix``; with no prefix,
    of the one pool whose owner is alive. Raises ``PoolNotFound`` saying why not."""
    pools = pool_boards()
    if prefix is None:
        live = {p: n for p, n in pools.items() if pid_alive(owner_of(n))}
        if len(live) == 1:
            return next(iter(live.items()))
        if not live:
            raise PoolNotFound("no LMPool pool is running on this machine")
        raise PoolNotFound(f"{len(live)} pools are running; name one (lmpool ps lists them)")
    matches = {p: n for p, n in pools.items() if p.startswith(prefix.lower())}
    if not matches:
        raise PoolNotFound(
            f"no LMPool pool {prefix!r} on this machine: it never ran, or it shut down "
            "(lmpool ps lists the pools there are)"
        )
    if len(matches) > 1:
        raise PoolNotFound(f"{prefix!r} matches {len(matches)} pools: give more of the id")
    return next(iter(matches.items()))


def owner_of(board: str) -> int:
    """The owner pid a board's name carries: ``/lmpool-<pool id>-<owner pid>-board-<label>``."""
    return int(board.split("-")[2])


class PoolMonitor:
    def __init__(self, pool_id: str, board: str) -> None:
        self.pool_id = pool_id
        self.owner_pid = owner_of(board)
        self.reader = StateBoardReader(board)
        self.samples: deque[PoolState] = deque(maxlen=RATE_WINDOW)
        self.rank_trends: dict[int, deque] = {}
        self.trend: deque = deque(maxlen=TREND)

    def close(self) -> None:
        self.reader.close()

    def sample(self) -> PoolView:
        try:
            state = self.reader.read()
        except BoardBusyError:  # the writer kept writing (or died mid-write): keep the last
            state = None
        except (msgspec.ValidationError, msgspec.DecodeError) as e:  # planted, or garbage
            reason = f"its state board holds no valid pool state ({e})"
            return PoolView(self.pool_id, self.owner_pid, "dead", reason, None, 0.0, trend=self.trend)
        if state is None and self.samples:
            state = self.samples[-1]
        if state is not None and (not self.samples or state.monotonic != self.samples[-1].monotonic):
            self._add(state)
        verdict, reason = self._verdict(state)
        age = time.monotonic() - state.monotonic if state is not None else 0.0
        view = PoolView(self.pool_id, self.owner_pid, verdict, reason, state, age, trend=self.trend)
        if state is None:
            return view
        alive = verdict == "alive"
        rates = self._rates() if alive else {}
        view.tokens_per_s = sum(rates.values())
        view.route_qps = self._route_qps() if alive else 0.0
        view.ranks = [
            RankView(row, alive and row.alive and pid_alive(row.pid), rates.get(row.rank, 0.0),
                     self.rank_trends.setdefault(row.rank, deque(maxlen=TREND)))
            for row in state.ranks
        ]
        return view

    def _verdict(self, state: PoolState | None) -> tuple[str, str]:
        if self.reader.removed():
            return "dead", "its state board is gone: the pool shut down or was cleaned up"
        if not pid_alive(self.owner_pid):
            return "dead", f"its owner process {self.owner_pid} is gone"
        if state is None:
            return "starting", ""
        if not pid_alive(state.control_pid):
            return "dead", f"its control process {state.control_pid} is gone"
        age = time.monotonic() - state.monotonic
        if age > STALE_S:
            return "dead", f"its control plane has published nothing for {age:.1f} s"
        return "alive", ""

    def _add(self, state: PoolState) -> None:
        """Record a new distinct state, and the per-publish rates the sparklines draw."""
        if self.samples:
            before = self.samples[-1]
            total = 0.0
            for rank, rate in _token_rates(before, state).items():
                self.rank_trends.setdefault(rank, deque(maxlen=TREND)).append(rate)
                total += rate
            self.trend.append(total)
        self.samples.append(state)

    def _rates(self) -> dict[int, float]:
        if len(self.samples) < 2:
            return {}
        return _token_rates(self.samples[0], self.samples[-1])

    def _route_qps(self) -> float:
        first, last = self.samples[0], self.samples[-1]
        if len(self.samples) < 2 or first.control_pid != last.control_pid:
            return 0.0
        return max(0, last.route_queries - first.route_queries) / (last.monotonic - first.monotonic)


def _token_rates(before: PoolState, after: PoolState) -> dict[int, float]:
    """Tokens/s per rank between two states; a restarted worker's counter counts from 0."""
    dt = after.monotonic - before.monotonic
    earlier = {row.rank: row for row in before.ranks}
    rates = {}
    for row in after.ranks:
        prev = earlier.get(row.rank)
        same_worker = prev is not None and prev.pid == row.pid and prev.epoch == row.epoch
        start = prev.generated_tokens if same_worker and prev.generated_tokens <= row.generated_tokens else 0
        rate = (row.generated_tokens - start) / dt if dt > 0 else 0.0
        rates[row.rank] = rate if math.isfinite(rate) else 0.0  # two states a hair apart: no rate
    return rates
