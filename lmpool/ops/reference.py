"""Plain-torch reference implementations of LMPool's KV-cache operations, and of the model's
norms and rotary embedding that LMPool fuses on CUDA.

These are the CPU path of the engine and the oracle every CUDA kernel is tested
against, so they favour obvious correctness over speed.

Layouts (shared with the CUDA kernels in ``kernels/``):

- whole cache: ``kv_cache[layers, 2, num_blocks, block_size, kv_heads, head_dim]``;
  ``kv_cache[l, 0]`` is layer ``l``'s key cache, ``kv_cache[l, 1]`` its value cache,
  each a contiguous ``[num_blocks, block_size, kv_heads, head_dim]`` tensor.
- a slot is ``block_id * block_size + offset``; slot ``-1`` marks padding.
- a ragged batch of queries is packed as ``q[total_q, q_heads, head_dim]`` with
  ``query_start_loc[b] .. query_start_loc[b + 1]`` the rows of sequence ``b``.
- ``context_lens[b]`` counts every token of sequence ``b`` already in the cache,
  including this step's new tokens (they are written before attention runs), so the
  ``j``-th of ``n`` new tokens sits at position ``context_lens[b] - n + j`` and
  attends to positions ``0 ..= context_lens[b] - n + j``.
- ``block_tables[b, i]`` is the physical block of sequence ``b``'s ``i``-th logical
  block; entries past the sequence's last block are ignored (pad with anything).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` rows ``[T, kv_heads, head_dim]`` at their slots; skip slot -1."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def gather_sequence_kv(
    cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> torch.Tensor:
    """The first ``length`` cached rows of one sequence as ``[length, kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    rows = cache[block_table[:num_blocks].long()].flatten(0, 1)
    return rows[:length]


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cached rows at ``slots`` (``[K]``, int32 or int64), in their order: ``[K, kv_heads, head_dim]``,
    contiguous (one context after another, where ``slots`` lists contexts so)."""
    return cache.flatten(0, 1).index_select(0, slots)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    key_starts: torch.Tensor | None = None,
    max_query_len: int = 0,
    max_context_len: int = 0,
    key_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ragged new queries over their sequences' paged KV.

    Returns ``[total_q, q_heads, head_dim]`` in ``q``'s dtype; math runs in fp32. ``key_starts``
    (the contexts' cumulative lengths, ``[B + 1]``), the longest query and context, and
    ``key_slots`` (every context's slots, context after context, where the step lists them) are
    for backends that size their launch on the host or read the keys gathered
    (``cuda.flash_paged_attention``, ``cuda.flash_gathered_attention``); unused here.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for b, ctx in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        if hi > lo:
            keys = gather_sequence_kv(k_cache, block_tables[b], ctx)
            vals = gather_sequence_kv(v_cache, block_tables[b], ctx)
            out[lo:hi] = attention_over(q[lo:hi], keys, vals, scale)
    return out


def attention_over(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's ``n`` new queries (``[n, q_heads, D]``, the last ``n``
    positions of its context) over its context's keys and values (``[ctx, kv_heads, D]``):
    ``[n, q_heads, D]`` in ``q``'s dtype; math in fp32."""
    n, ctx = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
    vals = vals.float().repeat_interleave(group, dim=1).transpose(0, 1)
    queries = q.float().transpose(0, 1)  # [Hq, n, D]
    scores = torch.matmul(queries, keys.transpose(1, 2)) * scale  # [Hq, n, ctx]
    q_pos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
    k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)
    scores.masked_fill_(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vals).transpose(0, 1).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One new query per sequence: ``q[batch, q_heads, head_dim]``.

    Batched over sequences (padded to the longest context and masked), because
    decode is the CPU engine's hot path and per-sequence loops cost more in
    dispatch than in arithmetic.
    """
    batch, q_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    max_ctx = int(context_lens.max())
    width = (max_ctx + block_size - 1) // block_size
    # Table entries past a sequence's last block may hold anything: clamp, then mask.
    tables = block_tables[:, :width].long().clamp(0, num_blocks - 1)
    keys = k_cache[tables].view(batch, width * block_size, kv_heads, head_dim)[:, :max_ctx].float()
    vals = v_cache[tables].view(batch, width * block_size, kv_heads, head_dim)[:, :max_ctx].float()
    queries = q.float().view(batch, kv_heads, q_heads // kv_heads, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", queries, keys) * scale
    beyond = torch.arange(max_ctx, device=q.device)[None, :] >= context_lens[:, None]
    scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    # Slots past a context may hold garbage (even NaN): a zero weight does not cancel NaN.
    vals = vals.masked_fill(beyond[:, :, None, None], 0.0)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, vals)
    return out.reshape(batch, q_heads, head_dim).to(q.dtype)


def cascade_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    kv_start: torch.Tensor,
    prefix_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    prefix_starts: torch.Tensor,
    prefix_rows: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``paged_decode_attention`` for rows in groups that share a cached prefix (cascade
    attention): group ``g`` is rows ``prefix_rows[prefix_starts[g]:prefix_starts[g + 1]]``,
    whose first ``prefix_lens[g]`` keys are the blocks of ``prefix_tables[g]``; its queries
    attend to them at once, each row attends to its own keys from ``kv_start[row]`` on, and the
    two parts merge by their log-sum-exps. A row is in at most one group, and then its
    ``kv_start`` is its group's ``prefix_lens``; a row in no group has ``kv_start`` 0. Equal to
    ``paged_decode_attention`` whenever each grouped row's first ``kv_start[row]`` keys are its
    group's prefix."""
    rows, q_heads, head_dim = q.shape
    group = q_heads // k_cache.shape[2]
    parts = torch.zeros(rows, q_heads, 2, head_dim, device=q.device)
    lse = torch.full((rows, q_heads, 2), float("-inf"), device=q.device)

    def attend(queries: torch.Tensor, table: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``[n, q_heads, D]`` over keys ``[lo, hi)`` of ``table``: ``[n, q_heads, D]``
        outputs and ``[n, q_heads]`` log-sum-exps."""
        keys = gather_sequence_kv(k_cache, table, hi)[lo:].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vals = gather_sequence_kv(v_cache, table, hi)[lo:].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(queries.float().transpose(0, 1), keys.transpose(1, 2)) * scale  # [Hq, n, keys]
        out = torch.matmul(torch.softmax(scores, dim=-1), vals)
        return out.transpose(0, 1), torch.logsumexp(scores, dim=-1).transpose(0, 1)

    starts, members = prefix_starts.tolist(), prefix_rows.tolist()
    for g, length in enumerate(prefix_lens.tolist()):
        idx = members[starts[g]:starts[g + 1]]
        if idx and length > 0:
            parts[idx, :, 0], lse[idx, :, 0] = attend(q[idx], prefix_tables[g], 0, length)
    for row, (lo, hi) in enumerate(zip(kv_start.tolist(), context_lens.tolist())):
        if hi > lo:
            (out,), (row_lse,) = attend(q[row:row + 1], block_tables[row], lo, hi)
            parts[row, :, 1], lse[row, :, 1] = out, row_lse
    weights = torch.softmax(lse, dim=-1).nan_to_num(0.0)  # a row with no key at all reads as zeros
    return (weights[..., None] * parts).sum(dim=2).to(q.dtype)


def pack_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, max_ctas: int = 0,
            keep_payload: bool = False) -> torch.Tensor:
    """Gather blocks of every layer into one ``[layers, 2, B, block_size, kv_heads, head_dim]``.
    (``max_ctas`` and ``keep_payload`` steer the CUDA kernel's grid and stores; they mean
    nothing here.)"""
    return kv_cache[:, :, block_ids.long()].contiguous()


def unpack_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, payload: torch.Tensor, max_ctas: int = 0) -> None:
    """Scatter a packed payload into ``block_ids`` of every layer (inverse of ``pack_kv``)."""
    if payload.shape[2] != block_ids.numel():
        raise ValueError(
            f"payload holds {payload.shape[2]} blocks but {block_ids.numel()} block ids were given"
        )
    kv_cache[:, :, block_ids.long()] = payload.to(kv_cache.dtype)


# ---- the model's elementwise work: one op here, one kernel on CUDA (kernels/norm_rope.cu) ----


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension as transformers' Qwen3 computes it: in fp32, rounded to
    the model dtype, then scaled by ``weight`` (in the model dtype)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def qkv_norm_rope_store(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                        cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, heads: int) -> torch.Tensor:
    """A qkv projection ``[T, (heads + 2 * kv_heads) * head_dim]``'s attention inputs: its q heads
    normed and rotated (returned ``[T, heads, head_dim]``), its k heads normed and rotated and
    its v heads stored into the caches at ``slot_mapping`` (``qk_norm_rope`` twice, then
    ``write_kv``)."""
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = qk_norm_rope(q.view(-1, heads, dim), q_weight, eps, cos, sin, positions)
    k = qk_norm_rope(k.view(-1, kv_heads, dim), k_weight, eps, cos, sin, positions)
    write_kv(k, v.view(-1, kv_heads, dim), k_cache, v_cache, slot_mapping)
    return q


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(``rms_norm`` of ``x + residual``, ``x + residual``): a residual add in the model dtype and
    the norm that reads its result."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A projection without bias, ``x @ weight.T`` (``weight [out, in]``, as ``nn.Linear`` holds it)."""
    return F.linear(x, weight)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating of ``gate_up[..., 2 * dim]`` (gate first): ``silu(gate) * up`` in the model
    dtype, each rounded as torch's two ops round."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm of ``x[tokens, heads, head_dim]``, then the rotate-half rotary embedding
    at each token's position; ``cos``/``sin`` are fp32 ``[positions, head_dim / 2]`` tables."""
    x = rms_norm(x, weight, eps)
    # index_select takes int32 positions as they are (advanced indexing would widen them first).
    c = cos.index_select(0, positions).unsqueeze(1)
    s = sin.index_select(0, positions).unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
