"""The CUDA IPC transport (``lmpool/transfer/cuda_ipc.py``) between two processes on one
GPU (**GPU**). The test process plays the control plane: it relays each peer's
``CudaIpcExport`` (msgpack, as the rings would carry it) to the other peer.
"""

from __future__ import annotations

import pytest
import torch

from lmpool.ops.reference import pack_kv
from transfer_testkit import Peer, block_ids, digest, expected_cache, make_cache, process_gone

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
CUDA = dict(kind="cuda_ipc", device="cuda:0", staging_bytes=64 << 20)


def exchange_exports(a: Peer, b: Peer) -> None:
    """Relay each peer's export to the other, as the control plane does."""
    export_a, export_b = a.expect("export")["export"], b.expect("export")["export"]
    a.tell(export_b)
    b.tell(export_a)
    assert a.expect("connected") == {"connected": a.rank}
    assert b.expect("connected") == {"connected": b.rank}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_size_in_both_directions_at_once(rendezvous, peers, dtype):
    transfers = [{"src": s, "dst": 1 - s, "tag": 100 + n, "blocks": n, "seed": 10 * n + s}
                 for n in SIZES for s in (0, 1)]
    for rank in (0, 1):
        sends = [{"send": 1 - rank, "tag": t["tag"], "blocks": t["blocks"], "seed": t["seed"]}
                 for t in transfers if t["src"] == rank]
        recvs = [{"recv": 1 - rank, "tag": t["tag"], "blocks": t["blocks"], "seed": t["seed"]}
                 for t in transfers if t["dst"] == rank]
        if rank == 1:
            recvs.reverse()  # matching is by tag, not by order
        script = [{"export": None}, {"import": None}, *sends, *recvs, {"wait": 30}]
        peers.append(Peer(rendezvous, rank, 2, script, dtype=dtype, **CUDA))
    exchange_exports(*peers)
    for p in peers:
        received = []
        for op in ["send"] * len(SIZES) + ["recv"] * len(SIZES):
            line = p.line()
            if op == "send":
                assert "sent" in line, line
                continue
            t = next(x for x in transfers if x["dst"] == p.rank and x["tag"] == line["received"])
            src_ids, _ = block_ids(t["seed"], t["blocks"])
            assert line["digest"] == digest(pack_kv(make_cache(t["src"], dtype=dtype), src_ids))
            received.append(t)
        assert p.expect("cache")["cache"] == expected_cache(p.rank, received, dtype)
        assert p.finish()["exit"] == p.rank


def test_killed_peer_fails_the_survivor_within_its_timeout(rendezvous, peers):
    survivor = [{"export": None}, {"import": None}, {"recv": 1, "tag": 5, "blocks": 128, "seed": 1},
                {"say": "posted"}, {"hear": None}, {"fail": 5}]
    victim = [{"export": None}, {"import": None}, {"say": "ready"}, {"hear": None}]
    peers.append(Peer(rendezvous, 0, 2, survivor, dtype="bfloat16", **CUDA))
    peers.append(Peer(rendezvous, 1, 2, victim, dtype="bfloat16", **CUDA))
    exchange_exports(*peers)
    peers[0].expect("say")
    peers[1].expect("say")
    pid = peers[1].proc.pid
    peers[1].kill()
    assert process_gone(pid)
    peers[0].tell()
    failure = peers[0].expect("failed")
    assert failure["error"] == "TransportError" and failure["elapsed"] < 2.0, failure
    assert "is gone" in failure["message"]
    peers[0].finish()
