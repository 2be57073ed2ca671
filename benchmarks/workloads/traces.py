"""The evaluation's request traces: locality (routing), load skew and memory skew.

A request's prompt is ``shared[:n] + tail``: ``shared`` is one group's fixed random token
sequence and ``tail`` is drawn fresh for that request. Token ids are random because the
benchmarks serve random-weight checkpoints, where text means nothing; what matters is
which complete KV blocks requests have in common, and that is set by the lengths below.

Lengths are written for 256-token KV blocks, the paper's block size. ``scale`` multiplies
every length (rounded, at least one token): a CPU run with 8-token blocks and
``scale=1/32`` keeps the same number of blocks per prompt and the same sharing pattern;
the dataset profile figures of ``benchmarks/README.md`` hold exactly at ``scale=1`` with
256-token blocks.

Invariants:
- a trace is a deterministic function of its arguments;
- the seed changes token ids and orders only, never a length, a group, a phase or a
  pinned rank, so every repetition has the same dataset profile;
- groups draw their shared sequences independently, so requests of different groups
  share no complete block (barring a collision of random blocks, probability about
  ``vocab_size ** -block_size``);
- phases run in the order of ``Trace.phases``; a runner finishes one phase before it
  starts the next.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# ---- locality: 16 recurring groups, 12 requests each ------------------------------------
LOCALITY_GROUPS = 16
LOCALITY_PER_GROUP = 12
LOCALITY_LEVELS = (1, 3, 5)
LOCALITY_HEADER = 39  # shared prefix = header + level x unit: 1,911 / 5,655 / 9,399 tokens
LOCALITY_UNIT = 1872
LOCALITY_TAIL = 32  # each request's own question

# ---- load skew: 3 hot groups, one warm-up each, then 189 revisits ------------------------
LOAD_GROUPS = 3
LOAD_REVISITS = 189
LOAD_PREFIX = 6144  # 24 blocks
LOAD_WARMUP_TAIL = 108
LOAD_REVISIT_TAIL = 81

# ---- memory skew: 6 sessions, 30 pressure requests, 36 session reuses --------------------
MEMORY_SESSIONS = 6
MEMORY_PRESSURE = 30
MEMORY_REUSES = 36
MEMORY_SESSION_PREFIX = 4096  # 16 blocks
MEMORY_WARMUP_TAIL = 128
MEMORY_ANCHOR = 256  # a pressure request opens with its session's first block...
MEMORY_PRESSURE_TAIL = 1099  # ...followed by cold tokens nobody asks for again
MEMORY_REUSE_TAIL = 32

DEFAULT_MAX_TOKENS = 32


@dataclass(frozen=True)
class TraceRequest:
    index: int  # position in the ordered trace
    phase: str
    group: str
    prompt: list[int] = field(repr=False)
    max_tokens: int
    rank: int | None = None  # placed by the workload itself (None: the policy routes it)


@dataclass(frozen=True)
class Trace:
    workload: str
    seed: int
    phases: tuple[str, ...]
    requests: tuple[TraceRequest, ...]
    params: dict  # the scaled lengths and counts, for the record

    def phase_requests(self, phase: str) -> list[TraceRequest]:
        return [r for r in self.requests if r.phase == phase]


class Tokens:
    """Random token ids from one seeded stream."""

    def __init__(self, workload: str, seed: int, vocab_size: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        # A string seed is hashed with SHA-512 by ``random``: stable across processes.
        self._rng = random.Random(f"{workload}/{seed}")
        self._ids = range(vocab_size)

    def draw(self, n: int) -> list[int]:
        return self._rng.choices(self._ids, k=n)

    def shuffle(self, items: list) -> None:
        self._rng.shuffle(items)


def scaled(length: int, scale: float) -> int:
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    return max(1, round(length * scale))


def check_max_tokens(max_tokens: int) -> None:
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")


def locality(level: int, seed: int, vocab_size: int, scale: float = 1.0,
             max_tokens: int = DEFAULT_MAX_TOKENS) -> Trace:
    """192 requests over 16 groups in a seeded shuffled order; the first request of a
    group builds its ``level``x shared prefix, the other 11 can reuse it."""
    if level < 1:
        raise ValueError(f"level must be >= 1, got {level}")
    check_max_tokens(max_tokens)
    name = f"locality_{level}x"
    tokens = Tokens(name, seed, vocab_size)
    prefix = scaled(LOCALITY_HEADER + level * LOCALITY_UNIT, scale)
    tail = scaled(LOCALITY_TAIL, scale)
    shared = [tokens.draw(prefix) for _ in range(LOCALITY_GROUPS)]
    # Balanced groups in a shuffled order, so group ids cannot line up with round robin.
    order = [g for g in range(LOCALITY_GROUPS) for _ in range(LOCALITY_PER_GROUP)]
    tokens.shuffle(order)
    requests = tuple(
        TraceRequest(i, "main", f"g{g:02d}", shared[g] + tokens.draw(tail), max_tokens)
        for i, g in enumerate(order)
    )
    params = {"level": level, "groups": LOCALITY_GROUPS, "per_group": LOCALITY_PER_GROUP,
              "prefix_tokens": prefix, "tail_tokens": tail, "max_tokens": max_tokens, "scale": scale}
    return Trace(name, seed, ("main",), requests, params)


def load_skew(seed: int, vocab_size: int, scale: float = 1.0, max_tokens: int = DEFAULT_MAX_TOKENS) -> Trace:
    """3 warm-ups (one long prefix per hot group), then 189 revisits of those 3 groups
    (63 each) in a seeded shuffled order: all the load lands on three prefixes."""
    check_max_tokens(max_tokens)
    tokens = Tokens("load_skew", seed, vocab_size)
    prefix = scaled(LOAD_PREFIX, scale)
    warm_tail, revisit_tail = scaled(LOAD_WARMUP_TAIL, scale), scaled(LOAD_REVISIT_TAIL, scale)
    shared = [tokens.draw(prefix) for _ in range(LOAD_GROUPS)]
    requests = [TraceRequest(g, "warmup", f"hot{g}", shared[g] + tokens.draw(warm_tail), max_tokens)
                for g in range(LOAD_GROUPS)]
    order = [g for g in range(LOAD_GROUPS) for _ in range(LOAD_REVISITS // LOAD_GROUPS)]
    tokens.shuffle(order)
    for g in order:
        requests.append(TraceRequest(len(requests), "revisit", f"hot{g}",
                                     shared[g] + tokens.draw(revisit_tail), max_tokens))
    params = {"groups": LOAD_GROUPS, "revisits": LOAD_REVISITS, "prefix_tokens": prefix,
              "warmup_tail_tokens": warm_tail, "revisit_tail_tokens": revisit_tail,
              "max_tokens": max_tokens, "scale": scale}
    return Trace("load_skew", seed, ("warmup", "revisit"), tuple(requests), params)


def source_ranks(world_size: int) -> list[int]:
    """The ranks memory skew loads: the first half (at least one); the rest start empty."""
    if world_size < 2:
        raise ValueError(f"memory skew needs world_size >= 2 (an empty partner), got {world_size}")
    return list(range(world_size // 2))


def memory_skew(seed: int, vocab_size: int, world_size: int, scale: float = 1.0,
                max_tokens: int = DEFAULT_MAX_TOKENS) -> Trace:
    """Three phases. ``warmup``: 6 session prefixes, each built on a source rank.
    ``pressure``: 30 requests, 5 per session, pinned to the session's source rank, that
    share only the session's first block (the anchor) and then fill memory with cold
    tokens. ``reuse``: 36 requests, 6 per session, that revisit the whole session prefix
    and are routed by the policy under test.

    Warm-up and pressure placement belongs to the workload (every policy faces the same
    skew: source ranks full, partners empty); only the reuse phase measures the policy."""
    check_max_tokens(max_tokens)
    sources = source_ranks(world_size)
    tokens = Tokens("memory_skew", seed, vocab_size)
    prefix = scaled(MEMORY_SESSION_PREFIX, scale)
    anchor = min(prefix, scaled(MEMORY_ANCHOR, scale))
    warm_tail, cold_tail = scaled(MEMORY_WARMUP_TAIL, scale), scaled(MEMORY_PRESSURE_TAIL, scale)
    reuse_tail = scaled(MEMORY_REUSE_TAIL, scale)
    shared = [tokens.draw(prefix) for _ in range(MEMORY_SESSIONS)]
    home = [sources[s % len(sources)] for s in range(MEMORY_SESSIONS)]
    requests: list[TraceRequest] = []

    def add(phase: str, s: int, prompt: list[int], rank: int | None) -> None:
        requests.append(TraceRequest(len(requests), phase, f"session{s}", prompt, max_tokens, rank))

    for s in range(MEMORY_SESSIONS):
        add("warmup", s, shared[s] + tokens.draw(warm_tail), home[s])
    # Sessions interleaved, so pressure grows on every source rank at once.
    for i in range(MEMORY_PRESSURE):
        s = i % MEMORY_SESSIONS
        add("pressure", s, shared[s][:anchor] + tokens.draw(cold_tail), home[s])
    for i in range(MEMORY_REUSES):
        s = i % MEMORY_SESSIONS
        add("reuse", s, shared[s] + tokens.draw(reuse_tail), None)
    params = {"sessions": MEMORY_SESSIONS, "pressure": MEMORY_PRESSURE, "reuses": MEMORY_REUSES,
              "session_prefix_tokens": prefix, "warmup_tail_tokens": warm_tail, "anchor_tokens": anchor,
              "pressure_tail_tokens": cold_tail, "reuse_tail_tokens": reuse_tail,
              "source_ranks": sources, "session_ranks": home, "max_tokens": max_tokens, "scale": scale}
    return Trace("memory_skew", seed, ("warmup", "pressure", "reuse"), tuple(requests), params)


def max_request_tokens(traces: list[Trace]) -> int:
    """The longest prompt plus its output over ``traces`` (sizes ``max_model_len``)."""
    return max(len(r.prompt) + r.max_tokens for t in traces for r in t.requests)
