"""The parts of the CUDA IPC transport that need no GPU: staging-region allocation,
transfer keys, the export message on the wire (alone and in the pool's unions), telling a
dead peer from a live one, the block copy's reference and checks, and argument checks."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmpool.ops.reference import pack_kv, unpack_kv
from lmpool.protocol import Connect, ControlToWorker, Executed, WorkerToControl
from lmpool.dataplane import kind_for_devices
from lmpool.dataplane.block_copy import copy_blocks
from lmpool.dataplane.cuda_ipc import ALIGN, CudaIpcTransport, Regions, process_start, transfer_key
from lmpool.protocol.cuda_ipc import CudaIpcExport, IpcStorage


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3000)), max_size=60))
def test_regions_never_overlap_stay_inside_and_are_aligned(ops):
    regions = Regions(8192)
    held: dict[int, int] = {}
    for release, nbytes in ops:
        if release and held:
            start = sorted(held)[nbytes % len(held)]
            regions.free(start)
            del held[start]
            continue
        start = regions.alloc(nbytes)
        if start is None:
            # Refused only when no aligned gap of that size exists.
            ends = sorted((s, s + n) for s, n in held.items())
            cursor, fits = 0, False
            for s, e in ends:
                fits |= s - cursor >= nbytes
                cursor = -(-e // ALIGN) * ALIGN
            assert not (fits or 8192 - cursor >= nbytes)
            continue
        assert start % ALIGN == 0 and start + nbytes <= 8192
        for s, n in held.items():
            assert start + nbytes <= s or s + n <= start
        held[start] = nbytes
    assert regions.used() == sum(held.values())


def test_a_freed_region_is_reused():
    regions = Regions(1024)
    a, b = regions.alloc(256), regions.alloc(256)
    assert (a, b) == (0, 256)
    assert regions.alloc(600) is None
    regions.free(a)
    assert regions.alloc(200) == 0


def test_keys_carry_both_ends_and_their_incarnations():
    key = transfer_key(1, 11, 0, 22, 7)
    assert key != transfer_key(1, 12, 0, 22, 7)  # a restarted sender never meets old keys
    assert key != transfer_key(0, 22, 1, 11, 7)  # the opposite direction, same tag
    assert key != transfer_key(1, 11, 0, 22, 8)


def storage(seed: int) -> IpcStorage:
    return IpcStorage(handle=bytes([seed]) * 66, nbytes=1 << 30, offset=512, ref_counter_handle=b"/torch_4242_1_0",
                      ref_counter_offset=3, event_handle=b"\x01" * 64, event_sync_required=True)


def test_export_round_trips_through_msgpack_and_rejects_wrong_types():
    export = CudaIpcExport(
        rank=1, peer=0, session=2**62 + 5, pid=4242, pid_start=123456, device=0, pair_session=77,
        staging=storage(1), events=[bytes([i]) * 64 for i in range(4)], kv_cache=storage(2),
        kv_shape=[28, 2, 100, 256, 8, 128], kv_dtype="bfloat16",
    )
    wire = msgspec.msgpack.encode(export)
    assert msgspec.msgpack.decode(wire, type=CudaIpcExport) == export
    pull_only = CudaIpcExport(rank=1, peer=0, session=5, pid=4242, pid_start=0, device=0, kv_cache=storage(3),
                              kv_shape=[4, 2, 8, 16, 2, 64], kv_dtype="float32")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(pull_only), type=CudaIpcExport) == pull_only
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(Connect(peer=1, session=2)),
                               type=CudaIpcExport)


def test_export_joins_the_pool_message_unions_both_ways():
    """The control rings carry exports in the pool's tagged unions (worker -> control ->
    worker): same wire conventions, a tag of its own, and each member decodes as itself."""
    export = CudaIpcExport(rank=0, peer=1, session=9, pid=1, pid_start=2, device=0, kv_cache=storage(4),
                           kv_shape=[4, 2, 8, 16, 2, 64], kv_dtype="float16")
    up = WorkerToControl
    down = ControlToWorker
    for union, other in ((up, Executed(5, 1)), (down, Connect(peer=1, session=0))):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(export), type=union) == export
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(other), type=union) == other


def test_process_start_tells_live_zombie_and_gone_apart():
    assert process_start(os.getpid()) == process_start(os.getpid()) > 0
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert process_start(child.pid) is None
    child.wait()
    assert process_start(child.pid) is None


def test_block_copy_reference_equals_pack_then_unpack():
    g = torch.Generator().manual_seed(3)
    src = torch.randn(3, 2, 10, 4, 2, 8, generator=g)
    dst = torch.randn(3, 2, 7, 4, 2, 8, generator=g)
    expected = dst.clone()
    unpack_kv(expected, torch.tensor([6, 0, 2]), pack_kv(src, torch.tensor([9, 4, 4])))
    copy_blocks(src, [9, 4, 4], dst, [6, 0, 2])
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("src_ids, dst_ids, dst_shape, message", [
    ([1, 2], [1], (3, 2, 7, 4, 2, 8), "2 source block ids but 1 destination"),
    ([10], [1], (3, 2, 7, 4, 2, 8), r"source block ids \[10\] are outside \[0, 10\)"),
    ([1], [-1], (3, 2, 7, 4, 2, 8), r"destination block ids \[-1\] are outside \[0, 7\)"),
    ([1, 2], [3, 3], (3, 2, 7, 4, 2, 8), "destination block ids repeat"),
    ([1], [1], (3, 2, 7, 4, 1, 8), "different KV shapes"),
    ([1], [1], (3, 7, 4, 2, 8), "must be \\[layers, 2"),
])
def test_block_copy_refuses_what_it_cannot_do(src_ids, dst_ids, dst_shape, message):
    src, dst = torch.zeros(3, 2, 10, 4, 2, 8), torch.zeros(dst_shape)
    with pytest.raises(ValueError, match=message):
        copy_blocks(src, src_ids, dst, dst_ids)


def test_peer_access_picks_cuda_ipc_across_gpus():
    assert kind_for_devices("cuda:0", "cuda:1", peer_access=True) == "cuda_ipc"
    assert kind_for_devices("cuda:0", "cuda:1", peer_access=False) == "nccl"
    assert kind_for_devices("cuda:1", "cuda:1", peer_access=False) == "cuda_ipc"


def test_transport_refuses_a_device_it_cannot_share():
    with pytest.raises(ValueError, match=r"needs a CUDA device with an index \(cuda:N\), got 'cpu'"):
        CudaIpcTransport("unix:@lmpool-rendezvous-0", 0, 2, device="cpu", staging_bytes=1024)
    with pytest.raises(ValueError, match="rank must be in"):
        CudaIpcTransport("unix:@lmpool-rendezvous-0", 2, 2, device="cuda:0", staging_bytes=1024)
    with pytest.raises(ValueError, match="staging_bytes must be >= 0"):
        CudaIpcTransport("unix:@lmpool-rendezvous-0", 0, 2, device="cuda:0", staging_bytes=-1)
