"""KV transfer latency between two worker processes, per block count: the profile the
transfer cost model reads (``lmpool/transfer/cost_model.py``).

For each directed pair (0->1, then 1->0) and each block count, two worker processes
measure, in turns within every repetition:

- ``pairs``: the data path of a transfer: the sender packs random block ids of its cache
  (``pack_kv``), sends, the receiver receives and unpacks into other block ids
  (``unpack_kv``); from just before the pack to just after the unpack has completed;
- ``raw``: the same bytes sent from a ready payload into a ready buffer (no pack, no
  unpack).

Both ends take their timestamps from ``time.monotonic()``, one clock for every process of
a host, so a one-way latency needs no round trip. Before each repetition the receiver
has already started its receive and tells the sender to go (a 4-byte message on the same
transport, outside the timed span). The first repetition of every size also checks the
bytes: a fingerprint of the sender's payload against one of the destination blocks after
the unpack; any difference fails the run. The run also measures a plain copy of the
largest payload within one process on the same device and reports each size's bandwidth
as a fraction of it.

    python benchmarks/benchmark_kv_transfer.py --kind gloo --json profile.json
    python benchmarks/benchmark_kv_transfer.py --kind cuda_ipc --preset 0.6b --json profile.json  # one GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import torch

from lmpool.model.make_model import DEFAULT_DTYPE, PRESETS
from lmpool.ops import get_backend
from lmpool.transfer import Rendezvous, make_transport
from lmpool.transfer.messages import CudaIpcExport

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WAIT_S = 120.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=("gloo", "cuda_ipc"), default="gloo")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the preset's")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="block counts, comma-separated")
    p.add_argument("--reps", type=int, default=30, help="timed repetitions per size, path and pair")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default=None, help="default: cpu for gloo, cuda:0 for cuda_ipc")
    p.add_argument("--reference-ops", action="store_true", help="torch pack/unpack even on CUDA")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--rendezvous", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = [int(n) for n in args.sizes.split(",")]
    args.dtype = args.dtype or DEFAULT_DTYPE[args.preset]
    args.device = args.device or ("cpu" if args.kind == "gloo" else "cuda:0")
    return args


def shape(args) -> dict:
    preset = PRESETS[args.preset]
    layers, kv_heads, head_dim = preset["num_hidden_layers"], preset["num_key_value_heads"], preset["head_dim"]
    element = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    return {
        "preset": args.preset, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
        "block_size": args.block_size, "dtype": args.dtype,
        "kv_bytes_per_block": layers * 2 * args.block_size * kv_heads * head_dim * element,
    }


def fingerprint(t: torch.Tensor) -> int:
    """A position-weighted wrapping sum of 32-bit words: any single changed word changes it."""
    words = t.reshape(-1).view(torch.uint8)
    pad = (-words.numel()) % 4
    if pad:
        words = torch.cat([words, words.new_zeros(pad)])
    words = words.view(torch.int32)
    total, chunk = 0, 1 << 24
    for start in range(0, words.numel(), chunk):
        part = words[start:start + chunk].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64) * 2 + 1
        total = (total + int((part * weights).sum())) & (2**64 - 1)
    return total


# ---- one worker ----------------------------------------------------------------------


class Worker:
    def __init__(self, args) -> None:
        self.rank, self.peer = args.worker, 1 - args.worker
        self.device = torch.device(args.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(1)  # two workers share the machine's cores
        torch.manual_seed(self.rank)  # so the two ends pick different block ids
        self.m = shape(args)
        self.ops = get_backend(self.device, use_kernels=not args.reference_ops)
        self.num_blocks = 2 * max(args.sizes)
        g = torch.Generator(device=self.device).manual_seed(1234 + self.rank)
        self.cache = torch.randn(self.m["layers"], 2, self.num_blocks, self.m["block_size"], self.m["kv_heads"],
                                 self.m["head_dim"], generator=g, device=self.device).to(DTYPES[args.dtype])
        payload_bytes = max(args.sizes) * self.m["kv_bytes_per_block"]
        self.transport = make_transport(args.kind, self.rank, 2, rendezvous=args.rendezvous, device=args.device,
                                        timeout_s=WAIT_S, staging_bytes=2 * payload_bytes + (1 << 20))
        self._connect(args)
        self.tag = 0
        self.go = torch.zeros(1, dtype=torch.int32, device=self.device)

    def _connect(self, args) -> None:
        if args.kind == "gloo":
            self.transport.connect(self.peer, session=1).wait(WAIT_S)
            return
        # The benchmark is its own control plane: exports travel through the rendezvous.
        from lmpool.transfer.transport import open_store

        store = open_store(args.rendezvous, WAIT_S)
        store.set(f"bench/export/{self.rank}", msgspec.msgpack.encode(self.transport.export()))
        theirs = msgspec.msgpack.decode(store.get(f"bench/export/{self.peer}"), type=CudaIpcExport)
        self.transport.connect(theirs)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def payload(self, n: int) -> torch.Tensor:
        return torch.empty(self.m["layers"], 2, n, self.m["block_size"], self.m["kv_heads"], self.m["head_dim"],
                           dtype=self.cache.dtype, device=self.device)

    def run(self, args) -> dict:
        times: dict[str, list[float]] = {}
        checks: dict[str, int] = {}
        for src in (0, 1):
            for n in args.sizes:
                ids = torch.randperm(self.num_blocks, device=self.device)[:n]  # differs per rank: src/dst ids
                ready = self.payload(n)  # the raw path's payload (sender) / buffer (receiver)
                ready.copy_(self.ops.pack_kv(self.cache, ids))
                out = self.payload(n)
                for rep in range(-args.warmup, args.reps):
                    for path in ("pack", "raw"):
                        t, check = self.one(src, path, ids, ready, out, check=rep == 0 and path == "pack")
                        key = f"{path}/{src}->{1 - src}/{n}"
                        if rep >= 0:
                            times.setdefault(key, []).append(t)
                        if check is not None:
                            checks[key] = check
        return {"times": times, "checks": checks}

    def one(self, src: int, path: str, ids, ready, out, check: bool) -> tuple[float, int | None]:
        """One timed transfer; returns this end's timestamp (start or end) and its fingerprint."""
        self.tag += 2
        if self.rank == src:
            self.transport.recv(self.peer, self.go, self.tag).wait(WAIT_S)
            self.sync()
            t0 = time.monotonic()
            payload = self.ops.pack_kv(self.cache, ids) if path == "pack" else ready
            self.transport.send(self.peer, payload, self.tag + 1).wait(WAIT_S)
            return t0, fingerprint(payload) if check else None
        buf = out if path == "pack" else ready
        receiving = self.transport.recv(self.peer, buf, self.tag + 1)
        self.transport.send(self.peer, self.go, self.tag).wait(WAIT_S)
        receiving.wait(WAIT_S)
        if path == "pack":
            self.ops.unpack_kv(self.cache, ids, buf)
        self.sync()
        t1 = time.monotonic()
        return t1, fingerprint(self.ops.pack_kv(self.cache, ids)) if check else None


def copy_bandwidth(args, m: dict) -> float:
    """Bytes per second of a plain copy of the largest payload, same device, one process."""
    device = torch.device(args.device)
    nbytes = max(args.sizes) * m["kv_bytes_per_block"]
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    samples = []
    for i in range(13):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 3:
            samples.append(time.perf_counter() - t0)
    return nbytes / sorted(samples)[len(samples) // 2]


def worker_main(args) -> None:
    worker = Worker(args)
    result = worker.run(args)
    if worker.rank == 0:
        result["copy_Bps"] = copy_bandwidth(args, worker.m)
    worker.transport.close()
    print(json.dumps(result), flush=True)


# ---- the launcher --------------------------------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(round(q * (len(sorted_values) - 1))))]


def environment(args) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "os": platform.platform(),
           "cpus": os.cpu_count(), "device": args.device}
    try:
        model = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name"))
        env["cpu"] = model.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        pass
    if torch.device(args.device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker_main(args)
        return 0
    rendezvous = Rendezvous.create()
    command = [sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:]),
               "--rendezvous", rendezvous.address]
    workers = [subprocess.Popen([*command, "--worker", str(r)], stdout=subprocess.PIPE, text=True)
               for r in (0, 1)]
    try:
        outputs = [w.communicate(timeout=3600)[0] for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        rendezvous.close()
    if any(w.returncode != 0 for w in workers):
        print(f"a worker failed: exit codes {[w.returncode for w in workers]}", file=sys.stderr)
        return 1
    results = [json.loads(o.strip().splitlines()[-1]) for o in outputs]
    m = shape(args)
    copy_Bps = results[0]["copy_Bps"]
    profile = {"kind": args.kind, "model": m, "sizes": args.sizes, "repetitions": args.reps,
               "pairs": {}, "raw": {}, "copy_bandwidth_GBps": round(copy_Bps / 1e9, 3)}
    wrong = []
    for key in results[0]["times"]:
        path, pair, n = key.split("/")
        src = int(pair[0])
        starts, ends = results[src]["times"][key], results[1 - src]["times"][key]
        latencies = sorted(e - s for s, e in zip(starts, ends))
        nbytes = int(n) * m["kv_bytes_per_block"]
        point = {"p50_s": percentile(latencies, 0.5), "p95_s": percentile(latencies, 0.95), "bytes": nbytes,
                 "copy_fraction_p50": round(nbytes / percentile(latencies, 0.5) / copy_Bps, 4)}
        if path == "pack":
            point["bytes_equal"] = results[src]["checks"][key] == results[1 - src]["checks"][key]
            if not point["bytes_equal"]:
                wrong.append(key)
        profile["pairs" if path == "pack" else "raw"].setdefault(pair, {})[n] = point
    profile["environment"] = environment(args)
    profile["environment"]["command"] = "python benchmarks/benchmark_kv_transfer.py " + shlex.join(
        argv if argv is not None else sys.argv[1:])
    print(f"kind {args.kind}, {m['preset']} ({m['layers']} layers, {m['kv_heads']} kv heads, head_dim "
          f"{m['head_dim']}, block {m['block_size']}, {m['dtype']}): {m['kv_bytes_per_block']} B per block; "
          f"device copy {copy_Bps / 1e9:.2f} GB/s")
    print(f"{'pair':>5} {'blocks':>6} {'MiB':>9} {'p50 ms':>9} {'p95 ms':>9} {'raw p50':>9} {'raw p95':>9} "
          f"{'of copy':>8} {'bytes':>6}")
    for pair, points in profile["pairs"].items():
        for n, point in points.items():
            raw = profile["raw"][pair][n]
            print(f"{pair:>5} {n:>6} {point['bytes'] / 2**20:>9.2f} {point['p50_s'] * 1e3:>9.3f} "
                  f"{point['p95_s'] * 1e3:>9.3f} {raw['p50_s'] * 1e3:>9.3f} {raw['p95_s'] * 1e3:>9.3f} "
                  f"{point['copy_fraction_p50']:>8.2%} {'equal' if point['bytes_equal'] else 'DIFFER':>6}")
    if args.json:
        args.json.write_text(json.dumps(profile, indent=1) + "\n")
    if wrong:
        print(f"bytes differ after the transfer: {wrong}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
