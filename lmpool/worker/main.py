"""A data-plane worker: one replica's EngineCore driven by messages from the frontend and the control process.

The worker owns its blocks; it tells the control plane what it caches with
versioned deltas (a full snapshot at start, after a ``ResyncRequest`` and when a
new control process attaches), and streams every new token to the frontend.

The step loop never waits on a message: reader tasks move arriving messages
into an inbox, and the loop yields to them between steps (``asyncio.sleep(0)``),
so a request or an abort is taken at the next step boundary while the model
runs. While a launched step runs on the device the loop keeps yielding (``while_stepping``):
requests are read (their senders never wait on a full ring for the step) and transfer orders
answered without waiting for the step's end. Under overlapped stepping a step's tokens are
read back after the next step's launch, unless the device has finished it before that launch
begins (``EngineCore.read_finished``): then they go out first, and a slow launch (a prefill's)
delays no token the device has already made. With nothing to do the loop sleeps on an event,
burning no CPU.

With foreground release on, admission that would evict cached blocks first asks
the control plane to move them to a partner (``lmpool.worker.release``); while the
worker waits for that (bounded), a step that runs nothing sleeps on the same
event until a message or the wait's deadline, instead of spinning.

It times its steps for the control plane's step-time model (``StepTimings``, at most every
``STEP_REPORT_S`` and with every heartbeat), the first of them the synthetic ones it ran at
start (``lmpool.engine.calibration``) before it was ready, and with them how long its loop's
synchronous stages and the garbage collector's passes kept its readers waiting
(``lmpool.worker.loop_stages``); it freezes its start-up heap, so that those passes are short.

Its control link: a message the link refuses (too large) fails alone, and a cache report too
large for one message goes in parts (``report_parts``); the control process's death leaves the
worker waiting for its successor, any other link failure ends the worker.

Run as ``LMPOOL_SPEC=SPEC_JSON python -m lmpool.worker.main`` (see ``lmpool.protocol.spec``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import uvloop

from lmpool.engine.calibration import calibrate
from lmpool.engine.cascade import plan_cascade
from lmpool.engine.core import EngineCore, StepOutput, StepUnderWay
from lmpool.engine.sequence import Sequence as EngineSequence
from lmpool.protocol import (
    AbortRequest,
    AddRequest,
    AttachControl,
    ControlToWorker,
    FrontendToWorker,
    Heartbeat,
    LoadReport,
    ReleaseOutcome,
    RequestRejected,
    ResyncRequest,
    Shutdown,
    StepOutputs,
    StepSample,
    StepTimings,
    TokenDelta,
    WorkerDelta,
    WorkerFailed,
    WorkerReady,
    WorkerSnapshot,
)
from lmpool.protocol.base import GROUP_HEADS, attention_pairs, prefill_keys
from lmpool.protocol.frontend_worker import unpack_ids
from lmpool.protocol.kv_events import KVDelta, KVSnapshot
from lmpool.protocol.spec import WorkerSpec, read_spec
from lmpool.worker.loop_stages import LoopStages
from lmpool.worker.release import ForegroundRelease
from lmpool.worker.report_parts import split_delta, split_snapshot
from lmpool.worker.transfers import Incoming, TransferExecutor
from lmpool_ipc import Channel, ChannelClosedError, IpcError, LinkError, MessageError, PeerDeadError

log = logging.getLogger("lmpool.worker")

STEP_REPORT_S = 0.05  # step timings go to the control plane at most this often (and with heartbeats)


class NamedGroup(NamedTuple):
    """A request's cascade group as its route named it (``AddRequest.group``), and how many of its
    prompt's tokens that group's prefix covers (0 where its prompt holds no block of that hash)."""
    head: bytes
    tokens: int


def named_group(seq: EngineSequence, head: bytes) -> NamedGroup:
    """``seq``'s group ``head``: its prefix ends at the block of that hash in ``seq``'s prompt."""
    try:
        depth = seq.block_hashes.index(head) + 1
    except ValueError:
        depth = 0
    return NamedGroup(head, depth * seq.block_size)


def _count_head(seq: EngineSequence, named: dict[str, NamedGroup], heads: Counter[bytes],
                longest: dict[bytes, int]) -> NamedGroup | None:
    """Count ``seq`` under its cascade group (``LoadReport.group_heads``) as its route named it
    (``AddRequest.group``, in ``named`` by request id) and return that group; a sequence whose
    route named none counts under none."""
    group = named.get(seq.request_id)
    if group is not None:
        heads[group.head] += 1
        longest[group.head] = max(longest.get(group.head, 0), seq.num_prompt_tokens)
    return group


class Worker:
    def __init__(self, spec: WorkerSpec, core: EngineCore, frontend: Channel,
                 calibration: Sequence[StepSample] = ()) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.epoch = spec.epoch
        self.core = core
        self.frontend = frontend
        self.control: Channel | None = None
        self.inbox: list = []
        self.wakeup = asyncio.Event()
        self.need_snapshot = True
        self.admitted: list[str] = []  # for the control plane's reservations
        # When each request not yet taken by the engine was read off the link: its arrival
        # (``Sequence.arrival_time``), so a request read while a step runs waits for that step in its
        # ``queued_s``, not in the link's ``intake_s``.
        self.read_at: dict[str, float] = {}
        # Prompt tokens each queued request found cached when it arrived (Dynamo's prefill term).
        self.cached_on_arrival: dict[str, int] = {}
        # Each request's cascade group, as its route named it (``AddRequest.group``), where the pool
        # prices by groups (``RoutingConfig.cascade_groups``): pruned to the running and waiting
        # sequences as each load report is built.
        self.groups: dict[str, NamedGroup] = {}
        self.last_load: LoadReport | None = None
        self.prompt_tokens = 0
        self.prefix_hit_tokens = 0
        self.generated_tokens = 0
        self.stopping = False
        self.fatal: LinkError | None = None  # a control-link failure that ends the worker
        self.tasks: list[asyncio.Task] = []
        self.transfers = TransferExecutor(spec, core) if spec.transfer_rendezvous else None
        self.calibration = list(calibration)  # sent to every control process that attaches
        self.steps_sent_at = 0.0
        self.loop_stages = LoopStages()  # how long the step loop kept the readers waiting
        # Foreground release, when it runs, is the scheduler's shortage hook (``release_hook``).
        hook = core.scheduler.on_shortage
        self.release: ForegroundRelease | None = hook if isinstance(hook, ForegroundRelease) else None

    # ---- message intake ---------------------------------------------------------

    async def read_frontend(self) -> None:
        try:
            async for msg in self.frontend.messages():
                if isinstance(msg, AddRequest):
                    self.read_at[msg.request_id] = time.monotonic()
                # ``self.inbox`` read after each message, not bound once: the step loop swaps
                # in a new list meanwhile.
                self.inbox.append(msg)
                self.wakeup.set()
        except IpcError:
            self.stopping = True  # the user process is gone: nobody to serve
            self.wakeup.set()

    async def read_control(self, channel: Channel) -> None:
        try:
            async for msg in channel.messages():
                if isinstance(msg, ResyncRequest):
                    self.need_snapshot = True
                    self.wakeup.set()
                elif isinstance(msg, Incoming) and self.transfers is not None:
                    self.transfers.receive(msg)  # plan orders, set-up, questions, peers' exports
                    self.wakeup.set()
                elif isinstance(msg, ReleaseOutcome) and self.release is not None:
                    self.release.on_outcome(msg)
                    self.wakeup.set()
        except (PeerDeadError, ChannelClosedError):
            self.drop_control(channel)  # the control process died (the frontend restarts it), or was replaced
        except LinkError as e:
            if self.control is channel:
                self.fail(e)

    def drop_control(self, channel: Channel) -> None:
        """``channel``'s control process is gone, or a successor replaced it: close it, which
        unmaps its rings and frees their descriptors (a pool reset replaces the control process
        every time), and, where it was the current link, wait for the successor's ``AttachControl``."""
        channel.close()
        if self.control is channel:
            self.control = None
            if self.release is not None:
                self.release.disconnected()

    def reset(self) -> None:
        """Forget every cached prefix and count from zero, as a fresh worker (the pool is idle:
        the frontend resets only then, and a request it aborted was read before this)."""
        try:
            dropped = self.core.reset_prefix_cache()
        except ValueError as e:  # a frontend bug, not this rank's: it serves on, its cache kept
            log.error("rank %d: pool reset refused: %s", self.rank, e)
            return
        log.info("rank %d: pool reset, %d cached blocks forgotten", self.rank, dropped)
        self.prompt_tokens = self.prefix_hit_tokens = self.generated_tokens = 0
        self.loop_stages.clear()
        self.last_load = None

    def attach_control(self, end: str) -> None:
        old, self.control = self.control, Channel(end, ControlToWorker)
        if old is not None:
            old.close()
        self.need_snapshot = True
        if self.release is not None:
            self.release.connected = True
        # The replaced links' readers have ended (or end on the close above): forget them.
        self.tasks = [t for t in self.tasks if not t.done()]
        self.tasks.append(asyncio.create_task(self.read_control(self.control)))

    # ---- reports --------------------------------------------------------------

    def load(self) -> LoadReport:
        sched, bm = self.core.scheduler, self.core.block_manager
        prefill = attention = keys = decode_left = context = 0
        heads: Counter[bytes] = Counter()  # sequences by the group their routes named: the cascade groups
        longest: dict[bytes, int] = {}  # ... and each group's longest prompt
        # Every step with output builds a report: the groups only where the pool prices by them (and
        # only then are any kept), counted where any sequence has one.
        named = self.groups
        count_heads = bool(named)
        members: list[tuple[EngineSequence, NamedGroup]] = []  # the sequences of named groups
        for seq in sched.running:
            n, c = max(0, len(seq) - 1 - seq.num_computed_tokens), seq.num_computed_tokens
            group = _count_head(seq, named, heads, longest) if count_heads else None
            if group is not None:
                members.append((seq, group))
            prefill += n
            attention += attention_pairs(n, c)
            keys += prefill_keys(n, c)
            decode_left += seq.params.max_tokens - seq.num_output_tokens
            context += len(seq)
        new_prefill = prefill
        for seq in sched.waiting:
            length = len(seq)
            group = _count_head(seq, named, heads, longest) if count_heads else None
            if group is not None:
                members.append((seq, group))
            prefill += length - seq.num_computed_tokens
            cached = max(seq.num_computed_tokens, self.cached_on_arrival.get(seq.request_id, 0))
            n = max(0, length - cached)
            new_prefill += n
            attention += attention_pairs(n, cached)
            keys += prefill_keys(n, cached)
            decode_left += seq.params.max_tokens - seq.num_output_tokens
            context += length
        self.cached_on_arrival = {s.request_id: self.cached_on_arrival[s.request_id]
                                  for s in sched.waiting if s.request_id in self.cached_on_arrival}
        if count_heads:  # finished and aborted requests leave
            self.groups = {s.request_id: named[s.request_id] for queue in (sched.running, sched.waiting)
                           for s in queue if s.request_id in named}
        launched = self.core.launched  # its prefill counted neither above nor in the queue
        # Sequences that decode as a cascade attend their shared prefixes in its prefix passes.
        cascade_pairs = 0
        if self.core.runner.cascade_min_saved:
            decoding = [s for s in sched.running if s.num_computed_tokens >= len(s) - 1]
            plan = plan_cascade([s.block_table for s in decoding], [len(s) for s in decoding], bm.block_size,
                                self.core.runner.cascade_min_saved)
            grouped: set[str] = set()
            if plan is not None:
                cascade_pairs = plan.pairs
                context -= plan.pairs
                grouped = {decoding[row].request_id for row in plan.rows}
            # A member of a named group with another member here that no cascade groups yet (queued,
            # prefilling, or decoding alone until another joins it) will read its prefix in the group's
            # prefix pass, as the reservations counted it (a join converts a lone member): a burst's
            # queued questions are not each priced as reading their document alone once reported.
            for seq, group in members:
                if heads[group.head] > 1 and seq.request_id not in grouped:
                    shared = min(group.tokens, len(seq) - 1)
                    context -= shared
                    cascade_pairs += shared
        # The most shared first, then the longest prompts (a document's first question, a group of
        # one, before a chat's short prompts): a group forms from its first row.
        groups = sorted(heads.items(), key=lambda hr: (-hr[1], -longest[hr[0]]))[:GROUP_HEADS]
        return LoadReport(
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            waiting_prefill_tokens=prefill,
            new_prefill_tokens=new_prefill,
            prefill_attention=attention,
            decode_tokens_left=decode_left,
            context_tokens=context,
            blocks_free=bm.num_free,
            blocks_reclaimable=bm.num_reclaimable,
            blocks_used=bm.num_used,
            prompt_tokens=self.prompt_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            generated_tokens=self.generated_tokens,
            cascade_pairs=cascade_pairs,
            launched_prefill_tokens=launched.prefill_tokens if launched else 0,
            launched_attention=launched.prefill_attention if launched else 0,
            group_heads=[h for h, _ in groups],
            group_rows=[rows for _, rows in groups],
            prefill_keys=keys,
            launched_keys=launched.prefill_keys if launched else 0,
        )

    async def send_steps(self, force: bool = False) -> None:
        """Send the steps timed since the last ``StepTimings``: at most every ``STEP_REPORT_S``
        unless ``force`` (a heartbeat)."""
        now = time.monotonic()
        due = force or now - self.steps_sent_at >= STEP_REPORT_S
        if self.control is None or not self.core.step_samples or not due:
            return
        self.steps_sent_at = now
        await self.send_control(StepTimings(self.rank, self.epoch, self.core.take_step_samples(),
                                            loop_ms=self.loop_stages.snapshot()))

    async def publish(self, load: LoadReport | None = None) -> None:
        """Tell the control plane what changed: cached blocks (or everything, if asked) and load.

        Routing costs a rank by its queue, so a changed load is reported at once
        rather than at the next heartbeat. ``load``: the report the step already built
        (``load()`` walks every sequence; once per step is enough).
        """
        if self.control is None:
            return
        bm = self.core.block_manager
        if load is None:
            load = self.load()
        if not (self.need_snapshot or bm.has_pending_events or self.admitted or load != self.last_load):
            return
        self.last_load = load
        report = msgspec.structs.replace(load, admitted=self.admitted)
        self.admitted = []
        if self.need_snapshot:
            self.need_snapshot = False
            bm.drain_delta()  # the snapshot supersedes pending events
            await self.send_cache(bm.snapshot(), report)
            if self.calibration:  # a control process that attaches fits from these first
                await self.send_control(StepTimings(self.rank, self.epoch, self.calibration, calibration=True))
        else:
            await self.send_cache(bm.drain_delta(), report)

    async def send_cache(self, cache: KVSnapshot | KVDelta, report: LoadReport) -> None:
        """A snapshot or delta of the cache with ``report``, in as many messages as the link
        needs (``report_parts``); past what any split fits, a resync is asked for instead."""
        channel = self.control
        if channel is None:
            return
        later = msgspec.structs.replace(report, admitted=[])  # each admission is reported once
        events = len(cache.blocks if isinstance(cache, KVSnapshot) else cache.events)
        parts = 1
        while True:
            payloads = [msgspec.msgpack.encode(m) for m in self._cache_messages(cache, report, later, parts)]
            largest = max(len(p) for p in payloads)
            if largest <= channel.max_payload:
                break
            if parts >= events:
                log.error("rank %d: a cache report of %d events needs a message of %d bytes, over the link's "
                          "%d: not sent; the control plane resyncs", self.rank, events, largest, channel.max_payload)
                self.need_snapshot = True
                return
            parts = min(events, parts * 2)
        if len(payloads) > 1:
            log.warning("rank %d: a cache report of %d events is %d messages (the link takes %d bytes per message)",
                        self.rank, events, len(payloads), channel.max_payload)
        for payload in payloads:
            if not await self.send_control(payload, encoded=True):
                return

    def _cache_messages(self, cache, report: LoadReport, later: LoadReport, parts: int) -> list:
        if isinstance(cache, KVSnapshot):
            first, rest = split_snapshot(cache, parts)
            return ([WorkerSnapshot(self.rank, self.epoch, self.core.block_manager.num_blocks, first, report)]
                    + [WorkerDelta(self.rank, self.epoch, d, later) for d in rest])
        return [WorkerDelta(self.rank, self.epoch, d, report if i == 0 else later)
                for i, d in enumerate(split_delta(cache, parts))]

    async def send_outputs(self, deltas: list[TokenDelta]) -> None:
        """A step's tokens to the user process: in one message, but each first token carrying its
        prompt's logprobs in one of its own (ingress lets each alone fit a message, not several
        together). One that the link still refuses fails its request alone; the rank serves on."""
        alone = [d for d in deltas if d.prompt_logprobs is not None]
        if len(alone) < len(deltas):
            await self.frontend.send(StepOutputs([d for d in deltas if d.prompt_logprobs is None] if alone else deltas))
        for delta in alone:
            try:
                await self.frontend.send(StepOutputs([delta]))
            except MessageError as e:
                self.core.abort_request(delta.request_id)
                await self.frontend.send(RequestRejected(delta.request_id, f"its prompt logprobs cannot be sent: {e}"))

    async def send_control(self, msg, encoded: bool = False) -> bool:
        """Send ``msg`` (or its encoded bytes) to the control plane; whether it went. A message
        the link refuses is that message's failure: logged, the link works on. The control
        process gone, or closing the link, leaves the worker waiting to be attached to its
        successor (the frontend restarts it). Any other link failure ends the worker, so its
        supervision sees it, rather than serving on unseen by routing."""
        channel = self.control
        if channel is None:
            return False
        try:
            await (channel.send_bytes(msg) if encoded else channel.send(msg))
            return True
        except MessageError as e:
            log.error("rank %d: a message to the control plane was refused: %s", self.rank, e)
            return False
        except (PeerDeadError, ChannelClosedError):
            self.drop_control(channel)
            return False
        except LinkError as e:
            self.fail(e)
            return False

    def fail(self, error: LinkError) -> None:
        """The control link broke while its peer lives: end the worker (``run`` raises it)."""
        log.error("rank %d: the control link failed: %s", self.rank, error)
        self.fatal = error
        self.stopping = True
        self.wakeup.set()

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.spec.pool.heartbeat_interval)
            # Plans whose control plane fell silent (it died, or its aborts were lost) end
            # here, so no pin or reservation outlives them.
            if self.transfers is not None and self.transfers.participant.expire():
                self.wakeup.set()
            if self.control is not None:
                await self.send_control(Heartbeat(self.rank, self.epoch, self.load()))
            await self.send_steps(force=True)

    # ---- the step loop ----------------------------------------------------------

    def handle(self, msg) -> list:
        """Apply one frontend message; return messages to send back."""
        if isinstance(msg, AddRequest):
            arrival = self.read_at.pop(msg.request_id, None)  # taken first: a rejected prompt leaves none behind
            try:
                seq = self.core.add_checked_request(msg.request_id, unpack_ids(msg.prompt_ids), msg.params,
                                                    msg.output_token_ids, msg.block_hashes, arrival)
            except ValueError as e:
                return [RequestRejected(msg.request_id, str(e))]
            self.admitted.append(msg.request_id)
            self.cached_on_arrival[msg.request_id] = self.core.cached_prefix_tokens(msg.request_id)
            if msg.group is not None and self.spec.pool.routing_config.cascade_groups:
                self.groups[msg.request_id] = named_group(seq, msg.group)
        elif isinstance(msg, AbortRequest):
            self.core.abort_request(msg.request_id)
        elif isinstance(msg, AttachControl):
            if msg.reset:
                self.reset()
            self.attach_control(msg.end)
        elif isinstance(msg, Shutdown):
            self.stopping = True
        return []

    async def deliver(self, outputs: list[StepOutput], report: bool = True) -> LoadReport | None:
        """Send a step's tokens to the user process, and its failures. With ``report``, the load
        report built before the sends where a token went (what ``publish`` reports is the step's
        load); without, None (tokens read back before a launch: the report follows the launch)."""
        deltas, failed = [], []
        for out in outputs:
            seq = out.seq
            if out.error is not None:  # that request's failure: the rank serves on
                failed.append(RequestRejected(out.request_id, out.error))
                continue
            queued = first_step = arrived = None
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
                self.prompt_tokens += seq.num_prompt_tokens
                self.prefix_hit_tokens += seq.num_cached_tokens
                queued, first_step = first_token_times(seq)
                arrived = seq.arrival_time
            deltas.append(
                TokenDelta(out.request_id, out.new_token_id, out.finished, out.finish_reason,
                           seq.num_cached_tokens, out.logprobs, out.prompt_logprobs, queued, first_step, arrived)
            )
        load = None
        if deltas:
            self.generated_tokens += len(deltas)  # one delta per new token
            load = self.load() if report else None
            await self.send_outputs(deltas)
        for reply in failed:
            await self.frontend.send(reply)
        return load

    async def idle(self) -> None:
        """The step ran nothing: wait for what can change that instead of spinning."""
        if self.transfers is not None and self.transfers.in_flight:
            # Bytes are moving on the transport's threads and nothing else needs this
            # loop: look again shortly.
            await asyncio.sleep(0.0005)
            return
        release = self.release
        if release is None or release.pending is None or self.inbox:
            return
        assert self.transfers is not None  # release_hook makes a release only with transfers
        if self.transfers.orders:
            return
        # Admission waits for a move: only a message (an order, the outcome, a request)
        # or the wait's deadline can change anything.
        self.wakeup.clear()
        try:
            await asyncio.wait_for(self.wakeup.wait(), max(0.0, release.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            pass

    async def while_stepping(self, step: StepUnderWay) -> None:
        """Serve the links until the device is done with ``step``'s awaited tokens. Transfer orders
        are answered without waiting for the step's end (a pull's source busy with a burst's long
        prefill steps held its plans for one or two of them; a copy into this rank still runs
        behind the step on the device). Requests are read into the inbox, so the user process's
        sends never wait on a full ring for a step to end; the scheduler takes them after it."""
        transfers = self.transfers
        while not step.ready():
            if transfers is not None and transfers.busy:
                for ack in transfers.progress():
                    await self.send_control(ack)
            await asyncio.sleep(0)  # the readers take what arrives meanwhile

    async def run(self) -> None:
        self.tasks += [asyncio.create_task(self.read_frontend()), asyncio.create_task(self.heartbeat())]
        self.attach_control(self.spec.control_end)
        await self.publish()
        while not self.stopping:
            transferring = self.transfers is not None and self.transfers.busy
            if not self.inbox and not self.core.has_unfinished() and not transferring:
                self.wakeup.clear()
                await self.wakeup.wait()
            if self.transfers is not None:
                for ack in self.transfers.progress():
                    await self.send_control(ack)
            inbox, self.inbox = self.inbox, []
            replies = []
            if inbox:
                with self.loop_stages.timed("admit"):
                    replies = [r for msg in inbox for r in self.handle(msg)]
            for reply in replies:
                await self.frontend.send(reply)
            if self.stopping:
                break
            ran, load = False, None
            if self.core.has_unfinished():
                started = time.perf_counter()
                finished = self.core.read_finished()
                if finished:  # the device is done with it: its tokens go out before the next launch
                    self.loop_stages.add("read_back", time.perf_counter() - started)
                    await self.deliver(finished, report=False)
                with self.loop_stages.timed("launch"):
                    step = self.core.begin_step()
                await self.while_stepping(step)
                with self.loop_stages.timed("read_back"):
                    outputs = self.core.end_step(step)
                batch = self.core.scheduler.last_batch
                ran = bool(batch.seqs or batch.num_preempted)
                load = await self.deliver(outputs)
            await self.publish(load)
            await self.send_steps()
            if self.release is not None and self.release.outbox:
                reports, self.release.outbox = self.release.outbox, []
                for report in reports:  # after the deltas that announced its blocks
                    await self.send_control(report)
            if not ran:
                await self.idle()
            await asyncio.sleep(0)  # let the readers take what arrived during the step
        for task in self.tasks:
            task.cancel()
        if self.transfers is not None:
            self.transfers.close()
        if self.fatal is not None:
            raise self.fatal


def first_token_times(seq) -> tuple[float | None, float | None]:
    """(queued, first step) seconds of a sequence at its first token: arrival to the launch of its
    first step, and that launch to now (``Sequence.first_token_time``)."""
    if seq.arrival_time is None or seq.first_scheduled_time is None:
        return None, None
    return seq.first_scheduled_time - seq.arrival_time, seq.first_token_time - seq.first_scheduled_time


def release_hook(spec: WorkerSpec):
    """What makes the scheduler's shortage hook: a foreground release that asks the control plane
    to move cold blocks before evicting them, when the pool runs it; None otherwise."""
    transfer = spec.pool.transfer
    if not (transfer.foreground_release and spec.transfer_rendezvous):
        return None
    policy = transfer.transfer_policy

    return lambda block_manager: ForegroundRelease(block_manager, spec.rank, spec.epoch, policy.foreground_wait_s,
                                                   policy.foreground_retry_s)


async def main_async(spec: WorkerSpec) -> int:
    frontend: Channel[FrontendToWorker] = Channel(spec.frontend_end, FrontendToWorker)
    try:
        core = EngineCore(spec.pool.engine_of(spec.rank), release_hook(spec))
        phases = core.runner.start_phases
        phases.lap("engine")  # what the runner's own phases leave: the scheduler, the block manager
        samples = calibrate(core, seed=spec.rank) if spec.pool.calibrate_steps else []
        phases.lap("calibration")
        worker = Worker(spec, core, frontend, samples)  # joins the transfer rendezvous, if any
        phases.lap("worker")
    except Exception as e:  # any start-up failure is reported, with its cause, to the frontend
        await frontend.send(WorkerFailed(spec.rank, f"{type(e).__name__}: {e}"))
        frontend.close()
        return 1
    # Everything made so far (torch, the model, the cache's bookkeeping) lives as long as the
    # process: keep it out of the collector's full passes, which would hold the step loop, and the
    # links' readers with it, for a tenth of a second (as the control process does).
    gc.collect()
    gc.freeze()
    worker.loop_stages.watch_collections()
    bm = core.block_manager
    await frontend.send(WorkerReady(spec.rank, os.getpid(), bm.num_blocks, bm.block_size,
                                    {k: round(v, 4) for k, v in phases.seconds.items()}))
    try:
        await worker.run()
    finally:
        if worker.control is not None:
            worker.control.close()
        frontend.close()
    return 0


def main() -> None:
    spec = read_spec(WorkerSpec)
    sys.exit(uvloop.run(main_async(spec)))


if __name__ == "__main__":
    main()
