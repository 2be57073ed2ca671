"""The gloo transport (``lmpool/dataplane/gloo.py``, ``transport.py``).

Peer processes (``transfer_peer.py``) build deterministic KV caches, pack the source
blocks, send them and unpack what they receive; the test recomputes, from the same seeds,
the exact bytes every destination cache must hold. Sequencing between processes goes
through their stdin/stdout lines, never sleeps. Tests in one process put both ends of a
pair in it (each end is its own gloo group with its own sockets).
"""

from __future__ import annotations

import re
import threading

import pytest
import torch

from lmpool.ops.reference import pack_kv
from lmpool.dataplane import (
    TAG_LIMIT,
    GlooTransport,
    TransferTimeout,
    TransportError,
    kind_for_devices,
    make_transport,
    plan_tag,
)
from lmpool.dataplane.rendezvous import open_store
from lmpool.frontend.rendezvous import Rendezvous
from transfer_testkit import Peer, block_ids, digest, expected_cache, make_cache, process_gone

SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


def connect_all(rank: int, world: int, session: int = 1) -> list[dict]:
    return [{"connect": p, "session": session} for p in range(world) if p != rank] + [{"connected": 20}]


def ops_of(rank: int, transfers: list[dict], reverse_recvs: bool = False) -> list[tuple[str, dict]]:
    """The transfers ``rank`` starts, in order: its sends, then its receives."""
    sends = [("send", t) for t in transfers if t["src"] == rank]
    recvs = [("recv", t) for t in transfers if t["dst"] == rank]
    return sends + (recvs[::-1] if reverse_recvs else recvs)


def script_for(rank: int, world: int, ops: list[tuple[str, dict]]) -> list[dict]:
    steps = [{op: t["dst"] if op == "send" else t["src"], "tag": t["tag"], "blocks": t["blocks"], "seed": t["seed"]}
             for op, t in ops]
    return connect_all(rank, world) + steps + [{"wait": 20}]


def check_received(peer: Peer, ops: list[tuple[str, dict]], dtype: str = "float32") -> None:
    """The peer's ``wait`` output: every receive holds the source's packed bytes, and the
    whole cache is the initial one with the payloads unpacked in order (no other block moved)."""
    for op, t in ops:
        line = peer.line()
        if op == "send":
            assert line == {"sent": t["tag"]}
        else:
            src_ids, _ = block_ids(t["seed"], t["blocks"])
            assert line == {"received": t["tag"], "digest": digest(pack_kv(make_cache(t["src"], dtype=dtype), src_ids))}
    received = [t for op, t in ops if op == "recv"]
    assert peer.expect("cache")["cache"] == expected_cache(peer.rank, received, dtype)


# ---- between processes ---------------------------------------------------------------


def test_every_size_in_both_directions_at_once(rendezvous, peers):
    """Both ranks start all their sends and receives before waiting on any: 1..128 blocks
    each way, the same tags in both directions, and rank 1 posting its receives in the
    opposite order to rank 0's sends."""
    transfers = [{"src": s, "dst": 1 - s, "tag": 100 + n, "blocks": n, "seed": 10 * n + s}
                 for n in SIZES for s in (0, 1)]
    ops = [ops_of(rank, transfers, reverse_recvs=rank == 1) for rank in (0, 1)]
    for rank in (0, 1):
        peers.append(Peer(rendezvous, rank, 2, script_for(rank, 2, ops[rank])))
    for p in peers:
        p.expect("connected")
        check_received(p, ops[p.rank])
        last = p.finish()
        assert last["pending"] == 0 and last["threads"] == 1  # close() left no thread behind


def test_four_ranks_several_pairs_at_once(rendezvous, peers):
    """Every rank sends to and receives from several peers concurrently (bfloat16 caches,
    moved as raw bytes); overlapping destination ids are unpacked in script order."""
    pairs = [(0, 1), (1, 0), (2, 3), (3, 2), (0, 2), (2, 0), (3, 1), (1, 3), (0, 3), (1, 2)]
    transfers = [{"src": s, "dst": d, "tag": plan_tag(7 * i + 2**40), "blocks": SIZES[i % len(SIZES)],
                  "seed": 500 + i} for i, (s, d) in enumerate(pairs)]
    ops = [ops_of(rank, transfers) for rank in range(4)]
    for rank in range(4):
        peers.append(Peer(rendezvous, rank, 4, script_for(rank, 4, ops[rank]), dtype="bfloat16"))
    for p in peers:
        p.expect("connected")
    for p in peers:
        check_received(p, ops[p.rank], dtype="bfloat16")
        assert p.finish()["threads"] == 1


@pytest.mark.parametrize("survivor_op", ["recv", "send"])
def test_killed_peer_fails_the_survivor_fast_and_a_restarted_peer_reconnects(rendezvous, peers, survivor_op):
    """Rank 1 is SIGKILLed while rank 0 has a 128-block transfer pending with it (and rank
    1 one of its own, the other way). Rank 0's wait must raise TransportError well within
    its 5 s timeout; then a new rank-1 process and rank 0 reconnect under a new session
    and a transfer succeeds."""
    big = {"blocks": 128, "seed": 77}
    survivor = connect_all(0, 2) + [
        {survivor_op: 1, "tag": 5, **big}, {"say": "posted"}, {"hear": None}, {"fail": 5},
        {"hear": None}, {"connect": 1, "session": 2}, {"connected": 20},
        {"recv": 1, "tag": 6, "blocks": 4, "seed": 78}, {"wait": 20},
    ]
    victim = connect_all(1, 2) + [
        {"send" if survivor_op == "send" else "recv": 0, "tag": 9, **big}, {"say": "posted"}, {"hear": None},
    ]
    peers.append(Peer(rendezvous, 0, 2, survivor))
    peers.append(Peer(rendezvous, 1, 2, victim))
    for p in peers:
        p.expect("connected")
        p.expect("say")
    victim_pid = peers[1].proc.pid
    peers[1].kill()
    assert process_gone(victim_pid)
    peers[0].tell()
    failure = peers[0].expect("failed")
    # Not its timeout: that would be a TransferTimeout saying so, after 5 s.
    assert failure["error"] == "TransportError", failure
    # gloo words a vanished peer as it met it: a closed connection, a reset, a broken pipe.
    assert re.search("closed by peer|reset by peer|Broken pipe", failure["message"]), failure

    restarted = connect_all(1, 2, session=2)[:-1] + [{"connected": 20}, {"send": 0, "tag": 6, "blocks": 4, "seed": 78},
                                                     {"wait": 20}]
    peers.append(Peer(rendezvous, 1, 2, restarted, incarnation=1))
    peers[0].tell()
    peers[0].expect("connected")
    received = peers[0].expect("received")
    src_ids, _ = block_ids(78, 4)
    assert received["digest"] == digest(pack_kv(make_cache(1, incarnation=1), src_ids))
    assert peers[0].expect("cache")["cache"] == expected_cache(
        0, [{"src": 1, "blocks": 4, "seed": 78}], src_incarnations={1: 1}
    )
    assert [peers[2].line() for _ in range(2)] == [{"connected": 1}, {"sent": 6}]
    peers[2].expect("cache")
    for p in (peers[0], peers[2]):
        assert p.finish()["threads"] == 1


# ---- in one process ------------------------------------------------------------------


def test_transfer_started_before_the_connection_is_up(rendezvous):
    a = GlooTransport(rendezvous, 0, 2)
    b = GlooTransport(rendezvous, 1, 2)
    connecting = a.connect(1, 3)
    payload = pack_kv(make_cache(0, dtype="float16"), block_ids(1, 8)[0])
    sent = a.send(1, payload, tag=4)  # queued until rank 1 joins
    assert not sent.done()
    b.connect(0, 3).wait(10)
    out = torch.empty_like(payload)
    b.recv(0, out, tag=4).wait(10)
    sent.wait(10)
    connecting.wait(10)
    assert sent.done() and torch.equal(out.view(torch.uint8), payload.view(torch.uint8))
    a.close()
    b.close()


def test_size_mismatch_fails_both_ends_and_the_process_survives(pair):
    """gloo aborts the process when a payload exceeds the posted receive; the size
    preamble turns that into a TransportError on both ends."""
    a, b = pair
    sent = a.send(1, torch.ones(100), tag=4)
    received = b.recv(0, torch.empty(50), tag=4)
    with pytest.raises(TransportError, match="sent 400 bytes on tag 4, 200 were expected"):
        received.wait(5)
    with pytest.raises(TransportError, match="failed"):
        sent.wait(5)
    with pytest.raises(TransportError, match="is broken .* connect again with a new session"):
        a.send(1, torch.ones(1), tag=5)


def test_expired_wait_breaks_the_pair_on_both_ends_and_a_new_session_recovers(pair):
    a, b = pair
    waiting = a.recv(1, torch.empty(10), tag=1)  # rank 1 never sends it
    other = b.recv(0, torch.empty(10), tag=2)  # and rank 0 never sends this one
    with pytest.raises(TransferTimeout, match="did not complete within 0.3s"):
        waiting.wait(0.3)
    # The other end learns of it from the closed connection (its own expiry would be a
    # TransferTimeout, not this).
    with pytest.raises(TransportError, match="closed"):
        other.wait(60)
    with pytest.raises(TransportError, match="broken"):
        b.send(0, torch.ones(1), tag=3)
    for h in (a.connect(1, 2), b.connect(0, 2)):
        h.wait(10)
    x = torch.arange(10.0)
    out = torch.empty(10)
    handles = [a.send(1, x, tag=1), b.recv(0, out, tag=1)]  # tag 1 is free again
    for h in handles:
        h.wait(5)
    assert torch.equal(out, x)
    assert a.pending() == b.pending() == 0


def test_close_fails_pending_transfers_and_stops_every_thread(rendezvous):
    # This test's threads, not a count: one an earlier test left to end (a rendezvous thread
    # serving an expired wait) may end meanwhile. gloo's own I/O threads are not Python threads.
    before = set(threading.enumerate())
    a = GlooTransport(rendezvous, 0, 2)
    b = GlooTransport(rendezvous, 1, 2)
    for h in (a.connect(1, 1), b.connect(0, 1)):
        h.wait(10)
    pending = a.recv(1, torch.empty(4), tag=1)
    queued_peerless = GlooTransport(rendezvous, 0, 3, timeout_s=0.5)
    queued_peerless.connect(2, 1)
    queued = queued_peerless.send(2, torch.ones(4), tag=1)
    a.close()
    queued_peerless.close()
    with pytest.raises(TransportError, match="transport closed"):
        pending.wait(2)
    with pytest.raises(TransportError, match="transport closed"):
        queued.wait(2)
    with pytest.raises(TransportError, match="is closed"):
        a.send(1, torch.ones(1), tag=2)
    b.close()
    # The connect thread of the peerless transport ends when its rendezvous wait expires, and
    # the rendezvous's thread serving that wait once it has answered it (its client is gone).
    for thread in threading.enumerate():
        if thread.name.startswith(("gloo-", "lmpool-rendezvous-conn")):
            thread.join(5)
    assert [t.name for t in threading.enumerate() if t not in before] == []


def test_connect_to_a_peer_that_never_comes_fails_within_its_timeout(rendezvous):
    t = GlooTransport(rendezvous, 0, 2, timeout_s=0.5)
    connecting = t.connect(1, 1)
    queued = t.recv(1, torch.empty(4), tag=1)
    # The transport's own connect timeout ends it (the waits' expiry would be a TransferTimeout).
    with pytest.raises(TransportError, match="could not connect to rank 1 .session 1. within 0.5s"):
        connecting.wait(60)
    with pytest.raises(TransportError, match="could not connect"):
        queued.wait(60)
    t.close()


def test_bad_arguments_are_refused_before_anything_starts(rendezvous, pair):
    a, _ = pair
    x = torch.zeros(8)
    with pytest.raises(ValueError, match="another rank"):
        a.send(0, x, 1)
    with pytest.raises(ValueError, match="another rank"):
        a.recv(2, x, 1)
    with pytest.raises(ValueError, match="tag must be in"):
        a.send(1, x, -1)
    with pytest.raises(ValueError, match="tag must be in"):
        a.send(1, x, TAG_LIMIT)
    with pytest.raises(ValueError, match="contiguous"):
        a.send(1, torch.zeros(4, 4).t(), 1)
    with pytest.raises(ValueError, match="is on meta"):
        a.recv(1, torch.empty(4, device="meta"), 1)
    with pytest.raises(TransportError, match=r"no connection to rank 2: call connect\(2, session\) first"):
        GlooTransport(rendezvous, 0, 3).send(2, x, 1)


def test_rendezvous_addresses_and_kinds(rendezvous):
    with pytest.raises(ValueError, match="unix:@lmpool-rendezvous-KEY"):
        open_store("file://store", 1)
    rz = Rendezvous.create()
    dead = rz.address
    rz.close()
    with pytest.raises(TransportError, match="cannot reach the rendezvous"):
        open_store(dead, 0.3)
    assert kind_for_devices("cpu", "cpu") == "gloo"
    assert kind_for_devices("cuda:0", "cuda:0") == "cuda_ipc"
    assert kind_for_devices("cuda:0", "cuda:1") == "nccl"
    with pytest.raises(ValueError, match="no transport"):
        kind_for_devices("cpu", "cuda:0")
    assert plan_tag(TAG_LIMIT + 5) == 5 and plan_tag(3) == 3
    t = make_transport("gloo", 0, 2, rendezvous=rendezvous)
    assert isinstance(t, GlooTransport)
    t.close()
    with pytest.raises(ValueError, match="kind must be one of"):
        make_transport("tcp", 0, 2, rendezvous=rendezvous)
