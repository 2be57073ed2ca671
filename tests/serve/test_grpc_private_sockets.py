"""``private_sockets``: a host's KV-event socket directory is its own (mode 0700, named after its
process); a start sweeps those of this user's dead servers and leaves live ones and others alone."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile

from lmpool.frontend.grpc import private_sockets


def test_a_start_sweeps_only_dead_servers_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / f"lmpool-kv-{dead}-abc").mkdir()
    (tmp_path / f"lmpool-kv-{os.getppid()}-abc").mkdir()  # a live process's
    (tmp_path / "lmpool-kv-notapid-abc").mkdir()
    made = private_sockets.make()
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(made), f"lmpool-kv-{os.getppid()}-abc",
                                                   "lmpool-kv-notapid-abc"])
    assert os.path.basename(made).startswith(f"lmpool-kv-{os.getpid()}-")
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
