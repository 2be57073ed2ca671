"""CUDA graphs for decode steps: one captured forward per padded batch size.

A decode step launches hundreds of small kernels; replaying a captured graph
removes the launch gaps. Inputs live in static buffers that each replay
overwrites: ids, positions, slots and context lengths form one ``[4, max_batch]``
int32 block, so a step's padded ``[4, G]`` inputs (``StepInputs.graph_header``,
already on the device) land in it with one copy, and its block table with one
more. Rows past the real batch are padding, prepared on the host: slot -1
(nothing written) and context length 1, so their attention reads one valid slot
(static table entries are always block ids some earlier step wrote, or 0) and
their output is discarded. Only graph-safe ops can be captured (the CUDA
kernels: no host synchronisation), so the torch reference path always runs
eagerly.

Batch sizes: 1, 2, 4, 8, then every multiple of 8 up to the largest, so a
replay pads at most 7 rows; decode cost is dominated by reading the weights
and the live KV, which padding rows barely add to. The attention's key splits
are chosen for the padded size, by the waves of CTAs its rows make
(``decode_splits``): padding close to the real rows keeps a short last wave of
real rows visible to that choice (33 rows padded to 48 hid theirs).

With cascades on (``EngineConfig.cascade_min_saved_tokens``), every size of two rows or more has
a second graph, its attention a cascade (``lmpool.engine.cascade``) read from a static span laid
out for the size (its rows, up to ``GRAPH_GROUPS`` groups, the table's width), which a step
copies its plan into. Its key splits are fixed at capture (the kernels size each split from the
lengths on the device), so one graph serves any grouping of its rows into that many groups.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmpool.engine.cascade import GRAPH_GROUPS, CascadePlan, cascade_offsets, cascade_views, write_cascade
from lmpool.model.qwen3 import AttentionMetadata

if TYPE_CHECKING:
    from lmpool.engine.model_runner import ModelRunner
    from lmpool.engine.step_inputs import StepInputs


def smallest_holding(sizes: list[int], n: int) -> int | None:
    """The smallest of the captured ``sizes`` (ascending) that holds ``n`` rows, or None if none does."""
    if n > sizes[-1]:
        return None
    return sizes[bisect.bisect_left(sizes, n)]


def batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    @torch.inference_mode()
    def __init__(self, runner: ModelRunner, max_batch: int, cascades: bool = False) -> None:
        dev = runner.device
        self.cascades = cascades
        self.sizes = batch_sizes(max_batch)
        self.max_batch = max_batch
        self.max_width = runner.max_blocks_per_seq
        # Rows: token ids, positions, slots, context lengths (see StepInputs).
        self.header = torch.zeros(4, max_batch, dtype=torch.int32, device=dev)
        self.header[2].fill_(-1)
        self.header[3].fill_(1)
        self.tables = torch.zeros(max_batch, self.max_width, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # Cascade graphs' static spans, holding no group until a step copies its plan in.
        self.spans: dict[int, torch.Tensor] = {}
        self.cascade_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.cascade_outputs: dict[int, torch.Tensor] = {}
        self._pool: Any = None  # the graphs' shared memory pool (torch's handle), after the first capture
        # A capture stream of this device: torch's default one is made once per process, on
        # whatever device was current then, and capturing on another device's stream fails.
        self._stream = torch.cuda.Stream(dev)
        for b in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            self.graphs[b], self.outputs[b] = self._capture(runner, b, self._meta(b))
            if cascades and b > 1:  # a plan groups two rows or more
                layout = (b, b, GRAPH_GROUPS, self.max_width)
                span = np.zeros(cascade_offsets(*layout)[-1], dtype=np.int32)
                write_cascade(span, CascadePlan([], [], [0], [], [], 0, 0), *layout)  # no group yet
                self.spans[b] = torch.from_numpy(span).to(dev)
                meta = self._meta(b)
                meta.cascade = cascade_views(self.spans[b], *layout)
                self.cascade_graphs[b], self.cascade_outputs[b] = self._capture(runner, b, meta)
        torch.cuda.synchronize(dev)

    def _capture(self, runner: ModelRunner, b: int, meta: AttentionMetadata
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The forward of ``b`` rows with ``meta``, captured (into the graphs' shared memory pool)."""
        args = (self.header[0, :b], self.header[1, :b], meta, runner.kv_cache, runner.ops)
        runner.model(*args)  # warm-up outside capture (lazy initialisation, autotuning)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            out = runner.model(*args)
        self._pool = graph.pool()
        return graph, out

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.header[2, :b],
            block_tables=self.tables[:b],
            context_lens=self.header[3, :b],
            query_start_loc=self.query_start[: b + 1],
            is_decode=True,
        )

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured batch a decode step of ``num_seqs`` sequences replays, or None if none fits."""
        return smallest_holding(self.sizes, num_seqs)

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of the ``inputs.num_seqs`` real rows; valid until the next replay."""
        b, n = inputs.graph_size, inputs.num_seqs
        assert b is not None and inputs.graph_header is not None  # the inputs of a graph step
        tables = inputs.meta.block_tables
        self.header[:, :b].copy_(inputs.graph_header)
        self.tables[:n, : tables.shape[1]].copy_(tables)
        if inputs.graph_cascade is not None:
            self.spans[b].copy_(inputs.graph_cascade)
            self.cascade_graphs[b].replay()
            return self.cascade_outputs[b][:n]
        self.graphs[b].replay()
        return self.outputs[b][:n]
