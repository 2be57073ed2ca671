"""One request's tokens and its progress through the engine.

A sequence's length counts its ``num_pending`` tokens: sampled on the device by a
launched step but not yet read back by the host (overlapped stepping). They are
always its last tokens; ``token_ids`` holds only the tokens the host knows, as an int32
``array`` (a prompt read off the wire as int32 bytes becomes one with a copy, not 16k Python
ints, and a block's tokens compare as bytes: ``block_bytes``).

Invariants: ``num_computed_tokens <= len(seq)``; ``block_hashes[i]`` is the
chained hash of complete block ``i`` of ``token_ids`` and is extended as tokens
are appended; ``block_table`` covers at least the computed tokens while the
sequence is running and is empty while it waits. When a step is scheduled, a
sequence has at most one pending token, and only if it has computed every known
token (so that step's one row for it reads the pending token from the device).
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from lmpool.engine.hashing import chain_hashes
from lmpool.sampling_params import SamplingParams
from lmpool.token_logprobs import TokenLogprobs

if TYPE_CHECKING:
    from lmpool.engine.block_manager import BlockManager

TOKEN_TYPECODE = "i"  # token ids as int32: every id is below a vocabulary's size, validated on admission
assert array(TOKEN_TYPECODE).itemsize == 4, "the token array must hold int32s"


def token_array(ids: Iterable[int] | np.ndarray) -> array:
    """``ids`` as an int32 token array: an int32 numpy array (a prompt off the wire) by one copy of
    its bytes, anything else id by id."""
    if isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.ndim == 1:
        out = array(TOKEN_TYPECODE)
        out.frombytes(np.ascontiguousarray(ids).tobytes())
        return out
    return array(TOKEN_TYPECODE, ids)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int] | np.ndarray,
        params: SamplingParams,
        block_size: int,
        output_token_ids: Iterable[int] | None = None,
        block_hashes: list[bytes] | None = None,
    ) -> None:
        self.request_id = request_id
        self.params = params
        # Greedy with nothing else asked of its logits (no logprobs, no penalty): read at every
        # step to take the model-dtype argmax path (``ModelRunner.sample_checked``).
        self.plain_greedy = params.greedy and params.logprobs is None and not params.penalized
        self.block_size = block_size
        # Outputs already produced elsewhere (a request recomputed on another
        # replica) are replayed as part of the prefill.
        self.token_ids = token_array(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.token_ids.extend(output_token_ids or ())
        # Given when the pool's frontend hashed them already (``AddRequest``).
        self.block_hashes = (chain_hashes(self.token_ids, block_size, salt=params.cache_salt)
                             if block_hashes is None else block_hashes)
        self.block_table: list[int] = []
        # ``BlockManager.match_prefix``'s last answer: (its manager, that manager's cache version,
        # this sequence's length, the hit), reused while all three stand.
        self.prefix_match: tuple[BlockManager, int, int, tuple[int, ...]] | None = None
        self.num_computed_tokens = 0
        self.num_ready_blocks = 0  # leading blocks whose KV is complete (see BlockManager.commit)
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_pending = 0  # sampled on the device, not yet read back (appended by ``resolve_token``)
        self.pending_row = -1  # row of the newest pending token in its step's sampled tokens
        self.admitted = False
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.first_token_time: float | None = None
        # ``time.monotonic()`` instants: its arrival (in a pool, its worker's read of it off the link;
        # else its addition to the engine), and the launch of the first
        # step that computed part of it (a replica's own share of its time to first token).
        self.arrival_time: float | None = None
        self.first_scheduled_time: float | None = None
        # With ``params.prompt_logprobs``: each prompt position's logprobs as steps read them back,
        # None for the first (it has none); sent with the first token once complete.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = [None] if params.prompt_logprobs is not None else None

    def __len__(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :].tolist()

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    def block_tokens(self, index: int) -> array:
        return self.token_ids[index * self.block_size : (index + 1) * self.block_size]

    def block_bytes(self, index: int) -> bytes:
        """Block ``index``'s token ids as int32 bytes: what a cached block's are compared with."""
        return self.block_tokens(index).tobytes()

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if len(self.token_ids) % self.block_size == 0:
            self.block_hashes = chain_hashes(self.token_ids, self.block_size, self.block_hashes, self.params.cache_salt)

    def add_prompt_logprobs(self, first: int, values: list[TokenLogprobs]) -> None:
        """Logprobs of prompt positions ``first ..``, as a step computed them; positions already
        held (a preempted sequence computes its prompt again) are kept as they were."""
        held = self.prompt_logprobs
        if held is None:  # sent already: this is a recomputation's
            return
        skip = len(held) - first
        if skip >= 0:
            held.extend(values[skip:])

    def take_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """The prompt's logprobs, once, when every position has them (None otherwise or after)."""
        held = self.prompt_logprobs
        if held is None or len(held) < self.num_prompt_tokens:
            return None
        self.prompt_logprobs = None
        return held

    def expect_token(self, row: int) -> None:
        """A launched step samples this sequence's next token into row ``row`` of its output."""
        self.num_pending += 1
        self.pending_row = row

    def resolve_token(self, token_id: int) -> None:
        """The oldest pending token, read back: it joins ``token_ids``."""
        assert self.num_pending > 0, f"{self.request_id}: a token was read back that no step sampled"
        self.num_pending -= 1
        self.append_token(token_id)

    def reset_for_recompute(self) -> None:
        """Drop all KV progress (preemption): the next admission prefills every token again.
        A pending token stays pending: it is read back before the sequence can be admitted."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.num_ready_blocks = 0
        self.status = SequenceStatus.WAITING
