"""Admission checks shared by a single engine and a pool's ingress: each names what is wrong."""

from __future__ import annotations

import contextlib
import struct
from array import array
from collections.abc import Sequence

import msgspec
import numpy as np

from lmpool.engine.hashing import HASH_WIRE_BYTES
from lmpool.sampling_params import SamplingParams

# A token id on the wire, at most: a resumed request's outputs as msgpack writes ids below 2**32
# (a prompt's ids take 4 bytes, ``protocol.pack_ids``).
TOKEN_WIRE_BYTES = 5
# One token's ``TokenLogprobs`` on the wire: array headers, its id and a float64, and per
# alternative an id and a float64.
LOGPROB_WIRE_BYTES, ALTERNATIVE_WIRE_BYTES = 24, 14
ENVELOPE_BYTES = 256  # ids, tags, counts and array headers of one message, generously


def validate_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    block_size: int,
    max_blocks: int,
    where: str = "the KV cache",
) -> array:
    """Raise ``ValueError`` if the request is malformed or could never fit in ``max_blocks`` blocks;
    else the prompt's ids as ``check_prompt`` returns them."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    # The length first: a prompt far past the context is refused without reading its items.
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds max_model_len {max_model_len}"
        )
    ids = check_prompt(prompt_token_ids, vocab_size)
    outside = [t for t in params.stop_token_ids if t >= vocab_size]
    if outside:
        raise ValueError(f"stop token id {outside[0]} is outside the vocabulary [0, {vocab_size}): it can never end "
                         f"the request")
    blocks = -(-total // block_size)
    if blocks > max_blocks:
        raise ValueError(
            f"request needs {blocks} KV blocks ({total} tokens) but {where} holds only {max_blocks}: "
            f"it could never run"
        )
    return ids


def check_admissible(
    prompt: np.ndarray,
    output_token_ids: list[int],
    params: SamplingParams,
    block_hashes: list[bytes],
    *,
    vocab_size: int,
    max_model_len: int,
    block_size: int,
    max_blocks: int,
) -> None:
    """Raise ``ValueError`` unless a request the frontend validated (``validate_request``) and
    hashed, decoded from its typed message, can be run here without harm: its sizes, its token
    ids' range (an id past the vocabulary would fault the embedding) and its hashes' count. Its
    ``prompt`` comes as the int32 array its message packs (``protocol.unpack_ids``), checked at C
    speed; the ``output_token_ids`` it resumes with (after a failure elsewhere) as ints."""
    num_prompt_tokens = len(prompt)
    tokens = num_prompt_tokens + len(output_token_ids)
    if len(block_hashes) != tokens // block_size:
        raise ValueError(f"{len(block_hashes)} block hashes for {tokens} tokens of {block_size}-token blocks")
    total = num_prompt_tokens + params.max_tokens
    if total > max_model_len:
        raise ValueError(f"{num_prompt_tokens} prompt tokens + max_tokens {params.max_tokens} exceeds max_model_len "
                         f"{max_model_len}")
    if -(-total // block_size) > max_blocks:
        raise ValueError(f"the request needs {-(-total // block_size)} KV blocks; this rank holds {max_blocks}")
    if not num_prompt_tokens:
        raise ValueError("prompt is empty")
    if (prompt.min() < 0 or prompt.max() >= vocab_size or any(not 0 <= t < vocab_size for t in output_token_ids)
            or any(t >= vocab_size for t in params.stop_token_ids)):
        raise ValueError(f"a token id is outside the vocabulary [0, {vocab_size})")


def check_prompt(prompt_token_ids: Sequence[int], vocab_size: int) -> array:
    """Raise ``ValueError`` unless the prompt is a non-empty sequence of token ids of the vocabulary;
    return them as an int64 array, which ``chain_hashes`` reads without converting them again."""
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt is empty")
    # Python ints in range pass at C speed (every request is checked on the pool's one event loop,
    # so a burst of long prompts waits on this): msgspec's strict conversion refuses anything but
    # ints (bools too), and the packing refuses what does not fit. Anything else is named below.
    with contextlib.suppress(msgspec.ValidationError, struct.error):
        msgspec.convert(prompt_token_ids, list[int])
        packed = _packed(prompt_token_ids)
        ids = np.frombuffer(packed, dtype=np.int64)
        if ids.min() >= 0 and ids.max() < vocab_size:
            return array("q", packed)
    for i, t in enumerate(prompt_token_ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise ValueError(f"prompt token {t!r} at position {i} is not an integer token id")
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt token {t!r} at position {i} is outside the vocabulary [0, {vocab_size})")
    return array("q", prompt_token_ids)  # ints of an int subclass: in range, so they fit


def _packed(token_ids: Sequence[int]) -> bytes:
    """``token_ids`` as native int64s' bytes (``array("q")``'s layout), at C speed (three times
    ``array("q", ...)``'s, which converts item by item); ``struct.error`` names an item that is
    not an integer or does not fit. Through a ``Struct``'s method, which takes a tuple's items as
    they are: ``struct.pack(fmt, *ids)`` puts the format before them, a copy of every item's
    reference (0.5 against 0.2 ms for 32k ids)."""
    return struct.Struct(f"={len(token_ids)}q").pack(*token_ids)


def check_wire_size(num_prompt_tokens: int, params: SamplingParams, *, block_size: int, limit: int) -> None:
    """Raise ``ValueError`` if a message of this request could exceed ``limit`` bytes, the
    most a pool's link carries in one message: its tokens and their block hashes to a worker (a
    request moved after a failure carries its outputs too; the routing query to the control
    plane carries the hashes alone, so it is smaller), or its prompt logprobs back from the worker.
    Checked before anything is sent, so a request too large for the links fails alone."""
    tokens = num_prompt_tokens + params.max_tokens
    sizes = {
        "its tokens": tokens * TOKEN_WIRE_BYTES + tokens // block_size * HASH_WIRE_BYTES
        + len(msgspec.msgpack.encode(params)) + ENVELOPE_BYTES,
    }
    if params.prompt_logprobs is not None:
        # They come back in one message with the first token, beside the step's other outputs:
        # half the limit leaves those room.
        per_token = LOGPROB_WIRE_BYTES + ALTERNATIVE_WIRE_BYTES * params.prompt_logprobs
        sizes["its prompt logprobs (twice, to leave the step's other outputs room)"] = (
            2 * (num_prompt_tokens * per_token + ENVELOPE_BYTES))
    for what, size in sizes.items():
        if size > limit:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) is too large to send: "
                f"{what} could take {size} bytes, over the {limit}-byte limit of a message between the pool's "
                f"processes"
            )
