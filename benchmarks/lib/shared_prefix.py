"""Prefill attention of sequences that share a cached prefix, the prefix read once for all of them:
a candidate for the engine's prefill, timed beside LMPool's kernel (``test_bench_kernels.py``,
``test_prefill_shared_prefix``), not used by the engine (``results/kernels_NOTES.md`` says why).

A burst's questions over one cached document each attend to the whole document: as separate
sequences, each question's query tiles read every document key (LMPool's prefill kernel: about
200 TFLOP/s on the H200 for 32 questions of 64 tokens over 16k keys, ``results/kernels_NOTES.md``).
Here a group's questions attend to its prefix in one unmasked pass, all of their query rows
against the prefix's keys gathered once (a dense library kernel over one long run of keys), and
each question to its own keys (those after the prefix: what it has cached alone and its new
tokens) causally; the two passes merge by each row's log-sum-exp of scores, as a cascade's do.

The plan (``SharedPrefix``) is the host's: which sequences share which prefix, as device index
tensors and the host lengths a launch needs. A sequence in no group attends to all of its keys in
the second pass (its ``own`` keys are its whole context).

Invariants: the result equals ``reference.paged_attention`` over the same cache up to rounding;
a group's prefix is whole blocks that every member holds ahead of its new tokens, so its keys are
visible to every member's query (the unmasked pass is exact); groups are disjoint.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lmpool.ops import reference
from lmpool.ops.dense_attention import merge


class SharedPrefix(NamedTuple):
    """Where a step's sequences' keys are, split into shared prefixes and each sequence's own."""

    prefix_slots: torch.Tensor  # [Kp] every group's prefix slots, group after group
    prefix_starts: torch.Tensor  # [G + 1] int32: group g's prefix is prefix_slots[starts[g]:starts[g + 1]]
    group_rows: torch.Tensor  # [J] int64: the query rows of the grouped sequences, group after group
    group_row_starts: torch.Tensor  # [G + 1] int32: group g's rows are group_rows[starts[g]:starts[g + 1]]
    own_slots: torch.Tensor  # [Ko] each sequence's keys after its group's prefix (all, in no group)
    own_starts: torch.Tensor  # [B + 1] int32
    max_prefix: int  # the longest prefix, the most rows of a group, the longest own keys, the longest query
    max_group_rows: int
    max_own: int
    max_query: int


def plan_shared_prefix(tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                       groups: list[tuple[list[int], int]], block_size: int,
                       device: torch.device | str = "cpu") -> SharedPrefix:
    """The plan of sequences with these block tables, context lengths (each counting its new
    tokens) and query lengths, grouped as ``groups``: (member sequences, prefix blocks) each, the
    prefix whole blocks every member holds ahead of its new tokens."""
    kv_start = [0] * len(tables)
    prefix_slots: list[int] = []
    prefix_starts, rows, row_starts = [0], [], [0]
    q_starts = [0]
    for n in query_lens:
        q_starts.append(q_starts[-1] + n)
    for members, blocks in groups:
        if len(members) < 2 or blocks < 1:
            raise ValueError(f"a group has two members or more and a prefix of a block or more: {members}, {blocks}")
        first = tables[members[0]][:blocks]
        for s in members:
            if kv_start[s]:
                raise ValueError(f"sequence {s} is in two groups")
            if tables[s][:blocks] != first or blocks * block_size > context_lens[s] - query_lens[s]:
                raise ValueError(f"sequence {s} does not hold the group's {blocks} prefix blocks before its new tokens")
            kv_start[s] = blocks * block_size
            rows.extend(range(q_starts[s], q_starts[s + 1]))
        prefix_slots.extend(_slots(first, 0, blocks * block_size, block_size))
        prefix_starts.append(len(prefix_slots))
        row_starts.append(len(rows))
    own_slots: list[int] = []
    own_starts = [0]
    for table, ctx, start in zip(tables, context_lens, kv_start):
        own_slots.extend(_slots(table, start, ctx, block_size))
        own_starts.append(len(own_slots))

    def ints(xs: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(xs, dtype=dtype, device=device)

    return SharedPrefix(
        ints(prefix_slots), ints(prefix_starts), ints(rows, torch.int64), ints(row_starts), ints(own_slots),
        ints(own_starts), max(_spans(prefix_starts), default=0), max(_spans(row_starts), default=0),
        max(_spans(own_starts), default=0), max(query_lens, default=0),
    )


def _slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [table[t // block_size] * block_size + t % block_size for t in range(start, end)]


def _spans(starts: list[int]) -> list[int]:
    return [b - a for a, b in zip(starts, starts[1:])]


def shared_prefix_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, plan: SharedPrefix, scale: float) -> torch.Tensor:
    """Causal attention of ragged new queries (``[T, q_heads, d]``, ``query_start_loc`` bounding
    each sequence's) over their contexts as ``plan`` splits them: ``[T, q_heads, d]`` in ``q``'s
    dtype."""
    attend = _flash_varlen if q.is_cuda else _math_varlen
    own_k, own_v = (reference.gather_slots(c, plan.own_slots) for c in (k_cache, v_cache))
    out, lse = attend(q, own_k, own_v, query_start_loc, plan.own_starts, plan.max_query, plan.max_own, True, scale)
    if plan.group_rows.numel() == 0:
        return out
    pre_k, pre_v = (reference.gather_slots(c, plan.prefix_slots) for c in (k_cache, v_cache))
    grouped_q = q.index_select(0, plan.group_rows)
    shared, shared_lse = attend(grouped_q, pre_k, pre_v, plan.group_row_starts, plan.prefix_starts,
                                plan.max_group_rows, plan.max_prefix, False, scale)
    rows = plan.group_rows
    merged = merge(shared, shared_lse, out.index_select(0, rows), lse.index_select(0, rows)).to(out.dtype)
    return out.index_copy(0, rows, merged)


def _flash_varlen(q, k, v, q_starts, k_starts, max_q, max_k, causal, scale):
    """torch's FlashAttention (varlen; causal aligned bottom right) and each row's natural
    log-sum-exp, ``[T, q_heads]``."""
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, q_starts, k_starts, int(max_q), int(max_k), 0.0, causal, return_debug_mask=False, scale=float(scale),
    )[:2]
    if lse.dim() != 2 or lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"FlashAttention's varlen log-sum-exp has shape {tuple(lse.shape)}, not [heads, rows]")
    return out, lse.t()


def _math_varlen(q, k, v, q_starts, k_starts, max_q, max_k, causal, scale):
    """``_flash_varlen`` in fp32 math, sequence by sequence (the reference and the CPU path)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    qs, ks = q_starts.tolist(), k_starts.tolist()
    group = q.shape[1] // k.shape[1]
    for q0, q1, k0, k1 in zip(qs, qs[1:], ks, ks[1:]):
        n, ctx = q1 - q0, k1 - k0
        queries = q[q0:q1].float().transpose(0, 1)  # [H, n, d]
        keys = k[k0:k1].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vals = v[k0:k1].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(queries, keys.transpose(1, 2)) * scale
        if causal:
            q_pos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
            scores.masked_fill_(torch.arange(ctx, device=q.device).unsqueeze(0) > q_pos, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [H, n]
        probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
        out[q0:q1] = torch.matmul(probs, vals).transpose(0, 1).to(q.dtype)
        lse[q0:q1] = row_lse.t()
    return out, lse
