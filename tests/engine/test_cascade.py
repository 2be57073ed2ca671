"""Cascade decode in the engine: which rows of a step share a cached prefix (``engine.cascade``),
the step inputs that carry the groups, and an engine whose decode steps read shared prefixes
once generating what one reading every row's whole context does."""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmpool.config import EngineConfig
from lmpool.config.engine import CASCADE_MIN_SAVED_TOKENS, cascade_min_saved, prefill_attention
from lmpool.engine.cascade import GRAPH_GROUPS, plan_cascade
from lmpool.engine.core import EngineCore
from lmpool.engine.sequence import Sequence
from lmpool.protocol import StepSample
from lmpool.sampling_params import SamplingParams

BLOCK = 4


@st.composite
def decode_rows(draw):
    """Block tables of decode rows: some start with one of a few shared documents (a random
    share of its blocks; the documents behind one shared preamble or not), then blocks of their
    own; context lengths within their tables."""
    preamble = [99_999] * draw(st.integers(0, 1))
    docs = [preamble + list(range(100 * d, 100 * d + draw(st.integers(1, 6))))
            for d in range(draw(st.integers(1, 3)))]
    tables, lens = [], []
    own = iter(range(10_000, 20_000))
    for _ in range(draw(st.integers(1, 10))):
        head = []
        if draw(st.booleans()):
            doc = docs[draw(st.integers(0, len(docs) - 1))]
            head = doc[: draw(st.integers(1, len(doc)))]
        table = head + [next(own) for _ in range(draw(st.integers(1, 3)))]
        tables.append(table)
        lens.append(draw(st.integers((len(table) - 1) * BLOCK + 1, len(table) * BLOCK)))
    return tables, lens


@settings(max_examples=300, deadline=None)
@given(decode_rows(), st.integers(1, 64))
def test_a_plan_groups_rows_by_the_whole_blocks_they_share(rows, min_saved):
    tables, lens = rows
    plan = plan_cascade(tables, lens, BLOCK, min_saved)
    # It saves at least what grouping the rows by their first block alone would (and plans
    # whenever that would).
    by_first: dict[int, list[int]] = {}
    for r, (table, ctx) in enumerate(zip(tables, lens)):
        if ctx > BLOCK:
            by_first.setdefault(table[0], []).append(r)
    one_each = BLOCK * sum((len(m) - 1) * len(os.path.commonprefix([tables[r][: (lens[r] - 1) // BLOCK] for r in m]))
                           for m in by_first.values())
    if plan is None:
        assert one_each < min_saved
        return
    assert plan.saved >= one_each
    assert len(set(plan.rows)) == len(plan.rows)  # disjoint groups
    assert plan.starts[0] == 0 and plan.starts[-1] == len(plan.rows) and plan.starts == sorted(plan.starts)
    saved = pairs = 0
    for g, tokens in enumerate(plan.lens):
        members = plan.rows[plan.starts[g]:plan.starts[g + 1]]
        assert len(members) > 1 and tokens == len(plan.tables[g]) * BLOCK > 0
        for r in members:
            assert plan.kv_start[r] == tokens < lens[r]  # its own keys, at least its new token's
            assert tables[r][: len(plan.tables[g])] == plan.tables[g]
        saved += (len(members) - 1) * tokens
        pairs += len(members) * tokens
    grouped = set(plan.rows)
    assert all(plan.kv_start[r] == 0 for r in range(len(tables)) if r not in grouped)
    assert plan.saved == saved >= min_saved and plan.pairs == pairs


def test_documents_behind_one_preamble_are_read_once_each():
    """Rows of two documents that start with the same system prompt block: each document's rows
    form a group of its own (the document read once for them), not one group of the prompt."""
    doc_a, doc_b = [7, 1, 2, 3, 4], [7, 5, 6, 8, 9]
    tables = [doc_a + [20 + r] for r in range(3)] + [doc_b + [30 + r] for r in range(2)] + [[7, 40]]
    lens = [6 * BLOCK] * 5 + [2 * BLOCK]
    plan = plan_cascade(tables, lens, BLOCK, 1)
    groups = sorted((plan.rows[plan.starts[g]:plan.starts[g + 1]], plan.lens[g]) for g in range(len(plan.lens)))
    assert groups == [([0, 1, 2], 5 * BLOCK), ([3, 4], 5 * BLOCK)]  # the short chat row reads its one block
    assert plan.saved == (2 + 1) * 5 * BLOCK
    # Where the branches share little beyond the prompt, they stay one group of it.
    tables = [[7, 1, 20], [7, 1, 21], [7, 5, 30], [7, 6, 31], [7, 8, 32]]
    plan = plan_cascade(tables, [3 * BLOCK] * 5, BLOCK, 1)
    assert plan.rows == [0, 1, 2, 3, 4] and plan.lens == [BLOCK]
    # Two branches of two rows each: two groups of the deeper prefix, not one of the prompt; and
    # the rows that stay behind a branch group over all they share.
    tables = [[7, 1, 20], [7, 1, 21], [7, 5, 30], [7, 5, 31]]
    plan = plan_cascade(tables, [3 * BLOCK] * 4, BLOCK, 1)
    assert sorted(plan.lens) == [2 * BLOCK, 2 * BLOCK] and plan.saved == 4 * BLOCK
    tables = [doc_a + [20], doc_a + [21], [7, 50, 3, 9], [7, 50, 4, 9]]
    plan = plan_cascade(tables, [len(t) * BLOCK for t in tables], BLOCK, 1)
    assert sorted(plan.lens) == [2 * BLOCK, 5 * BLOCK]


def test_rows_whose_tables_nest_plan_without_recursing_once_a_row():
    """Each row's table one block longer than the last (a conversation's turns side by side): the
    plan follows ``SPLIT_LEVELS`` branches at most, then groups the rest at their common prefix."""
    tables = [[1] + list(range(2, 2 + i)) + [10_000 + i] for i in range(1200)]
    plan = plan_cascade(tables, [len(t) * BLOCK for t in tables], BLOCK, 1)
    assert plan is not None and plan.saved >= 1199 * BLOCK  # at least the one group of the first block


def test_no_plan_below_its_threshold_or_when_off():
    tables = [[1, 2, 3, 7], [1, 2, 3, 8]]
    lens = [4 * BLOCK, 4 * BLOCK]
    assert plan_cascade(tables, lens, BLOCK, 3 * BLOCK).saved == 3 * BLOCK
    assert plan_cascade(tables, lens, BLOCK, 3 * BLOCK + 1) is None
    assert plan_cascade(tables, lens, BLOCK, 0) is None


@pytest.mark.parametrize("kw, dtype, head_dim, threshold", [
    ({}, "float32", 128, 0),  # a CPU engine: the torch reference gains nothing from a cascade
    ({"device": "cuda"}, "bfloat16", 128, CASCADE_MIN_SAVED_TOKENS),
    ({"device": "cuda:1"}, "float16", 64, CASCADE_MIN_SAVED_TOKENS),
    ({"device": "cuda"}, "float32", 128, 0),  # the kernels cascade on tensor cores only
    ({"device": "cuda", "cascade_min_saved_tokens": 16}, "float32", 128, 0),
    ({"device": "cuda", "use_kernels": False}, "bfloat16", 128, 0),  # the torch ops: only when asked
    ({"device": "cuda"}, "bfloat16", 96, 0),  # a head size the kernels lack runs the torch ops
    ({"device": "cuda", "use_kernels": False, "cascade_min_saved_tokens": 16}, "float32", 128, 16),
    ({"device": "cuda", "cascade_min_saved_tokens": 0}, "bfloat16", 128, 0),
    ({"cascade_min_saved_tokens": 16}, "float32", 128, 16),
])
def test_cascades_are_on_by_default_where_the_kernels_run_them_in_half_precision(kw, dtype, head_dim, threshold):
    assert cascade_min_saved(EngineConfig("model", **kw), dtype, head_dim) == threshold


@pytest.mark.parametrize("kw, dtype, head_dim, attention", [
    ({}, "float32", 128, "lmpool"),  # a CPU engine: the torch reference either way
    ({"device": "cuda"}, "bfloat16", 128, "flash"),
    ({"device": "cuda:1"}, "float16", 64, "flash"),
    ({"device": "cuda"}, "float32", 128, "lmpool"),  # FlashAttention takes no fp32
    ({"device": "cuda", "use_kernels": False}, "bfloat16", 128, "lmpool"),
    ({"device": "cuda"}, "bfloat16", 96, "lmpool"),  # a head size the kernels lack runs the torch ops
    ({"device": "cuda", "prefill_attention": "lmpool"}, "bfloat16", 128, "lmpool"),
    ({"prefill_attention": "flash"}, "float32", 128, "flash"),  # asked for: the runner warns it is ignored
])
def test_prefill_runs_flash_attention_by_default_where_the_kernels_run_in_half_precision(kw, dtype, head_dim,
                                                                                         attention):
    assert prefill_attention(EngineConfig("model", **kw), dtype, head_dim) == attention


@pytest.mark.parametrize("kw", [{}, {"cascade_min_saved_tokens": 16}, {"cascade_min_saved_tokens": 0}])
def test_an_engine_plans_cascades_by_the_threshold_its_pool_prices_by(tiny_model, kw):
    """The runner plans with what the pool's control plane is told (``ControlSpec``)."""
    from lmpool.config.pool import PoolConfig
    from lmpool.engine.model_runner import planned_cascades
    from lmpool.model.config import ModelConfig

    engine = EngineConfig(tiny_model, block_size=BLOCK, num_kv_blocks=16, **kw)
    spec_engine = PoolConfig(engine=engine, world_size=1).engine_of(0)  # what PoolClient sends in its ControlSpec
    core = EngineCore(engine)
    assert (core.runner.cascade_min_saved == planned_cascades(spec_engine, ModelConfig.from_pretrained(tiny_model))
            == kw.get("cascade_min_saved_tokens", 0))


def placed(name: str, table: list[int], length: int, computed: int, block_size: int = BLOCK) -> Sequence:
    """A sequence of ``length`` tokens, ``computed`` of them in the cache, holding the blocks ``table``."""
    s = Sequence(name, list(range(length)), SamplingParams(temperature=0, max_tokens=4), block_size)
    s.num_computed_tokens = computed
    s.block_table = table
    return s


def arrive_while_decoding(core: EngineCore, first: list[list[int]], later: list[list[int]],
                          params: SamplingParams) -> dict[str, list[int]]:
    """Each request's tokens when ``first`` (``a0``, ...) are prefilled and decoding before ``later``
    (``b0``, ...) arrive: the steps that prefill ``later`` are mixed."""
    out: dict[str, list[int]] = {}

    def step() -> None:
        for o in core.step():
            out.setdefault(o.request_id, []).append(o.new_token_id)

    for i, prompt in enumerate(first):
        core.add_request(f"a{i}", prompt, params)
    for _ in range(3):  # prefilled, then decoding
        step()
    for i, prompt in enumerate(later):
        core.add_request(f"b{i}", prompt, params)
    while core.has_unfinished():
        step()
    return out


def run(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
        if i == 0:  # the shared document is cached before the rest arrive
            while core.has_unfinished():
                for o in core.step():
                    out.setdefault(o.request_id, []).append(o.new_token_id)
    while core.has_unfinished():
        for o in core.step():
            out.setdefault(o.request_id, []).append(o.new_token_id)
    return out


@pytest.mark.parametrize("overlapped", [False, True])
def test_an_engine_reading_shared_prefixes_once_generates_the_same_tokens(tiny_model, monkeypatch, overlapped):
    doc = [(7 * i + 3) % 900 for i in range(10 * BLOCK + 1)]
    prompts = [doc] + [doc + [50 + q, 60 + q, 70 + q] for q in range(5)] + [list(range(300, 313))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain_core = EngineCore(EngineConfig(tiny_model, block_size=BLOCK, num_kv_blocks=128, async_scheduling=overlapped))
    plain = run(plain_core, prompts, params)
    core = EngineCore(EngineConfig(tiny_model, block_size=BLOCK, num_kv_blocks=128, async_scheduling=overlapped,
                                   cascade_min_saved_tokens=1))
    calls = []
    runner = core.runner
    ops = runner.ops

    def counted(*args, **kwargs):
        calls.append(args[9].numel())  # prefix_rows: the step's rows
        return ops.cascade_decode_attention(*args, **kwargs)

    monkeypatch.setattr(runner, "ops", dataclasses.replace(ops, cascade_decode_attention=counted))
    assert run(core, prompts, params) == plain
    assert calls, "no decode step ran as a cascade"
    # The same steps, as the step-time model sees them: a cascade step's prefix pass moves
    # (row, key) pairs from its context to its cascade pairs, apart from the prefill's attention,
    # and every row still reads its new token.
    cascaded, steps = list(core.step_samples), list(plain_core.step_samples)
    assert [(s.prefill_tokens, s.attention, s.decode_seqs, s.decode_context + s.cascade_pairs) for s in cascaded] == [
        (s.prefill_tokens, s.attention, s.decode_seqs, s.decode_context) for s in steps]
    moved = [c.cascade_pairs for c in cascaded]
    assert min(moved) == 0 and max(moved) >= 2 * 10 * BLOCK  # the document's ten blocks, two rows at least
    assert all(c.decode_context >= c.decode_seqs for c in cascaded) and not any(s.cascade_pairs for s in steps)


def test_a_cascade_step_carries_its_groups_and_replays_no_graph_where_none_was_captured():
    """Three decode rows, two of them sharing two whole blocks, and a later step without any
    sharing from the same builder: the first carries the plan's arrays (no graph: the graphs
    have no cascades), the next none."""
    import torch

    from lmpool.engine.scheduler import ScheduledBatch
    from lmpool.engine.step_inputs import StepInputBuilder
    from tests.engine.test_step_inputs import FakeGraphs

    def seq(name: str, table: list[int], length: int) -> Sequence:
        return placed(name, table, length, length - 1)

    builder = StepInputBuilder(torch.device("cpu"), BLOCK, 4096, cascade_min_saved=1)
    graphs = FakeGraphs(8, 16)
    rows = [seq("a", [5, 6, 40], 10), seq("b", [9, 41], 6), seq("c", [5, 6, 42, 43], 13)]
    batch = ScheduledBatch()
    for row in rows:
        batch.add(row, 1)
    inputs = builder.build(batch, graphs)
    assert batch.cascade_pairs == 2 * 8  # the prefix pass: two rows attend the shared two blocks
    # ... which the step's sample counts apart from any prefill's pairs: no attention, only the rows' own keys.
    assert batch.sample(1.0) == StepSample(1.0, 0, 0, 3, 10 + 6 + 13 - 16, cascade_pairs=16)
    plan = plan_cascade([r.block_table for r in rows], [10, 6, 13], BLOCK, 1)
    assert inputs.graph_size is None and inputs.meta.cascade is not None
    kv_start, prefix_tables, prefix_lens, prefix_starts, prefix_rows = (t.tolist() for t in inputs.meta.cascade)
    assert (kv_start, prefix_rows, prefix_starts, prefix_lens) == (plan.kv_start, plan.rows, plan.starts, plan.lens)
    assert kv_start == [8, 0, 8] and prefix_tables == [[5, 6]] and prefix_rows == [0, 2]
    assert inputs.meta.context_lens.tolist() == [10, 6, 13]
    alone = builder.build(ScheduledBatch(seqs=[seq("d", [7, 8], 6), seq("e", [9, 10], 6)], num_tokens=[1, 1]),
                          graphs)
    assert alone.meta.cascade is None and alone.graph_size == 2
    builder.build(batch, graphs)
    assert batch.cascade_pairs == 16  # built again, counted once


@settings(max_examples=200, deadline=None)
@given(decode_rows(), st.integers(0, 6), st.integers(0, 3))
def test_a_plan_fills_a_span_laid_out_for_a_larger_batch(rows, padding, more_groups):
    """``write_cascade`` into a span laid out for ``rows + padding`` rows, as many grouped rows and
    ``more_groups`` groups more than the plan's: the rows past the plan's are in no group, the
    groups past its own are empty, and its own are as planned."""
    import numpy as np
    import torch

    from lmpool.engine.cascade import cascade_offsets, cascade_views, write_cascade

    tables, lens = rows
    plan = plan_cascade(tables, lens, BLOCK, 1)
    if plan is None:
        return
    size, groups, width = len(tables) + padding, len(plan.lens) + more_groups, max(map(len, tables))
    span = np.full(cascade_offsets(size, size, groups, width)[-1], -7, dtype=np.int32)
    write_cascade(span, plan, size, size, groups, width)
    view = cascade_views(torch.from_numpy(span), size, size, groups, width)
    kv_start, prefix_tables, prefix_lens, starts, members = (t.tolist() for t in view)
    grouped = len(plan.rows)
    assert kv_start == plan.kv_start + [0] * padding
    assert members[:grouped] == plan.rows and starts == plan.starts + [grouped] * more_groups
    assert prefix_lens == plan.lens + [0] * more_groups
    for g, blocks in enumerate(plan.tables):
        assert prefix_tables[g] == blocks + [0] * (width - len(blocks))
    assert -7 not in span.tolist()  # every entry written


def test_a_cascade_step_replays_the_cascade_graph_of_its_padded_size():
    import torch

    from lmpool.engine.cascade import cascade_views
    from lmpool.engine.scheduler import ScheduledBatch
    from lmpool.engine.step_inputs import StepInputBuilder
    from tests.engine.test_step_inputs import FakeGraphs

    seqs = [placed(name, table, length, length - 1)
            for name, table, length in (("a", [5, 6, 40], 10), ("b", [9, 41], 6), ("c", [5, 6, 42, 43], 13))]
    builder = StepInputBuilder(torch.device("cpu"), BLOCK, 4096, cascade_min_saved=1)
    inputs = builder.build(ScheduledBatch(seqs=seqs, num_tokens=[1, 1, 1]), FakeGraphs(8, 16, cascades=True))
    assert inputs.graph_size == 4 and inputs.meta.cascade is None and inputs.graph_cascade is not None
    view = cascade_views(inputs.graph_cascade, 4, 4, GRAPH_GROUPS, 16)
    kv_start, prefix_tables, prefix_lens, starts, members = (t.tolist() for t in view)
    assert kv_start == [8, 0, 8, 0] and members[:2] == [0, 2] and starts == [0] + [2] * GRAPH_GROUPS
    assert prefix_lens == [8] + [0] * (GRAPH_GROUPS - 1) and prefix_tables[0][:3] == [5, 6, 0]


def test_a_step_of_more_groups_than_a_cascade_graph_holds_runs_eagerly():
    import torch

    from lmpool.engine.scheduler import ScheduledBatch
    from lmpool.engine.sequence import Sequence
    from lmpool.engine.step_inputs import StepInputBuilder
    from tests.engine.test_step_inputs import FakeGraphs

    params = SamplingParams(temperature=0, max_tokens=4)
    seqs = []
    for g in range(GRAPH_GROUPS + 1):  # as many documents, two rows on each
        for r in range(2):
            s = Sequence(f"{g}-{r}", list(range(7)), params, BLOCK)
            s.num_computed_tokens = 6
            s.block_table = [100 * g, 100 * g + 10 + r]
            seqs.append(s)
    builder = StepInputBuilder(torch.device("cpu"), BLOCK, 8192, cascade_min_saved=1)
    inputs = builder.build(ScheduledBatch(seqs=seqs, num_tokens=[1] * len(seqs)), FakeGraphs(16, 16, cascades=True))
    assert inputs.graph_size is None and inputs.meta.cascade is not None
    assert inputs.meta.cascade.prefix_lens.tolist() == [BLOCK] * (GRAPH_GROUPS + 1)


@pytest.mark.parametrize("overlapped", [False, True])
def test_decode_rows_beside_prompt_chunks_read_shared_prefixes_once_with_the_same_tokens(tiny_model, monkeypatch,
                                                                                        overlapped):
    """Questions over a cached document decode while later ones (and an unrelated prompt) are
    prefilled in the same steps: those mixed steps' decode rows run as a cascade, the prompt
    chunks as a prefill, and every request generates what it does without cascades."""
    from lmpool.model import qwen3

    doc = [(7 * i + 3) % 900 for i in range(10 * BLOCK + 1)]
    first = [doc + [50 + q, 60 + q, 70 + q] for q in range(4)]
    later = [doc + list(range(100 + 9 * q, 109 + 9 * q)) for q in range(3)] + [list(range(300, 313))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def staggered(core: EngineCore) -> dict[str, list[int]]:
        core.add_request("doc", doc, params)
        while core.has_unfinished():
            core.step()
        return arrive_while_decoding(core, first, later, params)

    def config(**kw) -> EngineConfig:
        return EngineConfig(tiny_model, block_size=BLOCK, num_kv_blocks=128, async_scheduling=overlapped, **kw)

    plain = staggered(EngineCore(config()))
    mixed_steps = []
    split = qwen3.Attention._mixed_cascade

    def counted(self, q, *args):
        mixed_steps.append((q.shape[0], args[2].mixed_decode_rows))
        return split(self, q, *args)

    monkeypatch.setattr(qwen3.Attention, "_mixed_cascade", counted)
    assert staggered(EngineCore(config(cascade_min_saved_tokens=1))) == plain
    assert mixed_steps, "no mixed step ran its decode rows as a cascade"
    assert all(rows > decode_rows >= 2 for rows, decode_rows in mixed_steps)


def test_a_mixed_step_lists_its_decode_rows_first_and_gives_the_rest_their_query_starts():
    import torch

    from lmpool.engine.scheduler import ScheduledBatch
    from lmpool.engine.step_inputs import StepInputBuilder

    seq = placed
    batch = ScheduledBatch()
    batch.add(seq("p", [5, 6, 50], 11, 8), 3)  # a prompt's last chunk, over the shared blocks
    batch.add(seq("a", [5, 6, 40], 10, 9), 1)
    batch.add(seq("q", [60, 61], 7, 0), 7)
    batch.add(seq("c", [5, 6, 42, 43], 13, 12), 1)
    batch.decode_first()
    assert [s.request_id for s in batch.seqs] == ["a", "c", "p", "q"] and batch.num_tokens == [1, 1, 3, 7]
    inputs = StepInputBuilder(torch.device("cpu"), BLOCK, 4096, cascade_min_saved=1).build(batch)
    meta = inputs.meta
    assert not meta.is_decode and meta.mixed_decode_rows == 2 and batch.cascade_pairs == 16
    # The step model's view: the prefix pass's pairs apart, what the rows read alone context.
    assert batch.sample(1.0) == StepSample(1.0, 3 + 7, (3 * 8 + 6) + 28, 2, 10 + 13 - 16, cascade_pairs=16,
                                           prefill_keys=(8 + 3) + 7)
    assert meta.mixed_query_start_loc.tolist() == [0, 3, 10]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 5, 12]
    assert meta.key_starts.tolist() == [0, 10, 23, 34, 41]  # contexts 10, 13, 11 and 7
    assert meta.mixed_key_starts.tolist() == [0, 11, 18]
    assert (meta.max_query_len, meta.max_context_len) == (7, 13)
    assert meta.cascade.kv_start.tolist() == [8, 8] and meta.cascade.prefix_lens.tolist() == [8]
    assert meta.cascade.prefix_rows.tolist() == [0, 1] and meta.cascade.prefix_tables.tolist() == [[5, 6]]
    unshared = ScheduledBatch()
    unshared.add(seq("a", [5, 6, 40], 10, 9), 1)
    unshared.add(seq("q", [60, 61], 7, 0), 7)
    plain = StepInputBuilder(torch.device("cpu"), BLOCK, 4096, cascade_min_saved=1).build(unshared).meta
    assert plain.mixed_decode_rows == 0 and plain.cascade is None and plain.mixed_query_start_loc is None
    assert plain.key_starts.tolist() == [0, 10, 17] and plain.mixed_key_starts is None
