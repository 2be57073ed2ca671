"""Message types, deterministic payload streams and a look into /dev/shm, shared by the
ipc tests and their peer processes."""

import random

import msgspec

from lmpool_ipc.lifecycle import pool_objects


class Echo(msgspec.Struct, tag=True, array_like=True, gc=False):
    seq: int
    payload: bytes = b""


class Stop(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


class Seq(msgspec.Struct, tag=True, array_like=True, gc=False):
    n: int


class Ready(msgspec.Struct, tag=True, array_like=True, gc=False):
    pid: int


Message = Echo | Stop | Seq | Ready


class Square(msgspec.Struct, array_like=True):
    x: int


class Squared(msgspec.Struct, array_like=True):
    x: int
    y: int


PATTERN_BYTES = 1 << 18
MAX_STREAM_PAYLOAD = 64 * 1024


def payload_stream(seed: int, count: int):
    """``count`` payloads of random sizes 0..64 KiB, each a slice of a random pattern at a
    random offset: the same sequence in every process, without generating 32 GB."""
    pattern = random.Random(seed).randbytes(PATTERN_BYTES)
    rng = random.Random(seed + 1)
    for _ in range(count):
        size = rng.randrange(MAX_STREAM_PAYLOAD + 1)
        offset = rng.randrange(PATTERN_BYTES - size + 1)
        yield pattern[offset : offset + size]


def board_value(n: int) -> bytes:
    """Value ``n`` of a board stream: ``n`` as 8 bytes, repeated 1 to 500 times, so a torn
    read (bytes of two values) shows as unequal words or a wrong length."""
    return n.to_bytes(8, "little") * (1 + n % 500)


def check_board_value(value: bytes) -> int:
    """The ``n`` of a value made by ``board_value``; AssertionError if the value is torn."""
    n = int.from_bytes(value[:8], "little")
    assert value == board_value(n), f"torn value: {len(value)} bytes, starting with {n}"
    return n


def leftovers(pool_id: str) -> list[str]:
    """Names of the segments and semaphores of pool ``pool_id`` that still exist."""
    return [o.name for o in pool_objects() if o.parsed.pool_id == pool_id]
