"""Microbenchmarks of LMPool's CUDA kernels, driven by pytest (``pytest benchmarks/test_bench_kernels.py -s``).

Every memory-bound figure is reported as a fraction of the device-to-device copy
bandwidth measured in the same run (read + write bytes of a large clone), and
against the torch reference (``lmpool.ops.reference``), timed on the lighter
cases where it is slow. Shapes follow Qwen3-0.6B: 16 q heads, 8 kv heads,
head_dim 128, bf16, 256-token blocks (16-token blocks as well for decode).

Timing: ``triton.testing.do_bench`` medians (it clears L2 before every run);
without triton, CUDA events around runs that each follow an L2-sized clear.
Results go to the JSON file named by ``LMPOOL_BENCH_JSON`` when it is set.
"""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch
import torch.nn.functional as F

from lmpool.ops import cuda, dense_attention, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

Q_HEADS, KV_HEADS, HEAD_DIM, DTYPE = 16, 8, 128, torch.bfloat16
# torch's FlashAttention reading the paged cache by its block tables (``prefill_attention='flash'``)
# where this torch has it (torch 2.11's has not: the rows then say why).
NO_FLASH_PAGED = cuda.flash_paged_unavailable()
LAYERS = 28
GB = 1e9


def time_ms(fn) -> float:
    """Median milliseconds per call, L2 cleared before each call."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return _time_with_events(fn, reps=20)
    return float(do_bench(fn, warmup=10, rep=60, return_mode="median"))


def _time_with_events(fn, reps: int) -> float:
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def slow_ms(fn) -> float:
    """For the reference: few runs, since one call can take many milliseconds."""
    return _time_with_events(fn, reps=3)


@pytest.fixture(scope="module")
def ext():
    return cuda.load_extension()


@pytest.fixture(scope="module")
def report():
    props = torch.cuda.get_device_properties(0)
    data = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bf16"},
    }
    yield data
    path = os.environ.get("LMPOOL_BENCH_JSON")
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
        print(f"\nwrote {path}")


@pytest.fixture(scope="module")
def copy_gbps(report) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    gbps = 2 * src.numel() / (ms * 1e-3) / GB
    report["copy_GBps"] = gbps
    print(f"\ndevice-to-device copy (1 GiB, read + write): {ms:.3f} ms = {gbps:.0f} GB/s")
    del src, dst
    return gbps


def _record(report, section, row):
    report.setdefault(section, []).append(row)
    print(f"{section}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


def _decode_inputs(batch, ctx, block_size, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = ctx // block_size
    num_blocks = batch * per_seq
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    tables = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32).view(batch, per_seq)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, tables, lens


DECODE_CASES = [(b, c, bs) for bs in (256, 16) for c in (2048, 4096) for b in (64, 128, 256)]
DECODE_CASES += [(1, 2048, 256), (8, 2048, 256)]  # the small batches of a latency-bound step


@pytest.mark.parametrize("batch,ctx,block_size", DECODE_CASES)
def test_decode(ext, report, copy_gbps, batch, ctx, block_size):
    q, k_cache, v_cache, tables, lens = _decode_inputs(batch, ctx, block_size)
    scale = HEAD_DIM**-0.5
    ms = time_ms(lambda: ext.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale))
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
    gbps = kv_bytes / (ms * 1e-3) / GB
    row = {
        "batch": batch,
        "ctx": ctx,
        "block_size": block_size,
        "splits": ext.decode_splits(batch, Q_HEADS, KV_HEADS, ctx, 0),
        "ms": ms,
        "GBps": gbps,
        "frac_copy": gbps / copy_gbps,
    }
    if block_size == 256 and NO_FLASH_PAGED:
        row["flash_paged"] = NO_FLASH_PAGED
    elif block_size == 256:  # torch's FlashAttention over the same paged cache, one query a sequence
        starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        keys = torch.arange(0, batch * ctx + 1, ctx, dtype=torch.int32, device="cuda")
        flash_ms = time_ms(lambda: cuda.flash_paged_attention(q, k_cache, v_cache, tables, lens, starts, scale, keys,
                                                              1, ctx))
        row["flash_paged_ms"] = flash_ms
        row["speedup_vs_flash_paged"] = flash_ms / ms
    if batch == 64 and ctx == 2048:
        ref_ms = slow_ms(lambda: reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale))
        row["ref_ms"] = ref_ms
        row["speedup_vs_ref"] = ref_ms / ms
        if block_size == 256:
            # Dense, unpaged anchor: torch SDPA on contiguous [batch, heads, ctx, head_dim] K/V.
            k = k_cache[tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
            v = v_cache[tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
            q4 = q.unsqueeze(2)
            sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
            row["sdpa_dense_ms"] = sdpa_ms
            row["speedup_vs_sdpa_dense"] = sdpa_ms / ms
            del k, v
    _record(report, "decode", row)
    if block_size == 256 and batch >= 64:
        assert gbps / copy_gbps > 0.5, "decode far below copy bandwidth"


@pytest.mark.parametrize("num_splits", [1, 2, 3, 4, 6, 8, 0])
@pytest.mark.parametrize("batch,ctx", [(64, 2048), (64, 4096), (128, 2048), (256, 2048), (67, 8192)])
def test_decode_split_sweep(ext, report, copy_gbps, batch, ctx, num_splits):
    """The split-K factor against bandwidth; 0 is the automatic choice."""
    q, k_cache, v_cache, tables, lens = _decode_inputs(batch, ctx, 256)
    ms = time_ms(lambda: ext.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, num_splits))
    gbps = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2 / (ms * 1e-3) / GB
    chosen = num_splits or ext.decode_splits(batch, Q_HEADS, KV_HEADS, ctx, 0)
    _record(report, "decode_split_sweep", {
        "batch": batch, "ctx": ctx, "num_splits": chosen, "auto": num_splits == 0, "ms": ms,
        "frac_copy": gbps / copy_gbps,
    })


@pytest.mark.parametrize("batch", [1, 4])
def test_decode_few_long_sequences(ext, report, copy_gbps, batch):
    ctx, block_size = 32768, 256
    q, k_cache, v_cache, tables, lens = _decode_inputs(batch, ctx, block_size)
    auto_ms = time_ms(lambda: ext.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1))
    one_ms = time_ms(lambda: ext.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, 1))
    # The few-rows target alone (about six CTAs an SM), which may pass one wave of the SMs' slots
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    target = min(ctx // 256, -(-6 * sms // (batch * KV_HEADS)))
    target_ms = time_ms(lambda: ext.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, target))
    gbps = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2 / (auto_ms * 1e-3) / GB
    _record(report, "decode_long", {
        "batch": batch, "ctx": ctx, "splits": ext.decode_splits(batch, Q_HEADS, KV_HEADS, ctx, 0),
        "ms": auto_ms, "frac_copy": gbps / copy_gbps, "no_split_ms": one_ms, "split_speedup": one_ms / auto_ms,
        "target_splits": target, "target_ms": target_ms, "slots": ext.decode_slots(Q_HEADS, KV_HEADS, 0),
    })


@pytest.mark.parametrize("rows,prefix", [(8, 16384), (32, 16384), (64, 16384), (32, 32768), (32, 2048)])
def test_cascade_decode(ext, report, rows, prefix):
    """Rows sharing one cached document (a burst's questions about it), each with its own 64
    keys after it: the prefix read once for all rows on tensor cores against every row reading
    it (``paged_decode_attention`` over the same tables)."""
    from tests.kernels.cascade_cases import cascade_case

    gen = torch.Generator().manual_seed(rows)
    case = cascade_case([(prefix // 256, [64] * rows)], 256, Q_HEADS, KV_HEADS, HEAD_DIM, DTYPE, gen, "cuda")
    scale = HEAD_DIM**-0.5
    cascade_ms = time_ms(lambda: ext.cascade_decode_attention(*case.cascade_args(), scale))
    decode_ms = time_ms(lambda: ext.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                                           case.context_lens, scale))
    _record(report, "cascade_decode", {
        "rows": rows, "prefix": prefix, "own": 64, "cascade_ms": cascade_ms, "decode_ms": decode_ms,
        "speedup": decode_ms / cascade_ms,
    })


@pytest.fixture(scope="module")
def kv_cache():
    # 192 blocks of Qwen3-0.6B: 28 layers x {K, V} x 512 KiB per block = 5.6 GB.
    shape = (LAYERS, 2, 192, 256, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, device="cuda", dtype=DTYPE)


@pytest.mark.parametrize("blocks", [16, 64, 128])
def test_pack_unpack(ext, report, copy_gbps, kv_cache, blocks):
    gen = torch.Generator(device="cuda").manual_seed(blocks)
    ids = torch.randperm(kv_cache.shape[2], generator=gen, device="cuda")[:blocks]
    payload = ext.pack_kv(kv_cache, ids)
    moved = 2 * payload.numel() * payload.element_size()  # read + write
    pack_ms = time_ms(lambda: ext.pack_kv(kv_cache, ids))
    unpack_ms = time_ms(lambda: ext.unpack_kv(kv_cache, ids, payload))
    ref_pack_ms = time_ms(lambda: reference.pack_kv(kv_cache, ids))
    ref_unpack_ms = time_ms(lambda: reference.unpack_kv(kv_cache, ids, payload))
    for op, ms, ref_ms in (("pack", pack_ms, ref_pack_ms), ("unpack", unpack_ms, ref_unpack_ms)):
        gbps = moved / (ms * 1e-3) / GB
        _record(report, op, {
            "blocks": blocks, "MB": payload.numel() * 2 / 1e6, "ms": ms, "GBps": gbps,
            "frac_copy": gbps / copy_gbps, "ref_ms": ref_ms, "speedup_vs_ref": ref_ms / ms,
        })
        assert gbps / copy_gbps > 0.5, f"{op} far below copy bandwidth"


# The 0.6B shape's projections (qkv, o, gate/up, down) and its tied output projection, [n, k].
LINEAR_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("n,k", LINEAR_SHAPES)
def test_linear(ext, report, copy_gbps, rows, n, k):
    """A decode step's projections: the skinny kernel (each weight read once) and its tensor-core
    candidate against cuBLAS (``F.linear``), in weight bytes a second and as a share of the copy
    bandwidth."""
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(rows, k, generator=gen, device="cuda", dtype=DTYPE)
    w = torch.randn(n, k, generator=gen, device="cuda", dtype=DTYPE)
    ms = time_ms(lambda: ext.skinny_linear(x, w))
    mma_ms = time_ms(lambda: ext.skinny_linear_mma(x, w))
    cublas_ms = time_ms(lambda: F.linear(x, w))
    weight_gb = n * k * 2 / GB
    _record(report, "linear", {
        "rows": rows, "n": n, "k": k, "ms": ms, "GBps": weight_gb / (ms * 1e-3),
        "frac_copy": weight_gb / (ms * 1e-3) / copy_gbps, "cublas_ms": cublas_ms,
        "cublas_GBps": weight_gb / (cublas_ms * 1e-3), "speedup_vs_cublas": cublas_ms / ms,
        "mma_ms": mma_ms, "mma_speedup_vs_cublas": cublas_ms / mma_ms,
    })


PREFILL_CASES = [  # (sequences, new tokens each, cached prefix each)
    (8, 512, 0),
    (4, 256, 2048),
    (1, 4096, 0),
    (32, 32, 4096),
    # Questions over a long cached document: the shapes the key splits are for.
    (1, 64, 16384),
    (4, 64, 16384),
    (1, 64, 32768),
    (32, 64, 16384),
    # A 16k-token document's prefill in the engine's 8192-token steps: cold, then over the first half.
    (1, 8192, 0),
    (1, 8192, 8192),
]


def _sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> str:
    """The backend torch's scaled_dot_product_attention picks for these causal GQA inputs."""
    choice = torch._fused_sdp_choice(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    names = {int(b): b.name for b in torch.nn.attention.SDPBackend.__members__.values()}
    return names.get(int(choice), str(choice))


@pytest.mark.parametrize("seqs,new,prefix", PREFILL_CASES)
def test_prefill(ext, report, seqs, new, prefix):
    block_size = 256
    ctx = new + prefix
    per_seq = -(-ctx // block_size)
    gen = torch.Generator(device="cuda").manual_seed(new)
    shape = (seqs * per_seq, block_size, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    tables = torch.randperm(shape[0], generator=gen, device="cuda").to(torch.int32).view(seqs, per_seq)
    q = torch.randn(seqs * new, Q_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
    starts = torch.arange(0, seqs * new + 1, new, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM**-0.5
    mma_ms = time_ms(lambda: ext.paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts, scale, True))
    splits = ext.prefill_splits(seqs * new, seqs, Q_HEADS, KV_HEADS, per_seq * block_size, 0)
    rows_ms = time_ms(lambda: ext.paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts, scale, False))
    pairs = seqs * (new * prefix + new * (new + 1) // 2)  # visible (query, key) pairs
    flops = 4 * pairs * Q_HEADS * HEAD_DIM
    row = {
        "seqs": seqs, "new": new, "prefix": prefix, "ms": mma_ms, "TFLOPs": flops / (mma_ms * 1e-3) / 1e12,
        "rows_path_ms": rows_ms, "speedup_vs_rows_path": rows_ms / mma_ms, "splits": splits,
    }
    if splits > 1:
        unsplit_ms = time_ms(
            lambda: ext.paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts, scale, True, 1))
        row["unsplit_ms"] = unsplit_ms
        row["speedup_vs_unsplit"] = unsplit_ms / mma_ms
    if seqs * new <= 2048 and prefix < 16384:
        ref_ms = slow_ms(lambda: reference.paged_attention(q, k_cache, v_cache, tables, lens, starts, scale))
        row["ref_ms"] = ref_ms
        row["speedup_vs_ref"] = ref_ms / mma_ms
    key_starts = torch.arange(0, seqs * ctx + 1, ctx, dtype=torch.int32, device="cuda")
    # torch's FlashAttention (varlen) on the same keys copied out into one run per sequence (the copy
    # untimed): the library's attention on these shapes, with or without its paged form.
    k, v = (cache[tables.long()].flatten(1, 2)[:, :ctx].flatten(0, 1) for cache in (k_cache, v_cache))
    varlen_ms = time_ms(lambda: torch.ops.aten._flash_attention_forward(
        q, k, v, starts, key_starts, new, ctx, 0.0, True, return_debug_mask=False, scale=scale))
    row["flash_varlen_ms"] = varlen_ms
    row["flash_varlen_TFLOPs"] = flops / (varlen_ms * 1e-3) / 1e12
    row["speedup_vs_flash_varlen"] = varlen_ms / mma_ms
    del k, v
    # ... and with the copy timed: prefill_attention="flash" on a torch whose FlashAttention reads
    # no block tables gathers each context's keys and values by their slots, every layer.
    slots = (tables.long()[:, :, None] * block_size + torch.arange(block_size, device="cuda")).flatten(1)[:, :ctx]
    slots = slots.flatten().to(torch.int32)
    gather_ms = time_ms(lambda: cuda.flash_gathered_attention(q, k_cache, v_cache, tables, lens, starts, scale,
                                                             key_starts, new, ctx, slots))
    row["flash_gather_ms"] = gather_ms
    if seqs == 1:  # one sequence: the gathered path runs torch's dense attention where usable
        row["flash_gather_path"] = "dense" if dense_attention.usable(q.device) else "varlen"
    row["flash_gather_TFLOPs"] = flops / (gather_ms * 1e-3) / 1e12
    row["speedup_vs_flash_gather"] = gather_ms / mma_ms
    if NO_FLASH_PAGED:
        row["flash_paged"] = NO_FLASH_PAGED
    else:  # reading the same paged cache by the same tables (prefill_attention="flash")
        flash_ms = time_ms(lambda: cuda.flash_paged_attention(q, k_cache, v_cache, tables, lens, starts, scale,
                                                              key_starts, new, ctx))
        row["flash_paged_ms"] = flash_ms
        row["flash_TFLOPs"] = flops / (flash_ms * 1e-3) / 1e12
        row["speedup_vs_flash_paged"] = flash_ms / mma_ms
    if prefix == 0:
        # Dense anchor: torch SDPA (flash) causal on contiguous K/V of the same tokens.
        k = k_cache[tables.long()].flatten(1, 2)[:, :new].transpose(1, 2).contiguous()
        v = v_cache[tables.long()].flatten(1, 2)[:, :new].transpose(1, 2).contiguous()
        q4 = q.view(seqs, new, Q_HEADS, HEAD_DIM).transpose(1, 2)
        sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=scale, enable_gqa=True))
        row["sdpa_dense_ms"] = sdpa_ms
        row["sdpa_dense_backend"] = _sdpa_backend(q4, k, v, scale)
        row["speedup_vs_sdpa_dense"] = sdpa_ms / mma_ms
    _record(report, "prefill", row)


SHARED_PREFIX_CASES = [  # (questions, new tokens each, the document they share)
    (12, 64, 16384),
    (32, 64, 16384),
    (8, 64, 32768),
    (4, 512, 8192),
]


@pytest.mark.parametrize("seqs,new,prefix", SHARED_PREFIX_CASES)
def test_prefill_shared_prefix(ext, report, seqs, new, prefix):
    """A burst's questions over one cached document in one step: LMPool's prefill kernel, each
    question's tiles reading the whole document, against the document read once for all of them
    (``benchmarks.lib.shared_prefix``: FlashAttention over the gathered document, each question's own keys
    causal, merged by log-sum-exp), the gathers timed."""
    from benchmarks.lib.shared_prefix import plan_shared_prefix, shared_prefix_attention

    block_size = 256
    doc, own = prefix // block_size, -(-new // block_size)
    gen = torch.Generator(device="cuda").manual_seed(prefix + seqs)
    shape = (doc + seqs * own, block_size, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    tables = [list(range(doc)) + [doc + s * own + i for i in range(own)] for s in range(seqs)]
    lens = [prefix + new] * seqs
    plan = plan_shared_prefix(tables, lens, [new] * seqs, [(list(range(seqs)), doc)], block_size, "cuda")
    t = torch.tensor(tables, dtype=torch.int32, device="cuda")
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    starts = torch.arange(0, seqs * new + 1, new, dtype=torch.int32, device="cuda")
    q = torch.randn(seqs * new, Q_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    mine = ext.paged_prefill_attention(q, k_cache, v_cache, t, ctx, starts, scale, True)
    shared = shared_prefix_attention(q, k_cache, v_cache, starts, plan, scale)
    torch.testing.assert_close(shared.float(), mine.float(), atol=2e-2, rtol=2e-2)
    mma_ms = time_ms(lambda: ext.paged_prefill_attention(q, k_cache, v_cache, t, ctx, starts, scale, True))
    shared_ms = time_ms(lambda: shared_prefix_attention(q, k_cache, v_cache, starts, plan, scale))
    flops = 4 * seqs * (new * prefix + new * (new + 1) // 2) * Q_HEADS * HEAD_DIM
    _record(report, "prefill_shared_prefix", {
        "seqs": seqs, "new": new, "prefix": prefix,
        "lmpool_ms": mma_ms, "lmpool_TFLOPs": flops / (mma_ms * 1e-3) / 1e12, "shared_ms": shared_ms, "shared_TFLOPs": flops / (shared_ms * 1e-3) / 1e12, "speedup": mma_ms / shared_ms,
    })
