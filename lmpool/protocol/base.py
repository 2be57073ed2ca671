"""The wire conventions every cross-process message shares, and the load report they carry.

Every message is a ``msgspec.Struct`` deriving from ``Message``: positional arrays on the
wire (tagged unions need one shape), defaults omitted, no GC tracking (messages hold no
reference cycles). Tags are unique across each union a receiver decodes.
"""

from __future__ import annotations

import msgspec

# A block's chained content hash (``lmpool.engine.hashing``): 32 bytes, an opaque key everywhere.
BlockHash = bytes


class Message(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Base of every message."""


class LoadReport(Message):
    """A worker's queue and capacity at one instant (what routing needs to cost a rank)."""

    num_waiting: int = 0
    num_running: int = 0
    waiting_prefill_tokens: int = 0  # prompt tokens not yet computed, over waiting and running
    # The same, less each queued prompt's cached prefix as it stood on arrival: what the ranks will
    # compute, which LMPool's price queues (Dynamo's prefill term too).
    new_prefill_tokens: int = 0
    # Causal attention pairs of that prefill still to compute (as ``StepSample.attention`` counts them).
    prefill_attention: int = 0
    decode_tokens_left: int = 0  # tokens still to generate by running and waiting sequences (max_tokens bound)
    # Tokens held by running and waiting sequences: the keys their decode steps read each on
    # its own (without the shared prefixes that running sequences decode as a cascade, nor those
    # of the sequences no cascade groups yet whose named group there has another member: those
    # are ``cascade_pairs``).
    context_tokens: int = 0
    blocks_free: int = 0
    blocks_reclaimable: int = 0
    blocks_used: int = 0
    prompt_tokens: int = 0  # cumulative prompt tokens admitted
    prefix_hit_tokens: int = 0  # cumulative prompt tokens served from the prefix cache
    admitted: list[str] = []  # request ids that reached the worker since the previous report
    generated_tokens: int = 0  # cumulative tokens this worker has emitted
    # (row, key) pairs a decode step's cascade prefix passes attend over the running sequences
    # (as ``StepSample.cascade_pairs`` counts them): each shared prefix times the rows sharing it;
    # and those that the sequences no cascade groups yet (queued, prefilling, or decoding alone)
    # will attend in their named groups' passes (the group's prefix in each member's prompt, where
    # the group has two members or more there), as their reservations counted them.
    cascade_pairs: int = 0
    # The prefill of the launched step whose tokens are not read back yet (a GPU's; a CPU computes
    # a step inside its launch): its prompt tokens and their attention pairs, no longer queued
    # but still ahead of any new request (``EngineCore.launched``).
    launched_prefill_tokens: int = 0
    launched_attention: int = 0
    # The cascade groups of the running and waiting sequences, as their routes named them
    # (``AddRequest.group``: the last block hash of the prefix each shares with other routed
    # prompts), the most shared first, at most ``GROUP_HEADS``, and how many of those sequences are
    # of each: the groups a rank decodes or will; listed only where the pool prices by them
    # (``RoutingConfig.cascade_groups``).
    # Last, defaulting to empty: a sender from before them still decodes.
    group_heads: list[BlockHash] = []
    group_rows: list[int] = []
    # The keys that prefill's chunks read (as ``StepSample.prefill_keys`` counts them: each
    # prompt's whole context), the queue's and the launched step's; after the groups, defaulting
    # to 0: a sender from before them still decodes.
    prefill_keys: int = 0
    launched_keys: int = 0


GROUP_HEADS = 16  # the most groups a load report lists (``LoadReport.group_heads``): a report stays small


class StepSample(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One engine step as the control plane's step-time model fits it: its wall seconds (from
    its launch, or the previous step's end if later, to its tokens read back) and its batch.

    A sequence computing one token decodes; one computing more prefills a chunk of ``n`` tokens
    after ``c`` computed ones, which attends ``n * c + n * (n + 1) / 2`` (query, key) pairs.
    Decoding rows that a cascade groups under a shared prefix of ``p`` tokens attend it in one
    prefix pass of ``rows * p`` pairs (``lmpool.engine.cascade``): those are ``cascade_pairs``,
    apart from the prefill's ``attention`` (a pass of few query rows over many keys costs a pair
    more than a prefill chunk's full tiles do), and only the keys each row reads alone are its
    context. A prefill chunk also reads its whole context's keys (``c + n``: ``prefill_keys``), at
    a cost per key apart from its pairs': short queries over a long context (a burst's questions
    through LMPool's kernel) cost ~3.5x a long prompt's pair on the H200, and the keys they read
    tell the two apart. ``cascade_pairs`` and then ``prefill_keys`` come last, defaulting to 0: a
    sender from before them still decodes (its cascade pairs are in ``attention``)."""

    seconds: float
    prefill_tokens: int = 0
    attention: int = 0  # (query, key) pairs of the prefill chunks
    decode_seqs: int = 0
    decode_context: int = 0  # keys the decoding rows read each on its own (not a cascade's prefix)
    cascade_pairs: int = 0  # (row, key) pairs of the cascade prefix passes
    prefill_keys: int = 0  # keys the prefill chunks read: each chunk's context, its own tokens included


def attention_pairs(tokens: int, context: int) -> int:
    """(query, key) pairs of a prefill chunk of ``tokens`` after ``context`` computed ones, as
    ``StepSample.attention`` counts them."""
    return tokens * context + tokens * (tokens + 1) // 2


def prefill_keys(tokens: int, context: int) -> int:
    """The keys that chunk reads, as ``StepSample.prefill_keys`` counts them: its whole context,
    none where it computes nothing. (A prompt longer than a step's chunk reads its earlier chunks'
    keys again; where it is, its pairs outweigh its keys by thousands to one.)"""
    return context + tokens if tokens > 0 else 0
