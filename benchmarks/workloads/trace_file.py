"""A trace of one's own, from a JSON Lines file, replayed by either runner (``--trace FILE``).

One request per line, in replay order; blank lines and lines starting with ``#`` are skipped::

    {"prompt": "You are a helpful assistant. ...", "max_tokens": 64}
    {"prompt": [151644, 872, 198, 9707], "phase": "revisit", "group": "faq", "rank": 1}

- ``prompt`` (required): text, encoded with the model's tokenizer, or token ids below the
  model's vocabulary size;
- ``max_tokens``: output tokens (default: the runner's ``--max-tokens``); every request is
  greedy with ``ignore_eos``, so it produces exactly this many;
- ``phase``: phases run in the order they first appear, each after the previous one has
  finished (default ``"main"``);
- ``group``: a label kept in the records (default ``""``);
- ``rank``: pin the request to a replica (default: the policy under test routes it).

Invariants: every request of a returned ``Trace`` has a non-empty prompt of valid ids, a
positive ``max_tokens`` and a rank below ``world_size`` or None; a file that breaks any of
this is refused with a ``ValueError`` naming its line. The trace is the same for every
repetition (the file fixes its ids and order; the seed is only recorded).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from benchmarks.workloads.traces import Trace, TraceRequest

KEYS = {"prompt", "max_tokens", "phase", "group", "rank"}


def trace_name(path: Path) -> str:
    """The workload name a trace file runs under: ``trace_<file stem>``."""
    return f"trace_{Path(path).stem}"


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def _request(line: dict, index: int, vocab_size: int, encode: Callable[[str], list[int]] | None,
             max_tokens: int, world_size: int) -> TraceRequest:
    unknown = set(line) - KEYS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}; a request takes {sorted(KEYS)}")
    prompt = line.get("prompt")
    if isinstance(prompt, str):
        if encode is None:
            raise ValueError("a text prompt needs the model's tokenizer, which this model lacks: give token ids")
        prompt = encode(prompt)
    elif isinstance(prompt, list):
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}), got {bad[0]!r}")
    else:
        raise ValueError(f"'prompt' must be text or a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("the prompt is empty")
    rank = line.get("rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size):
        raise ValueError(f"rank must be an integer in [0, {world_size}) or null, got {rank!r}")
    phase, group = line.get("phase", "main"), line.get("group", "")
    if not isinstance(phase, str) or not phase or not isinstance(group, str):
        raise ValueError("'phase' must be a non-empty string and 'group' a string")
    tokens = _positive_int(line.get("max_tokens", max_tokens), "max_tokens")
    return TraceRequest(index, phase, group, list(prompt), tokens, rank)


def load_trace(path: Path, seed: int, vocab_size: int, encode: Callable[[str], list[int]] | None,
               max_tokens: int, world_size: int) -> Trace:
    """The requests of JSON Lines file ``path`` as a ``Trace`` named ``trace_name(path)``."""
    path = Path(path)
    requests: list[TraceRequest] = []
    phases: list[str] = []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: JSON strings may hold U+2028
    except UnicodeDecodeError as e:
        raise ValueError(f"{path.name}: not UTF-8 text ({e})") from None
    for number, raw in enumerate(lines, 1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        try:
            line = json.loads(raw)
            if not isinstance(line, dict):
                raise ValueError(f"a request is a JSON object, got {type(line).__name__}")
            request = _request(line, len(requests), vocab_size, encode, max_tokens, world_size)
        except ValueError as e:  # json.JSONDecodeError is one
            raise ValueError(f"{path.name}:{number}: {e}") from None
        requests.append(request)
        if request.phase not in phases:
            phases.append(request.phase)
    if not requests:
        raise ValueError(f"{path.name}: no requests")
    # Phases are barriers run in order of first appearance: requests regroup under them.
    ordered = [r for phase in phases for r in requests if r.phase == phase]
    ordered = [TraceRequest(i, r.phase, r.group, r.prompt, r.max_tokens, r.rank) for i, r in enumerate(ordered)]
    params = {"file": path.name, "requests": len(ordered), "phases": list(phases),
              "prompt_tokens": sum(len(r.prompt) for r in ordered), "pinned": sum(r.rank is not None for r in ordered)}
    return Trace(trace_name(path), seed, tuple(phases), tuple(ordered), params)
