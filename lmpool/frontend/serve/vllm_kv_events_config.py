"""vLLM's ``--kv-events-config`` JSON, read into ``lmpool serve``'s own KV-event settings.

vLLM's ``KVEventsConfig`` fields: ``enable_kv_cache_events`` and ``publisher`` ("zmq", or
"null": off) say whether events are published; ``endpoint``, ``replay_endpoint``, ``topic`` and
``buffer_steps`` map onto ``--kv-events-endpoint``, ``--kv-events-replay-endpoint``,
``--kv-events-topic`` and ``--kv-events-buffer-steps``; ``hwm`` and ``max_queue_size`` are taken
and not acted on (the publisher's own bounds apply). Defaults are vLLM's, but for the endpoint:
vLLM's ``tcp://*:5557`` would publish every cached block's tokens to any host, so an endpoint left
out is ``tcp://127.0.0.1:5557``. An unknown field or a wrong type is refused by name.
"""

from __future__ import annotations

import json

LOOPBACK_ENDPOINT = "tcp://127.0.0.1:5557"
IGNORED = ("hwm", "max_queue_size")


def parse_kv_events_config(text: str) -> dict | None:
    """The settings in vLLM's JSON (keys: endpoint, replay_endpoint, topic, buffer_steps), or
    None when it turns events off; ``ValueError`` naming what is wrong."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError("must be a JSON object of vLLM's KVEventsConfig fields")
    known = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "topic", "buffer_steps", *IGNORED}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    publisher = _typed(config, "publisher", str, "zmq")
    if publisher not in ("zmq", "null"):
        raise ValueError(f"publisher must be 'zmq' or 'null', got {publisher!r}")
    if not _typed(config, "enable_kv_cache_events", bool, False) or publisher == "null":
        return None
    buffer_steps = _typed(config, "buffer_steps", int, 10_000)
    if buffer_steps < 1:
        raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
    for name in IGNORED:
        _typed(config, name, int, 0)
    return {"endpoint": _typed(config, "endpoint", str, LOOPBACK_ENDPOINT),
            "replay_endpoint": _typed(config, "replay_endpoint", (str, type(None)), None),
            "topic": _typed(config, "topic", str, ""), "buffer_steps": buffer_steps}


def _typed(config: dict, name: str, kind, default):
    value = config.get(name, default)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{name} must be {getattr(kind, '__name__', 'a string or null')}, got {value!r}")
    return value
