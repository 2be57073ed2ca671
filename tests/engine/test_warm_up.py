"""The start-up warm-up (``lmpool.engine.warm_up``): which shapes it runs, and that it touches
nothing a step reads (KV cache, input arena, random streams)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from lmpool.config.engine import EngineConfig
from lmpool.engine.core import EngineCore
from lmpool.engine.warm_up import EVERY_ROW_UP_TO, distinct_linears, row_counts, token_counts, warm_up


@given(st.integers(1, 2048))
def test_row_counts_cover_every_small_count_and_the_largest(max_rows):
    counts = row_counts(max_rows)
    assert counts == sorted(set(counts)) and counts[-1] == max_rows and counts[0] == 1
    assert set(range(1, min(max_rows, EVERY_ROW_UP_TO) + 1)) <= set(counts)
    assert max(b - a for a, b in zip([0, *counts], counts)) <= 16


@given(st.integers(1, 32768))
def test_token_counts_climb_to_the_largest(max_tokens):
    counts = token_counts(max_tokens)
    assert counts == sorted(set(counts)) and counts[-1] == max_tokens and counts[0] >= 1
    assert max(b - a for a, b in zip([0, *counts], counts)) <= 64


def test_warm_up_leaves_what_a_step_reads_alone(tiny_model):
    core = EngineCore(EngineConfig(model=tiny_model, num_kv_blocks=16, block_size=16))
    runner = core.runner
    runner.kv_cache.normal_()
    kv, arena = runner.kv_cache.clone(), runner.inputs.host.clone()
    rng = runner.sampler.generator.get_state()
    torch.manual_seed(0)
    global_rng = torch.get_rng_state()
    warm_up(runner.model, runner.device, runner.dtype, core.config.max_num_seqs, 64)
    assert torch.equal(runner.kv_cache, kv) and torch.equal(runner.inputs.host, arena)
    assert torch.equal(runner.sampler.generator.get_state(), rng) and torch.equal(torch.get_rng_state(), global_rng)


def test_the_distinct_linears_are_the_decoder_layers_shapes(tiny_model):
    core = EngineCore(EngineConfig(model=tiny_model, num_kv_blocks=16, block_size=16))
    c = core.model_config
    shapes = {(m.in_features, m.out_features) for m in distinct_linears(core.runner.model.layers)}
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    assert shapes == {(c.hidden_size, q + 2 * kv), (q, c.hidden_size),
                      (c.hidden_size, 2 * c.intermediate_size), (c.intermediate_size, c.hidden_size)}
