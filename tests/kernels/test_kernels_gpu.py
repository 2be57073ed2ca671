"""LMPool's CUDA kernels against the torch reference, on fresh random inputs (needs a GPU).

Inputs are built to catch reads and writes out of bounds: cache rows that no
sequence owns (spare blocks, the tail of each last block) are NaN, padding
entries of the block tables point at such blocks, block tables are shuffled,
and freed allocator memory is filled with NaN before each call so an output
element the kernel forgets to write shows up as NaN. The oracle is
``lmpool.ops.reference`` evaluated in fp32 from the same values.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

from lmpool.ops import cuda, dense_attention, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEVICE = "cuda"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_SIZES = [16, 32, 64, 128, 256]


@pytest.fixture(scope="module")
def ext():
    return cuda.load_extension()


def poison_allocator() -> None:
    """Leave NaN in the caching allocator's free blocks, small and large pools alike."""
    if DEVICE != "cuda":
        return
    torch.cuda.empty_cache()
    large = torch.full((64 << 20,), float("nan"), device=DEVICE)  # 256 MiB
    small = [torch.full((n,), float("nan"), device=DEVICE) for n in (1 << 18, 1 << 16, 1 << 12) * 4]
    del large, small


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "kernel output has NaN"
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.3g} >= {TOLERANCE[dtype]}"


def paged_kv(kv_lens, block_size, kv_heads, head_dim, dtype, gen, spare=3):
    """K/V caches holding each sequence's rows in shuffled blocks; every other row is NaN."""
    counts = [math.ceil(n / block_size) for n in kv_lens]
    num_blocks = sum(counts) + spare
    order = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    width = max(counts, default=0) + 2
    # Padding entries name real blocks, often NaN ones: reading them must show.
    tables = torch.randint(0, num_blocks, (len(kv_lens), width), generator=gen, dtype=torch.int32)
    used = 0
    offsets = torch.arange(block_size)
    for b, n in enumerate(kv_lens):
        ids = order[used : used + counts[b]]
        used += counts[b]
        tables[b, : counts[b]] = ids.to(torch.int32)
        slots = (ids.unsqueeze(1) * block_size + offsets).flatten()[:n]
        k_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE)


def strided_q(tokens, q_heads, kv_heads, head_dim, dtype, gen):
    """q as the leading slice of a fused qkv projection, as the model produces it."""
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    return qkv.to(DEVICE)[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)


def reference_attention(q, k_cache, v_cache, tables, kv_lens, starts, scale):
    """The oracle, in fp32 from the same values (fp16/bf16 convert to fp32 exactly)."""
    return reference.paged_attention(
        q.to(DEVICE).float(),
        k_cache.to(DEVICE).float(),
        v_cache.to(DEVICE).float(),
        tables.to(DEVICE),
        torch.tensor(kv_lens, dtype=torch.int32),
        starts,
        scale,
    )


# --------------------------------------------------------------------------- decode


def decode_lens(block_size):
    # Empty (CUDA-graph padding), one token, exact block boundaries, ragged, long.
    return [0, 1, block_size, block_size + 1, 2 * block_size - 1, 3 * block_size, 37, 700, 1500]


def check_decode(ext, dtype, group, head_dim, block_size, kv_lens, num_splits=0, seed=0, q_strided=False):
    gen = torch.Generator().manual_seed(seed)
    kv_heads = 2
    q_heads = kv_heads * group
    k_cache, v_cache, tables = paged_kv(kv_lens, block_size, kv_heads, head_dim, dtype, gen)
    if q_strided:
        q = strided_q(len(kv_lens), q_heads, kv_heads, head_dim, dtype, gen)
    else:
        q = torch.randn(len(kv_lens), q_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    ctx = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    poison_allocator()
    out = ext.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, num_splits)
    assert out.shape == q.shape and out.dtype == dtype
    starts = torch.arange(len(kv_lens) + 1, dtype=torch.int32)
    ref = reference_attention(q, k_cache, v_cache, tables, kv_lens, starts, scale)
    # An empty context (a padded CUDA-graph slot) reads as zeros; the reference's
    # matmul over zero keys may leave recycled memory there instead.
    ref[torch.tensor(kv_lens) == 0] = 0
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_reference(ext, dtype, group, head_dim):
    block_size = BLOCK_SIZES[(group + head_dim // 64) % len(BLOCK_SIZES)]
    check_decode(ext, dtype, group, head_dim, block_size, decode_lens(block_size), seed=group)


@pytest.mark.parametrize("block_size", [*BLOCK_SIZES, 24])
def test_decode_block_sizes(ext, block_size):
    # 24 takes the non-power-of-two path of the block-table lookup.
    check_decode(ext, torch.bfloat16, 2, 128, block_size, decode_lens(block_size), seed=block_size)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
def test_decode_split_k(ext, num_splits):
    # Long and short rows together: long rows use every split, short ones leave most empty.
    kv_lens = [4000, 1, 300, 2049, 256, 257]
    check_decode(ext, torch.bfloat16, 4, 128, 32, kv_lens, num_splits=num_splits, seed=num_splits)
    check_decode(ext, torch.float32, 2, 64, 64, kv_lens, num_splits=num_splits, seed=num_splits)


def test_decode_strided_q(ext):
    check_decode(ext, torch.float16, 2, 128, 16, decode_lens(16), q_strided=True)


def test_decode_through_cuda_ops_picks_splits_for_few_long_sequences():
    gen = torch.Generator().manual_seed(7)
    kv_lens = [9000, 5000]
    k_cache, v_cache, tables = paged_kv(kv_lens, 256, 8, 128, torch.bfloat16, gen)
    q = torch.randn(2, 16, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    ctx = torch.tensor(kv_lens, dtype=torch.int64, device=DEVICE)  # the wrapper narrows it
    poison_allocator()
    out = cuda.CUDA_OPS.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.1)
    starts = torch.arange(3, dtype=torch.int32)
    assert_close(out, reference_attention(q, k_cache, v_cache, tables, kv_lens, starts, 0.1), torch.bfloat16)
    assert cuda.load_extension().decode_splits(2, 16, 8, tables.shape[1] * 256, 0) > 1


def test_a_decode_launch_splits_its_keys_by_the_waves_the_sms_run():
    """The SMs hold ``slots`` CTAs at once (8 kv heads, GQA group 2: one CTA a row and head), so
    a launch runs in waves of that many. One row more than a wave leaves 8 CTAs to start when the
    rest end and run alone: the keys are split until there are at least four slots' worth. Rows
    that fit one wave are not split into a second; a last wave over half full is not split."""
    ext = cuda.load_extension()
    slots = ext.decode_slots(16, 8, 0)
    assert slots >= 16
    rows = slots // 8 + 1
    assert rows * 8 * ext.decode_splits(rows, 16, 8, 16384, 0) >= 4 * slots
    half = slots // 16
    assert half * 8 * ext.decode_splits(half, 16, 8, 16384, 0) <= slots
    fuller = slots * 7 // 32  # 1.75 waves of CTAs with one split
    assert ext.decode_splits(fuller, 16, 8, 16384, 0) == 1
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # 64: 256 keys a split
    assert ext.decode_splits(1, 16, 8, 16384, 0) == min(64, -(-6 * sms // 8), slots // 8)
    # the split counts this chooses are as correct as any: test_decode_split_k


# --------------------------------------------------------------------------- prefill


def prefill_shapes(block_size):
    """(new tokens, cached prefix) per sequence."""
    return [
        (1, 0),  # a one-token prompt
        (1, 300),  # decode-like
        (block_size, 0),  # a prompt that fills one block exactly
        (17, block_size),  # prefix ends on a block boundary
        (70, 2 * block_size - 5),
        (130, 0),  # several query tiles
        (5, 3),
        (260, 500),
    ]


def check_prefill(ext, dtype, group, head_dim, block_size, tensor_cores, seed=0, shapes=None, num_splits=0):
    gen = torch.Generator().manual_seed(seed)
    kv_heads = 2
    q_heads = kv_heads * group
    shapes = shapes or prefill_shapes(block_size)
    kv_lens = [n + p for n, p in shapes]
    k_cache, v_cache, tables = paged_kv(kv_lens, block_size, kv_heads, head_dim, dtype, gen)
    new = torch.tensor([n for n, _ in shapes])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), new.cumsum(0)]).to(torch.int32)
    q = strided_q(int(new.sum()), q_heads, kv_heads, head_dim, dtype, gen)
    ctx = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    poison_allocator()
    out = ext.paged_prefill_attention(
        q, k_cache, v_cache, tables, ctx, starts.to(DEVICE), scale, tensor_cores, num_splits
    )
    assert out.shape == q.shape and out.dtype == dtype
    ref = reference_attention(q, k_cache, v_cache, tables, kv_lens, starts, scale)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("tensor_cores", [True, False], ids=["mma", "rows"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_matches_reference(ext, dtype, group, head_dim, tensor_cores):
    if dtype == torch.float32 and tensor_cores:
        pytest.skip("fp32 always takes the rows path")
    block_size = BLOCK_SIZES[(group + head_dim // 64) % len(BLOCK_SIZES)]
    check_prefill(ext, dtype, group, head_dim, block_size, tensor_cores, seed=group + head_dim)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_block_sizes(ext, block_size):
    check_prefill(ext, torch.bfloat16, 2, 128, block_size, True, seed=block_size)


# Short queries over long cached contexts, the shape key splits are for, beside
# the edges: a share past a short sequence's keys, a share whose keys a row may
# not see (the causal diagonal of a long new prompt), a one-token prompt.
SPLIT_SHAPES = [(64, 3000), (1, 5000), (130, 1500), (5, 3), (600, 0), (1, 0), (33, 511)]


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("group,head_dim,dtype", [(2, 128, torch.bfloat16), (8, 64, torch.float16)])
def test_prefill_split_k_matches_reference(ext, num_splits, group, head_dim, dtype):
    check_prefill(ext, dtype, group, head_dim, 64, True, seed=num_splits, shapes=SPLIT_SHAPES,
                  num_splits=num_splits)


def test_prefill_splits_the_keys_of_a_short_query_over_a_long_context_only():
    ext = cuda.load_extension()
    # One 64-token question over 16k cached tokens (Qwen3-0.6B's 16 q / 8 kv heads): 16 CTAs alone.
    assert ext.prefill_splits(64, 1, 16, 8, 16384 + 64, 0) > 1
    # Its key shares stay at least kMinPrefillSplitKeys (512) long.
    assert ext.prefill_splits(64, 1, 16, 8, 1024, 0) <= 2
    # A 16k-token cold prompt's tiles fill the GPU already.
    assert ext.prefill_splits(16384, 1, 16, 8, 16384, 0) == 1
    check_prefill(ext, torch.bfloat16, 2, 128, 256, True, shapes=[(64, 8192)], seed=5)


def test_prefill_through_cuda_ops_matches_reference():
    gen = torch.Generator().manual_seed(11)
    kv_lens = [600, 33]
    k_cache, v_cache, tables = paged_kv(kv_lens, 256, 8, 128, torch.bfloat16, gen)
    q = torch.randn(400, 16, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    starts = torch.tensor([0, 390, 400], dtype=torch.int64)
    ctx = torch.tensor(kv_lens, device=DEVICE)
    poison_allocator()
    out = cuda.CUDA_OPS.paged_attention(q, k_cache, v_cache, tables, ctx, starts.to(DEVICE), 0.09)
    ref = reference_attention(q, k_cache, v_cache, tables, kv_lens, starts.to(torch.int32), 0.09)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.skipif(cuda.flash_paged_unavailable() is not None, reason=str(cuda.flash_paged_unavailable()))
@pytest.mark.parametrize("group,head_dim,dtype", [(2, 128, torch.bfloat16), (8, 64, torch.float16),
                                                  (1, 128, torch.bfloat16)])
def test_flash_prefill_over_the_paged_cache_matches_reference(group, head_dim, dtype):
    """``cuda.flash_paged_attention`` (torch's FlashAttention reading the cache by the block
    tables, ``EngineConfig.prefill_attention='flash'``) on the split shapes' mix of short
    questions over long contexts and cold prompts: causal from the bottom right, GQA, rows past a
    context's end (NaN here) unread."""
    gen = torch.Generator().manual_seed(group + head_dim)
    kv_heads = 2
    kv_lens = [n + p for n, p in SPLIT_SHAPES]
    k_cache, v_cache, tables = paged_kv(kv_lens, 256, kv_heads, head_dim, dtype, gen)
    new = torch.tensor([n for n, _ in SPLIT_SHAPES])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), new.cumsum(0)]).to(torch.int32)
    key_starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(kv_lens).cumsum(0)]).to(torch.int32)
    q = torch.randn(int(new.sum()), kv_heads * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    ctx = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    poison_allocator()
    out = cuda.FLASH_PREFILL_OPS.paged_attention(q, k_cache, v_cache, tables, ctx, starts.to(DEVICE), scale,
                                                 key_starts.to(DEVICE), int(new.max()), max(kv_lens))
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, reference_attention(q, k_cache, v_cache, tables, kv_lens, starts, scale), dtype)
    with pytest.raises(ValueError, match="needs key_starts"):
        cuda.flash_paged_attention(q, k_cache, v_cache, tables, ctx, starts.to(DEVICE), scale)


@pytest.mark.parametrize("group,head_dim,dtype", [(2, 128, torch.bfloat16), (8, 64, torch.float16)])
def test_flash_prefill_over_keys_gathered_out_of_the_cache_matches_reference(group, head_dim, dtype):
    """``cuda.flash_gathered_attention`` (``prefill_attention='flash'`` on a torch whose
    FlashAttention reads no block tables): each context's keys and values gathered by its slots
    (context after context, as ``StepInputBuilder`` lists them), causal from the bottom right,
    GQA, the NaN rows past a context's end never gathered; without slots, LMPool's kernel."""
    gen = torch.Generator().manual_seed(group + head_dim + 1)
    kv_heads, block = 2, 64
    kv_lens = [n + p for n, p in SPLIT_SHAPES]
    k_cache, v_cache, tables = paged_kv(kv_lens, block, kv_heads, head_dim, dtype, gen)
    new = torch.tensor([n for n, _ in SPLIT_SHAPES])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), new.cumsum(0)]).to(torch.int32)
    key_starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(kv_lens).cumsum(0)]).to(torch.int32)
    host_tables = tables.cpu().tolist()
    slots = torch.tensor([host_tables[b][p // block] * block + p % block for b, n in enumerate(kv_lens)
                          for p in range(n)], dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(new.sum()), kv_heads * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    ctx = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    poison_allocator()
    args = (q, k_cache, v_cache, tables, ctx, starts.to(DEVICE), scale, key_starts.to(DEVICE), int(new.max()),
            max(kv_lens))
    out = cuda.FLASH_GATHER_OPS.paged_attention(*args, slots)
    assert out.shape == q.shape and out.dtype == dtype
    ref = reference_attention(q, k_cache, v_cache, tables, kv_lens, starts, scale)
    assert_close(out, ref, dtype)
    assert_close(cuda.FLASH_GATHER_OPS.paged_attention(*args), ref, dtype)  # no slots: LMPool's kernel
    with pytest.raises(ValueError, match="needs key_starts"):
        cuda.flash_gathered_attention(q, k_cache, v_cache, tables, ctx, starts.to(DEVICE), scale, key_slots=slots)


@pytest.mark.parametrize("n,prefix", [(1024, 0), (1000, 0), (1000, 1000), (900, 1000), (512, 3000), (257, 6000)])
def test_one_sequence_dense_attention_matches_reference(n, prefix):
    """A long prompt's chunk alone in its step (``dense_attention``, what ``flash_gathered_attention``
    runs for one sequence): torch's dense attention (cuDNN's on Hopper), the cached prefix and
    the chunk's own keys merged by log-sum-exp, GQA of 2, bf16, against the reference; and that
    path is the one a Hopper GPU takes. Lengths that share a power-of-two bucket (1000 and 1024,
    900 and 1000 over 1000) share cuDNN's plan, their own lengths given as ragged offsets."""
    gen = torch.Generator().manual_seed(n + prefix)
    q = torch.randn(n, 16, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
    k, v = (torch.randn(n + prefix, 8, 128, generator=gen).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    if torch.cuda.get_device_capability()[0] >= 9:
        assert dense_attention.usable(torch.device(DEVICE, torch.cuda.current_device()))
    out = dense_attention.one_sequence_attention(q, k, v, 128**-0.5)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert_close(out, reference.attention_over(q, k, v, 128**-0.5), torch.bfloat16)


# --------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("aligned", [True, False], ids=["vector", "scalar"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference_and_skips_padding(ext, dtype, aligned, slot_dtype):
    gen = torch.Generator().manual_seed(3)
    tokens, kv_heads, head_dim, num_blocks, block_size = 40, 4, 128, 12, 16
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    row = kv_heads * head_dim
    if aligned:  # key and value as slices of a fused qkv projection
        qkv = torch.randn(tokens, 4 * row, generator=gen).to(dtype).to(DEVICE)
        key = qkv[:, 2 * row : 3 * row].view(tokens, kv_heads, head_dim)
        value = qkv[:, 3 * row :].view(tokens, kv_heads, head_dim)
    else:  # one element off 16-byte alignment
        flat = torch.randn(2 * tokens * row + 1, generator=gen).to(dtype).to(DEVICE)
        key = flat[1 : 1 + tokens * row].view(tokens, kv_heads, head_dim)
        value = flat[1 + tokens * row :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::5] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(key.cpu(), value.cpu(), expected_k, expected_v, slots)
    k_dev, v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
    ext.write_kv(key, value, k_dev, v_dev, slots.to(slot_dtype).to(DEVICE))
    assert torch.equal(k_dev.cpu(), expected_k)
    assert torch.equal(v_dev.cpu(), expected_v)


# --------------------------------------------------------------------------- pack / unpack


@pytest.mark.parametrize("max_ctas", [0, 1, 7])  # 0: a CTA per tile; else each CTA loops over many
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 256])
def test_pack_unpack_round_trip(ext, block_size, dtype, ids_dtype, max_ctas):
    gen = torch.Generator().manual_seed(block_size)
    layers, num_blocks, kv_heads, head_dim, count = 3, 24, 2, 64, 9
    shape = (layers, 2, num_blocks, block_size, kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    ids = torch.randperm(num_blocks, generator=gen)[:count]
    poison_allocator()
    payload = ext.pack_kv(kv_cache, ids.to(ids_dtype).to(DEVICE), max_ctas)
    assert torch.equal(payload.cpu(), reference.pack_kv(kv_cache.cpu(), ids))
    kept = ext.pack_kv(kv_cache, ids.to(ids_dtype).to(DEVICE), max_ctas, keep_payload=True)
    assert torch.equal(kept, payload)  # the store hint changes where the bytes linger, not them

    dest = torch.randn(shape, generator=gen).to(dtype)
    dest_ids = torch.randperm(num_blocks, generator=gen)[:count]
    expected = dest.clone()
    reference.unpack_kv(expected, dest_ids, payload.cpu())
    dest_dev = dest.to(DEVICE)
    ext.unpack_kv(dest_dev, dest_ids.to(ids_dtype).to(DEVICE), payload, max_ctas)
    assert torch.equal(dest_dev.cpu(), expected)  # other blocks untouched
    assert torch.equal(ext.pack_kv(dest_dev, dest_ids.to(DEVICE)), payload)


def test_pack_unpack_qwen3_shape_through_cuda_ops():
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    shape = (28, 2, 20, 256, 8, 128)  # Qwen3-0.6B, 256-token blocks
    kv_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.randperm(20, device=DEVICE)[:16]
    payload = cuda.CUDA_OPS.pack_kv(kv_cache, ids)
    assert torch.equal(payload, kv_cache[:, :, ids])
    dest = torch.zeros_like(kv_cache)
    cuda.CUDA_OPS.unpack_kv(dest, ids.flip(0), payload)
    assert torch.equal(dest[:, :, ids.flip(0)], payload)
    with pytest.raises(ValueError, match="16 blocks but 15 block ids"):
        cuda.CUDA_OPS.unpack_kv(dest, ids[:15], payload)
    capped = torch.zeros_like(kv_cache)
    cuda.CUDA_OPS.unpack_kv(capped, ids.flip(0), cuda.CUDA_OPS.pack_kv(kv_cache, ids, max_ctas=132), max_ctas=132)
    assert torch.equal(capped, dest), "a capped grid moves the same bytes"
    with pytest.raises(RuntimeError, match="max_ctas must be >= 0"):
        cuda.CUDA_OPS.pack_kv(kv_cache, ids, max_ctas=-1)


def test_out_of_range_block_ids_are_not_copied(ext):
    kv_cache = torch.randn(1, 2, 4, 16, 1, 64, device=DEVICE)
    ids = torch.tensor([1, 4, -1], device=DEVICE)
    payload = ext.pack_kv(kv_cache, ids)
    assert torch.equal(payload[:, :, 0], kv_cache[:, :, 1])
    assert not payload[:, :, 1:].any()
    before = kv_cache.clone()
    ext.unpack_kv(kv_cache, ids, torch.ones_like(payload))
    assert torch.equal(kv_cache[:, :, 1], torch.ones_like(kv_cache[:, :, 1]))
    assert torch.equal(kv_cache[:, :, [0, 2, 3]], before[:, :, [0, 2, 3]])


# --------------------------------------------------------------------------- graphs and checks


def test_ops_replay_in_a_cuda_graph(ext):
    """A decode step (write the new token, attend, pack) captured once and replayed on new inputs."""
    gen = torch.Generator().manual_seed(9)
    block_size, kv_heads, head_dim, group = 16, 2, 128, 2
    kv_lens = [5, 40, 20, 100]
    k_cache, v_cache, tables = paged_kv(kv_lens, block_size, kv_heads, head_dim, torch.bfloat16, gen)
    kv_cache = torch.stack([k_cache, v_cache]).unsqueeze(0)  # [1, 2, blocks, ...]
    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    batch = len(kv_lens)

    def inputs(lens):
        last = torch.tensor(lens) - 1
        blocks = tables.cpu()[torch.arange(batch), last // block_size]
        return (
            torch.randn(batch, kv_heads * group, head_dim, generator=gen).to(torch.bfloat16),
            torch.randn(batch, kv_heads, head_dim, generator=gen).to(torch.bfloat16),
            torch.randn(batch, kv_heads, head_dim, generator=gen).to(torch.bfloat16),
            (blocks * block_size + last % block_size).to(torch.int64),
            torch.tensor(lens, dtype=torch.int32),
        )

    static = [t.to(DEVICE) for t in inputs(kv_lens)]
    q, key, value, slots, ctx = static
    ids = torch.tensor([3, 0], device=DEVICE)
    ops = cuda.CUDA_OPS
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the capture, as torch requires
        ops.write_kv(key, value, k_cache, v_cache, slots)
        ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.1)
        ops.pack_kv(kv_cache, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.write_kv(key, value, k_cache, v_cache, slots)
        out = ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.1)
        payload = ops.pack_kv(kv_cache, ids)

    new_lens = [6, 33, 18, 100]  # longer, shorter, within the last block, same
    for dst, src in zip(static, inputs(new_lens)):
        dst.copy_(src)
    expected_cache = kv_cache.cpu()
    reference.write_kv(key.cpu(), value.cpu(), expected_cache[0, 0], expected_cache[0, 1], slots.cpu())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kv_cache.cpu().nan_to_num(), expected_cache.nan_to_num())
    starts = torch.arange(batch + 1, dtype=torch.int32)
    ref = reference_attention(q, expected_cache[0, 0], expected_cache[0, 1], tables, new_lens, starts, 0.1)
    assert_close(out, ref, torch.bfloat16)
    assert torch.equal(payload.cpu().nan_to_num(), expected_cache[:, :, [3, 0]].nan_to_num())
    # Tear the graph down here, not at some later garbage collection.
    del graph, out, payload
    gc.collect()
    torch.cuda.synchronize()


def _bad_calls():
    """(what is wrong, expected message, call) triples over one small valid decode setup."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables = paged_kv([20], 16, 2, 128, torch.bfloat16, gen)
    q = torch.randn(1, 4, 128, device=DEVICE, dtype=torch.bfloat16)
    ctx = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    odd = torch.zeros(4, 16, 2, 96, device=DEVICE, dtype=torch.bfloat16)
    kv_cache = torch.zeros(2, 2, 4, 16, 2, 64, device=DEVICE)
    return {
        "int64 block table": ("block_tables must be int32",
            lambda ext: ext.paged_decode_attention(q, k_cache, v_cache, tables.long(), ctx, 0.1)),
        "q on the cpu": ("q must be a CUDA tensor",
            lambda ext: ext.paged_decode_attention(q.cpu(), k_cache, v_cache, tables, ctx, 0.1)),
        "mixed dtypes": ("share a dtype",
            lambda ext: ext.paged_decode_attention(q.half(), k_cache, v_cache, tables, ctx, 0.1)),
        "q heads not a multiple": (r"q_heads \(3\) must be a positive multiple of kv_heads \(2\)",
            lambda ext: ext.paged_decode_attention(q[:, :3], k_cache, v_cache, tables, ctx, 0.1)),
        "head_dim 96": ("head_dim must be 64 or 128, got 96",
            lambda ext: ext.paged_decode_attention(q[..., :96], odd, odd, tables, ctx, 0.1)),
        "short query_start_loc": ("query_start_loc must have num_seqs",
            lambda ext: ext.paged_prefill_attention(q, k_cache, v_cache, tables, ctx, ctx, 0.1)),
        "float slots": ("slot_mapping must be int32 or int64",
            lambda ext: ext.write_kv(q[:, :2], q[:, :2], k_cache, v_cache, ctx.float())),
        "payload shape": (r"payload must have shape \[2, 2, 1, 16, 2, 64\] for 1 block ids",
            lambda ext: ext.unpack_kv(kv_cache, ctx.long(), torch.zeros(2, 2, 2, 16, 2, 64, device=DEVICE))),
    }


BAD_CASES = ["int64 block table", "q on the cpu", "mixed dtypes", "q heads not a multiple",
             "head_dim 96", "short query_start_loc", "float slots", "payload shape"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_inputs_are_rejected_with_a_message(ext, case):
    message, call = _bad_calls()[case]
    with pytest.raises(RuntimeError, match=message):
        call(ext)


# --------------------------------------------------------------------------- cascade decode

# (shared prefix blocks, the rows' own keys after it): a long shared document with many rows,
# a short one, rows sharing nothing (groups of one), a row whose own keys end a block exactly.
CASCADE_GROUPS = [(12, [1, 3, 17, 40, 64, 5, 9, 2]), (2, [1, 64]), (0, [30]), (0, [1]), (5, [33, 64])]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cascade_decode_matches_decode_over_the_whole_context(ext, dtype, group, head_dim):
    from tests.kernels.cascade_cases import cascade_case

    gen = torch.Generator().manual_seed(group + head_dim)
    case = cascade_case(CASCADE_GROUPS, 32, 2 * group, 2, head_dim, dtype, gen, DEVICE)
    scale = head_dim**-0.5
    starts = torch.arange(case.q.shape[0] + 1, dtype=torch.int32)
    ref = reference_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens.tolist(),
                              starts, scale)
    for splits, prefix_splits in ((0, 0), (1, 1), (3, 5)):
        poison_allocator()
        out = ext.cascade_decode_attention(*case.cascade_args(), scale, splits, prefix_splits)
        assert out.shape == case.q.shape and out.dtype == dtype
        assert_close(out, ref, dtype)


def test_cascade_decode_through_cuda_ops_on_the_qwen3_shape():
    """16 q heads over 8 kv heads, 256-token blocks: 32 rows over one 16k-token document, as a
    replica decodes a burst of questions about it."""
    from tests.kernels.cascade_cases import cascade_case

    gen = torch.Generator().manual_seed(0)
    case = cascade_case([(64, [40 + i for i in range(32)])], 256, 16, 8, 128, torch.bfloat16, gen, DEVICE)
    out = cuda.CUDA_OPS.cascade_decode_attention(*case.cascade_args(), 128**-0.5)
    starts = torch.arange(33, dtype=torch.int32)
    ref = reference_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens.tolist(),
                              starts, 128**-0.5)
    assert_close(out, ref, torch.bfloat16)


def test_cascade_decode_of_rows_sharing_nothing_is_plain_decode(ext):
    """No group at all: every row reads its whole context, as plain decode does."""
    from tests.kernels.cascade_cases import cascade_case

    case = cascade_case([(0, [5, 300, 1])], 16, 4, 2, 128, torch.bfloat16, torch.Generator().manual_seed(1), DEVICE)
    assert case.prefix_lens.numel() == 0 and case.prefix_rows.numel() == 0
    starts = torch.arange(4, dtype=torch.int32)
    ref = reference_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens.tolist(),
                              starts, 128**-0.5)
    poison_allocator()
    assert_close(ext.cascade_decode_attention(*case.cascade_args(), 128**-0.5), ref, torch.bfloat16)


def test_cascade_decode_refuses_fp32_with_a_message(ext):
    from tests.kernels.cascade_cases import cascade_case

    case = cascade_case([(1, [3])], 16, 4, 2, 64, torch.float32, torch.Generator().manual_seed(0), DEVICE)
    with pytest.raises(RuntimeError, match="tensor cores: q must be fp16 or bf16"):
        ext.cascade_decode_attention(*case.cascade_args(), 0.125)
