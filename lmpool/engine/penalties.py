"""Presence, frequency and repetition penalties, applied to a batch's logits as vLLM applies them.

For a row whose request is penalized: every token seen in its prompt or output has its logit
divided by ``repetition_penalty`` when positive and multiplied by it otherwise; then each
output token's logit loses ``frequency_penalty`` times its count in the output and
``presence_penalty`` once. Rows of other requests are untouched (and cost nothing).

The output counted includes the token still pending on the device (overlapped stepping: the
previous step sampled it and the host has not read it back): it is scattered in on the device
from the previous step's sampled tokens, so penalized tokens equal the serial path's.
"""

from __future__ import annotations

import torch

from lmpool.engine.sampler import to_device
from lmpool.engine.sequence import Sequence


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], previous: torch.Tensor | None) -> torch.Tensor:
    """``logits[B, vocab]`` (fp32, one row per sequence of ``seqs``) with each penalized row's
    penalties applied; a new tensor, or ``logits`` itself when no row is penalized."""
    rows = [i for i, s in enumerate(seqs) if s.params.penalized]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    seen, counts = _occurrences([seqs[i] for i in rows], previous, vocab, dev)
    params = [seqs[i].params for i in rows]
    repetition = to_device([p.repetition_penalty for p in params], torch.float32, dev).unsqueeze(1)
    frequency = to_device([p.frequency_penalty for p in params], torch.float32, dev).unsqueeze(1)
    presence = to_device([p.presence_penalty for p in params], torch.float32, dev).unsqueeze(1)
    index = to_device(rows, torch.int64, dev)
    sub = logits.index_select(0, index)
    scale = torch.where(seen, repetition.expand_as(sub), torch.ones_like(sub))
    sub = torch.where(sub > 0, sub / scale, sub * scale)
    sub = sub - frequency * counts - presence * (counts > 0).float()
    return logits.index_copy(0, index, sub)


def _occurrences(seqs: list[Sequence], previous: torch.Tensor | None, vocab: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: which tokens its prompt or output holds (bool ``[R, vocab]``) and how often
    each occurs in its output (float ``[R, vocab]``), the pending token included."""
    seen = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=device)
    counts = torch.zeros(len(seqs), vocab, dtype=torch.float32, device=device)
    prompt_rows: list[int] = []
    prompt_ids: list[int] = []
    out_rows: list[int] = []
    out_ids: list[int] = []
    pending_rows: list[int] = []
    pending_sources: list[int] = []
    for r, seq in enumerate(seqs):
        prompt, output = seq.token_ids[: seq.num_prompt_tokens], seq.token_ids[seq.num_prompt_tokens :]
        prompt_rows += [r] * len(prompt)
        prompt_ids += prompt
        out_rows += [r] * len(output)
        out_ids += output
        if seq.num_pending:
            pending_rows.append(r)
            pending_sources.append(seq.pending_row)
    _scatter(seen, counts, prompt_rows, to_device(prompt_ids, torch.int64, device), count=False)
    _scatter(seen, counts, out_rows, to_device(out_ids, torch.int64, device), count=True)
    if pending_rows:
        if previous is None:
            raise ValueError("a penalized sequence with a pending token needs the previous step's sampled tokens")
        ids = previous.index_select(0, to_device(pending_sources, torch.int64, device)).long()
        _scatter(seen, counts, pending_rows, ids, count=True)
    return seen, counts


def _scatter(seen: torch.Tensor, counts: torch.Tensor, rows: list[int], ids: torch.Tensor, count: bool) -> None:
    if not rows:
        return
    rows_t = to_device(rows, torch.int64, seen.device)
    seen.index_put_((rows_t, ids), torch.ones_like(ids, dtype=torch.bool))
    if count:
        counts.index_put_((rows_t, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
