"""The few NCCL calls a pair transport needs, bound with ctypes to the NCCL library torch
already loads (why not ``ProcessGroupNCCL``: docs/ARCHITECTURE.md, "Data paths").

Invariants: every call returns ``ncclSuccess`` or raises ``NcclError`` naming the call and
NCCL's description; communicators are blocking; a communicator is aborted at most once and
never used after.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
_UINT8 = 1  # ncclUint8: payloads go as bytes, so any dtype's count is its byte count
_SUCCESS = 0
_IN_PROGRESS = 7  # ncclInProgress: a non-blocking call still under way, not an error


class NcclError(RuntimeError):
    """An NCCL call failed, or the library cannot be loaded."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


_comm_t = ctypes.c_void_p
_SIGNATURES = {
    "ncclGetVersion": [ctypes.POINTER(ctypes.c_int)],
    "ncclGetUniqueId": [ctypes.POINTER(_UniqueId)],
    "ncclCommInitRank": [ctypes.POINTER(_comm_t), ctypes.c_int, _UniqueId, ctypes.c_int],
    "ncclSend": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _comm_t, ctypes.c_void_p],
    "ncclRecv": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _comm_t, ctypes.c_void_p],
    "ncclCommGetAsyncError": [_comm_t, ctypes.POINTER(ctypes.c_int)],
    "ncclCommAbort": [_comm_t],
}


def _candidates() -> list[str]:
    """Where the library may be, in order: ``LMPOOL_NCCL_LIBRARY``; the soname, which finds
    the copy torch has already loaded (or one on the loader's path); the copy of the
    ``nvidia-nccl`` wheel that CUDA builds of torch depend on."""
    found = [os.environ["LMPOOL_NCCL_LIBRARY"]] if os.environ.get("LMPOOL_NCCL_LIBRARY") else []
    found.append("libnccl.so.2")
    try:
        import nvidia.nccl  # the wheel's package: a namespace, so its path, not __file__

        found += [str(Path(p) / "lib" / "libnccl.so.2") for p in nvidia.nccl.__path__]
    except ImportError:
        pass
    return found


@functools.cache
def library() -> ctypes.CDLL:
    """The NCCL library, its functions typed; ``NcclError`` naming every place tried if none loads."""
    import torch  # noqa: F401  (loads torch's own NCCL first, so the soname finds that copy)

    tried = []
    for candidate in _candidates():
        try:
            lib = ctypes.CDLL(candidate)
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
            lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
        except (OSError, AttributeError) as e:  # not there, or not an NCCL of these calls
            tried.append(f"{candidate} ({e})")
            continue
        return lib
    raise NcclError("the NCCL library could not be loaded (set LMPOOL_NCCL_LIBRARY to its path); tried: "
                    + "; ".join(tried))


def _check(result: int, call: str) -> None:
    if result != _SUCCESS:
        text = library().ncclGetErrorString(result).decode(errors="replace")
        raise NcclError(f"{call} failed: {text} (ncclResult_t {result})")


def version() -> str:
    """The loaded library's version, as "major.minor.patch"."""
    code = ctypes.c_int()
    _check(library().ncclGetVersion(ctypes.byref(code)), "ncclGetVersion")
    major, rest = divmod(code.value, 10000)  # NCCL >= 2.9 encodes X.Y.Z as X*10000 + Y*100 + Z
    return f"{major}.{rest // 100}.{rest % 100}"


def unique_id() -> bytes:
    """A new communicator id; the rank that makes it hands it to the others."""
    uid = _UniqueId()
    _check(library().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return bytes(uid.internal)


class Communicator:
    """One NCCL communicator of ``nranks`` ranks on the calling thread's current CUDA device."""

    def __init__(self, uid: bytes, nranks: int, rank: int) -> None:
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        lib = library()
        self._lib = lib
        self._comm = _comm_t()
        packed = _UniqueId()
        ctypes.memmove(packed.internal, uid, UNIQUE_ID_BYTES)
        # Blocks until every rank has joined; ctypes releases the GIL meanwhile.
        _check(lib.ncclCommInitRank(ctypes.byref(self._comm), nranks, packed, rank), "ncclCommInitRank")
        self.aborted = False

    def send(self, data_ptr: int, nbytes: int, peer: int, stream: int) -> None:
        """Enqueue a send of ``nbytes`` at ``data_ptr`` to ``peer`` on CUDA stream ``stream``."""
        self._usable("ncclSend")
        _check(self._lib.ncclSend(data_ptr, nbytes, _UINT8, peer, self._comm, stream), "ncclSend")

    def recv(self, data_ptr: int, nbytes: int, peer: int, stream: int) -> None:
        """Enqueue a receive of ``nbytes`` into ``data_ptr`` from ``peer`` on stream ``stream``."""
        self._usable("ncclRecv")
        _check(self._lib.ncclRecv(data_ptr, nbytes, _UINT8, peer, self._comm, stream), "ncclRecv")

    def async_error(self) -> str | None:
        """What went wrong in the communicator's background (a peer gone, a network error), if anything."""
        if self.aborted:
            return "the communicator was aborted"
        result = ctypes.c_int()
        _check(self._lib.ncclCommGetAsyncError(self._comm, ctypes.byref(result)), "ncclCommGetAsyncError")
        if result.value in (_SUCCESS, _IN_PROGRESS):
            return None
        return self._lib.ncclGetErrorString(result.value).decode(errors="replace")

    def abort(self) -> None:
        """Free the communicator without waiting for its operations, which end (failed) instead of hanging."""
        if not self.aborted:
            self.aborted = True
            _check(self._lib.ncclCommAbort(self._comm), "ncclCommAbort")

    def _usable(self, call: str) -> None:
        if self.aborted:
            raise NcclError(f"{call} on an aborted communicator")
