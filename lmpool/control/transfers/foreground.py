"""Foreground release: a rank short of blocks moves cold cached blocks to a partner instead of
evicting them.

A worker whose scheduler can admit a waiting sequence only by evicting ``n`` cached
blocks names the ``n`` blocks eviction would take (its victims: unreferenced, cold,
leaves first, never a live block) and their cached ancestors, and asks the control
plane (``ShortageReport``). ``plan_release`` picks the partner and the blocks:

- the partner is a topology partner of the rank, alive, to which no plan is bringing
  any of the blocks, and whose free blocks (less reservations and blocks other plans
  bring) hold what must be sent; among them, the one taking the most victims, then
  sending the fewest blocks, then with the most free blocks;
- the plan sends the victims the partner lacks, preceded by those of their ancestors
  it lacks (copied, so the victims have their chain there; the source keeps them);
- the admission gate weighs the victims' discounted expected reuse (the worker's hit
  counts) against the transfer cost of every block sent.

The plan is a move whose first ``keep`` blocks (the ancestors) are only copied: the
source frees at most the victims sent, and only those still unreferenced when the
plan finalizes. Victims the partner already holds are not sent: the pool keeps a
copy of them, and the worker evicts them itself. Every refusal has a reason, and the
worker falls back to eviction at once.

Invariants: a plan's hashes are parents before children and each appears once; it
sends at least one victim; ``keep`` counts exactly its leading non-victims.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.transfers.admission import AdmissionDecision, AdmissionGate
from lmpool.protocol import ShortageReport
from lmpool.protocol.base import BlockHash


@dataclass(frozen=True)
class ReleasePlan:
    src: int
    dst: int
    hashes: list[BlockHash]
    generations: list[int]
    parents: list[BlockHash]
    keep: int  # leading blocks copied as ancestors, not moved
    decision: AdmissionDecision


def plan_release(
    report: ShortageReport,
    gbm: GlobalBlockManager,
    partners: tuple[int, ...],
    free_blocks: Callable[[int], int],
    gate: AdmissionGate,
    prefill_s_per_token: Callable[[int], float | None],
) -> tuple[ReleasePlan | None, str]:
    """The move that relieves ``report``'s shortage, or None and why not."""
    n = len(report.hashes)
    if not (len(report.parents) == len(report.generations) == n and 0 < report.num_victims <= n):
        raise ValueError(f"malformed shortage report from rank {report.rank}")
    src = report.rank
    first_victim = n - report.num_victims
    parent_of = dict(zip(report.hashes, report.parents))
    options = []
    reason = "no live partner"
    for dst in partners:
        if not gbm.alive_mask >> dst & 1 or dst == src:
            continue
        in_flight = gbm.ranks[dst].in_flight
        if any(h in in_flight for h in report.hashes):
            reason = f"a plan is already bringing some of these blocks to rank {dst}"
            continue
        victims = [h for h in report.hashes[first_victim:] if not gbm.ready_ranks(h) >> dst & 1]
        if not victims:
            reason = f"rank {dst} already holds every victim"
            continue
        needed = set(victims)
        for h in victims:  # the ancestors the partner lacks, up to one it holds
            parent = parent_of.get(h)
            while parent in parent_of and parent not in needed and not gbm.ready_ranks(parent) >> dst & 1:
                needed.add(parent)
                parent = parent_of.get(parent)
        ancestors = [h for h in report.hashes[:first_victim] if h in needed]
        sent = len(ancestors) + len(victims)
        free = free_blocks(dst)
        if free < sent:
            reason = f"rank {dst} has {free} free blocks for {sent}"
            continue
        options.append((-len(victims), sent, -free, dst, ancestors, victims))
    if not options:
        return None, reason
    _, sent, _, dst, ancestors, victims = min(options)
    decision = gate.foreground(src, dst, sent, report.expected_reuses, saved_blocks=len(victims),
                               prefill_s_per_token=prefill_s_per_token(dst))
    if not decision.admitted:
        return None, str(decision)
    index = {h: i for i, h in enumerate(report.hashes)}
    hashes = ancestors + victims
    return ReleasePlan(
        src, dst, hashes,
        [report.generations[index[h]] for h in hashes],
        [report.parents[index[h]] for h in hashes],
        len(ancestors), decision,
    ), ""
