"""A transport's client of the pool's rendezvous store (served by the user process:
``frontend/rendezvous.py``): ``open_store`` gives a ``torch.distributed.Store`` whose every call
is one request over the store's Unix socket, so gloo's process groups, NCCL's id exchange and CUDA
IPC's per-transfer signalling use it like any torch store.

Invariants: one connection carries one request at a time (a client's lock); a blocking ``get`` or
``wait`` gives up after the client's timeout with ``DistStoreError``, as torch's stores do.
"""

from __future__ import annotations

import datetime
import socket
import threading

import msgspec
import torch.distributed as dist

from lmpool.dataplane.transport import TransportError
from lmpool.protocol.rendezvous import (
    Add,
    Check,
    CompareSet,
    DeleteKey,
    Get,
    NumKeys,
    Reply,
    Request,
    Set,
    Wait,
    parse_address,
    recv_frame,
    send_frame,
)


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


def open_store(address: str, timeout_s: float) -> StoreClient:
    """A client of the rendezvous at ``address``; every blocking call on it gives up after
    ``timeout_s``."""
    return StoreClient(address, timeout_s)
