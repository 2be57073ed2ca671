"""KV transfer latency and bandwidth between two worker processes, per block count: the
profile the transfer cost model reads (``lmpool/control/transfers/cost_model.py``).

Modes (``--kind``):

- ``gloo``: two CPU workers.
- ``cuda_ipc``: two workers sharing one GPU (``--device``, default cuda:0).
- ``nccl``: two workers on two GPUs (cuda:0, cuda:1), for the side-by-side comparison of
  the packed NCCL transfer, a raw ``torch.distributed`` send/recv of the same bytes, and a
  CUDA IPC pull across the GPUs. NCCL runs with ``NCCL_NVLS_ENABLE=0`` unless set.
- ``pool``: the real pool path on one GPU with two replicas (``transfer/kv_transfer_pool.py``).

For each directed pair (0->1, then 1->0) and each block count the workers measure, in
turns within every repetition, the paths their kind offers:

- ``pull`` (cuda_ipc, nccl): the destination copies the source's blocks straight out of
  the source's mapped cache into its own blocks (``CudaIpcTransport.pull``: one kernel,
  no payload); from the destination's synchronized start to the copy's completion seen
  by the host (polled without pauses, so the figure is the data path's, not a polling
  policy's);
- ``pack``: the sender packs random block ids of its cache and sends them, the receiver
  receives them and unpacks them into other block ids, in layer chunks that overlap
  (``lmpool.dataplane.chunked``, as the pool's executor does); from just before the first
  pack to just after the last unpack has completed (cuda_ipc: through the staging
  buffer; nccl: ``NcclTransport``);
- ``raw``: the same bytes sent from a ready payload into a ready buffer, no pack, no
  unpack (nccl: a plain ``torch.distributed`` process group's send/recv);
- ``send`` and ``chunks`` (nccl): the same ready bytes over ``NcclTransport``, whole (one
  operation) and in the packed path's chunks over its lanes. Beside ``raw`` and ``pack`` they
  tell what the transport's wire costs from what packing and unpacking cost.
- ``only-pack`` and ``only-unpack`` (``--split``): ``pack`` with one end bare: the
  sender packs and the receiver lands the chunks in a ready buffer, or the sender sends
  ready chunks and the receiver unpacks them. Beside ``chunks`` and ``pack`` they split
  packing's cost between the two ends.

Timestamps come from ``time.monotonic()``, one clock for every process of a host, so a
one-way latency needs no round trip. Before each repetition of ``pack`` and ``raw`` the
receiver has started its receive (nccl raw: is about to) and tells the sender to go, with
a 4-byte message outside the timed span. The paths take turns within every repetition,
in an order shuffled afresh for each (``path_order``), so that no path always follows the
same one and carries what that one leaves behind. ``pairs`` in the output is the path the pool's
transfer executor uses for the kind (gloo and GPUs without peer access: ``pack``; one GPU
and peer-accessible GPUs: ``pull``), so the cost model reads the curve the pool will see.

Bytes are checked in an untimed warm-up repetition of every size and path: a fingerprint
of the source's blocks against one of the destination's blocks afterwards; any difference
fails the run.

**Bandwidth, and the fraction of copy bandwidth.** Every bandwidth here counts payload
bytes once: ``bytes / seconds``, where ``bytes`` is the KV of the blocks moved. The
baseline is a plain ``copy_`` of a contiguous buffer of the same number of bytes, within
one process on the source's device, timed the same way (host clock, from a synchronized
start until the copy has completed), median of 10. ``copy_fraction_p50`` is
``copy_seconds(n) / transfer_p50(n)`` for the same ``n``: the transfer's bandwidth as a
fraction of a device copy of the same size. A copy reads and writes every byte, as a
pull does; device notes that quote read plus write (4.24 TB/s on an H200) count twice
what this benchmark calls copy bandwidth. Across two GPUs the baseline is still the
source device's local copy: the fraction then says how close the link gets to HBM.

**Against raw NCCL** (nccl): ``nccl_ratios`` holds raw's p50 over each other path's, per
direction and size; ``nccl_ratio_ci95`` its 95 % interval from resampling the repetitions
(both paths ran in each, so a resample takes both), to tell a goal met from one straddled.

    python -m benchmarks.benchmark_kv_transfer --kind gloo --json profile.json
    python -m benchmarks.benchmark_kv_transfer --kind cuda_ipc --preset 0.6b --json profile.json      # one GPU
    python -m benchmarks.benchmark_kv_transfer --kind nccl --preset 0.6b --sizes 1,2,4,8,16 --json nccl.json  # two GPUs
    python -m benchmarks.benchmark_kv_transfer --kind pool --preset 0.6b --profile profile.json --json pool.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import msgspec
import numpy as np
import torch

from lmpool.model.make_model import DEFAULT_DTYPE, PRESETS
from lmpool.ops import get_backend
from lmpool.dataplane import make_transport
from lmpool.frontend.rendezvous import Rendezvous
from lmpool.dataplane.chunked import BlockReceiver, chunk_floor, chunk_tag, cut, default_max_ctas, send_blocks
from lmpool.protocol.cuda_ipc import CudaIpcExport

from benchmarks.transfer.kv_transfer_pool import pool_main
from benchmarks.transfer.record import DTYPES, environment, percentile, shape

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
WAIT_S = 120.0
COPY_SAMPLES = 10


def cpu_sets(text: str) -> list[set[int]]:
    """``"0-3/16,18"`` -> ``[{0, 1, 2, 3}, {16, 18}]``: each worker's CPUs, ranges and lists."""
    sets = []
    for part in text.split("/"):
        cpus: set[int] = set()
        for item in filter(None, part.split(",")):
            first, _, last = item.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
        if not cpus:
            raise argparse.ArgumentTypeError(f"no CPU in {part!r} of {text!r}")
        sets.append(cpus)
    if len(sets) != 2:
        raise argparse.ArgumentTypeError(f"two CPU sets (rank 0's/rank 1's) are needed, got {len(sets)} in {text!r}")
    return sets


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=("gloo", "cuda_ipc", "nccl", "pool"), default="gloo")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the preset's")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="block counts, comma-separated")
    p.add_argument("--reps", type=int, default=30, help="timed repetitions per size, path and pair")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default=None, help="default: cpu for gloo, cuda:0 for cuda_ipc and pool")
    p.add_argument("--reference-ops", action="store_true", help="torch pack/unpack/pull even on CUDA")
    p.add_argument("--model", default=None, help="pool: a Qwen3 checkpoint (default: a random one of --preset)")
    p.add_argument("--profile", type=Path, default=None,
                   help="pool: a data-path profile of this machine; the output adds its curves and the residuals")
    p.add_argument("--pack-variants", type=lambda v: [x for x in v.split(",") if x], default=[],
                   help="extra packed paths beside the default, comma-separated, each S, S:C, S/L or S:C/L: S is "
                        "auto (the default chunks), even (near-equal chunks of >= the transport's floor), "
                        "taper (tapered chunks), "
                        "K (K near-equal chunks), tK (K tapered chunks) or ends^F (as many as even, the two ends "
                        "F times smaller), any but auto and ends followed by ^F growing by F from the ends; "
                        "C caps the pack/unpack grids at C CTAs, "
                        "C+E those of the end chunks (the first pack, the last unpack) at E "
                        "(0: uncapped); L (nccl) sends over L communicators per direction, taken in turn; "
                        "a final ~keep stores the packs' payload without evict-first hints")
    p.add_argument("--split", action="store_true",
                   help="also the packed path's halves, only-pack (the receiver lands the chunks as "
                        "they are) and only-unpack (the sender sends ready chunks), to tell the sender's "
                        "share of packing's cost from the receiver's")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--trace", type=Path, default=None,
                   help="nccl, cuda_ipc: each worker writes a kernel trace of the run (torch.profiler) to "
                        "TRACE/trace_rank{r}.json, every transfer a range named PATH/SRC->DST/BLOCKS#REP; "
                        "transfer_trace.py tells where a transfer's time goes")
    p.add_argument("--cpus", type=cpu_sets, default=None,
                   help="CPUs of each worker, rank 0's then rank 1's, split by a slash (e.g. 0-3/16-19), "
                        "set before CUDA and NCCL start their threads: where the two workers' host "
                        "threads run, apart or not")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--rendezvous", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = [int(n) for n in args.sizes.split(",")]
    args.dtype = args.dtype or DEFAULT_DTYPE[args.preset]
    args.device = args.device or {"gloo": "cpu", "nccl": "cuda"}.get(args.kind, "cuda:0")
    args.warmup = max(1, args.warmup)  # the bytes are checked in the first warm-up repetition
    if args.split and args.kind == "pool":
        p.error("--split times the two halves of a transfer between two workers; --kind pool has none")
    for v in args.pack_variants:
        try:
            variant = pack_variant(f"pack@{v}")
            ok = variant.get("chunks", 1) >= 1 and (variant["max_ctas"] or 0) >= 0 and variant.get("lanes", 1) >= 1 \
                and variant.get("edge_ctas", 0) >= 0
        except ValueError:
            ok = False
        if ok and "lanes" in variant and args.kind != "nccl":
            p.error(f"--pack-variants: {v!r} names lanes, which only --kind nccl has")
        if not ok:
            p.error(f"--pack-variants: {v!r} is not S, S:C, S/L or S:C/L (each with ~keep or not), "
                    "S one of auto, even, taper, K, tK, ends^F, any but auto with ^F (F >= 1), "
                    "C a cap or C+E, with K >= 1, C, E >= 0, L >= 1")
    return args


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


def block_ids(rank: int, n: int, num_blocks: int, device: torch.device) -> torch.Tensor:
    """The blocks rank ``rank`` moves at size ``n``: distinct, shuffled, and computable by
    the peer (a pull names the source's blocks)."""
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randperm(num_blocks, generator=g)[:n].to(device)


def spin(handle, timeout: float = WAIT_S) -> None:
    """Wait for ``handle`` by polling without pauses (a GPU transfer's end is then seen
    within microseconds); raise what its ``wait`` raises."""
    deadline = time.monotonic() + timeout
    while not handle.done():
        if time.monotonic() > deadline:
            break
    handle.wait(0 if handle.done() else timeout)


def path_order(paths: list[str], src: int, n: int, rep: int) -> list[str]:
    """The order the paths take in one repetition: a shuffle seeded by the repetition, so both
    workers compute the same one. A rotation would keep each path behind the same neighbour
    (the default ``pack`` always after ``pull``): on the H200 pair, variants then mostly read
    1-4 points of raw NCCL above ``pack``, whichever setting ran as which
    (results/kv_transfer_NOTES.md)."""
    return random.Random(f"{src}/{n}/{rep}").sample(paths, k=len(paths))


def size_order(sizes: list[int], src: int, rep: int) -> list[int]:
    """The order the sizes take in one repetition, shuffled alike on both workers: a drift in
    the machine's speed (on one H200 pair the first minute ran 2-5 % slow, and the packed paths
    more so: results/kv_transfer_NOTES.md) then spreads over every size instead of
    falling on the sizes that run first."""
    return random.Random(f"{src}/sizes/{rep}").sample(sizes, k=len(sizes))


def pack_variant(path: str) -> dict:
    """``send_blocks``/``BlockReceiver`` keywords of a packed path: ``pack`` (the pool's
    default: ``chunked.SHAPE``, grids capped but the end chunks'), ``pack@S``, ``pack@S:C``, ``pack@S/L`` or
    ``pack@S:C/L`` where S is the chunking, ``auto`` (the default's), ``even`` (near-equal
    chunks of at least the transport's floor, as auto), ``taper`` (tapered chunks, their
    modelled count), ``K`` (K near-equal chunks), ``tK`` (K tapered chunks) or ``ends^F`` (as
    many chunks as even, the two ends F times smaller: ``chunked.small_ends``), any but auto
    and ends followed by ``^F`` to grow by F from the ends (``chunked.growing``), C caps the
    pack/unpack grids at C CTAs (0: uncapped; absent: the default cap), C+E also caps the end
    chunks' (the first pack's, the last unpack's) at E, L (nccl) sends over a transport
    of L lanes (``lanes``, which the worker takes out; absent: the default
    transport's), and a final ``~keep`` stores the packs' payload without evict-first hints
    (``keep_payload``, the sender's alone)."""
    if "@" not in path:
        return {}
    spec = path.split("@", 1)[1]
    keep = spec.endswith("~keep")
    spec, slash, lanes = spec.removesuffix("~keep").partition("/")
    spec, _, ctas = spec.partition(":")
    ctas, plus, edge = ctas.partition("+")
    variant: dict = {"max_ctas": int(ctas) if ctas else None}
    if plus:
        variant["edge_ctas"] = int(edge)
    if slash:
        variant["lanes"] = int(lanes)
    if keep:
        variant["keep_payload"] = True
    spec, caret, factor = spec.partition("^")
    if caret and (spec == "auto" or not float(factor) >= 1) or spec == "ends" and not caret:
        raise ValueError(f"{path!r}: a factor is >= 1 and follows a shape other than auto; ends takes one")
    grown = f"^{factor}" if caret else ""
    if spec in ("even", "taper", "ends"):
        variant["shape"] = spec + grown
    elif spec.startswith("t"):
        variant.update(shape="taper" + grown, chunks=int(spec[1:]))
    elif spec != "auto":
        variant.update(shape="even" + grown, chunks=int(spec))
    return variant


# ---- one worker ----------------------------------------------------------------------


class Worker:
    def __init__(self, args) -> None:
        self.kind = args.kind
        self.rank, self.peer = args.worker, 1 - args.worker
        self.device = torch.device(f"cuda:{self.rank}") if args.kind == "nccl" else torch.device(args.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(1)  # two workers share the machine's cores
        self.m = shape(args)
        self.ops = get_backend(self.device, use_kernels=not args.reference_ops)
        self.num_blocks = 2 * max(args.sizes)
        g = torch.Generator(device=self.device).manual_seed(1234 + self.rank)
        self.cache = torch.randn(self.m["layers"], 2, self.num_blocks, self.m["block_size"], self.m["kv_heads"],
                                 self.m["head_dim"], generator=g, device=self.device).to(DTYPES[args.dtype])
        from lmpool.dataplane.rendezvous import open_store

        self.store = open_store(args.rendezvous, WAIT_S)
        payload_bytes = max(args.sizes) * self.m["kv_bytes_per_block"]
        self.ipc = None  # the pull path
        self.laned: dict = {}  # nccl: lanes -> a transport of that many lanes (pack@S/L)
        if args.kind == "gloo":
            self.packed = make_transport("gloo", self.rank, 2, rendezvous=args.rendezvous, timeout_s=WAIT_S)
            self.packed.connect(self.peer, session=1).wait(WAIT_S)
        elif args.kind == "cuda_ipc":
            self.packed = self.ipc = make_transport(
                "cuda_ipc", self.rank, 2, rendezvous=args.rendezvous, device=str(self.device), timeout_s=WAIT_S,
                staging_bytes=2 * payload_bytes + (1 << 20), kv_cache=self.cache, use_kernels=not args.reference_ops)
        else:
            self.packed = self._nccl(args, session=1)
            # The lane counts the variants ask for beside the default transport's, each its
            # own transport under its own session.
            for lanes in sorted({pack_variant(f"pack@{v}").get("lanes") for v in args.pack_variants} - {None}):
                if lanes != self.packed.lanes:
                    self.laned[lanes] = self._nccl(args, session=1 + lanes, lanes=lanes)
            import torch.distributed as dist

            dist.init_process_group("nccl", store=dist.PrefixStore("bench/raw", self.store), rank=self.rank,
                                    world_size=2, device_id=self.device)
            if torch.cuda.can_device_access_peer(self.rank, self.peer):
                self.ipc = make_transport("cuda_ipc", self.rank, 2, rendezvous=args.rendezvous,
                                          device=str(self.device), timeout_s=WAIT_S, kv_cache=self.cache,
                                          use_kernels=not args.reference_ops)
        if self.ipc is not None:
            self._exchange_exports()
        self.paths = [p for p in ("pull", "pack", "raw") if p != "pull" or self.ipc is not None]
        if self.kind == "nccl":  # the transport's own wire, unpacked: whole and in the default chunks
            self.paths += ["send", "chunks"]
        if args.split:
            self.paths += ["only-pack", "only-unpack"]
        self.paths[self.paths.index("pack") + 1:1] = [f"pack@{v}" for v in args.pack_variants]
        self.tag = 0
        self.go = torch.zeros(1, dtype=torch.int32, device=self.device)
        # Per pull (warm-up included): [host seconds inside pull(), GPU seconds from its
        # start until the copy completed], to tell host overhead from the copy itself.
        self.pull_detail: dict[str, list[list[float]]] = {}

    def _nccl(self, args, session: int, lanes: int | None = None):
        transport = make_transport("nccl", self.rank, 2, rendezvous=args.rendezvous, device=str(self.device),
                                   timeout_s=WAIT_S, lanes=lanes)
        if not transport.connect(self.peer, session=session).wait(WAIT_S):
            raise RuntimeError(f"rank {self.rank}: the NCCL pair connection is not up after {WAIT_S}s")
        return transport

    def _exchange_exports(self) -> None:
        # The benchmark is its own control plane: exports travel through the rendezvous.
        self.store.set(f"bench/export/{self.rank}", msgspec.msgpack.encode(self.ipc.export(peer=self.peer)))
        theirs = msgspec.msgpack.decode(self.store.get(f"bench/export/{self.peer}"), type=CudaIpcExport)
        self.ipc.connect(theirs)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wait(self, handle) -> None:
        if self.device.type == "cuda":
            spin(handle)
        else:
            handle.wait(WAIT_S)

    def payload(self, n: int) -> torch.Tensor:
        return torch.empty(self.m["layers"], 2, n, self.m["block_size"], self.m["kv_heads"], self.m["head_dim"],
                           dtype=self.cache.dtype, device=self.device)

    def run(self, args) -> dict:
        starts: dict[str, list[float]] = {}
        ends: dict[str, list[float]] = {}
        checks: dict[str, int] = {}
        for src in (0, 1):
            blocks = {}  # size -> (this end's block ids, the peer's, raw's payload or buffer, spare)
            for n in args.sizes:
                mine = block_ids(self.rank, n, self.num_blocks, self.device)  # src ids, or dst ids
                ready = self.payload(n)  # the raw path's payload (sender) / buffer (receiver)
                ready.copy_(self.ops.pack_kv(self.cache, mine))
                blocks[n] = mine, block_ids(self.peer, n, self.num_blocks, self.device), ready, self.payload(n)
            for rep in range(-args.warmup, args.reps):
                for n in size_order(args.sizes, src, rep):
                    for path in path_order(self.paths, src, n, rep):
                        key = f"{path}/{src}->{1 - src}/{n}"
                        with torch.profiler.record_function(f"{key}#{rep}"):  # a no-op unless --trace
                            t0, t1, check = self.one(src, path, *blocks[n], check=rep == -args.warmup)
                        if check is not None:
                            checks[key] = check
                        if rep >= 0:
                            if t0 is not None:
                                starts.setdefault(key, []).append(t0)
                            if t1 is not None:
                                ends.setdefault(key, []).append(t1)
        return {"starts": starts, "ends": ends, "checks": checks}

    def one(self, src: int, path: str, mine, theirs, ready, out, check: bool):
        """One transfer; returns this end's timestamps (start, end: None where the other end
        takes it) and, when ``check``, a fingerprint of the bytes it sent or received."""
        if path == "pull":
            if self.rank == src:  # the source takes no part: its blocks are simply there
                return None, None, fingerprint(self.ops.pack_kv(self.cache, mine)) if check else None
            src_ids, dst_ids = theirs.tolist(), mine.tolist()  # the host lists a pull is given
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.sync()
            began.record()  # the stream is idle: this fires at once, with t0
            t0 = time.monotonic()
            handle = self.ipc.pull(self.peer, src_ids, dst_ids)
            launched = time.monotonic()
            ended.record()  # after the copy
            spin(handle)
            self.sync()
            t1 = time.monotonic()
            self.pull_detail.setdefault(f"pull/{src}->{1 - src}/{len(dst_ids)}", []).append(
                [launched - t0, began.elapsed_time(ended) / 1e3])
            return t0, t1, fingerprint(self.ops.pack_kv(self.cache, mine)) if check else None
        if self.kind == "nccl" and path == "raw":
            return self.one_raw_nccl(src, ready, check)
        self.tag += 1
        go_tag, plan = 2 * self.tag, 2 * self.tag + 1  # distinct from every chunk tag (chunk_tag)
        packed = path.startswith("pack")
        packs, unpacks = packed or path == "only-pack", packed or path == "only-unpack"
        chunking = pack_variant(path) if packed else {}
        wire = self.laned.get(chunking.pop("lanes", None), self.packed)
        # Unpacked ends move ``ready`` as it is: whole (``raw`` but nccl's, ``send``) or in the
        # default chunks (``chunks``, and the bare end of ``only-pack`` and ``only-unpack``).
        spans = ((0, ready.shape[0]),) if path in ("raw", "send") \
            else cut(ready.shape[0], ready.nbytes, chunk_bytes=chunk_floor(wire))
        if self.rank == src:
            self.wait(self.packed.recv(self.peer, self.go, chunk_tag(go_tag, 0)))
            self.sync()
            t0 = time.monotonic()
            if packs:  # what the pool's executor does: chunks that overlap
                self.wait(send_blocks(wire, self.peer, self.ops, self.cache, mine, plan, **chunking))
            else:
                for handle in [wire.send(self.peer, ready[a:b], chunk_tag(plan, i)) for i, (a, b) in enumerate(spans)]:
                    self.wait(handle)
            # ``ready`` holds these very blocks packed: either fingerprint is the payload's
            return t0, None, fingerprint(self.ops.pack_kv(self.cache, mine) if packs else ready) if check else None
        if unpacks:
            chunking.pop("keep_payload", None)  # the sender's store hint
            receiving = [BlockReceiver(wire, self.peer, self.ops, self.cache, mine, plan, **chunking)]
        else:
            receiving = [wire.recv(self.peer, ready[a:b], chunk_tag(plan, i)) for i, (a, b) in enumerate(spans)]
        self.wait(self.packed.send(self.peer, self.go, chunk_tag(go_tag, 0)))
        for handle in receiving:
            self.wait(handle)
        self.sync()
        t1 = time.monotonic()
        return None, t1, fingerprint(self.ops.pack_kv(self.cache, mine) if unpacks else ready) if check else None

    def one_raw_nccl(self, src: int, ready, check: bool):
        """``raw`` between two GPUs: a plain process group's send/recv. One communicator
        serves both directions of the pair and runs its operations in issue order, so the
        receiver sends the go before it posts the receive (the other order deadlocks)."""
        import torch.distributed as dist

        if self.rank == src:
            dist.recv(self.go, src=self.peer)
            self.sync()  # the go has arrived, not just been queued
            t0 = time.monotonic()
            dist.send(ready, dst=self.peer)
            self.sync()
            return t0, None, fingerprint(ready) if check else None
        dist.send(self.go, dst=self.peer)
        dist.recv(ready, src=self.peer)
        self.sync()
        t1 = time.monotonic()
        return None, t1, fingerprint(ready) if check else None

    def median_seconds(self, work: Callable[[], object]) -> float:
        """Median seconds of ``work`` over ``COPY_SAMPLES`` runs after 3 unmeasured ones, each
        from a synchronized start until its device work has completed."""
        samples = []
        for i in range(COPY_SAMPLES + 3):
            self.sync()
            t0 = time.monotonic()
            work()
            self.sync()
            if i >= 3:
                samples.append(time.monotonic() - t0)
        return sorted(samples)[len(samples) // 2]

    def copy_seconds(self, sizes: list[int]) -> dict[str, float]:
        """Median seconds of a plain copy of each size's bytes on this device (the baseline)."""
        result = {}
        for n in sizes:
            nbytes = n * self.m["kv_bytes_per_block"]
            src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=self.device)
            dst = torch.empty_like(src)
            result[str(n)] = self.median_seconds(lambda: dst.copy_(src))
            del src, dst
        return result

    def kernel_seconds(self, sizes: list[int]) -> dict[str, dict[str, float]]:
        """Median seconds of packing and of unpacking each size's blocks of every layer alone on
        this device, the grid capped as a transfer's middle chunks are (``default_max_ctas``) and
        uncapped: set beside a packed transfer's excess over raw, they tell slow kernels from a
        slow host (the same kind of machine has run the packed paths several points slower on
        some loans than on others)."""
        cap = default_max_ctas(self.device)
        result = {}
        for n in sizes:
            ids = block_ids(self.rank, n, self.num_blocks, self.device)
            payload = self.ops.pack_kv(self.cache, ids)  # unpacked back where it came from: the cache stays
            result[str(n)] = {
                "pack_capped": self.median_seconds(lambda: self.ops.pack_kv(self.cache, ids, cap)),
                "pack_uncapped": self.median_seconds(lambda: self.ops.pack_kv(self.cache, ids, 0)),
                "unpack_capped": self.median_seconds(lambda: self.ops.unpack_kv(self.cache, ids, payload, cap)),
                "unpack_uncapped": self.median_seconds(lambda: self.ops.unpack_kv(self.cache, ids, payload, 0)),
            }
            del payload
        return result

    def close(self) -> None:
        for transport in {id(t): t for t in (self.packed, self.ipc, *self.laned.values()) if t is not None}.values():
            transport.close()
        if self.kind == "nccl":
            import torch.distributed as dist

            dist.destroy_process_group()


def worker_main(args) -> None:
    if args.cpus is not None:  # before any thread starts: CUDA's and NCCL's inherit it
        os.sched_setaffinity(0, args.cpus[args.worker])
    worker = Worker(args)
    if args.trace is not None and worker.device.type == "cuda":
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as trace:
            result = worker.run(args)
        args.trace.mkdir(parents=True, exist_ok=True)
        trace.export_chrome_trace(str(args.trace / f"trace_rank{worker.rank}.json"))
    else:
        result = worker.run(args)
    result["paths"] = worker.paths
    result["pull_detail"] = worker.pull_detail
    if worker.rank == 0:
        result["copy_s"] = worker.copy_seconds(args.sizes)
        result["kernel_s"] = worker.kernel_seconds(args.sizes)
    worker.close()
    print(json.dumps(result), flush=True)


# ---- the launcher --------------------------------------------------------------------


GPU_STATE = "index,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu," \
            "clocks_throttle_reasons.active"


def gpu_state() -> list[str] | None:
    """Each GPU's clocks, power, temperature and active throttle reasons, as ``nvidia-smi``
    reports them (None without it): taken before and after a run, since the same kind of
    machine has run the packed paths several points slower on some loans than on others."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={GPU_STATE}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.splitlines() if line.strip()]


def executor_path(kind: str, paths: list[str]) -> str:
    """The path the pool's transfer executor takes for this kind of pair (see
    ``lmpool.dataplane.transport.kind_for_devices``): pull where the GPUs can address each
    other, the packed payload otherwise."""
    return "pull" if kind != "gloo" and "pull" in paths else "pack"


def summarize(args, results: list[dict]) -> tuple[dict, list[str]]:
    m = shape(args)
    copy_s = results[0]["copy_s"]
    paths = results[0]["paths"]
    profile = {"kind": args.kind, "model": m, "sizes": args.sizes, "repetitions": args.reps,
               "pairs_path": executor_path(args.kind, paths), "paths": {},
               "copy_seconds": copy_s, "kernel_seconds": results[0].get("kernel_s", {}),
               "copy_bandwidth_GBps": round(max(args.sizes) * m["kv_bytes_per_block"] / copy_s[str(max(args.sizes))]
                                            / 1e9, 3)}
    wrong = []
    samples: dict[str, list[float]] = {}  # per key, the latencies in repetition order
    for key in results[0]["checks"]:
        path, pair, n = key.rsplit("/", 2)  # a path may hold a slash itself (pack@S/L)
        src = int(pair[0])
        starts = results[src]["starts"].get(key) or results[1 - src]["starts"][key]
        ends = results[1 - src]["ends"][key]
        samples[key] = [e - s for s, e in zip(starts, ends)]
        latencies = sorted(samples[key])
        nbytes = int(n) * m["kv_bytes_per_block"]
        p50 = percentile(latencies, 0.5)
        point = {"p50_s": p50, "p95_s": percentile(latencies, 0.95), "bytes": nbytes,
                 "GBps_p50": round(nbytes / p50 / 1e9, 3), "copy_fraction_p50": round(copy_s[n] / p50, 4),
                 "bytes_equal": results[src]["checks"][key] == results[1 - src]["checks"][key]}
        detail = results[1 - src].get("pull_detail", {}).get(key)
        if detail:  # the pull's breakdown, over the timed repetitions
            timed = detail[args.warmup:]
            point["host_launch_p50_s"] = percentile(sorted(d[0] for d in timed), 0.5)
            point["gpu_p50_s"] = percentile(sorted(d[1] for d in timed), 0.5)
        if not point["bytes_equal"]:
            wrong.append(key)
        profile["paths"].setdefault(path, {}).setdefault(pair, {})[n] = point
    profile["pairs"] = profile["paths"][profile["pairs_path"]]
    profile["raw"] = profile["paths"]["raw"]
    if args.kind == "nccl":
        # Every other path against raw NCCL: the ratio of the medians, and its 95 % interval
        # from resampling the repetitions (both paths ran in each, so they are resampled together).
        profile["nccl_ratios"], profile["nccl_ratio_ci95"] = {}, {}
        for path, pairs in profile["paths"].items():
            if path == "raw":
                continue
            name = "packed_over_raw" if path == "pack" else f"{path}_over_raw"
            for pair, points in pairs.items():
                for n, point in points.items():
                    ratio = round(profile["paths"]["raw"][pair][n]["p50_s"] / point["p50_s"], 4)
                    profile["nccl_ratios"].setdefault(pair, {}).setdefault(n, {})[name] = ratio
                    profile["nccl_ratio_ci95"].setdefault(pair, {}).setdefault(n, {})[name] = ratio_interval(
                        samples[f"raw/{pair}/{n}"], samples[f"{path}/{pair}/{n}"])
    return profile, wrong


def ratio_interval(raw: list[float], path: list[float], draws: int = 2000, seed: int = 0) -> list[float]:
    """The 95 % percentile-bootstrap interval of ``median(raw) / median(path)``, resampling
    repetitions: the i-th latency of each list comes from the same repetition, so a draw
    takes both or neither (pairs beyond the shorter list are left out)."""
    pairs = np.array(list(zip(raw, path)), dtype=float)
    if len(pairs) == 0:
        return [float("nan"), float("nan")]
    picks = np.random.default_rng(seed).integers(0, len(pairs), size=(draws, len(pairs)))
    ratios = np.median(pairs[picks, 0], axis=1) / np.median(pairs[picks, 1], axis=1)
    return [round(float(q), 4) for q in np.percentile(ratios, [2.5, 97.5])]


def report(profile: dict) -> None:
    m = profile["model"]
    print(f"kind {profile['kind']}, {m['preset']} ({m['layers']} layers, {m['kv_heads']} kv heads, head_dim "
          f"{m['head_dim']}, block {m['block_size']}, {m['dtype']}): {m['kv_bytes_per_block']} B per block; "
          f"device copy {profile['copy_bandwidth_GBps']:.2f} GB/s at the largest size; pairs = "
          f"{profile['pairs_path']}")
    print(f"{'path':>5} {'pair':>5} {'blocks':>6} {'MiB':>9} {'p50 ms':>9} {'p95 ms':>9} {'GB/s':>9} "
          f"{'of copy':>8} {'bytes':>6}")
    for path, pairs in profile["paths"].items():
        for pair, points in pairs.items():
            for n, point in points.items():
                print(f"{path:>5} {pair:>5} {n:>6} {point['bytes'] / 2**20:>9.2f} {point['p50_s'] * 1e3:>9.3f} "
                      f"{point['p95_s'] * 1e3:>9.3f} {point['GBps_p50']:>9.2f} {point['copy_fraction_p50']:>8.2%} "
                      f"{'equal' if point['bytes_equal'] else 'DIFFER':>6}"
                      + (f"  (inside pull() {point['host_launch_p50_s'] * 1e3:.3f} ms, GPU "
                         f"{point['gpu_p50_s'] * 1e3:.3f} ms)" if "gpu_p50_s" in point else ""))
    for n, kernels in profile.get("kernel_seconds", {}).items():
        print(f"alone on rank 0, {n} blocks: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in kernels.items()))
    for pair, points in profile.get("nccl_ratios", {}).items():
        for n, ratios in points.items():
            ci = profile["nccl_ratio_ci95"][pair][n]
            print(f"nccl {pair} {n} blocks: " + ", ".join(
                f"{k} {v:.2%} [{ci[k][0]:.1%}, {ci[k][1]:.1%}]" for k, v in ratios.items()))


def main(argv=None) -> int:
    args = parse_args(argv)
    argv = argv if argv is not None else sys.argv[1:]
    if args.kind == "pool":
        return pool_main(args, argv)
    if args.worker is not None:
        worker_main(args)
        return 0
    if args.kind == "nccl" and torch.cuda.device_count() < 2:
        print("--kind nccl needs two CUDA devices", file=sys.stderr)
        return 2
    state_before = gpu_state() if args.kind != "gloo" else None
    rendezvous = Rendezvous.create()
    # Each worker is this module again, run from the same working directory (the repository
    # root, where ``benchmarks`` imports from).
    command = [sys.executable, "-m", "benchmarks.benchmark_kv_transfer", *argv, "--rendezvous", rendezvous.address]
    env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
    workers = [subprocess.Popen([*command, "--worker", str(r)], stdout=subprocess.PIPE, text=True, env=env)
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
    profile, wrong = summarize(args, [json.loads(o.strip().splitlines()[-1]) for o in outputs])
    profile["environment"] = environment(args)
    profile["environment"]["command"] = "python -m benchmarks.benchmark_kv_transfer " + shlex.join(argv)
    if state_before is not None:
        profile["environment"]["gpu_state"] = {"fields": GPU_STATE, "before": state_before, "after": gpu_state()}
    report(profile)
    if args.json:
        args.json.write_text(json.dumps(profile, indent=1) + "\n")
    if wrong:
        print(f"bytes differ after the transfer: {wrong}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
