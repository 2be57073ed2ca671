"""The source revision a benchmark ran: ``LMPOOL_GIT_REVISION`` when set (a copy of the tree
on another machine may carry no git metadata, or stale metadata, so the given revision
wins), else ``git`` in this tree. Every benchmark records its revision through here."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ENV = "LMPOOL_GIT_REVISION"


def _git(*args: str) -> str | None:
    """``git``'s stripped output, or None where git is missing, fails or hangs."""
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30,
                              cwd=Path(__file__).parent, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_revision() -> str | None:
    return os.environ.get(ENV) or _git("rev-parse", "HEAD") or None


def git_record() -> dict:
    """The revision, and whether tracked files differ from it (None where unknown: always
    so for a revision given through the environment, recorded as its ``source``)."""
    given = os.environ.get(ENV)
    if given:
        return {"revision": given, "dirty": None, "source": ENV}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"revision": git_revision(), "dirty": None if status is None else bool(status)}
