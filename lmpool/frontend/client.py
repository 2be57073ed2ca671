"""``PoolClient``: the user-process side of a pool. It launches, wires and supervises the
control process and N workers, and carries every request from ingress to its last token.

Flow of one request: validate at ingress -> chain the prompt's complete-block
hashes -> ask the control plane for a rank -> send the sequence to that
worker -> collect its tokens as they stream back. With route-time pulls the control
plane answers once the request's prefix has landed on its rank (or the pull aborted),
so a worker never sees a pulled request before its blocks.

Supervision: every link watches its peer's pid, so a dead process surfaces as
an ``IpcError`` on its channel; with ``hang_timeout`` it also watches the peer's
heartbeat, so a hung one (alive but silent) is killed and surfaces the same way. A dead
worker's unfinished requests are routed to live ranks and recomputed from prompt + tokens generated so far; the caller
sees no error while one rank lives, unless its request loses a second rank
(``MAX_REROUTES``). A dead control process is restarted on
fresh links, and every live worker re-attaches and sends a full snapshot.

Invariants: a request is in ``requests`` from ingress until its final token
(or abort), and then never again; each request has exactly one rank at a time.
Everything here runs on the one event loop that called ``start()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import subprocess
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import torch

from lmpool.config.pool import PoolConfig, reset_config
from lmpool.config.transfer_profile import TransferProfile
from lmpool.engine.hashing import chain_hashes
from lmpool.engine.model_runner import planned_cascades, resolve_dtype
from lmpool.engine.validation import check_prompt, check_wire_size, validate_request
from lmpool.errors import ArgumentTypeError, strict_bool
from lmpool.frontend import launcher as process
from lmpool.frontend.metrics import NO_METRICS
from lmpool.frontend.rendezvous import Rendezvous
from lmpool.model.config import ModelConfig
from lmpool.protocol import (
    AbortRequest,
    AddRequest,
    AttachControl,
    BlockDigests,
    ControlStats,
    DigestsReply,
    Quiesce,
    RankDown,
    ReleaseRoute,
    RequestRejected,
    RouteDecision,
    RouteQuery,
    Shutdown,
    StatsQuery,
    StepFit,
    StepOutputs,
    TokenDelta,
    TransferChain,
    TransferResult,
    WaitRanks,
    WorkerFailed,
    WorkerReady,
    WorkerToFrontend,
)
from lmpool.protocol.frontend_worker import pack_ids
from lmpool.protocol.spec import ControlSpec, WorkerSpec
from lmpool.protocol.state_board import BOARD_LABEL, board_capacity
from lmpool.sampling_params import SamplingParams
from lmpool_ipc import DEFAULT_CAPACITY, Channel, IpcError, IpcPool, Link, LinkError, RemoteError, Requester
from lmpool_ipc.frames import max_payload

# Rank deaths a request survives: it is recomputed elsewhere once. A request whose second
# rank dies too fails instead, so that one request that crashes workers (a bug it triggers)
# cannot take down every rank of the pool in turn.
MAX_REROUTES = 1
LIVE_STATS = ("num_waiting", "num_running", "blocks_free", "blocks_reclaimable", "blocks_used", "cached_blocks")
MAX_MESSAGE_BYTES = max_payload(DEFAULT_CAPACITY)  # the most one message between the pool's processes holds
# A worker's snapshot of its cache to the control plane takes about 1.1 kB per cached block at
# 256 tokens (two 32-byte hashes and the block's token ids): some 14k blocks per message; a larger
# one goes in parts (``lmpool.worker.report_parts``). Ring pages are touched only as they are used.
CONTROL_LINK_CAPACITY = 16 << 20
# A request's hand-over to its rank carries its prompt's ids, about 68 kB for 16k tokens; the
# worker reads its link only when its loop yields. At 1 MiB a burst's 32 questions over one 16k
# document filled a rank's ring after 14, and each later send would wait for that rank's next
# turn; 8 MiB holds about 120 such requests. (A burst's hand-over, 130 ms median over 16k
# questions, is its submissions' CPU work in series, not these sends: ``eval_NOTES.md``.)
WORKER_LINK_CAPACITY = 8 << 20


def step_fit_dict(fit: StepFit) -> dict:
    """A rank's step fit as ``stats()`` gives it: a dict, each kind of step's accuracy one too."""
    return msgspec.structs.asdict(fit) | {"kinds": [msgspec.structs.asdict(k) for k in fit.kinds]}


class PoolError(RuntimeError):
    """The pool cannot serve: it failed to start, or no rank is left alive."""


@dataclass
class Rank:
    rank: int
    proc: subprocess.Popen
    channel: Channel
    alive: bool = True
    num_blocks: int = 0
    epoch: int = 1
    spawned: float = 0.0  # time.monotonic() of its process's spawn
    # Seconds of each phase of its start (``WorkerReady.start_phases``), and before them its
    # process's launch and imports ("launch": from its spawn to its engine's first phase).
    start_phases: dict[str, float] = field(default_factory=dict)


@dataclass
class TrackedRequest:
    request_id: str
    # A tuple: it holds ints only, so the collector stops tracking it at its first look. A list of a
    # 16k-token prompt is 16k references every collection of its generation walks: a burst of 128
    # such requests, held twice each, made one young collection of the user process take 50-60 ms.
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    rank: int = -1
    route: str = ""  # the latest routing decision's reason (``RouteDecision.reason``), or "pinned"
    # From ``arrival``: the wait before the latest route, plus its price (``RouteDecision.predicted_ttft_s``).
    predicted_ttft_s: float | None = None
    # The id the worker knows this dispatch by: new for every dispatch, so tokens still in
    # flight from an aborted request, or from a rank the request left, never match it.
    wire_id: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    # Its rank's share of the time to its first token (``TokenDelta.queued_s``, ``first_step_s``),
    # and before it the seconds from the start of its send there to its arrival at that rank's worker.
    queued_s: float | None = None
    first_step_s: float | None = None
    intake_s: float | None = None
    finish_reason: str | None = None
    reroutes: int = 0
    arrival: float = field(default_factory=time.monotonic)  # its submission (``AsyncLMPool.submit``'s call)
    last_token_at: float = 0.0  # time.monotonic() of the latest token, for inter-token latency
    dispatched: float = 0.0  # time.monotonic() of the latest hand-over to a rank (0 before the first)
    sent: float = 0.0  # ... and of the start of its send (``intake_s`` runs from it)
    block_hashes: list = field(default_factory=list)  # the prompt's complete blocks' (``chain_hashes``)
    prompt_ids: bytes = b""  # its prompt's ids as its ``AddRequest`` carries them (``pack_ids``)
    # TokenDelta for every new token, then None at the end (or an exception).
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


def with_gpus(config: PoolConfig) -> PoolConfig:
    """``config`` with its GPU count set (``PoolConfig.gpus``): every CUDA device torch sees in
    this process, which its workers inherit."""
    if config.device != "cuda" or config.gpus is not None:
        return config
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
    return msgspec.structs.replace(config, gpus=count)


class PoolClient:
    def __init__(self, config: PoolConfig) -> None:
        config = self.config = with_gpus(config)
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.block_size = config.engine.block_size
        self.max_model_len = config.engine.max_model_len or self.model_config.max_context
        profile = config.transfer.transfer_policy.transfer_profile
        if profile is not None:  # refused here, with its reason, rather than in the control process
            try:
                TransferProfile.read(profile, self.kv_bytes_per_block())
            except (OSError, ValueError) as e:
                raise ValueError(f"transfer_profile {profile!r} cannot be used: {e}") from None
        self.ipc: IpcPool | None = None
        self.rendezvous: Rendezvous | None = None  # the workers' transfer rendezvous, if enabled
        self.board: str | None = None  # the pool-state board (``state_board``)
        self.started_at = 0.0
        self.metrics = NO_METRICS  # token timing; a Prometheus recorder when metrics are on
        self.ranks: list[Rank] = []
        self.control_proc: subprocess.Popen | None = None
        self.control: Requester | None = None
        self._control_channel: Channel | None = None
        self._control_links: list[Link] = []  # the control process's links (``_spawn_control``)
        self._control_lock = asyncio.Lock()
        self._serving = asyncio.Event()  # cleared while any ``reset`` is pending: routes wait for it
        self._serving.set()
        self._resets: set[asyncio.Task] = set()  # ``reset``'s work, each on a task of its own
        self.control_restarts = 0
        self.requests: dict[str, TrackedRequest] = {}
        self._by_wire: dict[str, TrackedRequest] = {}
        self._wire_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self._teardown: asyncio.Task | None = None  # ``shutdown``'s work, once begun
        self._releases: set[asyncio.Task] = set()  # ``ReleaseRoute`` messages on their way
        self._loop: asyncio.AbstractEventLoop | None = None

    def _check_loop(self) -> None:
        """A pool is bound to the loop it started on: from any other, every wait would hang."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # called outside any loop: nothing to compare
            return
        if self._loop is not None and running is not self._loop:
            raise PoolError("this pool was started on another event loop and can only be used from that one")

    # ---- start-up ---------------------------------------------------------------

    async def start(self) -> None:
        if self._closed:  # its processes and shared memory are gone for good
            raise PoolError("this pool was shut down and cannot start again: create a new one")
        if self.ipc is not None:
            raise PoolError("this pool is already started")
        self._loop = asyncio.get_running_loop()  # its channels and tasks live on this loop
        self.ipc = IpcPool.start()  # also removes what crashed pools left in /dev/shm
        if self.config.transfer.enable_transfers:
            self.rendezvous = Rendezvous.create()
        self.started_at = time.time()
        try:
            await self._start_processes()
        except BaseException:
            await self.shutdown()
            raise

    async def _start_processes(self) -> None:
        cfg = self.config
        assert self.ipc is not None  # start() made it
        self.board = self.ipc.create_board(BOARD_LABEL, board_capacity(cfg.world_size))
        control_links = []
        for r in range(cfg.world_size):
            link = self.ipc.create_link(WORKER_LINK_CAPACITY)
            control_links.append(self.ipc.create_link(CONTROL_LINK_CAPACITY))
            spec = WorkerSpec(
                rank=r, epoch=1, frontend_end=link.b, control_end=control_links[r].b, pool=cfg,
                transfer_rendezvous=self.rendezvous.address if self.rendezvous else None,
            )
            spawned = time.monotonic()
            proc = process.spawn("lmpool.worker.main", spec)
            channel: Channel[WorkerToFrontend] = Channel(link.a, WorkerToFrontend)
            channel.expect_peer(proc.pid)
            self.ranks.append(Rank(r, proc, channel, spawned=spawned))
        await self._spawn_control(dict(enumerate(control_links)))
        await asyncio.gather(*(self._await_ready(rank) for rank in self.ranks))
        for rank in self.ranks:
            self._tasks.append(asyncio.create_task(self._read_worker(rank)))
        await self.control_request(WaitRanks(list(range(cfg.world_size))))

    async def _await_ready(self, rank: Rank) -> None:
        try:
            msg = await asyncio.wait_for(rank.channel.recv(), self.config.ready_timeout)
        except asyncio.TimeoutError:
            raise PoolError(
                f"rank {rank.rank} did not become ready within {self.config.ready_timeout:g} s"
            ) from None
        except IpcError:
            code = rank.proc.wait()
            raise PoolError(f"rank {rank.rank} exited with code {code} during start-up") from None
        if isinstance(msg, WorkerFailed):
            raise PoolError(f"rank {rank.rank} failed to start: {msg.error}")
        assert isinstance(msg, WorkerReady)
        rank.num_blocks = msg.num_blocks
        launch = time.monotonic() - rank.spawned - sum(msg.start_phases.values())
        rank.start_phases = {"launch": round(max(0.0, launch), 4), **msg.start_phases}
        # Watched only from now: while it loaded the model its loop could not beat.
        assert not isinstance(self.config.hang_timeout, str)  # PoolConfig resolved "auto"
        rank.channel.watch_heartbeat(self.config.hang_timeout)

    async def _spawn_control(self, worker_links: dict[int, Link]) -> None:
        """Start a control process reaching each rank of ``worker_links`` on its link (a rank
        without one is down); the links it holds are ``_control_links`` until it is replaced."""
        cfg = self.config
        assert self.ipc is not None  # start() made it
        link = self.ipc.create_link()
        self._control_links = [link, *worker_links.values()]
        worker_ends = [worker_links[r].a if r in worker_links else None for r in range(cfg.world_size)]
        spec = ControlSpec(
            pool=cfg, frontend_end=link.b, worker_ends=worker_ends,
            pool_id=self.ipc.pool_id, owner_pid=self.ipc.owner_pid, started_at=self.started_at,
            board=self.board, worker_pids=[r.proc.pid for r in self.ranks],
            transfers=self.rendezvous is not None, kv_bytes_per_block=self.kv_bytes_per_block(),
            cascade_min_saved=planned_cascades(self.config.engine_of(0), self.model_config),
        )
        self.control_proc = process.spawn("lmpool.control.main", spec)
        self._control_channel = Channel(link.a, object)
        self._control_channel.expect_peer(self.control_proc.pid)
        assert not isinstance(self.config.hang_timeout, str)  # PoolConfig resolved "auto"
        self._control_channel.watch_heartbeat(self.config.hang_timeout)
        self.control = Requester(
            self._control_channel, RouteDecision | ControlStats | TransferResult | DigestsReply | None
        )

    def kv_bytes_per_block(self) -> int:
        """KV bytes of one block on a rank (the transfer cost model's unit)."""
        dtype = resolve_dtype(self.config.engine_of(0), self.model_config)
        return self.model_config.kv_bytes_per_block(self.block_size, dtype)

    async def _restart_control(self, failed: Requester) -> None:
        """Start a new control process unless another task already replaced ``failed``."""
        async with self._control_lock:
            if self.control is not failed or self._closed:
                return
            self.control_restarts += 1
            await self._replace_control()

    async def _replace_control(self, reset: bool = False) -> None:
        """Stop the control process and start one of ``self.config`` on fresh links; every live
        worker re-attaches (with ``reset``, first forgetting its cached prefixes) and sends a full
        snapshot. Under ``_control_lock``."""
        # A control process (its requester, channel and process) runs while self.control is set.
        assert self.ipc is not None and self.control is not None and self._control_channel is not None
        assert self.control_proc is not None
        self.control.close()
        self._control_channel.close()
        await asyncio.get_running_loop().run_in_executor(None, process.stop, self.control_proc, 1.0)
        if self._closed:  # a shutdown began meanwhile: it stops what runs; start nothing more
            raise PoolError("the pool is shut down")
        # The old process's links go with it: a worker still holding its end keeps it open until
        # it re-attaches, and a pool that resets between every run would otherwise pile them up.
        for old in self._control_links:
            self.ipc.remove_link(old)
        live = [r for r in self.ranks if r.alive]
        links = {r.rank: self.ipc.create_link(CONTROL_LINK_CAPACITY) for r in live}
        await self._spawn_control(links)
        for r in live:
            await self._send_to_rank(r, AttachControl(links[r.rank].b, reset=reset))
        # Routing needs the snapshots; a rank that dies meanwhile releases the wait.
        await self.control.request(WaitRanks([r.rank for r in live]))

    async def reset(self, **options) -> None:
        """Forget every rank's cached prefixes and replace the control process, optionally with
        other ``RESET_OPTIONS`` (another routing rule or transfer mode): the pool then routes,
        caches and counts as a freshly started one, keeping its processes, engines and data
        paths (what a start spends most of its time on). Only an idle pool resets: a request in
        flight is a ``PoolError``, as is a pool that is not running; an option the workers would
        need to restart for is a ``ValueError``. Transfers under way end first, none starts; a
        request submitted meanwhile waits for every pending reset to end.

        The work runs on a task of its own: a caller cancelled meanwhile (a timeout, Ctrl-C)
        leaves it to finish, so the pool is never left half reset. A reset whose new control
        process fails is a ``PoolError``, and the pool goes back to its settings before it."""
        self._check_loop()
        if self._closed or self.ipc is None or self.control is None:
            raise PoolError("the pool is not running")
        if self.requests:
            raise PoolError(f"a pool resets only when idle; {len(self.requests)} requests are in flight")
        config = reset_config(self.config, self.rendezvous is not None, options)
        self._serving.clear()  # from here (no await since the check) a new request waits
        task = asyncio.get_running_loop().create_task(self._reset(config))
        self._resets.add(task)
        task.add_done_callback(self._reset_ended)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and self._closed:  # the shutdown stopped it
                raise PoolError("the pool is shut down") from None
            raise

    def _reset_ended(self, task: asyncio.Task) -> None:
        self._resets.discard(task)
        if not self._resets:
            self._serving.set()
        if not task.cancelled():
            task.exception()  # read: a caller cancelled meanwhile never awaits it

    async def _reset(self, config: PoolConfig) -> None:
        async with self._control_lock:
            if self._closed:
                raise PoolError("the pool is shut down")
            assert self.control is not None  # a running pool has one (``reset`` checked)
            with contextlib.suppress(LinkError):  # a dead control process leaves no plan to wait for
                await self.control.request(Quiesce())
            previous, self.config = self.config, config
            try:
                await self._replace_control(reset=True)
            except LinkError as e:  # the new control process died (say, its KV-event port was taken)
                self.config = previous
                failure = f"the reset's control process failed ({type(e).__name__}: {e})"
            else:
                return
            try:  # back to the settings that served
                await self._replace_control(reset=True)
            except LinkError as e:
                raise PoolError(f"{failure}; so did the restart with the previous settings ({e})") from None
            raise PoolError(f"{failure}; the pool keeps its previous settings")

    async def control_request(self, msg):
        """A request to the control plane, restarting the control process if it died."""
        self._check_loop()
        failure: LinkError | None = None
        for _ in range(3):
            requester = self.control
            try:
                return await requester.request(msg)
            except RemoteError as e:  # the control plane answered with an error: not a crash
                raise PoolError(f"control plane: {e}") from None
            except LinkError as e:  # a MessageError (say, too large) is the request's, not a crash
                failure = e
                if self._closed:
                    raise PoolError("the pool is shut down") from None
                try:
                    await self._restart_control(requester)
                except LinkError as restart:  # the new one died too: the next round tries again
                    failure = restart
        raise PoolError(f"the control process keeps failing ({type(failure).__name__}: {failure})")

    # ---- requests ---------------------------------------------------------------

    def validate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> array:
        """Reject at ingress, on the pool's loop, what no rank could serve, naming the problem;
        the prompt's ids as an int64 array (``check_prompt``'s), for its block hashes."""
        if not self._closed:
            self._check_loop()
        return self.check_request(request_id, prompt_token_ids, params)

    def check_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> array:
        """``validate``'s checks from any thread: the synchronous ``LMPool`` checks a batch on
        its caller's before it hands the batch to the pool's own loop (the caller may run a loop
        of its own: an ``async def``, a notebook's cell)."""
        if self._closed:
            raise PoolError("the pool is shut down")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.ranks and not any(r.alive for r in self.ranks):
            raise PoolError("no rank is alive")
        check_wire_size(len(prompt_token_ids), params, block_size=self.block_size, limit=MAX_MESSAGE_BYTES)
        capacity = max((r.num_blocks for r in self.ranks if r.alive), default=0)
        return validate_request(
            prompt_token_ids, params, vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len, block_size=self.block_size, max_blocks=capacity,
            where="the largest live rank",
        )

    async def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, rank: int | None = None
    ) -> TrackedRequest:
        """Validate, route (or send to ``rank``, bypassing routing) and start one request."""
        return await self.launch(self.prepare(request_id, prompt_token_ids, params, rank), rank)

    def prepare(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, rank: int | None = None,
        arrival: float | None = None,
    ) -> TrackedRequest:
        """A request's work before its route, without a wait: its checks and its prompt's block
        hashes. It is tracked from here on; ``launch`` it next, with no await in between.
        ``arrival``: when it was submitted (``time.monotonic()``; None: now)."""
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise ArgumentTypeError(f"rank must be an integer or None, got {rank!r}")
        prompt_token_ids = tuple(prompt_token_ids)
        ids = self.validate(request_id, prompt_token_ids, params)
        if rank is not None and not (0 <= rank < len(self.ranks) and self.ranks[rank].alive):
            raise ValueError(f"rank {rank} is not a live rank of this pool")
        req = TrackedRequest(request_id, prompt_token_ids, params)
        if arrival is not None:
            req.arrival = arrival
        req.block_hashes = chain_hashes(ids, self.block_size, salt=params.cache_salt)
        req.prompt_ids = pack_ids(ids)
        self.requests[request_id] = req
        return req

    async def launch(self, req: TrackedRequest, rank: int | None = None) -> TrackedRequest:
        """Route (or send to ``rank``) and start a prepared request; forgotten if that fails."""
        try:
            await self._dispatch(req, rank)
        except BaseException:
            self._forget(req)
            raise
        return req

    async def _dispatch(self, req: TrackedRequest, pinned: int | None = None) -> None:
        """Route ``req`` (again, after a failure) and hand it to its rank; one submitted during a
        ``reset`` waits for it, and routes by the new control process on the emptied caches."""
        while True:
            await self._serving.wait()  # returns at once unless a reset runs
            if not any(r.alive for r in self.ranks):
                raise PoolError("no rank is alive")
            # The route's reservation is keyed by this dispatch's wire id: the worker reports
            # admissions by the id it was given, and the control plane releases on that.
            wire_id = str(next(self._wire_ids))
            tokens = [*req.prompt_token_ids, *req.output_token_ids] if req.output_token_ids else req.prompt_token_ids
            hashes = chain_hashes(tokens, self.block_size, req.block_hashes, req.params.cache_salt)
            # A pinned request is routed too, to its rank: the control plane reserves for it there
            # and counts its prefix, as for any route (a dead pinned rank: routed as usual).
            query = RouteQuery(
                wire_id, hashes, len(tokens),
                req.params.max_tokens - len(req.output_token_ids),
                pinned if pinned is not None and self.ranks[pinned].alive else None,
            )
            asked = time.monotonic()
            try:
                decision = await self.control_request(query)
            except PoolError as e:  # the control plane's words name no caller's id
                raise PoolError(f"request {req.request_id!r} could not be routed: {e}") from None
            except asyncio.CancelledError:  # its caller gave up while the route waited (on a pull)
                self._release_route(wire_id)
                raise
            rank = self.ranks[decision.rank]
            req.route, priced = decision.reason, decision.predicted_ttft_s
            # The price runs from the route; the wait before it (the turns, the checks) is known.
            req.predicted_ttft_s = None if priced is None else asked - req.arrival + priced
            if self.requests.get(req.request_id) is not req:
                self._release_route(wire_id)
                return  # aborted while its route waited (on a route-time pull): never start it
            if not rank.alive:
                continue  # the control plane had not yet heard of its death
            if rank.proc.poll() is not None:  # exited, its death not yet seen (it died with another)
                await self._rank_died(rank)
                continue
            self._by_wire.pop(req.wire_id, None)
            req.rank, req.wire_id = rank.rank, wire_id
            self._by_wire[req.wire_id] = req
            msg = AddRequest(req.wire_id, req.prompt_ids, req.params, list(req.output_token_ids), hashes,
                             decision.group)
            req.sent = time.monotonic()  # before the send's await: its first token may come during it
            if await self._send_to_rank(rank, msg):
                req.dispatched = time.monotonic()
                return

    async def transfer(self, prompt_token_ids: list[int], src: int, dst: int, move: bool = False) -> TransferResult:
        """Copy (or move) the KV of the prompt's complete blocks from rank ``src`` to ``dst``."""
        tokens, move = self._checked_chain(prompt_token_ids, src, dst), strict_bool(move, "move")
        if self.rendezvous is None:
            raise PoolError("this pool was started without enable_transfers")
        hashes = chain_hashes(tokens, self.block_size)
        return await self.control_request(TransferChain(src, dst, hashes, move))

    async def block_digests(self, rank: int, prompt_token_ids: list[int]) -> list[str]:
        """SHA-256 of each complete prompt block's KV bytes on ``rank`` ("" where not cached)."""
        tokens = self._checked_chain(prompt_token_ids, rank)
        if self.rendezvous is None:
            raise PoolError("this pool was started without enable_transfers")
        hashes = chain_hashes(tokens, self.block_size)
        return (await self.control_request(BlockDigests(rank, hashes))).digests

    def _checked_chain(self, prompt_token_ids, *ranks) -> list[int]:
        """A transfer's prompt, as token ids checked like a request's, and its ranks checked."""
        for rank in ranks:
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.config.world_size:
                raise ValueError(f"rank {rank!r} is not a rank of this pool (0 to {self.config.world_size - 1})")
        tokens = list(prompt_token_ids)
        check_prompt(tokens, self.model_config.vocab_size)
        return tokens

    async def _send_to_rank(self, rank: Rank, msg) -> bool:
        try:
            await rank.channel.send(msg)
            return True
        except LinkError:  # a MessageError (say, too large) is the request's, raised to its caller
            await self._rank_died(rank)
            return False

    async def abort(self, request_id: str) -> None:
        """Stop a request; an unknown (or already finished) id is a no-op."""
        req = self.requests.get(request_id)
        if req is None:
            return
        self._forget(req)
        req.finish_reason = "abort"
        req.queue.put_nowait(None)
        rank = self.ranks[req.rank]
        if rank.alive:
            await self._send_to_rank(rank, AbortRequest(req.wire_id))

    def _release_route(self, wire_id: str) -> None:
        """Tell the control plane that the route ``wire_id`` will never reach its rank, so that
        its reservation there ends now, not at its expiry (``ReleaseRoute``); sent on its own
        task, as the caller may be unwinding a cancellation."""
        if self._closed or self.control is None:
            return
        task = asyncio.get_running_loop().create_task(self._send_release(wire_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _send_release(self, wire_id: str) -> None:
        try:
            await self.control_request(ReleaseRoute(wire_id))
        except PoolError:  # the pool is shutting down, or the control plane restarting: the reservation expires
            pass

    def _forget(self, req: TrackedRequest) -> None:
        self.requests.pop(req.request_id, None)
        self._by_wire.pop(req.wire_id, None)

    # ---- workers ----------------------------------------------------------------

    async def _read_worker(self, rank: Rank) -> None:
        try:
            async for msg in rank.channel.messages():
                if isinstance(msg, StepOutputs):
                    for delta in msg.outputs:
                        self._deliver(rank, delta)
                elif isinstance(msg, RequestRejected):
                    req = self._by_wire.get(msg.request_id)
                    if req is not None:
                        self._forget(req)
                        # Refused at admission, or failed while running (non-finite logits).
                        req.queue.put_nowait(ValueError(f"request {req.request_id!r}: {msg.error}"))
        except IpcError:
            if not self._closed:
                await self._rank_died(rank)

    def _deliver(self, rank: Rank, delta: TokenDelta) -> None:
        req = self._by_wire.get(delta.request_id)
        if req is None:
            return  # aborted, or a late token from a rank the request has left
        now = time.monotonic()
        if req.output_token_ids:
            self.metrics.inter_token(now - req.last_token_at)
        else:
            self.metrics.first_token(now - req.arrival)
            req.queued_s, req.first_step_s = delta.queued_s, delta.first_step_s
            req.intake_s = intake_seconds(req.sent, delta.arrived_at)
            if not req.reroutes:
                req.num_cached_tokens = min(delta.num_cached_tokens, len(req.prompt_token_ids))
        req.last_token_at = now
        req.output_token_ids.append(delta.token_id)
        req.queue.put_nowait(delta)
        if delta.finished:
            req.finish_reason = delta.finish_reason
            self._forget(req)
            req.queue.put_nowait(None)

    async def _rank_died(self, rank: Rank) -> None:
        if not rank.alive:
            return
        rank.alive = False
        rank.channel.close()
        try:  # first, so that no request is routed there while the process is stopped
            await self.control_request(RankDown(rank.rank))
        except PoolError:
            pass
        # Off the event loop: a hung worker is only killed once the wait runs out.
        await asyncio.get_running_loop().run_in_executor(None, process.stop, rank.proc, 1.0)
        orphans = [r for r in self.requests.values() if r.rank == rank.rank]
        for req in orphans:
            req.reroutes += 1
            if req.reroutes > MAX_REROUTES:
                self._forget(req)
                req.queue.put_nowait(PoolError(
                    f"request {req.request_id!r} was running on {req.reroutes} ranks that died; it is not retried "
                    f"again, in case it is what kills them"))
                continue
            try:
                await self._dispatch(req)
            except (PoolError, ValueError) as e:  # ValueError: its message no longer fits a ring
                self._forget(req)
                req.queue.put_nowait(e)

    # ---- state --------------------------------------------------------------------

    async def stats(self) -> dict:
        control: ControlStats = await self.control_request(StatsQuery())
        ranks = []
        for state in control.ranks:
            rank = self.ranks[state.rank]
            load = state.load
            ranks.append({
                "rank": state.rank, "pid": rank.proc.pid, "alive": rank.alive,
                "num_waiting": load.num_waiting, "num_running": load.num_running,
                "blocks_free": load.blocks_free, "blocks_reclaimable": load.blocks_reclaimable,
                "blocks_used": load.blocks_used, "prompt_tokens": load.prompt_tokens,
                "prefix_hit_tokens": load.prefix_hit_tokens, "heartbeat_age_s": state.heartbeat_age_s,
                "epoch": state.epoch, "snapshot_version": state.snapshot_version,
                "cached_blocks": state.cached_blocks, "step_fit": step_fit_dict(state.step_fit),
                "loop_ms": state.loop_ms, "start_phases": rank.start_phases,
            })
            if not rank.alive:  # a dead rank queues, runs and holds nothing: no stale figures
                ranks[-1].update(dict.fromkeys(LIVE_STATS, 0))
        return {
            "control_pid": control.pid, "ranks": ranks, "route_queries": control.route_queries,
            "route_p50_us": control.route_p50_us, "route_p99_us": control.route_p99_us,
            "resyncs": control.resyncs, "stale_rejected": control.stale_rejected,
            "control_restarts": self.control_restarts,
            "transfers": msgspec.structs.asdict(control.transfers),
        }

    # ---- shutdown -------------------------------------------------------------------

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every process and remove every shared-memory object. Idempotent. The work runs as
        a task of its own: a caller cancelled meanwhile (an outer timeout, a second Ctrl-C) leaves
        it running, and every later call waits for that same teardown to end."""
        if self._teardown is None:
            self._check_loop()
            self._closed = True
            self._teardown = asyncio.get_running_loop().create_task(self._tear_down(timeout))
        await asyncio.shield(self._teardown)

    async def _tear_down(self, timeout: float) -> None:
        for req in self.requests.values():
            req.queue.put_nowait(PoolError("the pool is shut down"))
        self.requests.clear()
        self._by_wire.clear()
        for task in [*self._tasks, *self._releases, *self._resets]:
            task.cancel()
        for rank in self.ranks:
            if rank.alive:
                try:
                    await asyncio.wait_for(rank.channel.send(Shutdown()), 1.0)
                except (IpcError, asyncio.TimeoutError):
                    pass
        # A reset (or a restart) replacing the control process has unwound once this is taken:
        # the process it started, if any, is the one stopped here. A restart waiting for it
        # afterwards finds the pool closed.
        async with self._control_lock:
            if self.control is not None:
                self.control.close()
                assert self._control_channel is not None  # made with self.control
                self._control_channel.close()  # the control process's Responder sees it and exits
            loop = asyncio.get_running_loop()
            procs = [r.proc for r in self.ranks] + ([self.control_proc] if self.control_proc else [])
            await asyncio.gather(*(loop.run_in_executor(None, process.stop, p, timeout) for p in procs))
        for rank in self.ranks:
            rank.channel.close()
        if self.ipc is not None:
            self.ipc.close()
        if self.rendezvous is not None:
            self.rendezvous.close()

    def pids(self) -> list[int]:
        return [r.proc.pid for r in self.ranks] + ([self.control_proc.pid] if self.control_proc else [])


def intake_seconds(sent: float, arrived_at: float | None) -> float | None:
    """Seconds from the start of a request's send to its rank (``TrackedRequest.sent``) to its
    arrival at that rank's worker, read off the link (``TokenDelta.arrived_at``: the pool's
    processes share one host's monotonic clock), or None where either is unknown."""
    if arrived_at is None or not sent:
        return None
    return max(0.0, arrived_at - sent)  # 0 at least: a clock read a little apart on two processes
