"""vLLM's data-parallel load balancing: the minimum of ``4 * waiting + running``.

Reimplements vLLM v1 ``DPLBAsyncMPClient.get_core_engine_for_request``
(vllm/v1/engine/core_client.py): ``score = waiting * 4 + running``, the first minimum in
scan order wins (one client scans from rank 0), and the client bumps the chosen engine's
local waiting count until the next stats update. That bump is our route reservation:
waiting = the rank's reported ``num_waiting`` + its requests routed but not yet admitted.
Cache contents play no part.
"""

from __future__ import annotations

import math

from lmpool.control.routing.policy import RoutingPolicy
from lmpool.control.routing.route import Choice, Route


class LeastLoadedPolicy(RoutingPolicy):
    def choose(self, route: Route) -> Choice:
        ranks = route.ranks
        best, best_score = ranks[0], math.inf
        for r in ranks:
            info = self.table.ranks[r]
            score = 4 * (info.load.num_waiting + info.num_reservations) + info.load.num_running
            if score < best_score:
                best, best_score = r, score
        return Choice(best, f"least_loaded r{best} score={best_score}")
