"""One sequence's prefill attention through dense attention (``lmpool.ops.dense_attention``):
a context longer than its query split into the prefix (GQA heads folded into rows) and the
query's own keys (causal), merged by log-sum-exp, equals the reference on the CPU's math; the
merge itself is softmax over the union of two key sets."""

from __future__ import annotations

import os

import pytest
import torch

from lmpool.ops import dense_attention, reference


@pytest.mark.parametrize("n,prefix,group", [(7, 0, 1), (16, 0, 2), (5, 11, 2), (16, 48, 4), (1, 30, 8), (33, 1, 1)])
def test_one_sequence_matches_the_reference(n, prefix, group):
    gen = torch.Generator().manual_seed(n * 100 + prefix + group)
    kv_heads, d = 2, 16
    q = torch.randn(n, kv_heads * group, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(n + prefix, kv_heads, d, generator=gen, dtype=torch.float64) for _ in range(2))
    out = dense_attention.one_sequence_attention(q, k, v, d**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, reference.attention_over(q, k, v, d**-0.5), atol=1e-6, rtol=1e-6)


def test_the_merge_of_two_key_sets_is_softmax_over_their_union():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 5, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 12, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    whole, whole_lse = dense_attention.attend_with_lse(q, k, v, False, 0.3)
    first, first_lse = dense_attention.attend_with_lse(q, k[:, :, :4], v[:, :, :4], False, 0.3)
    rest, rest_lse = dense_attention.attend_with_lse(q, k[:, :, 4:], v[:, :, 4:], False, 0.3)
    torch.testing.assert_close(dense_attention.merge(first, first_lse, rest, rest_lse), whole.float())
    torch.testing.assert_close(torch.logaddexp(first_lse, rest_lse), whole_lse)


def test_usable_checks_the_path_on_the_device():
    assert dense_attention.usable(torch.device("cpu"))


def test_bucket_starts_cover_each_power_of_two_bucket_once_at_its_smallest_length():
    starts = dense_attention._bucket_starts(512, 8192)
    assert starts == [512, 513, 1025, 2049, 4097]
    buckets = {1 << (n - 1).bit_length() for n in range(512, 8193)}  # torch rounds each length up
    assert {1 << (s - 1).bit_length() for s in starts} == buckets
    assert dense_attention._bucket_starts(3, 5) == [3, 5] and dense_attention._bucket_starts(7, 7) == [7]


def test_warm_builds_nothing_off_a_gpu():
    assert dense_attention.warm(torch.device("cpu"), torch.float32, 4, 2, 16, 512, 8192, 40960) == 0
    assert dense_attention.warm(torch.device("cuda"), torch.float32, 4, 2, 16, 512, 256, 40960) == 0  # no such query


@pytest.mark.parametrize("group", [1, 2, 3, 5, 6, 8])
def test_warm_queries_reach_every_bucket_of_a_query_and_of_its_folded_rows(group):
    def bucket(n):
        return 1 << (n - 1).bit_length()
    queries = dense_attention._warm_queries(512, 8192, group)
    assert all(512 <= n <= 8192 for n in queries)
    assert {bucket(n) for n in range(512, 8193)} <= {bucket(n) for n in queries}
    assert {bucket(n * group) for n in range(512, 8193)} <= {bucket(n * group) for n in queries}


def test_bucketed_plans_are_set_on_where_the_process_has_not_chosen(monkeypatch):
    monkeypatch.delenv(dense_attention.BUCKETED_PLANS, raising=False)
    assert dense_attention.bucketed_plans() and os.environ[dense_attention.BUCKETED_PLANS] == "1"
    monkeypatch.setenv(dense_attention.BUCKETED_PLANS, "0")
    assert not dense_attention.bucketed_plans() and os.environ[dense_attention.BUCKETED_PLANS] == "0"
    monkeypatch.setenv(dense_attention.BUCKETED_PLANS, "on")
    assert dense_attention.bucketed_plans()
