"""Per-request sampling settings; validated once, at construction."""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

# What torch.Generator.manual_seed takes.
SEED_RANGE = (-(2**63), 2**64 - 1)


def _integer(value, what: str) -> int:
    """``value`` as an int if it is an integer (a numpy one included) but not a bool."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop.

    ``temperature == 0`` is greedy. ``top_k <= 0`` disables top-k; ``top_p == 1``
    disables nucleus filtering. ``seed`` makes a sampled request reproducible
    whatever else is in its batch. ``stop`` ends a request when its output text contains
    one of these strings (the text returned ends before it: ``lmpool.stop_strings``);
    ``stop_token_ids`` ends it at one of these tokens, kept in the output.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real) \
                or not (self.temperature >= 0 and math.isfinite(self.temperature)):  # also rejects NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "top_k", _integer(self.top_k, "top_k"))
        max_tokens = _integer(self.max_tokens, "max_tokens")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        object.__setattr__(self, "max_tokens", max_tokens)
        if self.seed is not None:
            seed = _integer(self.seed, "seed")
            if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
                raise ValueError(f"seed must lie in [-2**63, 2**64), got {seed}")
            object.__setattr__(self, "seed", seed)
        if isinstance(self.stop_token_ids, (str, bytes)):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        ids = tuple(_integer(t, "a stop token id") for t in self.stop_token_ids)
        if any(t < 0 for t in ids):
            raise ValueError(f"stop token ids must be >= 0, got {list(self.stop_token_ids)}")
        object.__setattr__(self, "stop_token_ids", ids)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
