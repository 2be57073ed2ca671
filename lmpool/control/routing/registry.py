"""The routing policies by name (``AsyncLMPool(routing=...)``): a new policy is one module
implementing ``RoutingPolicy``, one line here and its name in ``lmpool.config.pool.ROUTINGS``
(the names configuration and ``lmpool serve --routing`` accept without importing the control
process's policies; a test holds the two equal)."""

from __future__ import annotations

from lmpool.control.routing.dynamo_kv import DynamoKVPolicy
from lmpool.control.routing.least_loaded import LeastLoadedPolicy
from lmpool.control.routing.lmpool import LMPoolPolicy
from lmpool.control.routing.policy import RoutingPolicy
from lmpool.control.routing.round_robin import RoundRobinPolicy
from lmpool.control.routing.sglang_cache_aware import SGLangCacheAwarePolicy

POLICIES: dict[str, type[RoutingPolicy]] = {
    "lmpool": LMPoolPolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "sglang_cache_aware": SGLangCacheAwarePolicy,
    "dynamo_kv": DynamoKVPolicy,
}
