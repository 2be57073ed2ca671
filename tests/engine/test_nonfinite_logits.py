"""A request whose logits hold NaN or inf fails alone, in both stepping paths: it ends with an
error naming non-finite logits, the requests beside it get their usual tokens, its blocks are
freed and the engine serves on. The flag rides in the step's one token read-back."""

from __future__ import annotations

import pytest
import torch

from lmpool import LLM, SamplingParams
from lmpool.engine.model_runner import NON_FINITE, ModelRunner, PendingTokens, finite_rows
from nonfinite import AFTER, POISON, poisoning

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
HEALTHY = {"a": (list(range(100, 140)), GREEDY), "b": (list(range(300, 321)), SEEDED)}


def run(llm: LLM, requests: dict) -> tuple[dict, dict, dict]:
    """Drive the engine: each request's tokens, finish reason and error (if it failed)."""
    engine = llm.engine
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    tokens = {rid: [] for rid in requests}
    reasons, errors = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in reasons, f"{out.request_id} emitted after it finished"
            if out.error is not None:
                errors[out.request_id] = out.error
            else:
                tokens[out.request_id].append(out.new_token_id)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert engine.step() == []
    assert engine.block_manager.num_used == 0  # the failed request's blocks were freed too
    engine.block_manager.check_invariants([])
    return tokens, reasons, errors


@pytest.fixture(scope="module")
def reference(tiny_model):
    with LLM(tiny_model, block_size=BLOCK) as llm:
        return run(llm, HEALTHY)[0]


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("bad_params", [GREEDY, SEEDED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "overlapped"])
def test_a_request_with_non_finite_logits_fails_alone(tiny_model, reference, monkeypatch, async_scheduling,
                                                      bad_params, value):
    monkeypatch.setattr(ModelRunner, "sample_checked", poisoning(ModelRunner.sample_checked, value))
    requests = {**HEALTHY, "bad": ([POISON, *range(500, 530)], bad_params)}
    with LLM(tiny_model, block_size=BLOCK, async_scheduling=async_scheduling) as llm:
        tokens, reasons, errors = run(llm, requests)
        assert len(tokens["bad"]) == AFTER and reasons["bad"] == "error"
        assert "non-finite logits" in errors["bad"]
        assert {rid: tokens[rid] for rid in HEALTHY} == reference
        assert reasons["a"] == reasons["b"] == "length" and set(errors) == {"bad"}
        assert run(llm, HEALTHY)[0] == reference  # and it serves on


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "overlapped"])
def test_llm_generate_names_the_failed_prompt(tiny_model, reference, monkeypatch, async_scheduling):
    monkeypatch.setattr(ModelRunner, "sample_checked", poisoning(ModelRunner.sample_checked))
    prompts = [HEALTHY["a"][0], [POISON, *range(500, 530)]]
    with LLM(tiny_model, block_size=BLOCK, async_scheduling=async_scheduling) as llm:
        with pytest.raises(ValueError, match=r"prompt 1 \(request 'llm-1'\): .*non-finite logits"):
            llm.generate(prompts, GREEDY)
        assert llm.engine.block_manager.num_used == 0 and not llm.engine.has_unfinished()
        llm.engine.block_manager.check_invariants([])
        assert llm.generate(HEALTHY["a"][0], GREEDY)[0].token_ids == reference["a"]


def test_the_flag_rides_in_the_token_read_back():
    logits = torch.tensor([[0.0, 1.0], [float("nan"), 0.0], [0.0, float("-inf")], [2.0, 1.0]])
    tokens = logits.nan_to_num(0.0).argmax(-1)
    pending = PendingTokens([], tokens, finite_rows(logits))
    assert pending.result() == [1, NON_FINITE, NON_FINITE, 0]
    # The next step reads failed rows' pending inputs from here: they must be valid ids.
    assert pending.device_tokens.tolist() == [1, 0, 0, 0]
    assert PendingTokens([], tokens).result() == [1, 0, 0, 0]  # no flags: the tokens as they are
