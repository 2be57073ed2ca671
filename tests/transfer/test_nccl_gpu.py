"""The NCCL pair transport (``lmpool/dataplane/nccl.py``) between two processes on two GPUs
(**nccl**: needs two CUDA devices and ``RUN_NCCL_INTEGRATION=1``).

NCCL matches by order, not by tag, so both ends start a direction's transfers in the same
order; each direction has its own communicators (lanes), so opposite transfers run at once.
"""

from __future__ import annotations

import os

import pytest
import torch

from test_gloo_transport import SIZES, check_received, ops_of, script_for
from transfer_testkit import Peer

pytestmark = [
    pytest.mark.nccl,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2 or os.environ.get("RUN_NCCL_INTEGRATION") != "1",
        reason="needs two CUDA devices and RUN_NCCL_INTEGRATION=1",
    ),
]


@pytest.mark.parametrize(("dtype", "lanes"), [("bfloat16", 1), ("float32", 1), ("bfloat16", 2), ("float32", 3)])
def test_every_size_in_both_directions_at_once(rendezvous, peers, dtype, lanes):
    """Data equality and no deadlock: 1..128 blocks each way, all started before any wait,
    over one communicator per direction or several (lanes take operations in turn)."""
    transfers = [{"src": s, "dst": 1 - s, "tag": 100 + n, "blocks": n, "seed": 10 * n + s}
                 for n in SIZES for s in (0, 1)]
    ops = [ops_of(rank, transfers) for rank in (0, 1)]
    for rank in (0, 1):
        peers.append(Peer(rendezvous, rank, 2, script_for(rank, 2, ops[rank]), dtype=dtype, kind="nccl",
                          timeout_s=60.0, lanes=lanes))
    for p in peers:
        p.expect("connected")
        check_received(p, ops[p.rank], dtype)
        assert p.finish()["exit"] == p.rank


def test_ends_with_different_lanes_fail_the_pair_saying_why(rendezvous):
    """A pair whose ends disagree on lanes fails at connect, before any communicator, and
    says so at the first transfer on either end (instead of hanging in set-up)."""
    from lmpool.dataplane import TransportError
    from lmpool.dataplane.nccl import NcclTransport

    ends = [NcclTransport(rendezvous, r, 2, device=f"cuda:{r}", timeout_s=10.0, lanes=r + 1) for r in (0, 1)]
    try:
        ready = [ends[0].connect(1, 7), ends[1].connect(0, 7)]
        assert all(r.wait(30) for r in ready)
        for r, end in enumerate(ends):
            with pytest.raises(TransportError, match=f"rank {r} uses {r + 1} NCCL lanes per direction but "
                                                     f"rank {1 - r} uses {2 - r}"):
                end.send(1 - r, torch.zeros(4, device=f"cuda:{r}"), 0)
    finally:
        for end in ends:
            end.close()


def test_chunked_blocks_cross_both_ways_at_once_byte_equal(rendezvous):
    """``send_blocks`` and ``BlockReceiver`` over the pair, one plan each way started before
    either waits, in the most chunks."""
    from lmpool.ops import get_backend
    from lmpool.dataplane.chunked import BlockReceiver, send_blocks
    from lmpool.dataplane.nccl import NcclTransport
    from transfer_testkit import NUM_BLOCKS, make_cache

    devices = [torch.device(f"cuda:{r}") for r in (0, 1)]
    ends = [NcclTransport(rendezvous, r, 2, device=str(devices[r]), timeout_s=30.0) for r in (0, 1)]
    try:
        assert all(ready.wait(60) for ready in [ends[0].connect(1, 3), ends[1].connect(0, 3)])
        ops = [get_backend(d) for d in devices]
        caches = [make_cache(r).to(devices[r]) for r in (0, 1)]
        expected = [c.clone() for c in caches]
        # On each cache the blocks sent and the blocks received are apart: both directions run at once.
        order = [torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(20 + r)).to(devices[r])
                 for r in (0, 1)]
        work = []
        for src in (0, 1):
            dst = 1 - src
            src_ids, dst_ids = order[src][:6], order[dst][6:12]
            expected[dst][:, :, dst_ids] = caches[src][:, :, src_ids].to(devices[dst])
            with torch.cuda.device(devices[dst]):
                work.append(BlockReceiver(ends[dst], src, ops[dst], caches[dst], dst_ids, plan_id=40 + src,
                                          chunk_bytes=1))
            with torch.cuda.device(devices[src]):
                work.append(send_blocks(ends[src], dst, ops[src], caches[src], src_ids, plan_id=40 + src,
                                        chunk_bytes=1))
        for handle in work:
            handle.wait(60)
        for r in (0, 1):
            torch.cuda.synchronize(devices[r])
            assert torch.equal(caches[r], expected[r])
    finally:
        for end in ends:
            end.close()


def test_lanes_run_on_streams_of_their_own(rendezvous):
    """Every lane's stream is apart from torch's pool, however many pool streams the process
    takes (the pool hands its 32 out in turn), and the lanes still carry both directions."""
    from lmpool.dataplane.nccl import NcclTransport

    ends = [NcclTransport(rendezvous, r, 2, device=f"cuda:{r}", timeout_s=30.0) for r in (0, 1)]
    try:
        assert all(ready.wait(60) for ready in [ends[0].connect(1, 9), ends[1].connect(0, 9)])
        for r, end in enumerate(ends):
            pair = end._pairs[1 - r]
            lanes = {lane.stream.cuda_stream for lane in (*pair.outgoing, *pair.incoming)}
            assert len(lanes) == 2 * end.lanes
            assert not lanes & {torch.cuda.Stream(f"cuda:{r}").cuda_stream for _ in range(64)}
        data = [torch.arange(1000, dtype=torch.float32, device=f"cuda:{r}") + r for r in (0, 1)]
        out = [torch.zeros(1000, device=f"cuda:{r}") for r in (0, 1)]
        handles = [ends[r].recv(1 - r, out[r], 5) for r in (0, 1)] + [ends[r].send(1 - r, data[r], 5) for r in (0, 1)]
        for h in handles:
            h.wait(30)
        assert all(torch.equal(out[r].cpu(), data[1 - r].cpu()) for r in (0, 1))
    finally:
        for end in ends:
            end.close()
