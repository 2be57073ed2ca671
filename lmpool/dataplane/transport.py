"""The data path of a KV transfer as its callers see it: start a send or a receive, poll or
wait for it, and learn exactly why it failed.

A transport moves the bytes of one packed payload (``[layers, 2, B, block_size,
kv_heads, head_dim]``, see ``lmpool.ops.reference.pack_kv``) from one worker to another,
once per transfer. Block hashes, generations, modes and block ids travel on the control
plane; nothing here knows what the bytes mean. Where two workers' GPUs can address each
other's memory, ``CudaIpcTransport`` also offers a faster path outside this interface:
``pull``, which copies blocks straight from the peer's cache and materialises no payload
(see ``lmpool.dataplane.cuda_ipc``; ``kind_for_devices`` says which pairs get it).

Invariants every transport keeps:
- ``send`` and ``recv`` only start an operation and return a ``Handle``; they never wait
  for the peer, so a worker can start a send and a receive on the same pair at once
  (opposite directions never deadlock) and its step loop keeps running while bytes move.
- a send from rank A to rank B with tag ``t`` completes only the receive that rank B
  posted for rank A with tag ``t``. Tags separate concurrent transfers of one directed
  pair; the same tag may be in flight in both directions at once. Callers derive tags
  from plan ids (``plan_tag``), so two in-flight transfers never share one.
- the sender's payload and the receiver's ``out`` must stay untouched until the handle
  is done; the handle keeps both tensors alive until the transport no longer needs them.
- ``Handle.wait(timeout)`` returns or raises within about ``timeout`` seconds, whatever
  the peer does. Expiry raises ``TransferTimeout``; any other failure ``TransportError``.

The rendezvous every transport of a pool uses to find its peers is a store served by the
user process, reachable only by processes of its user (``lmpool.frontend.rendezvous``; the
transports' client: ``lmpool.dataplane.rendezvous``).
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

import torch

# Tags are non-negative int32 (gloo's limit); the largest is reserved for the transports'
# own use (gloo breaks a pair with it).
TAG_LIMIT = 2**31 - 1
KINDS = ("gloo", "cuda_ipc", "nccl")


class TransportError(RuntimeError):
    """A transfer, a connection or a transport failed; the message says which and why."""


class TransferTimeout(TransportError, TimeoutError):
    """A wait expired before the transfer completed."""


class Handle(Protocol):
    def done(self) -> bool:
        """True once the operation has finished, successfully or not; never blocks."""
        ...

    def wait(self, timeout: float) -> None:
        """Return once the operation succeeded; raise TransferTimeout if that takes more
        than ``timeout`` seconds, TransportError if it failed."""
        ...


class KVTransport(Protocol):
    rank: int
    world_size: int

    def send(self, peer: int, payload: torch.Tensor, tag: int) -> Handle:
        """Start sending the bytes of ``payload`` (contiguous, on this transport's device)."""
        ...

    def recv(self, peer: int, out: torch.Tensor, tag: int) -> Handle:
        """Start receiving exactly ``out.nbytes`` bytes into ``out`` (contiguous)."""
        ...

    def close(self) -> None:
        """Fail every pending operation and release connections, threads and buffers."""
        ...


def poll_until(done: Callable[[], bool], timeout: float, first_pause: float = 50e-6,
               max_pause: float = 2e-3) -> bool:
    """Call ``done`` until it returns True (then True) or ``timeout`` seconds have passed
    (then False), sleeping between calls from ``first_pause``, doubling up to ``max_pause``:
    a handle that completes within microseconds is seen at once, a long one costs no CPU."""
    deadline = time.monotonic() + timeout
    pause = first_pause
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, max_pause)
    return True


def plan_tag(plan_id: int) -> int:
    """The tag of a transfer plan's payload."""
    return plan_id % TAG_LIMIT


def check_args(transport: KVTransport, peer: int, tensor: torch.Tensor, tag: int, device: torch.device) -> None:
    """Raise ValueError, saying what is wrong, for arguments no transport can accept."""
    if not 0 <= peer < transport.world_size or peer == transport.rank:
        raise ValueError(
            f"peer must be another rank in [0, {transport.world_size}), not {peer} (this is rank {transport.rank})"
        )
    if not 0 <= tag < TAG_LIMIT:
        raise ValueError(f"tag must be in [0, {TAG_LIMIT}), got {tag}")
    if tensor.device != device:
        raise ValueError(f"tensor is on {tensor.device}, but this transport moves tensors on {device}")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous (a packed payload is)")


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor: writes through it land in ``tensor``."""
    return tensor.reshape(-1).view(torch.uint8)


def kind_for_devices(device_a: str, device_b: str, peer_access: bool = False) -> str:
    """Which transport connects replicas on these two devices; ``peer_access``: each GPU
    can read the other's memory (NVLink or PCIe P2P, ``torch.cuda.can_device_access_peer``).

    GPUs that can address each other use CUDA IPC: the destination pulls the blocks out of
    the source's cache in one kernel, with no payload, no communicator and no ordering
    rule between transfers. NCCL is left for GPUs that cannot (its packed payload crosses
    through whatever path NCCL finds). On one GPU there is no choice: NCCL refuses two
    ranks of one communicator on one device."""
    a, b = torch.device(device_a), torch.device(device_b)
    if a.type == b.type == "cpu":
        return "gloo"
    if a.type == b.type == "cuda":
        return "cuda_ipc" if a.index == b.index or peer_access else "nccl"
    raise ValueError(f"no transport connects a replica on {a} with one on {b}")


def make_transport(kind: str, rank: int, world_size: int, *, rendezvous: str, device: str = "cpu",
                   timeout_s: float = 30.0, staging_bytes: int = 0, kv_cache: torch.Tensor | None = None,
                   use_kernels: bool = True, lanes: int | None = None) -> KVTransport:
    """The transport of ``kind`` for this rank. Connections are made afterwards, per peer:
    ``connect(peer, session)`` for gloo and nccl, ``export``/``connect`` for cuda_ipc.

    cuda_ipc only: ``staging_bytes`` bounds the packed payloads this rank sends at once
    (0: it sends none), ``kv_cache`` is shared so that peers can pull from it.
    nccl only: ``lanes`` communicators per direction (None: ``nccl.DEFAULT_LANES``)."""
    if kind == "gloo":
        from lmpool.dataplane.gloo import GlooTransport

        return GlooTransport(rendezvous, rank, world_size, timeout_s=timeout_s)
    if kind == "cuda_ipc":
        from lmpool.dataplane.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(rendezvous, rank, world_size, device=device, staging_bytes=staging_bytes,
                                timeout_s=timeout_s, kv_cache=kv_cache, use_kernels=use_kernels)
    if kind == "nccl":
        from lmpool.dataplane.nccl import NcclTransport

        return NcclTransport(rendezvous, rank, world_size, device=device, timeout_s=timeout_s,
                             **({} if lanes is None else {"lanes": lanes}))
    raise ValueError(f"transport kind must be one of {KINDS}, got {kind!r}")
