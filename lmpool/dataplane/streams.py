"""CUDA streams of LMPool's own, outside torch's stream pool.

``torch.cuda.Stream()`` hands out the streams of a fixed per-device pool (32 in torch's
c10) in turn, so the 33rd stream a process asks for is the first one again. Two users who
each believe they hold a stream of their own then share one, and their work runs in one
queue. For independent kernels that only costs overlap; for work that waits on a peer it
is a deadlock: an NCCL send queued behind a receive from the same peer, which the peer
queued behind its own send, never completes; nor does one queued behind work that waits
for a chunk the peer sends only after that send has arrived. The NCCL lanes, and the CUDA
IPC transport's per-peer receive streams (each of which a dead peer may leave stuck),
therefore run on streams from here.

Invariants:
- a stream from ``acquire`` is handed to no one else, torch's pool included, until
  ``release`` gives it back.
- streams are reused, never destroyed: work still queued on a released stream (an aborted
  communicator's last kernels) only delays its next user, and torch's caching allocator
  may still record events on it for tensors it was given (``record_stream``).
- streams are non-blocking (``cudaStreamNonBlocking``): like torch's own, they never wait
  for, or hold up, the legacy default stream.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

_NON_BLOCKING = 0x1  # cudaStreamNonBlocking
_free: dict[int, list[torch.cuda.ExternalStream]] = {}  # device index -> released streams
_lock = threading.Lock()  # lanes are made on connect threads


def _loaded_paths(name: str) -> list[str]:
    """Paths of the shared libraries named ``name``* already mapped into this process."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if f"/{name}" in line and ".so" in line})
    except OSError:
        return []


@functools.cache
def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (the same copy: a second one would keep its own state)."""
    torch.cuda.init()
    tried = []
    for candidate in [*_loaded_paths("libcudart.so"), "libcudart.so"]:
        try:
            lib = ctypes.CDLL(candidate)
            lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
            lib.cudaStreamCreateWithFlags.restype = ctypes.c_int
        except (OSError, AttributeError) as e:
            tried.append(f"{candidate} ({e})")
            continue
        return lib
    raise RuntimeError("the CUDA runtime torch uses could not be found to make a stream; tried: " + "; ".join(tried))


def _index(device: torch.device | str | int) -> int:
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"a CUDA stream needs a CUDA device, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def acquire(device: torch.device | str | int) -> torch.cuda.ExternalStream:
    """A stream on ``device`` that no one else uses (a released one, or a new one)."""
    index = _index(device)
    with _lock:
        if _free.get(index):
            return _free[index].pop()
    handle = ctypes.c_void_p()
    with torch.cuda.device(index):  # the runtime makes a stream on the calling thread's device
        code = _cudart().cudaStreamCreateWithFlags(ctypes.byref(handle), _NON_BLOCKING)
    if code != 0:
        raise RuntimeError(f"cudaStreamCreateWithFlags failed on cuda:{index} (cudaError_t {code})")
    return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index))


def release(stream: torch.cuda.ExternalStream) -> None:
    """Give ``stream`` back for a later ``acquire``; its queued work may still be running."""
    with _lock:
        _free.setdefault(stream.device.index, []).append(stream)
