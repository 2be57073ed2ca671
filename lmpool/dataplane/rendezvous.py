"""The store a pool's transports meet at: only processes of the pool's own user can reach it.

The launcher serves one ``torch.distributed.HashStore`` (``Rendezvous``) on a Unix socket in the
abstract namespace (no file to leave behind or to guard with permissions) from threads of its
process; workers receive its ``address`` (``unix:@NAME``) in their spec and open clients with
``open_store``: a ``torch.distributed.Store`` whose every call is one request over that socket,
so gloo's process groups, NCCL's id exchange and CUDA IPC's per-transfer signalling use it like
any torch store. torch's own TCP store has no authentication (any local user could list, read and
overwrite a pool's keys); here the server reads each connecting process's credentials
(``SO_PEERCRED``) and serves only its own user's, closing any other connection before it reads a
byte of it.

Invariants: a request is served only on a connection whose peer's uid is the launcher's; one
connection carries one request at a time (a client's lock); a blocking ``get`` or ``wait`` gives up
after the client's timeout with ``DistStoreError``, as torch's stores do; frames are msgpack,
never pickles, and at most ``MAX_FRAME`` bytes.
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import struct
import threading

import msgspec
import torch.distributed as dist

from lmpool.dataplane.transport import TransportError

MAX_FRAME = 1 << 20  # a store holds ids, addresses and handles of a few hundred bytes
_LENGTH = struct.Struct("!I")
_NAME_PREFIX = "lmpool-rendezvous-"


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
    if scheme != "unix" or not name.startswith(_NAME_PREFIX) or not name[len(_NAME_PREFIX):].isalnum():
        raise ValueError(f"rendezvous address must look like unix:@{_NAME_PREFIX}KEY, got {address!r}")
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


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (as the kernel recorded it)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class Rendezvous:
    """The pool's store, served from the launcher's threads until ``close``."""

    def __init__(self) -> None:
        self._store = dist.HashStore()
        # A get waits for its key first (its own timeout); the store's is for the rare key deleted
        # between that wait and the read.
        self._store.set_timeout(datetime.timedelta(seconds=1))
        self._name = _NAME_PREFIX + secrets.token_hex(16)
        self.address = f"unix:@{self._name}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self._name)
        self._listener.listen(256)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closed = False
        self.refused = 0  # connections of another user, closed unread
        threading.Thread(target=self._accept, name="lmpool-rendezvous", daemon=True).start()

    @classmethod
    def create(cls) -> "Rendezvous":
        return cls()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            if peer_uid(conn) != os.getuid():
                self.refused += 1
                conn.close()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="lmpool-rendezvous-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        decoder, encoder = msgspec.msgpack.Decoder(Request), msgspec.msgpack.Encoder()
        try:
            send_frame(conn, encoder.encode(Reply()))  # the welcome: this connection is served
            while (frame := recv_frame(conn)) is not None:
                send_frame(conn, encoder.encode(self._answer(decoder.decode(frame))))
        except (OSError, ConnectionError, msgspec.DecodeError):
            pass  # the client went away, or sent what no client of ours sends: drop it
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _answer(self, request: Request) -> Reply:
        store = self._store
        try:
            if isinstance(request, Set):
                store.set(request.key, request.value)
                return Reply()
            if isinstance(request, Get):
                store.wait([request.key], datetime.timedelta(seconds=request.timeout_s))
                return Reply(store.get(request.key))
            if isinstance(request, Add):
                return Reply(store.add(request.key, request.amount))
            if isinstance(request, CompareSet):
                return Reply(store.compare_set(request.key, request.expected, request.desired))
            if isinstance(request, Check):
                return Reply(store.check(request.keys))
            if isinstance(request, DeleteKey):
                return Reply(store.delete_key(request.key))
            if isinstance(request, Wait):
                store.wait(request.keys, datetime.timedelta(seconds=request.timeout_s))
                return Reply()
            return Reply(store.num_keys())
        except dist.DistStoreError as e:
            return Reply(error=str(e), timed_out="timeout" in str(e).lower())
        except RuntimeError as e:
            return Reply(error=str(e))

    def close(self) -> None:
        """Stop serving: the listener and every connection are closed (clients see the store gone)."""
        with self._lock:
            self._closed = True
            connections, self._connections = list(self._connections), set()
        _shut(self._listener)
        for conn in connections:
            _shut(conn)


def _shut(sock: socket.socket) -> None:
    # shutdown first: it wakes a thread blocked in accept or recv on the socket, close alone does not.
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class StoreClient(dist.Store):
    """A ``torch.distributed.Store`` served by the pool's ``Rendezvous``. Whoever hands it to torch
    (a ``PrefixStore``, a process group) keeps a reference to it for as long as torch may call
    it: torch holds only its C++ half, and without its Python half every call fails."""

    def __init__(self, address: str, timeout_s: float) -> None:
        super().__init__()
        self.set_timeout(datetime.timedelta(seconds=timeout_s))
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._encoder, self._decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Reply)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout_s)
            self._sock.connect("\0" + parse_address(address))
            if recv_frame(self._sock) is None:  # closed unwelcomed: another user's process
                raise ConnectionError("it closed the connection (it serves only its own user's processes)")
        except (OSError, ConnectionError) as e:
            self._sock.close()
            raise TransportError(f"cannot reach the rendezvous at {address} within {timeout_s}s: {e}") from e

    def _call(self, request: Request, waits_s: float = 0.0):
        with self._lock:
            try:
                # A blocking request's answer may take its whole wait; the socket allows for it.
                self._sock.settimeout(self._timeout_s + waits_s)
                send_frame(self._sock, self._encoder.encode(request))
                frame = recv_frame(self._sock)
            except (OSError, ConnectionError) as e:
                raise TransportError(f"the rendezvous connection failed: {e}") from e
        if frame is None:
            raise TransportError("the rendezvous closed the connection (its pool is shutting down)")
        reply = self._decoder.decode(frame)
        if reply.error:
            raise (dist.DistStoreError if reply.timed_out else RuntimeError)(reply.error)
        return reply.value

    # torch.distributed.Store's interface (what gloo calls through it, and the transports).
    def set(self, key: str, value) -> None:
        self._call(Set(key, _raw(value)))

    def get(self, key: str) -> bytes:
        return self._call(Get(key, self._timeout_s), self._timeout_s)

    def add(self, key: str, amount: int) -> int:
        return self._call(Add(key, amount))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call(CompareSet(key, _raw(expected), _raw(desired)))

    def check(self, keys: list[str]) -> bool:
        return self._call(Check(list(keys)))

    def delete_key(self, key: str) -> bool:
        return self._call(DeleteKey(key))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        waits_s = self._timeout_s if timeout is None else timeout.total_seconds()
        self._call(Wait(list(keys), waits_s), waits_s)

    def num_keys(self) -> int:
        return self._call(NumKeys())

    def close(self) -> None:
        self._sock.close()

    def __del__(self) -> None:
        self._sock.close()


def _raw(value) -> bytes:
    """A store value as bytes: torch's stores take str or bytes alike."""
    return value.encode() if isinstance(value, str) else bytes(value)


def open_store(address: str, timeout_s: float) -> dist.Store:
    """A client of the rendezvous at ``address``; every blocking call on it gives up after
    ``timeout_s``."""
    return StoreClient(address, timeout_s)
