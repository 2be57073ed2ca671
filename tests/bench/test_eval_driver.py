"""``benchmarks/replay/eval_driver.py`` against a stand-in pool: trace order, the window cap, phase
barriers, Poisson arrivals and the per-request records; and ``eval_suite`` marking a policy
the pool constructor refuses as unavailable without starting anything."""

from __future__ import annotations

import asyncio
import json

import pytest
from benchmarks.workloads import traces as workloads
from benchmarks.replay.eval_driver import Arrival, replay


class Out:
    def __init__(self, n: int, rank: int, cached: int, last: bool) -> None:
        self.token_ids = list(range(n))
        self.rank, self.num_cached_tokens = rank, cached
        self.finish_reason = "length" if last else None
        self.route = f"spill r{rank} m0 cost=12 from owner r0 m3 cost=40" if rank else "pinned"


class FakePool:
    """Streams ``max_tokens`` outputs per request, yielding to the loop between tokens."""

    def __init__(self, finish: str = "length") -> None:
        self.events: list[tuple[str, int]] = []
        self.in_flight = self.most_in_flight = 0
        self.finish = finish
        self.index = {}

    async def stream(self, prompt, params, rank=None):
        i = self.index[id(prompt)]
        self.events.append(("start", i))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            for k in range(params.max_tokens):
                await asyncio.sleep(0)
                out = Out(k + 1, rank if rank is not None else i % 2, len(prompt) // 2, k + 1 == params.max_tokens)
                if out.finish_reason:
                    out.finish_reason = self.finish
                yield out
        finally:
            self.in_flight -= 1
            self.events.append(("end", i))


def fake_for(trace, **kw) -> FakePool:
    pool = FakePool(**kw)
    pool.index = {id(r.prompt): r.index for r in trace.requests}
    return pool


def test_trace_order_window_and_phase_barriers():
    trace = workloads.memory_skew(0, 100, world_size=4, scale=1 / 64, max_tokens=3)
    pool = fake_for(trace)
    cols = asyncio.run(replay(pool, trace, Arrival("window", window=4)))
    starts = [i for kind, i in pool.events if kind == "start"]
    assert starts == list(range(len(trace.requests)))
    assert pool.most_in_flight == 4
    for earlier, later in (("warmup", "pressure"), ("pressure", "reuse")):
        last_end = max(pool.events.index(("end", r.index)) for r in trace.phase_requests(earlier))
        first_start = min(pool.events.index(("start", r.index)) for r in trace.phase_requests(later))
        assert last_end < first_start
    assert cols["index"] == list(range(72))
    assert cols["output_len"] == [3] * 72
    assert cols["pinned_rank"][:36] == cols["rank"][:36]  # warm-up and pressure are pinned
    assert cols["route"] == ["spill" if rank else "pinned" for rank in cols["rank"]], "the rule, not its figures"
    assert all(reason.startswith(rule) for reason, rule in zip(cols["route_reason"], cols["route"]))
    assert cols["phase"] == [r.phase for r in trace.requests]
    assert all(a <= f <= c for a, f, c in zip(cols["arrival_s"], cols["first_token_s"], cols["completion_s"]))


def test_poisson_arrivals_are_spread_and_the_window_still_caps():
    trace = workloads.locality(1, 0, 100, scale=1 / 256, max_tokens=2)
    pool = fake_for(trace)
    cols = asyncio.run(replay(pool, trace, Arrival("poisson", window=0, rate=20000.0, seed=3)))
    arrivals = cols["arrival_s"]
    assert arrivals == sorted(arrivals)
    assert arrivals[-1] >= 0.9 * 191 / 20000.0  # 191 exponential gaps of mean 1/rate, at least
    with pytest.raises(ValueError, match="rate > 0"):
        Arrival("poisson", rate=0.0)
    with pytest.raises(ValueError, match="arrival mode"):
        Arrival("burst")


def test_a_request_that_does_not_finish_by_length_fails_the_run():
    trace = workloads.locality(1, 0, 100, scale=1 / 256, max_tokens=2)
    with pytest.raises(ExceptionGroup) as info:
        asyncio.run(replay(fake_for(trace, finish="abort"), trace, Arrival("window", window=8)))
    assert "finish_reason 'abort'" in str(info.value.exceptions[0])


def test_a_policy_the_pool_refuses_is_unavailable(tiny_model, tmp_path, monkeypatch):
    from benchmarks import eval_suite
    from benchmarks.benchmark_e2e import comparisons

    ap = eval_suite.argparse.ArgumentParser()
    eval_suite.add_arguments(ap)
    out = tmp_path / "refused.json"
    args = eval_suite.finish_arguments(
        ap.parse_args(["--quick", "--model", tiny_model, "--json", str(out), "--no-progress"]), 384, "e2e")
    trace = workloads.load_skew(0, 1024, args.scale, args.max_tokens)
    bogus = eval_suite.Policy("lmpool+teleport", "lmpool", "teleport")
    monkeypatch.setattr(eval_suite.sys, "argv", ["benchmark_e2e.py", "--quick"])
    result = eval_suite.run_suite(args, "e2e", {"load_skew": {0: trace}}, [bogus], comparisons)
    state = json.loads(out.read_text())["policies"]["lmpool+teleport"]
    assert state["status"] == "unavailable" and "teleport" in state["error"]
    assert [r["status"] for r in result["runs"]] == ["unavailable"]
    assert result["summary"] == {}


def test_a_transfer_profile_reaches_the_transfer_modes_only(tiny_model, tmp_path, monkeypatch):
    """``--transfer-profile`` is handed to the pools of the transfer modes: an unusable one
    makes exactly those policies unavailable, naming the profile, and is kept in the config."""
    from benchmarks import eval_suite
    from benchmarks.benchmark_e2e import comparisons

    ap = eval_suite.argparse.ArgumentParser()
    eval_suite.add_arguments(ap)
    out = tmp_path / "profiled.json"
    missing = tmp_path / "no_such_profile.json"
    args = eval_suite.finish_arguments(
        ap.parse_args(["--quick", "--model", tiny_model, "--json", str(out), "--no-progress",
                       "--transfer-profile", str(missing)]), 384, "e2e")
    trace = workloads.load_skew(0, 1024, args.scale, args.max_tokens)
    monkeypatch.setattr(eval_suite.sys, "argv", ["benchmark_e2e.py", "--quick"])
    background = eval_suite.Policy("lmpool+background", "lmpool", "background")
    eval_suite.run_suite(args, "e2e", {"load_skew": {0: trace}}, [background], comparisons)
    saved = json.loads(out.read_text())
    state = saved["policies"]["lmpool+background"]
    assert state["status"] == "unavailable" and "transfer_profile" in state["error"], state
    assert saved["metadata"]["config"]["transfer_profile"].endswith("no_such_profile.json")
