"""One bad message is that message's failure: random, truncated and ill-typed frames sent
into a live worker's and the control process's rings kill no process, and the pool then
serves exactly the tokens a single engine does; a request too large for the pool's links
is refused up front, alone, with the sizes."""

from __future__ import annotations

import asyncio
import random
from array import array

import msgspec
import numpy as np
import pytest

from lmpool import LLM, SamplingParams
from lmpool.engine.hashing import ROOT_HASH, block_hash
from lmpool.frontend.api import AsyncLMPool
from lmpool.frontend.client import CONTROL_LINK_CAPACITY, WORKER_LINK_CAPACITY
from lmpool.model.make_model import make_model
from lmpool.protocol import AddRequest, LoadReport, WorkerSnapshot
from lmpool.protocol.frontend_worker import pack_ids
from lmpool.protocol.kv_events import BlockStored, KVSnapshot
from lmpool_ipc.frames import frame_size, max_payload

BLOCK = 16
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 900 + 3 for j in range(20 + 9 * i)] for i in range(6)]


@pytest.fixture(autouse=True)
def no_leaks(no_leaks):
    yield


def ids(tokens: list[int]) -> bytes:
    """A prompt's ids as a frontend packs them."""
    return pack_ids(array("q", tokens))


def raw(tokens: list[int]) -> bytes:
    """Ids packed as int32s without the frontend's checks."""
    return np.array(tokens, dtype=np.int32).tobytes()


def bad_frames(seed: int) -> list[bytes]:
    """Random bytes, every cut of a valid request, and well-formed requests of the wrong types."""
    rng = random.Random(seed)
    frames = [rng.randbytes(rng.randrange(0, 300)) for _ in range(150)]
    valid = msgspec.msgpack.encode(AddRequest("never-sent", ids([1, 2, 3]), PARAMS, [], []))
    frames += [valid[:cut] for cut in range(len(valid))]
    # Well-typed, but what a frontend never sends: token ids past the vocabulary or negative, bytes
    # that are not whole int32 ids, outputs past int64, a hash count that does not match the
    # tokens. A worker trusts the frontend's checks, but not so far as to fault its embedding or
    # its cache on such a message.
    frames += [msgspec.msgpack.encode(AddRequest(f"malformed-{i}", prompt, PARAMS, outputs, hashes))
               for i, (prompt, outputs, hashes) in enumerate([
                   (raw([1, 10**6, 3]), [], []), (raw([-1]), [], []), (b"\x01\x02\x03", [], []),
                   (ids([1]), [2**64 - 1], []), (ids([1] * BLOCK), [], []), (ids([1, 2]), [], [bytes(32)])])]
    for params in ({"ignore_eos": 1}, {"ignore_eos": "yes"}, {"temperature": None}, {"max_tokens": True}):
        frames.append(msgspec.msgpack.encode(["add", "ill-typed", [1, 2, 3], params]))
    frames.append(msgspec.msgpack.encode(["add", "bad-prompt", "text, not ids", {}]))
    return frames


def test_bad_frames_into_live_rings_kill_nothing_and_change_no_token(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]

    async def main():
        async with AsyncLMPool(tiny_model, world_size=2, block_size=BLOCK) as pool:
            pids = pool.client.pids()
            for rank in pool.client.ranks:  # frames queue ahead of the requests sent below
                for frame in bad_frames(rank.rank):
                    await rank.channel.send_bytes(frame)
            for frame in bad_frames(99):
                await pool.client._control_channel.send_bytes(frame)
            outs = await asyncio.gather(*(pool.generate(p, PARAMS) for p in PROMPTS))
            stats = await pool.stats()
            assert [o.token_ids for o in outs] == reference
            assert pool.client.pids() == pids
            assert all(r["alive"] for r in stats["ranks"]) and stats["control_restarts"] == 0

    asyncio.run(main())


def test_a_request_too_large_for_the_links_fails_alone(tmp_path):
    """With one-token blocks, 33k prompt tokens make a worker's message (the tokens and their
    block hashes) and a routing query of over 1 MiB: refused with the sizes, and the pool serves
    on, its control process never restarted."""
    model = str(make_model(tmp_path / "long", preset="tiny", overrides={"max_position_embeddings": 65536}))

    async def main():
        async with AsyncLMPool(model, world_size=1, block_size=1, num_kv_blocks=40_000) as pool:
            with pytest.raises(ValueError, match=r"too large to send: its tokens could take \d+ bytes, "
                                                 r"over the \d+-byte limit"):
                await pool.generate([5] * 33_000, PARAMS)
            out = await pool.generate(PROMPTS[0], PARAMS)
            assert len(out.token_ids) == PARAMS.max_tokens
            assert (await pool.stats())["control_restarts"] == 0

    asyncio.run(main())


def test_a_snapshot_of_a_large_cache_fits_the_control_link():
    """256-bit hashes make a worker's snapshot ~86 bytes a block: 100k cached blocks (a
    large GPU with small blocks) still fit one message to the control plane."""
    h = block_hash(ROOT_HASH, [1, 2, 3])
    snapshot = KVSnapshot(1, [BlockStored(h, h, 2**20, 2**20)] * 100_000)
    report = WorkerSnapshot(0, 1, 2**20, snapshot, LoadReport())
    assert len(msgspec.msgpack.encode(report)) <= max_payload(CONTROL_LINK_CAPACITY)


def test_a_burst_of_long_prompts_fits_a_rank_s_link_unread():
    """A worker reads its link only when its loop yields: a hot-context burst's share of one rank (32
    questions over a 16k-token document, ids drawn from a 151k vocabulary) is handed over
    without waiting for it, with room for as many again."""
    rng = random.Random(0)
    doc = [rng.randrange(151_936) for _ in range(16_384)]
    hashes = [block_hash(ROOT_HASH, [i]) for i in range(64)]
    frames = [frame_size(len(msgspec.msgpack.encode(AddRequest(
        str(q), ids(doc + [rng.randrange(151_936) for _ in range(64)]), PARAMS, [], hashes, hashes[-1]))))
        for q in range(32)]
    assert 2 * sum(frames) <= WORKER_LINK_CAPACITY
