"""The ``hot_context`` family (``benchmarks/workloads/hot_context.py``): lengths, sharing, phases, the
owners' pinned reads, and an oracle that differs from its real trace only in placing every
context on every rank before the same burst."""

from __future__ import annotations

import pytest
from benchmarks.workloads.dataset_profile import profile_trace
from benchmarks.workloads.hot_context import hot_context, oracle_of, owners, workload_name

VOCAB = 151936


@pytest.mark.parametrize("length,n", [(4096, 1), (16384, 2), (32768, 2)])
def test_lengths_phases_and_sharing_at_full_scale(length, n):
    trace = hot_context(length, n, seed=0, vocab_size=VOCAB, world_size=4)
    assert trace.workload == workload_name(length, n) and trace.phases == ("read", "burst")
    reads, burst = trace.phase_requests("read"), trace.phase_requests("burst")
    assert [len(r.prompt) for r in reads] == [length + 32] * n
    assert len(burst) == 128 and all(len(r.prompt) == length + 64 and r.rank is None for r in burst)
    assert [r.rank for r in reads] == owners(n, 4) == list(range(n))
    per_context = {g: sum(r.group == g for r in burst) for g in {r.group for r in burst}}
    assert per_context == {f"ctx{c}": 128 // n for c in range(n)}  # the burst is spread evenly
    for r in burst:  # each question carries its whole context, block aligned
        context = reads[int(r.group[3:])].prompt[:length]
        assert r.prompt[:length] == context
    p = profile_trace(trace, 256)
    assert p["phases"]["read"]["requests_sharing"] == 0  # the contexts share nothing
    assert p["phases"]["burst"]["requests_sharing"] == 128
    assert p["phases"]["burst"]["shared_tokens"] == 128 * length  # every question can reuse its whole context


def test_the_oracle_reads_every_context_on_every_rank_and_asks_the_same_burst():
    real = hot_context(16384, 2, seed=5, vocab_size=VOCAB, world_size=4)
    oracle = hot_context(16384, 2, seed=5, vocab_size=VOCAB, world_size=4, oracle=True)
    assert oracle.workload == oracle_of(real.workload) == "hot_context_16k_2c_oracle"
    placed = sorted((r.group, r.rank) for r in oracle.phase_requests("read"))
    assert placed == [(f"ctx{c}", rank) for c in range(2) for rank in range(4)]
    context = {r.group: r.prompt[:16384] for r in real.phase_requests("read")}
    assert all(r.prompt[:16384] == context[r.group] for r in oracle.phase_requests("read"))
    assert [(r.group, r.prompt) for r in oracle.phase_requests("burst")] == [
        (r.group, r.prompt) for r in real.phase_requests("burst")]
    assert [r.index for r in oracle.requests] == list(range(8 + 128))
    assert profile_trace(oracle, 256)["phases"]["read"]["requests_sharing"] == 6  # 3 more ranks per context


def test_quick_scale_keeps_block_counts_and_the_seed_changes_only_tokens():
    full = hot_context(32768, 2, 0, VOCAB, 4)
    quick = hot_context(32768, 2, 0, 1024, 4, scale=1 / 32)
    assert [len(r.prompt) // 8 for r in quick.requests] == [len(r.prompt) // 256 for r in full.requests]
    other = hot_context(32768, 2, 1, 1024, 4, scale=1 / 32)
    assert [len(r.prompt) for r in other.requests] == [len(r.prompt) for r in quick.requests]
    assert [r.prompt for r in other.requests] != [r.prompt for r in quick.requests]
    assert profile_trace(other, 8)["shared_tokens"] == profile_trace(quick, 8)["shared_tokens"]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="contexts <= questions"):
        hot_context(4096, 3, 0, VOCAB, 4, questions=2)
    with pytest.raises(ValueError, match="max_tokens"):
        hot_context(4096, 1, 0, VOCAB, 4, max_tokens=0)
    assert workload_name(4096, 1) == "hot_context_4k_1c" and workload_name(6144, 3, True) == "hot_context_6k_3c_oracle"
