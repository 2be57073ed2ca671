"""Overlapped stepping (``async_scheduling=True``) against the serial path on CPU, token for token:
chunked prefill, preemption under KV pressure, prefix-cache hits, stop token ids (one read back
after its sequence was preempted), EOS, max_tokens, max_model_len, aborts mid-run and seeded
sampling. Every request's stream of step outputs is checked too: one
output per token, ``finished`` only on the last, nothing after a request finished or was aborted."""

from __future__ import annotations

import random

import pytest
import torch

from lmpool import LLM, SamplingParams
from lmpool.engine.scheduler import ScheduledBatch, Scheduler
from lmpool.engine.sequence import Sequence, SequenceStatus
from lmpool.engine.step_inputs import StepInputBuilder

BLOCK = 16


def prompts(n: int = 10, seed: int = 0, lo: int = 3, hi: int = 90) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_engine(model: str, requests, async_scheduling: bool, abort_after: dict[str, int] | None = None,
               eos: frozenset[int] | None = None, read_early: random.Random | None = None,
               **engine_args) -> tuple[dict, dict, int]:
    """Drive ``EngineCore.step`` directly: the tokens and finish reason of each request, as its
    step outputs announced them. ``abort_after[rid] = j`` aborts ``rid`` once it has emitted j
    tokens; ``eos`` replaces the model's EOS tokens; with ``read_early``, before a random half of
    the steps the launched step is read back first (``read_finished``, as a pool worker does
    where the device has finished it; on a CPU it always has). Checks each request's stream of
    outputs and that every block is released."""
    abort_after = dict(abort_after or {})
    with LLM(model, block_size=BLOCK, async_scheduling=async_scheduling, **engine_args) as llm:
        engine = llm.engine
        if eos is not None:
            engine.eos_token_ids = eos
        for rid, (ids, params) in requests.items():
            engine.add_request(rid, ids, params)
        tokens: dict[str, list[int]] = {rid: [] for rid in requests}
        reasons: dict[str, str] = {}
        while engine.has_unfinished():
            for rid, j in list(abort_after.items()):
                if len(tokens[rid]) >= j and rid not in reasons:
                    assert engine.abort_request(rid)
                    reasons[rid] = "abort"
                    del abort_after[rid]
            outputs = []
            if read_early is not None and read_early.random() < 0.5:
                outputs = engine.read_finished()
                assert engine.in_flight is None or not async_scheduling
                for seq in engine.scheduler.running:  # the step read back has its blocks committed
                    assert seq.num_ready_blocks == min(seq.num_computed_tokens // BLOCK, len(seq.block_hashes))
            for out in outputs + engine.step():
                assert out.request_id not in reasons, f"{out.request_id} emitted after it finished"
                tokens[out.request_id].append(out.new_token_id)
                assert out.seq.output_token_ids == tokens[out.request_id]
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        assert engine.step() == []  # nothing left in flight either
        assert engine.block_manager.num_used == 0
        engine.block_manager.check_invariants([])
        return tokens, reasons, engine.scheduler.num_preemptions


def assert_paths_agree(model: str, requests, abort_after=None, eos=None, **engine_args) -> tuple[dict, dict]:
    serial = run_engine(model, requests, False, abort_after, eos, **engine_args)
    overlapped = run_engine(model, requests, True, abort_after, eos, **engine_args)
    assert overlapped[0] == serial[0]
    assert overlapped[1] == serial[1]
    assert set(serial[1]) == set(requests)
    return serial[0], serial[1]


def as_requests(ps, params) -> dict:
    if isinstance(params, SamplingParams):
        params = [params] * len(ps)
    return {f"r{i}": (p, sp) for i, (p, sp) in enumerate(zip(ps, params))}


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 7, "max_num_seqs": 3},  # chunked prefill, small batches
    {"max_num_batched_tokens": 40},  # chunks mixed with decodes in one step
    {"num_kv_blocks": 12},  # preemption under KV pressure
    {"num_kv_blocks": 12, "max_num_batched_tokens": 24},
    {"enable_prefix_caching": False},
], ids=["roomy", "chunked", "mixed", "preempting", "preempting-chunked", "no-prefix-cache"])
def test_greedy_tokens_equal_the_serial_path(tiny_model, engine_args):
    params = [greedy(1 + 7 * i % 31) for i in range(10)]  # max_tokens from 1 to 31
    tokens, reasons = assert_paths_agree(tiny_model, as_requests(prompts(), params), **engine_args)
    assert all(len(tokens[f"r{i}"]) == p.max_tokens for i, p in enumerate(params))
    assert set(reasons.values()) == {"length"}


@pytest.mark.parametrize("engine_args", [
    {}, {"max_num_batched_tokens": 7, "max_num_seqs": 3}, {"num_kv_blocks": 12, "max_num_batched_tokens": 24},
], ids=["roomy", "chunked", "preempting-chunked"])
@pytest.mark.parametrize("seed", range(3))
def test_reading_a_finished_step_before_the_next_launch_changes_no_token(tiny_model, engine_args, seed):
    """Overlapped steps read back before the next launch at random (``read_finished``) and one step
    late otherwise: greedy tokens, stops and lengths are the serial path's, as are the streams."""
    ps = prompts(seed=seed)
    free = run_engine(tiny_model, as_requests(ps, greedy(20)), False, **engine_args)[0]
    params = [greedy(20, stop_token_ids=(free[f"r{i}"][2 + i],)) if i % 2 else greedy(1 + 3 * i)
              for i in range(len(ps))]
    requests = as_requests(ps, params)
    aborts = {"r1": 2, "r4": 3}  # aborted mid-run, read back early or late
    serial = run_engine(tiny_model, requests, False, aborts, **engine_args)
    mixed = run_engine(tiny_model, requests, True, aborts, read_early=random.Random(seed), **engine_args)
    assert mixed[:2] == serial[:2]


def test_read_finished_returns_nothing_while_the_step_runs_or_when_serial(tiny_model, monkeypatch):
    """A launched step the device has not finished stays in flight, and its tokens come from
    ``end_step`` as before; a serial engine never has one to read."""
    with LLM(tiny_model, block_size=BLOCK, async_scheduling=True) as llm:
        engine = llm.engine
        engine.add_request("a", prompts(1)[0], greedy(4))
        assert engine.read_finished() == []  # nothing launched
        assert engine.step() == []  # overlapped: its first step's token is read one step late
        launched = engine.in_flight
        assert launched is not None
        monkeypatch.setattr(type(launched.pending), "ready", lambda self: False)
        assert engine.read_finished() == [] and engine.in_flight is launched
        monkeypatch.undo()
        first = engine.read_finished()
        assert [(o.request_id, o.finished) for o in first] == [("a", False)]
        assert engine.in_flight is None and engine.launched is None and engine.last_read_back is launched.batch
        while engine.has_unfinished():
            first += engine.read_finished() + engine.step()
        assert [o.finished for o in first] == [False, False, False, True]
    with LLM(tiny_model, block_size=BLOCK, async_scheduling=False) as llm:
        llm.engine.add_request("a", prompts(1)[0], greedy(2))
        assert llm.engine.step() and llm.engine.read_finished() == []


def test_read_finished_refuses_to_run_between_a_launch_and_its_read_back(tiny_model):
    """Between ``begin_step`` and ``end_step`` the step in flight is the one just launched, not the
    one ``end_step`` reads: reading it first would put its tokens before the step before it."""
    with LLM(tiny_model, block_size=BLOCK, async_scheduling=True) as llm:
        engine = llm.engine
        engine.add_request("a", prompts(1)[0], greedy(4))
        engine.step()
        step = engine.begin_step()
        with pytest.raises(RuntimeError, match="between begin_step and end_step"):
            engine.read_finished()
        assert [o.request_id for o in engine.end_step(step)] == ["a"]
        assert [o.request_id for o in engine.read_finished()] == ["a"]


def test_preemption_happens_in_both_paths(tiny_model):
    requests = as_requests(prompts(), greedy(24))
    for async_scheduling in (False, True):
        assert run_engine(tiny_model, requests, async_scheduling, num_kv_blocks=12)[2] > 0


def test_prefix_cache_hits_give_identical_tokens(tiny_model):
    """Prompts sharing long prefixes, run twice on one engine: the second run reads cached blocks."""
    base = prompts(1, seed=3, lo=70, hi=71)[0]
    ps = [base[: 20 + 5 * i] + q for i, q in enumerate(prompts(6, seed=4, lo=2, hi=20))]
    want = {}
    for async_scheduling in (False, True):
        with LLM(tiny_model, block_size=BLOCK, async_scheduling=async_scheduling) as llm:
            first = llm.generate(ps, greedy(20))
            second = llm.generate(ps, greedy(20))
        assert any(o.num_cached_tokens > 0 for o in first)  # shared prefixes, within the first run
        assert all(o.num_cached_tokens >= 16 for o in second)
        assert [o.token_ids for o in second] == [o.token_ids for o in first]
        want[async_scheduling] = [o.token_ids for o in first]
    assert want[True] == want[False]


def test_stop_token_ids_end_requests_exactly(tiny_model):
    """Stop ids picked from each request's own greedy output: both paths stop at the same token,
    and the overlapped path drops the token its extra step computed for the stopped request."""
    ps = prompts()
    free = run_engine(tiny_model, as_requests(ps, greedy(30)), False)[0]
    params = [greedy(30, stop_token_ids=(free[f"r{i}"][3 + i],)) for i in range(len(ps))]
    for engine_args in ({}, {"num_kv_blocks": 12}, {"max_num_batched_tokens": 24}):
        tokens, reasons = assert_paths_agree(tiny_model, as_requests(ps, params), **engine_args)
        for i in range(len(ps)):
            out = tokens[f"r{i}"]
            stop = params[i].stop_token_ids[0]
            assert out[-1] == stop and stop not in out[:-1] and reasons[f"r{i}"] == "stop"
            assert out == free[f"r{i}"][: len(out)]


def test_a_stop_token_read_back_after_its_sequence_was_preempted(tiny_model, monkeypatch):
    """A sequence preempted while its newest token is still on the device, that token being a
    stop token: it is read back in the same step and the sequence ends from the waiting queue,
    never recomputed. The stop id is taken from a first run at the moment of its preemption."""
    ps = prompts()
    preempted = []
    preempt = Scheduler._preempt

    def recording_preempt(self, seq):
        preempted.append((seq.request_id, len(seq.output_token_ids), seq.num_pending))
        preempt(self, seq)

    monkeypatch.setattr(Scheduler, "_preempt", recording_preempt)
    free = run_engine(tiny_model, as_requests(ps, greedy(40)), True, num_kv_blocks=12)[0]
    rid, index, pending = preempted[0]
    assert pending == 1 and free[rid][index] not in free[rid][:index]
    params = {r: greedy(40, stop_token_ids=(free[rid][index],) if r == rid else ()) for r in free}
    retired_waiting = []
    retire = Scheduler.retire

    def recording_retire(self, seq, reason):
        retired_waiting.append(seq.status is SequenceStatus.WAITING)
        retire(self, seq, reason)

    monkeypatch.setattr(Scheduler, "retire", recording_retire)
    requests = {r: (p, params[r]) for r, p in zip(free, ps)}
    tokens, reasons = assert_paths_agree(tiny_model, requests, num_kv_blocks=12)
    assert tokens[rid] == free[rid][: index + 1] and reasons[rid] == "stop"
    assert any(retired_waiting)


def test_eos_ends_requests_unless_ignored(tiny_model):
    """EOS as a stop condition: the engine's EOS set is replaced by tokens the requests emit."""
    ps = prompts(6)
    free = run_engine(tiny_model, as_requests(ps, greedy(20)), False)[0]
    eos = frozenset({free["r0"][4], free["r3"][9]})
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=i == 0) for i in range(len(ps))]
    tokens, reasons = assert_paths_agree(tiny_model, as_requests(ps, params), eos=eos)
    for i in range(len(ps)):
        want = free[f"r{i}"]
        cut = next((j + 1 for j, t in enumerate(want) if t in eos and i != 0), len(want))
        assert tokens[f"r{i}"] == want[:cut]
        assert reasons[f"r{i}"] == ("length" if cut == len(want) else "stop")
    assert reasons["r0"] == "length" and reasons["r3"] == "stop"


def test_requests_reaching_max_model_len_end_in_both_paths(tiny_model):
    ps = prompts(6, lo=20, hi=60)
    params = [greedy(64 - len(p)) for p in ps]  # admission refuses anything longer
    tokens, reasons = assert_paths_agree(tiny_model, as_requests(ps, params), max_model_len=64)
    for i, p in enumerate(ps):
        assert len(p) + len(tokens[f"r{i}"]) == 64 and reasons[f"r{i}"] == "length"


@pytest.mark.parametrize("engine_args", [{}, {"num_kv_blocks": 12}], ids=["roomy", "preempting"])
def test_aborts_mid_run_stop_the_stream_at_once(tiny_model, engine_args):
    """Requests aborted once they have emitted j tokens (j = 0: before their first) emit nothing
    more, in either path; the others are undisturbed."""
    ps = prompts()
    abort_after = {"r1": 0, "r2": 1, "r4": 5, "r7": 12}
    tokens, reasons = assert_paths_agree(tiny_model, as_requests(ps, greedy(24)), abort_after, **engine_args)
    for rid, j in abort_after.items():
        assert len(tokens[rid]) == j and reasons[rid] == "abort"
    assert sum(r == "length" for r in reasons.values()) == len(ps) - len(abort_after)


def test_seeded_sampling_equals_the_serial_path(tiny_model):
    ps = prompts()
    params = [SamplingParams(temperature=0.9, top_k=(0, 40)[i % 2], top_p=(1.0, 0.8)[i % 3 % 2], max_tokens=20,
                             ignore_eos=True, seed=100 + i) for i in range(len(ps))]
    for engine_args in ({}, {"num_kv_blocks": 12}, {"max_num_batched_tokens": 24}):
        tokens, _ = assert_paths_agree(tiny_model, as_requests(ps, params), **engine_args)
        assert len({t for out in tokens.values() for t in out}) > 40  # sampled, not greedy


def test_greedy_and_seeded_rows_in_one_batch_with_stops(tiny_model):
    ps = prompts(12)
    free = run_engine(tiny_model, as_requests(ps, greedy(16)), False)[0]
    params = []
    for i in range(len(ps)):
        if i % 3 == 0:
            params.append(greedy(16, stop_token_ids=(free[f"r{i}"][i % 5],)))
        else:
            params.append(SamplingParams(temperature=0.7, top_k=20, max_tokens=4 + i, ignore_eos=True, seed=i))
    assert_paths_agree(tiny_model, as_requests(ps, params), num_kv_blocks=14, max_num_batched_tokens=48)


def test_overlapped_tokens_come_one_step_late(tiny_model):
    """The overlapped engine returns a step's tokens from the next ``step`` call; the request
    stays unfinished while its last token is still in flight."""
    with LLM(tiny_model, block_size=BLOCK) as llm:
        engine = llm.engine
        assert engine.config.async_scheduling  # the default
        engine.add_request("a", prompts(1)[0], greedy(2))
        assert engine.step() == []  # prefill launched, its token not yet read
        first = engine.step()  # the first decode launched; the prefill's token read back
        assert [(o.request_id, o.finished) for o in first] == [("a", False)]
        assert engine.has_unfinished() and not engine.scheduler.running  # its last token is in flight
        last = engine.step()
        assert [(o.request_id, o.finished, o.finish_reason) for o in last] == [("a", True, "length")]
        assert not engine.has_unfinished() and engine.block_manager.num_used == 0


def test_last_read_back_names_the_batch_whose_tokens_a_step_returned(tiny_model):
    """What a step's wall time measures once the device is busy (a pool's prefill meter)."""
    for async_scheduling in (False, True):
        with LLM(tiny_model, block_size=BLOCK, async_scheduling=async_scheduling) as llm:
            engine = llm.engine
            for i, p in enumerate(prompts(4)):
                engine.add_request(f"b{i}", p, greedy(3))
            launched = []
            while engine.has_unfinished():
                outputs = engine.step()
                launched.append(engine.scheduler.last_batch)
                read = launched[-2] if async_scheduling and len(launched) > 1 else launched[-1]
                if async_scheduling and len(launched) == 1:
                    assert not engine.last_read_back.seqs and not outputs
                else:
                    assert engine.last_read_back is read
                    assert {o.request_id for o in outputs} <= {s.request_id for s in read.seqs}


# ---- step inputs of a sequence whose input token is pending -----------------------------------


def _pending_batch() -> ScheduledBatch:
    a = Sequence("a", list(range(100, 140)), greedy(8), BLOCK)  # decoding, its token pending
    a.num_computed_tokens = 40
    a.block_table = [5, 9, 2]
    a.expect_token(row=1)
    b = Sequence("b", list(range(200, 230)), greedy(8), BLOCK)  # a prefill chunk
    b.num_computed_tokens = 16
    b.block_table = [7, 3]
    return ScheduledBatch(seqs=[a, b], num_tokens=[1, 14])


def test_step_inputs_mark_pending_tokens_for_the_device_to_fill():
    builder = StepInputBuilder(torch.device("cpu"), BLOCK, capacity=64)
    inputs = builder.build(_pending_batch())
    assert inputs.ids.tolist() == [0] + list(range(216, 230))
    assert inputs.positions.tolist() == [40] + list(range(16, 30))
    assert inputs.fill.tolist() == [[0], [1]]  # token row 0 from row 1 of the previous step's tokens
    assert inputs.sample_index is None and inputs.sample_rows.tolist() == [0, 14]


def test_a_pending_token_must_be_the_only_token_scheduled():
    batch = _pending_batch()
    batch.seqs[0].num_computed_tokens = 39
    batch.num_tokens[0] = 2
    with pytest.raises(ValueError, match="pending token must be the only token scheduled"):
        StepInputBuilder(torch.device("cpu"), BLOCK, capacity=64).build(batch)
