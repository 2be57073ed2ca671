"""``benchmarks/benchmark_kv_transfer.py`` runs on CPU replicas and writes a profile the
transfer cost model accepts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lmpool.transfer.cost_model import TransferCostModel

ROOT = Path(__file__).resolve().parents[2]


def test_profile_is_written_checked_and_readable_by_the_cost_model(tmp_path):
    out = tmp_path / "profile.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "benchmark_kv_transfer.py"), "--kind", "gloo",
         "--block-size", "16", "--sizes", "1,4", "--reps", "3", "--warmup", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    profile = json.loads(out.read_text())
    per_block = 4 * 2 * 16 * 2 * 64 * 4  # tiny preset, float32
    assert profile["kind"] == "gloo"
    assert profile["model"] == {"preset": "tiny", "layers": 4, "kv_heads": 2, "head_dim": 64, "block_size": 16,
                                "dtype": "float32", "kv_bytes_per_block": per_block}
    for table in ("pairs", "raw"):
        assert set(profile[table]) == {"0->1", "1->0"}
        for points in profile[table].values():
            assert set(points) == {"1", "4"}
            for n, point in points.items():
                assert 0 < point["p50_s"] <= point["p95_s"] < 10
                assert point["bytes"] == int(n) * per_block
    assert all(p["bytes_equal"] for points in profile["pairs"].values() for p in points.values())
    model = TransferCostModel.from_profile(out, kv_bytes_per_block=per_block)
    curve = profile["pairs"]["0->1"]
    assert model.data_path_p95(0, 1, 4) == max(curve["1"]["p95_s"], curve["4"]["p95_s"])  # made monotonic
