"""Names of the POSIX shared-memory segments and semaphores of a pool.

Every object of a link is named ``/lmpool-<pool id>-<owner pid>-<link id>-<role>``:

- ``pool id``: 32 hex digits from ``secrets``, so other users cannot guess (and pre-create
  or open) a pool's objects; with mode 0600 they could not open them anyway.
- ``owner pid``: the process that started the pool. When it is gone the pool is dead and
  ``lifecycle.sweep_dead_pools`` may remove the objects; the name carries it because a
  semaphore, unlike a ring, has no header to read it from.
- ``link id``: 16 hex digits, one per link (a pair of rings between two processes).
- ``role``: ``ab`` / ``ba``, the ring from end a to end b and back; ``a`` / ``b``, the
  semaphore that wakes that end.

A board (a region of the pool with no link, see ``board``) is named
``/lmpool-<pool id>-<owner pid>-board-<label>``, ``label`` being a short lowercase word
chosen by its user; ``board`` is not 16 hex digits, so no link name looks like it.

An end of a link is addressed by the string ``<link prefix>:a`` or ``<link prefix>:b``;
that string is all another process needs to open its end.

On Linux, segments appear as ``/dev/shm/<name>`` and semaphores as ``/dev/shm/sem.<name>``.
"""

import re
import secrets
from typing import NamedTuple

SHM_DIR = "/dev/shm"
SEM_FILE_PREFIX = "sem."
RING_ROLES = ("ab", "ba")
BELL_ROLES = ("a", "b")
ENDS = ("a", "b")

_OBJECT = re.compile(
    r"lmpool-([0-9a-f]{32})-([0-9]+)-(?:([0-9a-f]{16})-(ab|ba|a|b)|board-([a-z][a-z0-9]{0,15}))"
)
_LABEL = re.compile(r"[a-z][a-z0-9]{0,15}")
_END = re.compile(r"(/lmpool-[0-9a-f]{32}-[0-9]+-[0-9a-f]{16}):(a|b)")


class ObjectName(NamedTuple):
    """A parsed object name: which pool, its owner, and which link and role, or which
    board (``link_id`` and ``role`` empty)."""

    pool_id: str
    owner_pid: int
    link_id: str
    role: str
    board: str = ""


def new_pool_id() -> str:
    return secrets.token_hex(16)


def new_link_prefix(pool_id: str, owner_pid: int) -> str:
    return f"/lmpool-{pool_id}-{owner_pid}-{secrets.token_hex(8)}"


def board_name(pool_id: str, owner_pid: int, label: str) -> str:
    if _LABEL.fullmatch(label) is None:
        raise ValueError(f"a board label is 1-16 lowercase letters and digits, starting with a letter; got {label!r}")
    return f"/lmpool-{pool_id}-{owner_pid}-board-{label}"


def object_name(link_prefix: str, role: str) -> str:
    return f"{link_prefix}-{role}"


def end_name(link_prefix: str, end: str) -> str:
    return f"{link_prefix}:{end}"


def parse_end(name: str) -> tuple[str, str]:
    """Split an end name into its link prefix and ``"a"`` or ``"b"``."""
    match = _END.fullmatch(name)
    if match is None:
        raise ValueError(f"not an LMPool link end name: {name!r}")
    return match[1], match[2]


def parse_object(name: str) -> ObjectName | None:
    """Parse an object name, with or without its leading slash; None if not a pool's."""
    match = _OBJECT.fullmatch(name.removeprefix("/"))
    if match is None:
        return None
    if match[5] is not None:
        return ObjectName(match[1], int(match[2]), "", "", match[5])
    return ObjectName(match[1], int(match[2]), match[3], match[4])
