"""A pool in its own process, for tests that kill its owner: ``python pool_owner.py MODEL``.

Starts a 2-rank CPU pool, serves a few requests, prints one JSON line (the pool id and
the pids of its worker and control processes), then waits for stdin to close (the test
SIGKILLs it first)."""

import json
import sys

from lmpool import LMPool, SamplingParams

if __name__ == "__main__":
    with LMPool(sys.argv[1], world_size=2, block_size=16, routing="round_robin") as pool:
        pool.generate([[i, 7, 8, 9] * 8 for i in range(4)], SamplingParams(temperature=0, max_tokens=4))
        print(json.dumps({"pool_id": pool.pool_id, "pids": pool.client.pids()}), flush=True)
        sys.stdin.read()
