"""Helpers of the control-plane tests: a clock the test moves by hand, cached chains written
into a page table as worker snapshots, and routers that price with fixed step times."""

from __future__ import annotations

from lmpool.control.build import make_router
from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.pricing.engine_model import EngineModel
from lmpool.control.pricing.price import Limits, Pricer
from lmpool.control.pricing.step_model import StepCoefficients
from lmpool.control.routing.pending import CountPending, PendingPrefixes
from lmpool.control.routing.router import Router
from lmpool.control.topology import Topology
from lmpool.engine.hashing import ROOT_HASH
from lmpool.protocol.kv_events import BlockStored, KVSnapshot


class ManualClock:
    """A clock that reads ``now``, which only the test changes."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def chain_blocks(hashes: list[int], first_id: int = 0, generation: int = 1) -> list[BlockStored]:
    """The chain ``hashes`` (root first) stored in consecutive block ids from ``first_id``."""
    parents = [ROOT_HASH] + hashes[:-1]
    return [BlockStored(h, p, first_id + i, generation) for i, (h, p) in enumerate(zip(hashes, parents))]


def cache(gbm: GlobalBlockManager, rank: int, hashes: list[int]) -> None:
    """Replace ``rank``'s cache with the chain ``hashes`` (a snapshot at the next version, epoch 1)."""
    gbm.apply_snapshot(rank, 1, KVSnapshot(gbm.ranks[rank].version + 1, chain_blocks(hashes)))


# Step times for priced routing tests: 1 ms a step, 10 us a prefill token, 100 us a decoding
# sequence, 1 us a context token (attention and cascade pairs free, so prices are easy to work out
# by hand).
COEF = StepCoefficients(base=1e-3, prefill_token=1e-5, attention_pair=0.0, decode_seq=1e-4, context_token=1e-6,
                        cascade_pair=0.0)


def engine_model(world: int, coefficients: StepCoefficients = COEF) -> EngineModel:
    model = EngineModel(world)
    for rank in model.ranks:
        rank.reseed(coefficients)
    return model


def priced_router(gbm: GlobalBlockManager, topology: Topology, routing: str = "lmpool", config=None,
                  coefficients: StepCoefficients = COEF, reuse: float = 0.5, limits: Limits | None = None,
                  **stages) -> Router:
    """A router whose pricer reads fixed step times (``make_router``'s pipeline)."""
    pricer = Pricer(gbm, topology, engine_model(gbm.world_size, coefficients),
                    limits or Limits(gbm.block_size, 256, 8192), lambda rank: reuse)
    return make_router(gbm, topology, routing, config, pricer, **stages)


def pending_of(router: Router) -> PendingPrefixes | None:
    return next((s.pending for s in router.stages if isinstance(s, CountPending)), None)
