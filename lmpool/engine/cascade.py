"""Which rows of a decode step share a cached prefix, and whether reading it once for them pays.

Prefix caching hands sequences that start alike the same physical blocks, so rows sharing a
prefix hold the same block ids at the head of their block tables. A decode step's rows are
grouped by their first block; a group's prefix is the longest run of leading blocks all its
rows hold, counting only each row's whole blocks before the one its new token goes to (that
one is its own). Reading a group's prefix once for all of its rows (cascade attention,
``ops.cascade_decode_attention``) instead of once per row saves ``(rows - 1) * prefix`` key
reads; a step is planned as a cascade when its groups save at least ``min_saved`` of them.

Invariants of a plan: its groups partition the step's rows (``rows`` lists each once, group by
group, ``starts`` bounding the groups); each row's first ``kv_start`` keys are its group's
prefix (the blocks of its ``tables`` entry, ``lens`` tokens), and fewer than its context; a
group of one row shares nothing (its prefix is empty).

A plan travels to the device as int32 arrays in one span (``write_cascade``), laid out for K
rows, G groups and prefix tables V blocks wide: a decode graph's span is laid out for its padded
batch (K = G = the batch, V = the graphs' table width), its padding rows groups of one and its
groups past the plan's empty, so any plan of that many rows or fewer fills it.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import torch

from lmpool.model.qwen3 import CascadeInputs


class CascadePlan(NamedTuple):
    kv_start: list[int]  # per row: its group's prefix tokens, where its own keys start
    rows: list[int]  # every row once, group by group
    starts: list[int]  # group g is rows[starts[g]:starts[g + 1]]
    lens: list[int]  # per group: its prefix tokens (whole blocks)
    tables: list[list[int]]  # per group: its prefix blocks
    saved: int  # key reads saved against every row reading its whole context


def plan_cascade(tables: list[list[int]], context_lens: list[int], block_size: int,
                 min_saved: int) -> CascadePlan | None:
    """The cascade of decode rows with these block tables and context lengths (each counting the
    new token), or None when it would save fewer than ``min_saved`` key reads (or ``min_saved``
    is 0: cascades are off)."""
    if min_saved <= 0 or len(tables) < 2:
        return None
    by_first: dict[int, list[int]] = {}
    for row, (table, ctx) in enumerate(zip(tables, context_lens)):
        if ctx > block_size and table:  # at least one whole block before its new token's
            by_first.setdefault(table[0], []).append(row)
    groups: list[tuple[list[int], list[int]]] = []  # (rows, prefix blocks)
    saved = 0
    for members in by_first.values():
        if len(members) < 2:
            continue
        # The common head of their whole blocks (``commonprefix`` compares lists at C speed).
        heads = [tables[r][: (context_lens[r] - 1) // block_size] for r in members]
        prefix = os.path.commonprefix(heads)
        if prefix:
            groups.append((members, list(prefix)))
            saved += (len(members) - 1) * len(prefix) * block_size
    if saved < min_saved:
        return None
    kv_start = [0] * len(tables)
    rows: list[int] = []
    starts = [0]
    lens: list[int] = []
    prefixes: list[list[int]] = []
    grouped = set()
    for members, prefix in groups:
        tokens = len(prefix) * block_size
        for r in members:
            kv_start[r] = tokens
        rows += members
        grouped.update(members)
        starts.append(len(rows))
        lens.append(tokens)
        prefixes.append(prefix)
    for r in range(len(tables)):  # a group of one each: it shares nothing
        if r not in grouped:
            rows.append(r)
            starts.append(len(rows))
            lens.append(0)
            prefixes.append([])
    return CascadePlan(kv_start, rows, starts, lens, prefixes, saved)


def cascade_offsets(rows: int, groups: int, width: int) -> list[int]:
    """Where a span of K = ``rows``, G = ``groups``, V = ``width`` holds, in order, kv_start[K],
    prefix_rows[K], prefix_starts[G + 1], prefix_lens[G] and prefix_tables[G * V]; and its end."""
    return np.cumsum([0, rows, rows, groups + 1, groups, groups * width]).tolist()


def write_cascade(a: np.ndarray, plan: CascadePlan, rows: int, groups: int, width: int) -> None:
    """``plan`` into ``a``, a span laid out for ``rows`` rows, ``groups`` groups and ``width``
    blocks (``cascade_offsets``): rows past the plan's are groups of one, and groups past those
    are empty; prefix tables are padded with block 0 (never read)."""
    real, planned = len(plan.kv_start), len(plan.lens)
    padding = rows - real
    if padding < 0 or planned + padding > groups or any(len(t) > width for t in plan.tables):
        raise ValueError(f"a plan of {real} rows and {planned} groups does not fit a span of {rows} rows, "
                         f"{groups} groups and {width} blocks")
    o = cascade_offsets(rows, groups, width)
    a[o[0]:o[0] + real] = plan.kv_start
    a[o[0] + real:o[1]] = 0
    a[o[1]:o[1] + real] = plan.rows
    a[o[1] + real:o[2]] = np.arange(real, rows)
    a[o[2]:o[2] + planned + 1] = plan.starts
    a[o[2] + planned + 1:o[2] + planned + 1 + padding] = np.arange(real + 1, rows + 1)
    a[o[2] + planned + 1 + padding:o[3]] = rows
    a[o[3]:o[3] + planned] = plan.lens
    a[o[3] + planned:o[4]] = 0
    tables = a[o[4]:o[5]].reshape(groups, width)
    tables[:] = 0
    for g, blocks in enumerate(plan.tables):
        tables[g, : len(blocks)] = blocks


def cascade_views(span: torch.Tensor, rows: int, groups: int, width: int) -> CascadeInputs:
    """The attention's view of a span laid out for ``rows``, ``groups`` and ``width``."""
    o = cascade_offsets(rows, groups, width)
    return CascadeInputs(span[o[0]:o[1]], span[o[4]:o[5]].view(groups, width), span[o[3]:o[4]],
                         span[o[2]:o[3]], span[o[1]:o[2]])
