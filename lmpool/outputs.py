"""What a finished request returns to its caller."""

from __future__ import annotations

import msgspec

from lmpool.token_logprobs import TokenLogprobs


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None = None  # None when the model directory has no tokenizer
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finish_reason: str | None = None  # "stop", "length" or "abort"
    rank: int | None = None  # the replica that served it, in a pool
    route: str | None = None  # in a pool: the routing rule that chose the rank ("pinned" when asked for)
    # In a pool whose routing prices its ranks (``lmpool``): the predicted seconds from its
    # submission to its first token on the rank it chose (the wait before the route, then the
    # route's price).
    predicted_ttft_s: float | None = None
    # In a pool: seconds from the request's submission to its hand-over to that rank (its
    # validation, block hashes and route, and the caller's event loop between them).
    dispatch_s: float | None = None
    # In a pool: its rank's share of the time to its first token: seconds from its arrival there
    # (read off the link) to the launch of its first step (the step under way and the queue ahead
    # of it), and from that launch to its first token; and before them the seconds from the start
    # of its send to that rank to that arrival (the link, and the worker's readers).
    queued_s: float | None = None
    first_step_s: float | None = None
    intake_s: float | None = None
    # Where the request asked (``SamplingParams.logprobs``): one per token of ``token_ids``.
    logprobs: list[TokenLogprobs] | None = None
    # Where it asked (``SamplingParams.prompt_logprobs``): one per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
