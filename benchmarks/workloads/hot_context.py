"""Hot shared contexts read once, then a burst of questions about them (family ``hot_context``).

A trace has ``n`` long contexts (documents, code bases, transcripts) of ``length`` tokens.
Phase ``read``: each context is read once, pinned to its owner rank ``c mod world_size``
(as the memory-skew warm-up pins its sessions), so the contexts start on few replicas.
Phase ``burst``: ``questions`` requests, each one context plus a question of its own, spread
evenly over the contexts in a seeded shuffled order and routed by the policy under test.
With the runner's default window 0 the burst arrives all at once, more requests than one
replica's batch (``--max-num-seqs``, 64): serving it from the owners alone queues it.

The **oracle** variant (``..._oracle``) reads every context on every rank before the same
burst (one pinned read per context and rank): what a pool that could place each context
everywhere for free would start the burst with. Oracle and real traces of one seed share
every context and every burst prompt token for token; only the read phase differs.

Lengths at scale 1 (256-token blocks): contexts of 4,096 / 16,384 / 32,768 tokens (16 / 64
/ 128 blocks), questions of 64 tokens, reads of 32 more; ``scale`` multiplies them all.
Invariants (beside ``workloads``' own): burst requests share exactly one context each; a
read phase holds one request per context (real) or per context and rank (oracle).
"""

from __future__ import annotations

from benchmarks.workloads.traces import DEFAULT_MAX_TOKENS, Tokens, Trace, TraceRequest, check_max_tokens, scaled

CONTEXT_LENGTHS = (4096, 16384, 32768)
HOT_COUNTS = (1, 2)  # fewer hot contexts than replicas: the owners alone cannot carry the burst
QUESTIONS = 128
QUESTION_TOKENS = 64
READ_TOKENS = 32


def workload_name(length: int, n_contexts: int, oracle: bool = False) -> str:
    """``hot_context_16k_2c`` (nominal lengths, as ``locality_5x`` names its level), ``..._oracle``."""
    return f"hot_context_{length / 1024:g}k_{n_contexts}c" + ("_oracle" if oracle else "")


def owners(n_contexts: int, world_size: int) -> list[int]:
    return [c % world_size for c in range(n_contexts)]


def hot_context(length: int, n_contexts: int, seed: int, vocab_size: int, world_size: int, scale: float = 1.0,
                max_tokens: int = DEFAULT_MAX_TOKENS, questions: int = QUESTIONS, oracle: bool = False) -> Trace:
    """The ``read`` then ``burst`` trace of ``n_contexts`` contexts of ``length`` tokens."""
    check_max_tokens(max_tokens)
    if length < 1 or n_contexts < 1 or questions < n_contexts or world_size < 1:
        raise ValueError(f"need length >= 1, 1 <= contexts <= questions and world_size >= 1, got "
                         f"{length}, {n_contexts}, {questions}, {world_size}")
    # Seeded by the real trace's name, so the oracle draws the same contexts and burst.
    tokens = Tokens(workload_name(length, n_contexts), seed, vocab_size)
    context_len, question_len = scaled(length, scale), scaled(QUESTION_TOKENS, scale)
    read_len = scaled(READ_TOKENS, scale)
    contexts = [tokens.draw(context_len) for _ in range(n_contexts)]
    asked = [q % n_contexts for q in range(questions)]
    tokens.shuffle(asked)
    burst = [contexts[c] + tokens.draw(question_len) for c in asked]
    home = owners(n_contexts, world_size)
    reads = [(c, r) for c in range(n_contexts) for r in (range(world_size) if oracle else [home[c]])]
    requests = [TraceRequest(i, "read", f"ctx{c}", contexts[c] + tokens.draw(read_len), max_tokens, r)
                for i, (c, r) in enumerate(reads)]
    requests += [TraceRequest(len(reads) + i, "burst", f"ctx{c}", prompt, max_tokens)
                 for i, (c, prompt) in enumerate(zip(asked, burst))]
    params = {"contexts": n_contexts, "context_tokens": context_len, "nominal_context_tokens": length,
              "questions": questions, "question_tokens": question_len, "read_tokens": read_len,
              "owners": home, "oracle": oracle, "max_tokens": max_tokens, "scale": scale}
    return Trace(workload_name(length, n_contexts, oracle), seed, ("read", "burst"), tuple(requests), params)


def oracle_of(workload: str) -> str:
    return workload + "_oracle"
