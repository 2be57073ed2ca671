"""Shared by the block-level tests: put a prompt's KV on a BlockManager as a prefill would."""

from __future__ import annotations

from lmpool.engine.block_manager import BlockManager
from lmpool.engine.sequence import Sequence
from lmpool.sampling_params import SamplingParams

GREEDY_ONE = SamplingParams(temperature=0, max_tokens=1)


def prefill(bm: BlockManager, tokens: list[int], name: str) -> Sequence | None:
    """Prefill ``tokens`` on ``bm`` and keep the sequence running: its complete blocks are
    cached and referenced by it (None, and nothing changed, if it does not fit)."""
    seq = Sequence(name, tokens, GREEDY_ONE, bm.block_size)
    hit = bm.match_prefix(seq)
    if not bm.can_admit(hit, bm.blocks_needed(len(seq)) - len(hit)):
        return None
    bm.admit(seq, hit)
    bm.grow(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)
    return seq
