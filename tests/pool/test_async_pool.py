"""AsyncLMPool inside an application's running loop: streaming, cancellation, request ids."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from lmpool import LLM, SamplingParams
from lmpool.frontend.api import AsyncLMPool

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def expected(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        return llm.generate(PROMPT, GREEDY)[0].token_ids


def run(coro):
    """Run on uvloop, as an application would."""
    return uvloop.run(coro)


def test_stream_yields_token_by_token(tiny_model, expected):
    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
            seen = [out async for out in pool.stream(PROMPT, GREEDY)]
            whole = await pool.generate(PROMPT, GREEDY)
        return seen, whole

    seen, whole = run(main())
    assert [len(o.token_ids) for o in seen] == list(range(1, 7))
    assert seen[-1].token_ids == expected == whole.token_ids
    assert seen[-1].finish_reason == "length" and all(o.finish_reason is None for o in seen[:-1])


def test_cancelling_a_stream_aborts_the_request(tiny_model):
    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
            long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            first_token = asyncio.Event()

            async def consume():
                async for _ in pool.stream(PROMPT, long, request_id="to-cancel"):
                    first_token.set()

            task = asyncio.create_task(consume())
            await first_token.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert "to-cancel" not in pool.client.requests
            # The worker dropped it: the same id can be used again and the pool still serves.
            out = await pool.generate(PROMPT, GREEDY, request_id="to-cancel")
            return out

    assert len(run(main()).token_ids) == 6


def test_duplicate_request_id_refused_and_unknown_abort_is_noop(tiny_model):
    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            req = await pool.submit(PROMPT, long, request_id="dup")
            with pytest.raises(ValueError, match="already in use"):
                await pool.submit(PROMPT, GREEDY, request_id="dup")
            await pool.abort("no-such-request")
            await pool.abort("dup")
            assert req.finish_reason == "abort"
            return await pool.generate(PROMPT, GREEDY)

    assert len(run(main()).token_ids) == 6


def test_thousand_concurrent_streams_all_finish(tiny_model):
    """Every stream ends with its full output while a 10 ms timer keeps ticking in the loop
    (its lag is printed; the latency goal lives in benchmarks/test_bench_pool.py)."""

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
            lags = []
            stop = asyncio.Event()

            async def ticker():
                loop = asyncio.get_running_loop()
                while not stop.is_set():
                    start = loop.time()
                    await asyncio.sleep(0.01)
                    lags.append(loop.time() - start - 0.01)

            async def one(i):
                params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
                return [o async for o in pool.stream([i % 900 + 1, 7, 9], params)][-1]

            tick = asyncio.create_task(ticker())
            outs = await asyncio.gather(*(one(i) for i in range(1000)))
            stop.set()
            await tick
            return outs, lags

    outs, lags = run(main())
    assert len(outs) == 1000 and all(len(o.token_ids) == 3 for o in outs)
    lags.sort()
    print(f"timer lag p50 {lags[len(lags) // 2] * 1e3:.1f} ms, p99 {lags[int(len(lags) * 0.99)] * 1e3:.1f} ms")


def test_route_reservations_end_when_their_rank_reports_the_admission(tiny_model):
    """A reservation is keyed by the dispatch the worker reports admitted: it ends with that
    report, not with its time-to-live (600 s here, far beyond the wait)."""
    from lmpool.config import RoutingConfig

    import pool_waits

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK,
                               routing_config=RoutingConfig(reservation_ttl_s=600)) as pool:
            outs = await asyncio.gather(*(pool.generate([3 + i] * 40, GREEDY) for i in range(6)))
            stats = await pool_waits.settled(pool, lambda s: s["transfers"]["reservations"] == 0,
                                             "every reservation released by its admission")
            return outs, stats

    outs, stats = uvloop.run(main())
    assert all(len(o.token_ids) == 6 for o in outs)
    assert stats["transfers"]["reservations"] == 0


def test_a_routing_failure_names_the_callers_request_and_forgets_it(tiny_model):
    """The control plane routes by the pool's internal dispatch id; when it cannot route
    (here: it answers as if it believed every rank dead), the error names the caller's id,
    and the request leaves no trace, so its id can be used again."""
    from lmpool.frontend.client import PoolError
    from lmpool.protocol import RouteQuery

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
            engine = pool.client
            real = engine.control_request

            async def refuse_routes(msg):
                if isinstance(msg, RouteQuery):
                    raise PoolError("control plane: NoAliveRankError: no alive rank to route the request to")
                return await real(msg)

            engine.control_request = refuse_routes
            with pytest.raises(PoolError) as failure:
                await pool.generate(PROMPT, GREEDY, request_id="caller-7")
            left = dict(engine.requests)
            engine.control_request = real
            again = await pool.generate(PROMPT, GREEDY, request_id="caller-7")
            return str(failure.value), left, again

    message, left, again = run(main())
    assert message.startswith("request 'caller-7' could not be routed: ") and "no alive rank" in message
    assert left == {} and len(again.token_ids) == 6


def test_the_predicted_ttft_counts_the_wait_before_the_route(tiny_model):
    """A route prices the time from itself to the first token; the request's predicted TTFT adds
    what it waited before the route, which counts in its measured TTFT too."""
    import time

    from lmpool.protocol import RouteQuery

    waited = 5.0  # a submission this long before the route

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
            engine = pool.client
            real, prices = engine.control_request, []

            async def priced(msg):
                answer = await real(msg)
                if isinstance(msg, RouteQuery):
                    prices.append(answer.predicted_ttft_s)
                return answer

            engine.control_request = priced
            req = engine.prepare("late", PROMPT, GREEDY, arrival=time.monotonic() - waited)
            await engine.launch(req)
            while await req.queue.get() is not None:
                pass
            return req.predicted_ttft_s, prices

    predicted, prices = run(main())
    (price,) = prices
    assert price is not None and price > 0
    assert predicted >= waited + price


def test_a_request_s_prompt_in_flight_is_nothing_the_collector_walks(tiny_model):
    """The pool holds a request's prompt as a tuple of ints, which the collector stops tracking at
    its first look (a list of a long prompt is walked, element by element, at every collection of
    its generation while the request lives); the caller still gets its ids as a list."""
    import gc

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
            req = pool.client.prepare("held", PROMPT, GREEDY)
            gc.collect()
            tracked = gc.is_tracked(req.prompt_token_ids)
            await pool.client.launch(req)
            while await req.queue.get() is not None:
                pass
            return tracked, await pool.generate(PROMPT, GREEDY)

    tracked, out = run(main())
    assert not tracked
    assert out.prompt_token_ids == PROMPT and isinstance(out.prompt_token_ids, list)


def test_a_request_carries_its_route_s_group_to_its_worker(tiny_model):
    """The frontend passes the group its route named (``RouteDecision.group``) on to the worker in
    the ``AddRequest``, which counts the request under it (``LoadReport.group_heads``)."""
    import msgspec

    from lmpool.protocol import AddRequest, RouteQuery

    group = b"g" * 32

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
            engine = pool.client
            real_route, real_send, sent = engine.control_request, engine._send_to_rank, []

            async def grouped(msg):
                answer = await real_route(msg)
                return msgspec.structs.replace(answer, group=group) if isinstance(msg, RouteQuery) else answer

            async def send(rank, msg):
                if isinstance(msg, AddRequest):
                    sent.append(msg)
                return await real_send(rank, msg)

            engine.control_request, engine._send_to_rank = grouped, send
            out = await pool.generate(PROMPT, GREEDY)
            return out, sent

    out, sent = run(main())
    assert len(out.token_ids) == 6
    assert [msg.group for msg in sent] == [group]


def test_a_stop_string_ends_a_stream_and_partial_texts_never_show_it(tiny_model):
    """The pool ends a request at its first stop string, as ``LLM`` does: the last output's
    text stops before it, every earlier output's text leads up to that one, and the request
    is gone from its rank. The synchronous API honours stop strings too."""
    prompt = "The harbour town woke slowly"
    free = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLM(tiny_model, block_size=BLOCK) as llm:
        full = llm.generate(prompt, free)[0]
    start = next(i for i in range(4, len(full.text) - 3) if full.text[i:i + 3].strip()
                 and full.text.find(full.text[i:i + 3]) == i)
    stop = full.text[start:start + 3]
    stopping = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=stop)

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
            seen = [out async for out in pool.stream(prompt, stopping, request_id="stops")]
            assert "stops" not in pool.client.requests
            return seen, await pool.generate(prompt, free)

    seen, after = run(main())
    last = seen[-1]
    assert last.finish_reason == "stop" and last.text == full.text[:start]
    assert len(last.token_ids) < len(full.token_ids) and last.token_ids == full.token_ids[:len(last.token_ids)]
    assert all(last.text.startswith(o.text) for o in seen[:-1])
    assert after.token_ids == full.token_ids, "the pool still serves whole requests"
    from lmpool.frontend.api import LMPool

    with LMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
        outs = pool.generate([prompt, prompt], [stopping, free])
    assert (outs[0].finish_reason, outs[0].text) == ("stop", full.text[:start])
    assert outs[1].text == full.text


def test_chat_in_a_pool_gives_what_one_engine_gives(tiny_model):
    talk = [{"role": "user", "content": "Name a harbour town."}]
    with LLM(tiny_model, block_size=BLOCK) as llm:
        expected = llm.chat(talk, GREEDY)[0]

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
            one = await pool.chat(talk, GREEDY, rank=1)
            streamed = [o async for o in pool.stream(pool.encode_chat(talk), GREEDY)]
            return one, streamed[-1]

    one, streamed = run(main())
    assert one.prompt_token_ids == expected.prompt_token_ids and one.token_ids == expected.token_ids
    assert one.rank == 1 and streamed.token_ids == expected.token_ids
    from lmpool.frontend.api import LMPool

    with LMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
        both = pool.chat([talk, talk], GREEDY)
        with pytest.raises(ValueError, match="conversation 1: a conversation is a non-empty list"):
            pool.chat([talk, []], GREEDY)
    assert [o.token_ids for o in both] == [expected.token_ids] * 2


def test_the_synchronous_pool_serves_code_that_runs_inside_an_event_loop(tiny_model):
    """An ``async def`` (or a notebook's cell, which runs on its kernel's loop) may use the
    synchronous ``LMPool``: its checks run on the caller's thread, whose loop is not the pool's."""
    from lmpool.frontend.api import LMPool

    with LLM(tiny_model, block_size=BLOCK) as llm:
        expected = llm.generate([[1, 2, 3]], GREEDY)[0].token_ids

    async def cell():
        with LMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
            return pool.generate([[1, 2, 3]], GREEDY)[0].token_ids

    assert run(cell()) == expected


def test_a_pool_not_started_has_no_id_yet(tiny_model):
    from lmpool.frontend.client import PoolError

    pool = AsyncLMPool(tiny_model, world_size=2, device="cpu")
    with pytest.raises(PoolError, match="not started"):
        _ = pool.pool_id
