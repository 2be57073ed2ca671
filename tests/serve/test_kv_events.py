"""``lmpool serve --kv-events-endpoint``: the pool's KV events, as a ZMQ subscriber outside the
pool sees them. A prompt's complete blocks arrive as vLLM ``BlockStored`` events whose hashes
are the pool's chained block hashes in vLLM's default integer form (their low 64 bits) and
whose token ids are the prompt's; a replay from seq 0 gives the same batches; a snapshot shows
them on the rank that holds them; a worker's death clears its rank."""

from __future__ import annotations

import os
import signal

import httpx
import msgspec
import pytest
import zmq
from serve_process import BLOCK, free_port, start_server, wait_for

from lmpool.engine.hashing import chain_hashes
from lmpool.protocol.vllm_kv_events import event_types, external_block_hash
from lmpool.protocol.vllm_kv_events import END_SEQ, SNAPSHOT_REQUEST

PROMPT = list(range(200, 250))  # three complete blocks of 16 and two tokens
TYPES = event_types(True)
decode = msgspec.msgpack.Decoder(TYPES.batch).decode


@pytest.fixture
def events_server(tiny_model, tmp_path):
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    server = start_server(tiny_model, tmp_path, "--world-size", "2", "--kv-events-endpoint", pub,
                          "--kv-events-replay-endpoint", replay, "--kv-events-topic", "lmpool")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"lmpool")
    sub.connect(pub)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    try:
        yield server, sub, dealer
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
        server.stop()


def ask(dealer, request: bytes) -> list[tuple[int, object]]:
    dealer.send_multipart((b"", request))
    out = []
    while True:
        assert dealer.poll(30_000), "no answer from the replay socket"
        _, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            return out
        out.append((int.from_bytes(seq, "big", signed=True), decode(payload)))


def stored_blocks(batches) -> dict[int, dict[int, list[int]]]:
    """rank -> {block hash: its tokens}, replaying the batches' events in order."""
    state: dict[int, dict[int, list[int]]] = {}
    for batch in batches:
        blocks = state.setdefault(batch.data_parallel_rank, {})
        for event in batch.events:
            if isinstance(event, TYPES.cleared):
                blocks.clear()
            elif isinstance(event, TYPES.removed):
                for h in event.block_hashes:
                    blocks.pop(h, None)
            else:
                for i, h in enumerate(event.block_hashes):
                    blocks[h] = event.token_ids[i * event.block_size:(i + 1) * event.block_size]
    return state


def test_kv_events_follow_the_pool(events_server):
    server, sub, dealer = events_server
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code == 200
    hashes = [external_block_hash(h) for h in chain_hashes(PROMPT, BLOCK)]
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)

    def replayed():
        return stored_blocks(batch for _, batch in ask(dealer, (0).to_bytes(8, "big")))

    # The completion's blocks reach the control plane with the worker's next report.
    wait_for(lambda: any(set(hashes) <= set(blocks) for blocks in replayed().values()), "the prompt's BlockStored")
    state = replayed()
    [rank] = [r for r, blocks in state.items() if set(hashes) <= set(blocks)]
    assert [state[rank][h] for h in hashes] == [PROMPT[i * BLOCK:(i + 1) * BLOCK] for i in range(3)]

    # The live PUB stream carries the same batches as the replay buffer, under the topic.
    second = list(range(300, 340))
    assert httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": second}, timeout=120).status_code == 200
    wanted, frames = {external_block_hash(h) for h in chain_hashes(second, BLOCK)}, []
    while not wanted <= {h for f in frames for e in decode(f[2]).events if isinstance(e, TYPES.stored)
                         for h in e.block_hashes}:
        assert sub.poll(60_000), "the live stream never showed the second prompt's blocks"
        frames.append(sub.recv_multipart())
    assert {f[0] for f in frames} == {b"lmpool"}
    buffered = dict((seq, msgspec.msgpack.encode(batch)) for seq, batch in ask(dealer, (0).to_bytes(8, "big")))
    assert all(buffered[int.from_bytes(f[1], "big")] == f[2] for f in frames)

    snapshot = ask(dealer, SNAPSHOT_REQUEST)
    assert set(hashes) <= set(stored_blocks(batch for _, batch in snapshot)[rank])

    # A worker that dies takes its rank's blocks with it.
    os.kill(server.worker_pid(rank), signal.SIGKILL)
    wait_for(lambda: not stored_blocks(b for _, b in ask(dealer, SNAPSHOT_REQUEST)).get(rank), "the rank's clear")


def test_vllm_s_kv_events_config_json_publishes_the_same_events(tiny_model, tmp_path):
    """``--kv-events-config`` in vLLM's JSON form: its endpoint, replay endpoint and topic."""
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay,
              "topic": "vllm-form", "buffer_steps": 100, "hwm": 1000}
    server = start_server(tiny_model, tmp_path, "--kv-events-config", msgspec.json.encode(config).decode())
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    try:
        body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code == 200
        hashes = {external_block_hash(h) for h in chain_hashes(PROMPT, BLOCK)}
        wait_for(lambda: hashes <= set(stored_blocks(b for _, b in ask(dealer, SNAPSHOT_REQUEST)).get(0, {})),
                 "the prompt's blocks in the snapshot")
    finally:
        dealer.close(linger=0)
        ctx.term()
        server.stop()
