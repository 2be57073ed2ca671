"""The NCCL pair transport (``lmpool/transfer/nccl.py``) between two processes on two GPUs
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
    from lmpool.transfer import TransportError
    from lmpool.transfer.nccl import NcclTransport

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


@pytest.mark.parametrize("gpu_order", [False, True], ids=["host-ordered", "gpu-ordered"])
def test_chunked_blocks_cross_both_ways_at_once_byte_equal(rendezvous, gpu_order):
    """``send_blocks`` and ``BlockReceiver`` over the pair, one plan each way started before
    either waits, in the most chunks; the receiver unpacks as the host sees each chunk, or
    queues its unpacks on the GPU behind the receives (``gpu_order``)."""
    from lmpool.ops import get_backend
    from lmpool.transfer.chunked import BlockReceiver, send_blocks
    from lmpool.transfer.nccl import NcclTransport
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
                                          chunk_bytes=1, gpu_order=gpu_order))
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


def test_gpu_ordered_receives_outlast_a_turn_of_torchs_stream_pool(rendezvous):
    """As the benchmark and the pool do it: the receiver posts a plan's receives, GPU-ordered,
    then tells the sender to go over the opposite direction, and only then do the chunks
    leave. Run for more plans than torch's pool has streams (32), with pool streams taken
    in between: the go and the unpacks never share a stream (``streams``), which would hang
    the go behind unpacks waiting for chunks sent only after it."""
    from lmpool.ops import get_backend
    from lmpool.transfer.chunked import BlockReceiver, chunk_tag, send_blocks
    from lmpool.transfer.nccl import NcclTransport
    from transfer_testkit import NUM_BLOCKS, make_cache

    devices = [torch.device(f"cuda:{r}") for r in (0, 1)]
    ends = [NcclTransport(rendezvous, r, 2, device=str(devices[r]), timeout_s=30.0) for r in (0, 1)]
    try:
        assert all(ready.wait(60) for ready in [ends[0].connect(1, 5), ends[1].connect(0, 5)])
        ops = [get_backend(d) for d in devices]
        caches = [make_cache(r).to(devices[r]) for r in (0, 1)]
        go = [torch.zeros(1, device=d) for d in devices]
        pool = {torch.cuda.Stream(devices[1]).cuda_stream for _ in range(40)}
        for plan in range(40):
            torch.cuda.Stream(devices[1])  # another turn of the pool for every plan
            src_ids = torch.tensor([plan % NUM_BLOCKS, (plan + 3) % NUM_BLOCKS], device=devices[0])
            dst_ids = torch.tensor([(plan + 1) % NUM_BLOCKS, (plan + 5) % NUM_BLOCKS], device=devices[1])
            with torch.cuda.device(devices[0]):
                asked = ends[0].recv(1, go[0], chunk_tag(1000 + plan, 0))
            with torch.cuda.device(devices[1]):
                receiving = BlockReceiver(ends[1], 0, ops[1], caches[1], dst_ids, plan, chunk_bytes=1, gpu_order=True)
                told = ends[1].send(0, go[1], chunk_tag(1000 + plan, 0))
            assert not {h.stream.cuda_stream for h in (asked, told)} & pool
            told.wait(30)
            asked.wait(30)
            with torch.cuda.device(devices[0]):
                sending = send_blocks(ends[0], 1, ops[0], caches[0], src_ids, plan, chunk_bytes=1)
            sending.wait(30)
            receiving.wait(30)
            torch.cuda.synchronize(devices[1])
            assert torch.equal(caches[1][:, :, dst_ids], caches[0][:, :, src_ids].to(devices[1]))
    finally:
        for end in ends:
            end.close()
