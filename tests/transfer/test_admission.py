"""The transfer cost model (profile, interpolation, online correction) and the admission gate."""

from __future__ import annotations

import logging

import pytest

from lmpool.control.transfers.admission import AdmissionGate, AdmissionPolicy
from lmpool.control.transfers.cost_model import TransferCostModel, bucket

KV_BYTES = 4096


def profile(kv_bytes: int = KV_BYTES) -> dict:
    # 0.1 ms fixed + 0.01 ms per block, with one noisy point (16 blocks faster than 8).
    sizes = (1, 2, 4, 8, 16, 32, 64)
    times = {n: 1e-4 + 1e-5 * n for n in sizes}
    times[16] = times[8] * 0.9
    return {
        "kind": "gloo",
        "model": {"kv_bytes_per_block": kv_bytes},
        "pairs": {"0->1": {str(n): {"p50_s": t * 0.8, "p95_s": t} for n, t in times.items()}},
        "residual_p95_s": {"0->1": {"1": 5e-5, "64": 2e-4}},
    }


def test_profile_for_another_model_shape_is_refused():
    with pytest.raises(ValueError, match="measured for 8192 KV bytes per block"):
        TransferCostModel.from_profile(profile(8192), KV_BYTES)


def test_estimates_interpolate_extrapolate_and_never_decrease():
    model = TransferCostModel.from_profile(profile(), KV_BYTES)
    assert model.data_path_p95(0, 1, 8) == pytest.approx(1e-4 + 8e-5)
    assert model.data_path_p95(0, 1, 3) == pytest.approx((model.data_path_p95(0, 1, 2) + model.data_path_p95(0, 1, 4)) / 2)
    assert model.data_path_p95(0, 1, 128) > model.data_path_p95(0, 1, 64)
    estimates = [model.estimate(0, 1, n) for n in range(1, 200)]
    assert all(b >= a for a, b in zip(estimates, estimates[1:]))
    assert model.estimate(0, 1, 1) == pytest.approx(5e-5 + 1e-4 + 1e-5)  # residual + data path
    # An unmeasured pair (a pool larger than the calibration's two ranks) borrows the
    # measured pair's data path and residual alike.
    assert model.estimate(2, 3, 4) == pytest.approx(model.estimate(0, 1, 4))
    assert model.residual_p95(3, 0, 1) == pytest.approx(5e-5)
    assert [bucket(n) for n in (1, 3, 64, 500)] == [1, 2, 64, 64]


def test_online_correction_converges_to_observed_cost():
    model = TransferCostModel.from_profile(profile(), KV_BYTES, ewma_alpha=0.5)
    before = model.estimate(0, 1, 8)
    for _ in range(30):
        model.observe(0, 1, 8, 3 * before)
    assert model.estimate(0, 1, 8) == pytest.approx(3 * before, rel=1e-3)
    assert model.estimate(0, 1, 1) == pytest.approx(5e-5 + 1e-4 + 1e-5)  # other buckets untouched


def gate(prefill_s_per_token: float = 1e-6) -> AdmissionGate:
    policy = AdmissionPolicy(prefill_s_per_token=prefill_s_per_token, block_size=16, discount=0.5)
    return AdmissionGate(policy, TransferCostModel.from_profile(profile(), KV_BYTES))


def test_gate_refuses_little_reuse_and_admits_much(caplog):
    g = gate()
    caplog.set_level(logging.INFO, logger="lmpool.control.transfers.admission")
    # 4 blocks x 16 tokens x 1 us = 64 us saved once; the transfer costs ~190 us.
    refused = g.background(0, 1, 4)
    assert not refused.admitted and refused.saved_prefill_s < refused.transfer_cost_s
    # The same blocks, reused many times: the discounted sum approaches 2x, still too little...
    assert not g.foreground(0, 1, 4, expected_reuses=10).admitted
    # ...but a chain of 64 blocks saves 1 ms per reuse against ~0.9 ms of transfer.
    admitted = g.foreground(0, 1, 64, expected_reuses=3)
    assert admitted.admitted and admitted.saved_prefill_s > admitted.transfer_cost_s
    assert len(g.decisions) == 3
    logged = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("refuse background transfer 0->1 of 4 blocks: saves 0.064 ms") for m in logged)
    assert any(m.startswith("admit foreground transfer 0->1 of 64 blocks") for m in logged)


def test_no_expected_reuse_is_never_worth_a_transfer():
    assert not gate(prefill_s_per_token=1.0).foreground(0, 1, 64, expected_reuses=0).admitted


def test_bad_policy():
    with pytest.raises(ValueError, match="discount"):
        AdmissionPolicy(prefill_s_per_token=1e-6, block_size=16, discount=1.0)
