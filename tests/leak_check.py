"""What the pool tests' leak check counts (``conftest.no_leaks``): LMPool's processes and
shared-memory objects on this machine, but those of other live processes' pools (a test run
alongside this one)."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

from lmpool_ipc.lifecycle import pid_alive
from lmpool_ipc.names import SEM_FILE_PREFIX, parse_object

_OWNER_IN_SPEC = re.compile(rb"/lmpool-[0-9a-f]{32}-([0-9]+)-")


def _someone_elses(owner_pid: int) -> bool:
    """A pool owned by another live process (say, a test run alongside this one) is not
    this test's to clean up; a dead owner's leftovers are anyone's leak, but in such a pool."""
    return owner_pid != os.getpid() and pid_alive(owner_pid)


def lmpool_shm() -> set[str]:
    """LMPool's shared-memory objects, but other live processes' pools: an object of another's
    live process, and every object of a pool that has one (a run alongside this one killed
    that pool's control process, whose links wait there for its successor to sweep them)."""
    parsed = {}
    for name in os.listdir("/dev/shm"):
        if "lmpool" in name:
            parsed[name] = parse_object(name.removeprefix(SEM_FILE_PREFIX))
    foreign = {o.pool_id for o in parsed.values() if o and _someone_elses(o.owner_pid)}
    return {name for name, o in parsed.items() if not (o and o.pool_id in foreign)}


def child_pids() -> set[int]:
    """Live LMPool worker and control processes, but those of other processes' pools."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state == "Z" or not any(arg in (b"lmpool.worker.main", b"lmpool.control.main") for arg in cmdline):
            continue
        try:  # the spec (in the environment, or the command line of an older child) names the pool's links
            environ = (entry / "environ").read_bytes()
        except OSError:
            environ = b""
        owner = _OWNER_IN_SPEC.search(environ) or _OWNER_IN_SPEC.search(b" ".join(cmdline))
        if owner is None or not _someone_elses(int(owner[1])):
            pids.add(int(entry.name))
    return pids


def describe(names: set[str]) -> str:
    """How many objects each owner left, and whether that owner is this process or still
    alive: a leak is the owner's, and an owner that died during the test may be another
    test's process that outlived its own test."""
    def owner(name: str) -> int:
        parsed = parse_object(name.removeprefix(SEM_FILE_PREFIX))
        return parsed.owner_pid if parsed else -1

    def whose(pid: int) -> str:
        return "this process" if pid == os.getpid() else "alive" if pid_alive(pid) else "dead"

    owners = Counter(owner(name) for name in names)
    return "; ".join(f"{count} of owner {pid} ({whose(pid)})" for pid, count in sorted(owners.items())) \
        + f": {sorted(names)}"
