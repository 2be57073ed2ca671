"""The fused RMSNorm (with and without the residual add before it), q/k norm-then-rotate and
SwiGLU gating kernels (``kernels/norm_rope.cu``, ``kernels/silu_mul.cu``) against the torch
reference in the same dtype, whose roundings they follow (needs a GPU).

Inputs are strided views, as the model passes them (q and k are slices of the fused qkv
projection); freed allocator memory is NaN before each call, so an output element the
kernel forgets to write shows. Only the order of the sum of squares differs from torch, so
fp32 agrees to rounding and fp16/bf16 results are the reference's bits but for rare
one-unit differences; a residual sum and the gating are the reference's bits. Rows offset by
one element from 16-byte alignment take the kernels' element-wise path, aligned ones their
16-byte vectors.
"""

from __future__ import annotations

import pytest
import torch

from lmpool.model.qwen3 import RotaryEmbedding
from lmpool.model.rope import YarnScaling
from lmpool.ops import cuda, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def poisoned() -> None:
    """Leave NaN in the allocator's free blocks, large pool and small (outputs under 1 MiB
    come from the small one)."""
    torch.cuda.empty_cache()
    junk = [torch.full((16 << 20,), float("nan"), device="cuda")]
    junk += [torch.full((n,), float("nan"), device="cuda") for n in (1 << 18, 1 << 16, 1 << 12) * 4]
    del junk


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    assert not torch.isnan(out).any(), "an output element was never written"
    o, r = out.double(), ref.double()
    if out.dtype == torch.float32:
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)
        return
    # A normed value one unit apart moves a rotated one by about a unit of the normed values
    # (order 1), however small the rotated value is: the bound is relative to both.
    ulp = 2.0 ** -(7 if out.dtype == torch.bfloat16 else 10)
    assert ((o - r).abs() <= 2 * ulp * (r.abs() + 1)).all(), "more than a unit of rounding apart"
    assert (out == ref).float().mean().item() > 0.99, "too many elements differ from the reference's bits"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128, 1024, 200])
@pytest.mark.parametrize("rows", [1, 7, 333])
def test_rms_norm_equals_the_reference_on_a_strided_input(dtype, dim, rows):
    g = torch.Generator(device="cuda").manual_seed(dim * 1000 + rows)
    wide = torch.randn(rows, dim + 24, device="cuda", generator=g).to(dtype)
    x = wide[:, 8 : 8 + dim]  # rows strided, as a slice of a wider tensor
    weight = (1 + 0.3 * torch.randn(dim, device="cuda", generator=g)).to(dtype)
    poisoned()
    check(cuda.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [1024, 200, 1000, 1004])  # 1004: aligned rows of a width no vector divides
@pytest.mark.parametrize("offsets", [(8, 8), (1, 8), (8, 1)], ids=["aligned", "x_unaligned", "residual_unaligned"])
@pytest.mark.parametrize("rows", [1, 7, 333])
def test_add_rms_norm_equals_the_reference_and_returns_the_sum(dtype, dim, offsets, rows):
    g = torch.Generator(device="cuda").manual_seed(dim * 1000 + rows + 10 * offsets[0] + offsets[1])
    width = -(-(dim + 16) // 8) * 8  # rows 16-byte aligned in every dtype
    x = torch.randn(rows, width, device="cuda", generator=g).to(dtype)[:, offsets[0] : offsets[0] + dim]
    residual = (4 * torch.randn(rows, width, device="cuda", generator=g)).to(dtype)[:, offsets[1] : offsets[1] + dim]
    weight = (1 + 0.3 * torch.randn(dim, device="cuda", generator=g)).to(dtype)
    poisoned()
    out, total = cuda.add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_total = reference.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, ref_total)
    check(out, ref_out)
    check(cuda.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))  # the same path without the add


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [3072, 200, 1001, 1004])  # 1004: aligned rows, a width no vector divides
@pytest.mark.parametrize("rows", [1, 7, 333])
def test_silu_mul_is_the_reference_s_bits(dtype, dim, rows):
    g = torch.Generator(device="cuda").manual_seed(dim + rows)
    width = -(-(2 * dim + 8) // 8) * 8
    gate_up = (3 * torch.randn(rows, width, device="cuda", generator=g)).to(dtype)[:, 8 : 8 + 2 * dim]
    poisoned()
    out = cuda.silu_mul(gate_up)
    ref = reference.silu_mul(gate_up)
    assert out.shape == ref.shape == (rows, dim) and out.dtype == dtype and out.is_contiguous()
    assert not torch.isnan(out).any(), "an output element was never written"
    if dtype == torch.float32:  # fp32 keeps expf's last bits, which the two builds' math libraries may round apart
        torch.testing.assert_close(out, ref, rtol=2e-7, atol=0)
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 96])
@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("yarn", [False, True], ids=["plain", "yarn"])
def test_qk_norm_rope_equals_the_reference_on_a_qkv_slice(dtype, head_dim, positions_dtype, yarn):
    tokens, heads, kv_heads, max_pos = 37, 8, 2, 4096
    g = torch.Generator(device="cuda").manual_seed(head_dim + yarn)
    scaling = YarnScaling(factor=4.0, original_max_position_embeddings=1024) if yarn else None
    rotary = RotaryEmbedding(head_dim, max_pos, 1_000_000.0, scaling).to("cuda")
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, max_pos, (tokens,), device="cuda", generator=g).to(positions_dtype)
    for x in (q, k):
        weight = (1 + 0.3 * torch.randn(head_dim, device="cuda", generator=g)).to(dtype)
        args = (x, weight, 1e-6, rotary.cos, rotary.sin, positions)
        poisoned()
        check(cuda.qk_norm_rope(*args), reference.qk_norm_rope(*args))


def test_each_replays_in_a_cuda_graph_on_new_inputs():
    dim, heads, tokens = 128, 4, 16
    rotary = RotaryEmbedding(dim, 512, 10000.0).to("cuda")
    x = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    w, wh = torch.rand(dim, device="cuda", dtype=torch.bfloat16), torch.rand(1024, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(tokens, device="cuda", dtype=torch.int32)
    r = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(tokens, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    cuda.qk_norm_rope(x, w, 1e-6, rotary.cos, rotary.sin, pos)  # warm up outside the capture
    cuda.rms_norm(h, wh, 1e-6)
    cuda.add_rms_norm(h, r, wh, 1e-6)
    cuda.silu_mul(gate_up)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_q = cuda.qk_norm_rope(x, w, 1e-6, rotary.cos, rotary.sin, pos)
        out_h = cuda.rms_norm(h, wh, 1e-6)
        out_a, total = cuda.add_rms_norm(h, r, wh, 1e-6)
        out_g = cuda.silu_mul(gate_up)
    for t in (x, h, r, gate_up):
        t.copy_(torch.randn_like(t))
    pos.copy_(torch.randint(0, 512, (tokens,), device="cuda", dtype=torch.int32))
    graph.replay()
    check(out_q, reference.qk_norm_rope(x, w, 1e-6, rotary.cos, rotary.sin, pos))
    check(out_h, reference.rms_norm(h, wh, 1e-6))
    ref_a, ref_total = reference.add_rms_norm(h, r, wh, 1e-6)
    check(out_a, ref_a)
    assert torch.equal(total, ref_total)
    assert torch.equal(out_g, reference.silu_mul(gate_up))


def test_bad_inputs_are_refused_naming_the_problem():
    ext = cuda.load_extension()
    x = torch.zeros(3, 2, 8, device="cuda")
    w = torch.ones(8, device="cuda")
    table = torch.zeros(16, 4, device="cuda")
    pos = torch.zeros(3, dtype=torch.int32, device="cuda")
    cases = {
        "head_dim must be even": lambda: ext.qk_norm_rope(torch.zeros(3, 2, 7, device="cuda"), torch.ones(7, device="cuda"),
                                                          1e-6, torch.zeros(16, 3, device="cuda"),
                                                          torch.zeros(16, 3, device="cuda"), pos),
        "weight dtype": lambda: ext.qk_norm_rope(x, w.half(), 1e-6, table, table, pos),
        r"cos must be a contiguous float32 \[positions, 4\]": lambda: ext.qk_norm_rope(x, w, 1e-6, table[:, :2],
                                                                                      table, pos),
        "positions has 2 entries for 3 tokens": lambda: ext.qk_norm_rope(x, w, 1e-6, table, table, pos[:2]),
        r"x must be \[rows, dim\]": lambda: ext.rms_norm(x, w, 1e-6),
        r"weight must be a contiguous \[8\]": lambda: ext.rms_norm(x[:, 0], torch.ones(4, device="cuda"), 1e-6),
        r"residual has shape \[3, 4\]": lambda: ext.add_rms_norm(x[:, 0], torch.zeros(3, 4, device="cuda"), w, 1e-6),
        "residual dtype": lambda: ext.add_rms_norm(x[:, 0], x[:, 0].half(), w, 1e-6),
        r"gate_up must be \[rows, 2 \* dim\]": lambda: ext.silu_mul(torch.zeros(3, 7, device="cuda")),
    }
    for message, call in cases.items():
        with pytest.raises(RuntimeError, match=message):
            call()
    assert ext.rms_norm(torch.zeros(0, 8, device="cuda"), w, 1e-6).shape == (0, 8)
    assert ext.silu_mul(torch.zeros(0, 8, device="cuda")).shape == (0, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("slots_dtype", [torch.int32, torch.int64])
def test_qkv_norm_rope_store_equals_the_two_rotations_and_the_store(dtype, head_dim, slots_dtype):
    """The fused op against ``reference.qk_norm_rope`` on q and k and ``reference.write_kv``: q
    to rounding, the caches' written rows to rounding (values exactly), every other row untouched
    (a padding slot of -1 stores nothing)."""
    tokens, heads, kv_heads, blocks, block = 37, 8, 2, 16, 16
    g = torch.Generator(device="cuda").manual_seed(head_dim + (slots_dtype == torch.int64))
    rotary = RotaryEmbedding(head_dim, 4096, 1_000_000.0).to("cuda")
    wide = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim + 8, device="cuda", generator=g).to(dtype)
    qkv = wide[:, 8:]  # rows strided, as a slice of a wider tensor
    q_weight, k_weight = ((1 + 0.3 * torch.randn(head_dim, device="cuda", generator=g)).to(dtype) for _ in range(2))
    positions = torch.randint(0, 4096, (tokens,), device="cuda", generator=g).to(torch.int32)
    slots = torch.randperm(blocks * block, device="cuda", generator=g)[:tokens].to(slots_dtype)
    slots[5] = -1
    caches = [torch.randn(blocks, block, kv_heads, head_dim, device="cuda", generator=g).to(dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    args = (q_weight, k_weight, 1e-6, rotary.cos, rotary.sin, positions)
    poisoned()
    q = cuda.qkv_norm_rope_store(qkv, *args, *caches, slots, heads)
    ref_q = reference.qkv_norm_rope_store(qkv, *args, *ref_caches, slots, heads)
    check(q, ref_q)
    written = slots[slots >= 0].long()
    for ours, ref in zip(caches, ref_caches):
        flat, ref_flat = ours.view(-1, kv_heads, head_dim), ref.view(-1, kv_heads, head_dim)
        kept = torch.ones(flat.shape[0], dtype=torch.bool, device="cuda")
        kept[written] = False
        assert torch.equal(flat[kept], ref_flat[kept]), "a row no token writes changed"
        check(flat[written].contiguous(), ref_flat[written].contiguous())
    assert torch.equal(caches[1], ref_caches[1])  # values are copied, not computed


def test_qkv_norm_rope_store_refuses_what_does_not_match_its_cache():
    ext = cuda.load_extension()
    cache = torch.zeros(4, 16, 2, 8, device="cuda")
    w, table = torch.ones(8, device="cuda"), torch.zeros(16, 4, device="cuda")
    pos, slots = torch.zeros(3, dtype=torch.int32, device="cuda"), torch.zeros(3, dtype=torch.int32, device="cuda")
    qkv = torch.zeros(3, (4 + 4) * 8, device="cuda")
    cases = {
        r"qkv must be \[tokens, \(3 \+ 2 x 2\) x 8\]": lambda: ext.qkv_norm_rope_store(qkv, w, w, 1e-6, table, table, pos,
                                                                                   cache, cache, slots, 3),
        "the caches' dtype": lambda: ext.qkv_norm_rope_store(qkv, w, w, 1e-6, table, table, pos, cache.half(),
                                                             cache.half(), slots, 4),
        "slot_mapping has 2 entries for 3 tokens": lambda: ext.qkv_norm_rope_store(qkv, w, w, 1e-6, table, table, pos,
                                                                                   cache, cache, slots[:2], 4),
        r"k_cache and v_cache must be contiguous": lambda: ext.qkv_norm_rope_store(qkv, w, w, 1e-6, table, table,
                                                                                   pos, cache, cache[:2], slots, 4),
    }
    for message, call in cases.items():
        with pytest.raises(RuntimeError, match=message):
            call()
    assert ext.qkv_norm_rope_store(qkv[:0], w, w, 1e-6, table, table, pos[:0], cache, cache, slots[:0], 4).shape == (0, 4, 8)
