"""``KVEventsConfig``: where and how the control process publishes the pool's KV events in vLLM's
format (``control/kv_events/``), for consumers such as Dynamo's KV router or smg's gRPC worker.

A section of the pool's one configuration tree (``PoolConfig.kv_events``; None publishes nothing),
so a control process the pool restarts publishes as its predecessor did.
"""

from __future__ import annotations

import msgspec

REPLAY_MAX_BATCHES = 1_000  # batches one replay request gets (and the most a snapshot is split into)


class KVEventsConfig(msgspec.Struct, kw_only=True, frozen=True):
    endpoint: str  # the ZMQ PUB endpoint the events go out on
    replay_endpoint: str | None = None  # a ZMQ ROUTER answering replay and snapshot requests
    topic: str = ""
    buffer_steps: int = 10_000  # batches kept for replay
    replay_max_batches: int = REPLAY_MAX_BATCHES
    array_like: bool = True  # vLLM's array layout (False: the map layout of recent vLLM releases)
    # Block hashes as vLLM sends them by default, the digest's low 64 bits as an integer (what
    # Dynamo's KV router decodes); False sends the whole 32 bytes.
    int_hashes: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, str) or not self.endpoint:
            raise ValueError(f"kv_events.endpoint must be a ZMQ endpoint, got {self.endpoint!r}")
        if self.buffer_steps < 1 or self.replay_max_batches < 1:
            raise ValueError(f"kv_events.buffer_steps and replay_max_batches must be >= 1, got "
                             f"{self.buffer_steps} and {self.replay_max_batches}")
