"""Could a KV transfer skip packing? NCCL sends of every block's per-layer segment, straight
from cache to cache in one group, against one send of the same bytes (diagnostic, two GPUs).

    python benchmarks/probe_nccl_segments.py --preset 0.6b --sizes 9,10,12,16 --json out.json

A packed transfer gathers B scattered blocks into a payload, sends it and scatters it at the
receiver: two kernels beside the wire. NCCL can instead move each (layer, K/V, block) segment
(``block_size * kv_heads * head_dim`` elements, 512 KiB for the 0.6B shapes and 256-token
blocks) as its own send, all of them in one ``ncclGroupStart``/``ncclGroupEnd``, the
receiver posting the matching receives straight into its own blocks. Paths, per size:

- ``raw``: one send of a ready contiguous buffer of the same bytes;
- ``segments``: one group of ``layers * 2 * B`` segment sends on one communicator;
- ``segments-x3``: the layers in three parts, one group each, on three communicators and
  streams (as the transport's lanes).

Two timings of each: ``wall``, the receiver's host seconds from a barrier until its stream
is done (the Python loop that issues one call per segment included), and ``gpu``, the
receiver's CUDA-event seconds from the moment its stream is let go (it sleeps on the GPU
while both hosts issue their calls, so the sender's kernel is already waiting) until its
receives are done: what the wire and NCCL's kernels take, whoever issues the calls. The
sender may already have pushed the first bytes into NCCL's buffers by then, so ``gpu``
figures are lower bounds, raw's most of all (it has one operation to start). A
``gpu`` ratio near 1 says the per-segment sends cost the wire little, so issuing them from
compiled code instead of Python would make the path worth building. Every segment path is
checked byte-equal once per size and direction.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from lmpool.model.make_model import PRESETS
from lmpool.dataplane import nccl_lib
from lmpool.dataplane.transport import open_store

from pair_workers import kv_shape, run_pair, this_end

WAIT_S = 60.0
LANES = 3
GATE_CYCLES = 20_000_000  # about 10 ms at the H200's clock: longer than both hosts' issuing
PATHS = ("raw", "segments", f"segments-x{LANES}")


def worker(args) -> dict:
    rank, peer, device = this_end(args.worker)
    layers, kv_heads, head_dim = kv_shape(args.preset)
    segment = args.block_size * kv_heads * head_dim * 2  # bf16 bytes
    blocks = 2 * max(args.sizes) + 8
    # Each rank's cache is a function of its rank, so the receiver can check what it got.
    caches = [torch.randint(0, 256, (layers, 2, blocks, segment), dtype=torch.uint8, device=device,
                            generator=torch.Generator(device).manual_seed(r)) for r in (0, 1)]
    cache = caches[rank].clone()
    store = open_store(args.rendezvous, WAIT_S)
    comms = []
    for lane in range(LANES):  # rank 0 makes each id, rank 1 waits for it
        key = f"probe/uid/{lane}"
        if rank == 0:
            store.set(key, nccl_lib.unique_id())
        comms.append(nccl_lib.Communicator(store.get(key), 2, rank))
    lib = nccl_lib.library()
    streams = [torch.cuda.Stream(device) for _ in range(LANES)]
    base = torch.cuda.current_stream(device)
    ready = torch.empty(layers * 2 * max(args.sizes) * segment, dtype=torch.uint8, device=device)

    def group(call: str) -> None:
        result = getattr(lib, call)()
        if result != 0:
            raise nccl_lib.NcclError(f"{call} failed: {lib.ncclGetErrorString(result).decode(errors='replace')}")

    def barrier(name: str) -> None:
        store.set(f"{name}/{rank}", "1")
        store.get(f"{name}/{peer}")

    def ids_of(owner: int, n: int) -> list[int]:  # scattered blocks, the same on both ends
        return random.Random(f"{owner}/{n}").sample(range(blocks), n)

    def segments(lane_layers, ids, sending: bool, lane: int) -> None:
        comm, stream = comms[lane], streams[lane].cuda_stream
        call = comm.send if sending else comm.recv
        group("ncclGroupStart")
        for layer in lane_layers:
            for kv in (0, 1):
                for b in ids:
                    call(cache[layer, kv, b].data_ptr(), segment, peer, stream)
        group("ncclGroupEnd")

    def run(path: str, n: int, sending: bool) -> None:
        ids = ids_of(rank, n)
        if path == "raw":
            streams[0].wait_stream(base)
            buf = ready[: layers * 2 * n * segment]
            (comms[0].send if sending else comms[0].recv)(buf.data_ptr(), buf.nbytes, peer, streams[0].cuda_stream)
            base.wait_stream(streams[0])
            return
        lanes = 1 if path == "segments" else LANES
        parts = [range(layers)[i * layers // lanes:(i + 1) * layers // lanes] for i in range(lanes)]
        for lane in range(lanes):
            streams[lane].wait_stream(base)
            segments(parts[lane], ids, sending, lane)
        for lane in range(lanes):
            base.wait_stream(streams[lane])

    samples: dict[str, list[float]] = {}
    checked: list[str] = []
    order = random.Random(7)
    for rep in range(args.reps + 1):  # the first repetition warms up and checks
        jobs = [(p, n, src, mode) for p in PATHS for n in args.sizes for src in (0, 1) for mode in ("wall", "gpu")]
        order.shuffle(jobs)
        for path, n, src, mode in jobs:
            sending = rank == src
            torch.cuda.synchronize(device)
            barrier(f"{rep}/{path}/{n}/{src}/{mode}")
            if mode == "gpu":
                if not sending:  # hold the receiver's stream until both hosts have issued everything
                    torch.cuda._sleep(GATE_CYCLES)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(base)
                run(path, n, sending)
                end.record(base)
                torch.cuda.synchronize(device)
                seconds = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                run(path, n, sending)
                torch.cuda.synchronize(device)
                seconds = time.perf_counter() - t0
            if sending:
                continue
            if rep > 0:
                samples.setdefault(f"{path}|{src}->{rank}|{n}|{mode}", []).append(seconds)
            elif path != "raw":  # check what arrived, then give this rank its own content back before it sends
                got, want = cache[:, :, ids_of(rank, n)], caches[src][:, :, ids_of(src, n)]
                checked.append(f"{path} {src}->{rank} {n} {mode}: {'equal' if torch.equal(got, want) else 'DIFFERENT'}")
                cache.copy_(caches[rank])
    barrier("end")
    for comm in comms:
        comm.abort()
    return {"p50_s": {k: statistics.median(v) for k, v in samples.items()}, "checked": checked,
            "segment_bytes": segment, "layers": layers}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="0.6b", choices=sorted(PRESETS))
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--sizes", default="9,10,12,16")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--rendezvous", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.sizes = [int(n) for n in args.sizes.split(",")]
    if args.worker is not None:
        print(json.dumps(worker(args)), flush=True)
        return 0
    if torch.cuda.device_count() < 2:
        print("this probe needs two CUDA devices", file=sys.stderr)
        return 2
    outputs = run_pair(str(Path(__file__).resolve()), sys.argv[1:])
    if outputs is None:
        return 1
    from revision import git_record

    ends = [json.loads(line) for line in outputs]
    p50 = {**ends[0]["p50_s"], **ends[1]["p50_s"]}  # each end reports the transfers it received
    ratios = {}
    for key, seconds in sorted(p50.items()):
        path, direction, n, mode = key.split("|")
        raw = p50["|".join(("raw", direction, n, mode))]
        ratios[key] = raw / seconds
        print(f"{path:>12} {direction} {n:>3} blocks {mode:>4}: {seconds * 1e6:8.1f} us, raw/this {100 * raw / seconds:6.1f} %")
    result = {"p50_s": p50, "raw_over_path": ratios, "checked": ends[0]["checked"] + ends[1]["checked"],
              "segment_bytes": ends[0]["segment_bytes"], "layers": ends[0]["layers"], "sizes": args.sizes,
              "reps": args.reps, "nccl": nccl_lib.version(), "torch": torch.__version__, "git": git_record(),
              "command": " ".join(["python", "benchmarks/probe_nccl_segments.py", *sys.argv[1:]])}
    print("checked:", " ".join(result["checked"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
