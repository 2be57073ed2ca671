"""A worker's running estimate of what prefill costs it, per token, for the transfer gate.

Only prefill-heavy steps count (at least ``min_tokens`` tokens, at least half of them in
prompt chunks rather than single decode tokens): a decode step's time is mostly
per-sequence overhead and says little about what recomputing a prefix would cost. The
estimate is an EWMA of step seconds over step tokens, 0.0 until the first such step.
"""

from __future__ import annotations

from lmpool.engine.scheduler import ScheduledBatch


class PrefillMeter:
    def __init__(self, alpha: float = 0.2, min_tokens: int = 16) -> None:
        self.alpha = alpha
        self.min_tokens = min_tokens
        self.s_per_token = 0.0

    def observe(self, batch: ScheduledBatch, seconds: float) -> None:
        total = sum(batch.num_tokens)
        prefill = total - batch.num_tokens.count(1)  # tokens of sequences that ran more than one
        if total < self.min_tokens or 2 * prefill < total:
            return
        sample = seconds / total
        if self.s_per_token == 0.0:
            self.s_per_token = sample
        else:
            self.s_per_token += self.alpha * (sample - self.s_per_token)
