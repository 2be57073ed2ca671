"""Log-probabilities on the device: of sampled tokens, and of prompt tokens.

Computed from the raw logits (log_softmax in float32, before temperature, penalties, top-k or
top-p), only for the rows of requests that ask, and left on the device until the step's
tokens are read back (``DeviceLogprobs.read``; on a GPU they are copied to pinned host memory
with the tokens, ``staged``), so a request that does not ask costs nothing and one that does
adds no wait of its own. A prompt's logprobs need the logits of every prompt
position, which a normal step never computes (it projects only each sequence's last row):
``prompt_rows`` names the hidden rows a step must project for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmpool.engine.sampler import to_device
from lmpool.engine.sequence import Sequence
from lmpool.token_logprobs import TokenLogprobs

# Prompt positions projected to logits at once: a chunk of 8,192 tokens over a 152k vocabulary
# would otherwise take 5 GB of float32 logits.
PROMPT_ROWS_PER_SLICE = 512


@dataclass
class DeviceLogprobs:
    """Per row: the target token's logprob and the top ``k`` alternatives (``k`` per row, the
    tensors as wide as the largest), on the device until ``read``."""

    targets: torch.Tensor  # [R] int64
    chosen: torch.Tensor  # [R] float32
    top_ids: torch.Tensor  # [R, kmax]
    top_values: torch.Tensor  # [R, kmax]
    ks: list[int]

    def staged(self) -> DeviceLogprobs:
        """A copy in pinned host memory, queued now (non-blocking): read it once the stream has
        passed this point (``PendingTokens.result``), without waiting for later work."""
        return DeviceLogprobs(staged(self.targets), staged(self.chosen), staged(self.top_ids), staged(self.top_values),
                              self.ks)

    def read(self) -> list[TokenLogprobs]:
        targets, chosen = self.targets.tolist(), self.chosen.tolist()
        ids, values = self.top_ids.tolist(), self.top_values.tolist()
        return [TokenLogprobs(t, c, i[:k], v[:k]) for t, c, i, v, k in zip(targets, chosen, ids, values, self.ks)]


def staged(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s copy into pinned host memory, queued on the current stream."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor, ks: list[int]) -> DeviceLogprobs:
    """The logprobs of ``targets[R]`` under ``logits[R, vocab]`` and each row's top ``ks[r]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, targets.view(-1, 1)).view(-1)
    top = logp.topk(max(ks), dim=-1) if max(ks) else None
    empty = logp.new_empty(len(ks), 0)
    return DeviceLogprobs(targets, chosen, top.indices if top is not None else empty.long(),
                          top.values if top is not None else empty, list(ks))


@dataclass
class SampledLogprobs:
    """The logprobs of a step's sampled tokens, for the rows (``rows``) whose requests asked."""

    rows: list[int]
    logprobs: DeviceLogprobs

    def by_row(self, num_rows: int) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * num_rows
        for row, value in zip(self.rows, self.logprobs.read()):
            out[row] = value
        return out


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list) -> SampledLogprobs | None:
    """The logprobs of ``tokens`` (one per row of ``logits``) for the rows whose params ask; None if none does."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    index = to_device(rows, torch.int64, logits.device)
    ks = [params[i].logprobs for i in rows]
    return SampledLogprobs(rows, logprobs_of(logits.index_select(0, index), tokens.index_select(0, index), ks))


@dataclass
class PromptSlice:
    """Logprobs of prompt tokens ``first .. first + len - 1`` of one sequence, from one step."""

    seq: Sequence
    first: int  # the prompt position of the first target token
    logprobs: DeviceLogprobs


def prompt_targets(seq: Sequence, start: int, count: int) -> int:
    """How many of the rows a step computes for ``seq`` (positions ``start .. start + count - 1``)
    predict a prompt token (row ``p`` predicts token ``p + 1``; the first token has no logprob)."""
    if seq.params.prompt_logprobs is None:
        return 0
    return max(0, min(start + count, seq.num_prompt_tokens - 1) - start)


def prompt_logprobs(project, hidden: torch.Tensor, seq: Sequence, row: int, start: int, count: int) -> PromptSlice:
    """Logprobs of prompt tokens ``start + 1 .. start + count`` from the hidden rows ``row ..
    row + count - 1`` (``project`` turns hidden rows into logits), a slice of rows at a time.
    The targets are prompt tokens, which the host always knows."""
    k = seq.params.prompt_logprobs
    assert k is not None  # asked only for a request with prompt logprobs
    targets = to_device(seq.token_ids[start + 1 : start + count + 1].tolist(), torch.int64, hidden.device)
    parts = []
    for at in range(0, count, PROMPT_ROWS_PER_SLICE):
        n = min(PROMPT_ROWS_PER_SLICE, count - at)
        parts.append(logprobs_of(project(hidden[row + at : row + at + n]), targets[at : at + n], [k] * n))

    def cat(field: str) -> torch.Tensor:
        return torch.cat([getattr(p, field) for p in parts])

    merged = DeviceLogprobs(cat("targets"), cat("chosen"), cat("top_ids"), cat("top_values"), [k] * count)
    return PromptSlice(seq, start + 1, merged)
