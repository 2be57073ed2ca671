"""The torch reference ops (the CPU path and the CUDA kernels' oracle) against plain torch.

Paged attention is checked against dense causal attention computed by
``scaled_dot_product_attention`` on contiguous K/V, so the reference is not
checked against itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lmpool.ops import reference
from tests.kernels.cascade_cases import cascade_case


def _paged_cache(kv_lens, block_size, kv_heads, head_dim, gen, spare_blocks=3):
    """Random contiguous K/V per sequence, scattered into shuffled cache blocks."""
    blocks_per_seq = [(n + block_size - 1) // block_size for n in kv_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    width = max(blocks_per_seq) + 1
    # Padding entries point at real (spare) blocks: they must be ignored, not read.
    block_tables = torch.randint(0, num_blocks, (len(kv_lens), width), generator=gen, dtype=torch.int32)
    dense_k, dense_v, used = [], [], 0
    for b, n in enumerate(kv_lens):
        ids = order[used : used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        block_tables[b, : len(ids)] = ids.to(torch.int32)
        k = torch.randn(n, kv_heads, head_dim, generator=gen)
        v = torch.randn(n, kv_heads, head_dim, generator=gen)
        for i, blk in enumerate(ids.tolist()):
            rows = slice(i * block_size, min(n, (i + 1) * block_size))
            k_cache[blk, : rows.stop - rows.start] = k[rows]
            v_cache[blk, : rows.stop - rows.start] = v[rows]
        dense_k.append(k)
        dense_v.append(v)
    return k_cache, v_cache, block_tables, dense_k, dense_v


def _dense_causal(q, k, v, scale):
    """q [n, Hq, D] are the last n positions of k/v [ctx, Hkv, D]."""
    n, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)  # [Hq, n, D]
    kh = k.repeat_interleave(group, dim=1).transpose(0, 1)
    vh = v.repeat_interleave(group, dim=1).transpose(0, 1)
    visible = torch.arange(ctx).unsqueeze(0) <= torch.arange(ctx - n, ctx).unsqueeze(1)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=scale)
    return out.transpose(0, 1)


def _rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_dense_causal_sdpa(group, block_size):
    gen = torch.Generator().manual_seed(group * 100 + block_size)
    kv_heads, head_dim = 2, 32
    # (new tokens, cached prefix): decode, whole prompt, prefix at a block boundary, ragged.
    shapes = [(1, 0), (1, 37), (block_size, 0), (5, 2 * block_size), (9, 13), (3, block_size - 3)]
    kv_lens = [n + p for n, p in shapes]
    k_cache, v_cache, tables, dense_k, dense_v = _paged_cache(
        kv_lens, block_size, kv_heads, head_dim, gen
    )
    new = [n for n, _ in shapes]
    q = torch.randn(sum(new), kv_heads * group, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim**-0.5
    out = reference.paged_attention(
        q, k_cache, v_cache, tables, torch.tensor(kv_lens, dtype=torch.int32), starts, scale
    )
    for b in range(len(shapes)):
        lo, hi = starts[b].item(), starts[b + 1].item()
        expected = _dense_causal(q[lo:hi], dense_k[b], dense_v[b], scale)
        assert _rel_err(out[lo:hi], expected) < 1e-5


def test_decode_is_one_query_per_sequence():
    gen = torch.Generator().manual_seed(1)
    kv_lens = [1, 16, 17, 40]
    k_cache, v_cache, tables, dense_k, dense_v = _paged_cache(kv_lens, 16, 2, 32, gen)
    q = torch.randn(len(kv_lens), 4, 32, generator=gen)
    ctx = torch.tensor(kv_lens, dtype=torch.int32)
    out = reference.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2)
    for b in range(len(kv_lens)):
        expected = _dense_causal(q[b : b + 1], dense_k[b], dense_v[b], 0.2)
        assert _rel_err(out[b : b + 1], expected) < 1e-5


def test_write_kv_stores_rows_and_skips_padding():
    gen = torch.Generator().manual_seed(2)
    k_cache = torch.randn(4, 8, 2, 16, generator=gen)
    v_cache = torch.randn(4, 8, 2, 16, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key = torch.randn(5, 2, 16, generator=gen)
    value = torch.randn(5, 2, 16, generator=gen)
    slots = torch.tensor([9, -1, 31, 0, -1])
    reference.write_kv(key, value, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // 8, slot % 8], key[t])
            assert torch.equal(v_cache[slot // 8, slot % 8], value[t])
    written = torch.zeros(4 * 8, dtype=torch.bool)
    written[[9, 31, 0]] = True
    untouched = ~written.view(4, 8)
    assert torch.equal(k_cache[untouched], k_before[untouched])
    assert torch.equal(v_cache[untouched], v_before[untouched])


def test_pack_then_unpack_round_trips_blocks():
    gen = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(3, 2, 10, 4, 2, 8, generator=gen)
    ids = torch.tensor([7, 2, 9, 0])
    payload = reference.pack_kv(kv_cache, ids)
    assert payload.shape == (3, 2, 4, 4, 2, 8) and payload.is_contiguous()
    for i, blk in enumerate(ids.tolist()):
        assert torch.equal(payload[:, :, i], kv_cache[:, :, blk])

    other = torch.zeros_like(kv_cache)
    dest = torch.tensor([1, 5, 3, 8])
    reference.unpack_kv(other, dest, payload)
    for src, dst in zip(ids.tolist(), dest.tolist()):
        assert torch.equal(other[:, :, dst], kv_cache[:, :, src])
    untouched = [b for b in range(10) if b not in dest.tolist()]
    assert not other[:, :, untouched].any()
    assert torch.equal(reference.pack_kv(other, dest), payload)


def test_unpack_rejects_a_payload_of_another_size():
    kv_cache = torch.zeros(1, 2, 4, 2, 1, 8)
    payload = torch.zeros(1, 2, 3, 2, 1, 8)
    with pytest.raises(ValueError, match="3 blocks but 2 block ids"):
        reference.unpack_kv(kv_cache, torch.tensor([0, 1]), payload)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(1, 40), min_size=1, max_size=4)), min_size=1,
                max_size=4), st.sampled_from([1, 2, 4]), st.integers(0, 2**16))
def test_cascade_decode_equals_decode_over_the_whole_context(groups, group, seed):
    """Rows sharing a prefix attend to it together and to their own keys apart, merged by
    log-sum-exp: the same as each row attending to all of its keys (every slot no sequence
    fills is NaN, so a read past a row's keys shows)."""
    case = cascade_case(groups, 8, 2 * group, 2, 16, torch.float32, torch.Generator().manual_seed(seed))
    out = reference.cascade_decode_attention(*case.cascade_args(), 0.25)
    whole = reference.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                             case.context_lens, 0.25)
    assert not out.isnan().any()
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
