"""StepInputBuilder: every tensor of a step equals the plain per-token construction it replaces.

Random batches (decode, chunked prefill, mixed, with and without decode-graph
padding) are built one after another in one builder, so the reused arena, its
growth and the cached views are exercised; after each build every input is
compared with a list-by-list oracle that asks ``ScheduledBatch.samples`` which
sequences sample.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import event, given, settings

from lmpool.engine.cascade import GRAPH_GROUPS, plan_cascade
from lmpool.engine.cuda_graphs import batch_sizes
from lmpool.engine.scheduler import ScheduledBatch
from lmpool.engine.sequence import Sequence
from lmpool.engine.step_inputs import StepInputBuilder, arena_capacity
from lmpool.ops import reference
from lmpool.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=1)


class FakeGraphs:
    """The builder's view of DecodeGraphs: captured sizes up to ``max_batch``, table width."""

    def __init__(self, max_batch: int, max_width: int, cascades: bool = False) -> None:
        self.sizes = batch_sizes(max_batch)
        self.max_batch = max_batch
        self.max_width = max_width
        self.cascades = cascades

    def padded_size(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)


def oracle(batch: ScheduledBatch, block_size: int) -> dict:
    """The former ModelRunner.prepare, per token in Python lists."""
    ids, positions, slots, ctx, qsl, rows, index = [], [], [], [], [0], [], []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
        start = seq.num_computed_tokens
        ids += seq.token_ids[start : start + n]
        positions += range(start, start + n)
        slots += [seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        ctx.append(start + n)
        qsl.append(qsl[-1] + n)
        if batch.samples(i):
            rows.append(qsl[-1] - 1)
            index.append(i)
    width = max(len(s.block_table) for s in batch.seqs)
    tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
    return dict(ids=ids, positions=positions, slots=slots, ctx=ctx, qsl=qsl, rows=rows, index=index, tables=tables)


@st.composite
def batches(draw, block_size: int):
    decode = draw(st.booleans())
    num_seqs = draw(st.integers(1, 40 if decode else 8))
    seqs, counts = [], []
    next_block = 0
    for i in range(num_seqs):
        length = draw(st.integers(1, 5 * block_size))
        computed = draw(st.integers(max(0, length - 1) if decode else 0, length - 1))
        n = 1 if decode or draw(st.booleans()) else draw(st.integers(1, length - computed))
        tokens = draw(st.lists(st.integers(0, 999), min_size=length, max_size=length))
        seq = Sequence(f"s{i}", tokens, PARAMS, block_size)
        seq.num_computed_tokens = computed
        blocks = -(-(computed + n) // block_size) + draw(st.integers(0, 1))  # grow may have run ahead
        # Some lead with one of two shared prefixes' blocks (cached for several rows; cascades).
        shared = draw(st.sampled_from([[], [10_001, 10_002, 10_003], [20_001]]))[: blocks - 1]
        # Block ids scattered, so a wrong table entry shows up in the slots.
        seq.block_table = shared + [next_block + 7 * j + 3 for j in range(blocks - len(shared))]
        next_block += 7 * blocks + 5
        seqs.append(seq)
        counts.append(n)
    batch = ScheduledBatch()
    for seq, n in zip(seqs, counts):
        batch.add(seq, n)
    batch.decode_first()  # as the scheduler lists a mixed batch
    return batch


def check(builder: StepInputBuilder, batch: ScheduledBatch, graphs: FakeGraphs | None) -> None:
    want = oracle(batch, builder.block_size)
    got = builder.build(batch, graphs)
    num_seqs, num_rows = len(batch.seqs), sum(batch.num_tokens)
    decode = num_rows == num_seqs
    assert got.num_seqs == num_seqs and got.meta.is_decode == decode
    assert got.ids.tolist() == want["ids"]
    assert got.positions.tolist() == want["positions"]
    assert got.meta.slot_mapping.tolist() == want["slots"]
    assert got.meta.context_lens.tolist() == want["ctx"]
    assert got.meta.query_start_loc.tolist() == want["qsl"]
    assert got.meta.block_tables.tolist() == want["tables"]
    for t in (got.ids, got.positions, got.meta.slot_mapping, got.meta.block_tables, got.meta.context_lens):
        assert t.dtype == torch.int32
    check_cascade_and_key_starts(builder, batch, got, want)
    rows = list(range(num_rows)) if got.sample_rows is None else got.sample_rows.tolist()
    assert rows == want["rows"]
    if got.sample_rows is None:
        assert decode and len(want["index"]) == num_seqs
    assert (got.sample_index is None) == (len(want["index"]) == num_seqs)
    assert (list(range(num_seqs)) if got.sample_index is None else got.sample_index) == want["index"]
    # A decode cascade runs eagerly where no graph holds it: graphs without cascades, or too many groups.
    eager_cascade = decode and got.meta.cascade is not None
    if eager_cascade and graphs is not None and num_seqs <= graphs.max_batch:
        assert not graphs.cascades or len(got.meta.cascade.prefix_lens) > GRAPH_GROUPS
    if graphs is None or not decode or num_seqs > graphs.max_batch or eager_cascade:
        assert got.graph_size is None and got.graph_header is None
        return
    size = got.graph_size
    assert size == graphs.padded_size(num_seqs) and got.graph_header.shape == (4, size)
    header = got.graph_header.tolist()
    assert [h[:num_seqs] for h in header] == [want["ids"], want["positions"], want["slots"], want["ctx"]]
    pad = size - num_seqs
    assert [h[num_seqs:] for h in header] == [[0] * pad, [0] * pad, [-1] * pad, [1] * pad]


def check_cascade_and_key_starts(builder: StepInputBuilder, batch: ScheduledBatch, got, want: dict) -> None:
    """A step's cascade (over every row of a decode step, over a mixed step's leading single-token
    rows) is the plan of those rows, and a step that prefills carries its key starts, longest
    query and context, and a mixed cascade the rest's query and key starts."""
    meta, counts, ctx = got.meta, batch.num_tokens, want["ctx"]
    decode = meta.is_decode
    singles = len(counts) if decode else next(i for i, n in enumerate(counts) if n != 1)
    tables = [s.block_table for s in batch.seqs]
    plan = None
    if singles >= 2:
        plan = plan_cascade(tables[:singles], ctx[:singles], builder.block_size, builder.cascade_min_saved)
    assert batch.cascade_pairs == (plan.pairs if plan else 0)
    if decode:
        assert meta.key_starts is None and meta.mixed_decode_rows == 0
        assert (meta.cascade is not None or got.graph_cascade is not None) == (plan is not None)
        return
    key_starts = [0] + list(itertools.accumulate(ctx))
    assert meta.key_starts.tolist() == key_starts
    assert (meta.max_query_len, meta.max_context_len) == (max(counts), max(ctx))
    min_query, max_keys = builder.gather_keys or (0, 0)
    gathers = (plan is None and min_query and key_starts[-1] <= max_keys
               and sum(n * c for n, c in zip(counts, ctx)) >= min_query * key_starts[-1])
    if gathers:
        event("a prefill step listed its key slots")
        bs = builder.block_size
        assert meta.key_slots.tolist() == [t[p // bs] * bs + p % bs for t, c in zip(tables, ctx) for p in range(c)]
    else:
        assert meta.key_slots is None
    if plan is None:
        assert meta.cascade is None and meta.mixed_decode_rows == 0 and meta.mixed_query_start_loc is None
        return
    event("a mixed step ran a cascade")
    assert meta.mixed_decode_rows == singles and meta.cascade.kv_start.tolist() == plan.kv_start
    assert meta.cascade.prefix_rows.tolist() == plan.rows and meta.cascade.prefix_starts.tolist() == plan.starts
    assert meta.cascade.prefix_lens.tolist() == plan.lens
    assert [row[: len(t)] for row, t in zip(meta.cascade.prefix_tables.tolist(), plan.tables)] == plan.tables
    assert meta.mixed_query_start_loc.tolist() == [q - singles for q in want["qsl"][singles:]]
    assert meta.mixed_key_starts.tolist() == [k - key_starts[singles] for k in key_starts[singles:]]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_inputs_equal_the_per_token_construction(block_size, data):
    graphs = data.draw(st.sampled_from([None, FakeGraphs(32, 64), FakeGraphs(32, 64, cascades=True)]))
    # A small arena, so that some batches make it grow; cascades planned at any saving, or never.
    builder = StepInputBuilder(torch.device("cpu"), block_size, capacity=data.draw(st.integers(16, 512)),
                               cascade_min_saved=data.draw(st.sampled_from([0, 1])),
                               gather_keys=data.draw(st.sampled_from([None, (1, 10**6), (2, 10**6), (1, 40)])))
    for _ in range(data.draw(st.integers(1, 4))):
        check(builder, data.draw(batches(block_size)), graphs)


def test_a_long_prefill_attends_the_keys_its_slots_gather_as_it_would_the_paged_cache():
    """What ``cuda.flash_gathered_attention`` computes, with a dense causal attention in place of
    FlashAttention's: each context's keys and values gathered by the step's key slots, queries
    aligned to its end, equal the paged reference's attention; a step of more keys than the
    builder gathers, or of short queries over long contexts, lists no slots (it stays on
    LMPool's kernel)."""
    block, heads, kv_heads, dim = 4, 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(40, block, kv_heads, dim, generator=gen) for _ in range(2))
    seqs, counts = [], []
    for i, (cached, new) in enumerate([(0, 13), (6, 9), (11, 3)]):  # 25 query tokens over 42 keys
        seq = Sequence(f"s{i}", list(range(cached + new)), PARAMS, block)
        seq.num_computed_tokens = cached
        seq.block_table = [39 - 3 * i - 11 * j for j in range(-(-(cached + new) // block))]
        seqs.append(seq)
        counts.append(new)
    batch = ScheduledBatch(seqs=seqs, num_tokens=counts)
    # Queries times keys: 13 * 13 + 9 * 15 + 3 * 14 = 346, at least 8 a key (42 keys).
    meta = StepInputBuilder(torch.device("cpu"), block, 256, gather_keys=(8, 42)).build(batch).meta
    assert meta.key_slots is not None and len(meta.key_slots) == int(meta.key_starts[-1]) == 42
    q = torch.randn(sum(counts), heads, dim, generator=gen)
    want = reference.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                     meta.query_start_loc, 0.3)
    k, v = (reference.gather_slots(cache, meta.key_slots) for cache in (k_cache, v_cache))
    qs, ks = meta.query_start_loc.tolist(), meta.key_starts.tolist()
    for b in range(len(seqs)):
        rows, keys = slice(qs[b], qs[b + 1]), slice(ks[b], ks[b + 1])
        n, c = qs[b + 1] - qs[b], ks[b + 1] - ks[b]
        visible = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]  # causal from the bottom right
        got = torch.nn.functional.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k[keys].repeat_interleave(2, 1).transpose(0, 1),
            v[keys].repeat_interleave(2, 1).transpose(0, 1), attn_mask=visible, scale=0.3).transpose(0, 1)
        torch.testing.assert_close(got, want[rows])
    assert StepInputBuilder(torch.device("cpu"), block, 256, gather_keys=(8, 41)).build(batch).meta.key_slots is None
    batch = ScheduledBatch(seqs=seqs[1:], num_tokens=counts[1:])  # 9 * 15 + 3 * 14 = 177: < 8 a key (29)
    assert StepInputBuilder(torch.device("cpu"), block, 256, gather_keys=(8, 42)).build(batch).meta.key_slots is None


def test_a_graph_step_needs_a_table_the_graph_can_hold():
    builder = StepInputBuilder(torch.device("cpu"), 4, arena_capacity(64, 8, 8))
    seq = Sequence("s", list(range(40)), PARAMS, 4)
    seq.num_computed_tokens = 39
    seq.block_table = list(range(10))
    batch = ScheduledBatch(seqs=[seq], num_tokens=[1])
    assert builder.build(batch, FakeGraphs(8, 10)).graph_size == 1
    assert builder.build(batch, FakeGraphs(8, 9)).graph_size is None  # too wide: runs eagerly
    assert builder.build(batch, None).graph_size is None


def test_empty_batch_and_bad_block_size_are_refused():
    builder = StepInputBuilder(torch.device("cpu"), 16, 64)
    with pytest.raises(ValueError, match="empty batch"):
        builder.build(ScheduledBatch())
    with pytest.raises(ValueError, match="power of two"):
        StepInputBuilder(torch.device("cpu"), 12, 64)


def test_runner_refuses_a_cache_beyond_int32_slots(tiny_model):
    from lmpool import LLM

    with pytest.raises(ValueError, match="int32 slot indices"):
        LLM(tiny_model, block_size=16, num_kv_blocks=2**31 // 16)
