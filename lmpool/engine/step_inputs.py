"""One step's model inputs, built with numpy in a reused host buffer and moved in one copy.

Every index the model needs is int32 and lives in one flat arena, laid out as

    ids[P] | positions[P] | slots[P] | context_lens[C] | query_start_loc[B + 1]
           | sample_rows[R] | block_tables[B * W] | fill_rows[F] | fill_sources[F]
           | kv_start[K] | prefix_rows[J] | prefix_starts[G + 1] | prefix_lens[G] | prefix_tables[G * V]
           | mixed_query_start[M] | key_starts[B + 1] | mixed_key_starts[M] | key_slots[S]

for B sequences and T token rows, W the longest block table of the batch, and R
the sampled rows (R = 0 when the sampled rows are exactly every row: a decode
step where every sequence samples). Without a graph P = T and C = B. A
decode step that replays a CUDA graph of batch G >= B is padded on the host to
P = C = G, so that ids .. context lengths form one ``[4, G]`` block the graph
copies in one go; padding rows have token 0, position 0, slot -1 (nothing
written) and context length 1 (one valid slot read), and are never sampled.
Another step of at most the piecewise graphs' rows (``lmpool.engine.piecewise_graphs``)
is padded to P = their size for it, C = B: ids .. slots form one ``[3, P]`` block,
its padding rows as a decode graph's.
Table rows shorter than W are padded with block 0 (never read). Slots are int32:
the runner refuses a cache of 2**31 slots or more.

F counts the sequences whose input token is pending (``Sequence.num_pending``: the
previous step sampled it and the host has not read it back). Their id is written
as 0 on the host; ``fill_rows`` (their token rows) and ``fill_sources`` (their
rows in the previous step's sampled tokens) let the runner copy the real ids in
on the device, so a step never waits for the previous one's tokens.

A decode step whose rows share cached prefixes enough (``lmpool.engine.cascade``) is a
cascade, its attention reading each group's prefix once: K = B, its J grouped rows in G groups,
their prefixes V blocks wide at most; or, replaying the cascade graph of its padded batch, K =
J = that batch, G = ``cascade.GRAPH_GROUPS`` and V the graphs' table width (a step of more groups
runs eagerly). Otherwise none of it. A mixed step (prompt chunks beside decodes) lists its K
single-token rows first (``ScheduledBatch.decode_first``); when they share prefixes enough they
are a cascade too, and ``mixed_query_start[M]`` (M = B - K + 1) then gives the query starts of
the rest, which attend as a prefill. It runs eagerly, as every mixed step. A step that prefills
carries where each context starts among them all (``key_starts``, the contexts' cumulative
lengths; ``mixed_key_starts`` the rest's) and, in its metadata, its longest query and context.
Where the attention reads a prefill's keys gathered out of the cache (``gather_keys``: the fewest
queries per key and the most keys), a prefill step without a mixed cascade whose queries times
contexts (its (query, key) pairs, causal ones counted whole) are at least that many times its
keys, and whose keys are not too many, lists every context's
slots, context after context (``key_slots``, S = the contexts' total): there the copy, once a
key, is small beside the attention over it. Otherwise S = 0.

Invariants:
- On CUDA the host arena is pinned and reaches the device with a single
  ``non_blocking`` copy per step. Two host arenas take turns: before rewriting
  one the builder waits on the event recorded after its copy, two builds ago, so
  a copy never reads a half-written buffer. That wait never blocks when each
  step's tokens are read back before the step after next is built (both ways of
  stepping do so: the read-back follows the copy on the stream); only after a
  step that sampled nothing (so read nothing back) may it wait for that copy.
- The device tensors of a step stay valid until the next ``build``: its copy
  overwrites them, after the previous step's kernels have read them (stream order).
  Views of the device arena are cached per layout and dropped when it grows.
- On CPU the host arena is the device arena: no copy at all.
- A sequence samples when the tokens it has computed plus this step's reach its
  length (``ScheduledBatch.samples``); its sample row is its last token row. Rows
  and batch indices of the sampling sequences keep batch order.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import getitem
from typing import Protocol

import numpy as np
import torch

from lmpool.engine.cascade import GRAPH_GROUPS, cascade_offsets, cascade_views, plan_cascade, write_cascade
from lmpool.engine.scheduler import ScheduledBatch
from lmpool.model.qwen3 import AttentionMetadata, CascadeInputs


class GraphSizes(Protocol):
    """What the builder needs to know of the decode graphs (``DecodeGraphs``)."""

    max_width: int  # block-table columns the graphs' static table holds
    cascades: bool  # whether cascade steps have graphs too

    def padded_size(self, num_seqs: int) -> int | None: ...


class PieceSizes(Protocol):
    """What the builder needs to know of the piecewise graphs (``PiecewiseGraphs``)."""

    def padded_size(self, num_rows: int) -> int | None: ...


@dataclass
class StepInputs:
    ids: torch.Tensor  # [T] int32 token ids
    positions: torch.Tensor  # [T] int32
    meta: AttentionMetadata
    num_seqs: int
    sample_rows: torch.Tensor | None  # [R] hidden rows to sample, in batch order; None: every row
    sample_index: list[int] | None  # batch indices of the sampling sequences; None: all of them
    graph_size: int | None = None  # padded batch G when a decode graph replays this step
    graph_header: torch.Tensor | None = None  # [4, G]: ids, positions, slots, context lengths
    fill: torch.Tensor | None = None  # [2, F]: token rows to fill, rows of the previous step's tokens
    graph_cascade: torch.Tensor | None = None  # a cascade graph step's span, laid out for its padded batch
    piece_size: int | None = None  # padded rows P when piecewise graphs run this step
    piece_header: torch.Tensor | None = None  # [3, P]: ids, positions, slots


def arena_capacity(max_tokens: int, max_seqs: int, max_width: int) -> int:
    """Int32 entries of the largest step: P = C = max(tokens, seqs), R, F, K, J <= B, G <= B / 2 (or
    the graphs' ``GRAPH_GROUPS``), V <= W, the two mixed spans M <= B + 1 and the key starts B + 1."""
    rows = max(max_tokens, max_seqs)
    cascade = cascade_offsets(max_seqs, max_seqs, max(max_seqs // 2, GRAPH_GROUPS), max_width)[-1]
    return 4 * rows + 4 * max_seqs + 1 + max_seqs * max_width + cascade + 3 * (max_seqs + 1)


# A step's views into the device arena: ids, positions, slots, block tables, context lengths, query
# starts, sampled rows, graph header, pending-token fill, cascade, a cascade graph's span, a mixed
# cascade's query starts of the rest, the key starts, the rest's, the key slots and the piecewise
# graphs' header (the last ten where the step has them).
_Views = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
               torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, CascadeInputs | None,
               torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
               torch.Tensor | None, torch.Tensor | None]


class StepInputBuilder:
    def __init__(self, device: torch.device, block_size: int, capacity: int, cascade_min_saved: int = 0,
                 gather_keys: tuple[int, int] | None = None) -> None:
        """``cascade_min_saved``: the key reads a decode step's shared prefixes must save for it to
        run as a cascade (``EngineConfig.cascade_min_saved_tokens``; 0: never); ``gather_keys``:
        the mean queries per key at which a prefill step lists its key slots, and the most keys
        it lists (module docstring; None: never)."""
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.device = device
        self.block_size = block_size
        self.block_shift = block_size.bit_length() - 1
        self.cascade_min_saved = cascade_min_saved
        self.gather_keys = gather_keys
        self.on_cuda = device.type == "cuda"
        self._copied = [torch.cuda.Event(), torch.cuda.Event()] if self.on_cuda else None
        self._turn = 0  # the host arena of the latest build
        self._arange = np.arange(capacity + 1, dtype=np.int64)
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        # Normal tensors even when called under inference mode, so that callers
        # outside it (tests calling ``prepare``) may still write them.
        with torch.inference_mode(False):
            self.hosts = [torch.zeros(capacity, dtype=torch.int32, pin_memory=self.on_cuda)
                          for _ in range(2 if self.on_cuda else 1)]
            self.dev = torch.zeros(capacity, dtype=torch.int32, device=self.device) if self.on_cuda else self.hosts[0]
        self.host_nps = [h.numpy() for h in self.hosts]
        # Device views per layout: a decode step usually has the previous step's layout.
        self._views: dict[tuple[int, ...], _Views] = {}

    @property
    def host(self) -> torch.Tensor:
        """The host arena of the latest build."""
        return self.hosts[self._turn]

    @property
    def capacity(self) -> int:
        return self.dev.numel()

    def _iota(self, n: int) -> np.ndarray:
        """``0 .. n-1`` as a view of a kept array (numpy calls cost more than their work here)."""
        if n > len(self._arange):
            self._arange = np.arange(2 * n, dtype=np.int64)
        return self._arange[:n]

    def _key_slots(self, table: np.ndarray, ends: np.ndarray, key_starts: np.ndarray) -> np.ndarray:
        """Every context's slots, context after context: position p of sequence b (its ``ends[b]``
        tokens, ``key_starts`` their cumulative count) is in block ``table[b, p / block_size]``."""
        owner = np.repeat(self._iota(len(ends)), ends)
        positions = self._iota(len(owner)) - key_starts[:-1][owner]
        blocks = table[owner, positions >> self.block_shift].astype(np.int64)
        return (blocks << self.block_shift) | (positions & (self.block_size - 1))

    def build(self, batch: ScheduledBatch, graphs: GraphSizes | None = None,
              pieces: PieceSizes | None = None) -> StepInputs:
        seqs, counts = batch.seqs, batch.num_tokens
        num_seqs = len(seqs)
        if num_seqs == 0:
            raise ValueError("cannot build model inputs for an empty batch")
        if self._copied is not None:
            self._turn ^= 1
            self._copied[self._turn].synchronize()  # this arena's copy, two builds ago, has read it
        tokens = [s.token_ids for s in seqs]
        starts_list = [s.num_computed_tokens for s in seqs]
        pending = [i for i, s in enumerate(seqs) if s.num_pending]
        tables = [s.block_table for s in seqs]
        table_lens = list(map(len, tables))
        width = max(table_lens)
        num_rows = sum(counts)
        decode = num_rows == num_seqs  # every sequence has exactly one new token
        starts = np.array(starts_list, dtype=np.int64)
        if decode:
            ends = starts + 1
            query_start = self._iota(num_seqs + 1)
        else:
            count_arr = np.array(counts, dtype=np.int64)
            ends = starts + count_arr
            query_start = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(count_arr, out=query_start[1:])
        samples = ends == np.array(list(map(len, seqs)), dtype=np.int64)  # pending tokens count
        num_sampled = int(np.count_nonzero(samples))
        all_sample = num_sampled == num_seqs
        # Sample rows are needed unless they are exactly every row (a decode step where all sample).
        rows_needed = not (decode and all_sample)
        num_rows_sampled = num_sampled if rows_needed else 0

        # The leading single-token rows (``ScheduledBatch.decode_first``): every row of a decode step.
        singles = num_seqs if decode else next(i for i, n in enumerate(counts) if n != 1)
        plan = None
        if singles >= 2 and self.cascade_min_saved:
            plan = plan_cascade(tables[:singles], ends[:singles].tolist(), self.block_size, self.cascade_min_saved)
        mixed = 0 if decode or plan is None else singles  # a mixed step's cascade rows
        graph_size = None
        graphed = plan is None or (graphs is not None and graphs.cascades and len(plan.lens) <= GRAPH_GROUPS)
        if decode and graphs is not None and width <= graphs.max_width and graphed:
            graph_size = graphs.padded_size(num_seqs)
        piece_size = None
        if graph_size is None and pieces is not None:
            piece_size = pieces.padded_size(num_rows)
        padded = graph_size or piece_size or num_rows
        ctx_rows = graph_size or num_seqs
        o_pos, o_slot, o_ctx = padded, 2 * padded, 3 * padded
        o_qsl = o_ctx + ctx_rows
        o_rows = o_qsl + num_seqs + 1
        o_tab = o_rows + num_rows_sampled
        o_fill = o_tab + num_seqs * width
        num_fill = len(pending)
        o_cascade = o_fill + 2 * num_fill
        layout = (0, 0, 0, 0)  # the cascade span's rows, grouped rows, groups and prefix width
        if plan and graph_size is not None and graphs is not None:
            layout = (graph_size, graph_size, GRAPH_GROUPS, graphs.max_width)
        elif plan:
            layout = (singles, len(plan.rows), len(plan.lens), max(map(len, plan.tables)))
        o_mixed = o_cascade + (cascade_offsets(*layout)[-1] if plan else 0)
        o_keys = o_mixed + (num_seqs - mixed + 1 if mixed else 0)
        o_mixed_keys = o_keys + (0 if decode else num_seqs + 1)
        o_key_slots = o_mixed_keys + (num_seqs - mixed + 1 if mixed else 0)
        gathered = 0
        if not decode and not mixed and self.gather_keys is not None:
            min_query, max_keys = self.gather_keys
            keys = int(ends.sum())
            if keys <= max_keys and int(np.dot(count_arr, ends)) >= min_query * keys:  # visible pairs, at most
                gathered = keys
        end = o_key_slots + gathered
        if end > self.capacity:  # a batch larger than the scheduler's limits (direct callers)
            self._allocate(max(end, 2 * self.capacity))
        a = self.host_nps[self._turn]

        table = a[o_tab:o_fill].reshape(num_seqs, width)
        num_entries = sum(table_lens)
        flat_tables = np.fromiter(chain.from_iterable(tables), dtype=np.int32, count=num_entries)
        if num_entries == num_seqs * width:
            a[o_tab:o_fill] = flat_tables
        else:  # pad short rows with 0; entries past a sequence's blocks are never read
            table[:] = 0
            table[self._iota(width) < np.array(table_lens)[:, None]] = flat_tables

        if pending:
            check_pending(seqs, pending, starts_list, counts)
        if decode and not pending:
            a[:num_seqs] = list(map(getitem, tokens, starts_list))
        elif decode:  # a pending token's id is filled in on the device: 0 here
            a[:num_seqs] = [toks[start] if start < len(toks) else 0 for toks, start in zip(tokens, starts_list)]
        else:
            ids: list[int] = []
            for toks, start, n in zip(tokens, starts_list, counts):
                ids += toks[start : start + n]
            if pending:  # a pending token is the one token of its sequence's slice, missing from it
                for i in pending:
                    ids.insert(int(query_start[i]), 0)
            a[:num_rows] = ids
        if decode:
            positions = starts
            owner = self._iota(num_seqs)
        else:
            owner = np.repeat(self._iota(num_seqs), count_arr)
            positions = self._iota(num_rows) + (starts - query_start[:-1])[owner]
        a[o_pos : o_pos + num_rows] = positions
        blocks = table[owner, positions >> self.block_shift].astype(np.int64)
        a[o_slot : o_slot + num_rows] = (blocks << self.block_shift) | (positions & (self.block_size - 1))
        a[o_ctx : o_ctx + num_seqs] = ends
        if padded > num_rows:
            a[num_rows:padded] = 0
            a[o_pos + num_rows : o_slot] = 0
            a[o_slot + num_rows : o_ctx] = -1
        if graph_size is not None and graph_size > num_seqs:
            a[o_ctx + num_seqs : o_qsl] = 1
        a[o_qsl:o_rows] = query_start
        if rows_needed:
            a[o_rows:o_tab] = query_start[1:][samples] - 1
        if pending:
            a[o_fill : o_fill + num_fill] = query_start[1:][pending] - 1  # a pending token is its sequence's last row
            a[o_fill + num_fill : o_cascade] = [seqs[i].pending_row for i in pending]
        if plan:
            write_cascade(a[o_cascade:o_mixed], plan, *layout)
        if mixed:  # the rest's query starts: its rows follow the single-token ones
            a[o_mixed:o_keys] = query_start[mixed:] - mixed
        if not decode:  # where each context starts among all of them (and among the rest's)
            key_starts = a[o_keys:o_mixed_keys]
            key_starts[0] = 0
            np.cumsum(ends, out=key_starts[1:])
            if mixed:
                a[o_mixed_keys:o_key_slots] = key_starts[mixed:] - key_starts[mixed]
            if gathered:
                a[o_key_slots:end] = self._key_slots(table, ends, key_starts)
        # The step-time model counts a cascade's prefix passes apart from the keys rows read alone.
        batch.cascade_pairs = plan.pairs if plan else 0

        if self.on_cuda:
            self.dev[:end].copy_(self.host[:end], non_blocking=True)
            assert self._copied is not None  # made on CUDA
            self._copied[self._turn].record(torch.cuda.current_stream(self.device))  # the copy's stream
        key = (padded, ctx_rows, num_seqs, num_rows, rows_needed, num_rows_sampled, width, graph_size or 0,
               num_fill, *layout, mixed, gathered, piece_size or 0)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 256:
                self._views.clear()
            dev = self.dev
            views = self._views[key] = (
                dev[:num_rows],
                dev[o_pos : o_pos + num_rows],
                dev[o_slot : o_slot + num_rows],
                dev[o_tab:o_fill].view(num_seqs, width),
                dev[o_ctx : o_ctx + num_seqs],
                dev[o_qsl:o_rows],
                dev[o_rows:o_tab] if rows_needed else None,
                dev[: 4 * graph_size].view(4, graph_size) if graph_size else None,
                dev[o_fill:o_cascade].view(2, num_fill) if num_fill else None,
                cascade_views(dev[o_cascade:o_mixed], *layout) if plan else None,
                dev[o_cascade:o_mixed] if plan and graph_size else None,
                dev[o_mixed:o_keys] if mixed else None,
                None if decode else dev[o_keys:o_mixed_keys],
                dev[o_mixed_keys:o_key_slots] if mixed else None,
                dev[o_key_slots:end] if gathered else None,
                dev[: 3 * piece_size].view(3, piece_size) if piece_size else None,
            )
        (ids_v, pos_v, slots_v, tables_v, ctx_v, qsl_v, rows_v, header_v, fill_v, cascade_v, span_v, mixed_v, keys_v,
         mixed_keys_v, key_slots_v, pieces_v) = views
        longest = (0, 0) if decode else (max(counts), int(ends.max()))
        return StepInputs(
            ids=ids_v,
            positions=pos_v,
            meta=AttentionMetadata(slots_v, tables_v, ctx_v, qsl_v, decode, None if graph_size else cascade_v,
                                   mixed, mixed_v, keys_v, mixed_keys_v, *longest, key_slots_v),
            num_seqs=num_seqs,
            sample_rows=rows_v,
            sample_index=None if all_sample else np.flatnonzero(samples).tolist(),
            graph_size=graph_size,
            graph_header=header_v,
            fill=fill_v,
            graph_cascade=span_v,
            piece_size=piece_size,
            piece_header=pieces_v,
        )


def check_pending(seqs: list, pending: list[int], starts: list[int], counts: list[int]) -> None:
    """A pending token must be the one token its sequence computes in the step (its row is
    then the sequence's last, and no other row of it needs an unknown id)."""
    for i in pending:
        seq = seqs[i]
        if seq.num_pending != 1 or starts[i] != len(seq.token_ids) or counts[i] != 1:
            raise ValueError(f"{seq.request_id}: a pending token must be the only token scheduled "
                             f"(pending {seq.num_pending}, computed {starts[i]} of {len(seq.token_ids)} "
                             f"known, {counts[i]} scheduled)")
