"""The ``smg_cache_aware`` peer (``benchmarks/peers/eval_gateway.py``): two single-replica
``lmpool serve`` hosts behind the real smg gateway, driven by the evaluation's replay.

On a tiny trace replayed one request at a time (so smg's in-flight counts are all zero and
its cache-aware rule decides on the tree alone): every request has a record with its output
length and the rank that served it; requests that share a prefix with an earlier one follow
it to its host and find its blocks cached there; a pinned request runs on its rank; the
hosts ran exactly the trace's prompt tokens; and no host, pool process or gateway outlives
the run. A gateway that cannot run makes the policy unavailable.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.peers import eval_gateway
import pytest
from benchmarks.replay.eval_driver import Arrival, replay
from benchmarks.peers.eval_policies import SMG
from benchmarks.replay.eval_settings import Setting
from benchmarks.workloads.traces import Tokens, Trace, TraceRequest

from lmpool_ipc.lifecycle import pid_alive

BLOCK = 8
PREFIX = 5 * BLOCK  # five full blocks in common within a group
TAIL = 6
MAX_TOKENS = 3


def smg_runs() -> None:
    try:
        eval_gateway.smg_version()
    except eval_gateway.GatewayUnavailable as e:
        pytest.skip(f"the smg gateway binary cannot run here: {e}")


def tiny_trace(vocab: int) -> Trace:
    """Groups a and b: a first request, then three followers sharing its prefix. Group c:
    one request pinned to rank 1, behind the gateway's back."""
    tokens = Tokens("gateway-test", 0, vocab)
    prefixes = {g: tokens.draw(PREFIX) for g in "abc"}
    plan = [("first", "a", None), ("first", "b", None), ("pinned", "c", 1),
            *[("follow", g, None) for _ in range(3) for g in "ab"]]
    requests = tuple(TraceRequest(i, phase, g, prefixes[g] + tokens.draw(TAIL), MAX_TOKENS, rank)
                     for i, (phase, g, rank) in enumerate(plan))
    return Trace("gateway_test", 0, ("first", "pinned", "follow"), requests, {})


def suite_args(**kw) -> argparse.Namespace:
    base = {"world_size": 2, "device": "cpu", "block_size": BLOCK, "max_num_seqs": 8, "max_num_batched_tokens": 512,
            "dtype": None, "enforce_eager": False, "cascade_min_saved_tokens": None, "prefill_attention": None,
            "piecewise_graph_max_tokens": None, "run_timeout": 300.0}
    return argparse.Namespace(**(base | kw))


def test_smg_peer_routes_followers_to_their_prefix(tiny_model, no_leaks):
    smg_runs()
    from lmpool.model.config import ModelConfig

    trace = tiny_trace(ModelConfig.from_pretrained(tiny_model).vocab_size)
    setting = Setting(kv_blocks=64, arrival=Arrival("window", window=1))
    record = asyncio.run(eval_gateway.run_gateway(tiny_model, suite_args(), trace, setting, 128, replay,
                                                  lambda: None))

    req = record["requests"]
    assert req["index"] == list(range(len(trace.requests)))
    assert req["output_len"] == [MAX_TOKENS] * len(trace.requests)
    assert set(req["rank"]) <= {0, 1}
    assert record["gateway"]["prompts_checked"] == len(trace.requests)  # the hosts ran the exact ids
    first = {req["group"][i]: req["rank"][i] for i in range(len(trace.requests)) if req["phase"][i] == "first"}
    for i in range(len(trace.requests)):
        if req["phase"][i] == "follow":
            assert req["rank"][i] == first[req["group"][i]], f"request {i} left its group's host"
            assert req["num_cached_tokens"][i] == PREFIX, f"request {i} missed its prefix's blocks"
        if req["phase"][i] == "pinned":
            assert (req["rank"][i], req["route"][i]) == (1, "pinned")

    pids = record["gateway"]["pids"]
    assert pids["smg"] is not None and len(pids["hosts"]) == 2
    assert not [p for p in (pids["smg"], *pids["hosts"]) if pid_alive(p)], "a host or the gateway outlived the run"
    assert record["gateway"]["exit_codes"]["smg"] is not None


def test_a_gateway_that_cannot_run_is_unavailable(monkeypatch, tmp_path):
    from benchmarks import eval_suite

    monkeypatch.setattr(eval_gateway, "smg_path", lambda: str(tmp_path / "no-smg"))
    setting = Setting(kv_blocks=8, arrival=Arrival())
    with pytest.raises(eval_suite.PolicyUnavailable, match="smg binary cannot run"):
        asyncio.run(eval_suite.run_one("unused", suite_args(), SMG, tiny_trace(16), setting, 128, None))
    assert SMG.record()["gateway"]["error"] is not None
    assert "not a reimplementation" in SMG.record()["implementation"]


def test_every_runner_takes_the_gateway_by_name_and_all_leaves_it_out():
    from benchmarks import benchmark_e2e
    from benchmarks import benchmark_hot_context
    from benchmarks import benchmark_kv_routing
    from benchmarks.eval_suite import chosen_policies

    for runner in (benchmark_e2e, benchmark_kv_routing, benchmark_hot_context):
        named = chosen_policies(argparse.Namespace(quick=False, policies="smg_cache_aware,lmpool"), runner.POLICIES, "")
        assert [p.name for p in named] == ["smg_cache_aware", "lmpool"]
        every = chosen_policies(argparse.Namespace(quick=False, policies="all"), runner.POLICIES, "")
        assert "smg_cache_aware" not in {p.name for p in every} and "lmpool" in {p.name for p in every}


def ended(pid: int) -> bool:
    """Gone, or a zombie waiting for whoever adopted it to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_suite_killed_outright_leaves_no_host_or_gateway_behind(tmp_path):
    """A host runs in its own session (a terminal's Ctrl-C must reach the suite first), so only
    its parent-death signal ends it when the suite is killed without a chance to stop it."""
    suite = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from pathlib import Path
from benchmarks.peers import eval_gateway
child = eval_gateway.Processes(Path({str(tmp_path)!r}))._spawn(
    [sys.executable, "-c", "import time; time.sleep(600)"], "host")
print(child.pid, flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True, cwd=Path(eval_gateway.__file__).resolve().parents[2])
    host = int(suite.stdout.readline())
    assert not ended(host)
    suite.kill()
    suite.wait()
    deadline = time.monotonic() + 60  # (a guard against a hang, not a deadline)
    while not ended(host):
        assert time.monotonic() < deadline, "the host outlived the killed suite"
        time.sleep(0.05)
