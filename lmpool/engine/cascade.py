"""Which decode rows of a step share a cached prefix, and whether reading it once for them pays
(every row of a decode step; a mixed step's single-token rows, which its batch lists first).

Prefix caching hands sequences that start alike the same physical blocks, so rows sharing a
prefix hold the same block ids at the head of their block tables. A group's prefix is the
longest run of leading blocks all its rows hold, counting only each row's whole blocks before
the one its new token goes to (that one is its own). Rows are grouped on the tree their tables
make: rows sharing a first block form one group, unless the rows branching off at its prefix's
end save more as groups of their own (documents behind one system prompt: each document's rows
read it once, not each their own copy of it behind a one-block group). Reading a group's prefix
once for all of its rows (cascade attention, ``ops.cascade_decode_attention``) instead of once
per row saves ``(rows - 1) * prefix`` key reads; a step is planned as a cascade when its groups
save at least ``min_saved`` of them.
A group's prefix pass still attends each of its rows to every prefix key, as a prefill chunk
attends its queries (tensor-core tiles of rows against key blocks): the step-time model counts
its ``rows * prefix`` pairs, with a coefficient of their own (``StepSample.cascade_pairs``): few
query rows over many keys, split over the keys to fill the GPU, cost a pair more than a
prefill's full tiles. Pairs rather than the prefix's keys: a pass reads the prefix once per tile
(64 query rows: a group's rows times the q heads per kv head), so its cost follows its pairs once
groups fill tiles; and a request's row adds its prefix's pairs whatever else shares it, a sum
the pricing can reserve request by request, where a group's keys are not.

Invariants of a plan: its groups are disjoint sets of at least two rows (``rows`` lists the
grouped rows, group by group, ``starts`` bounding the groups); a row is in a group exactly when
its ``kv_start`` is above 0, and then its first ``kv_start`` keys are its group's prefix (the
blocks of its ``tables`` entry, ``lens`` tokens), fewer than its context.

A plan travels to the device as int32 arrays in one span (``write_cascade``), laid out for K
rows, J grouped rows, G groups and prefix tables V blocks wide. A decode graph's span is laid
out for its padded batch (K = J = the batch, G = ``GRAPH_GROUPS`` or fewer, V = the graphs'
table width): a plan of at most that many rows and groups fills it, its padding rows in no
group and the groups past its own empty.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import torch

from lmpool.model.qwen3 import CascadeInputs

# Groups a cascade graph holds: a step of more runs eagerly. Each group's prefix pass takes
# enough key splits to fill the GPU alone, so every group a graph holds adds that many CTAs
# to every replay, most of them empty when the step has fewer groups.
GRAPH_GROUPS = 4


class CascadePlan(NamedTuple):
    kv_start: list[int]  # per row: its group's prefix tokens, where its own keys start (0: in no group)
    rows: list[int]  # the grouped rows, group by group
    starts: list[int]  # group g is rows[starts[g]:starts[g + 1]]
    lens: list[int]  # per group: its prefix tokens (whole blocks)
    tables: list[list[int]]  # per group: its prefix blocks
    saved: int  # key reads saved against every row reading its whole context
    pairs: int  # (query, key) pairs its prefix passes attend: each group's rows times its prefix


def plan_cascade(tables: list[list[int]], context_lens: list[int], block_size: int,
                 min_saved: int) -> CascadePlan | None:
    """The cascade of decode rows with these block tables and context lengths (each counting the
    new token), or None when it would save fewer than ``min_saved`` key reads (or ``min_saved``
    is 0: cascades are off)."""
    if min_saved <= 0 or len(tables) < 2:
        return None
    # Each row's whole blocks before its new token's: what it can share.
    whole = [table[: (ctx - 1) // block_size] for table, ctx in zip(tables, context_lens)]
    groups = [g for members in _branches(whole, range(len(tables)), 0).values() if len(members) > 1
              for g in _groups(whole, members)]
    kv_start = [0] * len(tables)
    rows: list[int] = []
    starts = [0]
    lens: list[int] = []
    prefixes: list[list[int]] = []
    saved = pairs = 0
    for members, depth in groups:
        tokens = depth * block_size
        for r in members:
            kv_start[r] = tokens
        rows += members
        starts.append(len(rows))
        lens.append(tokens)
        prefixes.append(whole[members[0]][:depth])
        saved += (len(members) - 1) * tokens
        pairs += len(members) * tokens
    if saved < min_saved:
        return None
    return CascadePlan(kv_start, rows, starts, lens, prefixes, saved, pairs)


def _branches(whole: list[list[int]], members, depth: int) -> dict[int, list[int]]:
    """``members`` by their block at ``depth``; those with no whole block there are left out."""
    out: dict[int, list[int]] = {}
    for r in members:
        if len(whole[r]) > depth:
            out.setdefault(whole[r][depth], []).append(r)
    return out


# Levels of branches a plan follows below a first block: rows whose tables nest (each one block
# longer than the last) would otherwise recurse once per row.
SPLIT_LEVELS = 16

Groups = list[tuple[list[int], int]]  # (rows, prefix blocks) per group


def _groups(whole: list[list[int]], members: list[int], levels: int = SPLIT_LEVELS) -> Groups:
    """Groups (rows, prefix blocks) that read many keys once for ``members``, two or more rows
    sharing a first block, who share a prefix of ``depth`` blocks: the better of (a) each branch
    off its end that saves more on its own than its rows would in the group (``depth`` each)
    leaving to group as its rows do, the rest one group of their own common prefix, and (b)
    every branch on its own, the rows ending at ``depth`` one group. Not always the best
    partition, but invariant: it saves at least what one group of all of ``members`` would."""
    # Their common head (``commonprefix`` compares lists at C speed).
    depth = len(os.path.commonprefix([whole[r] for r in members]))
    ends = [r for r in members if len(whole[r]) == depth]
    branches = list(_branches(whole, members, depth).values())
    if levels <= 0 or not branches:
        return [(sorted(members), depth)]
    planned = [(b, _groups(whole, b, levels - 1) if len(b) > 1 else []) for b in branches]
    out: Groups = []
    stay = list(ends)
    for branch, split in planned:
        if _saved(split) > len(branch) * depth:
            out += split
        else:
            stay += branch
    alone = [g for _, split in planned for g in split]
    return max(_with(whole, out, stay), _with(whole, alone, ends), key=_saved)


def _with(whole: list[list[int]], groups: Groups, rest: list[int]) -> Groups:
    """``groups`` and, where two or more, ``rest`` as one group of their common prefix."""
    if len(rest) < 2:
        return groups
    return groups + [(sorted(rest), len(os.path.commonprefix([whole[r] for r in rest])))]


def _saved(groups: Groups) -> int:
    """Blocks a cascade of ``groups`` reads once instead of once a row."""
    return sum((len(rows) - 1) * depth for rows, depth in groups)


def cascade_offsets(rows: int, grouped: int, groups: int, width: int) -> list[int]:
    """Where a span of K = ``rows``, J = ``grouped``, G = ``groups`` and V = ``width`` holds, in
    order, kv_start[K], prefix_rows[J], prefix_starts[G + 1], prefix_lens[G] and
    prefix_tables[G * V]; and its end."""
    return np.cumsum([0, rows, grouped, groups + 1, groups, groups * width]).tolist()


def write_cascade(a: np.ndarray, plan: CascadePlan, rows: int, grouped: int, groups: int, width: int) -> None:
    """``plan`` into ``a``, a span laid out by ``cascade_offsets``: rows past the plan's are in no
    group, groups past its own are empty (they start and end at its last grouped row), and
    entries past its grouped rows and prefix blocks are 0 (never read)."""
    real, planned, members = len(plan.kv_start), len(plan.lens), len(plan.rows)
    if real > rows or members > grouped or planned > groups or any(len(t) > width for t in plan.tables):
        raise ValueError(f"a plan of {real} rows, {members} grouped in {planned} groups does not fit a span "
                         f"of {rows} rows, {grouped} grouped, {groups} groups and {width} blocks")
    o = cascade_offsets(rows, grouped, groups, width)
    a[o[0]:o[1]] = 0
    a[o[0]:o[0] + real] = plan.kv_start
    a[o[1]:o[2]] = 0
    a[o[1]:o[1] + members] = plan.rows
    a[o[2]:o[3]] = members
    a[o[2]:o[2] + planned + 1] = plan.starts
    a[o[3]:o[4]] = 0
    a[o[3]:o[3] + planned] = plan.lens
    tables = a[o[4]:o[5]].reshape(groups, width)
    tables[:] = 0
    for g, blocks in enumerate(plan.tables):
        tables[g, : len(blocks)] = blocks


def cascade_views(span: torch.Tensor, rows: int, grouped: int, groups: int, width: int) -> CascadeInputs:
    """The attention's view of a span laid out by ``cascade_offsets``."""
    o = cascade_offsets(rows, grouped, groups, width)
    return CascadeInputs(span[o[0]:o[1]], span[o[4]:o[5]].view(groups, width), span[o[3]:o[4]],
                         span[o[2]:o[3]], span[o[1]:o[2]])
