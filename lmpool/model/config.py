"""The Qwen3 dense model configuration LMPool serves, read from a Hugging Face directory.

Owns parsing ``config.json`` (+ the EOS ids of ``generation_config.json``) into a frozen
``ModelConfig``, and writing it back in the same format.

Invariants:
- only the Qwen3 dense architecture is accepted (``model_type == "qwen3"`` or
  ``Qwen3ForCausalLM`` in ``architectures``); anything else is a ``ValueError``.
- a missing non-shape key (eps, rope_theta, tying, ...) takes the value transformers'
  ``Qwen3Config`` would give it, so LMPool and transformers build the same model from
  the same directory. transformers' shape defaults describe Qwen3-8B and mean nothing
  for another model, so the main shapes are required, and the two that configs of this
  family sometimes omit are derived the conventional way: ``head_dim = hidden_size //
  num_attention_heads`` and ``num_key_value_heads = num_attention_heads``. (Published
  Qwen3 configs give both explicitly.)
- features that would silently change the math (rope scaling other than YaRN, sliding
  window, an activation other than SiLU) are rejected rather than ignored. YaRN is kept
  (``lmpool.model.rope``) and lengthens ``max_context`` to its scaled context.
- every constructed ``ModelConfig`` has positive shapes,
  ``num_attention_heads % num_key_value_heads == 0``, and a finite positive
  ``rms_norm_eps`` and ``rope_theta`` (others give NaN or garbage with no error).
- a malformed value (a rope dict that is not an object, a number that is not one) is a
  ``ValueError`` naming the key, never an ``AttributeError``/``KeyError``/``TypeError``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmpool.model.rope import YarnScaling

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_SUPPORTED = 'model_type "qwen3" / architecture "Qwen3ForCausalLM"'
# The config format written is that of the first transformers release with Qwen3, as
# published Qwen3 checkpoints state it. Some transformers 5 releases take a local config
# without this key for a Mistral one and warn that its tokenizer's regex is wrong.
_WRITTEN_AS = "4.51.0"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    rope_scaling: YarnScaling | None = None

    @property
    def max_context(self) -> int:
        """The longest sequence the model is meant for: its positions, or YaRN's scaled context."""
        scaled = self.rope_scaling.context if self.rope_scaling is not None else 0
        return max(self.max_position_embeddings, scaled)

    def __post_init__(self) -> None:
        for key in (*_REQUIRED, "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.torch_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"unsupported torch_dtype {self.torch_dtype!r}")
        for key in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, key)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not (math.isfinite(value) and value > 0)):
                raise ValueError(f"{key} must be a finite number > 0, got {value!r}")
        for token_id in (*self.eos_token_ids, *([] if self.bos_token_id is None else [self.bos_token_id])):
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"eos/bos token ids must be integers >= 0, got {token_id!r}")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory not found: {path}")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        generation_file = path / "generation_config.json"
        generation = _read_json(generation_file) if generation_file.is_file() else None
        return cls.from_hf_dict(_read_json(config_file), generation)

    @classmethod
    def from_hf_dict(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        model_type = config.get("model_type")
        architectures = config.get("architectures") or []
        if model_type != "qwen3" and "Qwen3ForCausalLM" not in architectures:
            raise ValueError(
                f"unsupported model: model_type={model_type!r}, architectures={architectures!r}; "
                f"LMPool supports only {_SUPPORTED}"
            )
        for key in _REQUIRED:
            if config.get(key) is None:
                raise ValueError(f"config.json is missing required key {key!r}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r}; only 'silu'")
        if config.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported")

        generation_config = generation_config or {}
        eos: list[int] = []
        for ids in (config.get("eos_token_id"), generation_config.get("eos_token_id")):
            for token_id in [ids] if isinstance(ids, int) else ids or []:
                if token_id not in eos:
                    eos.append(token_id)
        bos = config.get("bos_token_id")
        if bos is None:
            bos = generation_config.get("bos_token_id")

        heads = config["num_attention_heads"]
        theta, scaling = _rope(config)
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=_number(config, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            eos_token_ids=tuple(eos),
            bos_token_id=bos,
            torch_dtype=config.get("torch_dtype") or config.get("dtype") or "bfloat16",
            rope_scaling=scaling,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json contents transformers' Qwen3ForCausalLM loads as this model."""
        ids = list(self.eos_token_ids)
        eos: int | list[int] | None = (ids[0] if len(ids) == 1 else ids) if ids else None
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf() if self.rope_scaling is not None else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": self.torch_dtype,
            "use_cache": True,
            "transformers_version": _WRITTEN_AS,
        }

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype | str) -> int:
        """Bytes one KV-cache block of ``block_size`` tokens takes across all layers (K and V)."""
        torch_dtype: torch.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return (
            self.num_hidden_layers * 2 * block_size * self.num_key_value_heads
            * self.head_dim * torch_dtype.itemsize
        )


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _rope(config: dict[str, Any]) -> tuple[float, YarnScaling | None]:
    """rope_theta, from a top-level key or the ``rope_parameters``/``rope_scaling`` dict newer
    transformers versions write, and the YaRN scaling if that dict asks for it; any other rope
    type but the default one is rejected."""
    theta, scaling = config.get("rope_theta"), None
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key)
        if not params:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"{key} must be a JSON object, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "yarn":
            try:
                scaling = YarnScaling.from_hf(params)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{key} is not a valid YaRN scaling: {e}") from None
        elif rope_type != "default":
            raise ValueError(f"unsupported {key} rope_type {rope_type!r}; only 'default' and 'yarn'")
        theta = params.get("rope_theta", theta)
    return _number({"rope_theta": theta}, "rope_theta", 10000.0), scaling


def _number(config: dict[str, Any], key: str, default: float) -> float:
    """``config[key]`` as a float (``default`` when absent or null); anything else but a
    number is a ValueError naming the key."""
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)
