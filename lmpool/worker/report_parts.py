"""A cache report too large for the worker's link, as parts that each fit.

A snapshot lists every cached block with its token ids (about 1.1 kB a block at 256 tokens),
so a large cache's can exceed the most one message carries. It then goes as a smaller
snapshot of its first blocks and deltas storing the rest, and a large delta as consecutive
deltas. Versions stay exact: every event is one version, so the first part's snapshot is at
``version - len(rest)``, and each delta runs on from where the last part ended.

Invariants: applying the parts in order yields the state the whole report gives (the same
blocks at the same final version), parents before children; every part but the first of a
snapshot is a delta of stored blocks; ``parts`` >= 1 parts, none empty where events remain.
"""

from __future__ import annotations

from lmpool.protocol.kv_events import KVDelta, KVSnapshot


def split_snapshot(snapshot: KVSnapshot, parts: int) -> tuple[KVSnapshot, list[KVDelta]]:
    """``snapshot`` as a snapshot of its first blocks and up to ``parts - 1`` deltas of the rest."""
    blocks = snapshot.blocks
    size = _part_size(len(blocks), parts)
    if size >= len(blocks) or snapshot.version < len(blocks) - size:
        return snapshot, []  # one part (or too few versions to number the rest: unsplittable)
    start = snapshot.version - (len(blocks) - size)
    first = KVSnapshot(start, blocks[:size])
    return first, split_delta(KVDelta(start, snapshot.version, list(blocks[size:])), parts - 1)


def split_delta(delta: KVDelta, parts: int) -> list[KVDelta]:
    """``delta`` as up to ``parts`` consecutive deltas, in order."""
    events, size = delta.events, _part_size(len(delta.events), parts)
    if size >= len(events) or delta.to_version - delta.from_version != len(events):
        return [delta]
    out, version = [], delta.from_version
    for i in range(0, len(events), size):
        chunk = events[i:i + size]
        out.append(KVDelta(version, version + len(chunk), chunk))
        version += len(chunk)
    return out


def _part_size(n: int, parts: int) -> int:
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    return max(1, -(-n // parts))
