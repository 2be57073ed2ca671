"""Piecewise graphs (``lmpool.engine.piecewise_graphs``) run on CPU without capture: the same
pieces on the same static buffers, so the padding, the order of pieces and attentions and the
step inputs' ``[3, P]`` header are checked here; the GPU tests replay them captured.

- A step through the pieces gives the eager forward's hidden states (every row kind: prompt
  chunks, prefix-cache hits, decode rows beside them, pending input tokens).
- An engine whose runner runs them generates the eager engine's greedy tokens, token for token,
  under overlapped and serial stepping, steps too large for them running eagerly.
- Padding rows write no KV slot.
- Cascade decode steps and mixed steps (decode rows as a cascade beside prompt chunks) through
  them generate what the eager engine does.
"""

from __future__ import annotations

import pytest
import torch

from lmpool import LLM, SamplingParams
from lmpool.engine.piecewise_graphs import SMALLEST, PiecewiseGraphs, piece_sizes
from lmpool.engine.scheduler import ScheduledBatch
from lmpool.engine.sequence import Sequence
from lmpool.engine.step_inputs import StepInputBuilder

BLOCK = 16


@pytest.mark.parametrize("max_tokens", [1, 15, 16, 17, 24, 100, 512, 8192])
def test_sizes_end_at_the_most_and_pad_at_most_half_again(max_tokens):
    sizes = piece_sizes(max_tokens)
    assert sizes[-1] == max_tokens and sizes == sorted(set(sizes))
    assert sizes[0] == min(SMALLEST, max_tokens)
    for smaller, larger in zip(sizes, sizes[1:]):
        assert larger <= smaller * 3 // 2 or larger == max_tokens


def test_padded_size_is_the_smallest_that_holds_the_rows():
    class Sizes:
        padded_size = PiecewiseGraphs.padded_size

        def __init__(self, max_tokens):
            self.sizes = piece_sizes(max_tokens)

    sizes = Sizes(100)
    for rows in range(1, 101):
        size = sizes.padded_size(rows)
        assert size is not None and size >= rows
        assert all(s < rows for s in sizes.sizes if s < size)
    assert sizes.padded_size(101) is None


def _pieces(llm: LLM, max_tokens: int) -> PiecewiseGraphs:
    runner = llm.engine.runner
    runner.pieces = PiecewiseGraphs(runner, max_tokens, capture=False)
    return runner.pieces


def _batch(specs: list[tuple[int, int, int]], block_tables: list[list[int]]) -> ScheduledBatch:
    """Sequences of (prompt length, tokens computed, tokens this step), decode rows first."""
    seqs = []
    for i, (length, computed, _) in enumerate(specs):
        seq = Sequence(f"r{i}", list(range(7 + i, 7 + i + length)), SamplingParams(max_tokens=4), BLOCK)
        seq.num_computed_tokens = computed
        seq.block_table = block_tables[i]
        seqs.append(seq)
    return ScheduledBatch(seqs=seqs, num_tokens=[n for _, _, n in specs])


@pytest.mark.parametrize("specs", [
    [(30, 0, 30)],  # one prompt
    [(40, 32, 8), (9, 0, 9)],  # a prefix-cache hit beside a cold prompt
    [(21, 20, 1), (35, 34, 1), (50, 16, 34)],  # decode rows beside a chunk
    [(21, 20, 1), (18, 17, 1)],  # a decode step (no decode graphs here)
])
def test_a_step_through_the_pieces_equals_the_eager_forward(tiny_model, specs):
    with LLM(tiny_model, block_size=BLOCK, num_kv_blocks=64) as llm:
        runner = llm.engine.runner
        tables = [[4 * i + j for j in range(-(-length // BLOCK))] for i, (length, _, _) in enumerate(specs)]
        runner.kv_cache.normal_()  # every context's earlier keys and values
        batch = _batch(specs, tables)
        inputs = runner.prepare(batch)
        eager = runner.forward_hidden(inputs).clone()
        cache = runner.kv_cache.clone()
        pieces = _pieces(llm, 64)
        inputs = runner.prepare(batch)
        assert inputs.piece_size == pieces.padded_size(sum(batch.num_tokens))
        got = runner.forward_hidden(inputs)
        assert got.shape == eager.shape
        # A CPU matmul's roundings depend on its row count (a padded one's differ by ~1e-6), and
        # a few layers grow that; a piece out of order or a row mixed up differs by ~1.
        torch.testing.assert_close(got, eager, rtol=1e-3, atol=1e-3)
        # The same keys and values were stored, at the real rows' slots only.
        torch.testing.assert_close(runner.kv_cache, cache, rtol=1e-3, atol=1e-3)


def test_padding_rows_are_token_0_position_0_and_write_nothing():
    builder = StepInputBuilder(torch.device("cpu"), BLOCK, 4096)

    class Sizes:
        def padded_size(self, num_rows):
            return 24 if num_rows <= 24 else None

    batch = _batch([(21, 20, 1), (30, 16, 14)], [[0, 1], [2, 3]])
    inputs = builder.build(batch, None, Sizes())
    assert inputs.piece_size == 24 and inputs.piece_header is not None
    header = inputs.piece_header.tolist()
    assert header[0][:15] == inputs.ids.tolist() and header[0][15:] == [0] * 9
    assert header[1][:15] == inputs.positions.tolist() and header[1][15:] == [0] * 9
    assert header[2][:15] == inputs.meta.slot_mapping.tolist() and header[2][15:] == [-1] * 9
    assert inputs.meta.context_lens.tolist() == [21, 30]
    # A step larger than every size runs eagerly, unpadded.
    large = builder.build(_batch([(40, 0, 40)], [[0, 1, 2]]), None, Sizes())
    assert large.piece_size is None and large.piece_header is None and large.ids.shape[0] == 40


def _generate(model: str, prompts: list[list[int]], pieces: int | None, **kw) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model, block_size=BLOCK, max_num_batched_tokens=64, **kw) as llm:
        runs = 0
        if pieces is not None:
            run = _pieces(llm, pieces).run

            def counted(inputs):
                nonlocal runs
                runs += 1
                return run(inputs)

            llm.engine.runner.pieces.run = counted
        outs = llm.generate(prompts, params)
        assert (runs > 0) == (pieces is not None)
        return [o.token_ids for o in outs]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlapped", "serial"])
def test_an_engine_running_the_pieces_generates_the_eager_tokens(tiny_model, async_scheduling):
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 1000, (40,), generator=g).tolist()
    lengths = torch.randint(3, 150, (8,), generator=g)
    prompts = [torch.randint(0, 1000, (int(n),), generator=g).tolist() for n in lengths]
    prompts += [shared + [5, 6, 7], shared + [8, 9]]  # prefix-cache hits
    eager = _generate(tiny_model, prompts, None, async_scheduling=async_scheduling)
    # 24: most steps are larger (eager), some smaller (pieces); 64: every step through them.
    for most in (24, 64):
        assert _generate(tiny_model, prompts, most, async_scheduling=async_scheduling) == eager


@pytest.mark.parametrize("overlapped", [False, True], ids=["serial", "overlapped"])
def test_cascade_and_mixed_cascade_steps_through_the_pieces_equal_eager(tiny_model, monkeypatch, overlapped):
    """Questions over a cached document decode as a cascade while later ones are prefilled in the
    same steps: the pieces run those mixed steps (their attention eager, as laid out) and the
    cascade decode steps (no decode graph on a CPU), with the eager engine's tokens."""
    from lmpool.config.engine import EngineConfig
    from lmpool.engine.core import EngineCore
    from tests.engine.test_cascade import arrive_while_decoding

    doc = [(7 * i + 3) % 900 for i in range(10 * BLOCK + 1)]
    first = [doc + [50 + q, 60 + q, 70 + q] for q in range(4)]
    later = [doc + list(range(100 + 9 * q, 109 + 9 * q)) for q in range(3)] + [list(range(300, 313))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def staggered(pieces: bool) -> dict[str, list[int]]:
        core = EngineCore(EngineConfig(tiny_model, block_size=BLOCK, num_kv_blocks=128, async_scheduling=overlapped,
                                       cascade_min_saved_tokens=1))
        if pieces:
            core.runner.pieces = PiecewiseGraphs(core.runner, 64, capture=False)
        core.add_request("doc", doc, params)
        while core.has_unfinished():
            core.step()
        return arrive_while_decoding(core, first, later, params)

    eager = staggered(False)
    kinds: list[tuple[bool, int]] = []  # (decode step, its mixed decode rows) of each step the pieces ran
    run = PiecewiseGraphs.run

    def counted(self, inputs):
        kinds.append((inputs.meta.is_decode and inputs.meta.cascade is not None, inputs.meta.mixed_decode_rows))
        return run(self, inputs)

    monkeypatch.setattr(PiecewiseGraphs, "run", counted)
    assert staggered(True) == eager
    assert any(rows >= 2 for _, rows in kinds), "no mixed cascade step ran through the pieces"
    assert any(cascade for cascade, _ in kinds), "no cascade decode step ran through the pieces"


def test_the_rows_the_pieces_take_follow_the_engine_s_graphs():
    """One rule for the engine and the evaluation's record: CUDA graphs on LMPool's kernels
    only, at most a step's tokens."""
    from lmpool.config.engine import EngineConfig, piecewise_rows

    assert piecewise_rows(EngineConfig("m", device="cuda")) == 512
    assert piecewise_rows(EngineConfig("m", device="cuda:1", max_num_batched_tokens=100)) == 100
    assert piecewise_rows(EngineConfig("m", device="cuda", piecewise_graph_max_tokens=0)) == 0
    for off in ({"device": "cpu"}, {"device": "cuda", "enforce_eager": True}, {"device": "cuda", "use_kernels": False}):
        assert piecewise_rows(EngineConfig("m", **off)) == 0
