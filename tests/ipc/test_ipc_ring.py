"""The ring protocol (lmpool_ipc.ring) in one process: a stateful property test drives
a producer and a consumer in random interleavings and checks the ring against a model
queue after every step; plus header validation."""

import mmap
from collections import deque

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lmpool_ipc.errors import RingCorruptError
from lmpool_ipc.frames import ALIGN, frame_size, max_payload
from lmpool_ipc.ring import HEADER_SIZE, VERSION, Ring, format_ring, ring_bytes


class RingMachine(RuleBasedStateMachine):
    """Model: the FIFO of payloads put and not yet taken, and the wake-up flags."""

    @initialize(capacity=st.integers(8, 40).map(lambda k: k * ALIGN), shift=st.integers(0, 39))
    def create(self, capacity, shift):
        self.buf = bytearray(ring_bytes(capacity))
        format_ring(self.buf, owner_pid=1)
        self.ring = Ring(self.buf)
        self.model: deque[bytes] = deque()
        self.consumer_asleep = False
        self.producer_need = 0
        # Start the indices at an arbitrary aligned offset, as after earlier traffic.
        for _ in range(shift):
            assert self.ring.try_put(b"") and self.ring.take() == b""

    def model_used(self) -> int:
        return sum(frame_size(len(p)) for p in self.model)

    @rule(data=st.data())
    def put(self, data):
        payload = data.draw(st.binary(max_size=max_payload(self.ring.capacity)))
        fits = frame_size(len(payload)) <= self.ring.capacity - self.model_used()
        assert self.ring.try_put(payload) == fits
        if fits:
            self.model.append(payload)
            # A consumer that declared itself asleep is woken exactly once.
            assert self.ring.take_consumer_wakeup() == self.consumer_asleep
            self.consumer_asleep = False

    @rule()
    def take(self):
        expected = self.model.popleft() if self.model else None
        assert self.ring.take() == expected
        # A producer that declared itself asleep is woken once its need is met.
        free = self.ring.capacity - self.model_used()
        wake = bool(self.producer_need) and free >= self.producer_need
        assert self.ring.take_producer_wakeup() == wake
        if wake:
            self.producer_need = 0

    @precondition(lambda self: not self.consumer_asleep)
    @rule()
    def consumer_parks(self):
        asleep = self.ring.park_consumer()
        assert asleep == (not self.model)  # refuses to sleep on a non-empty ring
        self.consumer_asleep = asleep

    @precondition(lambda self: not self.producer_need)
    @rule(data=st.data())
    def producer_parks(self, data):
        need = frame_size(data.draw(st.integers(0, max_payload(self.ring.capacity))))
        asleep = self.ring.park_producer(need)
        assert asleep == (self.ring.capacity - self.model_used() < need)
        self.producer_need = need if asleep else 0

    @invariant()
    def indices_are_consistent(self):
        ring = self.ring
        assert 0 <= ring.tail - ring.head <= ring.capacity
        assert ring.head % ALIGN == 0 and ring.tail % ALIGN == 0
        assert ring.used() == self.model_used()
        assert ring.free() + ring.used() == ring.capacity

    def teardown(self):
        self.ring.release()


TestRing = RingMachine.TestCase


def test_header_records_owner_and_capacity():
    buf = bytearray(ring_bytes(1024))
    format_ring(buf, owner_pid=4242)
    ring = Ring(buf)
    assert (ring.capacity, ring.owner_pid, ring.head, ring.tail) == (1024, 4242, 0, 0)
    assert (ring.producer_pid, ring.consumer_pid, ring.producer_closed) == (0, 0, False)
    ring.release()


@pytest.mark.parametrize("capacity", [0, 8, 60, 1028])
def test_capacity_must_be_aligned_and_not_tiny(capacity):
    with pytest.raises(ValueError, match="capacity"):
        format_ring(bytearray(HEADER_SIZE + capacity), owner_pid=1)


def test_bad_magic_is_rejected():
    with pytest.raises(RingCorruptError, match="magic"):
        Ring(bytearray(ring_bytes(1024)))


def test_other_format_version_is_rejected():
    buf = bytearray(ring_bytes(1024))
    format_ring(buf, owner_pid=1)
    buf[8:16] = (VERSION + 1).to_bytes(8, "little")
    with pytest.raises(RingCorruptError, match=f"version {VERSION + 1}"):
        Ring(buf)


def test_head_and_tail_on_separate_cache_lines():
    buf = bytearray(ring_bytes(1024))
    format_ring(buf, owner_pid=1)
    ring = Ring(buf)
    assert ring.try_put(b"abc")
    tail_at = buf.index(frame_size(3).to_bytes(8, "little"), 64)
    assert 64 <= tail_at < 128  # the tail is the first word of the producer's line
    ring.take()
    head_at = buf.index(frame_size(3).to_bytes(8, "little"), 128)
    assert 128 <= head_at < 192  # the head is the first word of the consumer's line
    ring.release()


def test_release_lets_the_mapping_close():
    with mmap.mmap(-1, ring_bytes(4096)) as buf:
        format_ring(buf, owner_pid=1)
        ring = Ring(buf)
        assert ring.try_put(b"x" * 100)
        ring.release()
    assert buf.closed
