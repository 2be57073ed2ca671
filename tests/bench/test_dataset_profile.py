"""``benchmarks/workloads/traces.py`` and ``dataset_profile.py``: the paper's sharing figures at
full scale and 256-token blocks (acceptance a), the same for every seed, and a profile
that counts blocks exactly as the engine's prefix cache hashes them."""

from __future__ import annotations

import pytest
from benchmarks.workloads import traces as workloads
from benchmarks.workloads.dataset_profile import profile_prompts, profile_trace

VOCAB = 151936  # Qwen3's


def pct(x: float) -> str:
    return f"{100 * x:.2f}"


@pytest.mark.parametrize("level", [1, 3, 5])
def test_locality_shares_91_67_percent_of_requests(level):
    trace = workloads.locality(level, seed=0, vocab_size=VOCAB)
    p = profile_trace(trace, 256)
    assert p["requests"] == 192 and len({r.group for r in trace.requests}) == 16
    assert pct(p["trace_req_share"]) == "91.67"
    assert trace.params["prefix_tokens"] == {1: 1911, 3: 5655, 5: 9399}[level]


def test_load_skew_shares_98_44_percent_of_requests_and_97_15_percent_of_tokens():
    p = profile_trace(workloads.load_skew(seed=0, vocab_size=VOCAB), 256)
    assert (p["requests"], p["phases"]["warmup"]["requests"], p["phases"]["revisit"]["requests"]) == (192, 3, 189)
    assert (pct(p["trace_req_share"]), pct(p["trace_tok_share"])) == ("98.44", "97.15")


def test_memory_skew_shares_91_67_percent_of_requests_and_72_29_percent_of_tokens():
    p = profile_trace(workloads.memory_skew(seed=0, vocab_size=VOCAB, world_size=4), 256)
    assert [p["phases"][ph]["requests"] for ph in ("warmup", "pressure", "reuse")] == [6, 30, 36]
    assert (pct(p["trace_req_share"]), pct(p["trace_tok_share"])) == ("91.67", "72.29")
    assert p["phases"]["warmup"]["requests_sharing"] == 0  # the six sessions are new
    assert p["phases"]["pressure"]["shared_tokens"] == 30 * 256  # only the anchor block


@pytest.mark.parametrize("seed", [1, 7, 12345])
def test_the_profile_does_not_depend_on_the_seed(seed):
    makers = [lambda s: workloads.locality(5, s, VOCAB), lambda s: workloads.load_skew(s, VOCAB),
              lambda s: workloads.memory_skew(s, VOCAB, 4)]
    for make in makers:
        base, other = make(0), make(seed)
        assert [r.prompt for r in base.requests] != [r.prompt for r in other.requests]
        a, b = profile_trace(base, 256), profile_trace(other, 256)
        for key in ("requests_sharing", "prompt_tokens", "shared_tokens"):
            assert a[key] == b[key]


def test_profile_counts_engine_blocks_and_never_partial_ones():
    b = 4
    p = profile_prompts([
        ("x", [1, 2, 3, 4, 5, 6, 7]),         # 1 complete block; nothing seen yet
        ("x", [1, 2, 3, 4, 5, 6, 7, 8, 9]),   # block 0 seen; block 1 [5..8] is new
        ("x", [1, 2, 3, 4, 5, 6, 7, 8]),      # both blocks seen: 8 tokens
        ("y", [9, 1, 2, 3, 4]),               # same tokens at another offset: nothing
        ("y", [5, 6, 7, 8, 1, 2, 3, 4]),      # block [5..8] seen only after [1..4]: chained, so no
    ], b)
    assert p["requests_sharing"] == 2
    assert p["shared_tokens"] == 4 + 8
    assert p["prompt_tokens"] == 7 + 9 + 8 + 5 + 8
    assert p["phases"]["y"]["requests_sharing"] == 0


def test_traces_are_deterministic_and_well_formed():
    a, b = workloads.memory_skew(3, 1000, 4), workloads.memory_skew(3, 1000, 4)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
    assert [r.index for r in a.requests] == list(range(72))
    assert all(0 <= t < 1000 for r in a.requests for t in r.prompt)
    pinned = {r.phase: {r.rank for r in a.phase_requests(r.phase)} for r in a.requests}
    assert pinned == {"warmup": {0, 1}, "pressure": {0, 1}, "reuse": {None}}
    with pytest.raises(ValueError, match="world_size >= 2"):
        workloads.memory_skew(0, 1000, 1)
    with pytest.raises(ValueError, match="scale"):
        workloads.locality(1, 0, 1000, scale=0)


def test_quick_scale_keeps_block_counts_and_request_shares():
    """Lengths / 32 with 8-token blocks: the same requests can reuse a block."""
    for full, quick in [(workloads.locality(5, 0, VOCAB), workloads.locality(5, 0, 1024, 1 / 32)),
                        (workloads.load_skew(0, VOCAB), workloads.load_skew(0, 1024, 1 / 32)),
                        (workloads.memory_skew(0, VOCAB, 4), workloads.memory_skew(0, 1024, 4, 1 / 32))]:
        pf, pq = profile_trace(full, 256), profile_trace(quick, 8)
        assert pq["requests_sharing"] == pf["requests_sharing"]
        assert abs(pq["trace_tok_share"] - pf["trace_tok_share"]) < 0.01
        assert [len(r.prompt) // 8 for r in quick.requests] == [len(r.prompt) // 256 for r in full.requests]
