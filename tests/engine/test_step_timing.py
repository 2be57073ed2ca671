"""What an engine measures of its own steps for a pool's step-time model: each batch's shape
(prefill tokens and their attention pairs, decoding sequences and their context), a time per
read-back step that never counts an interval twice, and the calibration a worker runs before
it serves, which leaves the engine as it found it."""

from __future__ import annotations

import msgspec
import pytest
import torch

from lmpool.config import EngineConfig
from lmpool.engine.block_manager import BlockManager
from lmpool.engine.calibration import BATCH, DECODE, LONG_MIN, LONG_S, SHORT, calibrate, long_prompt_length
from lmpool.engine.core import EngineCore
from lmpool.engine.scheduler import Scheduler
from lmpool.engine.sequence import Sequence
from lmpool.protocol import StepSample
from lmpool.sampling_params import SamplingParams

BLOCK = 4


def test_a_batch_knows_its_shape():
    sched = Scheduler(BlockManager(64, BLOCK), max_num_seqs=8, max_num_batched_tokens=10)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = Sequence("a", list(range(12)), params, BLOCK)
    sched.add(first)
    batch = sched.schedule()  # 10 of its 12 prompt tokens: a chunk from 0
    assert (batch.prefill_tokens, batch.prefill_attention, batch.decode_seqs, batch.prefill_keys) == (10, 55, 0, 10)
    sched.complete_step(batch)
    sched.add(Sequence("b", list(range(100, 103)), params, BLOCK))
    batch = sched.schedule()  # "a": its last 2 after 10 computed; "b": 3 from 0
    assert (batch.prefill_tokens, batch.prefill_attention, batch.prefill_keys) == (5, 2 * 10 + 3 + 6, 12 + 3)
    sched.complete_step(batch)
    first.append_token(7)
    batch = sched.schedule()  # "a" decodes one token at 13 of context
    assert (batch.decode_seqs, batch.decode_context, batch.prefill_tokens) == (1, 13, 0)


@pytest.mark.parametrize("overlapped", [False, True])
def test_every_read_back_step_is_timed_once_with_its_batch(tiny_model, overlapped):
    core = EngineCore(EngineConfig(tiny_model, block_size=BLOCK, num_kv_blocks=64, async_scheduling=overlapped))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    core.add_request("a", list(range(9)), params)
    steps = 0
    while core.has_unfinished():
        core.step()
        steps += 1
    samples = core.take_step_samples()
    assert [(s.prefill_tokens, s.decode_seqs) for s in samples] == [(9, 0)] + [(0, 1)] * 4
    assert all(s.seconds > 0 for s in samples) and core.take_step_samples() == []


def test_calibration_times_the_shapes_the_fit_tells_apart_and_leaves_nothing_behind(tiny_model):
    core = EngineCore(EngineConfig(tiny_model, block_size=BLOCK, num_kv_blocks=256, max_num_seqs=32))
    samples = calibrate(core)
    prefill = [s for s in samples if s.prefill_tokens]
    decode = [s for s in samples if s.decode_seqs]
    assert len(prefill) >= 3 and 1 in {s.decode_seqs for s in decode} and max(s.decode_seqs for s in decode) > 1
    assert max(s.attention / s.prefill_tokens for s in prefill) > 4 * min(
        s.attention / s.prefill_tokens for s in prefill), "a long prompt's attention as well as short ones'"
    assert not any(s.cascade_pairs for s in samples), "an engine without cascades times none"
    longest = max(s.prefill_tokens for s in prefill)
    assert [s.prefill_tokens for s in prefill].count(longest) == 1, "the long prompt's warm-up is not kept"
    bm = core.block_manager
    assert not core.has_unfinished() and bm.num_free == bm.num_blocks and not bm.has_pending_events
    assert bm.enable_prefix_caching and core.take_step_samples() == []
    out = core.add_request("after", list(range(8)), SamplingParams(temperature=0, max_tokens=1))
    assert out.request_id == "after"


def test_where_the_engine_decodes_shared_prefixes_once_calibration_times_a_cascade_and_drops_its_cache(tiny_model):
    """Questions about the long prompt decode as a cascade, so the cascade's pair is measured; the
    blocks cached for them are dropped again, and what the cache held before stays."""
    core = EngineCore(EngineConfig(tiny_model, block_size=BLOCK, num_kv_blocks=1024, max_num_seqs=32,
                                   cascade_min_saved_tokens=1))
    core.add_request("before", list(range(4 * BLOCK + 1)), SamplingParams(temperature=0, max_tokens=1))
    while core.has_unfinished():
        core.step()
    bm = core.block_manager
    held = dict(bm.hash_to_block)
    samples = calibrate(core)
    cascades = [s for s in samples if s.cascade_pairs]
    assert len(cascades) >= DECODE - 2 and all(s.decode_seqs == BATCH and not s.prefill_tokens for s in cascades)
    prefix = cascades[0].cascade_pairs // BATCH  # the long prompt's whole blocks, each question's own keys apart
    assert prefix >= LONG_MIN * SHORT - BLOCK and all(s.cascade_pairs == BATCH * prefix for s in cascades)
    assert all(s.decode_context < BATCH * (SHORT + DECODE) for s in cascades)
    assert bm.hash_to_block == held and bm.num_free + bm.num_reclaimable == bm.num_blocks
    assert bm.enable_prefix_caching and not core.has_unfinished() and core.take_step_samples() == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_a_long_prefill_is_timed_as_the_longest_step(tiny_model):
    """Overlapped, the host learns of a step's end only after queueing the next: timed on the
    host, a prefill's time went to the decode step before it. Timed on the device, it is the
    prefill's (every read-back step timed once, none charged for another's)."""
    core = EngineCore(EngineConfig(tiny_model, device="cuda", block_size=16, num_kv_blocks=512))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # A first pass warms what a first step pays for once (lazy CUDA and library set-up: on the
    # H200 a first decode step took longer than the long prefill); its samples are dropped.
    core.add_request("warm", [(500 + 7 * i) % 1000 for i in range(4000)], params)
    while core.has_unfinished():
        core.step()
    core.take_step_samples()
    core.add_request("short", list(range(16)), params)
    for _ in range(3):
        core.step()
    # Shares no block with "short" (a cached block would leave fewer than 4,000 to compute).
    core.add_request("long", [1 + i % 1000 for i in range(4000)], params)
    while core.has_unfinished():
        core.step()
    samples = core.take_step_samples()
    prefill = [s for s in samples if s.prefill_tokens >= 4000]
    assert len(prefill) == 1 and all(s.seconds > 0 for s in samples)
    assert prefill[0].seconds > max(s.seconds for s in samples if not s.prefill_tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_every_chunk_of_a_long_prompt_is_awaited(tiny_model):
    """A chunk that samples nothing still ends in an event the host waits for, so an overlapped
    engine keeps at most one step queued behind the one running (unwaited, chunks filled the
    device's launch queue and a launch held the host for whole chunks), and is timed on the
    device's clock."""
    core = EngineCore(EngineConfig(tiny_model, device="cuda", block_size=16, num_kv_blocks=512,
                                   max_num_batched_tokens=512))
    core.add_request("long", [1 + i % 1000 for i in range(2000)], SamplingParams(temperature=0, max_tokens=2))
    awaited = []
    while core.has_unfinished():
        step = core.begin_step()
        core.end_step(step)  # reads the awaited step back
        if step.awaited is not None:
            awaited.append((step.awaited.batch.prefill_tokens, step.awaited.pending.device_s(None)))
    chunks = [a for a in awaited if a[0]]
    assert len(chunks) >= 3
    # timed on the device (None would mean no event): every chunk, sampling or not
    assert all(seconds is not None and seconds > 0 for _, seconds in chunks)


def test_the_long_prompt_is_as_long_as_the_batch_prefills_in_its_time():
    """Its pace is the batch's step (the most prefill tokens), not a lone short prompt's, whose
    fixed cost spread over few tokens would make the long prompt too short to time its attention."""
    lone = StepSample(seconds=0.004, prefill_tokens=64, attention=2080, decode_seqs=0, decode_context=0)
    batch = StepSample(seconds=0.010, prefill_tokens=1024, attention=16 * 2080, decode_seqs=0, decode_context=0)
    decode = StepSample(seconds=0.003, prefill_tokens=0, attention=0, decode_seqs=16, decode_context=1100)
    assert long_prompt_length([lone, decode, batch], 1 << 20, 512) == int(LONG_S * 1024 / 0.010)
    assert long_prompt_length([lone, batch], 4096, 512) == 4096  # one chunk at most
    assert long_prompt_length([lone, msgspec.structs.replace(batch, seconds=10.0)], 8192, 512) == 512  # the floor
    assert long_prompt_length([decode], 8192, 512) == 8192  # nothing timed: the longest
    assert long_prompt_length([lone, msgspec.structs.replace(batch, seconds=10.0)], 256, 512) == 256  # never past it
