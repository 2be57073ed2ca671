"""LMPool's settings, one tree: the engine, routing and transfer sections a pool is built from."""

from lmpool.config.engine import DTYPE_NAMES, EngineConfig
from lmpool.config.routing import RoutingConfig
from lmpool.config.transfer import TRANSFER_MODES, TransferPolicyConfig

__all__ = ["DTYPE_NAMES", "EngineConfig", "RoutingConfig", "TRANSFER_MODES", "TransferPolicyConfig"]
