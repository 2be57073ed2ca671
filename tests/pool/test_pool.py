"""The pool on CPU replicas: same tokens as one engine under every routing policy, prefix
locality, stats, bad input at ingress, start-up failures."""

from __future__ import annotations

import shutil
import time

import pytest
import torch

from lmpool import LLM, SamplingParams
from lmpool.config import RoutingConfig
from lmpool.frontend.api import LMPool
from lmpool.config.pool import ROUTINGS
from lmpool.frontend.client import PoolError

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def mixed_prompts(n: int = 64, seed: int = 0) -> list[list[int]]:
    """Prompts sharing a few long prefixes (so routing has locality to find) plus loners."""
    g = torch.Generator().manual_seed(seed)
    stems = [torch.randint(0, 1000, (int(k),), generator=g).tolist() for k in (40, 57, 23, 70)]
    prompts = []
    for i in range(n):
        tail = torch.randint(0, 1000, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        prompts.append(stems[i % 5] + tail if i % 5 < 4 else tail)
    return prompts


@pytest.fixture(scope="module")
def reference(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        return [o.token_ids for o in llm.generate(mixed_prompts(), GREEDY)]


@pytest.mark.parametrize("routing", ROUTINGS)
def test_pool_outputs_equal_single_engine(tiny_model, reference, routing):
    with LMPool(tiny_model, world_size=4, routing=routing, block_size=BLOCK) as pool:
        outs = pool.generate(mixed_prompts(), GREEDY)
        stats = pool.stats()
    assert [o.token_ids for o in outs] == reference
    assert {o.rank for o in outs} <= {0, 1, 2, 3}
    assert all(o.finish_reason == "length" for o in outs)
    assert len(stats["ranks"]) == 4 and all(r["alive"] for r in stats["ranks"])
    assert stats["route_queries"] == len(outs)
    if routing == "round_robin":
        assert {o.rank for o in outs} == {0, 1, 2, 3}


def test_lmpool_routing_follows_the_prefix(tiny_model):
    g = torch.Generator().manual_seed(3)
    stem = torch.randint(0, 1000, (64,), generator=g).tolist()
    with LMPool(tiny_model, world_size=4, block_size=BLOCK) as pool:
        first = pool.generate(stem + [1, 2, 3], GREEDY)[0]
        # The page table learns of the first request's blocks from the worker's delta;
        # later requests sharing the stem go where the blocks are and hit the cache (five at
        # once: within the bounded-load gate of four ranks, which opens at six in flight).
        later = pool.generate([stem + [i] for i in range(4, 9)], GREEDY)
        stats = pool.stats()
    assert all(o.rank == first.rank for o in later)
    assert all(o.num_cached_tokens == 64 for o in later)
    row = stats["ranks"][first.rank]
    assert row["prefix_hit_tokens"] >= 5 * 64 and row["snapshot_version"] > 0


def test_stats_fields(tiny_model):
    with LMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
        started = time.monotonic()
        outs = pool.generate(mixed_prompts(4), GREEDY)
        wall = time.monotonic() - started
        stats = pool.stats()
    for o in outs:  # each request's time to first token, in parts that lie within the call
        assert o.intake_s >= 0 and o.queued_s >= 0 and o.first_step_s > 0
        assert o.dispatch_s + o.intake_s + o.queued_s + o.first_step_s <= wall
    assert stats["control_pid"] > 0
    for i, row in enumerate(stats["ranks"]):
        assert row["rank"] == i and row["pid"] > 0 and row["alive"]
        for key in ("num_waiting", "num_running", "blocks_free", "blocks_reclaimable", "blocks_used",
                    "prompt_tokens", "prefix_hit_tokens", "heartbeat_age_s", "epoch", "snapshot_version"):
            assert key in row
    assert sum(r["prompt_tokens"] for r in stats["ranks"]) == sum(len(p) for p in mixed_prompts(4))


def test_bad_input_rejected_at_ingress(tiny_model):
    with LMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
        for prompt, match in (([], "empty"), ([5, 10**7], "outside the vocabulary"), ([1] * 5000, "max_model_len")):
            with pytest.raises(ValueError, match=match):
                pool.generate([[1, 2, 3], prompt], GREEDY)
        with pytest.raises(ValueError, match="rank 2 is not a live rank"):
            pool.generate([[1, 2, 3], [4, 5, 6]], GREEDY, rank=2)
        assert pool.client.requests == {}
        assert len(pool.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 8
        pinned = pool.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9]], GREEDY, rank=1)
        assert [o.rank for o in pinned] == [1, 1, 1] and {o.route for o in pinned} == {"pinned"}
        assert all(o.dispatch_s > 0 for o in pinned)  # submission to hand-over, routed through the control plane


def test_routing_config_reaches_the_control_process(tiny_model):
    """With pending prefixes on, a burst sharing a prefix nobody holds yet lands on one rank,
    whether or not the first request's blocks have been reported when the second is routed."""
    prefix = [(7 * i) % 500 + 1 for i in range(6 * BLOCK)]
    burst = [prefix + [900 + i] for i in range(4)]
    with LMPool(tiny_model, world_size=2, block_size=BLOCK, routing_config=RoutingConfig(pending_ttl_s=600)) as pool:
        outs = pool.generate(burst, GREEDY)
    assert len({o.rank for o in outs}) == 1, [o.rank for o in outs]
    routes = [o.route.split()[0] for o in outs]  # each output names the rule that placed it
    assert routes[0] == "min_price" and set(routes[1:]) == {"owner"}, [o.route for o in outs]
    with pytest.raises(ValueError, match="routing_config must be a RoutingConfig"):
        LMPool(tiny_model, world_size=2, block_size=BLOCK, routing_config={"pending_ttl_s": 1})


def test_an_unknown_gpu_transfer_path_is_refused_before_anything_starts(tiny_model):
    with pytest.raises(ValueError, match="gpu_transfer_path must be one of auto, nccl; got 'pcie'"):
        LMPool(tiny_model, world_size=2, block_size=BLOCK, enable_transfers=True, gpu_transfer_path="pcie")


def test_model_that_fails_to_load_names_rank_and_cause(tiny_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    for f in broken.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(PoolError, match=r"rank \d failed to start: FileNotFoundError"):
        LMPool(str(broken), world_size=2, block_size=BLOCK)


def test_each_rank_samples_its_own_random_stream(tiny_model):
    """Unseeded sampling: the first request on rank 0 and the first on rank 1 draw from
    different streams (the same seed on every rank drew identical samples); a seeded request
    samples alike wherever it runs."""
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)
    with LMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
        first = [pool.generate([[1, 2, 3]], sampled, rank=r)[0].token_ids for r in (0, 1)]
        pinned = [pool.generate([[1, 2, 3]], seeded, rank=r)[0].token_ids for r in (0, 1)]
    assert first[0] != first[1]
    assert pinned[0] == pinned[1]


@pytest.fixture
def sigint_raises():
    """Ctrl-C raises KeyboardInterrupt here, whatever this process inherited: a shell starting
    it in the background has it ignore SIGINT, and Python then installs no handler."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupted_generate_aborts_its_requests(tiny_model, sigint_raises):
    """Ctrl-C while ``LMPool.generate`` waits: the interruption reaches the caller, and the
    call's requests are aborted before it does, not left running on the ranks."""
    import signal
    import threading

    main = threading.main_thread().ident
    with LMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
        engine = pool.client
        deliver = engine._deliver

        def interrupt_at_first_token(rank, delta):
            deliver(rank, delta)
            if engine._deliver is not deliver:
                engine._deliver = deliver
                signal.pthread_kill(main, signal.SIGINT)

        engine._deliver = interrupt_at_first_token
        with pytest.raises(KeyboardInterrupt):
            pool.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=2000, ignore_eos=True))
        assert engine.requests == {}
        assert len(pool.generate([[4, 5, 6]], GREEDY)[0].token_ids) == 8  # and it still serves


def test_a_shutdown_cancelled_part_way_is_finished_by_the_next(tiny_model):
    """An outer timeout or a second Ctrl-C that cancels ``shutdown`` mid-way must not leave the
    pool half shut: its teardown goes on, and the next ``shutdown`` waits for it to end. The
    no_leaks fixture checks, while the program still runs, that no process or shared-memory
    object is left (the interpreter's exit would remove them, too late for a long-lived service)."""
    import asyncio

    import uvloop

    from lmpool.frontend.api import AsyncLMPool

    async def main():
        pool = AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK)
        await pool.start()
        first = asyncio.ensure_future(pool.shutdown())
        await asyncio.sleep(0)  # one loop round: the first shutdown has begun and waits on its teardown
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await pool.shutdown()
        with pytest.raises(PoolError, match="shut down"):
            await pool.generate([1, 2, 3], GREEDY)

    uvloop.run(main())


def test_a_pool_shut_down_refuses_calls_and_a_restart(tiny_model):
    import uvloop

    with LMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
        pool.generate([[1, 2, 3]], GREEDY)
    for call in (lambda: pool.stats(), lambda: pool.generate([[1, 2, 3]], GREEDY)):
        with pytest.raises(PoolError, match="shut down"):
            call()

    async def restart():
        from lmpool.frontend.api import AsyncLMPool

        again = AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK)
        async with again:
            pass
        with pytest.raises(PoolError, match="shut down and cannot start again"):
            await again.start()

    uvloop.run(restart())  # the no_leaks fixture checks nothing of either start is left
