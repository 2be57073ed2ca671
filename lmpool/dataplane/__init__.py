"""KV transfers between worker processes: the transports that move packed payloads.

``transport`` defines what every transport offers (``KVTransport``, ``Handle``, the
errors); ``rendezvous`` is their client of the store where they meet (the user process serves
it: ``frontend/rendezvous.py``); ``gloo`` connects CPU
replicas, ``cuda_ipc`` replicas sharing one GPU, ``nccl`` replicas on different GPUs. The
transports import lazily (``make_transport``), so importing this package needs no GPU.
"""

from lmpool.dataplane.gloo import GlooTransport
from lmpool.dataplane.transport import (
    KINDS,
    TAG_LIMIT,
    Handle,
    KVTransport,
    TransferTimeout,
    TransportError,
    kind_for_devices,
    make_transport,
    plan_tag,
)

__all__ = [
    "KINDS",
    "TAG_LIMIT",
    "GlooTransport",
    "Handle",
    "KVTransport",
    "TransferTimeout",
    "TransportError",
    "kind_for_devices",
    "make_transport",
    "plan_tag",
]
