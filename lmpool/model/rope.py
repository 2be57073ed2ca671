"""Rotary position frequencies: the default ones, or YaRN-scaled for a longer context.

Qwen3's published checkpoints are trained to 32K positions and reach 128K with YaRN, turned
on by a ``rope_scaling`` (or ``rope_parameters``) entry of ``rope_type: "yarn"`` in
config.json. YaRN keeps the fast-rotating frequencies as trained (extrapolation),
divides the slow ones by ``factor`` (interpolation) and ramps linearly between the two over
the dimensions whose wavelengths lie between ``beta_fast`` and ``beta_slow`` rotations of
the original context; cos and sin are then multiplied by an attention factor (``0.1 *
ln(factor) + 1`` unless the config names one). This is the computation transformers'
Qwen3 runs for the same config, so both build the same model from one directory.

Invariants:
- ``inv_freq`` has ``head_dim // 2`` entries, in float32, each between the default
  frequency divided by ``factor`` and the default frequency.
- a ``YarnScaling`` is valid when built: ``factor >= 1``, a positive original context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # None: from factor (and mscale, mscale_all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True  # round the ramp's bounds outwards to whole dimensions

    def __post_init__(self) -> None:
        if not self.factor >= 1:
            raise ValueError(f"YaRN factor must be >= 1, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("YaRN original_max_position_embeddings must be positive, "
                             f"got {self.original_max_position_embeddings}")

    @property
    def context(self) -> int:
        """The positions the scaled model is meant to reach."""
        return int(self.factor * self.original_max_position_embeddings)

    @classmethod
    def from_hf(cls, params: dict[str, Any]) -> YarnScaling:
        """From a config.json rope dict, which names ``factor`` and the original positions
        (transformers refuses one without them too)."""
        missing = [k for k in ("factor", "original_max_position_embeddings") if params.get(k) is None]
        if missing:
            raise ValueError(f"YaRN rope scaling needs {' and '.join(missing)}")
        original, factor = params["original_max_position_embeddings"], params["factor"]
        optional = {k: params[k] for k in ("attention_factor", "mscale", "mscale_all_dim") if params.get(k) is not None}
        return cls(factor=float(factor), original_max_position_embeddings=int(original),
                   beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                   truncate=bool(params.get("truncate", True)), **{k: float(v) for k, v in optional.items()})

    def to_hf(self) -> dict[str, Any]:
        out = {"rope_type": "yarn", "factor": self.factor,
               "original_max_position_embeddings": self.original_max_position_embeddings,
               "beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "truncate": self.truncate}
        out.update({k: getattr(self, k) for k in ("attention_factor", "mscale", "mscale_all_dim")
                    if getattr(self, k) is not None})
        return out

    def scale(self) -> float:
        """What cos and sin are multiplied by."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _mscale(self.factor, self.mscale) / _mscale(self.factor, self.mscale_all_dim)
        return _mscale(self.factor)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inv_freq(head_dim: int, theta: float, scaling: YarnScaling | None = None) -> tuple[torch.Tensor, float]:
    """The rotary frequencies of ``head_dim`` and the factor cos and sin are multiplied by."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    default = 1.0 / (theta ** exponents)
    if scaling is None:
        return default, 1.0

    def dimension(rotations: float) -> float:  # where a wavelength fits ``rotations`` times in the original context
        return head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) \
            / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0: fast dimensions, kept as trained; ramp 1: slow ones, interpolated.
    freq = default * (1 - ramp) + default / scaling.factor * ramp
    return freq, scaling.scale()
