"""The measured engine model and what prices with it: the step-time fit recovers known
coefficients from noisy steps and follows a change, stays non-negative and bounded against
stalls; calibrations seed every twin replica alike; the bounded-load gate; the measured
reuse of evictions; every price finite and sane on any load."""

from __future__ import annotations

import math
import random

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import given, settings

from lmpool.config import RoutingConfig
from lmpool.control.pricing.engine_model import MOVE, EngineModel
from lmpool.control.pricing.eviction import EvictionMemory
from lmpool.control.pricing.gate import overloaded
from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.pricing.price import Limits, Pricer, RankPrice, cheapest, group_key
from lmpool.control.pricing.step_model import DEFAULT_PRIOR, StepCoefficients, StepModel
from lmpool.control.topology import Topology
from lmpool.protocol import LoadReport, RouteQuery, StepSample, StepTimings
from lmpool.protocol.kv_events import BlockStored, KVSnapshot
from control_testkit import COEF, ManualClock, cache, chain_blocks, engine_model

TRUE = StepCoefficients(base=2e-3, prefill_token=30e-6, attention_pair=8e-9, decode_seq=40e-6, context_token=0.12e-6,
                        cascade_pair=12e-9, prefill_key=110e-9)
# COEF charges no pairs: a pair term's test needs some, a cascade's pair dearer than a prefill's,
# and the keys a prefill reads their own.
PAIRED = COEF._replace(attention_pair=5e-9, cascade_pair=12e-9, prefill_key=100e-9)


def steps(rng: random.Random, coefficients: StepCoefficients, n: int, noise: float = 0.05) -> list[StepSample]:
    """``n`` steps of mixed shapes (prefill chunks at various depths, or a burst's short questions
    over one long context, decode batches of various contexts, some of whose rows share a prefix
    read in a cascade's prefix pass, and both together), timed by ``coefficients`` with
    multiplicative noise."""
    out = []
    for _ in range(n):
        prefill = attention = cascade = keys = 0
        if rng.random() < 0.4:
            chunks, done = 1, rng.randrange(0, 16_384)
            prefill = rng.randrange(16, 8192)
            if rng.random() < 0.5:  # questions: few query rows each, every one reading the whole context
                chunks, prefill, done = rng.randrange(1, 64), rng.randrange(4, 48), rng.randrange(8192, 32_768)
            attention = chunks * (prefill * done + prefill * (prefill + 1) // 2)
            keys, prefill = chunks * (done + prefill), chunks * prefill
        seqs, mean = rng.randrange(0, 64), rng.randrange(16, 8192)  # a batch of long or short contexts
        context = sum(rng.randrange(1, 2 * mean) for _ in range(seqs))
        if seqs >= 2 and rng.random() < 0.4:  # questions about one document: a short tail of their own each
            context = sum(rng.randrange(1, 512) for _ in range(seqs))
            cascade = seqs * rng.randrange(1024, 32_768)
        if not prefill and not seqs:
            seqs, context = 1, 100
        seconds = coefficients.step_s(prefill, attention, seqs, context, cascade, keys) * rng.uniform(1 - noise, 1 + noise)
        out.append(StepSample(seconds, prefill, attention, seqs, context, cascade, keys))
    return out


def one_rank(load: LoadReport) -> GlobalBlockManager:
    """A page table of one live rank (16-token blocks, 4,096 of them) that reported ``load``."""
    gbm = GlobalBlockManager(1, 16, clock=ManualClock())
    gbm.register_rank(0, 1, 4096)
    gbm.apply_snapshot(0, 1, KVSnapshot(0, []))
    gbm.update_load(0, 1, load)
    return gbm


def predictions_within(model: StepModel, samples: list[StepSample], coefficients: StepCoefficients) -> float:
    """The largest relative error of ``model``'s predictions against ``coefficients``' on ``samples``."""
    worst = 0.0
    for s in samples:
        true = coefficients.predict(s)
        worst = max(worst, abs(model.predict(s) - true) / true)
    return worst


def test_the_fit_recovers_known_step_times_from_noisy_steps():
    rng = random.Random(0)
    model = StepModel()
    for _ in range(50):
        model.observe(steps(rng, TRUE, 20))
    assert predictions_within(model, steps(rng, TRUE, 500, noise=0.0), TRUE) < 0.05
    # Every coefficient, a cascade's pair apart from a prefill's (1.5 times it here, twice it in the prior).
    for name, fitted, true in zip(TRUE._fields, model.coefficients, TRUE):
        assert fitted == pytest.approx(true, rel=0.1), name
    assert model.samples == 1000 and 0 < model.error < 0.1


def test_the_fit_follows_a_replica_that_slows_down_and_never_goes_negative():
    rng = random.Random(1)
    model = StepModel(half_life=200)
    for _ in range(20):
        model.observe(steps(rng, TRUE, 20))
    slower = StepCoefficients(*(2 * v for v in TRUE))  # a neighbour started on the GPU
    for _ in range(60):
        model.observe(steps(rng, slower, 20))
    # A prefill's keys are a large part of few of these steps (a burst's questions), so within a
    # window of 200 steps their coefficient stays nearer the prior than the others: the worst step
    # within 15 %, the median within 5 %.
    probe = steps(rng, slower, 200, noise=0.0)
    assert predictions_within(model, probe, slower) < 0.15
    errors = sorted(abs(model.predict(s) - slower.predict(s)) / slower.predict(s) for s in probe)
    assert errors[len(errors) // 2] < 0.05
    assert all(v >= 0 for v in model.coefficients)


def test_a_stall_counts_as_a_bounded_miss():
    rng = random.Random(2)
    model = StepModel()
    for _ in range(10):
        model.observe(steps(rng, TRUE, 20))
    before = model.coefficients
    decode = StepSample(0.0, 0, 0, 8, 8000)
    model.observe([StepSample(5.0, 0, 0, 8, 8000)])  # a collection, a page fault: seconds, once
    assert model.predict(decode) < 2 * before.step_s(0, 0, 8, 8000)


def test_a_calibration_replaces_the_prior_and_the_fit_starts_afresh():
    rng = random.Random(3)
    model = StepModel()
    model.observe(steps(rng, StepCoefficients(*(10 * v for v in TRUE)), 40))
    fitted = model.calibrate(steps(rng, TRUE, 30))
    assert model.calibrated and model.samples == 0 and fitted == model.coefficients
    assert predictions_within(model, steps(rng, TRUE, 100, noise=0.0), TRUE) < 0.2
    assert model.calibrate([StepSample(0.0), StepSample(float("nan"))]) == fitted, "nothing timed: unchanged"


def calibration_steps(rng: random.Random, coefficients: StepCoefficients) -> list[StepSample]:
    """The shapes a worker's calibration times (``lmpool.engine.calibration``), 8-token blocks:
    one short request decoding alone, 16 prefilled together then decoding, one long prompt, then
    16 short questions about it decoding as a cascade over its 73 whole blocks."""
    out = [StepSample(0.0, 64, 64 * 65 // 2, 0, 0, 0, 64)]
    out += [StepSample(0.0, 0, 0, 1, 65 + i) for i in range(7)]
    out += [StepSample(0.0, 1024, 16 * 64 * 65 // 2, 0, 0, 0, 1024)]
    out += [StepSample(0.0, 0, 0, 16, 16 * (65 + i)) for i in range(7)]
    out += [StepSample(0.0, 591, 591 * 592 // 2, 0, 0, 0, 591)] + [StepSample(0.0, 0, 0, 1, 592 + i) for i in range(3)]
    out += [StepSample(0.0, 1024, 16 * (64 * 584 + 64 * 65 // 2), 0, 0, 0, 16 * 648)]
    out += [StepSample(0.0, 0, 0, 16, 16 * (65 + i), 16 * 584) for i in range(7)]
    return [msgspec.structs.replace(s, seconds=coefficients.predict(s) * rng.uniform(0.95, 1.05)) for s in out]


@pytest.mark.parametrize("factors", [(1, 1, 1, 1, 1, 1, 1), (1, 2, 90, 1.5, 15, 40, 20),
                                     (0.5, 0.2, 0.05, 0.3, 0.1, 0.05, 0.1), (8, 8, 8, 8, 8, 8, 8)])
def test_a_calibration_moves_the_fit_as_far_from_the_prior_as_its_steps_say(factors):
    """A worker's few calibration steps set its fit wherever they put it: a CPU's attention pair
    costs ~90 times the prior's (an H200 quarter's); a larger model's every coefficient 8 times.
    Ridged in multiples of the prior, the attention coefficient stayed near it, and a long
    prompt's prefill was priced at a quarter of its time. Online, a coefficient moves from there."""
    rng = random.Random(5)
    engine = StepCoefficients(*(f * v for f, v in zip(factors, DEFAULT_PRIOR)))
    model = StepModel()
    model.calibrate(calibration_steps(rng, engine))
    assert predictions_within(model, calibration_steps(rng, engine), engine) < 0.25
    for _ in range(20):
        model.observe(calibration_steps(rng, engine))
    assert predictions_within(model, calibration_steps(rng, engine), engine) < 0.1


def test_steps_far_faster_than_the_prior_still_fit():
    """A step of a picosecond over 10^12 pairs: the prior's ridge is lost in rounding beside it
    and the system is singular; the fit still gives finite, non-negative coefficients."""
    model = StepModel()
    model.calibrate([StepSample(1e-12, 0, 10**12, 0, 0)])
    model.observe([StepSample(1e-12, 0, 10**12, 0, 0)] * 3)
    assert all(math.isfinite(v) and v >= 0 for v in model.coefficients)


def test_a_rank_without_steps_of_its_own_is_priced_like_its_twins():
    rng = random.Random(4)
    model = EngineModel(3)
    slow = StepCoefficients(*(1.3 * v for v in TRUE))
    model.observe(StepTimings(0, 1, steps(rng, TRUE, 30, noise=0.0), calibration=True))
    model.observe(StepTimings(1, 1, steps(rng, slow, 30, noise=0.0), calibration=True))
    calibrated = model.coefficients(0)
    assert model.coefficients(1) == model.coefficients(2) == calibrated, "all at the mean of the calibrations"
    faster = StepCoefficients(*(0.5 * v for v in TRUE))  # rank 1 now runs alone on the machine
    model.observe(StepTimings(1, 1, steps(rng, faster, 200, noise=0.0)))
    assert model.coefficients(1).base == pytest.approx(faster.base, rel=0.05)
    assert model.coefficients(0) == model.coefficients(2), "the idle ranks: the pooled fit, not their calibrations"
    assert model.coefficients(0).base == pytest.approx(faster.base, rel=0.05), (
        "... which is the one rank fitted on its own steps")
    model.observe(StepTimings(0, 1, steps(rng, TRUE, 200, noise=0.0)))
    assert model.coefficients(0).base == pytest.approx(TRUE.base, rel=0.05)  # the mean shape, times its speed
    assert model.coefficients(2).base == pytest.approx((TRUE.base + faster.base) / 2, rel=0.05)
    fit = model.describe(1)
    assert fit.calibrated and fit.samples == 200 and fit.base_ms == pytest.approx(faster.base * 1e3, rel=0.05)
    assert model.describe(0).speed == pytest.approx(TRUE.base / ((TRUE.base + faster.base) / 2), rel=0.05)
    assert model.describe(2).speed == 1.0  # no steps of its own


def single_sequence_steps(rng: random.Random, c: StepCoefficients, n: int, noise: float) -> list[StepSample]:
    """A long prompt read alone, then decoded alone: steps that vary the context and little else."""
    out = []
    for i in range(n):
        context = 16_384 + i
        seconds = c.step_s(0, 0, 1, context) * (1 + rng.uniform(-noise, noise))
        out.append(StepSample(seconds, 0, 0, 1, context))
    return out


def test_one_rank_s_calibration_far_from_its_twins_does_not_set_their_price():
    """Four twins calibrate; one paid a one-time cost in its steps (every one 10 times as long).
    Every rank is priced at the calibrations' median: the three alike, not a mean the outlier
    pulls (3.25 times theirs)."""
    rng = random.Random(6)
    model = EngineModel(4)
    for rank in range(3):
        model.observe(StepTimings(rank, 1, steps(rng, TRUE, 30, noise=0.0), calibration=True))
    model.observe(StepTimings(3, 1, steps(rng, StepCoefficients(*(10 * v for v in TRUE)), 30, noise=0.0),
                              calibration=True))
    for rank in range(4):  # a calibration of 30 steps is within 15 % of the truth; the mean, 3.25 times it
        priced = model.coefficients(rank)
        assert all(p == pytest.approx(t, rel=0.15) for p, t in zip(priced, TRUE)), rank


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000))
def test_twins_that_ran_alike_are_priced_with_one_shape(seed):
    """Two ranks whose steps cannot tell their coefficients apart (one sequence each, at one
    context) are priced by one shape: every coefficient of one is the other's times one ratio,
    and that ratio is their measured speeds', within the noise of their steps."""
    rng = random.Random(seed)
    model = EngineModel(2)
    for rank in range(2):
        model.observe(StepTimings(rank, 1, steps(rng, TRUE, 30), calibration=True))
    for rank in range(2):
        model.observe(StepTimings(rank, 1, single_sequence_steps(rng, TRUE, 80, noise=0.1)))
    a, b = model.coefficients(0), model.coefficients(1)
    ratios = [x / y for x, y in zip(a, b) if y > 0]
    moved = 2 * MOVE  # each rank's may lag the pooled fit times its speed by less than MOVE
    assert max(ratios) == pytest.approx(min(ratios), rel=moved)
    assert ratios[0] == pytest.approx(model.describe(0).speed / model.describe(1).speed, rel=moved)
    assert 0.95 < ratios[0] < 1.05, "alike within their steps' noise"


def test_priced_coefficients_stay_the_same_object_until_they_move():
    """A rank's pricing work is cached on its coefficients' identity: a report that moves none by
    ``MOVE`` keeps them; one that does replaces them."""
    rng = random.Random(3)
    model = EngineModel(2)
    for rank in range(2):
        model.observe(StepTimings(rank, 1, steps(rng, TRUE, 30), calibration=True))
        model.observe(StepTimings(rank, 1, steps(rng, TRUE, 64, noise=0.0)))
    kept = model.coefficients(0)
    model.observe(StepTimings(1, 1, steps(rng, TRUE, 1, noise=0.0)))  # one more step alike
    assert model.coefficients(0) is kept
    slower = StepCoefficients(*(1.5 * v for v in TRUE))
    model.observe(StepTimings(0, 1, steps(rng, slower, 64, noise=0.0)))
    assert model.coefficients(0) is not kept and model.describe(0).speed > 1.1


def test_a_replica_that_runs_slower_is_priced_slower_by_its_speed():
    rng = random.Random(7)
    model = EngineModel(2)
    slow = StepCoefficients(*(1.6 * v for v in TRUE))  # its GPU shared with a busier neighbour
    for rank, c in enumerate((TRUE, slow)):
        model.observe(StepTimings(rank, 1, steps(rng, TRUE, 30), calibration=True))
    for rank, c in enumerate((TRUE, slow)):
        model.observe(StepTimings(rank, 1, steps(rng, c, 200, noise=0.02)))
    assert model.describe(1).speed / model.describe(0).speed == pytest.approx(1.6, rel=0.05)
    batch = (512, 512 * 4096, 16, 16 * 512, 16 * 4096)  # a mixed step over a cascade: every coefficient counts
    assert model.coefficients(1).step_s(*batch) / model.coefficients(0).step_s(*batch) == pytest.approx(1.6, rel=0.05)
    model.observe(StepTimings(1, 1, [StepSample(float("inf"), 1, 1, 1, 1), StepSample(float("nan"))]))
    assert math.isfinite(model.describe(1).speed)  # untimed steps are not measured
    model.observe(StepTimings(1, 2, steps(rng, TRUE, 30), calibration=True))  # it restarted
    assert model.describe(1).speed == 1.0


def test_the_bounded_load_gate_is_smg_s():
    """Past the mean by min(abs, max(4, 2 sqrt(mean))) and past rel times the mean."""
    assert not overloaded(5, [5, 0, 0, 0], 64, 1.5)  # mean 1.25: 5 is within 4 of it
    assert overloaded(6, [6, 0, 0, 0], 64, 1.5)
    assert not overloaded(121, [121, 93, 93, 94], 64, 1.5), "past the margin (20.02), not 1.5 times the mean"
    assert overloaded(121, [121, 93, 93, 94], 64, 1.0)
    assert not overloaded(4, [4, 0], 64, 1.5) and overloaded(4, [4, 0], 0, 1.5), "the margin's cap"


def test_prices_within_the_tie_are_equal_and_the_emptier_rank_wins():
    def p(rank, total_s, free, matched=0, affinity=0, seqs=0, joins=False):
        return RankPrice(rank, matched, 0, 1, 100, free, seqs, total_s / 2, total_s, affinity, joins=joins)

    assert cheapest([p(0, 1.0, 10), p(1, 1.02, 90)], 0.03).rank == 1  # within 3 %: more free blocks
    assert cheapest([p(0, 1.0, 10), p(1, 1.05, 90)], 0.03).rank == 0  # beyond it: the price
    assert cheapest([p(0, 1.0, 10), p(1, 1.0, 90)], 0.0).rank == 1  # an exact tie
    assert cheapest([p(0, 1.0, 10, matched=3), p(1, 1.01, 90)], 0.03).rank == 0  # a longer match first
    assert cheapest([p(0, 1.0, 90), p(1, 1.01, 10, affinity=1)], 0.03).rank == 1  # nearer the seed first
    assert cheapest([p(0, 1.0, 90, seqs=33), p(1, 1.02, 10, seqs=32)], 0.03).rank == 1  # fewer in flight first
    assert cheapest([p(0, 1.0, 90, seqs=33), p(1, 1.05, 10, seqs=32)], 0.03).rank == 0  # ... within the tie only
    assert cheapest([p(0, 1.0, 10, matched=3, seqs=9), p(1, 1.0, 90, seqs=1)], 0.03).rank == 0  # the match first
    # Its cascade group's rank before a busier count's: not a second document on a rank reading one already.
    assert cheapest([p(0, 1.0, 90, seqs=13, joins=True), p(1, 1.02, 90, seqs=3)], 0.03).rank == 0
    assert cheapest([p(0, 1.02, 90, seqs=13, joins=True), p(1, 1.0, 90, seqs=3)], 0.03).rank == 0  # if dearer
    assert cheapest([p(0, 1.05, 90, seqs=13, joins=True), p(1, 1.0, 90, seqs=3)], 0.03).rank == 1  # the tie only
    assert cheapest([p(0, 1.0, 90, matched=3), p(1, 1.0, 90, matched=2, joins=True)], 0.03).rank == 0  # after the match


def test_evictions_are_regretted_when_a_later_prompt_wants_what_was_evicted():
    memory = EvictionMemory(2, capacity=3)
    assert memory.reuse(0) == pytest.approx(0.5), "the prior: one regret in two evictions"
    for h in (b"a", b"b", b"c", b"d"):  # b"a" is forgotten: at most 3 ghosts a rank
        memory.removed(0, h)
    memory.wanted(b"a")
    assert memory.reuse(0) == pytest.approx(1 / 6, rel=1e-3), "a forgotten ghost is no regret"
    memory.wanted(b"d")
    memory.wanted(b"d")  # regretted once
    assert memory.reuse(0) == pytest.approx(2 / 6, rel=1e-3) and memory.reuse(1) == pytest.approx(0.5)
    memory.drop_rank(0)
    memory.wanted(b"c")
    assert memory.reuse(0) == pytest.approx(2 / 6, rel=1e-3), "a restarted rank's ghosts are gone"


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 300), st.integers(0, 300), st.integers(0, 200_000), st.integers(0, 100_000),
       st.integers(0, 50_000), st.integers(-20, 2000), st.integers(0, 2000), st.integers(0, 40), st.integers(1, 60),
       st.integers(1, 512), st.floats(0, 1), st.floats(0, 0.05))
def test_every_price_is_finite_non_negative_and_at_least_its_time_to_first_token(
        running, waiting, context, left, queued, free, reclaimable, matched, blocks, out, reuse, wait):
    clock = ManualClock()
    gbm = GlobalBlockManager(2, 16, clock=clock)
    for rank in range(2):
        gbm.register_rank(rank, 1, 4096)
        gbm.apply_snapshot(rank, 1, KVSnapshot(0, []))
    gbm.update_load(0, 1, LoadReport(num_running=running, num_waiting=waiting, context_tokens=context,
                                     decode_tokens_left=left, waiting_prefill_tokens=queued, new_prefill_tokens=queued,
                                     prefill_attention=queued * 1000, blocks_free=free, blocks_reclaimable=reclaimable))
    pricer = Pricer(gbm, Topology.virtual(2), engine_model(2), Limits(16, 256, 8192), lambda rank: reuse)
    query = RouteQuery("q", list(range(blocks)), blocks * 16 + 3, out)
    p = pricer.price(query, 0, min(matched, blocks), wait, None)
    values = (p.ttft_s, p.total_s)
    assert all(math.isfinite(v) and v >= 0 for v in values)
    assert p.ttft_s >= COEF.base and p.total_s >= p.ttft_s and p.need >= 0 and p.missing >= 1
    assert pricer.load_s(0) >= 0 and math.isfinite(pricer.load_s(0))


@pytest.mark.parametrize("running", [0, 3])
def test_an_overlapped_rank_makes_a_new_request_wait_one_step_more(running):
    """With ``async_scheduling`` the step after the one under way is already launched when a
    request arrives, so it waits for both; an idle rank starts it at once either way. A step
    reads the keys its rows read alone and attends the pairs of its cascade's prefix pass."""
    ttft = {}
    for overlapped in (False, True):
        gbm = one_rank(LoadReport(num_running=running, context_tokens=1000 * running,
                                  decode_tokens_left=10 * running, blocks_free=4000, cascade_pairs=3000 * running))
        pricer = Pricer(gbm, Topology.virtual(1), engine_model(1, PAIRED), Limits(16, 256, 8192, overlapped),
                        lambda rank: 0.5)
        ttft[overlapped] = pricer.price(RouteQuery("q", [1, 2], 35, 8), 0, 0, 0.0, None).ttft_s
    step = (PAIRED.base + PAIRED.decode_seq * running + PAIRED.context_token * 1000 * running
            + PAIRED.cascade_pair * 3000 * running)
    assert ttft[True] - ttft[False] == pytest.approx(step if running else 0.0)


@pytest.mark.parametrize("device, async_scheduling, overlapped", [
    ("cuda", True, True), ("cuda:1", True, True), ("cuda", False, False), ("cpu", True, False), ("cpu", False, False),
])
def test_only_a_gpu_rank_stepping_overlapped_is_priced_overlapped(device, async_scheduling, overlapped):
    """A CPU's launch computes its step and its worker reads each step back before the next launch
    (``EngineCore.read_finished``): whatever ``async_scheduling`` says, it waits like a serial one."""
    from lmpool.config.engine import EngineConfig
    from lmpool.control.build import limits

    engine = EngineConfig(model="unused", device=device, async_scheduling=async_scheduling)
    assert limits(engine, 0, True).overlapped is overlapped


def test_the_prefix_pass_of_a_rank_s_sequences_is_priced_at_the_cascade_s_pair():
    """A rank whose running sequences share a prefix (its load's cascade pairs) spends each step
    their prefix pass at a cascade's pair, not a prefill's (``PAIRED`` has them differ): every
    step a request waits for or decodes in there, and what each sequence there adds to it."""
    pairs = 8 * 16_384  # eight questions about one document
    load = LoadReport(num_running=8, context_tokens=8 * 100, decode_tokens_left=80, blocks_free=4000,
                      cascade_pairs=pairs)
    w = Pricer(one_rank(load), Topology.virtual(1), engine_model(1, PAIRED), Limits(16, 256, 8192),
               lambda rank: 0.5).work(0)
    reads = PAIRED.context_token * 800 + PAIRED.cascade_pair * pairs
    assert w.step == pytest.approx(PAIRED.base + PAIRED.decode_seq * 8 + reads)
    assert w.theirs == pytest.approx(PAIRED.decode_seq + reads / 8)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(1, 8192), st.integers(0, 10**9), st.integers(0, 10**6), st.booleans())
def test_a_new_request_waits_for_the_prefill_its_rank_has_launched(running, tokens, pairs, keys, overlapped):
    """A prefill launched and not yet read back has left the rank's queue, not its device: a
    request arriving now waits for it too (a burst's questions admitted into one step)."""
    ttft = []
    for launched, attention, read in ((0, 0, 0), (tokens, pairs, keys)):
        gbm = one_rank(LoadReport(num_running=running, context_tokens=1000 * running, decode_tokens_left=10 * running,
                                  blocks_free=4000, launched_prefill_tokens=launched, launched_attention=attention,
                                  launched_keys=read))
        pricer = Pricer(gbm, Topology.virtual(1), engine_model(1, PAIRED), Limits(16, 256, 8192, overlapped),
                        lambda rank: 0.5)
        ttft.append(pricer.price(RouteQuery("q", [1, 2], 35, 8), 0, 0, 0.0, None).ttft_s)
    assert ttft[1] - ttft[0] == pytest.approx(PAIRED.prefill_token * tokens + PAIRED.attention_pair * pairs
                                              + PAIRED.prefill_key * keys)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 64), st.integers(1, 64), st.integers(1, 32_768), st.integers(1, 200))
def test_a_prefill_is_priced_at_the_keys_its_chunks_read(running, questions, context, own):
    """Short questions over a long document cost more than their pairs at a long prompt's rate:
    each chunk reads its whole context. The queue's reported keys and a request's own prompt
    (its context, where it computes any) are both priced at the fitted key's seconds."""
    def ttft(coefficients: StepCoefficients, keys: int) -> float:
        load = LoadReport(num_running=running, context_tokens=100 * running, decode_tokens_left=10 * running,
                          blocks_free=4000, num_waiting=questions, waiting_prefill_tokens=questions * own,
                          new_prefill_tokens=questions * own,
                          prefill_attention=questions * (own * context + own * (own + 1) // 2), prefill_keys=keys)
        pricer = Pricer(one_rank(load), Topology.virtual(1), engine_model(1, coefficients), Limits(16, 256, 8192),
                        lambda rank: 0.5)
        return pricer.price(RouteQuery("q", [1, 2], 35, 8), 0, 0, 0.0, None).ttft_s

    queue_keys = questions * (context + own)
    keyless = PAIRED._replace(prefill_key=0.0)
    assert ttft(PAIRED, queue_keys) - ttft(keyless, queue_keys) == pytest.approx(PAIRED.prefill_key * (queue_keys + 35))
    assert ttft(PAIRED, queue_keys) - ttft(PAIRED, 0) == pytest.approx(PAIRED.prefill_key * queue_keys)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 64), st.integers(1, 8192), st.integers(0, 10**9), st.integers(0, 20_000))
def test_a_copy_into_a_rank_waits_behind_the_prefill_it_has_launched(running, tokens, pairs, queued):
    """The step under way at a rank, which a pull's copy into it runs behind (``next_step_s``),
    is the launched one with its prefill, not a share of the queue that has not left the host."""
    base = dict(num_running=running, context_tokens=1000 * running, decode_tokens_left=10 * running,
                blocks_free=4000, waiting_prefill_tokens=queued, new_prefill_tokens=queued)
    steps = [Pricer(one_rank(LoadReport(**base, **launched)), Topology.virtual(1), engine_model(1, PAIRED),
                    Limits(16, 256, 8192, True), lambda rank: 0.5).next_step_s(0)
             for launched in ({}, dict(launched_prefill_tokens=tokens, launched_attention=pairs))]
    step = PAIRED.base + PAIRED.decode_seq * running + PAIRED.context_token * 1000 * running
    assert steps[1] == pytest.approx(step + PAIRED.prefill_token * tokens + PAIRED.attention_pair * pairs)
    chunk = min(queued, 8192 - running)
    assert steps[0] == pytest.approx((step + PAIRED.prefill_token * chunk) if queued else (step if running else 0.0))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 64), st.integers(1, 8192), st.integers(0, 10**9), st.booleans())
def test_a_request_waiting_on_a_copy_counts_the_launched_prefill_once(running, tokens, pairs, overlapped):
    """A pull's wait already holds the destination's step under way with its launched prefill
    (``next_step_s``: the copy runs behind it). Once the copy has landed that prefill is done,
    so the request's price counts it in the wait alone, never again as the step it arrives to."""
    ttft, waits = [], []
    for launched, attention in ((0, 0), (tokens, pairs)):
        gbm = one_rank(LoadReport(num_running=running, context_tokens=1000 * running, decode_tokens_left=10 * running,
                                  blocks_free=4000, launched_prefill_tokens=launched, launched_attention=attention))
        pricer = Pricer(gbm, Topology.virtual(1), engine_model(1, PAIRED), Limits(16, 256, 8192, overlapped),
                        lambda rank: 0.5)
        waits.append(10.0 + pricer.next_step_s(0))  # a copy of 10 s behind the step under way
        ttft.append(pricer.price(RouteQuery("q", [1, 2], 35, 8), 0, 0, waits[-1], None).ttft_s)
    launched_s = PAIRED.prefill_token * tokens + PAIRED.attention_pair * pairs
    assert waits[1] - waits[0] == pytest.approx(launched_s + (0.0 if running else PAIRED.base))
    assert ttft[1] - ttft[0] == pytest.approx(waits[1] - waits[0])


def test_a_launched_prefill_is_waited_for_where_no_sequence_runs_any_more():
    """Prompts that generate one token leave ``running`` when their step is launched: the rank
    then runs nothing, but its device still computes their prefill."""
    idle = one_rank(LoadReport(blocks_free=4000))
    busy = one_rank(LoadReport(blocks_free=4000, launched_prefill_tokens=500, launched_attention=125_250))
    ttft = [Pricer(gbm, Topology.virtual(1), engine_model(1, PAIRED), Limits(16, 256, 8192, True), lambda rank: 0.5)
            .price(RouteQuery("q", [1, 2], 35, 8), 0, 0, 0.0, None).ttft_s for gbm in (idle, busy)]
    assert ttft[1] - ttft[0] == pytest.approx(2 * PAIRED.base + PAIRED.prefill_token * 500
                                              + PAIRED.attention_pair * 125_250)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.integers(0, 200_000), st.integers(0, 50_000), st.integers(1, 60), st.integers(0, 60),
       st.integers(0, 60))
def test_a_pull_s_floor_is_its_serve_price_less_all_the_pulled_blocks_could_save(running, context, queued, blocks,
                                                                                 matched, top):
    """``pull_price._least``: the serve price less the pulled blocks' prefill (its own and the shared
    steps') and every step of that prefill; -inf without a serve price."""
    from lmpool.control.pricing.price import prefill_seconds
    from lmpool.control.transfers.pull_price import _least

    gbm = one_rank(LoadReport(num_running=running, context_tokens=context, waiting_prefill_tokens=queued, new_prefill_tokens=queued,
                              blocks_free=1000))
    pricer = Pricer(gbm, Topology.virtual(1), engine_model(1, TRUE), Limits(16, 256, 8192), lambda rank: 0.5)
    query = RouteQuery("q", list(range(blocks)), blocks * 16 + 3, 8)
    serve = pricer.price(query, 0, min(matched, blocks), 0.0, None)
    cached, w = min(top, blocks) * 16, pricer.work(0)
    pulled = (prefill_seconds(w.c, serve.missing, query.num_prompt_tokens - serve.missing)
              - prefill_seconds(w.c, query.num_prompt_tokens - cached, cached))
    floor = serve.total_s - (1 + w.n) * pulled - -(-serve.missing // w.room) * w.step
    assert _least(w, serve, query.num_prompt_tokens, cached, 8, False) == pytest.approx(floor, rel=1e-12, abs=1e-15)
    assert _least(w, None, query.num_prompt_tokens, cached, 8, False) == float("-inf")


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 20), st.integers(1, 4000), st.integers(0, 3000), st.floats(0.0, 0.5))
def test_work_deferred_behind_a_pull_delays_only_a_request_that_waits_on_a_copy_too(running, tokens, queued, wait):
    """Reserved prefill whose request waits on a pull starts once the pull lands: a request that
    waits on a copy to that rank starts after it (its wait plus that work's queue), one that
    does not is priced as if the same work were admissible now."""
    priced = {}
    for deferred in (False, True):
        gbm = one_rank(LoadReport(num_running=running, context_tokens=1000 * running,
                                  decode_tokens_left=10 * running, waiting_prefill_tokens=queued, new_prefill_tokens=queued,
                                  blocks_free=4000))
        gbm.reserve("waiter", 0, 4, tokens, tokens * 500, tokens, 8, deferred=deferred)
        pricer = Pricer(gbm, Topology.virtual(1), engine_model(1), Limits(16, 256, 8192), lambda rank: 0.5)
        query = RouteQuery("q", [1, 2], 35, 8)
        priced[deferred] = (pricer.price(query, 0, 0, wait, None).ttft_s, pricer.price(query, 0, 0, 0.0, None).ttft_s)
    w, missing = pricer.work(0), 35
    assert (w.deferred, w.deferred_work) == (tokens, COEF.prefill_token * tokens + COEF.attention_pair * tokens * 500)
    # Its prefill packed behind the queue's (deferred or not, all of it), or behind its copy
    start = w.queue_work + -(-(w.queued + missing) // w.room) * w.step
    landed_now = wait + -(-missing // w.room) * w.step
    landed_deferred = wait + w.deferred_work + -(-(tokens + missing) // w.room) * w.step
    (waits_now, plain_now), (waits_deferred, plain_deferred) = priced[False], priced[True]
    assert plain_deferred == plain_now  # no wait of its own: the deferred work is just queued work
    if wait:
        assert waits_deferred >= waits_now
        assert waits_deferred - waits_now == pytest.approx(max(start, landed_deferred) - max(start, landed_now))
    else:
        assert waits_deferred == waits_now


@given(st.lists(st.tuples(st.floats(1e-4, 1.0), st.integers(0, 8192), st.integers(0, 10**9), st.integers(0, 256),
                          st.integers(0, 10**6), st.integers(0, 10**7)), max_size=200))
def test_recent_steps_sum_their_last_window(rows):
    """The running sums are those of the last ``WINDOW`` steps, and the speed their measured over
    predicted seconds."""
    from lmpool.control.pricing.engine_model import WINDOW, RecentSteps

    recent = RecentSteps()
    for row in rows:
        recent.add(StepSample(*row))
    last = [StepSample(*r) for r in rows[-WINDOW:]]
    assert len(recent) == len(last)
    assert recent.seconds == pytest.approx(sum(s.seconds for s in last), rel=1e-9, abs=1e-12)
    predicted = sum(TRUE.predict(s) for s in last)
    assert recent.speed(TRUE) == (pytest.approx(sum(s.seconds for s in last) / predicted, rel=1e-6) if last else 1.0)
    recent.clear()
    assert len(recent) == 0 and recent.speed(TRUE) == 1.0


def branched_after(gbm: GlobalBlockManager, chain: list[int], depth: int) -> None:
    """Cache ``chain`` on rank 0 and route two prompts that continue its first ``depth`` blocks two
    ways (two questions about one document): those blocks are shared, the rest is one prompt's own."""
    cache(gbm, 0, chain)
    if depth:
        for other in (10_000, 10_001):
            gbm.record_route(chain[:depth] + [other], depth, depth)
    assert gbm.branched_depth(chain) == depth


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.integers(0, 50_000), st.integers(1, 30), st.integers(0, 30), st.integers(0, 30),
       st.integers(1, 64), st.integers(1, 2000))
def test_where_ranks_decode_shared_prefixes_once_a_shared_cached_prefix_is_not_a_request_s_own_reading(
        running, context, blocks, matched, shared, out, min_saved):
    """With cascades, what a request adds to each decode step is its keys past the cached prefix
    other routed prompts share, and that prefix's pairs in the prefix pass that attends it once for
    the sequences sharing it: its price falls by the difference over every step it decodes in and
    shares, and its time to first token is the same. A
    cached prefix no other prompt shares (a conversation's own history) it reads alone: no fall;
    nor where the sequences there could not save a cascade's worth of key reads with it. (Without
    cascade groups, the default's rule before 1dc4676: the group tests below price by groups.)"""
    prices = {}
    chain = list(range(blocks))
    depth = min(shared, blocks)
    for threshold in (0, min_saved):
        gbm = one_rank(LoadReport(num_running=running, context_tokens=context, decode_tokens_left=8 * running,
                                  blocks_free=2000))
        branched_after(gbm, chain, depth)
        pricer = Pricer(gbm, Topology.virtual(1), engine_model(1, PAIRED),
                        Limits(16, 256, 8192, True, threshold, cascade_groups=False), lambda rank: 0.5)
        query = RouteQuery("q", chain, blocks * 16 + 3, out)
        prices[threshold] = pricer.price(query, 0, min(matched, blocks), 0.0, None)
    plain, cascaded = prices[0], prices[min_saved]
    read_once = min(plain.matched, depth) * 16 if depth * 16 * running >= min_saved else 0
    overlap = min(running * (out - 1), 8 * running)
    assert cascaded.ttft_s == plain.ttft_s
    fall = (PAIRED.context_token - PAIRED.cascade_pair) * read_once * (out - 1 + overlap)
    assert plain.total_s - cascaded.total_s == pytest.approx(fall)


@pytest.mark.parametrize("min_saved, depth, context", [(0, 4, 5 * 16 + 3), (128, 4, 16 + 3), (64, 2, 3 * 16 + 3),
                                                       (128, 2, 5 * 16 + 3), (128, 0, 5 * 16 + 3),
                                                       (129, 4, 5 * 16 + 3)])
def test_a_reservation_on_ranks_that_decode_shared_prefixes_once_holds_its_own_keys_as_context(min_saved, depth,
                                                                                               context):
    """Its context is its prompt less the cached prefix other prompts share (4 of its 5 blocks
    cached), where the 2 sequences running there could save a cascade's worth with it (its
    shared keys each: 128 key reads at a depth of 4 blocks, 64 at 2); that prefix it holds as
    cascade pairs. (Without cascade groups: the group tests below reserve by groups.)"""
    from lmpool.control.routing.reserve import Reserve
    from lmpool.control.routing.route import Route

    gbm = one_rank(LoadReport(num_running=2, blocks_free=100))
    branched_after(gbm, list(range(5)), depth)
    query = RouteQuery("q", list(range(5)), 5 * 16 + 3, 8)
    route = Route(query, None, (0,), [4], [4], rank=0)
    pricer = Pricer(gbm, Topology.virtual(1), engine_model(1), Limits(16, 256, 8192, True, min_saved, False),
                    lambda r: 0.5)
    reserve = Reserve(gbm, pricer)
    reserve.settle(route)  # the router settles a route before it records it
    reserve.record(route)
    assert route.group is None  # no groups priced: none named
    assert gbm.ranks[0].reserved.context == context
    assert gbm.ranks[0].reserved.cascade == 5 * 16 + 3 - context


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 300), st.integers(0, 200_000), st.integers(0, 50_000), st.integers(1, 60), st.integers(0, 60),
       st.integers(0, 60), st.integers(1, 64), st.booleans(), st.integers(0, 60),
       st.sampled_from([TRUE, TRUE._replace(cascade_pair=1e-6)]), st.sampled_from([None, 0, 1]))
def test_a_pull_s_floor_is_below_the_price_of_serving_at_its_depth(running, context, queued, blocks, matched, top,
                                                                   out, cascades, shared, coefficients, groups):
    """Whatever the ranks' decode (cascades or not, a shared prefix's pair dearer or cheaper than
    its key read alone, priced by cascade groups or not), no pull to a depth prices below its floor:
    the floor is at most the price of serving there with those blocks already held, at once.
    (``groups``: None, no cascade groups; else that many sequences there are of the prompt's group.)"""
    from lmpool.control.transfers.pull_price import _least

    key = group_key(list(range(blocks)), min(shared, blocks))  # the prompt's group (None: it shares nothing)
    heads = dict(group_heads=[key], group_rows=[groups]) if groups and key is not None else {}
    gbm = one_rank(LoadReport(num_running=running, context_tokens=context, waiting_prefill_tokens=queued, new_prefill_tokens=queued,
                              decode_tokens_left=16 * running, blocks_free=100_000, **heads))
    branched_after(gbm, list(range(blocks)), min(shared, blocks))  # the prefix other prompts share
    pricer = Pricer(gbm, Topology.virtual(1), engine_model(1, coefficients),
                    Limits(16, 256, 8192, True, 16 * cascades, groups is not None), lambda rank: 0.5)
    query = RouteQuery("q", list(range(blocks)), blocks * 16 + 3, out)
    usable = pricer.terms(query).usable
    depth = min(top, usable)
    serve = pricer.price(query, 0, min(matched, depth), 0.0, None)  # a pull brings blocks past its match
    held = pricer.price(query, 0, depth, 0.0, None)
    reads_once = cascades and (groups is None or pricer.sharing(0, pricer.terms(query).head) > 0)  # as the pull's
    floor = _least(pricer.work(0), serve, query.num_prompt_tokens, depth * 16, out, reads_once)
    assert floor <= held.total_s * (1 + 1e-9)


@pytest.mark.parametrize("via", ["reported", "reserved"])
@pytest.mark.parametrize("groups", [False, True])
def test_with_cascade_groups_a_shared_prefix_is_read_once_only_where_its_group_is(via, groups):
    """Two ranks of equal load, both holding a document other questions share: one has a sequence
    of that document (in its load report, or routed there since), the other one of another.
    With ``Limits.cascade_groups`` a question of the document is priced cheaper where its group
    is (it reads the document once there, alone elsewhere); without, the two are equal. A group
    is keyed by the shared prefix's last block (``group_key``)."""
    doc, other = list(range(8)), list(range(100, 108))
    gbm = GlobalBlockManager(2, 16, clock=ManualClock())
    for rank, head in ((0, doc[-1]), (1, other[-1])):
        gbm.register_rank(rank, 1, 4096)
        gbm.apply_snapshot(rank, 1, KVSnapshot(0, []))
        grouped = dict(group_heads=[head], group_rows=[1]) if via == "reported" else {}
        gbm.update_load(rank, 1, LoadReport(num_running=4, context_tokens=4 * 200, decode_tokens_left=4 * 64,
                                            blocks_free=2000, **grouped))
        if via == "reserved":
            gbm.reserve(f"q{rank}", rank, 1, 16, context=16, decode=64, head=head)
        cache(gbm, rank, doc)
    for question in (10_000, 10_001):  # the document is shared: questions about it were routed
        gbm.record_route(doc + [question], 8, 8)
    pricer = Pricer(gbm, Topology.virtual(2), engine_model(2, DEFAULT_PRIOR),
                    Limits(16, 256, 8192, True, 256, cascade_groups=groups), lambda rank: 0.5)
    query = RouteQuery("q", doc + [10_002], 9 * 16 + 3, 64)
    assert pricer.terms(query).head == (doc[-1] if groups else None)
    grouped, alone = (pricer.price(query, rank, 8, 0.0, None) for rank in (0, 1))
    assert grouped.ttft_s == alone.ttft_s
    if groups:
        n = 4 if via == "reported" else 5  # the reserved sequence is in flight too, decoding 64 more
        # Its own steps read the document once, the others' steps wait less for them, and the group's
        # lone member reads it once too from then on: its steps and this one's, 63 together.
        saved = (DEFAULT_PRIOR.context_token - DEFAULT_PRIOR.cascade_pair) * 8 * 16 * (63 + min(n * 63, n * 64)
                                                                                      + 2 * 63)
        assert alone.total_s - grouped.total_s == pytest.approx(saved)
        assert pricer.sharing(0, doc[-1]) == 1 and pricer.sharing(1, doc[-1]) == 0
    else:
        assert grouped.total_s == alone.total_s


def test_the_group_key_is_the_shared_prefix_s_last_block():
    chain = [11, 12, 13, 14]
    assert [group_key(chain, depth) for depth in range(5)] == [None, 11, 12, 13, 14]


@pytest.mark.parametrize("via", ["reported", "reserved"])
def test_with_cascade_groups_documents_behind_one_system_prompt_block_are_groups_apart(via):
    """Two documents open with the same system-prompt block, then differ; both are cached on both
    ranks of equal load, and questions about each were routed (so the system block and each
    document are shared prefixes). Rank 0 decodes (or was routed) a question of document A, rank 1
    nothing of either. Another question of A reads its document once on rank 0 and is priced
    cheaper there; a question of B is not: the group on rank 0 is A's (keyed by A's last block),
    not the system prompt's, so B's question would read its context alone on either rank (the
    engine's cascade plans group A's and B's rows apart)."""
    system = 1
    doc_a, doc_b = [system] + list(range(10, 17)), [system] + list(range(20, 27))
    gbm = GlobalBlockManager(2, 16, clock=ManualClock())
    b_after_system = [BlockStored(h, p, 8 + i, 1) for i, (h, p) in enumerate(zip(doc_b[1:], doc_b[:-1]))]
    for rank in (0, 1):
        gbm.register_rank(rank, 1, 4096)
        gbm.apply_snapshot(rank, 1, KVSnapshot(1, chain_blocks(doc_a) + b_after_system))
        grouped = dict(group_heads=[doc_a[-1]], group_rows=[1]) if via == "reported" and rank == 0 else {}
        gbm.update_load(rank, 1, LoadReport(num_running=4, context_tokens=4 * 200, decode_tokens_left=4 * 64,
                                            blocks_free=2000, **grouped))
    if via == "reserved":
        gbm.reserve("a0", 0, 1, 16, context=16, decode=64, head=doc_a[-1])
        gbm.reserve("x1", 1, 1, 16, context=16, decode=64)  # as much in flight on rank 1, of no group
    for doc in (doc_a, doc_b):
        for question in (10_000, 10_001):
            gbm.record_route(doc + [question + doc[1]], 8, 8)
    assert gbm.branched_depth(doc_a) == gbm.branched_depth(doc_b) == 8
    pricer = Pricer(gbm, Topology.virtual(2), engine_model(2, DEFAULT_PRIOR),
                    Limits(16, 256, 8192, True, 256, cascade_groups=True), lambda rank: 0.5)
    ask_a = RouteQuery("qa", doc_a + [30_000], 9 * 16 + 3, 64)
    ask_b = RouteQuery("qb", doc_b + [30_001], 9 * 16 + 3, 64)
    assert pricer.terms(ask_a).head == doc_a[-1] and pricer.terms(ask_b).head == doc_b[-1]
    assert pricer.sharing(0, doc_a[-1]) == 1 and pricer.sharing(0, doc_b[-1]) == 0
    assert pricer.sharing(0, system) == 0  # no group is keyed by the first block
    a_grouped, a_alone = (pricer.price(ask_a, rank, 8, 0.0, None) for rank in (0, 1))
    b_there, b_elsewhere = (pricer.price(ask_b, rank, 8, 0.0, None) for rank in (0, 1))
    n = 4 if via == "reported" else 5  # as above, the lone member of A's group converted by the join
    saved = (DEFAULT_PRIOR.context_token - DEFAULT_PRIOR.cascade_pair) * 8 * 16 * (63 + min(n * 63, n * 64) + 2 * 63)
    assert a_alone.total_s - a_grouped.total_s == pytest.approx(saved)
    assert b_there.total_s == b_elsewhere.total_s  # A's group is no group of B's


@pytest.mark.parametrize("sharing", [0, 1, 2])
def test_with_cascade_groups_a_reservation_reads_its_shared_prefix_once_only_where_its_group_is(sharing):
    """The reservation follows the pricing's rule: its shared prefix (4 of its 5 blocks) is cascade
    pairs where ``sharing`` sequences there are of its group (keyed by the prefix's last block,
    which the route settles), else its own context; it names that group either way. Joining a
    group of one, it converts that lone member (``converted``: its prefix leaves the rank's keys
    read alone for the cascade's pairs, as the pricing credited), and the rank's work reads so."""
    from lmpool.control.routing.reserve import Reserve
    from lmpool.control.routing.route import Route

    gbm = one_rank(LoadReport(num_running=2, blocks_free=100))
    branched_after(gbm, list(range(5)), 4)
    route = Route(RouteQuery("q", list(range(5)), 5 * 16 + 3, 8), None, (0,), [4], [4], rank=0)
    asked = []
    pricer = Pricer(gbm, Topology.virtual(1), engine_model(1, DEFAULT_PRIOR),
                    Limits(16, 256, 8192, True, 128, cascade_groups=True), lambda rank: 0.5)
    reserve = Reserve(gbm, pricer)
    counted = pricer.sharing
    pricer.sharing = lambda rank, head: asked.append((rank, head)) or sharing  # type: ignore[method-assign]
    reserve.settle(route)
    assert route.depth == 4 and route.group == 3
    reserve.record(route)
    assert asked == [(0, 3)] and gbm.ranks[0].reserved.heads == {3: 1}
    assert gbm.ranks[0].reserved.cascade == (4 * 16 if sharing else 0)
    assert gbm.ranks[0].reserved.converted == (4 * 16 if sharing == 1 else 0)
    pricer.sharing = counted  # type: ignore[method-assign]
    c, converted = DEFAULT_PRIOR, gbm.ranks[0].reserved.converted
    # (the lone member here is the test's ``sharing``, in no load report: the conversion floors at 0)
    context = max(0, 5 * 16 + 3 - gbm.ranks[0].reserved.cascade - converted)
    reads = c.context_token * context + c.cascade_pair * (gbm.ranks[0].reserved.cascade + converted)
    assert pricer.work(0).step == pytest.approx(c.base + c.decode_seq * 3 + reads)


def test_a_router_refuses_a_pricer_that_reads_cascades_otherwise_than_its_config():
    from lmpool.control.build import make_router

    gbm = one_rank(LoadReport(blocks_free=100))
    for groups in (False, True):
        pricer = Pricer(gbm, Topology.virtual(1), engine_model(1), Limits(16, 256, 8192, True, 128, groups),
                        lambda rank: 0.5)
        with pytest.raises(ValueError, match="cascade_groups"):
            make_router(gbm, Topology.virtual(1), "lmpool", RoutingConfig(cascade_groups=not groups), pricer)


def test_with_cascade_groups_a_second_question_joins_its_document_s_lone_question_not_an_idle_rank():
    """A 16k document cached on two idle ranks; its first question (32 tokens to decode) is routed
    to rank 0, where it reads the document alone: no cascade groups one row. Its second question
    prices rank 0 below idle rank 1: joining converts the first (both then read the document once,
    in the prefix pass), which the price credits (``Reservation.converted``). Without that credit
    rank 0 looked dearer than the idle rank by the first question's solo reads, and the questions
    of a burst over two documents ended one or two on a rank of the other's (an H100 oracle run,
    step fits like these; each such stray row read its 16k alone every step)."""
    from lmpool.control.routing.reserve import Reserve
    from lmpool.control.routing.route import Route

    fit = StepCoefficients(base=2.4e-3, prefill_token=1.57e-6, attention_pair=5.4e-9, decode_seq=17.5e-6,
                           context_token=0.176e-6, cascade_pair=12.8e-9)  # an H100 replica's, under MPS 4
    doc = list(range(64))  # 64 blocks of 256 tokens
    gbm = GlobalBlockManager(2, 256, clock=ManualClock())
    for rank in (0, 1):
        gbm.register_rank(rank, 1, 4096)
        gbm.apply_snapshot(rank, 1, KVSnapshot(0, []))
        gbm.update_load(rank, 1, LoadReport(blocks_free=4000))
        cache(gbm, rank, doc)
    pricer = Pricer(gbm, Topology.virtual(2), engine_model(2, fit),
                    Limits(256, 256, 8192, True, 65536, cascade_groups=True), lambda rank: 0.5)
    reserve = Reserve(gbm, pricer)
    first, second = (RouteQuery(f"q{i}", doc + [1000 + i], 64 * 256 + 64, 32) for i in range(2))
    route = Route(first, None, (0, 1), [64, 64], [64, 64], rank=0)
    reserve.settle(route)
    reserve.record(route)
    assert route.group == doc[-1] and gbm.ranks[0].reserved.cascade == 0  # alone: a group of one
    joined, idle = pricer.serve(second, [0, 1], [64, 64], None)
    assert joined.total_s < idle.total_s
    together = 31  # the first question's decode steps this one shares
    credit = 2 * (fit.context_token - fit.cascade_pair) * 64 * 256 * together
    assert joined.total_s + credit > idle.total_s  # what the conversion is worth decides it
