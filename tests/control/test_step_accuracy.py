"""How well a rank's priced step time predicted each kind of its steps
(``lmpool.control.pricing.step_accuracy``), as ``stats()`` shows it."""

from __future__ import annotations

import math

import msgspec
import pytest
from control_testkit import engine_model
from hypothesis import given, settings
from hypothesis import strategies as st

from lmpool.control.pricing.step_accuracy import KINDS, StepAccuracy, kind_of
from lmpool.control.pricing.step_model import StepCoefficients
from lmpool.protocol import StepSample, StepTimings

PRICED = StepCoefficients(base=2e-3, prefill_token=20e-6, attention_pair=5e-9, decode_seq=30e-6, context_token=0.1e-6,
                          cascade_pair=10e-9)


def test_each_step_has_one_kind():
    assert kind_of(StepSample(1.0, 0, 0, 8, 8000)) == "decode"
    assert kind_of(StepSample(1.0, 0, 0, 2, 10, 2 * 16384)) == "cascade"  # a prefix pass's pairs, no prompt tokens
    assert kind_of(StepSample(1.0, 512, 512 * 513 // 2, 0, 0)) == "prefill"
    assert kind_of(StepSample(1.0, 64, 64 * 16384, 8, 8000)) == "mixed"
    assert kind_of(StepSample(1.0, 64, 64 * 16384, 8, 8000, 8 * 16384)) == "mixed"  # over a cascade


def test_a_sender_from_before_cascade_pairs_still_decodes_and_its_cascades_count_as_such():
    """``StepSample.cascade_pairs`` came last, defaulting to 0: a worker that counted its prefix
    passes' pairs as attention still decodes, those steps still count as cascades."""

    class OldSample(msgspec.Struct, array_like=True):  # StepSample as it was
        seconds: float
        prefill_tokens: int = 0
        attention: int = 0
        decode_seqs: int = 0
        decode_context: int = 0

    wire = msgspec.msgpack.encode([OldSample(0.01, 0, 0, 8, 8000), OldSample(0.02, 0, 2 * 16384, 2, 10)])
    decode, cascade = msgspec.msgpack.decode(wire, type=list[StepSample])
    assert cascade == StepSample(0.02, 0, 2 * 16384, 2, 10, cascade_pairs=0)
    assert (kind_of(decode), kind_of(cascade)) == ("decode", "cascade")


def test_a_rank_s_fit_says_which_kind_of_step_its_price_misses():
    """Decode steps as priced, mixed steps twice as long as priced, prefills 10 % short: each kind
    is summed apart against the coefficients the routes priced the rank with."""
    model = engine_model(1, PRICED)
    decode, mixed, prefill = StepSample(0.0, 0, 0, 8, 8000), StepSample(0.0, 64, 64 * 4096, 8, 8000), \
        StepSample(0.0, 2048, 2048 * 2049 // 2, 0, 0)
    steps = []
    for shape, factor in ((decode, 1.0), (mixed, 2.0), (prefill, 1 / 0.9)):
        steps += [msgspec.structs.replace(shape, seconds=PRICED.predict(shape) * factor) for _ in range(10)]
    model.observe(StepTimings(0, 1, steps))
    kinds = {k.kind: k for k in model.describe(0).kinds}
    assert set(kinds) == {"decode", "mixed", "prefill"}  # no cascade step ran: none shown
    assert kinds["decode"].steps == 10 and kinds["decode"].predicted_over_measured == pytest.approx(1.0)
    assert kinds["decode"].within_25pct == pytest.approx(1.0)
    assert kinds["mixed"].predicted_over_measured == pytest.approx(0.5) and kinds["mixed"].within_25pct == 0.0
    assert kinds["prefill"].predicted_over_measured == pytest.approx(0.9) and kinds["prefill"].within_25pct == 1.0


def test_steps_without_a_time_count_nowhere():
    accuracy = StepAccuracy()
    accuracy.observe([StepSample(0.0, 0, 0, 1, 10), StepSample(math.inf, 0, 0, 1, 10),
                      StepSample(float("nan"), 0, 0, 1, 10)], PRICED.predict)
    accuracy.observe([StepSample(1.0, 0, 0, 1, 10)], lambda s: 0.0)  # nothing predicted: no ratio
    accuracy.observe([StepSample(1e300, 0, 0, 1, 10)], lambda s: 1e-30)  # a ratio that underflows
    assert accuracy.describe() == [] and sum(accuracy.steps.values()) == 0


def test_a_rank_s_calibration_starts_its_figures_afresh():
    """A restarted worker calibrates again: a new engine state, scored from then on."""
    model = engine_model(1, PRICED)
    model.observe(StepTimings(0, 1, [StepSample(0.01, 0, 0, 4, 4000)]))
    assert [k.kind for k in model.describe(0).kinds] == ["decode"]
    model.observe(StepTimings(0, 2, [StepSample(0.01, 0, 0, 4, 4000)], calibration=True))
    assert model.describe(0).kinds == []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-6, 10.0), st.integers(0, 8192), st.integers(0, 10**8), st.integers(0, 64),
                          st.integers(0, 10**6), st.integers(0, 10**7), st.integers(0, 10**6)), max_size=60),
       st.floats(10.0, 5000.0))
def test_every_kind_shown_has_a_finite_ratio_and_a_share(rows, half_life):
    accuracy = StepAccuracy(half_life)
    samples = [StepSample(*row) for row in rows]
    accuracy.observe(samples, PRICED.predict)
    shown = accuracy.describe()
    assert [k.kind for k in shown] == [k for k in KINDS if any(kind_of(s) == k for s in samples)]
    for k in shown:
        assert k.steps == sum(kind_of(s) == k.kind for s in samples)
        assert 0 < k.predicted_over_measured < math.inf and 0.0 <= k.within_25pct <= 1.0 + 1e-12
        # The last few of the kind, whole: its time, its prediction, its shape.
        mine = [s for s in samples if kind_of(s) == k.kind][-len(k.recent):]
        assert len(k.recent) == min(4, k.steps) and [r[:1] + r[2:] for r in k.recent] == [
            [s.seconds, s.prefill_tokens, s.attention, s.decode_seqs, s.decode_context, s.cascade_pairs,
             s.prefill_keys] for s in mine]
        assert all(r[1] == PRICED.predict(s) for r, s in zip(k.recent, mine))


def test_stats_gives_a_rank_s_fit_and_its_kinds_as_plain_dicts():
    """What an evaluation's records store (``json.dumps``) and a script reads by name."""
    import json

    from lmpool.frontend.client import step_fit_dict

    model = engine_model(1, PRICED)
    model.observe(StepTimings(0, 1, [StepSample(0.01, 0, 0, 4, 4000)]))
    fit = json.loads(json.dumps(step_fit_dict(model.describe(0))))
    assert fit["samples"] == 1 and fit["base_ms"] > 0  # the fit's figures, by name
    # Priced at 2.52 ms (before the step moved the fit), measured 10 ms.
    assert fit["kinds"] == [{"kind": "decode", "steps": 1, "predicted_over_measured": pytest.approx(0.252),
                             "within_25pct": 0.0, "recent": [[0.01, pytest.approx(0.00252), 0, 0, 4, 4000, 0, 0]]}]


def test_stats_lists_a_rank_s_last_calibration_steps_beside_its_fit_s_predictions():
    """What a rank's prior was made of: its worker's calibration steps, each as a recent step is
    listed, predicted by the calibration's own fit; a restarted worker's replace them."""
    import json

    from lmpool.frontend.client import step_fit_dict

    model = engine_model(2, PRICED)
    first = [StepSample(0.004, 64, 64 * 65 // 2, 0, 0, 0, 64), StepSample(0.003, 0, 0, 1, 65),
             StepSample(0.09, 5000, 5000 * 5001 // 2, 0, 0, 0, 5000)]
    model.observe(StepTimings(0, 1, first, calibration=True))
    fit = json.loads(json.dumps(step_fit_dict(model.describe(0))))
    calibrated = model.ranks[0].coefficients  # the calibration's fit, before any served step
    assert [row[0] for row in fit["calibration"]] == [s.seconds for s in first]
    assert [row[2:] for row in fit["calibration"]] == [[s.prefill_tokens, s.attention, s.decode_seqs,
                                                        s.decode_context, s.cascade_pairs, s.prefill_keys]
                                                       for s in first]
    assert [row[1] for row in fit["calibration"]] == pytest.approx([calibrated.predict(s) for s in first])
    model.observe(StepTimings(0, 1, [StepSample(0.01, 0, 0, 4, 4000)]))  # served steps leave it as it was
    assert step_fit_dict(model.describe(0))["calibration"] == fit["calibration"]
    assert model.describe(1).calibration == [], "a rank whose worker has not calibrated lists none"
    again = [StepSample(0.005, 0, 0, 2, 130)]
    model.observe(StepTimings(0, 2, again, calibration=True))  # its worker restarted
    assert [row[0] for row in model.describe(0).calibration] == [0.005]


def test_stats_and_top_show_the_cascade_pair_apart():
    """The fit's figures by name (``stats()``), a cascade's pair apart from a prefill's, and
    ``lmpool top``'s STEP column: a decode step of the rank's running batch, its prefix pass at
    the cascade's pair."""
    from lmpool.frontend.client import step_fit_dict
    from lmpool.protocol import LoadReport, RankState
    from lmpool.protocol.state_board import RankRow

    fit = engine_model(1, PRICED).describe(0)
    figures = step_fit_dict(fit)
    assert figures["attention_ns_per_pair"] == pytest.approx(5.0)
    assert figures["cascade_ns_per_pair"] == pytest.approx(10.0)
    load = LoadReport(num_running=4, context_tokens=400, cascade_pairs=4 * 16_384)
    state = RankState(rank=0, alive=True, epoch=1, snapshot_version=1, heartbeat_age_s=0.0, load=load,
                      cached_blocks=0, step_fit=fit)
    row = RankRow.from_state(state, pid=1, blocks_in_flight=0)
    assert row.step_ms == pytest.approx(PRICED.step_s(0, 0, 4, 400, 4 * 16_384) * 1e3)
