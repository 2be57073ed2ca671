"""Multi-turn sessions whose histories grow under KV pressure (workloads ``sessions``,
``agent_sessions`` and ``agent_sessions_zipf``).

A session's turn 0 is one of the shared preambles (a system prompt; session ``s`` opens with
preamble ``s mod preambles``, or, with a Zipf exponent, preambles drawn by popularity) followed
by the session's own opening request; turn k's prompt is
turn k-1's prompt, then turn k-1's reply, then a new user turn. Replies are recorded tokens of
``max_tokens`` length drawn with the trace (a replayed conversation: the model's own output
does not feed back, so every policy sees the same prompts). Each turn is a phase (a barrier),
so a turn is only asked once the session's previous turn has finished; within a turn the
sessions arrive interleaved in a seeded shuffled order.

- ``sessions``: 16 sessions of 8 turns, one 512-token system prompt, 2,048-token openings,
  512-token user turns. At scale 1 with 256-token blocks the last turn's prompt holds about
  25 blocks, so the 16 histories need about 400 blocks: more than the e2e suite's whole-pool
  budget (384), so keeping each session where its history is, and what is evicted, decides reuse.
- ``agent_sessions``: 32 agent sessions of 6 turns over 4 preambles of 2,048 tokens (tool
  definitions, say), 1,024-token openings, 256-token user turns: about 18 blocks a session by
  its last turn, 576 in all, beside 4 shared preambles. Run it at 128 blocks per replica
  (``--num-kv-blocks 128``) for KV pressure, and at twice that for little.
- ``agent_sessions_zipf``: the same, but the preambles' popularity follows Zipf (exponent 1.1,
  as the chat service's tenants): 15, 8, 5 and 4 sessions. Keeping every session with its
  preamble's cache now loads one replica with half the sessions and their growing histories;
  what decides a policy is when a session is worth opening elsewhere.
- ``agent_sessions_scaleout``: ``agent_sessions`` over caches its router did not build: every
  session opened on replica 0 (turn 0 pinned there), the others empty, as after a scale-out or
  a gateway restart. A policy that keeps each session with its history keeps replica 0 carrying
  them all; one that balances recomputes or moves histories. The router's knowledge differs by
  design here: a pinned request never reaches the SGLang copy's tree or the real gateway's
  (they meet turn 1 knowing nothing, as a restarted gateway would), while LMPool reads the
  replicas' caches and Dynamo's router their KV events. A red-team trace of this kind (16
  sessions of 9 turns on 2 replicas, on CPU) had the default run about 115 of its 144 requests on
  replica 0 and 24 % behind the SGLang copy's throughput; this workload on CPU showed no gap
  beyond the run-to-run noise (``results/eval_NOTES.md``).

Invariants (beside ``workloads``' own): turn k's prompt begins with turn k-1's whole prompt;
sessions share only their preamble; lengths and each session's preamble do not depend on the
seed.
"""

from __future__ import annotations

import random

from benchmarks.workloads.traces import DEFAULT_MAX_TOKENS, Tokens, Trace, TraceRequest, check_max_tokens, scaled

SESSIONS = 16
TURNS = 8
SYSTEM_PROMPT = 512  # 2 blocks, common to every session
OPENING = 2048  # the session's first user request
USER_TURN = 512  # each later user turn
# agent_sessions
AGENT_SESSIONS, AGENT_TURNS, AGENT_PREAMBLES = 32, 6, 4
AGENT_PREAMBLE, AGENT_OPENING, AGENT_USER_TURN = 2048, 1024, 256
ZIPF = 1.1  # agent_sessions_zipf's preamble popularity


def sessions(seed: int, vocab_size: int, scale: float = 1.0, max_tokens: int = DEFAULT_MAX_TOKENS,
             n_sessions: int = SESSIONS, turns: int = TURNS, preambles: int = 1, preamble: int = SYSTEM_PROMPT,
             opening: int = OPENING, user_turn: int = USER_TURN, name: str = "sessions",
             zipf: float = 0.0, opened_on: int | None = None) -> Trace:
    """``n_sessions`` sessions of ``turns`` turns over ``preambles`` shared preambles of
    ``preamble`` tokens, one phase per turn (``turn0``, ...); ``zipf`` > 0 gives the preambles
    that popularity (``preamble_of``); ``opened_on``: the rank every session's turn 0 is pinned to."""
    check_max_tokens(max_tokens)
    if n_sessions < 1 or turns < 1 or not 1 <= preambles <= n_sessions:
        raise ValueError(f"need sessions >= 1, turns >= 1 and 1 <= preambles <= sessions, got "
                         f"{n_sessions}, {turns}, {preambles}")
    tokens = Tokens(name, seed, vocab_size)
    shared = [tokens.draw(scaled(preamble, scale)) for _ in range(preambles)]
    opening, user = scaled(opening, scale), scaled(user_turn, scale)
    owner = preamble_of(n_sessions, preambles, zipf)
    history = [shared[owner[s]] + tokens.draw(opening) for s in range(n_sessions)]
    requests: list[TraceRequest] = []
    for turn in range(turns):
        order = list(range(n_sessions))
        tokens.shuffle(order)
        for s in order:
            rank = opened_on if turn == 0 else None
            requests.append(TraceRequest(len(requests), f"turn{turn}", f"session{s:02d}", history[s], max_tokens, rank))
        # The next turn carries this turn's recorded reply and a new user turn.
        history = [h + tokens.draw(max_tokens) + tokens.draw(user) for h in history]
    params = {"sessions": n_sessions, "turns": turns, "preambles": preambles, "preamble_tokens": len(shared[0]),
              "opening_tokens": opening, "user_turn_tokens": user, "reply_tokens": max_tokens,
              "max_tokens": max_tokens, "scale": scale}
    if opened_on is not None:
        params["opened_on"] = opened_on
    if zipf:
        params["zipf"] = zipf
        params["preamble_sessions"] = [owner.count(k) for k in range(preambles)]
    if preambles == 1:  # the record's older name for the one system prompt
        params["system_tokens"] = params["preamble_tokens"]
    return Trace(name, seed, tuple(f"turn{t}" for t in range(turns)), tuple(requests), params)


def agent_sessions(seed: int, vocab_size: int, scale: float = 1.0, max_tokens: int = DEFAULT_MAX_TOKENS) -> Trace:
    return sessions(seed, vocab_size, scale, max_tokens, AGENT_SESSIONS, AGENT_TURNS, AGENT_PREAMBLES,
                    AGENT_PREAMBLE, AGENT_OPENING, AGENT_USER_TURN, name="agent_sessions")


def agent_sessions_zipf(seed: int, vocab_size: int, scale: float = 1.0, max_tokens: int = DEFAULT_MAX_TOKENS) -> Trace:
    return sessions(seed, vocab_size, scale, max_tokens, AGENT_SESSIONS, AGENT_TURNS, AGENT_PREAMBLES,
                    AGENT_PREAMBLE, AGENT_OPENING, AGENT_USER_TURN, name="agent_sessions_zipf", zipf=ZIPF)


def agent_sessions_scaleout(seed: int, vocab_size: int, scale: float = 1.0,
                            max_tokens: int = DEFAULT_MAX_TOKENS) -> Trace:
    return sessions(seed, vocab_size, scale, max_tokens, AGENT_SESSIONS, AGENT_TURNS, AGENT_PREAMBLES,
                    AGENT_PREAMBLE, AGENT_OPENING, AGENT_USER_TURN, name="agent_sessions_scaleout", opened_on=0)


def preamble_of(n_sessions: int, preambles: int, zipf: float) -> list[int]:
    """Each session's preamble: ``s mod preambles`` without ``zipf``; with it, preamble k opens
    a share of the sessions proportional to ``1 / (k + 1) ** zipf`` (largest remainders; every
    preamble at least one session), the sessions dealt in a fixed shuffled order, so the seed
    changes none of it."""
    if not zipf:
        return [s % preambles for s in range(n_sessions)]
    weights = [1 / (k + 1) ** zipf for k in range(preambles)]
    spare = n_sessions - preambles  # one each first
    quotas = [spare * w / sum(weights) for w in weights]
    counts = [1 + int(q) for q in quotas]
    by_remainder = sorted(range(preambles), key=lambda k: (int(quotas[k]) - quotas[k], k))
    for k in by_remainder[:n_sessions - sum(counts)]:
        counts[k] += 1
    owner = [k for k in range(preambles) for _ in range(counts[k])]
    random.Random("sessions/preambles").shuffle(owner)
    return owner
