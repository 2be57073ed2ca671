"""Multi-turn sessions whose histories grow under KV pressure (workload ``sessions``).

16 sessions of 8 turns. Turn 0 of a session is a system prompt common to every session
followed by the session's own opening request; turn k's prompt is turn k-1's prompt, then
turn k-1's reply, then a new user turn. Replies are recorded tokens of ``max_tokens``
length drawn with the trace (a replayed conversation: the model's own output does not
feed back, so every policy sees the same prompts). Each turn is a phase (a barrier), so a
turn is only asked once the session's previous turn has finished; within a turn the
sessions arrive interleaved in a seeded shuffled order.

At scale 1 with 256-token blocks the last turn's prompt holds about 25 blocks, so the 16
histories need about 400 blocks: more than the e2e suite's whole-pool budget (384), so
keeping each session where its history is, and what is evicted, decides reuse.

Invariants (beside ``workloads``' own): turn k's prompt begins with turn k-1's whole
prompt; sessions share only the system prompt; lengths do not depend on the seed.
"""

from __future__ import annotations

from workloads import DEFAULT_MAX_TOKENS, Tokens, Trace, TraceRequest, check_max_tokens, scaled

SESSIONS = 16
TURNS = 8
SYSTEM_PROMPT = 512  # 2 blocks, common to every session
OPENING = 2048  # the session's first user request
USER_TURN = 512  # each later user turn


def sessions(seed: int, vocab_size: int, scale: float = 1.0, max_tokens: int = DEFAULT_MAX_TOKENS,
             n_sessions: int = SESSIONS, turns: int = TURNS) -> Trace:
    """``n_sessions`` sessions of ``turns`` turns, one phase per turn (``turn0``, ...)."""
    check_max_tokens(max_tokens)
    if n_sessions < 1 or turns < 1:
        raise ValueError(f"sessions and turns must be >= 1, got {n_sessions} and {turns}")
    tokens = Tokens("sessions", seed, vocab_size)
    system = tokens.draw(scaled(SYSTEM_PROMPT, scale))
    opening, user = scaled(OPENING, scale), scaled(USER_TURN, scale)
    history = [system + tokens.draw(opening) for _ in range(n_sessions)]
    requests: list[TraceRequest] = []
    for turn in range(turns):
        order = list(range(n_sessions))
        tokens.shuffle(order)
        for s in order:
            requests.append(TraceRequest(len(requests), f"turn{turn}", f"session{s:02d}", history[s], max_tokens))
        # The next turn carries this turn's recorded reply and a new user turn.
        history = [h + tokens.draw(max_tokens) + tokens.draw(user) for h in history]
    params = {"sessions": n_sessions, "turns": turns, "system_tokens": len(system), "opening_tokens": opening,
              "user_turn_tokens": user, "reply_tokens": max_tokens, "max_tokens": max_tokens, "scale": scale}
    return Trace("sessions", seed, tuple(f"turn{t}" for t in range(turns)), tuple(requests), params)
