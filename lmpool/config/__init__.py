"""LMPool's settings, one tree: the engine, routing and transfer sections a pool is built from."""

from lmpool.config.engine import DTYPES, EngineConfig
from lmpool.config.routing import RoutingConfig
from lmpool.config.transfer import TRANSFER_MODES, TransferPolicyConfig

__all__ = ["DTYPES", "EngineConfig", "RoutingConfig", "TRANSFER_MODES", "TransferPolicyConfig"]
