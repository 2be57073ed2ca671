"""The CUDA IPC transport (``lmpool/dataplane/cuda_ipc.py``) between two processes on one
GPU (**GPU**), and across two peer-accessible GPUs (**nccl**: several GPUs): packed
send/receive through the staging buffer, and pulls straight out of the peer's cache. The
test process plays the control plane: it relays each peer's ``CudaIpcExport`` (msgpack,
as the rings would carry it) to the other peer.
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


VICTIM = [{"export": None}, {"import": None}, {"say": "ready"}, {"hear": None}]


def kill_the_victim_once_ready(rendezvous: str, peers: list[Peer], survivor: list[dict], **options) -> Peer:
    """Rank 0 runs ``survivor`` (which says something, then waits to hear), rank 1 maps it and
    is SIGKILLed once both are ready; rank 0 is then told to go on, and returned."""
    peers.append(Peer(rendezvous, 0, 2, survivor, dtype="bfloat16", **options))
    peers.append(Peer(rendezvous, 1, 2, VICTIM, dtype="bfloat16", **options))
    exchange_exports(*peers)
    peers[0].expect("say")
    peers[1].expect("say")
    pid = peers[1].proc.pid
    peers[1].kill()
    assert process_gone(pid)
    peers[0].tell()
    return peers[0]


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
    survivor = kill_the_victim_once_ready(rendezvous, peers, [
        {"export": None}, {"import": None}, {"recv": 1, "tag": 5, "blocks": 128, "seed": 1},
        {"say": "posted"}, {"hear": None}, {"fail": 5}], **CUDA)
    failure = survivor.expect("failed")
    # The peer's death, not the wait's timeout (that would be a TransferTimeout saying so).
    assert failure["error"] == "TransportError" and "is gone" in failure["message"], failure
    survivor.finish()


PULL = dict(kind="cuda_ipc", device="cuda:0", share_cache=True)


def pull_scripts(puller: int, sizes: list[int]) -> tuple[list, list]:
    """The puller copies every size out of the other rank's cache, one after the other (the
    pulls write the cache itself: a later one may overwrite an earlier one's blocks)."""
    pulls = [step for n in sizes for step in ({"pull": 1 - puller, "blocks": n, "seed": 7 * n}, {"wait": 30})]
    source = [{"export": None}, {"import": None}, {"say": "serving"}, {"hear": None}]
    dest = [{"export": None}, {"import": None}, *pulls]
    return (dest, source) if puller == 0 else (source, dest)


def check_pulls(dest: Peer, source_rank: int, sizes: list[int], dtype: str) -> None:
    """Each pull's blocks equal the source's, and the whole cache is what they make of it."""
    transfers = []
    for n in sizes:
        line = dest.expect("pulled")
        src_ids, _ = block_ids(line["pulled"], n)
        assert line["digest"] == digest(pack_kv(make_cache(source_rank, dtype=dtype), src_ids)), n
        transfers.append({"src": source_rank, "blocks": n, "seed": 7 * n})
        assert dest.expect("cache")["cache"] == expected_cache(dest.rank, transfers, dtype), n


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("puller", [0, 1])
def test_pull_copies_blocks_out_of_the_peer_cache(rendezvous, peers, dtype, puller):
    """The fast path: one kernel from the source's mapped cache into the destination's."""
    scripts = pull_scripts(puller, SIZES)
    for rank in (0, 1):
        peers.append(Peer(rendezvous, rank, 2, scripts[rank], dtype=dtype, **PULL))
    exchange_exports(*peers)
    source = peers[1 - puller]
    source.expect("say")
    check_pulls(peers[puller], source.rank, SIZES, dtype)
    source.tell()
    for p in peers:
        assert p.finish()["exit"] == p.rank


def test_pull_from_a_killed_peer_fails_without_reading(rendezvous, peers):
    puller = kill_the_victim_once_ready(rendezvous, peers, [
        {"export": None}, {"import": None}, {"say": "mapped"}, {"hear": None},
        {"pull": 1, "blocks": 4, "seed": 1}, {"wait": 5}], **PULL)
    refused = puller.expect("refused")
    assert refused["error"] == "TransportError" and "is gone" in refused["message"], refused
    assert puller.expect("cache")["cache"] == expected_cache(0, [], "bfloat16"), "nothing was written"
    puller.finish()


@pytest.mark.nccl
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_pull_across_two_gpus(rendezvous, peers):
    """Peer-accessible GPUs (NVLink): the destination's kernel reads the peer GPU's cache."""
    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("cuda:0 cannot access cuda:1 directly")
    scripts = pull_scripts(1, SIZES)
    for rank in (0, 1):
        peers.append(Peer(rendezvous, rank, 2, scripts[rank], dtype="bfloat16", device_per_rank=True,
                          kind="cuda_ipc", share_cache=True))
    exchange_exports(*peers)
    peers[0].expect("say")
    check_pulls(peers[1], 0, SIZES, "bfloat16")
    peers[0].tell()
    for p in peers:
        assert p.finish()["exit"] == p.rank
