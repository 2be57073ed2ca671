"""Requests from the user process (frontend) to the control process, and their replies
(``lmpool_ipc.Requester``: one reply per request, matched by the RPC layer)."""

from __future__ import annotations

import msgspec

from lmpool.protocol.base import BlockHash, LoadReport, Message


class RouteQuery(Message, tag="route"):
    request_id: str
    block_hashes: list[BlockHash]  # chained hashes of the prompt's complete blocks
    num_prompt_tokens: int
    max_tokens: int
    pinned: int | None = None  # a rank the caller chose: the router accounts for it there, choosing nothing


class RouteDecision(Message, tag="decision"):
    rank: int
    matched_blocks: int = 0  # prefix blocks the chosen rank already holds (as the page table saw them)
    reason: str = ""  # which rule chose the rank, for logs and benchmarks
    predicted_ttft_s: float | None = None  # the price's time to first token there, when the policy prices
    # The request's cascade group, where the pool prices by groups (``RoutingConfig.cascade_groups``):
    # the last block hash of the prefix it shares with other routed prompts
    # (``lmpool.control.pricing.price.group_key``), None where it shares none. The frontend passes it
    # on in the ``AddRequest``; its worker counts the request under it (``LoadReport.group_heads``).
    # Last, defaulting to None: a sender from before it still decodes.
    group: BlockHash | None = None


class ReleaseRoute(Message, tag="release_route"):
    """The request routed as ``request_id`` (the route's id) will never reach its rank: its caller
    gave up while the route waited (on a route-time pull), or aborted it. Release its reservation
    there now rather than at its expiry. Answered with None."""

    request_id: str


class RankDown(Message, tag="rank_down"):
    """The engine saw rank ``rank`` die: forget its blocks and stop routing to it."""

    rank: int


class RankUp(Message, tag="rank_up"):
    rank: int
    epoch: int


class WaitRanks(Message, tag="wait_ranks"):
    """Reply once each of ``ranks`` has delivered a snapshot (or died): routing then sees them."""

    ranks: list[int]


class StatsQuery(Message, tag="stats"):
    pass


class Quiesce(Message, tag="quiesce"):
    """Start no transfer from now on, and reply once every open plan has ended (the pool's
    ``reset``, before this control process is replaced): no block stays pinned for it."""


# msgspec lets a frozen struct extend an unfrozen one; mypy reads it with dataclass rules.
class StepKindFit(Message, kw_only=True, frozen=True):  # type: ignore[misc]
    """How well a rank's priced step time predicts one kind of its steps
    (``lmpool.control.pricing.step_accuracy``: decode, cascade, prefill or mixed)."""

    kind: str
    steps: int = 0  # of this kind, since the rank's first report
    predicted_over_measured: float = 1.0  # recent geometric mean
    within_25pct: float = 0.0  # recent share of steps predicted within 25 %
    # The last few steps of this kind, each [seconds measured, seconds predicted, then its
    # ``StepSample`` shape: prefill tokens, attention pairs, decoding sequences, their context,
    # cascade pairs, prefill keys]: what a badly predicted kind's misses were made of.
    recent: list[list[float]] = []


class StepFit(Message, kw_only=True, frozen=True):  # type: ignore[misc]
    """A rank's fitted step time (``lmpool.control.pricing.step_model``): a step's seconds are
    base + per prefill token + per attention pair + per decoding sequence + per context token
    + per cascade pair + per key a prefill reads. The cascade pair's and the key's came last: a
    reader from before them still decodes."""

    base_ms: float = 0.0
    prefill_us_per_token: float = 0.0
    attention_ns_per_pair: float = 0.0
    decode_us_per_seq: float = 0.0
    context_us_per_token: float = 0.0
    samples: int = 0  # steps fitted since calibration
    calibrated: bool = False
    error: float = 0.0  # recent mean |relative error| of its predictions
    speed: float = 1.0  # its recent steps' measured time over the pooled fit's (the coefficients include it)
    kinds: list[StepKindFit] = []  # its priced predictions by kind of step
    cascade_ns_per_pair: float = 0.0
    prefill_ns_per_key: float = 0.0
    # Its worker's last calibration steps, each as ``StepKindFit.recent`` lists a step, predicted
    # by that calibration's own fit: what the prior a rank started from was made of.
    calibration: list[list[float]] = []


class RankState(Message, kw_only=True):
    rank: int
    alive: bool
    epoch: int
    snapshot_version: int
    heartbeat_age_s: float
    load: LoadReport
    cached_blocks: int
    step_fit: StepFit = StepFit()
    loop_ms: dict[str, list[float]] = {}  # its worker's latest ``StepTimings.loop_ms``


class TransferStats(Message, kw_only=True):
    """The control plane's KV transfer counters (all plans: explicit, background, foreground)."""

    plans_started: int = 0
    plans_committed: int = 0
    plans_aborted: int = 0
    plans_open: int = 0
    blocks_copied: int = 0  # blocks of committed plans that the source kept
    blocks_moved: int = 0  # blocks of committed moves that the source gave up
    lease_routed: int = 0  # requests routed to a copy because of a placement lease
    leases: int = 0  # placement leases held now
    background_ticks: int = 0
    background_copies: int = 0  # committed background plans
    background_blocks: int = 0  # blocks they copied
    foreground_requests: int = 0  # shortage reports received
    foreground_moves: int = 0  # committed foreground plans
    foreground_refused: int = 0  # shortage reports answered without a move
    foreground_failed: int = 0  # foreground plans that aborted
    admission_admitted: int = 0
    admission_refused: int = 0
    placement_refused: dict[str, int] = {}  # background candidates refused, per gate
    in_flight_blocks: int = 0  # page-table entries marked in flight now
    reservations: int = 0  # route reservations held now
    pulls_started: int = 0  # route-time pull plans opened
    pulls_moved: int = 0  # ... that moved the chain's unshared blocks (freed on their source)
    pulls_shared: int = 0  # requests that waited on a pull another request opened
    pulls_landed: int = 0  # pulls whose destination published
    pulls_aborted: int = 0  # pulls that aborted first (their requests recompute)
    pulls_routed: int = 0  # requests sent elsewhere than the routing policy chose
    pulls_open: int = 0
    reconnects: int = 0  # worker pairs connected again after their data path broke (``data_paths``)
    # kind -> phase -> [median ms, max ms, plans] from its start to each phase's end (and to each
    # side's prepare answer), over the last completed plans (``control.transfers.phase_times``).
    plan_phases_ms: dict[str, dict[str, list[float]]] = {}


class ControlStats(Message, tag="control_stats", kw_only=True):
    pid: int
    ranks: list[RankState]
    route_queries: int
    route_p50_us: float
    route_p99_us: float
    resyncs: int
    stale_rejected: int
    transfers: TransferStats = msgspec.field(default_factory=TransferStats)


class TransferChain(Message, tag="transfer_chain"):
    """Copy (or move) the cached chain ``block_hashes`` (complete blocks from the first) from
    ``src`` to ``dst``; the reply is a ``TransferResult`` once the plan has ended."""

    src: int
    dst: int
    block_hashes: list[BlockHash]
    move: bool = False


class TransferResult(Message, tag="transfer_result"):
    plan_id: int
    state: str  # "done" or "aborted"
    reason: str = ""
    seconds: float = 0.0  # from the plan's prepare to its end, on the control process's clock


class BlockDigests(Message, tag="block_digests"):
    """Ask ``rank`` for a digest of the KV bytes of each cached block in ``block_hashes``."""

    rank: int
    block_hashes: list[BlockHash]


class DigestsReply(Message, tag="digests"):
    digests: list[str]  # "" for a block the rank does not cache


FrontendToControl = (RouteQuery | ReleaseRoute | RankDown | RankUp | WaitRanks | StatsQuery | Quiesce
                     | TransferChain | BlockDigests)
