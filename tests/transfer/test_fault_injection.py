"""Fault injection for transfer plans (``lmpool/dataplane/faults.py``): faults fire where and
as often as asked, only in the named incarnation, and bad specs fail loudly."""

from __future__ import annotations

import pytest

from lmpool.dataplane.faults import ENV, Fault, FaultPlan, InjectedFault, encode


def plan(faults, rank=1, epoch=1):
    return FaultPlan.from_env(rank, epoch, {ENV: encode(faults)})


def test_unset_variable_injects_nothing():
    p = FaultPlan.from_env(0, 1, {})
    assert all(p.hit(o, w) is None for o in ("publish", "execute_send") for w in ("before", "after"))


def test_a_fault_fires_at_its_point_on_its_rank_and_epoch_only_as_often_as_asked():
    faults = [Fault(rank=1, order="publish", point="after", action="drop", times=2)]
    assert plan(faults, rank=0).hit("publish", "after") is None
    assert plan(faults, epoch=2).hit("publish", "after") is None
    p = plan(faults)
    assert p.hit("publish", "before") is None
    assert p.hit("finalize", "after") is None
    assert [p.hit("publish", "after") for _ in range(3)] == ["drop", "drop", None]


def test_raise_raises_and_faults_at_one_point_fire_in_order():
    p = plan([Fault(rank=1, order="execute_recv", point="during", action="raise"),
              Fault(rank=1, order="execute_recv", point="during", action="drop")])
    with pytest.raises(InjectedFault, match="during execute_recv"):
        p.hit("execute_recv", "during")
    assert p.hit("execute_recv", "during") == "drop"
    assert p.hit("execute_recv", "during") is None


@pytest.mark.parametrize("raw, match", [
    ('[{"rank": 1, "order": "nope", "point": "before", "action": "drop"}]', "order must be one of"),
    ('[{"rank": 1, "order": "publish", "point": "during", "action": "drop"}]', "needs an execute order"),
    ('[{"rank": 1, "order": "publish", "point": "before", "action": "explode"}]', "action must be one of"),
    ('[{"rank": 1, "order": "publish", "point": "before", "action": "drop", "times": 0}]', "times must be"),
    ('[{"rank": 1, "order": "publish", "point": "before", "action": "drop", "extra": 1}]', "not a valid"),
    ("not json", "not a valid"),
])
def test_bad_specs_are_refused_with_the_reason(raw, match):
    with pytest.raises(ValueError, match=match):
        FaultPlan.from_env(1, 1, {ENV: raw})


def test_a_marked_fault_records_each_firing(tmp_path):
    mark = tmp_path / "fired"
    p = plan([Fault(rank=1, order="finalize", point="after", action="drop", times=2, mark=str(mark))])
    assert not mark.exists()
    p.hit("finalize", "after")
    p.hit("finalize", "after")
    p.hit("finalize", "after")
    assert mark.read_text().splitlines() == ["finalize after", "finalize after"]
