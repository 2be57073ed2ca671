"""Frame encoding and ring index arithmetic (lmpool_ipc.frames), property-based."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmpool_ipc.errors import RingCorruptError
from lmpool_ipc.frames import (
    ALIGN,
    PREFIX,
    frame_size,
    max_payload,
    read_frame,
    spans,
    write_frame,
)

capacities = st.integers(8, 64).map(lambda k: k * ALIGN)  # 64 .. 512 bytes
indices = st.integers(0, 2**48).map(lambda i: i * ALIGN)  # aligned, far past 2**32


def positions(capacity: int, index: int, length: int) -> list[int]:
    """The offsets of bytes ``[index, index + length)``, one at a time."""
    return [(index + k) % capacity for k in range(length)]


@given(st.integers(0, 1 << 20))
def test_frame_size_is_aligned_and_tight(n):
    size = frame_size(n)
    assert size % ALIGN == 0
    assert PREFIX + n <= size < PREFIX + n + ALIGN


@given(capacities, st.integers(0, 2**64 - 1), st.data())
def test_spans_cover_the_range_in_order(capacity, index, data):
    length = data.draw(st.integers(0, capacity))
    (start, first), (zero, rest) = spans(capacity, index, length)
    assert zero == 0 and first + rest == length
    assert 0 <= start < capacity and start + first <= capacity
    assert rest == 0 or start + first == capacity  # wraps only at the end
    covered = list(range(start, start + first)) + list(range(rest))
    assert covered == positions(capacity, index, length)


@given(capacities, indices, st.data())
def test_frame_round_trips_at_any_index(capacity, index, data):
    payload = data.draw(st.binary(max_size=max_payload(capacity)))
    region = bytearray(b"\xee" * capacity)
    end = write_frame(memoryview(region), index, payload)
    assert end == index + frame_size(len(payload))
    assert read_frame(memoryview(region), index, frame_size(len(payload))) == (payload, end)
    # Only the frame's own bytes were written.
    touched = set(positions(capacity, index, PREFIX + len(payload)))
    assert all(region[i] == 0xEE for i in range(capacity) if i not in touched)


@pytest.mark.parametrize("base", [0, 2**40])
def test_every_offset_and_length_wraps_correctly(base):
    """Exhaustive over a small ring: every aligned start offset x every payload length."""
    capacity = 64
    for offset in range(0, capacity, ALIGN):
        for n in range(max_payload(capacity) + 1):
            payload = bytes((offset + n + k) % 251 for k in range(n))
            region = memoryview(bytearray(capacity))
            end = write_frame(region, base + offset, payload)
            assert read_frame(region, base + offset, end - base - offset) == (payload, end)


@given(capacities, indices, st.data())
def test_back_to_back_frames_read_back_in_order(capacity, index, data):
    """Frames written one after another, each while it fits, come back in order."""
    region = memoryview(bytearray(capacity))
    head = tail = index
    sent, received = [], []
    for payload in data.draw(st.lists(st.binary(max_size=max_payload(capacity)), max_size=30)):
        if frame_size(len(payload)) > capacity - (tail - head):
            while head != tail:  # drain, as the consumer would
                got, head = read_frame(region, head, tail - head)
                received.append(got)
        tail = write_frame(region, tail, payload)
        sent.append(payload)
    while head != tail:
        got, head = read_frame(region, head, tail - head)
        received.append(got)
    assert received == sent


@given(capacities, indices, st.integers(1, 2**63))
def test_length_beyond_published_bytes_is_corruption(capacity, index, claimed):
    """A length prefix that runs past the published bytes is reported, never trusted."""
    region = memoryview(bytearray(capacity))
    region[index % capacity : index % capacity + PREFIX] = claimed.to_bytes(PREFIX, "little")
    with pytest.raises(RingCorruptError, match=f"claims {claimed} payload bytes"):
        read_frame(region, index, min(frame_size(claimed) - ALIGN, capacity))
