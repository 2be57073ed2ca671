"""CUDA streams of LMPool's own, outside torch's 32-stream pool, for the NCCL lanes and the
CUDA IPC receive streams: two users of one pool stream share its queue, and work that waits
on a peer then deadlocks (docs/ARCHITECTURE.md, "Data paths").

Invariants: a stream from ``acquire`` is handed to no one else until ``release``; streams
are reused, never destroyed; they are non-blocking.
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
