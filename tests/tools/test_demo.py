"""``lmpool demo``, the README's first command: on a machine with nothing cached it generates
the tiny model, serves two rounds of prompts from two CPU replicas, and prints a summary in
which each replica served the prompts of one instruction, the second round from its cache."""

from __future__ import annotations

import os
import re
import subprocess

from tools_testkit import LMPOOL

ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+%|-)\s+(\d+)$")


def test_demo_serves_each_instruction_from_its_own_replica(tmp_path):
    env = {**os.environ, "LMPOOL_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([LMPOOL, "demo", "--device", "cpu", "--max-tokens", "4"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "cache" / "models" / "tiny-seed0" / "config.json").is_file()
    rows = {int(m[1]): [int(m[i]) for i in (2, 3, 4)] for m in map(ROW.match, run.stdout.splitlines()) if m}
    assert set(rows) == {0, 1}, run.stdout
    for requests, prompt_tokens, cached in rows.values():
        # Three prompts of one instruction, twice: all but the first hit the instruction's
        # blocks, and the second round hits whole prompts.
        assert requests == 6 and 0 < cached < prompt_tokens, run.stdout
    assert "12 requests on 2 ranks" in run.stdout
