"""Runs, once before a CUDA engine serves, the work a step picks by its shape, so that no step
pays a first use.

The first time a process runs a matrix product of a new shape class (cuBLAS picks and loads a
kernel for it), or a kernel it has not run before, the launch waits for the device to finish
everything queued: measured on an H200 (``tools.diagnostics.profile_launch``), a mixed step's
launch held its worker's loop for a whole step before it (70-320 ms) the first time its
sampled-row count came up, and took 14-25 ms once the same shapes had run. The decode graphs
cover only the forward at their batch sizes; this covers what they leave out:

- the logits of every sampled-row count up to ``max_num_seqs`` (every count up to
  ``EVERY_ROW_UP_TO``, then every ``ROW_STRIDE``th), in the model's dtype and in fp32, with
  their argmax and finite-row check;
- each distinct linear layer at a ladder of token counts up to ``max_num_batched_tokens``;
- the on-device copy of pending input tokens.

Invariants: it reads and writes only scratch tensors of its own (no KV block, no input arena,
no random stream is touched), and it waits for the device before returning. A CPU engine, which
has no such first use, does not run it (it would run there, as the tests do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lmpool.model.qwen3 import Qwen3ForCausalLM

EVERY_ROW_UP_TO = 256
ROW_STRIDE = 16
TOKEN_STEPS = ((1024, 16), (None, 64))  # (up to, stride): every 16th count to 1k, then every 64th


def row_counts(max_rows: int) -> list[int]:
    """The sampled-row counts warmed: each one up to ``EVERY_ROW_UP_TO``, then every
    ``ROW_STRIDE``th, and ``max_rows`` itself."""
    counts = list(range(1, min(max_rows, EVERY_ROW_UP_TO) + 1))
    counts += range(EVERY_ROW_UP_TO + ROW_STRIDE, max_rows + 1, ROW_STRIDE)
    if counts[-1] != max_rows:
        counts.append(max_rows)
    return counts


def token_counts(max_tokens: int) -> list[int]:
    """The token counts each linear layer is warmed at: a ladder (``TOKEN_STEPS``) to ``max_tokens``."""
    counts: list[int] = []
    start = 0
    for up_to, stride in TOKEN_STEPS:
        end = max_tokens if up_to is None else min(up_to, max_tokens)
        counts += range(start + stride, end + 1, stride)
        start = max(start, end)
    if not counts or counts[-1] != max_tokens:
        counts.append(max_tokens)
    return counts


@torch.inference_mode()
def warm_up(model: Qwen3ForCausalLM, device: torch.device, dtype: torch.dtype,
            max_rows: int, max_tokens: int) -> None:
    """Run the shapes above on ``model`` on the current stream."""
    hidden = model.config.hidden_size
    scratch = torch.zeros(max(max_rows, max_tokens), hidden, dtype=dtype, device=device)
    for rows in row_counts(max_rows):
        logits = model.compute_logits(scratch[:rows], fp32=False)
        logits.argmax(dim=-1)
        torch.isfinite(logits).all(dim=-1)
        model.compute_logits(scratch[:rows]).argmax(dim=-1)
    for layer in distinct_linears(model.layers):
        x = torch.zeros(max_tokens, layer.in_features, dtype=dtype, device=device)
        for tokens in token_counts(max_tokens):
            layer(x[:tokens])
    ids = torch.zeros(max_rows, dtype=torch.int32, device=device)
    previous = torch.zeros(max_rows, dtype=torch.int64, device=device)
    index = torch.arange(max_rows, device=device)
    ids.index_copy_(0, index, previous.index_select(0, index).to(ids.dtype))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def distinct_linears(layers: torch.nn.Module) -> list[torch.nn.Linear]:
    """One linear layer of ``layers`` (the decoder layers: not the head, which sees sampled rows
    only) per distinct weight shape."""
    seen: dict[tuple[int, int], torch.nn.Linear] = {}
    for module in layers.modules():
        if isinstance(module, torch.nn.Linear):
            seen.setdefault((module.in_features, module.out_features), module)
    return list(seen.values())
