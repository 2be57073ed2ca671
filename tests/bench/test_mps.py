"""The MPS daemon's start and bounded stop (``benchmarks/device/mps.py``), against a stand-in control binary.

The stand-in ``nvidia-cuda-mps-control`` behaves like the real one where the shutdown
depends on it: ``-d`` leaves a daemon and a server process behind and writes the pid
file into the pipe directory; the front-end answers ``get_server_list`` and
``get_client_list`` and, on ``quit``, either stops both and returns (a clean quit) or
blocks, as the real one does while a client is still connected. ``FAKE_MPS`` picks the
behaviour; every process the stand-in starts logs its pid under ``FAKE_MPS_LOG``, so each
test can check that none outlives the block, and the fixture ends any that do.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks.device import mps
from benchmarks.device.mps import mps_daemon, mps_share

FAKE = r'''#!{python}
import os, signal, subprocess, sys, time
from pathlib import Path

mode = os.environ.get("FAKE_MPS", "clean")
log = Path(os.environ["FAKE_MPS_LOG"])
pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
LIFETIME_S = 300  # a stand-in process never outlives a broken test by long


def note(name, text):
    with open(log / name, "a") as f:
        f.write(text + "\n")


def alive(pid):
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{{pid}}/stat").read_text()
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return stat[stat.rindex(")") + 2:][:1] not in ("Z", "X")


def pids():
    return [int((pipe / n).read_text()) for n in ("nvidia-cuda-mps-control.pid", "server.pid")]


args = sys.argv[1:]
if args == ["--serve"]:  # the daemon or its server
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(LIFETIME_S)
elif args == ["-d"]:
    if mode == "fail_start":
        print("cannot start: no GPU here", file=sys.stderr)
        sys.exit(1)
    procs = [subprocess.Popen([sys.executable, __file__, "--serve"], start_new_session=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(2)]
    for p in procs:
        note("pids", str(p.pid))
    if mode != "no_pid_file":
        (pipe / "nvidia-cuda-mps-control.pid").write_text(str(procs[0].pid))
    (pipe / "server.pid").write_text(str(procs[1].pid))
elif not args:  # the front-end: one command a line until EOF
    note("pids", str(os.getpid()))
    for line in sys.stdin:
        command = line.split()
        note("commands", line.strip())
        if command == ["get_server_list"]:
            print(pids()[1], flush=True)
        elif command[:1] == ["get_client_list"]:
            if mode in ("hang", "stubborn"):
                print(os.getppid(), flush=True)  # the process that runs the suite is a client
        elif command == ["quit"]:
            if mode in ("hang", "stubborn"):
                time.sleep(LIFETIME_S)  # waits for clients that never leave
            for pid in pids():
                os.kill(pid, signal.SIGTERM)
            while any(alive(pid) for pid in pids()):
                time.sleep(0.01)
            sys.exit(0)
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Put the stand-in first on PATH; yields its log directory; ends leftovers by pid."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    script = bin_dir / "nvidia-cuda-mps-control"
    script.write_text(FAKE.format(python=sys.executable))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    for var in mps._VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(mps, "SIGNAL_WAIT_S", 30.0)
    yield log
    for pid in started(log):
        if mps._alive(pid):
            os.kill(pid, signal.SIGKILL)


def started(log: Path) -> list[int]:
    path = log / "pids"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def commands(log: Path) -> list[str]:
    path = log / "commands"
    return path.read_text().splitlines() if path.exists() else []


def assert_all_stopped(log: Path, tmp_root: Path) -> None:
    assert started(log), "the stand-in started nothing"
    assert [p for p in started(log) if mps._alive(p)] == []
    assert list(tmp_root.iterdir()) == []  # the private pipe and log directories are gone
    assert not any(v in os.environ for v in mps._VARS)


def test_a_share_of_one_in_n_runs_the_daemon_and_none_runs_nothing(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS", "clean")
    with mps_share(0) as info:
        assert info is None and not any(v in os.environ for v in mps._VARS)
    assert started(fake) == []
    with mps_share(4) as info:
        assert info["enabled"] and os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert_all_stopped(fake, tmp_path / "tmp")


def test_clean_quit_sets_and_restores_the_environment(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS", "clean")
    with mps_daemon(4) as info:
        assert info == {"enabled": True, "active_thread_percentage": 25, "replicas_per_gpu": 4}
        assert Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"]).is_dir()
        assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        daemon, server = started(fake)
    shutdown = info["shutdown"]
    assert shutdown["outcome"] == "quit" and shutdown["error"] is None
    assert (shutdown["daemon"], shutdown["servers"], shutdown["clients"]) == (daemon, [server], [])
    assert shutdown["signals"] == {} and shutdown["quit_s"] is not None
    assert commands(fake) == ["get_server_list", f"get_client_list {server}", "quit"]
    assert_all_stopped(fake, tmp_path / "tmp")


def test_a_daemon_pinned_to_gpus_gives_its_clients_them_numbered_from_zero(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS", "clean")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with mps_daemon(4) as info:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1" and info["daemon_visible_devices"] == "3,5"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert info["shutdown"]["outcome"] == "quit"


def test_a_quit_that_waits_on_this_process_is_cut_short(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS", "hang")
    with mps_daemon(2, quit_timeout_s=0.2) as info:
        daemon, server = started(fake)
    shutdown = info["shutdown"]
    assert shutdown["outcome"] == "signalled" and shutdown["quit_s"] is None
    assert shutdown["clients"] == [os.getpid()] and shutdown["own_process_was_client"]
    assert shutdown["signals"] == {str(daemon): "SIGTERM", str(server): "SIGTERM"}
    assert commands(fake)[-1] == "quit"
    assert_all_stopped(fake, tmp_path / "tmp")  # the blocked front-end too


def test_a_daemon_that_ignores_sigterm_gets_sigkill(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS", "stubborn")
    monkeypatch.setattr(mps, "SIGNAL_WAIT_S", 0.2)
    with mps_daemon(4, quit_timeout_s=0.0) as info:
        daemon, server = started(fake)
    assert info["shutdown"]["signals"] == {str(daemon): "SIGKILL", str(server): "SIGKILL"}
    assert_all_stopped(fake, tmp_path / "tmp")


def test_the_blocks_own_error_propagates_and_the_daemon_still_stops(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS", "hang")
    with pytest.raises(RuntimeError, match="a run failed"):
        with mps_daemon(4, quit_timeout_s=0.0):
            raise RuntimeError("a run failed")
    assert_all_stopped(fake, tmp_path / "tmp")


def test_a_failing_stop_is_recorded_not_raised(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS", "clean")

    def broken(*_args):
        raise RuntimeError("control socket gone")

    with mps_daemon(4) as info:
        daemon, server = started(fake)
        monkeypatch.setattr(mps, "_ask_pids", broken)
    shutdown = info["shutdown"]
    assert shutdown["outcome"] == "error" and "control socket gone" in shutdown["error"]
    # The daemon's pid was known, so it was stopped; the server's was never learnt (the
    # fixture ends it).
    assert shutdown["signals"] == {str(daemon): "SIGTERM"} and not mps._alive(daemon)
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_daemon_without_pid_file_is_reported_gone(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS", "no_pid_file")
    with mps_daemon(4) as info:
        pass
    assert info["shutdown"]["outcome"] == "gone" and info["shutdown"]["daemon"] is None
    assert "quit" not in commands(fake)  # nothing named the stand-in's processes (the fixture ends them)
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_daemon_that_cannot_start_runs_the_block_without_mps(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS", "fail_start")
    with mps_daemon(4) as info:
        assert not any(v in os.environ for v in mps._VARS)
    assert info["enabled"] is False and "exited 1: cannot start: no GPU here" in info["error"]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_no_control_binary(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with mps_daemon(4) as info:
        pass
    assert info == {"enabled": False, "error": "nvidia-cuda-mps-control is not on PATH"}


def test_bad_arguments():
    with pytest.raises(ValueError, match="replicas_per_gpu"):
        with mps_daemon(0):
            pass
    with pytest.raises(ValueError, match="quit_timeout_s"):
        with mps_daemon(1, quit_timeout_s=-1):
            pass


def test_the_suite_records_the_shutdown(fake, tmp_path, monkeypatch):
    """``eval_suite`` stores the yielded dict before the block ends; the record lands in it."""
    from benchmarks import eval_suite

    monkeypatch.setenv("FAKE_MPS", "hang")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(mps, "QUIT_TIMEOUT_S", 0.0)
    metadata = {}
    with eval_suite.mps_if_asked(argparse.Namespace(mps=True, world_size=4)) as info:
        metadata["mps"] = info
    assert metadata["mps"]["enabled"] and metadata["mps"]["shutdown"]["outcome"] == "signalled"
    assert_all_stopped(fake, tmp_path / "tmp")
