"""The host-overhead benchmark runs both paths (serial and overlapped stepping) on identical
engines and writes its JSON (figures are not asserted; the benchmark itself checks both paths
chose the same tokens)."""

from __future__ import annotations

import json


from benchmarks import benchmark_host_overhead


def test_host_overhead_benchmark_writes_json(tmp_path):
    out = tmp_path / "host.json"
    benchmark_host_overhead.main([
        "--batches", "3,1", "--min-context", "20", "--max-context", "70", "--block-size", "16",
        "--steps", "3", "--repeats", "2", "--warmup", "1", "--json", str(out),
    ])
    data = json.loads(out.read_text())
    assert [r["batch"] for r in data["results"]] == [3, 1]
    for r in data["results"]:
        for path in ("serial", "overlapped"):
            assert set(r[path]["phases_us"]) == set(benchmark_host_overhead.PHASES)
            assert r[path]["total_us"] > 0 and len(r[path]["repeats_total_us"]) == 2
        assert r["serial_over_overlapped"] > 0


def test_burst_mode_times_admission_and_launch_of_questions_over_a_cached_document(tmp_path):
    out = tmp_path / "burst.json"
    benchmark_host_overhead.main(["--batches", "", "--bursts", "3:40", "--block-size", "16", "--repeats", "2",
                                  "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["results"] == []
    (burst,) = data["bursts"]
    assert (burst["questions"], burst["document"]) == (3, 40)
    assert len(burst["repeats_admit_ms"]) == len(burst["repeats_launch_ms"]) == 2
    assert burst["admit_ms"] > 0 and burst["launch_ms"] > 0
