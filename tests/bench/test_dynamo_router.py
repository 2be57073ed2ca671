"""The ``dynamo_kv`` peer (``benchmarks/peers/eval_dynamo.py``): NVIDIA Dynamo's own KV router
(``ai-dynamo-runtime``'s ``SelectionService``) in front of a two-replica CPU pool, reading the
pool's KV events.

Two prefixes are seeded on ranks 0 and 1 by requests pinned there; once Dynamo's index shows
each prefix on its rank (the pool's events are its only source: pinned requests put nothing in
its index), the prefixes' followers, routed by Dynamo, go to the rank holding their prefix and
find it cached there. Every booking is released: Dynamo counts no request, prefill token or
block once the requests ended, including a stream its reader left early. The relay gives each
rank its own stream and replay, byte for byte the pool's batches. Without the package the policy
is unavailable, with the reason, in the suite's record.

After a restart too: a pool restarted on the same KV-event endpoints (a server restarted with the
same flags) with each prefix now on the other rank clears every rank in Dynamo's index (its
start's ``AllBlocksCleared``, relayed from its snapshot) and shows the new placement, which
Dynamo's routing then follows; the relay keeps each rank's sequence growing across the restart,
and a rank the restarted publisher cleared is cleared for its consumer even when the live event
was published before the relay reconnected. A control process the pool replaces (SIGKILLed)
publishes from seq 0 again too: Dynamo keeps the placement and takes what it adds afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys

from benchmarks.peers import eval_dynamo
import msgspec
import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq (the dev extra) carries LMPool's KV events to Dynamo")
import zmq.asyncio  # noqa: E402
from benchmarks.replay.eval_driver import Arrival, replay
from benchmarks.peers.eval_policies import DYNAMO
from benchmarks.replay.eval_settings import Setting
from benchmarks.peers.dynamo_client import DynamoRoutedPool
from benchmarks.peers.kv_event_relay import END_SEQ, RankRelay
from benchmarks.workloads.traces import Tokens, Trace, TraceRequest

from lmpool.control.kv_events.publisher import KVEventPublisher
from lmpool.protocol.vllm_kv_events import event_types
from lmpool.sampling_params import SamplingParams

BLOCK = 8
PREFIX = 5 * BLOCK  # five full blocks in common within a group
TAIL = 6
MAX_TOKENS = 3
POLL_S = 0.05


def dynamo_runs() -> None:
    try:
        eval_dynamo.selection_service()
    except eval_dynamo.DynamoUnavailable as e:
        pytest.skip(f"Dynamo's router is not installed here: {e}")


def suite_args(**kw) -> argparse.Namespace:
    base = {"world_size": 2, "device": "cpu", "block_size": BLOCK, "max_num_seqs": 8, "max_num_batched_tokens": 512,
            "dtype": None, "enforce_eager": False, "cascade_min_saved_tokens": None, "prefill_attention": None,
            "piecewise_graph_max_tokens": None, "run_timeout": 300.0, "transfer_profile": None, "order": "fixed"}
    return argparse.Namespace(**(base | kw))


def moved(seed: Trace) -> Trace:
    """``seed`` with each pinned request on the other rank."""
    requests = tuple(dataclasses.replace(r, rank=1 - r.rank) for r in seed.requests)
    return dataclasses.replace(seed, requests=requests)


def traces(vocab: int) -> tuple[Trace, Trace, dict[str, list[int]]]:
    """The seeding trace (group a's first request pinned to rank 0, group b's to rank 1), the
    followers' trace (three per group, routed by Dynamo), and the groups' prefixes."""
    tokens = Tokens("dynamo-test", 0, vocab)
    prefixes = {g: tokens.draw(PREFIX) for g in "ab"}
    seed = tuple(TraceRequest(i, "seed", g, prefixes[g] + tokens.draw(TAIL), MAX_TOKENS, rank)
                 for i, (g, rank) in enumerate((("a", 0), ("b", 1))))
    follow = tuple(TraceRequest(i, "follow", g, prefixes[g] + tokens.draw(TAIL), MAX_TOKENS, None)
                   for i, g in enumerate("abbaab"))
    return (Trace("dynamo_seed", 0, ("seed",), seed, {}), Trace("dynamo_follow", 0, ("follow",), follow, {}),
            prefixes)


async def device_blocks(service, prompt: list[int]) -> dict[int, int]:
    """Per rank, the blocks of ``prompt`` Dynamo's index holds there."""
    scores = await service.overlap_scores({"token_ids": prompt})
    return {w["dp_rank"]: w["device_blocks"] for w in scores["workers"]}


async def wait_for_index(service, prompt: list[int], rank: int, blocks: int) -> None:
    """Until Dynamo's index shows ``blocks`` of ``prompt`` on ``rank`` (the pool's events reached it)."""
    while (await device_blocks(service, prompt)).get(rank, 0) < blocks:
        await asyncio.sleep(POLL_S)


def new_pool(model: str, args, setting, events=None):
    """An unstarted pool publishing its KV events as ``events`` says (new loopback ports if None)."""
    from benchmarks import eval_suite

    return eval_suite.new_pool(model, args, eval_suite.DYNAMO_POOL, setting, 128,
                               kv_events=events or eval_dynamo.events_config())


async def started_pool(model: str, args, setting, events):
    """A pool publishing its KV events as ``events`` says (a restart on the same endpoints)."""
    return await new_pool(model, args, setting, events).start()


async def under_dynamo(model: str, args, setting, scenario):
    """``scenario(pools, service, relay)`` with a pool started (``pools[0]``) and Dynamo's router
    reading its KV events; a scenario that restarts the pool appends the new one. The last pool
    is shut down on the way out, after the router."""
    events = eval_dynamo.events_config()
    pools = [await started_pool(model, args, setting, events)]
    try:
        async with eval_dynamo.router_on(events, args, setting) as (service, relay):
            return await scenario(pools, service, relay)
    finally:
        await pools[-1].shutdown()


async def wait_for_placement(service, prefixes: dict[str, list[int]], homes: dict[str, int]) -> None:
    """Until Dynamo's index shows each group's prefix whole on its home rank."""
    for group, rank in homes.items():
        await wait_for_index(service, prefixes[group], rank, PREFIX // BLOCK)


def assert_followed(followed: dict, homes: dict[str, int]) -> None:
    for i, group in enumerate(followed["group"]):
        assert followed["rank"][i] == homes[group], f"follower {i} of group {group} left its prefix's rank"
        assert followed["route"][i] == "dynamo_select"
        assert followed["num_cached_tokens"][i] == PREFIX, f"follower {i} missed its prefix's blocks"
        assert followed["output_len"][i] == MAX_TOKENS


def test_dynamo_routes_followers_to_the_rank_holding_their_prefix(tiny_model, no_leaks):
    dynamo_runs()
    from lmpool.model.config import ModelConfig

    seed, follow, prefixes = traces(ModelConfig.from_pretrained(tiny_model).vocab_size)
    args, setting = suite_args(), Setting(kv_blocks=64, arrival=Arrival("window", window=1))

    async def scenario():
        async with eval_dynamo.dynamo_in_front(new_pool(tiny_model, args, setting), args, setting) as front:
            service = front.service
            never_sent = list(range(1, 1 + PREFIX))
            seeded = await replay(front.client, seed, setting.arrival)
            assert seeded["rank"] == [0, 1] and seeded["route"] == ["pinned", "pinned"]
            # Only the pool's KV events can put the seeded prefixes in Dynamo's index.
            for group, rank in (("a", 0), ("b", 1)):
                await wait_for_index(service, prefixes[group], rank, PREFIX // BLOCK)
                assert (await device_blocks(service, prefixes[group])).get(1 - rank, 0) == 0
            assert set((await device_blocks(service, never_sent)).values()) == {0}
            followed = await replay(front.client, follow, setting.arrival)
            booked = eval_dynamo.booked_load(service)
            figures = eval_dynamo.run_figures(front, BLOCK)
            return followed, booked, figures

    followed, booked, figures = asyncio.run(scenario())
    assert_followed(followed, {"a": 0, "b": 1})
    # Every booking released: nothing left counted on any worker once the requests ended.
    assert booked == {"active_requests": 0, "prefill_tokens": 0, "decode_blocks": 0}
    assert figures["booked_after"] == booked
    assert figures["selected"] == len(follow.requests) and figures["pinned"] == len(seed.requests)
    total = len(follow.requests) + len(seed.requests)
    assert figures["prefill_completed"] == figures["freed"] == total
    assert all(n > 0 for n in figures["forwarded"])  # each rank's own stream carried its events


def test_after_a_pool_restart_dynamo_drops_the_old_placement_and_follows_the_new(tiny_model, no_leaks):
    """Prefix a on rank 0 and b on rank 1 in Dynamo's index; the pool stops and a new one starts
    on the same KV-event endpoints, where a is seeded on rank 1 and b on rank 0. Once the index
    shows the new placement, it holds nothing of the old: each rank's stream delivered the
    restart's clear before the new blocks (one listener per rank applies its stream in order). The
    followers, routed by Dynamo, go to the prefixes' new ranks and find them cached."""
    dynamo_runs()
    from lmpool.model.config import ModelConfig

    seed, follow, prefixes = traces(ModelConfig.from_pretrained(tiny_model).vocab_size)
    args, setting = suite_args(), Setting(kv_blocks=64, arrival=Arrival("window", window=1))
    before, after = {"a": 0, "b": 1}, {"a": 1, "b": 0}

    async def scenario(pools, service, relay):
        await replay(DynamoRoutedPool(pools[0], service, 2), seed, setting.arrival)
        await wait_for_placement(service, prefixes, before)
        await pools[0].shutdown()
        pools.append(await started_pool(tiny_model, args, setting, pools[0].config.kv_events))
        client = DynamoRoutedPool(pools[1], service, 2)
        reseeded = await replay(client, moved(seed), setting.arrival)
        assert reseeded["rank"] == [1, 0] and reseeded["num_cached_tokens"] == [0, 0]  # a new pool
        await wait_for_placement(service, prefixes, after)
        stale = {g: (await device_blocks(service, prefixes[g])).get(before[g], 0) for g in "ab"}
        followed = await replay(client, follow, setting.arrival)
        return stale, followed, relay.resyncs, eval_dynamo.booked_load(service)

    stale, followed, resyncs, booked = asyncio.run(under_dynamo(tiny_model, args, setting, scenario))
    assert stale == {"a": 0, "b": 0}, "Dynamo's index kept blocks of the pool before the restart"
    assert resyncs >= 1  # the relay took the restarted pool's snapshot
    assert_followed(followed, after)
    assert booked == {"active_requests": 0, "prefill_tokens": 0, "decode_blocks": 0}


def test_after_a_control_process_restart_dynamo_follows_the_new_publisher(tiny_model, no_leaks):
    """The control process is SIGKILLed and the pool restarts it: its publisher binds the same
    endpoints and numbers from 0 again, then publishes what the workers still hold (each rank's
    snapshot: cleared, then its blocks). Dynamo's index keeps the placement it had (a on rank 0,
    b on rank 1) and takes what the new publisher adds: a prefix c seeded on rank 0 afterwards,
    whose batches carry seqs Dynamo's listeners had already passed, and which Dynamo then routes
    c's followers to."""
    dynamo_runs()
    from lmpool.model.config import ModelConfig

    vocab = ModelConfig.from_pretrained(tiny_model).vocab_size
    seed, _, prefixes = traces(vocab)
    tokens = Tokens("dynamo-test-c", 0, vocab)
    prefixes["c"] = tokens.draw(PREFIX)
    seed_c = Trace("dynamo_seed_c", 0, ("seed",), (TraceRequest(0, "seed", "c", prefixes["c"] + tokens.draw(TAIL),
                                                                MAX_TOKENS, 0),), {})
    follow_c = Trace("dynamo_follow_c", 0, ("follow",), tuple(
        TraceRequest(i, "follow", "c", prefixes["c"] + tokens.draw(TAIL), MAX_TOKENS, None) for i in range(3)), {})
    args, setting = suite_args(), Setting(kv_blocks=64, arrival=Arrival("window", window=1))

    async def scenario(pools, service, relay):
        pool = pools[0]
        client = DynamoRoutedPool(pool, service, 2)
        await replay(client, seed, setting.arrival)
        await wait_for_placement(service, prefixes, {"a": 0, "b": 1})
        old = pool.client.control_proc.pid
        os.kill(old, signal.SIGKILL)
        # The pool replaces a control process it finds dead, as a query finds it.
        while (await pool.stats())["control_pid"] == old:
            await asyncio.sleep(POLL_S)
        await replay(client, seed_c, setting.arrival)
        await wait_for_placement(service, prefixes, {"c": 0})
        kept = {g: await device_blocks(service, prefixes[g]) for g in "ab"}
        followed = await replay(client, follow_c, setting.arrival)
        return kept, followed, relay.resyncs

    kept, followed, resyncs = asyncio.run(under_dynamo(tiny_model, args, setting, scenario))
    assert kept == {"a": {0: PREFIX // BLOCK, 1: 0}, "b": {0: 0, 1: PREFIX // BLOCK}}
    assert resyncs >= 1
    assert_followed(followed, {"c": 0})


def test_a_booking_moves_at_the_first_token_and_is_freed_however_the_stream_ends(tiny_model, no_leaks):
    """Dynamo's lifecycle on one request: booked (prefill and blocks) when routed; at its first
    token its prefill leaves the load and its blocks stay; at its end nothing stays. A reader
    that leaves a stream early frees its booking too."""
    dynamo_runs()
    args, setting = suite_args(), Setting(kv_blocks=64, arrival=Arrival())
    prompt = list(range(100, 100 + 4 * BLOCK + 3))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def scenario():
        async with eval_dynamo.dynamo_in_front(new_pool(tiny_model, args, setting), args, setting) as front:
            client, service = front.client, front.service
            seen = []
            async for out in client.stream(prompt, params):
                seen.append(eval_dynamo.booked_load(service))
            after = eval_dynamo.booked_load(service)
            stream = client.stream(prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
            await anext(stream)
            left_open = eval_dynamo.booked_load(service)
            await stream.aclose()  # the reader leaves: the pool aborts the request, Dynamo frees it
            return seen, after, left_open, eval_dynamo.booked_load(service), client

    seen, after, left_open, closed, client = asyncio.run(scenario())
    blocks = len(prompt) // BLOCK  # Dynamo books a prompt's complete blocks
    assert seen[0] == {"active_requests": 1, "prefill_tokens": 0, "decode_blocks": blocks}
    assert after == closed == {"active_requests": 0, "prefill_tokens": 0, "decode_blocks": 0}
    assert left_open["active_requests"] == 1
    assert client.selected == client.prefill_completed == client.freed == 2


def test_an_absent_dynamo_package_makes_the_policy_unavailable(monkeypatch):
    """No substitute rule runs under Dynamo's name: the run and the policy are ``unavailable``,
    with the reason, and the policy's record says why too."""
    from benchmarks import eval_suite

    monkeypatch.setitem(sys.modules, "dynamo.llm", None)  # import dynamo.llm now fails
    setting = Setting(kv_blocks=8, arrival=Arrival())
    with pytest.raises(eval_suite.PolicyUnavailable, match="ai-dynamo-runtime is not installed"):
        asyncio.run(eval_suite.run_one("unused", suite_args(), DYNAMO, traces(16)[0], setting, 128, None))
    record = DYNAMO.record()
    assert record["runner"] == "dynamo" and "not a reimplementation" in record["implementation"]
    assert "ai-dynamo-runtime" in record["dynamo"]["error"] and record["dynamo"]["router_config"] is None

    state, failures = {"status": "ok", "error": None}, {DYNAMO.name: 0}
    cell = {"key": "dynamo_seed", "trace": traces(16)[0], "setting": setting, "position": 0}
    run = asyncio.run(eval_suite._run_policy(suite_args(), "unused", DYNAMO, cell, 0, 128, state, failures,
                                             eval_suite.Progress(1, False)))
    assert run["status"] == state["status"] == "unavailable"
    assert "ai-dynamo-runtime" in run["error"] and failures[DYNAMO.name] == 0


async def test_the_relay_gives_each_rank_its_own_stream_and_replay():
    """The pool's one stream becomes one per rank, each numbered from 0, live to a subscriber
    and replayable, every payload the pool's own bytes. Forwarding waits for a subscriber on
    every rank, then starts with what the pool published before (from the pool's replay socket),
    so a subscriber sees its rank's stream from seq 0; batches of no rank of the pool go nowhere."""
    decode = msgspec.msgpack.Decoder(event_types(True).batch).decode
    publisher = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0").start()
    publisher.stored(0, [11, 12], None, list(range(8)), 4)
    publisher.flush()
    publisher.stored(1, [21], None, [9] * 4, 4)
    publisher.flush()
    relay = await RankRelay(publisher.endpoint, publisher.replay_endpoint, 2).start()
    ctx = zmq.asyncio.Context()
    subs, dealers = [ctx.socket(zmq.SUB) for _ in range(2)], [ctx.socket(zmq.DEALER) for _ in range(2)]
    try:
        for rank in range(2):
            subs[rank].setsockopt(zmq.SUBSCRIBE, b"")
            subs[rank].connect(relay.endpoints[rank])
            dealers[rank].connect(relay.replay_endpoints[rank])
        await relay.subscribed()  # both subscriptions reached the relay: forwarding starts
        for rank, hashes in ((0, [13]), (1, [22]), (0, [14])):
            publisher.stored(rank, hashes, None, [rank] * 4, 4)
            publisher.flush()
        while sum(relay.forwarded) < 5:
            publisher.cleared(99)  # a batch of no rank here: any the relay missed shows as a gap
            publisher.flush()
            await asyncio.sleep(POLL_S)
        assert relay.forwarded == [3, 2] and relay.lost == 0
        payloads = [p for _, p in publisher._buffer if decode(p).data_parallel_rank in (0, 1)]
        for rank in range(2):
            mine = [p for p in payloads if decode(p).data_parallel_rank == rank]
            live = [await subs[rank].recv_multipart() for _ in mine]
            assert [(int.from_bytes(f[1], "big"), f[2]) for f in live] == list(enumerate(mine))
            await dealers[rank].send_multipart((b"", (0).to_bytes(8, "big")))
            replayed = []
            while (frames := await dealers[rank].recv_multipart())[1] != END_SEQ:
                replayed.append((int.from_bytes(frames[1], "big"), frames[2]))
            assert replayed == list(enumerate(mine))  # its own numbering from 0, the pool's bytes
        assert relay.replays_served == [1, 1]
    finally:
        for sock in (*subs, *dealers):
            sock.close(linger=0)
        ctx.term()
        await relay.aclose()
        publisher.close()


def apply(state: dict[int, set], batch) -> None:
    """A consumer's view of one rank: its blocks' hashes after ``batch``."""
    for event in batch.events:
        if isinstance(event, TYPES.cleared):
            state.clear()
        elif isinstance(event, TYPES.stored):
            state.update(event.block_hashes)
        else:
            state.difference_update(event.block_hashes)


TYPES = event_types(True)


async def test_the_relay_follows_a_publisher_restarted_on_its_endpoints():
    """The pool's publisher stops and a new one binds its endpoints, numbering from 0 again; it
    clears both ranks and stores rank 0's new block before the relay has reconnected (those live
    batches are lost to the relay). The relay resynchronises from the new publisher's snapshot:
    each rank's consumer, applying its stream in order, ends with exactly the new publisher's
    blocks (the old ones cleared, rank 1's too, though it holds none now), every rank's sequence
    consecutive from 0 across the restart."""
    decode = msgspec.msgpack.Decoder(TYPES.batch).decode
    first = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0").start()
    endpoints = (first.endpoint, first.replay_endpoint)
    first.stored(0, [11], None, [0] * 4, 4)
    first.stored(1, [21], None, [1] * 4, 4)
    first.flush()
    relay = await RankRelay(*endpoints, 2).start()
    ctx = zmq.asyncio.Context()
    subs = [ctx.socket(zmq.SUB) for _ in range(2)]
    second = None
    try:
        for rank in range(2):
            subs[rank].setsockopt(zmq.SUBSCRIBE, b"")
            subs[rank].connect(relay.endpoints[rank])
        await relay.subscribed()
        received: list[list] = [[await subs[rank].recv_multipart()] for rank in range(2)]  # the first's blocks
        first.close()
        first, second = None, KVEventPublisher(*endpoints).start()
        for rank in range(2):
            second.cleared(rank)
        second.stored(0, [12], None, [2] * 4, 4)
        second.flush()
        while relay.resyncs == 0:  # the relay reconnected and took the snapshot
            await asyncio.sleep(POLL_S)
        second.stored(0, [13], 12, [3] * 4, 4)  # live after the resync: a last batch on each rank
        second.stored(1, [22], None, [4] * 4, 4)
        second.flush()
        states: list[set] = [set(), set()]
        for rank, last in ((0, 13), (1, 22)):
            while True:
                received[rank].append(frames := await subs[rank].recv_multipart())
                batch = decode(frames[2])
                if any(isinstance(e, TYPES.stored) and last in e.block_hashes for e in batch.events):
                    break
            for frames in received[rank]:
                apply(states[rank], decode(frames[2]))
            assert [int.from_bytes(f[1], "big") for f in received[rank]] == list(range(len(received[rank])))
        assert states == [{12, 13}, {22}]
    finally:
        for sock in subs:
            sock.close(linger=0)
        ctx.term()
        await relay.aclose()
        for publisher in (first, second):
            if publisher is not None:
                publisher.close()


def test_dynamo_runs_in_front_of_a_kept_pool_reset_to_publish_its_events(tiny_model, no_leaks):
    """The suite's kept pool serves Dynamo's run too: reset to round robin with KV events on, it
    shows Dynamo empty caches (the run before it left none), the seeds then fill them and the
    followers go where their prefixes are; a reset turns the events off again."""
    dynamo_runs()
    from benchmarks import eval_suite
    from lmpool.model.config import ModelConfig

    seed, follow, prefixes = traces(ModelConfig.from_pretrained(tiny_model).vocab_size)
    args, setting = suite_args(), Setting(kv_blocks=64, arrival=Arrival("window", window=1))

    async def scenario():
        pool = await eval_suite.new_pool(tiny_model, args, eval_suite.DYNAMO_POOL, setting, 128, kept=True).start()
        try:
            await replay(pool, seed, setting.arrival)  # the run before: its cache is the reset's to empty
            await pool.reset(routing="round_robin", transfer_mode="none", kv_events=eval_dynamo.events_config())
            async with eval_dynamo.dynamo_on(pool, args, setting) as front:
                empty = [await device_blocks(front.service, prefixes[g]) for g in ("a", "b")]
                await replay(front.client, seed, setting.arrival)
                await wait_for_placement(front.service, prefixes, {"a": 0, "b": 1})
                followed = await replay(front.client, follow, setting.arrival)
            await pool.reset(kv_events=None)
            return empty, followed, pool.config.kv_events
        finally:
            await pool.shutdown()

    empty, followed, events = asyncio.run(scenario())
    assert all(set(blocks.values()) <= {0} for blocks in empty)
    assert_followed(followed, {"a": 0, "b": 1})
    assert events is None
