"""Continuous batching for one replica: which sequences run this step, and how many tokens each.

Each step spends at most ``max_num_batched_tokens`` tokens. Running sequences go
first, in admission order: a decoding sequence takes one token, a sequence still
prefilling takes the next chunk of its prompt. Waiting sequences are then
admitted first-come-first-served while the budget, ``max_num_seqs`` and the KV
blocks allow. The batch lists the sequences computing one token first
(``ScheduledBatch.decode_first``), each part in the order it was scheduled. When a
running sequence needs a block and none is available, the most recently admitted
running sequence is preempted: its blocks are dropped and it waits at the head of
the queue to be recomputed (its complete blocks are usually still in the prefix
cache). No sequence is admitted in a step that preempted, so the pool does not thrash.

A request that asks for prompt logprobs never starts from cached blocks (``prefix_hit``): its
prompt's every position must run through the model to give its logits. So it is never passed
over either (below): waiting would save it nothing.

A waiting sequence whose next uncached block is being computed right now by a running
sequence (one still prefilling the same prefix, or admitted earlier in this step) is
passed over for this step: admitted now, it would compute the same blocks a second
time; a step or a few later it finds them in the prefix cache. Only such sequences
are passed over (the next waiting one is looked at); any other that does not fit ends
admission for the step, first come first served. A passed-over sequence waits only
while its producer runs, so it cannot starve.

Admitting a waiting sequence may need more fresh blocks than are free; the rest
are then reclaimed from the prefix cache (evicted). Before that happens the
optional ``on_shortage(hit, num_blocks)`` hook is asked: True means "keep the
sequence waiting this step" (a pool worker is moving that many cold cached blocks
to a partner instead of losing them), False means evict as usual. The hook
bounds its own waiting, so admission never stalls forever.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lmpool.engine.block_manager import BlockManager
from lmpool.engine.sequence import Sequence, SequenceStatus
from lmpool.protocol.base import BlockHash, StepSample, attention_pairs, prefill_keys


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens computed this step, per sequence
    num_preempted: int = 0
    # The batch's shape as the step-time model reads it (``lmpool.protocol.StepSample``).
    prefill_tokens: int = 0
    prefill_attention: int = 0
    prefill_keys: int = 0
    decode_seqs: int = 0
    decode_context: int = 0  # keys the decoding rows attend to, in all
    # Of those, the keys a cascade's prefix passes read once for their rows, as (row, key) pairs
    # (``CascadePlan.pairs``): set once the step's inputs are planned.
    cascade_pairs: int = 0
    # Indices of the sequences computing prompt positions whose logprobs they asked for.
    prompt_logprobs: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, n: int) -> None:
        """``seq`` computes ``n`` tokens this step, after the ones it has computed."""
        self.seqs.append(seq)
        self.num_tokens.append(n)
        c = seq.num_computed_tokens
        if c + 1 < seq.num_prompt_tokens and seq.params.prompt_logprobs is not None:
            self.prompt_logprobs.append(len(self.seqs) - 1)
        if n == 1:
            self.decode_seqs += 1
            self.decode_context += c + 1
        else:
            self.prefill_tokens += n
            self.prefill_attention += attention_pairs(n, c)
            self.prefill_keys += prefill_keys(n, c)

    def sample(self, seconds: float) -> StepSample:
        """This step, taking ``seconds``, as the step-time model reads it: a cascade's prefix
        passes as their pairs, the keys each row reads on its own as its context."""
        return StepSample(seconds, self.prefill_tokens, self.prefill_attention, self.decode_seqs,
                          self.decode_context - self.cascade_pairs, self.cascade_pairs, self.prefill_keys)

    def decode_first(self) -> None:
        """List the single-token rows first, each part in its order (the prompt logprobs' indices
        follow): a mixed step's attention then takes its decode rows as one slice."""
        if self.decode_seqs in (0, len(self.seqs)):
            return
        order = sorted(range(len(self.seqs)), key=lambda i: self.num_tokens[i] != 1)  # stable
        self.seqs = [self.seqs[i] for i in order]
        self.num_tokens = [self.num_tokens[i] for i in order]
        if self.prompt_logprobs:
            moved = {old: new for new, old in enumerate(order)}
            self.prompt_logprobs = sorted(moved[i] for i in self.prompt_logprobs)

    def samples(self, i: int) -> bool:
        """Whether sequence ``i`` reaches its last token this step, and so yields a new token."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_tokens[i] == len(seq)


def prefix_hit(bm: BlockManager, seq: Sequence) -> list[int]:
    """The cached blocks ``seq`` may start from. None for a request with prompt logprobs: they
    need the logits of every prompt position, which only computing the whole prompt gives."""
    return [] if seq.params.prompt_logprobs is not None else bm.match_prefix(seq)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 on_shortage: Callable[[list[int], int], bool] | None = None) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.on_shortage = on_shortage
        self.last_batch = ScheduledBatch()  # what the latest ``schedule()`` returned

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.finish(seq, "abort")

    def retire(self, seq: Sequence, reason: str) -> None:
        """Finish ``seq`` wherever it is: running, waiting (preempted while its last token was
        still on the device) or in neither (its step was its last, see ``EngineCore``)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.finish(seq, reason)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def schedule(self) -> ScheduledBatch:
        batch = self.last_batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        block_size = bm.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            target = seq.num_computed_tokens + n
            # Most decode steps need no new block: the block manager (whose checks cost most of
            # a step's scheduling) is asked only when the table does not cover the target.
            if target > len(seq.block_table) * block_size and not self._grow_or_preempt(seq, target, batch):
                continue  # ``seq`` itself was preempted: it was the last one running
            batch.add(seq, n)
            budget -= n
            i += 1
        if batch.num_preempted:
            batch.decode_first()
            return batch
        # Without a prefix cache nothing computed now could be reused later: no one is passed over.
        computing = self._blocks_in_progress() if bm.enable_prefix_caching and self.waiting else None
        passed: list[Sequence] = []  # waiting sequences whose prefix another one is computing
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # A preempted sequence's last token may still be on the device; it is read back in
            # the step that preempted it, and no step that preempts admits anything.
            assert not seq.num_pending, f"{seq.request_id} admitted before its last token was read back"
            hit = prefix_hit(bm, seq)
            # One that takes no cached prefix (prompt logprobs) would gain nothing by waiting.
            if (computing and len(hit) < len(seq.block_hashes) and seq.block_hashes[len(hit)] in computing
                    and seq.params.prompt_logprobs is None):
                passed.append(self.waiting.popleft())
                continue
            n = min(len(seq) - len(hit) * bm.block_size, budget)
            fresh = bm.blocks_needed(len(hit) * bm.block_size + n) - len(hit)
            if not bm.can_admit(hit, fresh):
                break
            evict = fresh - bm.num_free
            if evict > 0 and self.on_shortage is not None and self.on_shortage(hit, evict):
                break  # cold cached blocks are being moved out instead of evicted: wait for them
            self.waiting.popleft()
            bm.admit(seq, hit)
            bm.grow(seq, seq.num_computed_tokens + n)
            if not seq.admitted:
                seq.admitted = True
                seq.num_cached_tokens = min(len(hit) * bm.block_size, seq.num_prompt_tokens)
                seq.first_scheduled_time = time.monotonic()  # its first step is launched now
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
            if computing is not None:
                computing.update(seq.block_hashes[len(hit):])
        self.waiting.extendleft(reversed(passed))  # back at the front, in their order
        batch.decode_first()
        return batch

    def _grow_or_preempt(self, seq: Sequence, target: int, batch: ScheduledBatch) -> bool:
        """Give ``seq`` the blocks its first ``target`` tokens need, preempting the most recently
        admitted running sequences while too few are available; False if ``seq`` itself went."""
        bm = self.block_manager
        while bm.blocks_needed(target) - len(seq.block_table) > bm.num_available:
            victim = self.running.pop()
            self._preempt(victim)
            batch.num_preempted += 1
            if victim is seq:
                return False
        bm.grow(seq, target)
        return True

    def _blocks_in_progress(self) -> set[BlockHash]:
        """Hashes of the complete blocks running sequences hold but have not finished computing."""
        return {h for seq in self.running for h in seq.block_hashes[seq.num_ready_blocks:]}

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def complete_step(self, batch: ScheduledBatch) -> None:
        """Account for the tokens the model just computed and cache the blocks they completed."""
        self.advance(batch)
        self.commit(batch)

    def advance(self, batch: ScheduledBatch) -> None:
        """Count the batch's tokens as computed (the step is launched: later steps follow it on
        the device). A sequence finished or preempted since it was scheduled has no progress."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens += n

    def commit(self, batch: ScheduledBatch) -> None:
        """Mark READY (and cache) the blocks the batch's computed tokens completed. Called before
        any later step is counted by ``advance``, so only this batch's blocks are committed."""
        bm = self.block_manager
        block_size = bm.block_size
        for seq in batch.seqs:
            # A decode step completes a block once every ``block_size`` tokens: only then is
            # there anything for the block manager to commit.
            if seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens // block_size > seq.num_ready_blocks:
                bm.commit(seq)
