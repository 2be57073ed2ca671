"""The link between the user process (frontend) and one worker: requests down, tokens up.

A request's prompt travels as its token ids' native int32 bytes (``pack_ids``): packed from the
frontend's int64 check and read by the worker at C speed, 4 bytes a token. As a msgpack array of
ints, a 16k-token prompt cost the frontend 0.19 ms to encode and its worker 0.82 ms to decode,
check and queue (0.02 and 0.35 ms so), each request of a burst in turn. Invariant: every packed id
is in [0, 2**31)."""

from __future__ import annotations

from array import array

import numpy as np

from lmpool.protocol.base import Message
from lmpool.sampling_params import SamplingParams
from lmpool.token_logprobs import TokenLogprobs


class AddRequest(Message, tag="add"):
    """A request the frontend has validated and hashed: the worker checks only what keeps it
    alive (``EngineCore.add_checked_request``), and hashes nothing again."""

    request_id: str
    prompt_ids: bytes  # its prompt's token ids (``pack_ids``; ``unpack_ids`` reads them)
    params: SamplingParams
    output_token_ids: list[int]  # tokens already generated elsewhere (recompute after a failure)
    block_hashes: list[bytes]  # of prompt + output tokens' complete blocks (``chain_hashes``)
    # Its cascade group, as its route named it (``RouteDecision.group``): what the worker counts it
    # under in its load reports (``LoadReport.group_heads``). Last, defaulting to None: a sender from
    # before it still decodes.
    group: bytes | None = None


def pack_ids(ids: array) -> bytes:
    """Token ids given as an int64 array (``validation.check_prompt``'s) as native int32 bytes;
    ``ValueError`` for an id outside [0, 2**31), which no vocabulary reaches."""
    wide = np.frombuffer(ids, dtype=np.int64)
    if len(wide) and (wide.min() < 0 or wide.max() >= 2**31):
        raise ValueError("a token id is outside [0, 2**31): it has no int32 form")
    return wide.astype(np.int32).tobytes()


def unpack_ids(data: bytes) -> np.ndarray:
    """``pack_ids``' ids as an int32 array (a view of ``data``); ``ValueError`` when ``data`` is
    not whole int32s."""
    if len(data) % 4:
        raise ValueError(f"a prompt of {len(data)} bytes is not whole int32 token ids")
    return np.frombuffer(data, dtype=np.int32)


class AbortRequest(Message, tag="abort"):
    request_id: str


class AttachControl(Message, tag="attach_control"):
    """Use this link end to reach a (re)started control process, and send it a full snapshot.
    With ``reset`` (the pool's ``reset``, on an idle pool), first forget every cached prefix and
    count the worker's figures from zero: the new control process meets a fresh replica."""

    end: str
    reset: bool = False


class Shutdown(Message, tag="shutdown"):
    pass


class WorkerReady(Message, tag="ready"):
    rank: int
    pid: int
    num_blocks: int
    block_size: int
    # Seconds of each phase of its start, in order (``lmpool.engine.start_phases``): the engine's,
    # then its calibration and the worker's own set-up.
    start_phases: dict[str, float] = {}


class WorkerFailed(Message, tag="failed"):
    """The worker could not start (or hit a fatal error); ``error`` says why."""

    rank: int
    error: str


class RequestRejected(Message, tag="rejected"):
    """The request failed on the worker, at admission or mid-stream (non-finite logits): no
    token of it follows, its blocks are freed; ``error`` says why."""

    request_id: str
    error: str


class TokenDelta(Message):
    request_id: str
    token_id: int
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    # Only where the request asked (defaults are not sent): the token's logprobs, and with its
    # first token the prompt's (``lmpool.token_logprobs``).
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # With the first token only: seconds from the request's arrival at the worker (read off its
    # link) to the launch of its first step, and from that launch to this token (the replica's
    # share of its TTFT); and the ``time.monotonic()`` instant of that arrival (a pool's processes
    # share one host's clock: the front end takes the instant its send began from it,
    # ``RequestOutput.intake_s``).
    queued_s: float | None = None
    first_step_s: float | None = None
    arrived_at: float | None = None


class StepOutputs(Message, tag="outputs"):
    outputs: list[TokenDelta]


FrontendToWorker = AddRequest | AbortRequest | AttachControl | Shutdown
WorkerToFrontend = WorkerReady | WorkerFailed | RequestRejected | StepOutputs
