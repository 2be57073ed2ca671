"""A packed KV transfer in layer chunks, so that packing, the wire and unpacking overlap:
``send_blocks`` packs and sends every chunk at once, ``BlockReceiver`` posts every receive
and unpacks, in order, the chunks that have arrived each time it is polled. ``cut`` plans
the chunks ("even", "even^F", "ends^F", "taper"; measurements behind the default shape:
benchmarks/results/kv_transfer_NOTES.md).

Invariants:
- sender and receiver cut from the layer count and payload size alone, so they agree on
  the number and sizes of the messages; chunk i of a plan carries ``chunk_tag(plan_id, i)``.
- a chunk is unpacked only after its receive completed and only while ``wanted()`` holds
  (the plan is open): bytes of a plan that ended are dropped, never written.
- a failed chunk ends the whole transfer with that chunk's error.
- a receiver is done only once its last unpack has completed on the device, so the blocks a
  destination publishes hold their bytes (a source reading them need wait for nothing).
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable

import torch

from lmpool.dataplane.transport import Handle, TransferTimeout, TransportError, plan_tag, poll_until

# Each chunk costs a fixed start-up on the wire (an NCCL operation's launch and handshake),
# and only the first pack and the last unpack are exposed, so a few large chunks beat many
# small ones. Measured over an NVLink pair of H200s (results/h200x2/
# kv_transfer_h200x2_nccl_variants.json, 28 MiB blocks): 2 chunks were best at 112 MiB,
# 4-8 at 448 MiB and 1.75 GiB, 16 chunks lost 3-8 points against 8.
CHUNK_BYTES = 48 << 20
MAX_CHUNKS = 8


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_max_ctas(device: torch.device) -> int:
    """The pack/unpack grid cap for the chunks a transfer overlaps with the wire, on
    ``device``: one CTA per SM on a GPU (0, no cap, elsewhere). NCCL's kernels copy beside
    these packs and unpacks; an uncapped grid fills every SM and delays them, while one CTA
    per SM still nearly saturates HBM. On the H200 pair from 448 MiB on: 8 chunks capped at
    132 CTAs reached 84-89 % of raw NCCL against 81-85 % uncapped (the variants run), then
    78-88 % against 76-85 % in the run of the final setting (``kv_transfer_h200x2_nccl.json``).
    The end chunks overlap nothing and go uncapped (``EDGE_CTAS``)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 0


# The grid of the end chunks (the first pack, which the wire waits for, and the last unpack,
# which the transfer's end waits for): uncapped, as nothing runs beside them. Side by side
# on the H200 pair over nccl_lib, paths in shuffled order (results/h200x2/direct/), uncapped
# ends beat ends capped at 132 CTAs at 11 of 12 points from 224 MiB to 1.75 GiB, by 0.6-1.4
# points of raw NCCL, where two paths of identical settings differed by 0.8 at most.
EDGE_CTAS = 0


# The default: near-equal chunks, the larger in the middle. Side by side on the H200 pair
# (results/h200x2/direct/16_*, 8 chunks of 28 layers over 3 lanes), 3, 3, 4, 4, 4, 4, 3, 3
# layers read 0.2-2.3 points of raw NCCL above 4, 3, 3, 4, 4, 3, 3, 4 at 11 of 14 sizes and
# directions from 224 MiB to 896 MiB (0.2-1.9 below at the other 3); ends twice smaller still
# (2, 4, ..., 4, 2) read 2.1 below to 0.9 above the latter, growing by 1.25 1.2 below to 1.5
# above.
SHAPE = "even"


def layer_chunks(layers: int, payload_bytes: int, chunk_bytes: int = CHUNK_BYTES,
                 chunks: int | None = None, weights: Callable[[int], list[float]] | None = None
                 ) -> list[tuple[int, int]]:
    """``[(first_layer, end_layer), ...]`` covering ``range(layers)``: ``chunks`` parts if
    given, else one per ``chunk_bytes``, never more than the layers or ``MAX_CHUNKS``;
    near-equal (the larger in the middle: the ends' pack and unpack are exposed), or in
    proportion to ``weights(k)`` for k parts (``apportion``)."""
    _check_cut(layers, chunks)
    wanted = chunks if chunks is not None else payload_bytes // max(1, chunk_bytes)
    k = max(1, min(MAX_CHUNKS, layers, wanted))
    return _spans([0, *itertools.accumulate(apportion(layers, weights(k) if weights else [1.0] * k))])


def growing(factor: float) -> Callable[[int], list[float]]:
    """Weights of k chunks growing by ``factor`` from both ends towards the middle."""
    return lambda k: [factor ** min(j, k - 1 - j) for j in range(k)]


def small_ends(factor: float) -> Callable[[int], list[float]]:
    """Weights of k chunks alike but the two at the ends, ``factor`` times smaller: only the
    first pack and the last unpack are exposed, while the middle chunks, whose packs overlap
    the wire, keep their near-equal size. With two chunks or fewer every chunk is an end."""
    return lambda k: [1.0 if j in (0, k - 1) else float(factor) for j in range(k)]


def apportion(layers: int, weights: list[float]) -> list[int]:
    """Layer counts in proportion to ``weights``: each at least one, summing to ``layers``
    (``len(weights) <= layers``); of equal weights, the larger counts are the middle ones."""
    ideal = [layers * w / sum(weights) for w in weights]
    counts = [max(1, int(x)) for x in ideal]
    while sum(counts) > layers:  # the floor of one layer overshot: take from the largest
        counts[counts.index(max(counts))] -= 1
    middle = (len(counts) - 1) / 2
    while sum(counts) < layers:  # the remainder goes where the count falls shortest, the middle first on a tie
        short = [x - n for x, n in zip(ideal, counts)]
        counts[max(range(len(counts)), key=lambda j: (short[j], -abs(j - middle)))] += 1
    return counts


def _check_cut(layers: int, chunks: int | None) -> None:
    if layers < 1:
        raise ValueError(f"a payload has at least one layer, got {layers}")
    if chunks is not None and chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")


def _spans(bounds: list[int]) -> list[tuple[int, int]]:
    """``[(bounds[0], bounds[1]), (bounds[1], bounds[2]), ...]``."""
    return list(zip(bounds, bounds[1:]))


# The tapered plan's model, in bytes of wire time. Alone, the pack and unpack kernels move
# 1.8 GB/ms on an H200 (results/kernels_NOTES.md) against NCCL's 0.35-0.37 GB/ms over the
# NVLink pair, a factor of 5, taken as 4. A linear fit of raw NCCL send/recv times leaves
# 70-90 us per operation; the near-equal chunking's ratios fit a marginal cost near 45 us,
# 16 MiB of wire time, per chunk beyond the first. Beside NCCL's kernels the packs proved
# slower than the factor says: the tapered plans lost from 8 to 32 blocks, so the shape is
# opt-in until the factor is measured under that contention. The start-up term models one
# NCCL lane; over several the start-up hides behind the previous chunk.
PACK_OVER_WIRE = 4.0
CHUNK_START_BYTES = 16 << 20


def taper(layers: int, chunks: int, factor: float = PACK_OVER_WIRE) -> list[int]:
    """Layer counts of ``chunks`` chunks whose sizes grow by ``factor`` from both ends
    towards the middle (each at least one layer, summing to ``layers``)."""
    if not 1 <= chunks <= layers:
        raise ValueError(f"chunks must be in [1, {layers}] for {layers} layers, got {chunks}")
    if not factor >= 1:
        raise ValueError(f"a taper's growth factor is at least 1, got {factor}")
    return apportion(layers, growing(factor)(chunks))


def modelled_overhead(counts: list[int], layer_bytes: float, r: float = PACK_OVER_WIRE) -> float:
    """Wire-time bytes that cutting a payload into chunks of ``counts`` layers adds to its own,
    packing ``r`` times as fast as the wire: the first pack and the last unpack, a start-up
    per extra chunk, and any pack (unpack) that outlasts the previous (next) chunk's time on
    the wire."""
    size = [n * layer_bytes for n in counts]
    cost = (size[0] + size[-1]) / r + (len(size) - 1) * CHUNK_START_BYTES
    cost += sum(max(0.0, size[j] / r - size[j - 1]) for j in range(1, len(size)))
    cost += sum(max(0.0, size[j] / r - size[j + 1]) for j in range(len(size) - 1))
    return cost


def tapered_chunks(layers: int, payload_bytes: int, chunks: int | None = None,
                   factor: float = PACK_OVER_WIRE) -> list[tuple[int, int]]:
    """``[(first_layer, end_layer), ...]`` covering ``range(layers)`` in chunks tapered by
    ``factor`` (``taper``): ``chunks`` of them if given, else the count, at most
    ``MAX_CHUNKS``, whose ``modelled_overhead`` (packing ``factor`` times as fast as the
    wire) is least (the fewer chunks on a tie)."""
    _check_cut(layers, chunks)
    most = min(MAX_CHUNKS, layers)
    if chunks is not None:
        counts = taper(layers, min(chunks, most), factor)
    else:
        plans = [taper(layers, k, factor) for k in range(1, most + 1)]
        counts = min(plans, key=lambda c: (modelled_overhead(c, payload_bytes / layers, factor), len(c)))
    return _spans([0, *itertools.accumulate(counts)])


@functools.lru_cache(maxsize=4096)
def cut(layers: int, payload_bytes: int, shape: str = SHAPE, chunks: int | None = None,
        chunk_bytes: int = CHUNK_BYTES) -> tuple[tuple[int, int], ...]:
    """The chunks of a payload: ``shape`` "even" (``layer_chunks``, whose floor is
    ``chunk_bytes``), "even^F" (as many, ``growing`` by F), "ends^F" (as many, the two ends F
    times smaller: ``small_ends``), "taper" (``tapered_chunks``) or "taper^F" (tapered by F,
    counted by the model). Cached: one plan per payload size."""
    name, caret, factor = shape.partition("^")
    if name == "even" and not caret:
        return tuple(layer_chunks(layers, payload_bytes, chunk_bytes, chunks))
    if name in ("even", "ends") and caret:
        weights = (growing if name == "even" else small_ends)(_factor(factor))
        return tuple(layer_chunks(layers, payload_bytes, chunk_bytes, chunks, weights))
    if name == "taper":
        return tuple(tapered_chunks(layers, payload_bytes, chunks, _factor(factor) if caret else PACK_OVER_WIRE))
    raise ValueError(f"a chunk shape is 'even', 'taper', 'even^F', 'ends^F' or 'taper^F', got {shape!r}")


def _factor(text: str) -> float:
    try:
        factor = float(text)
    except ValueError:
        raise ValueError(f"a shape's growth factor is a number, got {text!r}") from None
    if not factor >= 1:
        raise ValueError(f"a shape's growth factor is at least 1, got {factor}")
    return factor


def chunk_tag(plan_id: int, index: int) -> int:
    """The tag of chunk ``index`` of a plan's payload (distinct for the plans in flight)."""
    return plan_tag(plan_id * MAX_CHUNKS + index)


def payload_bytes(cache: torch.Tensor, num_blocks: int) -> int:
    return cache[:, :, :1].numel() * num_blocks * cache.element_size()


class _Chunks:
    """What the two ends share: every chunk's transport handle, polled in order."""

    what: str
    error: str | None

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout: float) -> None:
        if not poll_until(self.done, timeout):
            raise TransferTimeout(f"{self.what} did not complete within {timeout}s")
        if self.error is not None:
            raise TransportError(f"{self.what} failed: {self.error}")

    @staticmethod
    def _failure(handle) -> str | None:
        """The error of a handle that is done (None: it succeeded)."""
        try:
            handle.wait(0)
        except (TransportError, TransferTimeout, RuntimeError) as e:
            return str(e)
        return None


class BlockSender(_Chunks):
    def __init__(self, handles: list, what: str) -> None:
        self.what, self.error = what, None
        self._handles = handles

    def done(self) -> bool:
        while self._handles and self.error is None:
            if not self._handles[0].done():
                return False
            self.error = self._failure(self._handles.pop(0))
        return True


def chunk_floor(transport, chunk_bytes: int | None = None) -> int:
    """``chunk_bytes`` if given, else the transport's own floor (its ``chunk_bytes``
    attribute, when set), else ``CHUNK_BYTES``. Both ends of a pair get one value: they are given the
    same argument, and their transports are alike (NCCL checks its lanes at connect)."""
    if chunk_bytes is not None:
        return chunk_bytes
    return getattr(transport, "chunk_bytes", None) or CHUNK_BYTES


def _plan(transport, cache: torch.Tensor, num_blocks: int, shape: str, chunks: int | None,
          chunk_bytes: int | None) -> tuple[tuple[int, int], ...]:
    """The one plan both ends of a transfer cut: sender and receiver call this alike."""
    return cut(cache.shape[0], payload_bytes(cache, num_blocks), shape, chunks, chunk_floor(transport, chunk_bytes))


def _grids(cache: torch.Tensor, max_ctas: int | None, edge_ctas: int | None) -> tuple[int, int]:
    """The grid caps of the chunks between the ends and of the end chunks (the first pack, the
    last unpack): ``max_ctas`` (None: ``default_max_ctas``) and ``edge_ctas`` (None:
    ``EDGE_CTAS`` where ``max_ctas`` is None too, else ``max_ctas``: a caller who caps the
    grids caps them all unless it says otherwise)."""
    if max_ctas is None:
        return default_max_ctas(cache.device), EDGE_CTAS if edge_ctas is None else edge_ctas
    return max_ctas, max_ctas if edge_ctas is None else edge_ctas


def send_blocks(transport, peer: int, ops, cache: torch.Tensor, block_ids: torch.Tensor, plan_id: int,
                shape: str = SHAPE, chunks: int | None = None, chunk_bytes: int | None = None,
                max_ctas: int | None = None, edge_ctas: int | None = None, keep_payload: bool = False) -> BlockSender:
    """Pack blocks ``block_ids`` of every layer of ``cache`` and send them to ``peer``, in chunks
    (``cut`` with ``chunk_floor``; the receiver must cut alike); ``max_ctas`` and ``edge_ctas``
    cap the pack kernels' grids (``_grids``: the first pack's is the edge's), and
    ``keep_payload`` drops their evict-first store hints (``pack_kv``)."""
    middle, edge = _grids(cache, max_ctas, edge_ctas)
    handles = []
    cuts = _plan(transport, cache, len(block_ids), shape, chunks, chunk_bytes)
    for i, (first, end) in enumerate(cuts):
        payload = ops.pack_kv(cache[first:end], block_ids, edge if i == 0 else middle, keep_payload)
        handles.append(transport.send(peer, payload, chunk_tag(plan_id, i)))
    return BlockSender(handles, f"send of {len(block_ids)} blocks to rank {peer} (plan {plan_id})")


class BlockReceiver(_Chunks):
    """Receive ``block_ids``' blocks of every layer from ``peer`` into ``cache``, in chunks."""

    def __init__(self, transport, peer: int, ops, cache: torch.Tensor, block_ids: torch.Tensor, plan_id: int,
                 wanted: Callable[[], bool] = lambda: True, shape: str = SHAPE, chunks: int | None = None,
                 chunk_bytes: int | None = None, max_ctas: int | None = None, edge_ctas: int | None = None) -> None:
        self.what, self.error = f"receive of {len(block_ids)} blocks from rank {peer} (plan {plan_id})", None
        self._ops, self._cache, self._ids, self._wanted = ops, cache, block_ids, wanted
        self._ctas, self._last_ctas = _grids(cache, max_ctas, edge_ctas)
        self._pending: list[tuple[int, int, torch.Tensor, Handle]] = []
        cuts = _plan(transport, cache, len(block_ids), shape, chunks, chunk_bytes)
        for i, (first, end) in enumerate(cuts):
            buffer = torch.empty((end - first, 2, len(block_ids), *cache.shape[3:]), dtype=cache.dtype,
                                 device=cache.device)
            self._pending.append((first, end, buffer, transport.recv(peer, buffer, chunk_tag(plan_id, i))))
        self.unpacked = 0  # chunks written into the cache
        self._written: torch.cuda.Event | None = None  # after the last unpack, on a GPU

    def done(self) -> bool:
        """Every chunk received and, unless it failed, its bytes in the cache: a GPU's unpacks
        have completed, not only been queued (what the blocks' publication needs)."""
        while self._pending and self.error is None:
            first, end, buffer, handle = self._pending[0]
            if not handle.done():
                return False
            self._pending.pop(0)
            self.error = self._failure(handle)
            if self.error is None and self._wanted():
                ctas = self._ctas if self._pending else self._last_ctas
                self._ops.unpack_kv(self._cache[first:end], self._ids, buffer, ctas)
                self.unpacked += 1
                if not self._pending and self._cache.is_cuda:
                    self._written = torch.cuda.Event()
                    self._written.record(torch.cuda.current_stream(self._cache.device))
        return self._written is None or self._written.query()
