"""Prometheus metrics (lmpool.frontend.metrics): a pool with ``metrics_port`` serves /metrics,
which a Prometheus text parser reads, with latency histograms (time to first token, between
tokens, route decisions) that count every request and token, per-rank counters equal to what
the requests' outputs say, and the served model's name on every series; with ``metrics=True``
alone the same registry is in the process, with no port."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tools_testkit import wait_until

from lmpool import LMPool, SamplingParams

N, MAX_TOKENS = 10, 6


MODEL = "tiny-served"


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        return parse(response.read().decode())


def parse(text: str) -> dict:
    """Family name -> {(sample name, labels as sorted tuple, but model_name): value}; every
    sample labelled ``model_name=MODEL``."""
    families = {}
    for family in text_string_to_metric_families(text):
        samples = {}
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name", None) == MODEL, f"{s.name} {s.labels} lacks model_name={MODEL}"
            samples[(s.name, tuple(sorted(labels.items())))] = s.value
        families[family.name] = samples
    return families


def per_rank(families: dict, name: str) -> dict[int, float]:
    return {int(dict(labels)["rank"]): value for (_, labels), value in families[name].items()}


def histogram(families: dict, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """A histogram's cumulative buckets (bound, count) in bound order, its count and its sum."""
    samples = families[name]
    buckets = sorted((float(dict(labels)["le"]), v) for (sample, labels), v in samples.items()
                     if sample == f"{name}_bucket")
    return buckets, samples[(f"{name}_count", ())], samples[(f"{name}_sum", ())]


def test_metrics_endpoint(tiny_model):
    g = torch.Generator().manual_seed(5)
    stem = torch.randint(0, 1000, (48,), generator=g).tolist()
    prompts = [stem + torch.randint(0, 1000, (i + 1,), generator=g).tolist() for i in range(N)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LMPool(tiny_model, world_size=2, block_size=16, metrics_port=0, served_model_name=MODEL) as pool:
        port = pool.metrics_port
        outs = pool.generate(prompts, params)

        def counted_every_token():
            # Counters come from the state board, published a few times a second: wait
            # for the publish that includes the last token.
            families = scrape(port)
            done = sum(per_rank(families, "lmpool:generation_tokens").values()) == N * MAX_TOKENS
            return families if done else None

        families = wait_until(counted_every_token, "the generation counters to reach every token")
    with pytest.raises(urllib.error.URLError):  # the endpoint goes with the pool
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)

    ttft = families["lmpool:time_to_first_token_seconds"]
    assert ttft[("lmpool:time_to_first_token_seconds_count", ())] == N
    assert ttft[("lmpool:time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == N
    assert ttft[("lmpool:time_to_first_token_seconds_sum", ())] > 0
    itl = families["lmpool:inter_token_latency_seconds"]
    assert itl[("lmpool:inter_token_latency_seconds_count", ())] == N * (MAX_TOKENS - 1)
    buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in itl.items() if name.endswith("_bucket"))
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative

    ranks = {0, 1}
    by_rank = {r: [o for o in outs if o.rank == r] for r in ranks}
    assert per_rank(families, "lmpool:generation_tokens") == {r: len(by_rank[r]) * MAX_TOKENS for r in ranks}
    prompt_tokens = {r: sum(len(o.prompt_token_ids) for o in by_rank[r]) for r in ranks}
    assert per_rank(families, "lmpool:prompt_tokens") == prompt_tokens
    assert per_rank(families, "lmpool:prefix_cache_queries") == prompt_tokens
    hits = {r: sum(o.num_cached_tokens for o in by_rank[r]) for r in ranks}
    assert per_rank(families, "lmpool:prefix_cache_hits") == hits
    assert per_rank(families, "lmpool:num_requests_running") == {0: 0, 1: 0}
    assert per_rank(families, "lmpool:num_requests_waiting") == {0: 0, 1: 0}
    assert all(0 <= u <= 1 for u in per_rank(families, "lmpool:kv_cache_usage_perc").values())
    assert per_rank(families, "lmpool:rank_up") == {0: 1, 1: 1}
    assert families["lmpool:kv_transfers"] == {("lmpool:kv_transfers_total", ()): 0}
    assert families["lmpool:route_queries"] == {("lmpool:route_queries_total", ()): N}
    # A histogram, as Prometheus aggregates one: every decision counted, in cumulative buckets.
    buckets, count, total = histogram(families, "lmpool:route_latency_seconds")
    assert count == N and buckets[-1] == (float("inf"), N) and total > 0
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)


def test_completed_transfers_are_counted(tiny_model):
    prompt = torch.randint(0, 1000, (3 * 16 + 1,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with LMPool(tiny_model, world_size=2, block_size=16, metrics_port=0, enable_transfers=True,
                served_model_name=MODEL) as pool:
        [out] = pool.generate([prompt], params)
        copied = pool.transfer(prompt, src=out.rank, dst=1 - out.rank)
        assert copied.state == "done", copied.reason

        def counted_the_copy():
            families = scrape(pool.metrics_port)
            return families if families["lmpool:kv_transfers"][("lmpool:kv_transfers_total", ())] else None

        families = wait_until(counted_the_copy, "the transfer counter to count the copy")
    assert families["lmpool:kv_transfers"] == {("lmpool:kv_transfers_total", ()): 1}
    assert families["lmpool:kv_blocks_transferred"] == {("lmpool:kv_blocks_transferred_total", ()): 3}


def test_metrics_in_process_without_a_port(tiny_model):
    """``metrics=True``: the registry the server renders at its own /metrics, no port opened."""
    from prometheus_client import generate_latest

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LMPool(tiny_model, world_size=2, block_size=16, metrics=True, served_model_name=MODEL) as pool:
        assert pool.metrics_port is None
        pool.generate([[1, 2, 3, 4]], params)

        def counted_every_token():
            families = parse(generate_latest(pool.metrics_registry).decode())
            tokens = sum(per_rank(families, "lmpool:generation_tokens").values()) \
                if "lmpool:generation_tokens" in families else 0
            return families if tokens == MAX_TOKENS else None

        families = wait_until(counted_every_token, "the generation counters to reach every token")
    assert histogram(families, "lmpool:time_to_first_token_seconds")[1] == 1
    assert histogram(families, "lmpool:route_latency_seconds")[1] == 1


def test_metrics_are_off_by_default_and_need_no_prometheus_client():
    check = (
        "import sys; import lmpool.frontend.api, lmpool.frontend.client, lmpool.frontend.metrics; "
        "assert 'prometheus_client' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_taken_port_fails_the_start_and_leaves_nothing(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            LMPool(tiny_model, world_size=2, block_size=16, metrics_port=taken.getsockname()[1])
