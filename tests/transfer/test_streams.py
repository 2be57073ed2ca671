"""LMPool's own CUDA streams (``lmpool/dataplane/streams.py``): never one of torch's pool,
never handed to two users at once. The GPU cases need a CUDA device (**GPU**)."""

from __future__ import annotations

import pytest
import torch

from lmpool.dataplane import streams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_stream_needs_a_cuda_device():
    with pytest.raises(ValueError, match="a CUDA stream needs a CUDA device, got cpu"):
        streams.acquire("cpu")


@pytest.mark.gpu
@needs_cuda
def test_acquired_streams_are_apart_from_torchs_pool_and_from_each_other():
    """Torch's pool hands its streams out again after a full turn; ours never share one."""
    ours = [streams.acquire("cuda:0") for _ in range(40)]
    try:
        pool = {torch.cuda.Stream("cuda:0").cuda_stream for _ in range(64)}
        assert len(pool) < 64  # the pool came round: why the lanes cannot take from it
        handles = [s.cuda_stream for s in ours]
        assert len(set(handles)) == len(ours)
        assert not set(handles) & pool
    finally:
        for s in ours:
            streams.release(s)


@pytest.mark.gpu
@needs_cuda
def test_a_released_stream_is_reused_and_runs_work():
    first = streams.acquire(0)
    streams.release(first)
    again = streams.acquire(0)
    try:
        assert again.cuda_stream == first.cuda_stream
        with torch.cuda.stream(again):
            x = torch.arange(1000, device="cuda:0").sum()
        again.synchronize()
        assert x.item() == 499500
    finally:
        streams.release(again)
