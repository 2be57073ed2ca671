"""``benchmarks/benchmark_kv_transfer.py`` runs on CPU replicas and writes a profile the
transfer cost model accepts; its GPU modes' arithmetic (bandwidth, fractions of copy
bandwidth, NCCL ratios, pool residuals) is checked on synthetic measurements."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import benchmark_kv_transfer as bench
from benchmarks.transfer import kv_transfer_pool
from lmpool.control.transfers.cost_model import TransferCostModel

ROOT = Path(__file__).resolve().parents[2]
# Run as a module from the repository root, as a user runs it.
RUN = [sys.executable, "-m", "benchmarks.benchmark_kv_transfer"]


def test_profile_is_written_checked_and_readable_by_the_cost_model(tmp_path):
    out = tmp_path / "profile.json"
    run = subprocess.run(
        [*RUN, "--kind", "gloo",
         "--block-size", "16", "--sizes", "1,4", "--reps", "3", "--warmup", "1", "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    profile = json.loads(out.read_text())
    per_block = 4 * 2 * 16 * 2 * 64 * 4  # tiny preset, float32
    assert profile["kind"] == "gloo" and profile["pairs_path"] == "pack"
    assert profile["environment"]["git"]["revision"], "the revision that ran is recorded"
    assert profile["model"] == {"preset": "tiny", "layers": 4, "kv_heads": 2, "head_dim": 64, "block_size": 16,
                                "dtype": "float32", "kv_bytes_per_block": per_block}
    assert set(profile["paths"]) == {"pack", "raw"}
    assert profile["pairs"] == profile["paths"]["pack"] and profile["raw"] == profile["paths"]["raw"]
    assert set(profile["copy_seconds"]) == {"1", "4"}
    assert set(profile["kernel_seconds"]) == {"1", "4"}  # the kernels alone, capped and not
    # Durations are checked positive and finite, never bounded: a loaded machine may take its time.
    assert all(set(k) == {"pack_capped", "pack_uncapped", "unpack_capped", "unpack_uncapped"}
               and all(0 < s < math.inf for s in k.values()) for k in profile["kernel_seconds"].values())
    for table in ("pairs", "raw"):
        assert set(profile[table]) == {"0->1", "1->0"}
        for points in profile[table].values():
            assert set(points) == {"1", "4"}
            for n, point in points.items():
                assert 0 < point["p50_s"] <= point["p95_s"] < math.inf
                assert point["bytes"] == int(n) * per_block
                assert point["bytes_equal"]
                assert point["copy_fraction_p50"] == round(profile["copy_seconds"][n] / point["p50_s"], 4)
    model = TransferCostModel.from_profile(out, kv_bytes_per_block=per_block)
    curve = profile["pairs"]["0->1"]
    assert model.data_path_p95(0, 1, 4) == max(curve["1"]["p95_s"], curve["4"]["p95_s"])  # made monotonic


def test_the_packed_paths_halves_move_the_same_bytes(tmp_path):
    """``--split``: packing at one end only (the other bare) still lands every byte where the
    full packed path would: the receiver's blocks or ready buffer match the sender's. So does
    a variant whose packs keep their payload (``~keep``, a hint to the sender's kernel), with
    each worker pinned to CPUs of its own (``--cpus``)."""
    out = tmp_path / "split.json"
    cpus = sorted(os.sched_getaffinity(0))
    pinned = f"{cpus[0]}/{cpus[-1]}"
    run = subprocess.run(
        [*RUN, "--kind", "gloo", "--split", "--block-size", "16", "--sizes", "3",
         "--reps", "2", "--warmup", "1", "--pack-variants", "auto~keep", "--cpus", pinned, "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["environment"]["worker_cpus"] == [[cpus[0]], [cpus[-1]]]
    paths = result["paths"]
    assert set(paths) == {"pack", "pack@auto~keep", "raw", "only-pack", "only-unpack"}
    assert all(paths[p][pair]["3"]["bytes_equal"] for p in paths for pair in ("0->1", "1->0"))
    refused = subprocess.run([*RUN, "--kind", "pool", "--split"], capture_output=True,
                             text=True, cwd=ROOT, timeout=60)
    assert refused.returncode == 2 and "--kind pool has none" in refused.stderr


def test_cpu_sets_parse_ranges_and_lists_and_refuse_anything_but_two():
    assert bench.cpu_sets("0-3/16,18") == [{0, 1, 2, 3}, {16, 18}]
    assert bench.cpu_sets("5/5") == [{5}, {5}]
    for bad in ("0-3", "0/1/2", "0/", "a/1"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            bench.cpu_sets(bad)


def synthetic(paths: dict[str, float], check_differs: str = "") -> list[dict]:
    """Two workers' results for one size (2 blocks), each path taking the given seconds."""
    results = [{"starts": {}, "ends": {}, "checks": {}, "paths": list(paths)} for _ in (0, 1)]
    for path, seconds in paths.items():
        for src in (0, 1):
            key = f"{path}/{src}->{1 - src}/2"
            starter = 1 - src if path == "pull" else src  # a pull is timed at its destination
            results[starter]["starts"][key] = [10.0, 20.0, 30.0]
            results[1 - src]["ends"][key] = [10.0 + seconds, 20.0 + seconds, 30.0 + 2 * seconds]
            results[src]["checks"][key] = 7
            results[1 - src]["checks"][key] = 8 if key == check_differs else 7
    results[0]["copy_s"] = {"2": 0.001}
    return results


def test_nccl_summary_ratios_and_bandwidth():
    args = bench.parse_args(["--kind", "nccl", "--preset", "tiny", "--sizes", "2", "--reps", "3"])
    profile, wrong = bench.summarize(args, synthetic({"pull": 0.002, "pack": 0.004, "raw": 0.003}))
    assert wrong == []
    assert profile["pairs_path"] == "pull" and profile["pairs"] == profile["paths"]["pull"]
    point = profile["paths"]["pack"]["0->1"]["2"]
    assert point["p50_s"] == pytest.approx(0.004) and point["p95_s"] == pytest.approx(0.008)
    assert point["GBps_p50"] == round(2 * bench.shape(args)["kv_bytes_per_block"] / 0.004 / 1e9, 3)
    assert point["copy_fraction_p50"] == 0.25  # a 1 ms copy against a 4 ms transfer
    assert profile["nccl_ratios"]["1->0"]["2"] == {"packed_over_raw": 0.75, "pull_over_raw": 1.5}
    # Every repetition's ratio is 0.75 here (synthetic latencies scale alike), so is every resample's.
    assert profile["nccl_ratio_ci95"]["1->0"]["2"]["packed_over_raw"] == [0.75, 0.75]
    bench.report(profile)


def test_the_ratio_interval_resamples_repetitions_in_pairs():
    """Raw and packed move together from repetition to repetition (a slow repetition is slow
    for both): resampled in pairs the ratio stays put; an interval holds the point estimate."""
    raw = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    packed = [x / 0.8 for x in raw]
    assert bench.ratio_interval(raw, packed) == [0.8, 0.8]
    noisy = [x * (1 + 0.05 * ((-1) ** i)) for i, x in enumerate(packed)]
    lo, hi = bench.ratio_interval(raw, noisy)
    ratio = sorted(raw)[4] / sorted(noisy)[4]
    assert lo <= ratio <= hi and lo < hi
    assert bench.ratio_interval(raw, packed) == bench.ratio_interval(raw, packed)  # seeded


def test_pack_variants_parse_and_get_their_own_ratio():
    assert bench.pack_variant("pack") == {}
    assert bench.pack_variant("pack@4") == {"shape": "even", "chunks": 4, "max_ctas": None}
    assert bench.pack_variant("pack@4:0") == {"shape": "even", "chunks": 4, "max_ctas": 0}
    assert bench.pack_variant("pack@t3:0") == {"shape": "taper", "chunks": 3, "max_ctas": 0}
    assert bench.pack_variant("pack@even:132") == {"shape": "even", "max_ctas": 132}
    assert bench.pack_variant("pack@taper") == {"shape": "taper", "max_ctas": None}
    assert bench.pack_variant("pack@taper^2") == {"shape": "taper^2", "max_ctas": None}
    assert bench.pack_variant("pack@t8^1.5:132+0") == {"shape": "taper^1.5", "chunks": 8, "max_ctas": 132,
                                                        "edge_ctas": 0}
    assert bench.pack_variant("pack@even^1") == {"shape": "even^1", "max_ctas": None}
    assert bench.pack_variant("pack@8^1.25") == {"shape": "even^1.25", "chunks": 8, "max_ctas": None}
    assert bench.pack_variant("pack@ends^2:132") == {"shape": "ends^2", "max_ctas": 132}
    assert bench.pack_variant("pack@auto:132") == {"max_ctas": 132}
    assert bench.pack_variant("pack@auto/2") == {"max_ctas": None, "lanes": 2}
    assert bench.pack_variant("pack@8:0/3") == {"shape": "even", "chunks": 8, "max_ctas": 0, "lanes": 3}
    assert bench.pack_variant("pack@auto:32+0") == {"max_ctas": 32, "edge_ctas": 0}
    assert bench.pack_variant("pack@auto~keep") == {"max_ctas": None, "keep_payload": True}
    assert bench.pack_variant("pack@8:0/3~keep") == {"shape": "even", "chunks": 8, "max_ctas": 0, "lanes": 3,
                                                     "keep_payload": True}
    for bad in ("0", "x", "t0", "t", "2:-1", "2:y", "auto/0", "auto/x", "4:132/", "auto:32+", "auto:32+-1",
                "auto^2", "t8^", "t8^0.5", "taper^x", "8^x", "ends", "ends^0", "auto-g", "~keep", "auto~kep",
                "auto~keep/2"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--kind", "nccl", "--pack-variants", bad])
    with pytest.raises(SystemExit):  # lanes are the NCCL transport's
        bench.parse_args(["--kind", "gloo", "--pack-variants", "auto/2"])
    args = bench.parse_args(["--kind", "nccl", "--preset", "tiny", "--sizes", "2", "--reps", "3",
                             "--pack-variants", "4:132,auto/2"])
    profile, wrong = bench.summarize(args, synthetic({"pack": 0.004, "pack@4:132": 0.002, "pack@auto/2": 0.003,
                                                      "raw": 0.003}))
    assert wrong == [] and profile["pairs_path"] == "pack"
    assert profile["nccl_ratios"]["0->1"]["2"] == {"packed_over_raw": 0.75, "pack@4:132_over_raw": 1.5,
                                                   "pack@auto/2_over_raw": 1.0}


def test_summary_flags_bytes_that_differ_and_picks_pack_without_peer_access():
    args = bench.parse_args(["--kind", "nccl", "--preset", "tiny", "--sizes", "2", "--reps", "3"])
    profile, wrong = bench.summarize(args, synthetic({"pack": 0.004, "raw": 0.003},
                                                     check_differs="pack/1->0/2"))
    assert wrong == ["pack/1->0/2"] and not profile["paths"]["pack"]["1->0"]["2"]["bytes_equal"]
    assert profile["pairs_path"] == "pack" and "pull_over_raw" not in profile["nccl_ratios"]["0->1"]["2"]


def test_pool_residuals_are_what_the_pool_adds_to_the_data_path():
    pool = {"0->1": {"1": {"p95_s": 0.0015}, "4": {"p95_s": 0.001}}, "1->0": {"1": {"p95_s": 0.002}}}
    pairs = {"0->1": {"1": {"p95_s": 0.0005}, "4": {"p95_s": 0.0012}}}
    assert kv_transfer_pool.residuals(pool, pairs) == {"0->1": {"1": pytest.approx(0.001), "4": 0.0}, "1->0": {}}


@pytest.mark.parametrize("kind", ["nccl", "pool"])
def test_gpu_modes_refuse_a_machine_without_the_gpus(kind):
    import torch

    if torch.cuda.device_count() >= (2 if kind == "nccl" else 1):
        pytest.skip("this machine has the GPUs")
    run = subprocess.run([*RUN, "--kind", kind], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2 and "needs" in run.stderr, run.stderr


def test_pool_mode_on_cpu_replicas_times_byte_equal_moves(tmp_path):
    out = tmp_path / "pool.json"
    run = subprocess.run([*RUN, "--kind", "pool", "--device", "cpu", "--preset", "tiny",
                          "--block-size", "16", "--sizes", "1,2", "--reps", "3", "--warmup", "1", "--json", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    pool, plan = result["pool"], result["pool_plan"]
    assert set(pool) == set(plan) == {"0->1", "1->0"}
    for pair, points in pool.items():
        assert set(points) == set(plan[pair]) == {"1", "2"}
        assert all(p["bytes_equal"] and 0 < p["p50_s"] <= p["p95_s"] for p in points.values())
        # prepare -> finalize lies inside the request's span
        assert all(0 < plan[pair][n]["p50_s"] < p["p50_s"] for n, p in points.items())


def test_paths_are_shuffled_alike_on_both_ends_and_follow_varying_neighbours():
    """Both workers compute one order per repetition, and no path is always preceded by the
    same one (a rotation kept ``pack`` behind ``pull`` in every repetition)."""
    paths = ["pull", "pack", "pack@auto:132", "raw", "send", "chunks"]
    orders = [bench.path_order(paths, 0, 8, rep) for rep in range(40)]
    assert orders == [bench.path_order(list(paths), 0, 8, rep) for rep in range(40)]
    assert all(sorted(order) == sorted(paths) for order in orders)
    before_pack = {order[order.index("pack") - 1] for order in orders if order.index("pack") > 0}
    assert len(before_pack) > 2


def test_sizes_are_shuffled_alike_on_both_ends_and_each_runs_first_in_some_repetition():
    """A slow spell early in a run then falls on every size, not on the sizes listed first."""
    sizes = [2, 4, 8, 16, 32]
    orders = [bench.size_order(sizes, 1, rep) for rep in range(-1, 40)]
    assert orders == [bench.size_order(list(sizes), 1, rep) for rep in range(-1, 40)]
    assert all(sorted(order) == sizes for order in orders)
    assert {order[0] for order in orders} == set(sizes)


def test_gpu_state_reads_one_line_per_gpu_and_is_none_without_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert bench.gpu_state() is None
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '0, 1980 MHz, 1980 MHz, 3201 MHz, 120.5 W, 700.0 W, 41, 0x0'\n"
                    "echo '1, 1500 MHz, 1980 MHz, 3201 MHz, 650.0 W, 700.0 W, 78, 0x4'\n\n")
    fake.chmod(0o755)
    assert bench.gpu_state() == ["0, 1980 MHz, 1980 MHz, 3201 MHz, 120.5 W, 700.0 W, 41, 0x0",
                                 "1, 1500 MHz, 1980 MHz, 3201 MHz, 650.0 W, 700.0 W, 78, 0x4"]
