"""``HostKVView``: the host's replicas' KV events as one worker's, as smg indexes a gRPC worker.

A block is stored for the host at its first copy and removed at its last; one rank's clear
removes only what no other rank holds; the snapshot and the batches after it reproduce the
host's set; a resume from a number the host never sent, or no longer holds, is refused."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lmpool.frontend.grpc.host_events import HostKVView
from lmpool.protocol.vllm_kv_events import event_types

T = event_types(True)
SIZE = 2


def stored(hashes, parent=None):
    return T.stored(list(hashes), parent, [h * 10 + i for h in hashes for i in range(SIZE)], SIZE, None, "GPU", None)


def replay(batches) -> dict[int, tuple]:
    """hash -> its tokens, applying host batches as smg would."""
    state: dict[int, tuple] = {}
    for batch in batches:
        for event in batch.events:
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                state.clear()
            elif kind == "BlockRemoved":
                for h in event.block_hashes:
                    assert h in state, "a removal of a block the host never stored"
                    del state[h]
            else:
                for i, h in enumerate(event.block_hashes):
                    assert h not in state, "a block stored twice for the host"
                    state[h] = tuple(event.token_ids[i * SIZE:(i + 1) * SIZE])
    return state


def test_a_block_on_two_ranks_is_one_host_block_until_its_last_copy_goes():
    view = HostKVView(base_seq=0)
    first = view.apply(0, [stored([1, 2])])
    assert [type(e).__name__ for e in first.events] == ["BlockStored"] and first.seq == 1
    # Rank 1 caches the same first block and a new second one: only the new one is news,
    # chained onto the shared block.
    second = view.apply(1, [stored([1, 3])])
    assert second.events[0].block_hashes == [3] and second.events[0].parent_block_hash == 1
    assert view.apply(1, [T.removed([1], "GPU")]) is None  # rank 0 still holds block 1
    cleared = view.apply(0, [T.cleared()])
    assert sorted(cleared.events[0].block_hashes) == [1, 2]
    assert replay([view.snapshot()]) == {3: (30, 31)}


def test_resuming_from_a_number_not_held_is_refused():
    view = HostKVView(buffer_batches=2, base_seq=100)
    assert view.since(101) == [] and view.since(100) is None  # before this host's first batch
    for h in range(1, 4):
        view.apply(0, [stored([h])])
    assert [b.seq for b in view.since(102)] == [102, 103]
    assert view.since(101) is None  # rolled out of the buffer
    assert view.since(105) is None  # never sent


def test_a_restarted_host_never_reuses_its_predecessors_numbers():
    old = HostKVView()
    for h in range(5):
        old.apply(0, [stored([h])])
    assert HostKVView().since(old.seq + 1) is None


ops = st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]), st.integers(0, 2),
                         st.lists(st.integers(1, 6), min_size=1, max_size=4, unique=True)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(0, 40))
def test_the_host_holds_the_union_of_its_ranks(operations, cut):
    """Any sequence of rank events: the host batches, and a snapshot taken part way followed by
    the batches after it, both give exactly the blocks some rank holds."""
    view, ranks, batches = HostKVView(base_seq=0), {0: set(), 1: set(), 2: set()}, []
    snapshot, after = None, []
    for i, (op, rank, hashes) in enumerate(operations):
        if i == cut:
            snapshot = view.snapshot()
        event = stored(hashes) if op == "store" else T.removed(hashes, "GPU") if op == "remove" else T.cleared()
        ranks[rank] = ranks[rank] | set(hashes) if op == "store" else ranks[rank] - set(hashes) if op == "remove" \
            else set()
        batch = view.apply(rank, [event])
        if batch is not None:
            batches.append(batch)
            if snapshot is not None:
                after.append(batch)
    union = set().union(*ranks.values())
    assert set(replay(batches)) == union
    if snapshot is not None:
        assert [b.seq for b in view.since(snapshot.seq + 1)] == [b.seq for b in after]
        assert set(replay([snapshot, *after])) == union
