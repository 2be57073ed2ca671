"""Logprobs in OpenAI's response shapes (as vLLM's server writes them), from ``TokenLogprobs``.

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one entry per token;
each ``top_logprobs`` entry maps token strings to logprobs, the token itself among them; an echoed
prompt's first token has ``null`` for both (nothing predicts it). Chat: ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``. A token's string is its
id decoded alone; JSON has no infinity, so a logprob of -inf is written as -9999.0 (vLLM's).
"""

from __future__ import annotations

import functools
import math

from lmpool.token_logprobs import TokenLogprobs

FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return FLOOR if math.isinf(logprob) or logprob < FLOOR else logprob


class TokenText:
    """Token ids as the strings logprobs name them by (each decoded alone, cached)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        if self.tokenizer is None:  # a model directory without a tokenizer: vLLM's id form
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


def completion_logprobs(text: TokenText, token_ids: list[int], entries: list[TokenLogprobs | None],
                        offset: int = 0) -> tuple[dict, int]:
    """The completions ``logprobs`` object of ``token_ids`` (their ``entries`` alongside; None
    where a token has none) and the text offset after them; offsets start at ``offset``."""
    tokens = [text.text(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top = [None if e is None else {text.text(e.token_id): _finite(e.logprob),
                                   **{text.text(i): _finite(v) for i, v in zip(e.top_ids, e.top_logprobs)}}
           for e in entries]
    body = {"text_offset": offsets, "token_logprobs": [None if e is None else _finite(e.logprob) for e in entries],
            "tokens": tokens, "top_logprobs": top}
    return body, offset


def chat_logprobs(text: TokenText, entries: list[TokenLogprobs]) -> dict:
    """The chat ``logprobs`` object of the tokens ``entries`` describe."""
    def item(token_id: int, logprob: float) -> dict:
        token = text.text(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}

    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(i, v) for i, v in zip(e.top_ids, e.top_logprobs)]}
                        for e in entries]}
