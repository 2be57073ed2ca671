"""CUDA graphs for decode steps: one captured forward per padded batch size.

A decode step launches hundreds of small kernels; replaying a captured graph
removes the launch gaps. Inputs live in static buffers that each replay
overwrites. Rows past the real batch are padding: slot -1 (nothing written)
and context length 1, so their attention reads one valid slot and their output
is discarded. Only graph-safe ops can be captured (the CUDA kernels: no host
synchronisation), so the torch reference path always runs eagerly.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from lmpool.model.qwen3 import AttentionMetadata

if TYPE_CHECKING:
    from lmpool.engine.model_runner import ModelRunner


def batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    @torch.inference_mode()
    def __init__(self, runner: ModelRunner, max_batch: int) -> None:
        dev = runner.device
        self.sizes = batch_sizes(max_batch)
        self.max_batch = max_batch
        self.ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_batch,), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(max_batch, runner.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        for b in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            meta = self._meta(b)
            args = (self.ids[:b], self.pos[:b], meta, runner.kv_cache, runner.ops)
            runner.model(*args)  # warm-up outside capture (lazy initialisation, autotuning)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = runner.model(*args)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(dev)

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:b],
            block_tables=self.tables[:b],
            context_lens=self.context_lens[:b],
            query_start_loc=self.query_start[: b + 1],
            is_decode=True,
        )

    def fits(self, n: int, meta: AttentionMetadata) -> bool:
        return n <= self.max_batch and meta.block_tables.shape[1] <= self.tables.shape[1]

    def replay(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = ids.shape[0]
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.ids[:n] = ids
        self.pos[:n] = pos
        self.slots[:n] = meta.slot_mapping
        self.slots[n:b] = -1
        self.tables[:n, : meta.block_tables.shape[1]] = meta.block_tables
        self.context_lens[:n] = meta.context_lens
        self.context_lens[n:b] = 1
        self.graphs[b].replay()
        return self.outputs[b][:n]
