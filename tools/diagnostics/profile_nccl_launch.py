"""What the host pays to start one chunk of a packed NCCL transfer (diagnostic, two GPUs):
the median host seconds of each call on the sender's path, the GPU idle before each call,
so that a figure is the call's own cost, not a wait on queued work.

    python -m tools.diagnostics.profile_nccl_launch --preset 0.6b --json launch.json

- ``pack``: ``ops.pack_kv`` of one 28 MiB chunk (allocation, launch);
- ``transport_send``: ``NcclTransport.send`` of a ready 28 MiB payload (argument checks,
  lane choice, the enqueue, the handle);
- ``lane_send``: the lane's own enqueue alone (stream ordering, ``ncclSend``, completion
  event), on the lane the wrapper would take;
- ``handle_done``: one ``NcclHandle.done()`` poll of a send still in flight;
- ``send_blocks``: the whole ``send_blocks`` call of an 8-block transfer (its default chunks).

Run it on each revision to compare: ``NcclTransport`` went through torch's
``ProcessGroupNCCL`` (about 40 us per send on the H200 pair) before ``nccl_lib``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from lmpool.model.make_model import PRESETS
from lmpool.ops import get_backend
from lmpool.dataplane import make_transport
from lmpool.dataplane.chunked import BlockReceiver, payload_bytes, send_blocks
from lmpool.dataplane.rendezvous import open_store

from benchmarks.benchmark_kv_transfer import spin  # the same wait as the benchmark's: polling without pauses
from tools.diagnostics.pair_workers import kv_shape, run_pair, this_end

REPS = 200
WAIT_S = 60.0


def worker(args) -> dict:
    rank, peer, device = this_end(args.worker)
    num_layers, kv_heads, head_dim = kv_shape(args.preset)
    cache = torch.randn(num_layers, 2, 16, args.block_size, kv_heads, head_dim, device=device).to(torch.bfloat16)
    ops = get_backend(device, use_kernels=True)
    transport = make_transport("nccl", rank, 2, rendezvous=args.rendezvous, device=str(device), timeout_s=WAIT_S)
    if not transport.connect(peer, session=1).wait(WAIT_S):
        raise RuntimeError("the NCCL pair is not up")
    store = open_store(args.rendezvous, WAIT_S)
    ids = torch.arange(8, device=device)
    layers = max(1, (28 << 20) * cache.shape[0] // payload_bytes(cache, len(ids)))  # a 28 MiB chunk of the 8 blocks
    payload = ops.pack_kv(cache[:layers], ids)
    out: dict[str, list[float]] = {}

    def barrier(name: str) -> None:
        store.set(f"{name}/{rank}", "1")
        store.get(f"{name}/{peer}")

    def timed(name: str, call):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        result = call()
        out.setdefault(name, []).append(time.perf_counter() - t0)
        return result

    if rank == 0:
        for _ in range(REPS):
            timed("pack", lambda: ops.pack_kv(cache[:layers], ids))
    for name in ("transport_send", "lane_send"):
        barrier(name)
        if rank == 0:
            for _ in range(REPS):
                if name == "transport_send":
                    handle = timed(name, lambda: transport.send(peer, payload, 1))
                    t0 = time.perf_counter()
                    handle.done()
                    out.setdefault("handle_done", []).append(time.perf_counter() - t0)
                    spin(handle)
                else:
                    lane = transport._pair(peer, WAIT_S).next_outgoing()
                    done = timed(name, lambda: lane.start("send", payload, 1))
                    done.synchronize()
        else:
            for _ in range(REPS):
                spin(transport.recv(peer, torch.empty_like(payload), 1))
    barrier("send_blocks")
    for plan in range(REPS // 4):
        if rank == 0:
            sending = timed("send_blocks", lambda: send_blocks(transport, peer, ops, cache, ids, plan))
            spin(sending)
        else:
            spin(BlockReceiver(transport, peer, ops, cache, ids + 8, plan))
    barrier("end")
    torch.cuda.synchronize(device)
    transport.close()
    return {name: statistics.median(samples[5:]) for name, samples in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="0.6b", choices=sorted(PRESETS))
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--rendezvous", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args)), flush=True)
        return 0
    outputs = run_pair("tools.diagnostics.profile_nccl_launch", sys.argv[1:])
    if outputs is None:
        return 1
    from benchmarks.lib.revision import git_record

    result = {"sender_host_s": json.loads(outputs[0]),
              "env": {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL", "TORCH_FR", "NCCL_"))},
              "torch": torch.__version__, "git": git_record()}
    for name, seconds in result["sender_host_s"].items():
        print(f"{name:>15}: {seconds * 1e6:8.1f} us")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
