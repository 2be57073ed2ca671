"""A private CUDA MPS control daemon for replicas that share one GPU.

Without MPS, processes on one GPU time-slice it; with MPS their kernels run side by
side, and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` caps each client at its share of the SMs,
so N replicas on one GPU each get 1/N of it, like N smaller GPUs. A daemon started with
``CUDA_VISIBLE_DEVICES`` serves only those GPUs and its clients see them numbered from 0,
so inside the block the variable is renumbered (``0,1,...``) and restored afterwards.
The daemon's pipe and log directories are a fresh temporary directory, so it never meets
another user's daemon; the variables are set in this process's environment, which the
pool's worker processes inherit. On exit the environment is restored and the daemon is
stopped.

Stopping is bounded and never raises (the caller writes its results after the block).
``quit`` is synchronous: the control front-end returns only when the daemon has exited,
and the daemon first waits for its servers, which wait for every client to disconnect.
Any process that initialised CUDA while the daemon ran is a client until it exits; the
caller itself becomes one if it touches CUDA inside the block (``torch.cuda.is_available()``
initialises the driver), and then a plain ``quit`` waits for the very process that sent
it. So: the servers and their clients are listed first (recorded, so a run shows who held
the daemon), ``quit`` is sent without waiting on the front-end's output, the daemon and
its servers get ``quit_timeout_s`` to exit, and whatever is left gets SIGTERM, then
SIGKILL. Only this daemon's processes are signalled: its pid comes from the pid file in
its private pipe directory, its servers' from its own ``get_server_list``. The outcome is
added to the yielded dict under ``shutdown``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_VARS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
PID_FILE = "nvidia-cuda-mps-control.pid"  # written by the daemon into its pipe directory
START_TIMEOUT_S = 30.0
QUERY_TIMEOUT_S = 5.0  # one front-end command that only reads (server or client list)
QUIT_TIMEOUT_S = 10.0  # the daemon's time to exit by itself after ``quit``
SIGNAL_WAIT_S = 5.0  # after SIGTERM, then after SIGKILL
_POLL_S = 0.05


@contextmanager
def mps_share(clients: int) -> Iterator[dict | None]:
    """With ``clients`` > 0, ``mps_daemon(clients)`` for the block, so that CUDA started in it
    runs as one of that many clients (a diagnostic timing one replica's share); else nothing.
    The CUDA driver must not start before the block, not even by ``torch.cuda.is_available()``:
    it reads the daemon's settings once, when it starts (the record's ``shutdown`` says whether
    this process was a client)."""
    if not clients:
        yield None
        return
    with mps_daemon(clients) as mps:
        yield mps


@contextmanager
def mps_daemon(replicas_per_gpu: int, quit_timeout_s: float | None = None) -> Iterator[dict]:
    """Run an MPS control daemon for the duration of the block; yields what was set up.

    A daemon that cannot start is reported in the yielded dict (``enabled: False`` and
    ``error``) and the block runs without MPS: the caller records it rather than losing
    a whole GPU session to it. When the block ends the dict gains ``shutdown``
    (``stop_daemon``'s record). ``quit_timeout_s`` defaults to ``QUIT_TIMEOUT_S``."""
    if quit_timeout_s is None:
        quit_timeout_s = QUIT_TIMEOUT_S
    if replicas_per_gpu < 1:
        raise ValueError(f"replicas_per_gpu must be >= 1, got {replicas_per_gpu}")
    if not quit_timeout_s >= 0:
        raise ValueError(f"quit_timeout_s must be >= 0, got {quit_timeout_s}")
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
    try:
        started = subprocess.run([control, "-d"], env=daemon_env, capture_output=True, text=True,
                                 timeout=START_TIMEOUT_S)
        error = None if started.returncode == 0 else (
            f"nvidia-cuda-mps-control -d exited {started.returncode}: {(started.stderr or started.stdout).strip()}")
    except (OSError, subprocess.TimeoutExpired) as e:
        error = f"nvidia-cuda-mps-control -d failed: {type(e).__name__}: {e}"
    if error is not None:
        # A daemon that half started (its pid file exists) is stopped all the same.
        stop_daemon(control, daemon_env, settings["CUDA_MPS_PIPE_DIRECTORY"], 0.0)
        shutil.rmtree(root, ignore_errors=True)
        yield {"enabled": False, "error": error}
        return
    os.environ.update(settings)
    info = {"enabled": True, "active_thread_percentage": int(settings["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]),
            "replicas_per_gpu": replicas_per_gpu}
    pinned = os.environ.get("CUDA_VISIBLE_DEVICES")
    if pinned:
        # The daemon serves only these GPUs, and its clients number them from 0: a client
        # that kept CUDA_VISIBLE_DEVICES=1 would ask for a second GPU the server lacks.
        saved["CUDA_VISIBLE_DEVICES"] = pinned
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i, d in enumerate(pinned.split(",")) if d.strip())
        info["daemon_visible_devices"] = pinned
    try:
        yield info
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        info["shutdown"] = record = stop_daemon(control, daemon_env, settings["CUDA_MPS_PIPE_DIRECTORY"],
                                                quit_timeout_s)
        if record["outcome"] != "quit":
            print(f"warning: MPS daemon shutdown ({quit_timeout_s:g} s allowed for quit): {record}", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)


def stop_daemon(control: str, env: dict[str, str], pipe_dir: str, quit_timeout_s: float) -> dict:
    """Stop the daemon whose pipe directory is ``pipe_dir`` (module docstring); never raises.

    Returns ``outcome`` ("quit": it exited by itself; "signalled": it or a server needed a
    signal; "gone": no daemon was found; "error"), ``quit_s`` (time to exit after ``quit``,
    or None), ``daemon``, ``servers``, ``clients`` (pids connected when ``quit`` was sent),
    ``own_process_was_client``, ``signals`` (pid -> the last signal it needed; "survived"
    if even SIGKILL left it) and ``error``."""
    record: dict = {"outcome": "error", "quit_s": None, "daemon": None, "servers": [], "clients": [],
                    "own_process_was_client": False, "signals": {}, "error": None}
    front = None
    try:
        record["daemon"] = daemon = _read_pid(Path(pipe_dir) / PID_FILE)
        if daemon is None or not _alive(daemon):
            record["outcome"] = "gone"
            return record
        record["servers"] = servers = _ask_pids(control, env, "get_server_list")
        clients = sorted({c for s in servers for c in _ask_pids(control, env, f"get_client_list {s}")})
        record["clients"] = clients
        record["own_process_was_client"] = os.getpid() in clients
        # Nothing reads the front-end's output, so it can never block on a full pipe; it
        # stays in this process's group, so a Ctrl-C reaches it too.
        front = subprocess.Popen([control], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, env=env, text=True)
        t = time.monotonic()
        try:
            front.stdin.write("quit\n")
            front.stdin.close()
        except OSError:
            pass  # the front-end already exited (it found no daemon): the checks below tell
        ours = [daemon, *servers]
        if _wait_gone(ours, t + quit_timeout_s):
            record["quit_s"] = time.monotonic() - t
            record["outcome"] = "quit"
        else:
            record["signals"] = _terminate(ours)
            record["outcome"] = "signalled"
    except Exception as e:  # noqa: BLE001 - the caller's results must still be written
        record["error"] = f"{type(e).__name__}: {e}"
        record["outcome"] = "error"
        # Still stop what is known to be this daemon's, so no process outlives the suite.
        known = [p for p in (record["daemon"], *record["servers"]) if p is not None]
        try:
            record["signals"] = _terminate(known)
        except Exception as again:  # noqa: BLE001
            record["error"] += f"; stopping it: {type(again).__name__}: {again}"
    finally:
        if front is not None and front.poll() is None:
            front.kill()
            front.wait()
    return record


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _ask_pids(control: str, env: dict[str, str], command: str) -> list[int]:
    """The pids a read-only front-end command prints, one per line; [] when it fails."""
    try:
        done = subprocess.run([control], input=command + "\n", env=env, capture_output=True, text=True,
                              timeout=QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(tok) for tok in done.stdout.split() if tok.isdigit()]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc here: the kill probe is all there is
    # The state letter follows the command name, which is in parentheses and may hold spaces.
    return stat[stat.rindex(")") + 2:][:1] not in ("Z", "X")


def _wait_gone(pids: list[int], deadline: float) -> bool:
    while any(_alive(p) for p in pids):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _terminate(pids: list[int]) -> dict[str, str]:
    """SIGTERM every live pid, SIGKILL what is left after ``SIGNAL_WAIT_S``; the last signal each needed."""
    sent: dict[str, str] = {}
    for sig, name in ((signal.SIGTERM, "SIGTERM"), (signal.SIGKILL, "SIGKILL")):
        live = [p for p in pids if _alive(p)]
        for p in live:
            try:
                os.kill(p, sig)
                sent[str(p)] = name
            except ProcessLookupError:
                pass
            except PermissionError:
                sent[str(p)] = "not permitted"
        if _wait_gone(live, time.monotonic() + SIGNAL_WAIT_S):
            return sent
    for p in pids:
        if _alive(p):
            sent[str(p)] = "survived"
    return sent
