"""Helpers of the tools tests and their fixtures: the ``lmpool`` command, bounded polling,
a private tmux server, and reading ``lmpool top``'s screen."""

from __future__ import annotations

import os
import re
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import waiting

LMPOOL = str(Path(sys.executable).with_name("lmpool"))  # the console script of this environment
WAIT_S = 60  # bound of every poll; a passing test never gets near it


def lmpool(*args: str, timeout: float = WAIT_S) -> subprocess.CompletedProcess:
    """Run the ``lmpool`` command; its output as text."""
    return subprocess.run([LMPOOL, *args], capture_output=True, text=True, timeout=timeout)


def wait_until(condition, what: str, show=None, timeout: float = WAIT_S):
    """Poll ``condition`` until it returns something true; return that. On timeout the
    error says what was awaited, and what ``show()`` returns (say, the screen)."""
    return waiting.wait_until(condition, what, limit=timeout, show=show)


class Tmux:
    """One tmux server on a private socket, with one 160x40 session running a command."""

    def __init__(self, tmp: Path) -> None:
        self.socket = f"lmpool-test-{os.getpid()}-{secrets.token_hex(4)}"
        self.errors = tmp / "stderr.txt"

    def _tmux(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=check)

    def start(self, *command: str) -> None:
        line = " ".join(map(shlex.quote, command)) + " 2>" + shlex.quote(str(self.errors))
        self._tmux("new-session", "-d", "-s", "top", "-x", "160", "-y", "40", line)

    def screen(self) -> str:
        """The visible screen; empty once the session has ended."""
        done = self._tmux("capture-pane", "-p", "-t", "top", check=False)
        return done.stdout if done.returncode == 0 else ""

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "top", *keys)

    def running(self) -> bool:
        return self._tmux("has-session", "-t", "top", check=False).returncode == 0

    def stderr(self) -> str:
        return self.errors.read_text() if self.errors.exists() else ""

    def report(self) -> str:
        """The screen and the command's stderr, for a failure message."""
        return f"{self.screen()}\nstderr: {self.stderr()}"

    def kill(self) -> None:
        self._tmux("kill-server", check=False)


PID, STATE, RUN, TOKS = 1, 3, 6, 15  # columns of a rank row


def rank_rows(screen: str) -> dict[int, list[str]]:
    """``lmpool top``'s rank rows by rank, split into columns: RANK PID EPOCH STATE BEAT WAIT
    RUN [KV] USED RECL FREE HIT% STEP XFER LEASE TOK/S [TREND]."""
    rows = {}
    for line in screen.splitlines():
        fields = line.split()
        if len(fields) >= 16 and fields[0].isdigit() and fields[3] in ("alive", "dead"):
            rows[int(fields[0])] = fields
    return rows



def pool_tokens_per_s(screen: str) -> float:
    """The pool's tokens/s from ``lmpool top``'s header (0 if not shown yet)."""
    match = re.search(r"tokens/s ([0-9.]+)", screen)
    return float(match[1]) if match else 0.0
