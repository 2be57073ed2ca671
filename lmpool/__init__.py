"""LMPool: one LLM served from N data-parallel replicas whose paged KV caches act as one pool.

The public names are loaded on first use (PEP 562): a process that needs one light module of the
package (the control process, the HTTP server's body-parsing process) does not import the engine,
and torch with it, by importing ``lmpool``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOMES = {
    "LLM": "lmpool.frontend.llm",
    "AsyncLMPool": "lmpool.frontend.api",
    "LMPool": "lmpool.frontend.api",
    "RequestOutput": "lmpool.outputs",
    "SamplingParams": "lmpool.sampling_params",
    "TokenLogprobs": "lmpool.token_logprobs",
}

__all__ = ["LLM", "AsyncLMPool", "LMPool", "RequestOutput", "SamplingParams", "TokenLogprobs"]  # _HOMES' keys

if TYPE_CHECKING:
    from lmpool.frontend.api import AsyncLMPool, LMPool
    from lmpool.frontend.llm import LLM
    from lmpool.outputs import RequestOutput
    from lmpool.sampling_params import SamplingParams
    from lmpool.token_logprobs import TokenLogprobs


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'lmpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
