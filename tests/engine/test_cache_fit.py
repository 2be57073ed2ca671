"""A KV cache the GPU cannot hold is refused with the sizes and what to change
(``model_runner.cache_shortfall``; the GPU check itself is in ``test_engine_gpu.py``)."""

from __future__ import annotations

from lmpool.engine.model_runner import cache_shortfall


def test_a_cache_within_the_free_memory_passes():
    assert cache_shortfall(needed=10 << 30, available=10 << 30, device="cuda:0", num_blocks=5, utilization=0.9) is None


def test_a_cache_beyond_it_names_the_sizes_and_the_remedies():
    message = cache_shortfall(needed=3 << 30, available=1 << 30, device="cuda:1", num_blocks=96, utilization=0.9)
    assert message == ("the KV cache of 96 blocks needs 3.00 GiB but only 1.00 GiB is free on cuda:1 (other "
                       "processes hold the rest); lower gpu_memory_utilization (now 0.9) or set num_kv_blocks")
