"""The NCCL transport's lanes without a GPU: which communicator each operation takes, and
the check that both ends of a pair use the same number of lanes (``lmpool/dataplane/nccl.py``).
The transfers themselves need two GPUs: ``test_nccl_gpu.py``."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist
from hypothesis import given, strategies as st

from lmpool.dataplane import TransportError
from lmpool.dataplane.nccl import MAX_LANES, NcclTransport, _NcclPair, check_lanes


@given(lanes=st.integers(1, 4), ops=st.lists(st.sampled_from(["send", "recv"]), max_size=40))
def test_the_nth_operation_of_a_direction_takes_lane_n_mod_lanes(lanes, ops):
    """Both ends count a direction's operations alike, so the sender's n-th send and the
    receiver's n-th receive meet on one lane, whatever the other direction does meanwhile."""
    pair = _NcclPair(peer=1, session=1)
    pair.outgoing = [f"out{i}" for i in range(lanes)]
    pair.incoming = [f"in{i}" for i in range(lanes)]
    sends = recvs = 0
    for op in ops:
        if op == "send":
            assert pair.next_outgoing() == f"out{sends % lanes}"
            sends += 1
        else:
            assert pair.next_incoming() == f"in{recvs % lanes}"
            recvs += 1
        assert (pair.sent, pair.received) == (sends, recvs)


def _check_both(mine: int, theirs: int) -> list:
    """check_lanes on two threads, one per end; what each raised (None: nothing)."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=10))
    raised = [None, None]

    def end(rank: int, lanes: int) -> None:
        try:
            check_lanes(store, rank, 1 - rank, lanes)
        except TransportError as e:
            raised[rank] = e

    threads = [threading.Thread(target=end, args=(r, n)) for r, n in ((0, mine), (1, theirs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    return raised


@pytest.mark.parametrize("lanes", [1, 2, 4])
def test_equal_lanes_pass_on_both_ends(lanes):
    assert _check_both(lanes, lanes) == [None, None]


def test_different_lanes_fail_both_ends_naming_both_counts():
    raised = _check_both(1, 2)
    assert "rank 0 uses 1 NCCL lanes per direction but rank 1 uses 2" in str(raised[0])
    assert "rank 1 uses 2 NCCL lanes per direction but rank 0 uses 1" in str(raised[1])


@pytest.mark.parametrize("lanes", [0, MAX_LANES + 1])
def test_a_lane_count_out_of_range_is_refused_before_anything_is_set_up(lanes):
    with pytest.raises(ValueError, match=f"lanes must be in \\[1, {MAX_LANES}\\], got {lanes}"):
        NcclTransport("127.0.0.1:1", 0, 2, device="cuda:0", lanes=lanes)


def test_a_pair_replaced_while_connecting_ends_every_lane_and_makes_no_more(monkeypatch):
    """``connect`` runs on a thread, and a new session may abort the pair while that thread
    is still making communicators: the one it finishes then is ended when added (its
    communicator aborted, its stream given back) and it makes no further one. Fakes stand
    in for CUDA, the store and NCCL; the real thing is ``test_nccl_gpu.py``."""
    from lmpool.dataplane import nccl

    made, released = [], []
    pair = _NcclPair(peer=1, session=1)

    class FakeComm:
        def __init__(self, uid, nranks, rank):
            made.append(self)
            self.aborted = False
            if len(made) == 2:  # the caller replaces the pair while this one is being made
                pair.abort("replaced by session 2")

        def abort(self):
            self.aborted = True

    monkeypatch.setattr(nccl.torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(nccl, "open_store", lambda address, timeout: dist.HashStore())
    monkeypatch.setattr(nccl, "check_lanes", lambda *args: None)
    monkeypatch.setattr(nccl.nccl_lib, "unique_id", lambda: b"\0" * 128)
    monkeypatch.setattr(nccl.nccl_lib, "Communicator", FakeComm)
    monkeypatch.setattr(nccl.streams, "acquire", lambda device: object())
    monkeypatch.setattr(nccl.streams, "release", released.append)
    transport = object.__new__(NcclTransport)  # its constructor needs CUDA; _connect needs only these
    transport.rank, transport.lanes, transport.device, transport.timeout_s = 0, 3, "cuda:0", 5.0
    transport._rendezvous = "127.0.0.1:1"
    transport._connect(pair)
    assert pair.ready.is_set() and pair.broken == "replaced by session 2"
    assert len(made) == 2 and all(comm.aborted for comm in made)  # no third: the thread stopped
    lanes = [*pair.outgoing, *pair.incoming]
    assert [lane.comm for lane in lanes] == made and released == [lane.stream for lane in lanes]
