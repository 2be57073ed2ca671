"""Frame layout and ring index arithmetic, as pure functions over a data region.

A ring's data region is ``capacity`` bytes; ``capacity`` is a positive multiple of
``ALIGN``. Indices are monotonically increasing byte counters (they never wrap: 2**64
bytes at 10 GB/s take 58 years); the byte at index ``i`` lives at offset
``i % capacity``.

A frame is an 8-byte little-endian payload length followed by the payload, padded to a
multiple of ``ALIGN`` bytes. Frames start at aligned indices, so a length prefix never
straddles the end of the region. A payload that runs past the end continues at offset 0
(split copy, no wrap marker): any frame of at most ``capacity`` bytes fits whenever the
ring has that much free space, wherever the indices stand.
"""

import struct

from .errors import RingCorruptError

PREFIX = 8
ALIGN = 8
_LENGTH = struct.Struct("<Q")


def frame_size(payload_len: int) -> int:
    """Bytes a frame carrying ``payload_len`` bytes occupies, prefix and padding included."""
    return (PREFIX + payload_len + ALIGN - 1) & -ALIGN


def max_payload(capacity: int) -> int:
    """The largest payload that fits in an empty ring of ``capacity`` bytes."""
    return capacity - PREFIX


def spans(capacity: int, index: int, length: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Bytes ``[index, index + length)`` as two contiguous ``(offset, size)`` pieces: the
    part before the end of the region, then the part wrapped to offset 0 (size 0 if none).
    ``length`` is at most ``capacity``."""
    start = index % capacity
    first = min(length, capacity - start)
    return (start, first), (0, length - first)


def write_frame(data: memoryview, index: int, payload) -> int:
    """Write ``payload`` as a frame at ``index`` of ``data``; return the index after it.
    The caller has checked that ``frame_size(len(payload))`` bytes are free."""
    capacity = len(data)
    n = len(payload)
    at = index % capacity
    _LENGTH.pack_into(data, at, n)
    at += PREFIX
    if at + n <= capacity:
        data[at : at + n] = payload
    else:
        (at, first), (_, rest) = spans(capacity, index + PREFIX, n)
        view = memoryview(payload)
        data[at : at + first] = view[:first]
        data[:rest] = view[first:]
    return index + ((PREFIX + n + ALIGN - 1) & -ALIGN)


def read_frame(data: memoryview, index: int, available: int) -> tuple[bytes, int]:
    """Read the frame at ``index`` given ``available`` published bytes from ``index`` on;
    return its payload (a copy) and the index after it."""
    capacity = len(data)
    at = index % capacity
    n = _LENGTH.unpack_from(data, at)[0]
    size = (PREFIX + n + ALIGN - 1) & -ALIGN
    if size > available:
        raise RingCorruptError(
            f"frame at index {index} claims {n} payload bytes but only {available} bytes "
            f"(prefix included) are published"
        )
    at += PREFIX
    if at + n <= capacity:
        payload = data[at : at + n].tobytes()
    else:
        (at, first), (_, rest) = spans(capacity, index + PREFIX, n)
        payload = b"".join((data[at : at + first], data[:rest]))
    return payload, index + size
