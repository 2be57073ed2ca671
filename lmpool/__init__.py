"""LMPool: one LLM served from N data-parallel replicas whose paged KV caches act as one pool."""

from lmpool.frontend.llm import LLM
from lmpool.outputs import RequestOutput
from lmpool.frontend.api import AsyncLMPool, LMPool
from lmpool.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLMPool", "LMPool", "RequestOutput", "SamplingParams"]
