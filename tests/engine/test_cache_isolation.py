"""Tenant isolation in the prefix cache: 256-bit block hashes, a per-request ``cache_salt``
in the first block's hash (so in every later one), and hits verified along their chain."""

from __future__ import annotations

from lmpool import LLM, SamplingParams
from lmpool.engine.block_manager import BlockManager
from lmpool.engine.hashing import HASH_BYTES, ROOT_HASH, block_hash, chain_hashes
from lmpool.engine.sequence import Sequence

BLOCK = 4


def cached(bm: BlockManager, tokens: list[int], salt: str | None = None) -> Sequence:
    """Run ``tokens`` through ``bm`` as a finished prefill, so its complete blocks are cached."""
    seq = Sequence(f"s{len(bm.hash_to_block)}", tokens, SamplingParams(max_tokens=1, cache_salt=salt), BLOCK)
    bm.admit(seq, bm.match_prefix(seq))
    bm.grow(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.commit(seq)
    return seq


def hit_blocks(bm: BlockManager, tokens: list[int], salt: str | None = None) -> int:
    return len(bm.match_prefix(Sequence("q", tokens, SamplingParams(max_tokens=1, cache_salt=salt), BLOCK)))


def test_hashes_are_256_bit_and_salted_along_the_chain():
    tokens = list(range(12))
    plain, a, b = (chain_hashes(tokens, BLOCK, salt=s) for s in (None, "tenant-a", "tenant-b"))
    assert all(len(h) == HASH_BYTES for h in plain + a + b)
    assert plain == chain_hashes(tokens, BLOCK) and a == chain_hashes(tokens, BLOCK, salt="tenant-a")
    for i in range(3):  # the salt enters block 0 only, yet every block differs
        assert len({plain[i], a[i], b[i]}) == 3
    assert block_hash(ROOT_HASH, tokens[:4]) != block_hash(plain[0], tokens[:4])


def test_a_tenant_hits_only_its_own_salt():
    bm = BlockManager(16, BLOCK)
    prompt = list(range(9))
    cached(bm, prompt, salt="alice")
    assert hit_blocks(bm, prompt, salt="alice") == 2
    assert hit_blocks(bm, prompt, salt="mallory") == 0
    assert hit_blocks(bm, prompt) == 0


def test_a_hit_is_verified_along_its_parent_chain():
    """A block whose hash (say, by a collision) and tokens match is still no hit unless its
    cached parent is the hit's previous block."""
    bm = BlockManager(16, BLOCK)
    x = cached(bm, [1, 1, 1, 1, 2, 2, 2, 2, 9])
    cached(bm, [3, 3, 3, 3, 7])
    probe = Sequence("q", [3, 3, 3, 3, 2, 2, 2, 2, 9], SamplingParams(max_tokens=1), BLOCK)
    probe.block_hashes[1] = x.block_hashes[1]  # collides with x's second block, same tokens
    assert len(bm.match_prefix(probe)) == 1


def test_llm_cache_salt_separates_tenants(tiny_model):
    prompt = list(range(100, 180))
    with LLM(tiny_model, block_size=16) as llm:
        def cached_tokens(salt):
            params = SamplingParams(temperature=0, max_tokens=1, cache_salt=salt)
            return llm.generate([prompt], params)[0].num_cached_tokens

        assert cached_tokens("alice") == 0
        assert cached_tokens("alice") == 64
        assert cached_tokens("bob") == 0
        assert cached_tokens(None) == 0
