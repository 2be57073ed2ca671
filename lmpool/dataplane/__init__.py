"""KV transfers between worker processes: the transports that move packed payloads.

``transport`` defines what every transport offers (``KVTransport``, ``Handle``, the
errors); ``rendezvous`` is the pool's store where transports meet; ``gloo`` connects CPU
replicas, ``cuda_ipc`` replicas sharing one GPU, ``nccl`` replicas on different GPUs. The
transports import lazily (``make_transport``), so importing this package needs no GPU.
"""

from lmpool.dataplane.gloo import GlooTransport
from lmpool.dataplane.rendezvous import Rendezvous
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
    "Rendezvous",
    "TransferTimeout",
    "TransportError",
    "kind_for_devices",
    "make_transport",
    "plan_tag",
]
