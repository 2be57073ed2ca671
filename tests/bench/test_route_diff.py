"""``benchmarks/route_diff.py``: requests compared by what rank labels cannot change."""

from __future__ import annotations

from benchmarks.route_diff import compare


def columns(ranks, cached, pinned=None):
    n = len(ranks)
    return {"rank": ranks, "num_cached_tokens": cached, "group": ["a", "b", "a", "b", "a"][:n],
            "phase": ["main"] * n, "pinned_rank": pinned or [None] * n}


def test_relabelled_ranks_agree_and_a_moved_group_is_named():
    same = compare(columns([0, 1, 0, 1, 0], [0, 0, 8, 8, 8]), columns([1, 0, 1, 0, 1], [0, 0, 8, 8, 8]))
    assert same["stay"] == (5, 5) and same["differ"] == [] and same["spread"] == ({}, {})
    moved = compare(columns([0, 1, 0, 1, 1], [0, 0, 8, 8, 0]), columns([0, 1, 0, 1, 0], [0, 0, 8, 8, 8]))
    assert moved["stay"] == (4, 5) and moved["cold"] == (3, 2)
    assert moved["spread"] == ({"a": 2}, {})
    assert moved["differ"] == [(4, "main", "a", False, True, 0, 8)]


def test_pinned_requests_are_left_out():
    pinned = [1, None, None]
    c = compare(columns([1, 0, 0], [0, 0, 8], pinned), columns([1, 1, 1], [0, 0, 8], pinned))
    assert c["routed"] == 2 and c["stay"] == (2, 2)
