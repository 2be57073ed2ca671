"""The parts of the CUDA IPC transport that need no GPU: staging-region allocation,
transfer keys, the export message on the wire, and argument checks."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmpool.transfer.cuda_ipc import ALIGN, CudaIpcTransport, Regions, transfer_key
from lmpool.transfer.messages import ConnectPeer, CudaIpcExport


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


def test_export_round_trips_through_msgpack_and_rejects_wrong_types():
    export = CudaIpcExport(
        rank=1, session=2**62 + 5, pid=4242, device=0, storage_handle=bytes(range(66)),
        storage_bytes=1 << 30, storage_offset=512, ref_counter_handle=b"/torch_4242_1_0",
        ref_counter_offset=3, storage_event_handle=b"\x01" * 64, storage_event_sync_required=True,
        events=[bytes([i]) * 64 for i in range(4)],
    )
    wire = msgspec.msgpack.encode(export)
    assert msgspec.msgpack.decode(wire, type=CudaIpcExport) == export
    bad = msgspec.msgpack.encode(ConnectPeer(peer=1, session=2))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(bad, type=CudaIpcExport)
    assert msgspec.msgpack.decode(bad, type=ConnectPeer | CudaIpcExport) == ConnectPeer(peer=1, session=2)


def test_transport_refuses_a_device_it_cannot_share():
    with pytest.raises(ValueError, match=r"needs a CUDA device with an index \(cuda:N\), got 'cpu'"):
        CudaIpcTransport("tcp://127.0.0.1:1", 0, 2, device="cpu", staging_bytes=1024)
    with pytest.raises(ValueError, match="rank must be in"):
        CudaIpcTransport("tcp://127.0.0.1:1", 2, 2, device="cuda:0", staging_bytes=1024)
