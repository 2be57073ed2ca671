"""The pool's rendezvous wire: the requests a transport's store client sends to the store the
user process serves (``frontend/rendezvous.py``), its replies, their frames and its address.

A frame is a 4-byte big-endian length, then a msgpack body of at most ``MAX_FRAME`` bytes: a
``Request`` from a client, a ``Reply`` from the server (the first, unasked, welcomes a connection
the server will serve). An address is ``unix:@NAME``: a Unix socket in the abstract namespace.
"""

from __future__ import annotations

import socket
import struct

import msgspec

MAX_FRAME = 1 << 20  # a store holds ids, addresses and handles of a few hundred bytes
_LENGTH = struct.Struct("!I")
NAME_PREFIX = "lmpool-rendezvous-"


# The requests a client sends, and the server's replies.
class Set(msgspec.Struct, tag="set", array_like=True):
    key: str
    value: bytes


class Get(msgspec.Struct, tag="get", array_like=True):
    key: str
    timeout_s: float


class Add(msgspec.Struct, tag="add", array_like=True):
    key: str
    amount: int


class CompareSet(msgspec.Struct, tag="compare_set", array_like=True):
    key: str
    expected: bytes
    desired: bytes


class Check(msgspec.Struct, tag="check", array_like=True):
    keys: list[str]


class DeleteKey(msgspec.Struct, tag="delete_key", array_like=True):
    key: str


class Wait(msgspec.Struct, tag="wait", array_like=True):
    keys: list[str]
    timeout_s: float


class NumKeys(msgspec.Struct, tag="num_keys", array_like=True):
    pass


class Reply(msgspec.Struct, tag="reply", array_like=True):
    """A request's outcome: its ``value`` (bytes, int, bool or None), or ``error`` ("" if none)
    and whether it was a timeout."""

    value: bytes | int | bool | None = None
    error: str = ""
    timed_out: bool = False


Request = Set | Get | Add | CompareSet | Check | DeleteKey | Wait | NumKeys


def parse_address(address: str) -> str:
    """The abstract socket name of a ``unix:@NAME`` address."""
    scheme, _, name = address.partition(":@")
    if scheme != "unix" or not name.startswith(NAME_PREFIX) or not name[len(NAME_PREFIX):].isalnum():
        raise ValueError(f"rendezvous address must look like unix:@{NAME_PREFIX}KEY, got {address!r}")
    return name


def send_frame(sock: socket.socket, frame: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(frame)) + frame)


def recv_frame(sock: socket.socket) -> bytes | None:
    """One frame, or None where the peer closed the connection between frames."""
    head = _recv_exactly(sock, _LENGTH.size)
    if head is None:
        return None
    (size,) = _LENGTH.unpack(head)
    if size > MAX_FRAME:
        raise ConnectionError(f"a rendezvous frame of {size} bytes, more than {MAX_FRAME}")
    body = _recv_exactly(sock, size)
    if body is None:
        raise ConnectionError("the rendezvous connection closed in the middle of a frame")
    return body


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            if data:
                raise ConnectionError("the rendezvous connection closed in the middle of a frame")
            return None
        data += chunk
    return bytes(data)
