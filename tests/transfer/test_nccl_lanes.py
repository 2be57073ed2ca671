"""The NCCL transport's lanes without a GPU: which communicator each operation takes, and
the check that both ends of a pair use the same number of lanes (``lmpool/transfer/nccl.py``).
The transfers themselves need two GPUs: ``test_nccl_gpu.py``."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist
from hypothesis import given, strategies as st

from lmpool.transfer import TransportError
from lmpool.transfer.nccl import MAX_LANES, NcclTransport, _NcclPair, check_lanes


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
