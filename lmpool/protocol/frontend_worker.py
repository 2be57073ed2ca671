"""The link between the user process (frontend) and one worker: requests down, tokens up."""

from __future__ import annotations

from lmpool.protocol.base import Message
from lmpool.sampling_params import SamplingParams
from lmpool.token_logprobs import TokenLogprobs


class AddRequest(Message, tag="add"):
    """A request the frontend has validated and hashed: the worker checks only what keeps it
    alive (``EngineCore.add_checked_request``), and hashes nothing again."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int]  # tokens already generated elsewhere (recompute after a failure)
    block_hashes: list[bytes]  # of prompt + output tokens' complete blocks (``chain_hashes``)
    # Its cascade group, as its route named it (``RouteDecision.group``): what the worker counts it
    # under in its load reports (``LoadReport.group_heads``). Last, defaulting to None: a sender from
    # before it still decodes.
    group: bytes | None = None


class AbortRequest(Message, tag="abort"):
    request_id: str


class AttachControl(Message, tag="attach_control"):
    """Use this link end to reach a (re)started control process, and send it a full snapshot."""

    end: str


class Shutdown(Message, tag="shutdown"):
    pass


class WorkerReady(Message, tag="ready"):
    rank: int
    pid: int
    num_blocks: int
    block_size: int


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
    # With the first token only: seconds from the request's arrival at the worker to the launch
    # of its first step, and from that launch to this token (the replica's share of its TTFT).
    queued_s: float | None = None
    first_step_s: float | None = None


class StepOutputs(Message, tag="outputs"):
    outputs: list[TokenDelta]


FrontendToWorker = AddRequest | AbortRequest | AttachControl | Shutdown
WorkerToFrontend = WorkerReady | WorkerFailed | RequestRejected | StepOutputs
