"""Prefill attention with shared prefixes read once (``benchmarks.lib.shared_prefix``, the
candidate the kernel benchmark times): a group's questions over their common cached prefix in
one unmasked pass, each question's own keys causal, merged by log-sum-exp, equals the
reference's attention over each whole context (CPU math, and torch's FlashAttention on a GPU);
a plan refuses groups whose members do not hold the prefix."""

from __future__ import annotations

import pytest
import torch

from benchmarks.lib.shared_prefix import plan_shared_prefix, shared_prefix_attention
from lmpool.ops import reference

BLOCK = 4


def _case(device, dtype, query_lens, own_blocks, groups, prefix_blocks, seed=0, kv_heads=2, group=2, d=16):
    """Sequences whose tables start with a group's prefix blocks (shared ids), then own blocks."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    k_cache, v_cache = (torch.randn(num_blocks, BLOCK, kv_heads, d, generator=gen).to(device, dtype) for _ in range(2))
    free = iter(torch.randperm(num_blocks, generator=gen).tolist())
    tables, lens = [None] * len(query_lens), [0] * len(query_lens)
    shared = {}
    for g, members in enumerate(groups):
        shared[g] = [next(free) for _ in range(prefix_blocks[g])]
        for s in members:
            tables[s] = list(shared[g])
    for s, (n, own) in enumerate(zip(query_lens, own_blocks)):
        head = tables[s] or []
        tables[s] = head + [next(free) for _ in range(own)]
        assert own * BLOCK >= n
        lens[s] = (len(head) + own) * BLOCK - (own * BLOCK - n) // 2  # ends mid-block where it may
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    q = torch.randn(sum(query_lens), kv_heads * group, d, generator=gen).to(device, dtype)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    plan = plan_shared_prefix(tables, lens, query_lens, [(m, prefix_blocks[g]) for g, m in enumerate(groups)],
                              BLOCK, device)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    want = reference.paged_attention(q, k_cache, v_cache, padded, ctx, qsl, d**-0.5)
    return shared_prefix_attention(q, k_cache, v_cache, qsl, plan, d**-0.5), want


@pytest.mark.parametrize("query_lens,own_blocks,groups,prefix_blocks", [
    ([3, 3, 3], [1, 1, 1], [[0, 1, 2]], [4]),  # questions over one document
    ([1, 4, 2, 5], [1, 2, 1, 2], [[0, 2], [1, 3]], [3, 2]),  # two documents, members interleaved
    ([2, 2, 6], [1, 1, 2], [[0, 1]], [5]),  # one sequence in no group: all of its keys its own
    ([4, 1], [3, 1], [[0, 1]], [1]),  # a member with private cached blocks after the prefix
])
def test_it_equals_the_reference(query_lens, own_blocks, groups, prefix_blocks):
    out, want = _case("cpu", torch.float64, query_lens, own_blocks, groups, prefix_blocks)
    assert out.shape == want.shape and out.dtype == want.dtype
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)


def test_without_groups_every_sequence_reads_its_whole_context():
    out, want = _case("cpu", torch.float64, [2, 3], [2, 3], [], [])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)


def test_a_plan_refuses_members_that_do_not_hold_the_prefix():
    tables, lens, queries = [[0, 1, 2], [0, 5, 6]], [11, 11], [3, 3]
    with pytest.raises(ValueError, match="does not hold"):
        plan_shared_prefix(tables, lens, queries, [([0, 1], 2)], BLOCK)  # block 1 is 0's alone
    with pytest.raises(ValueError, match="does not hold"):
        plan_shared_prefix(tables, [9, 9], [3, 3], [([0, 1], 2)], BLOCK)  # the prefix reaches a new token
    with pytest.raises(ValueError, match="two groups"):
        plan_shared_prefix([[0, 1], [0, 1], [0, 1]], [9, 9, 9], [1, 1, 1], [([0, 1], 1), ([1, 2], 1)], BLOCK)
    with pytest.raises(ValueError, match="two members or more"):
        plan_shared_prefix(tables, lens, queries, [([0], 1)], BLOCK)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("query_lens,own_blocks,groups,prefix_blocks", [
    ([3, 3, 3], [1, 1, 1], [[0, 1, 2]], [4]),
    ([1, 4, 2, 5], [1, 2, 1, 2], [[0, 2], [1, 3]], [3, 2]),
    ([2, 2, 6], [1, 1, 2], [[0, 1]], [5]),
])
def test_it_equals_the_reference_through_flash_attention(query_lens, own_blocks, groups, prefix_blocks):
    out, want = _case("cuda", torch.bfloat16, query_lens, own_blocks, groups, prefix_blocks, d=128)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
