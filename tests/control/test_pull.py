"""Route-time pulls on the control plane alone (``lmpool.control.transfers.pull``): which option
wins and why, one plan shared by the requests that need it, the outcomes a waiting request
hears, and nothing left behind by a pull that lands, aborts or loses a rank."""

from __future__ import annotations

import pytest
from control_testkit import COEF
from pull_rig import BLOCK, NUM_BLOCKS, PullRig

from lmpool.protocol import RouteQuery

DOC = list(range(1, 33))  # a 32-block cached document
# Its prefill (128 ms at 1 ms a token) outlasts a busy source's step (7.7 ms with 64 sequences
# of one block): workers read a copy's messages between steps, so only then can a pull win.
DEAR = COEF._replace(prefill_token=1e-3)


def busy_owner(rig: PullRig, running: int = 64, context: int = BLOCK) -> None:
    """The document's rank runs ``running`` sequences of ``context`` tokens each."""
    rig.cache(0, DOC)
    rig.load(0, running, decode_left=running * 64, context=running * context)
    for r in range(1, rig.gbm.world_size):
        rig.load(r, 0)


def test_a_busy_owner_sends_the_request_to_a_partner_that_pulls_the_prefix_first():
    rig = PullRig(coefficients=DEAR)
    busy_owner(rig)
    rid, decision = rig.route(DOC)
    assert decision.rank == 1 and decision.matched_blocks == 0
    assert decision.reason.startswith("pull r1<-r0:32b=")
    assert "serve r0=" in decision.reason and "; pull r1<-r0:32b=" in decision.reason
    # Its own price's parts come before the owner's it overrode (a record's reader takes the first).
    own_parts, owners = decision.reason.split(" over ", 1)
    assert "busy=" in own_parts and " own=" in own_parts and "busy=" in owners
    # Its first token once the copy has landed (after one of the source's steps, its prepare: the
    # destination reads the blocks, the idle destination's execute and publish wait for none) and
    # its last block's tail is computed.
    source_step = DEAR.base + 64 * DEAR.decode_seq + 64 * BLOCK * DEAR.context_token
    copy_s = rig.cost_model.estimate(0, 1, 32) + source_step
    assert decision.predicted_ttft_s == pytest.approx(copy_s + DEAR.base + DEAR.prefill_token)
    (plan,) = rig.coordinator.plans.values()
    assert (plan.src, plan.dst, plan.hashes, plan.kind) == (0, 1, DOC, "pull")
    assert rig.pulls.waiting == {rid: plan.plan_id}
    assert rig.gbm.reservations[rid].tokens == BLOCK + 1 - BLOCK  # only the last block's tail
    rig.check()
    rig.advance(plan.plan_id)
    rig.advance(plan.plan_id)
    rig.check()
    assert not rig.resolved
    rig.advance(plan.plan_id)  # the destination publishes: the request may run
    assert rig.resolved == [(rid, "landed")]
    assert rig.gbm.prefix_match(DOC)[1] == len(DOC)
    rig.finish(plan.plan_id)
    rig.check()


def test_a_pull_decided_opens_its_plan_as_its_route_is_recorded():
    """The decision ends with the choice: the plan and its waiter open with the route's record
    (before the next route is decided), and the request is known to wait from the decision on."""
    rig = PullRig(coefficients=DEAR)
    busy_owner(rig)
    query = RouteQuery("first", DOC, len(DOC) * BLOCK + 1, 64)
    decision = rig.router.decide(query)
    assert decision.rank == 1 and decision.reason.startswith("pull r1<-r0:32b=")
    assert not rig.coordinator.plans and not rig.pulls.waiting and not rig.sent
    assert rig.pulls.waits("first") and not rig.pulls.waits("other")
    rig.router.record()
    (plan,) = rig.coordinator.plans.values()
    assert rig.pulls.waiting == {"first": plan.plan_id} and rig.pulls.waits("first")
    # The next request for the document shares it: it is decided after the first was recorded.
    rid, decision = rig.route(DOC)
    assert decision.rank == 1 and rig.pulls.waiting == {"first": plan.plan_id, rid: plan.plan_id}
    rig.check()


def test_a_pull_of_a_decision_never_recorded_never_opens():
    """A route whose decision failed after its pull was chosen is never recorded: the next
    route's settling forgets that pull, and no plan opens for it."""
    rig = PullRig(coefficients=DEAR)
    busy_owner(rig)
    rig.router.decide(RouteQuery("lost", DOC, len(DOC) * BLOCK + 1, 64))
    rig.router._unrecorded = None  # as if the decision had raised before it ended
    rid, decision = rig.route([100, 101])  # another prompt: no pull
    assert not rig.pulls.waits("lost") and not rig.coordinator.plans and not rig.pulls.waiting
    rig.check()


def test_where_workers_serve_orders_while_stepping_a_busy_source_delays_no_pull():
    """CUDA workers answer a plan's orders while a step runs: the pull's price then counts only
    the destination's step under way, behind which its copy runs (none: it is idle)."""
    rig = PullRig(coefficients=DEAR, held=False)
    busy_owner(rig)
    _, decision = rig.route(DOC)
    assert decision.rank == 1 and decision.reason.startswith("pull r1<-r0:32b=")
    copy_s = rig.cost_model.estimate(0, 1, 32)
    assert decision.predicted_ttft_s == pytest.approx(copy_s + DEAR.base + DEAR.prefill_token)
    (plan,) = rig.coordinator.plans.values()
    rig.finish(plan.plan_id)
    rig.check()


def test_a_landed_pull_teaches_the_cost_model_its_time_to_publication_not_the_source_s_finalize():
    """The requests a pull holds go at publication; the source's finalize comes after. The
    cost model's correction learns the former (less the steps the opener priced)."""
    rig = PullRig(coefficients=DEAR, held=False)
    busy_owner(rig)
    estimate = rig.cost_model.estimate(0, 1, 32)
    rig.route(DOC)
    (plan,) = rig.coordinator.plans.values()
    for phase_s in (0.010, 0.020, 0.030):  # prepared, executed, published: 60 ms in all
        rig.clock.now += phase_s
        rig.advance(plan.plan_id)
    rig.clock.now += 10.0  # a finalize ten seconds late
    rig.advance(plan.plan_id)
    assert plan.plan_id not in rig.coordinator.plans
    alpha = rig.cost_model.ewma_alpha
    assert rig.cost_model.estimate(0, 1, 32) == pytest.approx(estimate * (1 - alpha) + 0.060 * alpha)
    rig.check()


def test_a_copy_goes_to_the_emptiest_of_the_ranks_priced_alike():
    """Idle ranks price alike; one that holds a document nothing has asked for yet (its
    questions may be coming) is not where another document's copy should land."""
    rig = PullRig(world=4, coefficients=DEAR)
    busy_owner(rig)
    other = list(range(100, 132))
    rig.cache(1, other)
    rig.load(1, 0, free=NUM_BLOCKS - 100 - len(other))
    _, decision = rig.route(DOC)
    assert decision.reason.startswith("pull r2<-r0:32b=")
    (plan,) = rig.coordinator.plans.values()
    assert plan.dst == 2
    rig.finish(plan.plan_id)
    rig.check()


def test_an_idle_owner_keeps_its_request_and_no_copy_starts():
    rig = PullRig(coefficients=DEAR)
    busy_owner(rig, running=3)  # within the bounded-load gate
    _, decision = rig.route(DOC)
    assert decision.rank == 0 and decision.reason.startswith("owner r0")
    assert not rig.coordinator.plans and not rig.pulls.waiting


@pytest.mark.parametrize("owner_pulls", [False, True])
def test_an_owner_the_gate_keeps_has_its_prefix_pulled_only_where_the_pool_allows_it(owner_pulls):
    """Five long sequences on the owner (within the gate: it counts sequences, not their
    context) make it dearer than copying the document to the idle partner: the owner keeps the
    request by default; with ``RoutingConfig.owner_pulls`` the copy goes ahead."""
    from lmpool.config import RoutingConfig

    rig = PullRig(coefficients=DEAR, config=RoutingConfig(owner_pulls=owner_pulls))
    busy_owner(rig, running=5, context=20_000)
    _, decision = rig.route(DOC)
    if not owner_pulls:
        assert decision.rank == 0 and decision.reason.startswith("owner r0") and not rig.coordinator.plans
        assert "; pull " not in decision.reason  # no pull was even priced
        return
    assert decision.rank == 1 and decision.reason.startswith("pull r1<-r0:32b=") and "over owner r0" in decision.reason
    (plan,) = rig.coordinator.plans.values()
    assert (plan.src, plan.dst, plan.hashes) == (0, 1, DOC)
    rig.check()


def test_requests_needing_the_same_blocks_on_the_same_rank_share_one_pull():
    rig = PullRig(coefficients=DEAR)
    busy_owner(rig)
    first, d1 = rig.route(DOC)
    second, d2 = rig.route(DOC[:20])  # a shorter prompt of the same document
    assert d1.rank == d2.rank == 1
    assert len(rig.coordinator.plans) == 1 and rig.pulls.counters.shared == 1
    (plan_id,) = rig.coordinator.plans
    # Both requests' work there waits on the pull: deferred, priced to start once it lands.
    waiting = [rig.gbm.reservations[rid] for rid in (first, second)]
    assert all(r.deferred and r.rank == 1 for r in waiting)
    assert rig.gbm.ranks[1].reserved.deferred_tokens == sum(r.tokens for r in waiting) > 0
    rig.check()
    rig.finish(plan_id)
    assert sorted(rig.resolved) == [(first, "landed"), (second, "landed")]
    assert not any(rig.gbm.reservations[rid].deferred for rid in (first, second))  # admissible, still reserved
    assert rig.gbm.ranks[1].reserved.deferred_tokens == 0
    rig.check()


def test_a_request_routed_to_a_pull_s_destination_waits_behind_the_work_deferred_there():
    """The pull's later waiters start once the pull lands, after the earlier waiters' prefill:
    a time to first token there counts the wait and that work, not the larger of the two."""
    rig = PullRig(coefficients=DEAR)
    busy_owner(rig)
    first, _ = rig.route(DOC, tail_tokens=200)  # opens the pull; 200 tokens of its own to prefill there
    (pull,) = rig.pulls.open.values()
    pricer = rig.router.policy.pricer
    query = RouteQuery("later", DOC, len(DOC) * BLOCK + 1, 64)
    m = len(DOC)  # every block usable: the prompt's one more token is what it computes
    behind = pricer.price(query, 1, m, pull.estimate_s, None).ttft_s
    rig.gbm.admissible(first)  # as if that work could start now: the larger of wait and queue
    level = pricer.price(query, 1, m, pull.estimate_s, None).ttft_s
    w = pricer.work(1)  # the same work, now counted as queued: packed with the later one's in its steps
    packed = w.queue_work + -(-(w.queued + 1) // w.room) * w.step
    assert behind > level
    assert behind - level == pytest.approx(pull.estimate_s + packed - max(packed, pull.estimate_s + w.step))


def test_an_aborted_pull_releases_its_waiters_to_recompute_and_leaves_nothing_in_flight():
    rig = PullRig(coefficients=DEAR)
    busy_owner(rig)
    rid, _ = rig.route(DOC)
    (plan_id,) = rig.coordinator.plans
    rig.advance(plan_id)  # both prepared: the destination's blocks are in flight
    assert rig.gbm.ranks[1].in_flight
    rig.fail(plan_id)
    assert rig.resolved[0][0] == rid and rig.resolved[0][1].startswith("aborted: rank 1 failed")
    assert not rig.gbm.reservations[rid].deferred  # it recomputes there, from now
    assert rig.gbm.prefix_match(DOC)[1] == 0
    rig.check()


@pytest.mark.parametrize("dead", [0, 1])
def test_a_rank_that_dies_mid_pull_ends_it_and_frees_its_waiters(dead):
    rig = PullRig(coefficients=DEAR)
    busy_owner(rig)
    rid, _ = rig.route(DOC)
    (plan_id,) = rig.coordinator.plans
    rig.advance(plan_id)
    rig.kill(dead)
    assert rig.resolved == [(rid, f"aborted: rank {dead} died in executing")]
    rig.check()


def test_a_waiting_request_id_waits_once():
    rig = PullRig(coefficients=DEAR)
    busy_owner(rig)
    rid, _ = rig.route(DOC)
    rig.router.route(RouteQuery(rid, DOC, len(DOC) * BLOCK + 1, 64))  # the same id, routed again while it waits
    assert len(rig.coordinator.plans) == 1 and list(rig.pulls.waiting) == [rid]
    rig.check()


def test_a_source_s_long_step_makes_recomputing_beat_the_copy():
    """Workers read a plan's messages between steps: sequences of 8,192 tokens each make the
    source's step under way 531 ms; the copy waits for two, the document's prefill on the idle rank 128 ms."""
    rig = PullRig(coefficients=DEAR)
    busy_owner(rig, context=8192)
    _, decision = rig.route(DOC)
    assert decision.rank == 1 and decision.reason.startswith("spill r1 m0")
    assert "; pull r1<-r0:32b=" in decision.reason and not rig.coordinator.plans


def test_a_long_prefill_queue_on_an_overloaded_owner_makes_the_copy_beat_recomputing():
    """The owner's requests in flight pass the bounded-load gate; 50,000 tokens queued there make
    serving on it dearest, and copying the document to the idle rank beats recomputing it there:
    the copy waits for the owner's step under way (a chunk of those tokens, under 0.1 s), shorter
    than the document's prefill (its 8,256 attention pairs at 0.1 ms a pair: 0.83 s)."""
    rig = PullRig(coefficients=COEF._replace(attention_pair=1e-4))
    rig.cache(0, DOC)
    rig.gbm.update_load(0, 1, rig.gbm.ranks[0].load.__class__(num_waiting=12, waiting_prefill_tokens=50_000,
                                                               new_prefill_tokens=50_000, blocks_free=900))
    rig.load(1, 0)
    _, decision = rig.route(DOC)
    assert decision.rank == 1 and decision.reason.startswith("pull r1<-r0")
    assert "over owner r0 m32" in decision.reason and "serve r0=767 r1=920" in decision.reason  # both dearer


def test_a_pull_moves_one_conversation_s_own_blocks_and_copies_what_others_branched_from():
    rig = PullRig(coefficients=DEAR)
    busy_owner(rig)
    for tail in (900, 901):  # two prompts leave the document after its 8th block
        rig.gbm.record_route(DOC[:8] + [tail], 8, 0)
    _, decision = rig.route(DOC)
    (plan,) = rig.coordinator.plans.values()
    assert (plan.move, plan.keep) == (True, 8)
    assert rig.pulls.counters.moved == 1
    rig.finish(plan.plan_id)
    rig.check()
