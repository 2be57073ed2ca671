"""The gate every transfer passes: does the expected reuse pay for the movement?

Benefit is prefill time saved, in seconds: the transferred blocks' tokens times
the cost of prefilling one token on the destination.

- Foreground (a real block shortage; the blocks would otherwise be evicted):
  the chain is expected to be reused ``expected_reuses`` more times, each reuse
  worth ``discount`` times the previous one (the further away, the less
  certain), so ``benefit = saved_once * (1 - discount**k) / (1 - discount)``.
- Background (placing a copy of a hot chain on a less loaded rank): at most one
  avoided cold prefill, ``benefit = saved_once``, because the copy only helps
  if a request is routed to it, and then only once before the destination
  would have cached the chain itself.

A transfer is admitted when ``benefit > margin * cost``. Every decision, admitted
or not, is logged with both figures (logger ``lmpool.control.transfers.admission``) and
returned, so benchmarks can count and audit them; the latest ``DECISIONS_KEPT``
stay in ``decisions``.

A plan may carry more blocks than it saves (a move also copies ancestors the
destination lacks, so that the moved blocks have their chain there): the cost is
for every block carried, the benefit only for ``saved_blocks``. The prefill
cost per token may be given per decision (the destination's latest measurement).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from lmpool.control.transfers.cost_model import TransferCostModel

log = logging.getLogger("lmpool.control.transfers.admission")
DECISIONS_KEPT = 1024


@dataclass(frozen=True)
class AdmissionPolicy:
    prefill_s_per_token: float  # measured prefill cost on the destination
    block_size: int
    discount: float = 0.5
    margin: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.discount < 1:
            raise ValueError(f"discount must be in [0, 1), got {self.discount}")
        if self.prefill_s_per_token <= 0 or self.margin <= 0:
            raise ValueError("prefill_s_per_token and margin must be positive")


@dataclass(frozen=True)
class AdmissionDecision:
    admitted: bool
    kind: str  # "foreground" or "background"
    src: int
    dst: int
    num_blocks: int
    saved_prefill_s: float
    transfer_cost_s: float

    def __str__(self) -> str:
        verdict = "admit" if self.admitted else "refuse"
        return (
            f"{verdict} {self.kind} transfer {self.src}->{self.dst} of {self.num_blocks} blocks: "
            f"saves {self.saved_prefill_s * 1e3:.3f} ms of prefill, costs {self.transfer_cost_s * 1e3:.3f} ms"
        )


class AdmissionGate:
    def __init__(self, policy: AdmissionPolicy, cost_model: TransferCostModel) -> None:
        self.policy = policy
        self.cost_model = cost_model
        self.decisions: deque[AdmissionDecision] = deque(maxlen=DECISIONS_KEPT)
        self.admitted = 0
        self.refused = 0

    def saved_once(self, num_blocks: int, prefill_s_per_token: float | None = None) -> float:
        per_token = self.policy.prefill_s_per_token if prefill_s_per_token is None else prefill_s_per_token
        return num_blocks * self.policy.block_size * per_token

    def foreground(
        self, src: int, dst: int, num_blocks: int, expected_reuses: float,
        saved_blocks: int | None = None, prefill_s_per_token: float | None = None,
    ) -> AdmissionDecision:
        d = self.policy.discount
        reuse = (1 - d ** expected_reuses) / (1 - d) if expected_reuses > 0 else 0.0
        saved = num_blocks if saved_blocks is None else saved_blocks
        return self._decide("foreground", src, dst, num_blocks, self.saved_once(saved, prefill_s_per_token) * reuse)

    def background(
        self, src: int, dst: int, num_blocks: int, prefill_s_per_token: float | None = None
    ) -> AdmissionDecision:
        return self._decide("background", src, dst, num_blocks, self.saved_once(num_blocks, prefill_s_per_token))

    def _decide(self, kind: str, src: int, dst: int, num_blocks: int, benefit: float) -> AdmissionDecision:
        cost = self.cost_model.estimate(src, dst, num_blocks)
        decision = AdmissionDecision(benefit > self.policy.margin * cost, kind, src, dst, num_blocks, benefit, cost)
        self.decisions.append(decision)
        if decision.admitted:
            self.admitted += 1
        else:
            self.refused += 1
        log.info("%s", decision)
        return decision
