"""Packed transfers in layer chunks (``lmpool/dataplane/chunked.py``) over a gloo pair in one
process: both ends cut alike, tapered chunks are small at the ends and never modelled worse
than near-equal ones, bytes arrive exact, a plan that ended drops its bytes, a failed chunk
fails the transfer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmpool.ops import reference
from lmpool.dataplane import TransportError
from lmpool.dataplane.chunked import (
    CHUNK_BYTES,
    EDGE_CTAS,
    MAX_CHUNKS,
    SHAPE,
    BlockReceiver,
    _grids,
    chunk_floor,
    chunk_tag,
    cut,
    default_max_ctas,
    layer_chunks,
    modelled_overhead,
    payload_bytes,
    send_blocks,
    tapered_chunks,
)
from transfer_testkit import block_ids, make_cache

WAIT_S = 10


@given(layers=st.integers(1, 96), nbytes=st.integers(0, 1 << 30), chunk=st.integers(1, 1 << 26))
def test_layer_chunks_cover_every_layer_once_in_near_equal_parts(layers, nbytes, chunk):
    parts = layer_chunks(layers, nbytes, chunk)
    assert parts[0][0] == 0 and parts[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    sizes = [end - first for first, end in parts]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert len(parts) <= MAX_CHUNKS
    assert len(parts) == 1 or nbytes // len(parts) >= chunk  # no chunk under the floor


@given(layers=st.integers(1, 96), nbytes=st.integers(0, 1 << 30), chunk=st.integers(1, 1 << 26),
       shape=st.sampled_from(["even^1.25", "even^2", "ends^1", "ends^1.5", "ends^3"]))
def test_shaped_chunks_are_as_many_as_near_equal_ones_and_smallest_at_the_ends(layers, nbytes, chunk, shape):
    even, shaped = cut(layers, nbytes, "even", chunk_bytes=chunk), cut(layers, nbytes, shape, chunk_bytes=chunk)
    assert len(shaped) == len(even) and shaped[0][0] == 0 and shaped[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(shaped, shaped[1:]))
    sizes = sizes_of(shaped)
    assert min(sizes) >= 1
    peak = sizes.index(max(sizes))
    assert sizes[:peak + 1] == sorted(sizes[:peak + 1]) and sizes[peak:] == sorted(sizes[peak:], reverse=True)
    assert all(abs(a - b) <= 1 for a, b in zip(sizes, reversed(sizes)))  # mirrored, within a layer
    if shape.startswith("ends") and len(sizes) > 2:  # the middle chunks near-equal
        assert max(sizes[1:-1]) - min(sizes[1:-1]) <= 1


def test_chunk_tags_differ_between_chunks_and_plans():
    tags = {chunk_tag(plan, i) for plan in range(50) for i in range(MAX_CHUNKS)}
    assert len(tags) == 50 * MAX_CHUNKS


@given(layers=st.integers(1, 96), chunks=st.integers(1, 40))
def test_a_chunk_count_is_honoured_within_the_layers_and_the_cap(layers, chunks):
    parts = layer_chunks(layers, 1 << 30, chunks=chunks)
    assert len(parts) == min(chunks, layers, MAX_CHUNKS)
    sizes = [end - first for first, end in parts]
    assert sum(sizes) == layers and max(sizes) - min(sizes) <= 1


def sizes_of(parts: list[tuple[int, int]]) -> list[int]:
    return [end - first for first, end in parts]


@given(layers=st.integers(1, 128), nbytes=st.integers(1, 1 << 36), chunks=st.none() | st.integers(1, 40),
       factor=st.sampled_from([1.0, 1.25, 2.0, 4.0, 10.0]))
def test_tapered_chunks_cover_every_layer_once_rising_then_falling(layers, nbytes, chunks, factor):
    parts = tapered_chunks(layers, nbytes, chunks, factor)
    assert parts[0][0] == 0 and parts[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    sizes = sizes_of(parts)
    assert min(sizes) >= 1 and len(parts) <= MAX_CHUNKS
    if chunks is not None:
        assert len(parts) == min(chunks, layers, MAX_CHUNKS)
    peak = sizes.index(max(sizes))
    assert sizes[:peak + 1] == sorted(sizes[:peak + 1])  # rising to the largest chunk
    assert sizes[peak:] == sorted(sizes[peak:], reverse=True)  # and falling after it
    assert all(abs(a - b) <= 1 for a, b in zip(sizes, reversed(sizes)))  # mirrored, within a layer


@given(layers=st.integers(1, 128), nbytes=st.integers(1, 1 << 36))
def test_the_tapered_plan_is_never_modelled_worse_than_near_equal_chunks(layers, nbytes):
    layer_bytes = nbytes / layers
    chosen = modelled_overhead(sizes_of(tapered_chunks(layers, nbytes)), layer_bytes)
    for k in range(1, min(layers, MAX_CHUNKS) + 1):
        assert chosen <= modelled_overhead(sizes_of(layer_chunks(layers, nbytes, chunks=k)), layer_bytes) + 1e-6


def test_a_small_payload_goes_whole_and_a_large_one_has_small_ends():
    block = 28 << 20  # a Qwen3-0.6B block in bf16: 28 layers of 1 MiB
    assert tapered_chunks(28, block) == [(0, 28)]  # one chunk's start-up outweighs its whole pack
    sizes = sizes_of(tapered_chunks(28, 64 * block))
    assert len(sizes) > 2 and max(sizes[0], sizes[-1]) < max(sizes) / 2


def test_cut_names_its_shapes_and_defaults_to_near_equal_chunks():
    assert list(cut(28, 1 << 30)) == list(cut(28, 1 << 30, SHAPE)) == layer_chunks(28, 1 << 30)
    eight = 8 * 28 << 20  # 8 chunks of a 28-layer payload
    assert sizes_of(cut(28, eight, "even^1.25", chunk_bytes=28 << 20)) == [2, 3, 4, 5, 5, 4, 3, 2]
    assert sizes_of(cut(28, eight, "ends^2", chunk_bytes=28 << 20)) == [2, 4, 4, 4, 4, 4, 4, 2]
    assert sizes_of(cut(28, eight, chunk_bytes=28 << 20)) == [3, 3, 4, 4, 4, 4, 3, 3]  # the larger in the middle
    assert cut(28, eight, "ends^1", chunk_bytes=28 << 20) == cut(28, eight, "even", chunk_bytes=28 << 20)
    assert list(cut(28, 1 << 30, "even", chunks=4)) == layer_chunks(28, 1 << 30, chunks=4)
    assert list(cut(28, 1 << 30, "taper")) == tapered_chunks(28, 1 << 30)
    assert cut(28, 3 << 30, "taper") is cut(28, 3 << 30, "taper")  # computed once per payload size
    assert list(cut(28, 1 << 30, "taper^2", chunks=8)) == tapered_chunks(28, 1 << 30, 8, factor=2)
    assert sizes_of(cut(28, 1 << 30, "taper^2", chunks=8)) == [1, 2, 4, 7, 7, 4, 2, 1]
    assert sizes_of(cut(28, 1 << 30, "taper^1", chunks=4)) == [7, 7, 7, 7]  # a factor of 1 is no taper
    for bad, match in (("spiral", "'even', 'taper', 'even\\^F', 'ends\\^F' or 'taper\\^F'"), ("ends", "'ends\\^F'"),
                       ("taper^x", "a number"), ("taper^0.5", "at least 1"), ("even^0", "at least 1")):
        with pytest.raises(ValueError, match=match):
            cut(28, 1 << 30, bad, chunks=4)


def test_layer_chunks_refuse_an_empty_payload_and_no_chunks():
    with pytest.raises(ValueError, match="at least one layer"):
        layer_chunks(0, 100)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        layer_chunks(4, 100, chunks=0)
    with pytest.raises(ValueError, match="at least one layer"):
        tapered_chunks(0, 100)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        tapered_chunks(4, 100, chunks=0)


@pytest.mark.parametrize("chunking, expected_chunks", [
    ({"shape": "even", "chunk_bytes": 1}, "most"),
    ({"shape": "even", "chunk_bytes": 10**9}, 1),
    ({"shape": "taper", "chunks": 3}, 3),
    ({"shape": "even", "chunk_bytes": 1, "max_ctas": 4, "edge_ctas": 0}, "most"),
    ({}, 1),  # the default: a payload this small goes whole
], ids=["even-most", "even-whole", "taper-3", "even-most-edge-grids", "default"])
def test_chunked_blocks_arrive_byte_equal(pair, chunking, expected_chunks):
    a, b = pair
    src, dst = make_cache(0), make_cache(1)
    expected = dst.clone()
    src_ids, dst_ids = block_ids(3, 5)
    reference.unpack_kv(expected, dst_ids, reference.pack_kv(src, src_ids))
    receiving = BlockReceiver(b, 0, reference, dst, dst_ids, plan_id=7, **chunking)
    sending = send_blocks(a, 1, reference, src, src_ids, plan_id=7, **chunking)
    receiving.wait(WAIT_S)
    sending.wait(WAIT_S)
    most = min(MAX_CHUNKS, src.shape[0])
    assert receiving.unpacked == (most if expected_chunks == "most" else expected_chunks)
    plan = {k: v for k, v in chunking.items() if k not in ("max_ctas", "edge_ctas")}  # grids do not cut
    assert len(cut(src.shape[0], payload_bytes(src, 5), **plan)) == receiving.unpacked
    assert torch.equal(dst, expected)


def test_the_transports_own_floor_cuts_both_ends_unless_an_argument_overrides_it(pair):
    """A transport naming its ``chunk_bytes`` (NCCL over several lanes) sets the floor of
    both ends' plans; an explicit ``chunk_bytes`` still wins."""
    a, b = pair
    assert chunk_floor(a) == CHUNK_BYTES and chunk_floor(a, 5) == 5
    a.chunk_bytes = b.chunk_bytes = 1
    try:
        assert chunk_floor(a) == 1 and chunk_floor(a, 10**9) == 10**9
        src, dst = make_cache(0), make_cache(1)
        expected = dst.clone()
        src_ids, dst_ids = block_ids(3, 5)
        reference.unpack_kv(expected, dst_ids, reference.pack_kv(src, src_ids))
        receiving = BlockReceiver(b, 0, reference, dst, dst_ids, plan_id=8)
        sending = send_blocks(a, 1, reference, src, src_ids, plan_id=8)
        receiving.wait(WAIT_S)
        sending.wait(WAIT_S)
        assert receiving.unpacked == min(MAX_CHUNKS, src.shape[0])  # a 1-byte floor: the most chunks
        assert torch.equal(dst, expected)
    finally:
        del a.chunk_bytes, b.chunk_bytes


def test_bytes_of_a_plan_that_ended_are_dropped(pair):
    a, b = pair
    src, dst = make_cache(0), make_cache(1)
    before = dst.clone()
    src_ids, dst_ids = block_ids(4, 3)
    open_plans = {9}
    receiving = BlockReceiver(b, 0, reference, dst, dst_ids, plan_id=9, wanted=lambda: 9 in open_plans,
                              shape="even", chunk_bytes=1)
    open_plans.clear()  # aborted while the bytes are on the wire
    send_blocks(a, 1, reference, src, src_ids, plan_id=9, shape="even", chunk_bytes=1).wait(WAIT_S)
    receiving.wait(WAIT_S)
    assert receiving.unpacked == 0 and torch.equal(dst, before)


def test_a_failed_chunk_fails_the_transfer(pair):
    """The sender's chunks are larger than the receiver expects: gloo's size check fails the
    first chunk, and the receive reports it instead of unpacking."""
    a, b = pair
    src = make_cache(0)
    small = make_cache(1)[:, :, :, :2].contiguous()  # blocks of 2 tokens instead of the sender's
    src_ids, dst_ids = block_ids(5, 2)
    receiving = BlockReceiver(b, 0, reference, small, dst_ids, plan_id=11)
    sending = send_blocks(a, 1, reference, src, src_ids, plan_id=11)
    with pytest.raises(TransportError, match="receive of 2 blocks from rank 0 \\(plan 11\\) failed"):
        receiving.wait(WAIT_S)
    assert receiving.unpacked == 0
    with pytest.raises(TransportError):
        sending.wait(WAIT_S)


def test_grid_caps_the_ends_apart_only_by_default_or_when_asked():
    """The default caps the chunks that overlap the wire and leaves the end chunks uncapped
    (``EDGE_CTAS``); a caller's cap covers every chunk unless it names the ends' own."""
    cache = make_cache(0)
    assert _grids(cache, None, None) == (default_max_ctas(cache.device), EDGE_CTAS)
    assert _grids(cache, 8, None) == (8, 8)
    assert _grids(cache, 8, 0) == (8, 0)
    assert _grids(cache, None, 5) == (default_max_ctas(cache.device), 5)
    assert default_max_ctas(torch.device("cpu")) == 0  # no grid to cap

