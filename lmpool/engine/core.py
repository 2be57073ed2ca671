"""One replica's engine loop: admission checks, scheduling, the model step and stop conditions.

``EngineCore`` is driven from outside (``LLM.generate`` or a pool worker): add
requests, call ``step()`` until nothing is unfinished. A request that is
invalid, or that could never fit in this replica's KV cache, is refused with a
``ValueError`` at ``add_request`` and never disturbs the requests already in.

Two ways to step, chosen by ``EngineConfig.async_scheduling``:

- serial (False): schedule, launch the model, do the block accounting of the batch
  while the device computes, wait for the new tokens, append them, check stops.
- overlapped (True): schedule and launch step N+1 first, then wait for step N's
  tokens (the device is busy with N+1 meanwhile) and process them, one step late.
  A sequence sampled in step N has a pending token (``Sequence.num_pending``) when
  step N+1 is scheduled; that step's input id for it is copied on the device from
  step N's sampled tokens. Step N's blocks are committed to the prefix cache only
  once N is known to be complete (after its read-back).

``step()`` is ``begin_step()`` then ``end_step()``; between them the caller may do work that
leaves the requests alone (a pool worker serves transfer orders while the device computes).
Before ``begin_step``, ``read_finished()`` reads back the launched step if the device has
finished it already (overlapped only): the step after it is then scheduled with its tokens
known, as a serial step would be, and its launch delays none of them. A pool worker does so
every step; ``step()`` does not, so that it keeps the overlapped path's order on a CPU too.

Exactness of the overlapped path:
- A sequence whose step-N token finishes it by length (max_tokens, max_model_len)
  is known to finish before the token is read: it leaves the running list when N
  is launched, so no later step computes for it.
- A sequence that a stop token (or EOS) finishes in step N was also scheduled in
  step N+1; it is finished when N is read back, and its token from N+1 is dropped:
  a finished or aborted sequence never emits again. Its blocks are freed while
  N+1 may still write them, which is safe because every later user of a block
  runs after N+1 on the device: later steps on the same stream, KV transfers on
  streams that wait for it.
- A sequence whose logits in step N hold NaN or inf ends when N is read back, as a
  stop token would end it: its row reads back as ``NON_FINITE`` and its last output
  has ``finish_reason`` "error" and ``StepOutput.error``, with no token; the other
  sequences of the batch go on.
- A preempted sequence may still have a pending token; it is read back in the
  same ``step`` call, before any admission could recompute the sequence.
Greedy tokens equal the serial path's; so do a seeded request's (its generator
draws once per token it samples, in the same order). Unseeded sampled tokens may
not: a stopped sequence's extra row in step N+1 draws from the engine's stream.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import numpy as np

from lmpool.config.engine import EngineConfig
from lmpool.engine.block_manager import BlockManager
from lmpool.engine.model_runner import NON_FINITE, ModelRunner, PendingTokens
from lmpool.engine.scheduler import ScheduledBatch, Scheduler, prefix_hit
from lmpool.engine.sequence import Sequence, SequenceStatus
from lmpool.engine.validation import check_admissible, validate_request
from lmpool.model.config import ModelConfig
from lmpool.protocol.base import StepSample
from lmpool.sampling_params import SamplingParams
from lmpool.token_logprobs import TokenLogprobs

STEP_SAMPLES = 4096  # timed steps kept until a caller takes them (``take_step_samples``)


@dataclass(slots=True)
class StepOutput:
    request_id: str
    new_token_id: int
    finished: bool
    finish_reason: str | None
    seq: Sequence
    error: str | None = None  # why the request failed (finish_reason "error", no token); the caller names it
    logprobs: TokenLogprobs | None = None  # the token's, where its request asked (``SamplingParams.logprobs``)
    # The prompt's, with the request's first token, where it asked (``SamplingParams.prompt_logprobs``).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(slots=True)
class InFlightStep:
    """A launched step whose tokens the host has not read back yet."""

    batch: ScheduledBatch
    pending: PendingTokens
    launched: float  # perf_counter when the ``begin_step`` call that launched it began


@dataclass(slots=True)
class StepUnderWay:
    """A step between ``begin_step`` and ``end_step``: the batch it launched and the launched
    step ``end_step`` reads back (``awaited``: this one when serial, the previous one when
    overlapped; None: nothing to read back)."""

    batch: ScheduledBatch
    awaited: InFlightStep | None = None

    def ready(self) -> bool:
        """Whether ``end_step`` would find the awaited tokens on the host without waiting."""
        return self.awaited is None or self.awaited.pending.ready()


class EngineCore:
    def __init__(self, config: EngineConfig,
                 shortage_hook: Callable[[BlockManager], Callable[[list[int], int], bool]] | None = None) -> None:
        """``shortage_hook``, given the block manager, makes the scheduler's ``on_shortage`` hook
        (a pool worker's foreground release); None: evict as usual."""
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        limit = self.model_config.max_context
        self.max_model_len = config.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context of {limit} positions "
                "(max_position_embeddings, or YaRN's factor times its original positions)"
            )
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        on_shortage = shortage_hook(self.block_manager) if shortage_hook is not None else None
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, on_shortage)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self.awaiting_prompt_logprobs: set[str] = set()  # requests whose prompt logprobs are not sent yet
        self.in_flight: InFlightStep | None = None  # overlapped stepping: launched, not read back
        # The launched step whose tokens the scheduler counts as computed and the host has not
        # read back: its prefill has left the queue, not the device (a worker's load reports it).
        # Serial: the step between its launch and its read-back. Overlapped: the latest step that
        # ``end_step`` advanced; a step ``begin_step`` launched is still counted as queued until then.
        # None on a CPU, whose launch returns once the step is computed.
        self.launched: ScheduledBatch | None = None
        # The batch whose tokens were read back last: by the latest ``step``, the one it ran when
        # serial, the one before when overlapped (what a step's wall time measures once the device
        # is busy); or by ``read_finished``. Empty until a step has been read back.
        self.last_read_back = ScheduledBatch()
        self._between = False  # between ``begin_step`` and ``end_step``
        # Every read-back step's time and shape, newest last, for a pool's step-time model.
        self.step_samples: deque[StepSample] = deque(maxlen=STEP_SAMPLES)
        self._last_done = 0.0  # perf_counter when the latest timed step ended
        self._timed_pending: PendingTokens | None = None  # ... and its tokens (their events time the next)
        self._synchronous = self.runner.device.type == "cpu"  # a launch returns once the step is computed

    # ---- admission ------------------------------------------------------------

    def validate(self, prompt_token_ids: SequenceABC[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming what is wrong with a request; return if it can be served."""
        validate_request(
            prompt_token_ids, params, vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len, block_size=self.config.block_size,
            max_blocks=self.block_manager.num_blocks,
        )

    def cached_prefix_tokens(self, request_id: str) -> int:
        """Prompt tokens of a queued request that its rank's prefix cache holds now."""
        seq = self.requests[request_id]
        return len(prefix_hit(self.block_manager, seq)) * self.config.block_size

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceABC[int],
        params: SamplingParams,
        output_token_ids: SequenceABC[int] = (),
    ) -> Sequence:
        """Queue a request; ``output_token_ids`` resumes one whose first tokens were generated elsewhere."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, prompt_token_ids, params, self.config.block_size, output_token_ids)
        return self._queue(seq)

    def add_checked_request(self, request_id: str, prompt: np.ndarray, params: SamplingParams,
                            output_token_ids: list[int], block_hashes: list[bytes],
                            arrival: float | None = None) -> Sequence:
        """``add_request`` for a request a pool's frontend validated and hashed, its prompt's ids
        as its message packs them (``protocol.unpack_ids``): only what could harm this engine is
        checked again (``check_admissible``), and nothing is hashed again. ``arrival``: when its
        worker read it (``time.monotonic()``; None: now)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        check_admissible(prompt, output_token_ids, params, block_hashes, vocab_size=self.model_config.vocab_size,
                         max_model_len=self.max_model_len, block_size=self.config.block_size,
                         max_blocks=self.block_manager.num_blocks)
        return self._queue(Sequence(request_id, prompt, params, self.config.block_size, output_token_ids,
                                    block_hashes), arrival)

    def _queue(self, seq: Sequence, arrival: float | None = None) -> Sequence:
        request_id, params = seq.request_id, seq.params
        self.requests[request_id] = seq
        if params.prompt_logprobs is not None:
            self.awaiting_prompt_logprobs.add(request_id)
        seq.arrival_time = time.monotonic() if arrival is None else arrival
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks; an unknown id is a no-op that returns False."""
        seq = self.requests.pop(request_id, None)
        self.awaiting_prompt_logprobs.discard(request_id)
        if seq is None:
            return False
        self.scheduler.abort(seq)
        self.runner.sampler.release(request_id)
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (``BlockManager.forget_cached``): the cache of a freshly
        started engine. Only an idle engine resets (``ValueError`` otherwise: a running request's
        blocks would stay cached); the number of blocks forgotten."""
        if self.has_unfinished():
            raise ValueError(f"a prefix cache resets only on an idle engine; {len(self.requests)} requests "
                             "are unfinished")
        return self.block_manager.forget_cached()

    def close(self) -> None:
        """Release the replica's device memory; the engine cannot step afterwards."""
        self.runner.close()

    def has_unfinished(self) -> bool:
        # Every unfinished request is here, including one whose last token is still on the device.
        return bool(self.requests)

    # ---- one step -------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one step; returns the tokens the host has read back (see the module docstring)."""
        return self.end_step(self.begin_step())

    def begin_step(self) -> StepUnderWay:
        """Schedule and launch a step; ``end_step`` finishes it. In between, ``ready()`` says
        whether the device is done with what ``end_step`` waits for, and the caller may do
        other work: it must not add, abort or schedule requests meanwhile."""
        started = time.perf_counter()
        step = self._begin_overlapped(started) if self.config.async_scheduling else self._begin_serial(started)
        self._between = True
        return step

    def end_step(self, step: StepUnderWay) -> list[StepOutput]:
        """Wait for the device if need be, then read back (see the module docstring)."""
        self._between = False
        if self.config.async_scheduling:
            return self._end_overlapped(step)
        return self._end_serial(step)

    def take_step_samples(self) -> list[StepSample]:
        """The timed steps since the previous call, oldest first (at most ``STEP_SAMPLES``)."""
        samples = list(self.step_samples)
        self.step_samples.clear()
        return samples

    def _timed(self, batch: ScheduledBatch, launched: float, pending: PendingTokens | None = None) -> None:
        """Record a step whose tokens the host has just come to know. Its time runs from its
        launch, or from the previous step's end when that came later (overlapped, the device was
        busy with it), so consecutive samples never count the same interval twice nor an idle one.
        On a GPU that is the device's clock (``PendingTokens.device_s``: the host learns of a
        step's end only once it has queued the next); a CPU computes a step inside its launch,
        so its tokens are known when the launch returns."""
        done = time.perf_counter()
        seconds = pending.device_s(self._timed_pending) if pending is not None else None
        if seconds is None:
            seconds = done - max(launched, self._last_done)
        self.step_samples.append(batch.sample(seconds))
        self._last_done = done
        self._timed_pending = pending

    def _begin_serial(self, started: float) -> StepUnderWay:
        batch = self.last_read_back = self.scheduler.schedule()
        if not batch.seqs:
            return StepUnderWay(batch)
        pending = self.runner.launch(batch)
        self._expect_tokens(pending)
        # Block accounting needs only the batch, not the new tokens: it runs while
        # the device computes them.
        self.scheduler.complete_step(batch)
        self.launched = None if self._synchronous else batch
        return StepUnderWay(batch, InFlightStep(batch, pending, started))

    def _end_serial(self, step: StepUnderWay) -> list[StepOutput]:
        self.launched = None
        if step.awaited is None:
            return []
        pending = step.awaited.pending
        tokens = pending.result()
        self._timed(step.batch, step.awaited.launched, pending)
        return self._read_back(pending, tokens)

    def _begin_overlapped(self, started: float) -> StepUnderWay:
        previous, self.in_flight = self.in_flight, None
        batch = self.scheduler.schedule()
        if batch.seqs:
            device_tokens = previous.pending.device_tokens if previous is not None else None
            pending = self.runner.launch(batch, device_tokens)
            if self._synchronous:
                self._timed(batch, started)
            self._expect_tokens(pending)
            self.in_flight = InFlightStep(batch, pending, started)
        return StepUnderWay(batch, previous)

    def read_finished(self) -> list[StepOutput]:
        """Overlapped stepping: the tokens of the launched step, read back now if the device has
        finished it, so that they need not wait for the next step's launch (``end_step`` then
        has nothing to await); [] while it still runs, or when serial. Where the host launches a
        step more slowly than the device ran the one before (a prefill's launch is one kernel at
        a time; on a CPU the launch is the step), the finished step's first tokens would
        otherwise come a whole launch late. The device is idle meanwhile either way."""
        if self._between:  # the step launched last is then not the one to read: the one before it is
            raise RuntimeError("read_finished between begin_step and end_step")
        finished = self.in_flight
        if finished is None or not finished.pending.ready():
            return []
        self.in_flight = self.launched = None
        self.last_read_back = finished.batch
        return self._finish(finished)

    def _finish(self, step: InFlightStep) -> list[StepOutput]:
        """Read back a launched step of the overlapped path (waiting for the device if need be)."""
        tokens = step.pending.result()
        if not self._synchronous:
            self._timed(step.batch, step.launched, step.pending)
        # Its KV is complete now, so its blocks can be cached; then its tokens are appended
        # (after the commit: ``commit`` reads only tokens known before that step).
        self.scheduler.commit(step.batch)
        return self._read_back(step.pending, tokens)

    def _end_overlapped(self, step: StepUnderWay) -> list[StepOutput]:
        previous, batch = step.awaited, step.batch
        if previous is not None:
            self.last_read_back = previous.batch
        # The step's one wait, for the previous step: the device has this one queued behind it.
        outputs = [] if previous is None else self._finish(previous)
        self.launched = None
        if batch.seqs:
            # After the previous step's commit, which must not count this step's tokens.
            self.scheduler.advance(batch)
            self.launched = None if self._synchronous else batch
        return outputs

    def _expect_tokens(self, pending: PendingTokens) -> None:
        """Each sampling sequence of a launched step awaits its token. One that this token
        finishes by length leaves the running list now, so no later step computes for it."""
        running, max_len = self.scheduler.running, self.max_model_len
        for row, seq in enumerate(pending.seqs):
            seq.expect_token(row)
            length = len(seq)
            if length - seq.num_prompt_tokens >= seq.params.max_tokens or length >= max_len:
                running.remove(seq)

    def _read_back(self, pending: PendingTokens, tokens: list[int]) -> list[StepOutput]:
        """Append the tokens of a finished step and apply the stop conditions (a non-finite row
        fails its request). A sequence that finished (a stop token, an abort, an error) while
        this step ran gets nothing from it."""
        for part in pending.prompt:  # before the tokens: a prompt's last part comes with its first token
            part.seq.add_prompt_logprobs(part.first, part.logprobs.read())
        outputs = self._read_tokens(pending.seqs, tokens)
        if pending.logprobs is not None or self.awaiting_prompt_logprobs:
            self._attach_logprobs(outputs, pending)
        return outputs

    def _attach_logprobs(self, outputs: list[StepOutput], pending: PendingTokens) -> None:
        """Give each output its token's logprobs and, with its request's first token, its prompt's."""
        by_row = pending.token_logprobs()
        rows = {seq.request_id: row for row, seq in enumerate(pending.seqs)} if by_row is not None else {}
        awaiting = self.awaiting_prompt_logprobs
        for out in outputs:
            if by_row is not None and out.request_id in rows:
                out.logprobs = by_row[rows[out.request_id]]
            if out.request_id in awaiting and out.error is None:
                out.prompt_logprobs = out.seq.take_prompt_logprobs()
                awaiting.discard(out.request_id)

    def _read_tokens(self, seqs: list[Sequence], tokens: list[int]) -> list[StepOutput]:
        """``_read_back``'s tokens: appended, each sequence's stop conditions checked."""
        outputs: list[StepOutput] = []
        append = outputs.append
        eos, max_len = self.eos_token_ids, self.max_model_len
        # Stop conditions inline: this loop runs once per sequence per step.
        for seq, token in zip(seqs, tokens):
            if seq.status is SequenceStatus.FINISHED:
                continue
            if token == NON_FINITE:
                append(self._fail(seq, "the model produced non-finite logits (NaN or inf)"))
                continue
            seq.resolve_token(token)
            params = seq.params
            length = len(seq.token_ids)
            if token in params.stop_token_ids or (token in eos and not params.ignore_eos):
                reason = "stop"
            elif length - seq.num_prompt_tokens >= params.max_tokens or length >= max_len:
                assert not seq.num_pending, f"{seq.request_id} was scheduled past its length limit"
                reason = "length"
            else:
                append(StepOutput(seq.request_id, token, False, None, seq))
                continue
            self.scheduler.retire(seq, reason)
            self.runner.sampler.release(seq.request_id)
            del self.requests[seq.request_id]
            append(StepOutput(seq.request_id, token, True, reason, seq))
        return outputs

    def _fail(self, seq: Sequence, error: str) -> StepOutput:
        """Finish ``seq`` at once with an error of its own and free its blocks; the others go on."""
        self.scheduler.retire(seq, "error")
        self.awaiting_prompt_logprobs.discard(seq.request_id)
        self.runner.sampler.release(seq.request_id)
        del self.requests[seq.request_id]
        return StepOutput(seq.request_id, NON_FINITE, True, "error", seq, error)
