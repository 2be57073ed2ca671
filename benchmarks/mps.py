"""A private CUDA MPS control daemon for replicas that share one GPU.

Without MPS, processes on one GPU time-slice it; with MPS their kernels run side by
side, and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` caps each client at its share of the SMs,
so N replicas on one GPU each get 1/N of it, like N smaller GPUs. The daemon's pipe and
log directories are a fresh temporary directory, so it never meets another user's
daemon; the variables are set in this process's environment, which the pool's worker
processes inherit. The daemon is told to quit, and the environment restored, on exit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

_VARS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


@contextmanager
def mps_daemon(replicas_per_gpu: int) -> Iterator[dict]:
    """Run an MPS control daemon for the duration of the block; yields what was set up.

    A daemon that cannot start is reported in the yielded dict (``enabled: False`` and
    ``error``) and the block runs without MPS: the caller records it rather than losing
    a whole GPU session to it."""
    if replicas_per_gpu < 1:
        raise ValueError(f"replicas_per_gpu must be >= 1, got {replicas_per_gpu}")
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        yield {"enabled": False, "error": "nvidia-cuda-mps-control is not on PATH"}
        return
    root = tempfile.mkdtemp(prefix="lmpool-mps-")
    settings = {
        "CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log"),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, 100 // replicas_per_gpu)),
    }
    os.makedirs(settings["CUDA_MPS_PIPE_DIRECTORY"])
    os.makedirs(settings["CUDA_MPS_LOG_DIRECTORY"])
    saved = {k: os.environ.get(k) for k in _VARS}
    daemon_env = {**os.environ, **settings}
    started = subprocess.run([control, "-d"], env=daemon_env, capture_output=True, text=True)
    if started.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        yield {"enabled": False, "error": f"nvidia-cuda-mps-control -d exited {started.returncode}: "
                                          f"{(started.stderr or started.stdout).strip()}"}
        return
    os.environ.update(settings)
    try:
        yield {"enabled": True, "active_thread_percentage": int(settings["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]),
               "replicas_per_gpu": replicas_per_gpu}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        subprocess.run([control], input="quit\n", env=daemon_env, capture_output=True, text=True, timeout=30)
        shutil.rmtree(root, ignore_errors=True)
