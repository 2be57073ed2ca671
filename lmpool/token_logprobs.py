"""One token's log-probability and the most likely alternatives at its position.

``TokenLogprobs`` is what the engine reports for a sampled token (``SamplingParams.logprobs``)
or a prompt token (``SamplingParams.prompt_logprobs``), what crosses a pool's links inside a
``TokenDelta`` and what a ``RequestOutput`` holds, one per token. Values are natural logs of
the model's raw distribution (log_softmax of the logits in float32, before temperature,
penalties, top-k or top-p: vLLM's default ``raw_logprobs``). ``top_ids`` are the ``k`` most
likely tokens at that position, most likely first, with ``top_logprobs`` alongside.
"""

from __future__ import annotations

import msgspec

# The most alternatives a request may ask for per token (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False, frozen=True):
    token_id: int
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []
