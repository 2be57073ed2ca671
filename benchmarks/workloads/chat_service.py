"""A shared chat service: a few tenants' system prompts under unique traffic (workload ``chat``).

8 tenants, each with its own system prompt (512 to 2,048 tokens), share one pool. 256
requests in one phase: 80% are a tenant's system prompt followed by a user message of its
own (64 to 512 tokens), the tenants drawn by popularity (Zipf, exponent 1.1: the first tenant
about a third of them); 20% are unique prompts of 1,024 tokens that nobody else shares (a
pasted document, an API caller without a system prompt). The requests arrive in a seeded
shuffled order; the runner's window (e2e suite: 16) keeps a steady number in flight.

What decides a policy here: keeping each tenant's system prompt where it is cached while
the most popular tenant's traffic overloads its replica, and where the unique prompts go.

Invariants (beside ``workloads``' own): tenants' prompts share only their own system prompt;
the tenant and length of every request come from a generator of their own, so the seed changes
token ids and the order only.
"""

from __future__ import annotations

import random

from benchmarks.workloads.traces import DEFAULT_MAX_TOKENS, Tokens, Trace, TraceRequest, check_max_tokens, scaled

TENANTS = 8
REQUESTS = 256
UNIQUE_SHARE = 0.2
ZIPF = 1.1
SYSTEM_TOKENS = (2048, 1024, 1536, 512)  # tenant t's: SYSTEM_TOKENS[t % 4]
USER_TOKENS = (64, 512)  # a user message's length, uniform in this range
UNIQUE_TOKENS = 1024


def chat_service(seed: int, vocab_size: int, scale: float = 1.0, max_tokens: int = DEFAULT_MAX_TOKENS,
                 requests: int = REQUESTS) -> Trace:
    check_max_tokens(max_tokens)
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    shape = random.Random("chat/shape")  # who asks and how long: the same for every seed
    weights = [1 / (t + 1) ** ZIPF for t in range(TENANTS)]
    asks = []
    for _ in range(requests):
        if shape.random() < UNIQUE_SHARE:
            asks.append((None, scaled(UNIQUE_TOKENS, scale)))
        else:
            asks.append((shape.choices(range(TENANTS), weights)[0], scaled(shape.randint(*USER_TOKENS), scale)))
    tokens = Tokens("chat", seed, vocab_size)
    systems = [tokens.draw(scaled(SYSTEM_TOKENS[t % len(SYSTEM_TOKENS)], scale)) for t in range(TENANTS)]
    tokens.shuffle(asks)
    out = tuple(
        TraceRequest(i, "main", "unique" if tenant is None else f"tenant{tenant}",
                     (systems[tenant] if tenant is not None else []) + tokens.draw(n), max_tokens)
        for i, (tenant, n) in enumerate(asks))
    params = {"tenants": TENANTS, "requests": requests, "unique_share": UNIQUE_SHARE, "zipf": ZIPF,
              "system_tokens": [len(s) for s in systems], "user_tokens": list(USER_TOKENS),
              "unique_tokens": scaled(UNIQUE_TOKENS, scale), "max_tokens": max_tokens, "scale": scale}
    return Trace("chat", seed, ("main",), out, params)
