"""A replica's first measurements of its own step time, taken once before it serves.

A pool's control plane fits each rank's step time to the shape of its batches
(``lmpool.control.pricing.step_model``) from the steps the rank runs. Before the first
request there are none, so a worker first runs a few synthetic requests whose steps span
the shapes the fit tells apart: one short sequence decoding alone; a batch of short prompts
prefilled together, then decoding together; one long prompt (its attention grows with its
square), then decoding at a long context; and, where the engine decodes shared prefixes once
(cascades), a batch of short questions about that prompt decoding as a cascade (its prefix
pass's pairs, which nothing else times). A warm-up round runs first and is not kept (a first
step pays one-time costs), and so does a prompt of the long one's length (a first prompt of a
length pays for the attention kernels built for its shape).

Invariants: nothing it computes stays cached: the prefix cache is off while it runs, except,
for an engine that runs cascades, from the long prompt on, so its questions share its blocks;
every block cached from then is dropped again (its store and removal events net to nothing,
and a worker's first report is a snapshot anyway). Every request is gone, its blocks free,
when it returns; a request that could not fit is left out rather than failing the worker, and
so are questions that could not run as a cascade. A script holds at most half the cache (the
questions, besides their prompt). It costs a few hundred milliseconds (more on a slow CPU,
whose long prompt is at least ``LONG_MIN`` short ones).
"""

from __future__ import annotations

import random

from lmpool.engine.block_manager import BlockManager
from lmpool.engine.core import EngineCore
from lmpool.protocol.base import BlockHash, StepSample
from lmpool.sampling_params import SamplingParams

BATCH = 16  # short requests decoding together (and questions about the long prompt)
SHORT = 64  # their prompt tokens (a question's own, after the long prompt's whole blocks)
DECODE = 8  # tokens each short request generates (the long one: half as many)
LONG_S = 0.05  # the long prompt's length is what its linear part prefills in this long at the batch's pace
LONG_MIN = 8  # ... and at least this many short prompts' length (its attention per token 8x theirs)

Script = list[tuple[list[int], int]]  # prompts and the tokens each generates


def calibrate(core: EngineCore, seed: int = 0) -> list[StepSample]:
    """Time synthetic steps on ``core`` (idle, with no request in it); the samples."""
    if core.has_unfinished():
        raise ValueError("calibration needs an idle engine")
    bm, cfg = core.block_manager, core.config
    rng, vocab = random.Random(seed), core.model_config.vocab_size
    room = bm.num_blocks * bm.block_size // 2  # tokens a script may hold at once
    short = max(1, min(SHORT, room // 4))
    batch = max(1, min(BATCH, cfg.max_num_seqs, room // (short + DECODE)))
    longest = max(1, min(cfg.max_num_batched_tokens, core.max_model_len - DECODE, room - DECODE))
    caching, bm.enable_prefix_caching = bm.enable_prefix_caching, False
    cascades = caching and core.runner.cascade_min_saved > 0
    cached = set(bm.hash_to_block)
    kept: list[StepSample] = []
    try:
        for i, lengths in enumerate([[short], [short], [short] * batch]):
            core.take_step_samples()
            _run(core, [(_tokens(rng, vocab, n), DECODE) for n in lengths], f"calibration-{i}")
            if i:  # the first is the warm-up
                kept += core.take_step_samples()
        n = long_prompt_length(kept, longest, min(longest, LONG_MIN * short))
        # Its length warmed first, as the short batch is, and not kept: a first prompt of a
        # length paid once for what dense attention built per shape (on an H200, cuDNN took
        # 43-1,100 ms against the prompt's few), which priced every attention pair ~50x its time.
        # The engine now builds those plans at start (``dense_attention.warm``); this still takes
        # whatever else a first step of this size pays once.
        _run(core, [(_tokens(rng, vocab, n), 1)], "calibration-long-warm-up")
        core.take_step_samples()
        long = _tokens(rng, vocab, n)
        bm.enable_prefix_caching = cascades  # its blocks cached for the questions about it
        _run(core, [(long, DECODE // 2)], "calibration-long")
        kept += core.take_step_samples()
        if cascades:
            _run(core, _questions(core, rng, long, batch, short, room), "calibration-questions")
            kept += core.take_step_samples()
    finally:
        try:
            for request_id in [r for r in core.requests if r.startswith("calibration-")]:
                core.abort_request(request_id)
            while core.has_unfinished():  # an overlapped step may still hold a finished one's token
                core.step()
        finally:  # the cache as it was, even where a step failed
            _uncache_since(bm, cached)
            bm.enable_prefix_caching = caching
            core.take_step_samples()
    return kept


def long_prompt_length(kept: list[StepSample], longest: int, floor: int) -> int:
    """As long a prompt as the short batch's measured pace prefills in ``LONG_S`` (attention grows
    faster than that on a CPU), ``longest`` (one chunk) at most; and never under ``floor`` tokens:
    on a slow or loaded machine the pace alone would leave the long prompt's attention per token
    too like the short ones' for the fit to tell them apart. The pace is the step that prefilled
    the most tokens, the batch's, not a lone short prompt's: that step's fixed cost spread over
    its 64 tokens made the pace ~5x too slow, and the prompt so short (about 1,000 tokens on an
    H100 quarter) that its attention was a tenth of its step, which then priced a pair 7-20x
    what a 16k document's chunks took."""
    batch = max((s for s in kept if s.prefill_tokens > 0 and s.seconds > 0), key=lambda s: s.prefill_tokens,
                default=None)
    if batch is None:
        return longest
    return min(longest, max(floor, int(LONG_S * batch.prefill_tokens / batch.seconds)))


def _questions(core: EngineCore, rng: random.Random, document: list[int], batch: int, short: int,
               room: int) -> Script:
    """Up to ``batch`` short questions about ``document``: its whole blocks, then ``short`` tokens
    of their own (fewer where the context runs out), as many as ``room`` holds besides it; none
    where their decode steps would not save the key reads that make them a cascade."""
    block = core.config.block_size
    shared = (len(document) - 1) // block * block  # at least a token short of it: room for their own
    own = min(short, core.max_model_len - DECODE - shared)
    rows = min(batch, room // (own + DECODE + block))
    if rows < 2 or (rows - 1) * shared < core.runner.cascade_min_saved:
        return []
    vocab = core.model_config.vocab_size
    return [(document[:shared] + _tokens(rng, vocab, own), DECODE) for _ in range(rows)]


def _uncache_since(bm: BlockManager, cached: set[BlockHash]) -> None:
    """Drop every block cached since the cache held ``cached``: in caching order (each after its
    parent), so backwards each leaf goes before its parent."""
    bm.drop_unreferenced_suffix([block for h, block in bm.hash_to_block.items() if h not in cached])


def _tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _run(core: EngineCore, script: Script, prefix: str) -> None:
    for j, (prompt, tokens) in enumerate(script):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        try:
            core.add_request(f"{prefix}-{j}", prompt, params)
        except ValueError:
            continue  # this engine cannot take it (a short max_model_len, a small cache)
    while core.has_unfinished():
        core.step()
