"""Foreground release on the control plane: which partner gets a shortage's victims, which
ancestors travel with them, every reason to refuse, and the gate refusing little reuse and
admitting much, with both figures logged."""

from __future__ import annotations

import logging

import pytest

from lmpool.control.transfers.foreground import plan_release
from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.engine.hashing import ROOT_HASH
from lmpool.protocol.kv_events import KVSnapshot
from lmpool.protocol import LoadReport, ShortageReport
from lmpool.control.transfers.admission import AdmissionGate, AdmissionPolicy
from lmpool.control.transfers.cost_model import TransferCostModel
from control_testkit import cache

BLOCK = 16
# Rank 0's cached chain 1-2-3-4, whose two leaves 3 and 4 are the victims; 1 and 2 travel as ancestors.
REPORT = ShortageReport(0, 1, 7, hashes=[1, 2, 3, 4], parents=[ROOT_HASH, 1, 2, 3], generations=[5, 5, 6, 6],
                        num_victims=2, expected_reuses=2.0)


def world(n: int = 3, free: int = 50):
    gbm = GlobalBlockManager(n, BLOCK)
    for r in range(n):
        gbm.register_rank(r, 1, 100)
        gbm.apply_snapshot(r, 1, KVSnapshot(0, []))
        gbm.update_load(r, 1, LoadReport(blocks_free=free))
    return gbm


def gate(prefill: float = 1e-3) -> AdmissionGate:
    # ~1 ms + ~1 ms per block: a 4-block move costs ~5 ms; a block saves 16 ms of prefill per reuse.
    return AdmissionGate(AdmissionPolicy(prefill_s_per_token=prefill, block_size=BLOCK),
                         TransferCostModel.uncalibrated(4096, 1e-3, 4e6))


def release(gbm, report=REPORT, partners=(1, 2), g=None, free=None):
    free_blocks = free or (lambda r: gbm.ranks[r].load.blocks_free)
    return plan_release(report, gbm, partners, free_blocks, g or gate(), lambda r: None)


def test_victims_move_with_the_ancestors_the_partner_lacks():
    plan, reason = release(world())
    assert reason == "" and plan.dst == 1
    assert plan.hashes == [1, 2, 3, 4] and plan.parents == [ROOT_HASH, 1, 2, 3] and plan.generations == [5, 5, 6, 6]
    assert plan.keep == 2, "the ancestors are copied, not moved"


def test_the_partner_that_already_holds_the_ancestors_is_preferred():
    gbm = world()
    cache(gbm, 2, [1, 2])
    plan, _ = release(gbm)
    assert plan.dst == 2 and plan.hashes == [3, 4] and plan.keep == 0


def test_a_victim_the_partner_holds_is_not_sent():
    gbm = world(n=2)
    cache(gbm, 1, [1, 2, 3])
    plan, _ = release(gbm, partners=(1,))
    assert plan.hashes == [4] and plan.keep == 0 and plan.decision.num_blocks == 1


def test_refusals_name_their_reason():
    gbm = world(n=2)
    cache(gbm, 1, [1, 2, 3, 4])
    assert release(gbm, partners=(1,)) == (None, "rank 1 already holds every victim")
    assert release(world(n=2, free=3), partners=(1,)) == (None, "rank 1 has 3 free blocks for 4")
    gbm = world(n=2)
    gbm.mark_in_flight(1, 3, 9, 1)
    assert release(gbm, partners=(1,))[1].startswith("a plan is already bringing")
    gbm = world(n=2)
    gbm.mark_dead(1)
    assert release(gbm, partners=(1,)) == (None, "no live partner")
    assert release(world(n=2), partners=()) == (None, "no live partner")


def test_the_gate_refuses_little_reuse_and_admits_much(caplog):
    caplog.set_level(logging.INFO, logger="lmpool.control.transfers.admission")
    g = gate()
    never = ShortageReport(0, 1, 8, hashes=[1, 2, 3, 4], parents=[ROOT_HASH, 1, 2, 3], generations=[5] * 4,
                           num_victims=2, expected_reuses=0.0)
    plan, reason = release(world(), report=never, g=g)
    assert plan is None and reason.startswith("refuse foreground transfer 0->1 of 4 blocks: saves 0.000 ms")
    plan, _ = release(world(), g=g)
    assert plan is not None and plan.decision.admitted
    # Two victims x 16 tokens x 1 ms, reused 1 + 0.5 times (discounted): 48 ms, for 4 blocks' transfer.
    assert plan.decision.saved_prefill_s == pytest.approx(2 * BLOCK * 1e-3 * 1.5)
    assert plan.decision.transfer_cost_s == pytest.approx(g.cost_model.estimate(0, 1, 4))
    logged = [r.getMessage() for r in caplog.records]
    assert logged[0].startswith("refuse foreground") and logged[1].startswith("admit foreground transfer 0->1 of 4")
    assert (g.admitted, g.refused) == (1, 1)


def test_a_cheap_prefill_is_not_worth_a_move():
    plan, reason = release(world(), g=gate(prefill=1e-6))
    assert plan is None and reason.startswith("refuse foreground")


def test_malformed_reports_are_errors():
    bad = ShortageReport(0, 1, 9, hashes=[1, 2], parents=[ROOT_HASH], generations=[1, 1], num_victims=1,
                         expected_reuses=1.0)
    with pytest.raises(ValueError, match="malformed shortage report from rank 0"):
        release(world(), report=bad)
