"""Admission checks shared by a single engine and a pool's ingress: each names what is wrong."""

from __future__ import annotations

from collections.abc import Sequence

from lmpool.sampling_params import SamplingParams


def validate_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    block_size: int,
    max_blocks: int,
    where: str = "the KV cache",
) -> None:
    """Raise ``ValueError`` if the request is malformed or could never fit in ``max_blocks`` blocks."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt is empty")
    for i, t in enumerate(prompt_token_ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise ValueError(f"prompt token {t!r} at position {i} is not an integer token id")
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt token {t!r} at position {i} is outside the vocabulary [0, {vocab_size})")
    outside = [t for t in params.stop_token_ids if t >= vocab_size]
    if outside:
        raise ValueError(f"stop token id {outside[0]} is outside the vocabulary [0, {vocab_size}): it can never end "
                         f"the request")
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds max_model_len {max_model_len}"
        )
    blocks = -(-total // block_size)
    if blocks > max_blocks:
        raise ValueError(
            f"request needs {blocks} KV blocks ({total} tokens) but {where} holds only {max_blocks}: "
            f"it could never run"
        )
