"""Starting LMPool's child processes, and keeping them from outliving their parent.

A child is ``python -m <module>``, its spec a msgspec JSON document (no pickle: a
spec only ever carries names and numbers) in its environment, ``LMPOOL_SPEC``: a spec holds
the transfer rendezvous's secret key, and a command line is readable by every user, an
environment only by the process's own. Children tie their life to ours when they read their
spec (``lmpool.protocol.spec.read_spec``) and also notice a dead parent through their
channels, so no process is orphaned whatever way the user process ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import msgspec

from lmpool.protocol.spec import SPEC_VARIABLE


def spawn(module: str, spec: Any) -> subprocess.Popen:
    """Start ``python -m module`` with ``spec`` in its environment."""
    env = dict(os.environ)
    env[SPEC_VARIABLE] = msgspec.json.encode(spec).decode()
    # One torch thread per child: several replicas share few cores, and OpenMP workers
    # spinning against each other cost far more than they compute.
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.Popen(
        [sys.executable, "-m", module],
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a terminal's Ctrl-C reaches the user process, which shuts us down
    )


def stop(proc: subprocess.Popen, timeout: float) -> int:
    """Wait up to ``timeout`` seconds for ``proc`` to exit, then kill it; return its exit code."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
