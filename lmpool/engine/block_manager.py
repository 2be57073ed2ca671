"""A replica's KV block allocator and prefix cache: the authority on its blocks.

Block life cycle: FREE -> WRITING (allocated, KV being computed) -> READY (full
and computed) -> RECLAIMABLE (no references left, still cached) -> FREE. A prefix
hit revives a RECLAIMABLE block. Invariants, checked by ``check_invariants``:

- every block is in exactly one state; FREE blocks are exactly the free list;
- ``ref_count`` equals the number of sequence block tables holding the block,
  and is 0 exactly for FREE and RECLAIMABLE blocks;
- a cached block (one in ``hash_to_block``) is READY or RECLAIMABLE, and its
  cached parent is resident: a block is only cached when the same sequence's
  previous block is the cached copy of its parent, so any reference to a cached
  child also references its parent, and reclamation takes leaves first;
- ``free + used + reclaimable == num_blocks``.

Reclamation picks, among reclaimable leaves, the least frequently hit and then
the least recently used block. Hashes are 256-bit (``hashing``), and every hit is
verified along its chain: each block's own tokens, and its cached parent being the
previous block of the hit (the first block's having none), so even a collision could
not serve another prefix's KV.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Iterable

from lmpool.engine.hashing import ROOT_HASH, BlockHash, short
from lmpool.engine.sequence import Sequence, token_array
from lmpool.protocol.kv_events import BlockRemoved, BlockStored, KVDelta, KVEvent, KVSnapshot


class StaleBlockError(ValueError):
    """A transfer named a block that is no longer cached here under that generation."""


class BlockState(enum.Enum):
    FREE = "free"
    WRITING = "writing"
    READY = "ready"
    RECLAIMABLE = "reclaimable"


class Block:
    __slots__ = (
        "block_id", "state", "ref_count", "generation", "block_hash", "parent_id",
        "token_ids", "token_bytes", "num_cached_children", "hits", "last_access",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.state = BlockState.FREE
        self.ref_count = 0
        self.generation = 0  # bumped at every allocation, so stale references are detectable
        self.block_hash: BlockHash | None = None  # set while the block is cached
        self.parent_id: int | None = None  # the cached parent block, while cached
        self.token_ids: tuple[int, ...] = ()
        self.token_bytes = b""  # the same ids as int32 bytes (``Sequence.block_bytes``): what a hit compares
        self.num_cached_children = 0
        self.hits = 0
        self.last_access = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.hash_to_block: dict[BlockHash, int] = {}
        self.num_reclaimable = 0
        # (hits, last_access, block_id) of reclaimable leaves; stale entries are skipped on pop.
        self._reclaim_heap: list[tuple[int, int, int]] = []
        self._clock = 0
        self.version = 0
        self._events: list[KVEvent] = []
        self._events_from = 0

    # ---- capacity -------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self.num_reclaimable

    @property
    def num_available(self) -> int:
        """Blocks an allocation can obtain: free ones plus reclaimable cached ones."""
        return self.num_free + self.num_reclaimable

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- prefix cache ---------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding ``seq``'s longest prefix, leaving at least one token to compute.

        The last prompt token must run through the model to produce logits, so a
        prompt that is entirely cached still recomputes its final block.
        """
        if not self.enable_prefix_caching:
            return []
        # The cache changes only with an event (``version``), and a sequence's match only as it
        # grows: a question matched when its worker reports its cached prefix and again when it is
        # scheduled, with nothing cached or reclaimed between, is matched once.
        memo = seq.prefix_match
        if memo is not None and memo[0] is self and memo[1] == self.version and memo[2] == len(seq):
            return list(memo[3])
        max_blocks = (len(seq) - 1) // self.block_size
        hit: list[int] = []
        for i, h in enumerate(seq.block_hashes[:max_blocks]):
            block_id = self.hash_to_block.get(h)
            if block_id is None or not self._continues(self.blocks[block_id], hit, seq.block_bytes(i)):
                break
            hit.append(block_id)
        seq.prefix_match = (self, self.version, len(seq), tuple(hit))
        return hit

    @staticmethod
    def _continues(block: Block, hit: list[int], token_bytes: bytes) -> bool:
        """True if ``block`` holds the tokens of ``token_bytes`` (int32 ids) and hangs off the last
        block of ``hit`` (off nothing, for the first): a hit is checked along its whole chain, not
        block by block. Bytes, not tuples: a 16k prompt's 64 blocks compare in microseconds."""
        return block.parent_id == (hit[-1] if hit else None) and block.token_bytes == token_bytes

    def can_admit(self, hit: list[int], num_fresh: int) -> bool:
        # Reviving a reclaimable hit takes it out of the reclaimable pool.
        revived = sum(1 for b in hit if self.blocks[b].state is BlockState.RECLAIMABLE)
        return num_fresh <= self.num_available - revived

    # ---- allocation -----------------------------------------------------------

    def admit(self, seq: Sequence, hit: list[int]) -> None:
        """Take references on the prefix hit; the sequence starts computing after it."""
        assert not seq.block_table, "sequence already holds blocks"
        for block_id in hit:
            self._reference(self.blocks[block_id])
            self._touch(self.blocks[block_id], hit=True)
        seq.block_table = list(hit)
        seq.num_computed_tokens = len(hit) * self.block_size
        seq.num_ready_blocks = len(hit)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` enough blocks to hold its first ``num_tokens`` tokens."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need > self.num_available:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_available} available")
        for _ in range(need):
            seq.block_table.append(self._allocate_one())

    def allocate_blocks(self, n: int) -> list[int]:
        """``n`` fresh WRITING blocks owned by the caller (one reference each)."""
        if n > self.num_available:
            raise RuntimeError(f"out of KV blocks: need {n}, {self.num_available} available")
        return [self._allocate_one() for _ in range(n)]

    def _allocate_one(self) -> int:
        if not self.free_ids:
            self._reclaim_one()
        block = self.blocks[self.free_ids.popleft()]
        block.state = BlockState.WRITING
        block.ref_count = 1
        block.generation += 1
        self._touch(block, hit=False)
        block.hits = 0
        return block.block_id

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; cached blocks stay reclaimable, the rest become free."""
        for block_id in reversed(seq.block_table):
            self.release(block_id)
        seq.block_table = []
        seq.num_ready_blocks = 0

    def _reference(self, block: Block) -> None:
        """One more holder of a cached or in-use block; a reclaimable one is revived."""
        if block.state is BlockState.RECLAIMABLE:
            block.state = BlockState.READY
            self.num_reclaimable -= 1
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} released more often than referenced"
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.block_hash is None:
            block.state = BlockState.FREE
            self.free_ids.append(block_id)
        else:
            block.state = BlockState.RECLAIMABLE
            self.num_reclaimable += 1
            self._push_if_leaf(block)

    # ---- readiness and caching ------------------------------------------------

    def commit(self, seq: Sequence) -> None:
        """Mark blocks whose tokens are all computed READY and cache them."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_ready_blocks, full):
            block = self.blocks[seq.block_table[i]]
            block.state = BlockState.READY
            if self.enable_prefix_caching:
                self._cache(block, seq, i)
        seq.num_ready_blocks = max(seq.num_ready_blocks, full)

    def _cache(self, block: Block, seq: Sequence, index: int) -> None:
        block_hash = seq.block_hashes[index]
        if block.block_hash is not None or block_hash in self.hash_to_block:
            return  # already cached, or another copy holds this prefix
        parent_hash = seq.block_hashes[index - 1] if index else ROOT_HASH
        parent_id = None
        if index:
            parent_id = seq.block_table[index - 1]
            if self.hash_to_block.get(parent_hash) != parent_id:
                return  # only the cached parent's own child joins the chain
            self.blocks[parent_id].num_cached_children += 1
        block.block_hash = block_hash
        block.parent_id = parent_id
        tokens = seq.block_tokens(index)
        block.token_ids, block.token_bytes = tuple(tokens), tokens.tobytes()
        self.hash_to_block[block_hash] = block.block_id
        self._emit(BlockStored(block_hash, parent_hash, block.block_id, block.generation, block.token_ids))

    # ---- transfers ------------------------------------------------------------

    def pin_cached(self, block_hashes: list[BlockHash], generations: list[int]) -> tuple[list[int], list[int]]:
        """Reference the cached blocks holding ``block_hashes`` (a transfer's source), so they
        cannot be reclaimed while their bytes move. All or nothing: if any block is no longer
        cached, or was reused under another generation, nothing is pinned.

        The cached ancestors of every block are pinned too: a referenced block must
        never hang off a reclaimable parent, or leaf-first reclamation could stall.
        Returns (the blocks, every block pinned).
        """
        ids = []
        for h, generation in zip(block_hashes, generations, strict=True):
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].generation != generation:
                raise StaleBlockError(f"block {short(h)} generation {generation} is no longer cached here")
            ids.append(block_id)
        pinned = list(ids)
        seen = set(ids)
        for block_id in ids:  # a plan may carry several chains: pin each one's ancestors
            parent = self.blocks[block_id].parent_id
            while parent is not None and parent not in seen:
                seen.add(parent)
                pinned.append(parent)
                parent = self.blocks[parent].parent_id
        for block_id in pinned:
            self._reference(self.blocks[block_id])
        return ids, pinned

    def publish_received(
        self,
        block_ids: list[int],
        block_hashes: list[BlockHash],
        parent_hashes: list[BlockHash],
        token_ids: list[list[int]],
    ) -> None:
        """Make blocks that received a transfer visible in the prefix cache, parents first, then
        drop the transfer's references (they stay cached, reclaimable).

        A block joins the cache only if its parent is cached here (the chain stays
        contiguous) and no other copy holds its hash; otherwise it is simply freed.
        """
        for block_id, h, parent, tokens in zip(block_ids, block_hashes, parent_hashes, token_ids, strict=True):
            block = self.blocks[block_id]
            if block.state is not BlockState.WRITING or block.block_hash is not None:
                raise ValueError(f"block {block_id} is not a reserved transfer destination")
            if len(tokens) != self.block_size:
                raise ValueError(f"block {short(h)} carries {len(tokens)} tokens, not {self.block_size}")
            token_bytes = token_array(tokens).tobytes()  # before any change: an id past int32 changes nothing
            block.state = BlockState.READY
            parent_id = None if parent == ROOT_HASH else self.hash_to_block.get(parent)
            if h in self.hash_to_block or (parent != ROOT_HASH and parent_id is None):
                continue
            if parent_id is not None:
                self.blocks[parent_id].num_cached_children += 1
            block.block_hash, block.parent_id, block.token_ids = h, parent_id, tuple(tokens)
            block.token_bytes = token_bytes
            self.hash_to_block[h] = block_id
            self._emit(BlockStored(h, parent, block_id, block.generation, block.token_ids))
        for block_id in block_ids:
            self.release(block_id)

    def drop_unreferenced_suffix(self, block_ids: list[int]) -> list[int]:
        """Reclaim the blocks of ``block_ids`` (parents before children) from the end backwards
        that nobody references and no cached child hangs off (the source side of a move);
        return the freed ids.

        A block that must stay keeps its ancestors too (they still have a cached child), so
        of one chain exactly an unreferenced suffix goes; of several chains, each one's."""
        freed = []
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.state is not BlockState.RECLAIMABLE or block.num_cached_children:
                continue
            self._uncache(block)
            freed.append(block_id)
        return freed

    def forget_cached(self) -> int:
        """Uncache every cached block nobody references, leaves first as reclamation takes them
        (each removal an event); return how many. A block in use keeps its hash, and so do its
        cached ancestors: on an idle manager nothing stays cached."""
        dropped = 0
        while self._reclaim_heap:
            hits, last_access, block_id = heapq.heappop(self._reclaim_heap)
            block = self.blocks[block_id]
            if (block.state is BlockState.RECLAIMABLE and block.num_cached_children == 0
                    and (block.hits, block.last_access) == (hits, last_access)):
                self._uncache(block)  # its parent, a leaf now, joins the heap
                dropped += 1
        return dropped

    def eviction_order(self, n: int, exclude: Iterable[int] = ()) -> list[int]:
        """The first ``n`` blocks (or fewer) reclamation would take, in order, without taking
        them: cold cached blocks that nobody references, leaves first. A block in ``exclude``
        (say, a waiting sequence's own prefix hit) is never named, nor are its ancestors
        through it."""
        skip = set(exclude)
        heap = []
        for hits, last_access, block_id in self._reclaim_heap:
            block = self.blocks[block_id]
            if (block_id not in skip and block.state is BlockState.RECLAIMABLE and not block.num_cached_children
                    and (block.hits, block.last_access) == (hits, last_access)):
                heap.append((hits, last_access, block_id))
                skip.add(block_id)  # the heap may hold an entry twice
        heapq.heapify(heap)
        taken: list[int] = []
        children_taken: dict[int, int] = {}
        excluded = set(exclude)
        while heap and len(taken) < n:
            block_id = heapq.heappop(heap)[2]
            taken.append(block_id)
            parent_id = self.blocks[block_id].parent_id
            if parent_id is None or parent_id in excluded:
                continue
            parent = self.blocks[parent_id]
            children_taken[parent_id] = children_taken.get(parent_id, 0) + 1
            if parent.state is BlockState.RECLAIMABLE and children_taken[parent_id] == parent.num_cached_children:
                heapq.heappush(heap, (parent.hits, parent.last_access, parent_id))
        return taken

    # ---- reclamation ----------------------------------------------------------

    def _push_if_leaf(self, block: Block) -> None:
        if block.state is BlockState.RECLAIMABLE and block.num_cached_children == 0:
            heapq.heappush(self._reclaim_heap, (block.hits, block.last_access, block.block_id))

    def _reclaim_one(self) -> None:
        while self._reclaim_heap:
            hits, last_access, block_id = heapq.heappop(self._reclaim_heap)
            block = self.blocks[block_id]
            if (
                block.state is BlockState.RECLAIMABLE
                and block.num_cached_children == 0
                and (block.hits, block.last_access) == (hits, last_access)
            ):
                self._uncache(block)
                return
        raise RuntimeError("no reclaimable block left")  # guarded by num_available

    def _uncache(self, block: Block) -> None:
        assert block.block_hash is not None
        del self.hash_to_block[block.block_hash]
        self._emit(BlockRemoved(block.block_hash, block.block_id, block.generation))
        if block.parent_id is not None:
            parent = self.blocks[block.parent_id]
            parent.num_cached_children -= 1
            self._push_if_leaf(parent)
        block.block_hash = None
        block.parent_id = None
        block.token_ids, block.token_bytes = (), b""
        block.state = BlockState.FREE
        self.num_reclaimable -= 1
        self.free_ids.append(block.block_id)

    def _touch(self, block: Block, hit: bool) -> None:
        self._clock += 1
        block.last_access = self._clock
        if hit:
            block.hits += 1

    # ---- reports for the control plane ---------------------------------------

    def _emit(self, event: KVEvent) -> None:
        self._events.append(event)
        self.version += 1

    @property
    def has_pending_events(self) -> bool:
        return bool(self._events)

    def drain_delta(self) -> KVDelta:
        """Events since the previous drain, as one versioned delta."""
        delta = KVDelta(self._events_from, self.version, self._events)
        self._events = []
        self._events_from = self.version
        return delta

    def snapshot(self) -> KVSnapshot:
        blocks = []
        for block_hash, block_id in self.hash_to_block.items():
            block = self.blocks[block_id]
            parent = self.blocks[block.parent_id].block_hash if block.parent_id is not None else ROOT_HASH
            assert parent is not None  # a cached block's parent is cached
            blocks.append(BlockStored(block_hash, parent, block_id, block.generation, block.token_ids))
        return KVSnapshot(self.version, blocks)

    # ---- invariants (tests and debugging) -------------------------------------

    def check_invariants(self, block_tables: list[list[int]]) -> None:
        refs = [0] * self.num_blocks
        for table in block_tables:
            for block_id in table:
                refs[block_id] += 1
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is twice in the free list"
        counts = {state: 0 for state in BlockState}
        for block in self.blocks:
            counts[block.state] += 1
            assert block.ref_count == refs[block.block_id], f"block {block.block_id} ref count"
            assert (block.state is BlockState.FREE) == (block.block_id in free)
            assert (block.ref_count == 0) == (block.state in (BlockState.FREE, BlockState.RECLAIMABLE))
            if block.block_hash is not None:
                assert block.state in (BlockState.READY, BlockState.RECLAIMABLE)
                assert self.hash_to_block[block.block_hash] == block.block_id
                if block.parent_id is not None:
                    parent = self.blocks[block.parent_id]
                    assert parent.block_hash is not None, "cached child without its parent"
            else:
                assert block.state is not BlockState.RECLAIMABLE
        children = [0] * self.num_blocks
        for block_id in self.hash_to_block.values():
            parent_id = self.blocks[block_id].parent_id
            if parent_id is not None:
                children[parent_id] += 1
        assert children == [b.num_cached_children for b in self.blocks], "child counts"
        assert counts[BlockState.RECLAIMABLE] == self.num_reclaimable
        assert self.num_free + self.num_used + self.num_reclaimable == self.num_blocks
