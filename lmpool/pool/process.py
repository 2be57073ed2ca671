"""Starting LMPool's child processes, and keeping them from outliving their parent.

A child is ``python -m <module> <spec>``, where the spec is a msgspec JSON
document (no pickle: a spec only ever carries names and numbers). Children ask
the kernel to SIGKILL them when their parent dies (Linux ``PR_SET_PDEATHSIG``),
and also notice a dead parent through their channels, so no process is
orphaned whatever way the user process ends.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Any

import msgspec

PR_SET_PDEATHSIG = 1


def spawn(module: str, spec: Any) -> subprocess.Popen:
    """Start ``python -m module`` with ``spec`` as its only argument."""
    env = dict(os.environ)
    # One torch thread per child: several replicas share few cores, and OpenMP workers
    # spinning against each other cost far more than they compute.
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.Popen(
        [sys.executable, "-m", module, msgspec.json.encode(spec).decode()],
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a terminal's Ctrl-C reaches the user process, which shuts us down
    )


def read_spec(spec_type: type) -> Any:
    """In a child: decode the spec from argv and tie the child's life to its parent's."""
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python -m {sys.argv[0]} SPEC_JSON")
    die_with_parent()
    return msgspec.json.decode(sys.argv[1], type=spec_type)


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def stop(proc: subprocess.Popen, timeout: float) -> int:
    """Wait up to ``timeout`` seconds for ``proc`` to exit, then kill it; return its exit code."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
