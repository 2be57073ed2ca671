"""The store a pool's transports meet at (``dataplane/rendezvous.py`` is their client), served by
the user process: only processes of the pool's own user can reach it.

``Rendezvous`` serves one ``torch.distributed.HashStore`` on a Unix socket in the abstract
namespace (no file to leave behind or to guard with permissions) from threads of this process;
workers receive its ``address`` (``unix:@NAME``) in their spec. torch's own TCP store has no
authentication (any local user could list, read and overwrite a pool's keys); here the server
reads each connecting process's credentials (``SO_PEERCRED``) and serves only its own user's,
closing any other connection before it reads a byte of it.

Invariants: a request is served only on a connection whose peer's uid is this process's; frames
are msgpack, never pickles, and at most ``MAX_FRAME`` bytes (``protocol/rendezvous.py``).
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

from lmpool.protocol.rendezvous import (
    NAME_PREFIX,
    Add,
    Check,
    CompareSet,
    DeleteKey,
    Get,
    Reply,
    Request,
    Set,
    Wait,
    recv_frame,
    send_frame,
)


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
        self._name = NAME_PREFIX + secrets.token_hex(16)
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
                store.set(request.key, request.value)  # type: ignore[arg-type]  # torch's stubs: str; bytes are taken
                return Reply()
            if isinstance(request, Get):
                store.wait([request.key], datetime.timedelta(seconds=request.timeout_s))
                return Reply(store.get(request.key))
            if isinstance(request, Add):
                return Reply(store.add(request.key, request.amount))
            if isinstance(request, CompareSet):
                # torch's stubs: str values; the store takes bytes, as the workers' clients send them.
                return Reply(store.compare_set(request.key, request.expected, request.desired))  # type: ignore[arg-type]
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
