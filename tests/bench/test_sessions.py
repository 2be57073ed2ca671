"""The ``sessions`` and ``agent_sessions`` workloads (``benchmarks/workloads/sessions.py``): every turn extends the session's
previous prompt by its reply and a new user turn, turns are phases, sessions share only the
system prompt, and the histories outgrow the e2e suite's KV budget."""

from __future__ import annotations

from hypothesis import assume, given
from hypothesis import strategies as st

from benchmarks.workloads.dataset_profile import profile_trace
from benchmarks.workloads.sessions import (
    agent_sessions,
    agent_sessions_scaleout,
    agent_sessions_zipf,
    preamble_of,
    sessions,
)

VOCAB = 151936


def test_each_turn_extends_the_previous_prompt_by_a_reply_and_a_user_turn():
    trace = sessions(0, VOCAB)
    assert trace.phases == tuple(f"turn{t}" for t in range(8)) and len(trace.requests) == 128
    by_session: dict[str, list] = {}
    for r in trace.requests:
        by_session.setdefault(r.group, []).append(r)
    assert len(by_session) == 16
    for turns in by_session.values():
        assert [r.phase for r in turns] == list(trace.phases)
        assert len(turns[0].prompt) == 512 + 2048
        for before, after in zip(turns, turns[1:]):
            assert after.prompt[:len(before.prompt)] == before.prompt
            assert len(after.prompt) == len(before.prompt) + 32 + 512  # the reply, then the user turn
    openings = [turns[0].prompt for turns in by_session.values()]
    assert len({tuple(o[:512]) for o in openings}) == 1  # one system prompt
    assert len({tuple(o[512:768]) for o in openings}) == 16  # the sessions' own requests differ


def test_sessions_interleave_within_a_turn_and_outgrow_the_e2e_budget():
    trace = sessions(3, VOCAB)
    firsts = [r.group for r in trace.phase_requests("turn0")]
    seconds = [r.group for r in trace.phase_requests("turn1")]
    assert sorted(firsts) == sorted(seconds) and firsts != seconds  # a shuffled order per turn
    last = trace.phase_requests("turn7")
    assert sum(-(-len(r.prompt) // 256) for r in last) > 384  # more history than the pool's 384 blocks
    p = profile_trace(trace, 256)
    assert p["phases"]["turn0"]["requests_sharing"] == 15  # only the system prompt, after the first
    assert p["phases"]["turn0"]["shared_tokens"] == 15 * 512
    assert all(p["phases"][f"turn{t}"]["requests_sharing"] == 16 for t in range(1, 8))


def test_the_seed_changes_tokens_and_order_only():
    a, b = profile_trace(sessions(0, VOCAB), 256), profile_trace(sessions(9, VOCAB), 256)
    for key in ("requests_sharing", "prompt_tokens", "shared_tokens"):
        assert a[key] == b[key]


def test_agent_sessions_share_one_of_four_preambles_and_outgrow_128_blocks_a_replica():
    trace = agent_sessions(0, VOCAB)
    assert trace.phases == tuple(f"turn{t}" for t in range(6)) and len(trace.requests) == 192
    openings = {r.group: r.prompt for r in trace.phase_requests("turn0")}
    preambles = {tuple(p[:2048]) for p in openings.values()}
    assert len(openings) == 32 and len(preambles) == 4
    for s, prompt in openings.items():  # session s opens with preamble s mod 4
        assert tuple(prompt[:2048]) == tuple(openings[f"session{int(s[-2:]) % 4:02d}"][:2048])
    last = trace.phase_requests("turn5")
    assert sum(-(-len(r.prompt) // 256) for r in last) > 4 * 128  # more history than 4 x 128 blocks
    p = profile_trace(trace, 256)
    assert p["phases"]["turn0"]["requests_sharing"] == 28 and p["phases"]["turn0"]["shared_tokens"] == 28 * 2048
    a, b = profile_trace(agent_sessions(5, VOCAB), 256), p
    assert all(a[key] == b[key] for key in ("requests_sharing", "prompt_tokens", "shared_tokens"))


def test_zipf_popular_preambles_open_15_8_5_and_4_sessions_whatever_the_seed():
    trace = agent_sessions_zipf(0, VOCAB)
    assert trace.params["preamble_sessions"] == [15, 8, 5, 4]
    openings = {r.group: tuple(r.prompt[:2048]) for r in trace.phase_requests("turn0")}
    by_preamble = sorted((list(openings.values()).count(p) for p in set(openings.values())), reverse=True)
    assert by_preamble == [15, 8, 5, 4]
    other = {r.group: tuple(r.prompt[:2048]) for r in agent_sessions_zipf(7, VOCAB).phase_requests("turn0")}
    same = {s: {t for t in openings if openings[t] == openings[s]} for s in openings}  # who shares with whom
    assert same == {s: {t for t in other if other[t] == other[s]} for s in other}
    assert openings != other  # the seed changes the tokens


@given(st.integers(1, 64), st.integers(1, 8), st.floats(0.1, 3.0))
def test_zipf_preambles_open_every_session_once_and_the_popular_ones_most(sessions_, preambles, zipf):
    assume(preambles <= sessions_)
    owner = preamble_of(sessions_, preambles, zipf)
    counts = [owner.count(k) for k in range(preambles)]
    assert len(owner) == sessions_ and min(counts) >= 1
    assert counts == sorted(counts, reverse=True)
    assert preamble_of(sessions_, preambles, 0.0) == [s % preambles for s in range(sessions_)]


def test_a_scaled_out_pool_s_sessions_all_open_on_replica_0_then_route_freely():
    """The agent sessions' prompts, turn by turn, with only turn 0 placed (on replica 0)."""
    trace, plain = agent_sessions_scaleout(3, VOCAB), agent_sessions(3, VOCAB)
    assert [r.prompt for r in trace.requests] != [r.prompt for r in plain.requests]  # its own tokens
    assert trace.phases == plain.phases and trace.params["opened_on"] == 0
    assert {r.rank for r in trace.phase_requests("turn0")} == {0}
    assert all(r.rank is None for r in trace.requests if r.phase != "turn0")
    assert [len(r.prompt) for r in trace.requests] == [len(r.prompt) for r in plain.requests]
