"""The ``chat`` workload (``benchmarks/workloads/chat_service.py``): tenants' prompts share only their own
system prompt, the most popular tenant leads by Zipf, a fifth of the prompts are unique, and
the seed changes token ids and the order only."""

from __future__ import annotations

import collections

from benchmarks.workloads.chat_service import chat_service
from benchmarks.workloads.dataset_profile import profile_trace

VOCAB = 151936


def test_tenants_share_only_their_system_prompt_and_a_fifth_is_unique():
    trace = chat_service(0, VOCAB)
    assert trace.phases == ("main",) and len(trace.requests) == 256
    groups = collections.Counter(r.group for r in trace.requests)
    assert 0.12 < groups["unique"] / 256 < 0.28
    tenants = [groups[f"tenant{t}"] for t in range(8)]
    assert tenants[0] == max(tenants) and tenants[0] > 2 * tenants[4]  # Zipf: the first tenant leads
    for t, length in enumerate(trace.params["system_tokens"]):
        prompts = [r.prompt for r in trace.requests if r.group == f"tenant{t}"]
        assert len({tuple(p[:length]) for p in prompts}) == 1  # one system prompt
        assert len({tuple(p[length:length + 32]) for p in prompts}) == len(prompts)  # messages of their own
        assert all(64 <= len(p) - length <= 512 for p in prompts)
    assert all(len(r.prompt) == 1024 for r in trace.requests if r.group == "unique")


def test_the_seed_changes_tokens_and_order_only():
    a, b = chat_service(0, VOCAB), chat_service(4, VOCAB)
    assert [r.group for r in a.requests] != [r.group for r in b.requests]
    assert sorted((r.group, len(r.prompt)) for r in a.requests) == sorted((r.group, len(r.prompt)) for r in b.requests)
    pa, pb = profile_trace(a, 256), profile_trace(b, 256)
    assert all(pa[key] == pb[key] for key in ("requests_sharing", "prompt_tokens", "shared_tokens"))
