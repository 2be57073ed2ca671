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
    new_prefill_tokens: int = 0  # the same, less each queued prompt's cached prefix as it stood on arrival
    # Causal attention pairs of that prefill still to compute (``StepSample.prefill_attention``).
    prefill_attention: int = 0
    decode_tokens_left: int = 0  # tokens still to generate by running and waiting sequences (max_tokens bound)
    # Tokens held by running and waiting sequences: the keys their decode steps read (a shared
    # prefix that running sequences decode as a cascade, once).
    context_tokens: int = 0
    blocks_free: int = 0
    blocks_reclaimable: int = 0
    blocks_used: int = 0
    prompt_tokens: int = 0  # cumulative prompt tokens admitted
    prefix_hit_tokens: int = 0  # cumulative prompt tokens served from the prefix cache
    admitted: list[str] = []  # request ids that reached the worker since the previous report
    generated_tokens: int = 0  # cumulative tokens this worker has emitted


class StepSample(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One engine step as the control plane's step-time model fits it: its wall seconds (from
    its launch, or the previous step's end if later, to its tokens read back) and its batch.

    A sequence computing one token decodes; one computing more prefills a chunk of ``n`` tokens
    after ``c`` computed ones, which attends ``n * c + n * (n + 1) / 2`` (query, key) pairs."""

    seconds: float
    prefill_tokens: int = 0
    prefill_attention: int = 0
    decode_seqs: int = 0
    decode_context: int = 0  # keys the decoding sequences read, in all (a prefix a cascade reads once, once)
