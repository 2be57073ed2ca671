"""The NCCL pair transport (``lmpool/transfer/nccl.py``) between two processes on two GPUs
(**nccl**: needs two CUDA devices and ``RUN_NCCL_INTEGRATION=1``).

NCCL matches by order, not by tag, so both ends start a direction's transfers in the same
order; each direction has its own communicator, so opposite transfers run at once.
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


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_size_in_both_directions_at_once(rendezvous, peers, dtype):
    """Data equality and no deadlock: 1..128 blocks each way, all started before any wait."""
    transfers = [{"src": s, "dst": 1 - s, "tag": 100 + n, "blocks": n, "seed": 10 * n + s}
                 for n in SIZES for s in (0, 1)]
    ops = [ops_of(rank, transfers) for rank in (0, 1)]
    for rank in (0, 1):
        peers.append(Peer(rendezvous, rank, 2, script_for(rank, 2, ops[rank]), dtype=dtype, kind="nccl",
                          timeout_s=60.0))
    for p in peers:
        p.expect("connected")
        check_received(p, ops[p.rank], dtype)
        assert p.finish()["exit"] == p.rank
