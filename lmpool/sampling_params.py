"""Per-request sampling settings; validated once, at construction.

Validation is strict about types (a bool is not an int, an int is not a bool, numpy
scalars are taken as the Python numbers they hold), so that whatever a caller can build
here encodes and decodes to the same value in every process of a pool. Values that the
device would round to nothing (a temperature or top_p that underflows) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmpool.errors import ArgumentTypeError, strict_bool, strict_float, strict_int
from lmpool.token_logprobs import MAX_LOGPROBS

# What torch.Generator.manual_seed takes.
SEED_RANGE = (-(2**63), 2**64 - 1)
# A signed 64-bit integer: what every other integer field must fit to cross the pool's links
# (msgpack) and to become a tensor on the worker.
INT64_RANGE = (-(2**63), 2**63 - 1)
# Below this a sampled request is greedy in all but name, and logits / temperature can
# overflow float32 to inf (then NaN): refused, with temperature=0 named as the way to greedy.
MIN_TEMPERATURE = 1e-2
# The smallest normal float32: a smaller top_p rounds to 0 (or a subnormal) on the device,
# where it would drop every token.
MIN_TOP_P = 1.1754943508222875e-38
MAX_CACHE_SALT_CHARS = 4096
# OpenAI's range for presence and frequency penalties (vLLM's too).
ADDITIVE_PENALTY_RANGE = (-2.0, 2.0)


def _integer(value, what: str) -> int:
    """``value`` as an int if it is an integer (a numpy one included) but not a bool, and one
    that fits in 64 bits (a larger one could not be encoded for the workers)."""
    value = strict_int(value, what)
    if not INT64_RANGE[0] <= value <= INT64_RANGE[1]:
        raise ValueError(f"{what} must fit in a signed 64-bit integer, got {value}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop.

    ``temperature == 0`` is greedy. ``top_k <= 0`` disables top-k; ``top_p == 1``
    disables nucleus filtering. ``seed`` makes a sampled request reproducible
    whatever else is in its batch. ``stop`` ends a request when its output text contains
    one of these strings (the text returned ends before it: ``lmpool.stop_strings``);
    ``stop_token_ids`` ends it at one of these tokens, kept in the output.

    ``cache_salt`` (as vLLM's request field of that name) isolates a tenant in the prefix
    cache: it is mixed into the hash of the request's first block, so only requests with
    the same salt share cached blocks (and can learn from a hit that a prefix was seen).

    ``logprobs=k`` reports each output token's log-probability and the ``k`` most likely
    tokens at its position (0: the token's alone); ``prompt_logprobs=k`` the same for every
    prompt token but the first (``lmpool.token_logprobs``). A request with prompt logprobs
    never takes its prefix from the cache: every prompt position runs through the model.
    Penalties follow vLLM: ``repetition_penalty`` divides the positive logits (multiplies the
    negative ones) of tokens seen in the prompt or the output; ``presence_penalty`` subtracts
    from the logit of every token the output holds, ``frequency_penalty`` that many times over.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    cache_salt: str | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        self._set("temperature", _temperature(self.temperature))
        self._set("top_p", _top_p(self.top_p))
        self._set("top_k", _integer(self.top_k, "top_k"))
        max_tokens = _integer(self.max_tokens, "max_tokens")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        self._set("max_tokens", max_tokens)
        self._set("ignore_eos", strict_bool(self.ignore_eos, "ignore_eos"))
        if self.seed is not None:
            seed = strict_int(self.seed, "seed")
            if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
                raise ValueError(f"seed must lie in [-2**63, 2**64), got {seed}")
            self._set("seed", seed)
        self._set("stop_token_ids", _stop_token_ids(self.stop_token_ids))
        self._set("stop", _stop_strings(self.stop))
        self._set("cache_salt", _cache_salt(self.cache_salt))
        self._set("logprobs", _num_logprobs(self.logprobs, "logprobs"))
        self._set("prompt_logprobs", _num_logprobs(self.prompt_logprobs, "prompt_logprobs"))
        for name in ("presence_penalty", "frequency_penalty"):
            self._set(name, _additive_penalty(getattr(self, name), name))
        self._set("repetition_penalty", _repetition_penalty(self.repetition_penalty))

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes this request's logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _temperature(value) -> float:
    t = strict_float(value, "temperature")
    if t < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {value!r}")
    if 0 < t < MIN_TEMPERATURE:
        raise ValueError(f"temperature {value!r} is below {MIN_TEMPERATURE}: sampling would be greedy in all but "
                         f"name and the logits could overflow; use temperature=0 for greedy")
    return t


def _top_p(value) -> float:
    p = strict_float(value, "top_p")
    if not 0 < p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {value!r}")
    if p < MIN_TOP_P:
        raise ValueError(f"top_p {value!r} is below {MIN_TOP_P:.3g}: it would round to 0 on the device")
    return p


def _stop_token_ids(value) -> tuple[int, ...]:
    if isinstance(value, (str, bytes, bytearray, dict)) or not hasattr(value, "__iter__"):
        raise ArgumentTypeError(f"stop_token_ids must be a sequence of token ids, got {value!r}")
    ids = tuple(_integer(t, "a stop token id") for t in value)
    if any(t < 0 for t in ids):
        raise ValueError(f"stop token ids must be >= 0, got {list(value)}")
    return ids


def _stop_strings(value) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    elif isinstance(value, (bytes, bytearray, dict)) or not hasattr(value, "__iter__"):
        raise ArgumentTypeError(f"stop must be a string or a sequence of strings, got {value!r}")
    stop = tuple(value)
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be non-empty strings, got {value!r}")
    return stop


def _cache_salt(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ArgumentTypeError(f"cache_salt must be a string or None, got {value!r} ({type(value).__name__})")
    if not 0 < len(value) <= MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                         f"got {len(value)} characters")
    return value


def _num_logprobs(value, what: str) -> int | None:
    if value is None:
        return None
    k = strict_int(value, what)
    if not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"{what} must be an integer in [0, {MAX_LOGPROBS}] (the alternatives per token), got {k}")
    return k


def _additive_penalty(value, what: str) -> float:
    penalty = strict_float(value, what)
    low, high = ADDITIVE_PENALTY_RANGE
    if not low <= penalty <= high:
        raise ValueError(f"{what} must be in [{low:g}, {high:g}], got {value!r}")
    return penalty


def _repetition_penalty(value) -> float:
    penalty = strict_float(value, "repetition_penalty")
    if penalty <= 0:
        raise ValueError(f"repetition_penalty must be a finite number > 0, got {value!r}")
    return penalty
