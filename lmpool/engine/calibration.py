"""A replica's first measurements of its own step time, taken once before it serves.

A pool's control plane fits each rank's step time to the shape of its batches
(``lmpool.control.pricing.step_model``) from the steps the rank runs. Before the first
request there are none, so a worker first runs a few synthetic requests whose steps span
the shapes the fit tells apart: one short sequence decoding alone; a batch of short prompts
prefilled together, then decoding together; one long prompt (its attention grows with its
square), then decoding at a long context. A warm-up round runs first and is not kept (a
first step pays one-time costs).

Invariants: the prefix cache is off while it runs, so nothing computed is cached or reported,
and every request is gone, its blocks free, when it returns; a request that could not fit
is left out rather than failing the worker. It costs a few hundred milliseconds (more on
a slow CPU, whose long prompt is at least ``LONG_MIN`` short ones).
"""

from __future__ import annotations

import random

from lmpool.engine.core import EngineCore
from lmpool.protocol.base import StepSample
from lmpool.sampling_params import SamplingParams

BATCH = 16  # short requests decoding together
SHORT = 64  # their prompt tokens
DECODE = 8  # tokens each short request generates (the long one: half as many)
LONG_S = 0.05  # the long prompt's length is what its linear part prefills in this long at the batch's pace
LONG_MIN = 8  # ... and at least this many short prompts' length (its attention per token 8x theirs)


def calibrate(core: EngineCore, seed: int = 0) -> list[StepSample]:
    """Time synthetic steps on ``core`` (idle, with no request in it); the samples."""
    if core.has_unfinished():
        raise ValueError("calibration needs an idle engine")
    bm, cfg = core.block_manager, core.config
    rng = random.Random(seed)
    room = bm.num_blocks * bm.block_size // 2  # tokens a script may hold at once
    short = max(1, min(SHORT, room // 4))
    batch = max(1, min(BATCH, cfg.max_num_seqs, room // (short + DECODE)))
    longest = max(1, min(cfg.max_num_batched_tokens, core.max_model_len - DECODE, room - DECODE))
    caching, bm.enable_prefix_caching = bm.enable_prefix_caching, False
    kept: list[StepSample] = []
    try:
        for i, script in enumerate([[(short, DECODE)], [(short, DECODE)], [(short, DECODE)] * batch]):
            core.take_step_samples()
            _run(core, rng, script, f"calibration-{i}")
            if i:  # the first is the warm-up
                kept += core.take_step_samples()
        # As long a prompt as the batch's measured pace prefills in ``LONG_S`` (attention grows
        # faster than that on a CPU), in one chunk at most; and never under ``LONG_MIN`` short
        # ones where it fits: on a slow or loaded machine the pace alone would leave the long
        # prompt's attention per token too like the short ones' for the fit to tell them apart.
        pace = max((s.seconds / s.prefill_tokens for s in kept if s.prefill_tokens), default=0.0)
        floor = min(longest, LONG_MIN * short)
        long = longest if pace <= 0 else max(floor, min(longest, int(LONG_S / pace)))
        _run(core, rng, [(long, DECODE // 2)], "calibration-long")
        kept += core.take_step_samples()
    finally:
        for request_id in [r for r in core.requests if r.startswith("calibration-")]:
            core.abort_request(request_id)
        while core.has_unfinished():  # an overlapped step may still hold a finished one's token
            core.step()
        bm.enable_prefix_caching = caching
        core.take_step_samples()
    return kept


def _run(core: EngineCore, rng: random.Random, script: list[tuple[int, int]], prefix: str) -> None:
    vocab = core.model_config.vocab_size
    for j, (prompt, tokens) in enumerate(script):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        try:
            core.add_request(f"{prefix}-{j}", [rng.randrange(vocab) for _ in range(prompt)], params)
        except ValueError:
            continue  # this engine cannot take it (a short max_model_len, a small cache)
    while core.has_unfinished():
        core.step()
