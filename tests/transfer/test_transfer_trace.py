"""``benchmarks/transfer_trace.py`` reads the kernel traces of ``benchmark_kv_transfer.py
--trace`` (GPU runs only); its arithmetic is checked here on synthetic traces: the go
message's kernels are left out, each end is read on its own clock, warm-ups are skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import transfer_trace

PACK = "void block_copy_kernel<long, true>(uint4*, uint4*, long const*, long, long, long, long, long)"
UNPACK = PACK.replace("true", "false")
NCCL = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def span(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def write(tmp_path: Path, rank: int, events: list[dict]) -> None:
    (tmp_path / f"trace_rank{rank}.json").write_text(json.dumps({"traceEvents": events}))


def test_a_packed_transfer_and_raw_send_are_broken_down_per_end(tmp_path):
    # Rank 0 sends; the clocks of the two traces differ by 1e6 us and must not be compared.
    sender = [
        span("pack@8/3/0->1/10#0", 0, 1000),
        kernel(NCCL, 5, 10),  # the go's receive, before the first pack: not a chunk
        kernel(PACK, 100, 20), kernel(NCCL, 125, 300),
        kernel(PACK, 120, 30), kernel(NCCL, 155, 300),
        span("raw/0->1/10#0", 2000, 1000), kernel(NCCL, 2010, 5), kernel(NCCL, 2100, 800),
        span("chunks/0->1/10#0", 3000, 1000), kernel(NCCL, 3010, 5),  # the go, then two chunks at once
        kernel(NCCL, 3100, 400), kernel(NCCL, 3120, 450),
        span("pack@8/3/0->1/10#-1", 4000, 1000), kernel(PACK, 4100, 999),  # a warm-up: skipped
    ]
    receiver = [
        span("pack@8/3/0->1/10#0", 1e6, 1000),
        kernel(NCCL, 1e6 + 10, 400), kernel(NCCL, 1e6 + 12, 450),  # the two receives, posted first
        kernel(NCCL, 1e6 + 20, 5),  # the go's send: not among the last-ending receives
        kernel(UNPACK, 1e6 + 420, 25), kernel(UNPACK, 1e6 + 480, 20),
    ]
    write(tmp_path, 0, sender)
    write(tmp_path, 1, receiver)
    result = transfer_trace.breakdown(tmp_path)
    packed = result["pack@8/3"]["0->1"]["10"]
    assert packed["pack0_us"] == 20 and packed["packs_us"] == 50
    assert packed["first_send_us"] == 25 and packed["wire_us"] == 330 and packed["sender_us"] == 355
    assert packed["lanes_busy"] == pytest.approx(600 / 330, abs=0.01)
    assert packed["tail_wait_us"] == 18 and packed["tail_us"] == 38  # from the receive ending at +462
    assert packed["last_unpack_us"] == 20 and packed["unpacks_us"] == 45
    assert packed["estimate_us"] == 355 + 38
    assert result["raw"]["0->1"]["10"] == {"send_us": 800, "ops": 1}
    assert result["chunks"]["0->1"]["10"] == {"send_us": 470, "ops": 2}
    assert set(result) == {"pack@8/3", "raw", "chunks"}
