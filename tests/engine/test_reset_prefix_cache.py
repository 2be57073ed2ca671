"""``EngineCore.reset_prefix_cache``: an idle engine forgets every cached prefix, a busy one refuses."""

from __future__ import annotations

import pytest

from lmpool.config.engine import EngineConfig
from lmpool.engine.core import EngineCore
from lmpool.sampling_params import SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(100, 180))  # five whole blocks


def run_to_end(core: EngineCore, request_id: str) -> None:
    core.add_request(request_id, PROMPT, GREEDY)
    while core.has_unfinished():
        core.step()


def test_an_idle_engine_forgets_its_prefixes_and_computes_the_prompt_again(tiny_model):
    core = EngineCore(EngineConfig(tiny_model, block_size=BLOCK, num_kv_blocks=64))
    run_to_end(core, "first")
    run_to_end(core, "hit")
    assert core.block_manager.hash_to_block, "the prompt's blocks are cached"
    assert core.reset_prefix_cache() == len(PROMPT) // BLOCK
    bm = core.block_manager
    assert not bm.hash_to_block and bm.num_free == bm.num_blocks
    core.add_request("after", PROMPT, GREEDY)
    assert core.cached_prefix_tokens("after") == 0
    while core.has_unfinished():
        core.step()


def test_a_busy_engine_refuses_to_reset_and_keeps_its_cache(tiny_model):
    core = EngineCore(EngineConfig(tiny_model, block_size=BLOCK, num_kv_blocks=64))
    run_to_end(core, "first")
    cached = dict(core.block_manager.hash_to_block)
    core.add_request("running", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="idle"):
        core.reset_prefix_cache()
    assert core.block_manager.hash_to_block.keys() >= cached.keys()
