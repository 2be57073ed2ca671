"""CUDA graphs for the steps that prefill: every layer's work but its attention, captured per
padded token count, with the attention launched eagerly between them.

A step that prefills launches hundreds of kernels from Python, a few tens of microseconds of
host each: 17 ms for one question over a cached 16k document on an H200 host (10 ms on an H100's),
against about 1.5 ms on the device; 5 ms through these pieces. Its attention depends on how the
step's tokens split into sequences and where their contexts lie, which a graph would fix at
capture; everything else works row by row. So a step of
at most ``max_tokens`` token rows that no decode graph takes (``StepInputs.piece_size``) runs as
``L + 1`` graph replays and ``L`` eager attentions: the first piece embeds the tokens and computes
layer 0's queries (storing its keys and values), piece ``i`` runs layer ``i - 1`` after its
attention and layer ``i`` up to it, and the last one ends the stream with the final norm.

Pieces read and write static buffers: the step's ids, positions and slots (``[3, P]``, copied in
one go from the step's padded inputs), the queries of the layer about to attend, its attention's
output, the residual stream and the final hidden states. Rows past the step's real ones are padding, made
on the host as the decode graphs' are (token 0, position 0, slot -1: nothing is written); the
attention reads only the real rows' queries and writes only their outputs, and every other op
is row-wise, so padding never reaches a real row. Every piece shares one memory pool: a step
replays its size's pieces in the order they were captured, and steps run one after another on
one stream.

Sizes: 16, 24, 32, 48, 64, 96, ... (a power of two and one and a half times it) up to
``max_tokens``, so a step pads at most half its rows again. Without ``capture`` (a CPU, tests)
the pieces run eagerly on the same buffers: the padding and the order are then checkable
anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lmpool.engine.cuda_graphs import smallest_holding

if TYPE_CHECKING:
    from lmpool.engine.model_runner import ModelRunner
    from lmpool.engine.step_inputs import StepInputs

SMALLEST = 16


def piece_sizes(max_tokens: int) -> list[int]:
    """The padded token counts captured, up to ``max_tokens`` (which is one of them)."""
    sizes: list[int] = []
    size = SMALLEST
    while size < max_tokens:
        sizes += [s for s in (size, size * 3 // 2) if s < max_tokens]
        size *= 2
    return [*sizes, max_tokens]


class PiecewiseGraphs:
    @torch.inference_mode()
    def __init__(self, runner: ModelRunner, max_tokens: int, capture: bool = True) -> None:
        if max_tokens < 1:
            raise ValueError(f"piecewise graphs need at least one token row, got {max_tokens}")
        self.runner = runner
        self.sizes = piece_sizes(max_tokens)
        model, dev, dtype = runner.model, runner.device, runner.dtype
        c = model.config
        self.num_layers = c.num_hidden_layers
        # Rows: token ids, positions, slots (see StepInputs); slots -1 until a step copies its own.
        self.header = torch.zeros(3, max_tokens, dtype=torch.int32, device=dev)
        self.header[2].fill_(-1)
        self.queries = torch.zeros(max_tokens, c.num_attention_heads, c.head_dim, dtype=dtype, device=dev)
        self.attended = torch.zeros(max_tokens, c.num_attention_heads * c.head_dim, dtype=dtype, device=dev)
        self.residual = torch.zeros(max_tokens, c.hidden_size, dtype=dtype, device=dev)
        self.hidden = torch.zeros(max_tokens, c.hidden_size, dtype=dtype, device=dev)
        self.pieces: dict[int, list[Callable[[], None]]] = {}
        self._pool: Any = None  # the graphs' shared memory pool (torch's handle), after the first capture
        self._stream = torch.cuda.Stream(dev) if capture else None  # see DecodeGraphs
        for size in reversed(self.sizes):  # largest first, so smaller pieces reuse its memory
            pieces = [self._piece(size, i) for i in range(self.num_layers + 1)]
            self.pieces[size] = [self._capture(piece) for piece in pieces] if capture else pieces
        if capture:
            torch.cuda.synchronize(dev)

    def padded_size(self, num_rows: int) -> int | None:
        """The captured token count a step of ``num_rows`` rows pads to, or None if none holds it."""
        return smallest_holding(self.sizes, num_rows)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states of the step's real rows; valid until the next step that runs here."""
        size, header = inputs.piece_size, inputs.piece_header
        assert size is not None and header is not None  # the inputs of a piecewise step
        rows = inputs.ids.shape[0]
        model, kv_cache, ops = self.runner.model, self.runner.kv_cache, self.runner.ops
        pieces = self.pieces[size]
        self.header[:, :size].copy_(header)
        pieces[0]()
        for i in range(self.num_layers):
            self.attended[:rows].copy_(model.attend(i, self.queries[:rows], inputs.meta, kv_cache, ops))
            pieces[i + 1]()
        return self.hidden[:rows]

    def _piece(self, size: int, i: int) -> Callable[[], None]:
        """Piece ``i`` of a step of ``size`` rows, on the static buffers (module docstring)."""
        model, kv_cache, ops = self.runner.model, self.runner.kv_cache, self.runner.ops
        ids, positions, slots = self.header[0, :size], self.header[1, :size], self.header[2, :size]
        queries, attended = self.queries[:size], self.attended[:size]
        residual, hidden = self.residual[:size], self.hidden[:size]

        def first() -> None:
            q, stream = model.first_queries(ids, positions, slots, kv_cache, ops)
            queries.copy_(q)
            residual.copy_(stream)

        def middle() -> None:
            out, stream = model.after_attention(i - 1, attended, residual, ops)
            q, stream = model.next_queries(i, out, stream, positions, slots, kv_cache, ops)
            queries.copy_(q)
            residual.copy_(stream)

        def last() -> None:
            out, stream = model.after_attention(i - 1, attended, residual, ops)
            hidden.copy_(model.final_norm(out, stream, ops))

        return first if i == 0 else last if i == self.num_layers else middle

    def _capture(self, piece: Callable[[], None]) -> Callable[[], None]:
        """``piece`` captured into the pieces' memory pool; its replay. Captured as
        ``torch.cuda.graph`` does, without its device-wide synchronisation and cache emptying
        before each of the few hundred pieces: their capture stream waits for the warm-up."""
        piece()  # warm-up outside capture (lazy initialisation, cuBLAS's choice for the shape)
        assert self._stream is not None  # made where pieces are captured
        self._stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool)
            try:
                piece()
            finally:
                graph.capture_end()
        self._pool = graph.pool()
        return graph.replay
