"""A destination that makes room for a received chain never evicts the cached block that chain
continues (a route-time pull's anchor): prepare pins it and its ancestors, and publish or
abort releases them, so the block accounting holds and nothing stays pinned."""

from __future__ import annotations

import pytest
from block_testkit import prefill

from lmpool.dataplane.transactions import TransferParticipant
from lmpool.engine.block_manager import BlockManager, BlockState, StaleBlockError
from lmpool.engine.hashing import block_hash

BLOCK = 4


def cached_leaf(bm: BlockManager, tokens: list[int], name: str) -> tuple[bytes, int, int]:
    """Prefill ``tokens`` and free it: (leaf hash, its generation, its block id), reclaimable."""
    seq = prefill(bm, tokens, name)
    leaf_id = seq.block_table[len(tokens) // BLOCK - 1]
    bm.free(seq)
    block = bm.blocks[leaf_id]
    assert block.state is BlockState.RECLAIMABLE
    return block.block_hash, block.generation, leaf_id


@pytest.mark.parametrize("end", ["publish", "abort"])
def test_the_anchor_survives_an_allocation_that_evicts_every_other_cached_block(end):
    bm = BlockManager(6, BLOCK)
    anchor, generation, anchor_id = cached_leaf(bm, [1] * 8, "a")  # 2 blocks, oldest: evicted first otherwise
    cached_leaf(bm, [2] * 8, "b")  # 2 more cold blocks
    p = TransferParticipant(bm)
    plan = p.prepare_dest(7, 4, anchor, generation)  # 2 free + 2 reclaimable from "b"
    assert bm.hash_to_block[anchor] == anchor_id and bm.blocks[anchor_id].ref_count == 1
    bm.check_invariants(p.held_blocks())
    if end == "publish":
        p.executed(7)
        parents, hashes = [anchor], []
        for _ in range(4):
            hashes.append(block_hash(parents[-1], [5] * BLOCK))
            parents.append(hashes[-1])
        parents.pop()
        p.publish(7, hashes, parents, [[5] * BLOCK] * 4)
        assert all(h in bm.hash_to_block for h in hashes), "the chain continues the anchor"
    else:
        p.abort(7)
    assert not p.held_blocks() and bm.num_used == 0
    bm.check_invariants([])
    assert plan.block_ids and bm.blocks[anchor_id].state is BlockState.RECLAIMABLE


def test_a_stale_anchor_fails_prepare_and_a_failed_allocation_unpins_it():
    bm = BlockManager(4, BLOCK)
    anchor, generation, anchor_id = cached_leaf(bm, [1] * 8, "a")
    p = TransferParticipant(bm)
    with pytest.raises(StaleBlockError):
        p.prepare_dest(1, 1, anchor, generation + 1)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        p.prepare_dest(2, 3, anchor, generation)  # 2 free; the anchored 2 cannot be taken
    assert bm.blocks[anchor_id].ref_count == 0 and not p.held_blocks()
    bm.check_invariants([])
