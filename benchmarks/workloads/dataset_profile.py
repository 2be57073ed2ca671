"""How much prefix sharing a trace holds, before any system runs it.

Replays the trace in order against an unlimited cache with perfect placement: every
complete block any earlier request produced is available to every later request. Blocks
are identified by the engine's own chained hashes (``lmpool.engine.hashing``) at the run's
block size, so "shared" here means exactly what the prefix cache can reuse.

- ``trace_req_share``: requests whose first complete block was seen before, over all
  requests (the request can reuse at least one block).
- ``trace_tok_share``: over all prompt tokens, the tokens covered by each request's
  longest previously seen block-aligned prefix. Partial tail blocks never count.

Runtime ``DP req hit`` / ``DP tok reuse`` measure how much of this potential a policy
realises under finite caches, placement and timing; these figures are their upper bounds.
"""

from __future__ import annotations

from collections.abc import Iterable

from lmpool.engine.hashing import chain_hashes


def _counts() -> dict:
    return {"requests": 0, "requests_sharing": 0, "prompt_tokens": 0, "shared_tokens": 0}


def _finish(c: dict) -> dict:
    c["trace_req_share"] = c["requests_sharing"] / c["requests"] if c["requests"] else 0.0
    c["trace_tok_share"] = c["shared_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0
    return c


def profile_prompts(prompts: Iterable[tuple[str, list[int]]], block_size: int) -> dict:
    """The sharing profile of ``(phase, prompt)`` pairs in replay order, overall and per phase."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seen: set[int] = set()
    total = _counts()
    phases: dict[str, dict] = {}
    for phase, prompt in prompts:
        hashes = chain_hashes(list(prompt), block_size)
        # Chained hashes: block k is seen only if its whole prefix was, so the longest
        # reusable prefix ends at the first unseen hash.
        k = 0
        while k < len(hashes) and hashes[k] in seen:
            k += 1
        seen.update(hashes)
        for c in (total, phases.setdefault(phase, _counts())):
            c["requests"] += 1
            c["requests_sharing"] += k > 0
            c["prompt_tokens"] += len(prompt)
            c["shared_tokens"] += k * block_size
    result = _finish(total)
    result["block_size"] = block_size
    result["assumptions"] = "ordered replay, unlimited cache, perfect placement"
    result["phases"] = {name: _finish(c) for name, c in phases.items()}
    return result


def profile_trace(trace, block_size: int) -> dict:
    """``profile_prompts`` of a ``workloads.Trace``, with its name and parameters."""
    result = profile_prompts(((r.phase, r.prompt) for r in trace.requests), block_size)
    result["workload"] = trace.workload
    result["params"] = dict(trace.params)
    return result
