"""Evaluation policies that vary LMPool's own routing settings: they reach the pool as a
``RoutingConfig``, and the acceptance never counts them as peers of LMPool."""

from __future__ import annotations

from collections import Counter

import pytest


from benchmarks import benchmark_kv_routing
from benchmarks.eval_suite import LMPOOL, LMPOOL_UNGROUPED, LMPOOL_OWNER_PULLS, LMPOOL_ROUTING, LMPOOL_VARIANTS, Policy
from lmpool.config.routing import RoutingConfig


def test_a_variant_passes_its_routing_config_and_a_plain_policy_passes_none():
    (without,) = [p for p in LMPOOL_VARIANTS if p.name == "lmpool-pending"]
    kw = without.pool_kwargs()
    assert kw["routing"] == "lmpool" and kw["routing_config"].pending_ttl_s == 0.0
    assert LMPOOL.pool_kwargs() == {"routing": "lmpool"}, "LMPool as a user gets it: no mode of its own"
    assert LMPOOL_ROUTING.pool_kwargs() == {"routing": "lmpool", "transfer_mode": "none"}, "routing only, always"
    assert Policy("x", "lmpool", "background").pool_kwargs() == {"routing": "lmpool", "transfer_mode": "background"}


def change(claim: str) -> dict:
    return {"relative_change": {"mean": 0.1, "low": 0.05, "high": 0.15, "n": 3},
            "difference": {"mean": 1.0, "low": 0.5, "high": 1.5, "n": 3}, "claim": claim}


def test_lmpool_variants_are_not_peers_in_the_acceptance(monkeypatch):
    def paired(by_policy, base, peer, metric):
        return change("behind" if peer in ("lmpool-pending", "sglang_cache_aware") else "ahead")

    monkeypatch.setattr(benchmark_kv_routing, "paired_change", paired)
    summary = {"locality_5x": {p: {} for p in ("lmpool", "round_robin", "sglang_cache_aware", "lmpool-pending")}}
    acceptance = benchmark_kv_routing.comparisons(summary)["acceptance"]
    assert acceptance["peers_better_beyond_ci"] == [
        "sglang_cache_aware:e2e_mean_ms", "sglang_cache_aware:throughput_tok_s", "sglang_cache_aware:ttft_mean_ms"]


def test_the_idle_transfers_control_sets_transfers_up_and_never_counts_as_a_transfer_mode(monkeypatch):
    """``lmpool+idle`` starts its pool with transfers enabled and no mode; a win of it over
    routing only would be the set-up's, so the e2e acceptance leaves it out."""
    from benchmarks import benchmark_e2e
    from benchmarks.eval_suite import TRANSFERS_IDLE

    assert TRANSFERS_IDLE.pool_kwargs() == {"routing": "lmpool", "transfer_mode": "none", "enable_transfers": True}
    monkeypatch.setattr(benchmark_e2e, "paired_change", lambda *a: change("ahead"))
    policies = ("lmpool-routing", "round_robin", "lmpool+idle", "lmpool+background", "lmpool")
    summary = {"load_skew": {p: {} for p in policies}}
    acceptance = benchmark_e2e.comparisons(summary)["acceptance"]
    assert acceptance["transfer_beats_routing_only"] == {"load_skew": ["lmpool", "lmpool+background"]}


def test_every_policy_takes_every_position_once_over_as_many_repetitions():
    from benchmarks.eval_suite import run_order

    policies = [Policy(n, "lmpool") for n in ("a", "b", "c", "d")]
    orders = [[p.name for p in run_order(policies, rep)] for rep in range(8, 12)]
    assert all(sorted(order) == ["a", "b", "c", "d"] for order in orders)
    for position in range(4):
        assert sorted(order[position] for order in orders) == ["a", "b", "c", "d"]
    assert run_order([], 3) == []


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_every_policy_follows_every_other_equally_often(n):
    """Over a block of n repetitions (even n) or two (odd n), each ordered pair of policies
    runs back to back equally often, and each block puts every policy in every position."""
    from benchmarks.eval_suite import run_order

    policies = [Policy(str(i), "lmpool") for i in range(n)]
    blocks = 1 if n % 2 == 0 else 2
    orders = [[p.name for p in run_order(policies, rep)] for rep in range(n, n + blocks * n)]
    pairs = Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    assert set(pairs) == {(a.name, b.name) for a in policies for b in policies if a is not b}
    assert set(pairs.values()) == {blocks}
    for block in range(blocks):
        rows = orders[block * n:(block + 1) * n]
        for position in range(n):
            assert sorted(order[position] for order in rows) == sorted(p.name for p in policies)


def test_peer_variants_pin_the_older_rules_and_are_refused_by_a_build_without_their_fields():
    """``sglang_cache_aware_v0`` and ``dynamo_kv_copy_v0`` name every field of the rule set they
    stand for; a routing config that lacks one refuses it (the suite then records the variant
    unavailable) rather than running today's rule under the old name."""
    import dataclasses

    from benchmarks.peers.eval_policies import PEER_VARIANTS

    from lmpool.config import RoutingConfig

    fields = {f.name for f in dataclasses.fields(RoutingConfig)}
    by_name = {p.name: p for p in PEER_VARIANTS}
    sglang = dict(by_name["sglang_cache_aware_v0"].routing_config)
    assert sglang["sglang_cache_threshold"] == 0.5 and sglang["sglang_balance_abs_threshold"] == 32
    assert sglang["sglang_balance_rel_threshold"] == 1.0001 and sglang["sglang_miss_rule"] == "smallest_tree"
    for policy in PEER_VARIANTS:
        missing = set(dict(policy.routing_config)) - fields
        if missing:
            with pytest.raises(TypeError):
                policy.pool_kwargs()
        else:
            assert policy.pool_kwargs()["routing_config"] is not None


def test_the_default_mode_passes_no_transfer_mode_and_records_which_it_ran():
    from benchmarks.peers.eval_policies import PEERS, default_transfer_mode

    assert LMPOOL.pool_kwargs() == {"routing": "lmpool"}
    assert LMPOOL.record()["transfer_mode"] == f"default ({default_transfer_mode()})"
    sglang = next(p for p in PEERS if p.name == "sglang_cache_aware").record()
    assert {"sglang_cache_threshold", "sglang_balance_abs_threshold", "sglang_balance_rel_threshold"} <= set(
        sglang["rule_fields"])
    assert "rule_fields" not in LMPOOL.record()


@pytest.mark.parametrize("candidate, option", [(LMPOOL_OWNER_PULLS, "owner_pulls"), (LMPOOL_UNGROUPED, "cascade_groups")])
def test_a_candidate_default_runs_the_default_mode_with_its_option_and_only_when_named(candidate, option):
    """A candidate turns one option of the default the other way (owner pulls on; cascade groups, the
    default since 1dc4676, off) and runs only when named."""
    import argparse

    from benchmarks import benchmark_e2e, benchmark_hot_context
    from benchmarks.eval_suite import chosen_policies

    kw = candidate.pool_kwargs()
    assert kw["routing"] == "lmpool" and "transfer_mode" not in kw
    assert getattr(kw["routing_config"], option) != getattr(RoutingConfig(), option), "the default's the other way"
    for runner in (benchmark_e2e, benchmark_hot_context, benchmark_kv_routing):
        assert candidate in runner.POLICIES
        every = chosen_policies(argparse.Namespace(quick=False, policies="all"), runner.POLICIES, "")
        assert candidate not in every and LMPOOL in every
        named = chosen_policies(argparse.Namespace(quick=False, policies=f"lmpool,{candidate.name}"), runner.POLICIES, "")
        assert named == [LMPOOL, candidate]
