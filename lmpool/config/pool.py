"""``PoolConfig``: one tree for a whole pool, its engine, routing and transfer sections.

The tree travels whole, as JSON, in every child's start-up spec (``lmpool.protocol.spec``):
no process copies settings field by field. ``PoolConfig.from_options`` takes the flat
keywords of ``AsyncLMPool``/``LMPool`` and files each under the section that declares it,
so a new setting is one field in one section.

Invariants (checked at construction, so in every process that decodes the tree): the
device is "cpu" or "cuda" (ranks take the ``gpus`` GPUs in turn, ``device_of``); ``hang_timeout``
is resolved from "auto"; any transfer mode but "none" enables transfers. Free of torch: the
user process resolves ``gpus`` from what torch sees when the pool starts (``PoolClient``), and
the tree carries it to every process.
"""

from __future__ import annotations

import dataclasses

import msgspec

from lmpool.config.engine import EngineConfig, check_hang_timeout, check_world_size
from lmpool.config.kv_events import KVEventsConfig
from lmpool.config.routing import RoutingConfig
from lmpool.config.transfer import TransferPolicyConfig, check_mode

# The keys of lmpool.control.routing.registry.POLICIES (a test holds them equal), named here so that
# configuration and the CLI do not import the control process's policies.
ROUTINGS = ("lmpool", "round_robin", "least_loaded", "sglang_cache_aware", "dynamo_kv")
GPU_TRANSFER_PATHS = ("auto", "nccl")
# CPU replicas share one machine's memory: each takes a quarter of what a lone ``LLM`` would.
POOL_CPU_KV_CACHE_BYTES = 256 << 20


class TransferConfig(msgspec.Struct, kw_only=True):
    """Which KV transfers a pool runs (the names are the pool's own keywords)."""

    enable_transfers: bool = False  # workers can copy and move KV blocks between them
    transfer_lease_s: float = 10.0  # a worker aborts a plan its control plane left silent this long
    transfer_mode: str = "pull"  # automatic policies (``lmpool.config.transfer``); any but "none" enables
    background_copy_max_blocks: int = 128  # of a chain per tick: documents of 32k tokens whole
    background_copy_batch_max_blocks: int = 128
    transfer_policy: TransferPolicyConfig = msgspec.field(default_factory=TransferPolicyConfig)
    # Between replicas on two GPUs: "auto" pulls through CUDA IPC where the GPUs can address
    # each other's memory and packs over NCCL elsewhere; "nccl" packs over NCCL between any two
    # (for peer access that is reported but slow or broken). Replicas sharing a GPU always
    # pull: NCCL refuses two ranks on one device.
    gpu_transfer_path: str = "auto"

    def __post_init__(self) -> None:
        check_mode(self.transfer_mode, self.background_copy_max_blocks, self.background_copy_batch_max_blocks)
        if not isinstance(self.transfer_policy, TransferPolicyConfig):
            raise ValueError("transfer_policy must be a TransferPolicyConfig, "
                             f"got {type(self.transfer_policy).__name__}")
        self.transfer_policy.check()
        if self.transfer_mode != "none":
            self.enable_transfers = True
        if self.gpu_transfer_path not in GPU_TRANSFER_PATHS:
            raise ValueError(f"gpu_transfer_path must be one of {', '.join(GPU_TRANSFER_PATHS)}; "
                             f"got {self.gpu_transfer_path!r}")

    @property
    def foreground_release(self) -> bool:
        return self.transfer_mode in ("foreground", "both", "all")

    @property
    def background_placement(self) -> bool:
        return self.transfer_mode in ("background", "both", "all")

    @property
    def route_pulls(self) -> bool:
        return self.transfer_mode in ("pull", "all")


class PoolConfig(msgspec.Struct, kw_only=True):
    engine: EngineConfig  # the replicas' engine; its device is "cpu" or "cuda" (per rank: ``device_of``)
    world_size: int = 2
    # CUDA devices the ranks take in turn (rank r on GPU r % gpus); None until the pool starts,
    # which sets every device torch sees. Unused on CPU.
    gpus: int | None = None
    routing: str = "lmpool"
    routing_config: RoutingConfig = msgspec.field(default_factory=RoutingConfig)  # the policies' thresholds
    transfer: TransferConfig = msgspec.field(default_factory=TransferConfig)
    topology: list[tuple[int, int]] | None = None  # logical NVLink pairs; None: all partners
    ready_timeout: float = 300.0
    heartbeat_interval: float = 0.5
    # Workers time a few synthetic steps before they serve, so that routing prices a rank by its
    # measured step time from the first request (``lmpool.engine.calibration``).
    calibrate_steps: bool = True
    # Seconds a worker or the control process may stay silent, once up, before it is taken for
    # hung and killed as if it had died (see docs/ARCHITECTURE.md). "auto": 60 s on CUDA, where a
    # step takes milliseconds; off (None) on CPU, where one step of a large model may take minutes.
    hang_timeout: float | str | None = "auto"
    # The pool's KV events, published in vLLM's format (a dict of its fields is taken too); None: none.
    kv_events: KVEventsConfig | None = None

    def __post_init__(self) -> None:
        self.world_size = check_world_size(self.world_size)
        if self.hang_timeout == "auto":
            self.hang_timeout = 60.0 if self.device == "cuda" else None
        self.hang_timeout = check_hang_timeout(self.hang_timeout, self.heartbeat_interval)
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}; got {self.routing!r}")
        if not isinstance(self.routing_config, RoutingConfig):
            raise ValueError(f"routing_config must be a RoutingConfig, got {type(self.routing_config).__name__}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if isinstance(self.kv_events, dict):
            self.kv_events = msgspec.convert(self.kv_events, KVEventsConfig)
        if self.kv_events is not None and not isinstance(self.kv_events, KVEventsConfig):
            raise ValueError(f"kv_events must be a KVEventsConfig, a dict of its fields or None, got "
                             f"{type(self.kv_events).__name__}")
        if self.gpus is not None and (isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1):
            raise ValueError(f"gpus must be an integer >= 1 or None, got {self.gpus!r}")

    @classmethod
    def from_options(cls, model: str, **options) -> PoolConfig:
        """A pool's config from ``AsyncLMPool``'s flat keywords: each goes to the section that
        declares it (engine, transfer, or the pool's own); an unknown one is a ``TypeError``."""
        engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
        sections: dict[str, dict] = {"engine": {"model": str(model)}, "transfer": {}, "pool": {}}
        for name, value in options.items():
            if name in engine_fields and name != "model":
                sections["engine"][name] = value
            elif name in TransferConfig.__struct_fields__:
                sections["transfer"][name] = value
            elif name in cls.__struct_fields__ and name not in ("engine", "transfer"):
                sections["pool"][name] = value
            else:
                raise TypeError(f"unknown pool option {name!r}")
        sections["engine"].setdefault("cpu_kv_cache_bytes", POOL_CPU_KV_CACHE_BYTES)
        if sections["pool"].get("routing_config") is None:
            sections["pool"].pop("routing_config", None)
        if sections["transfer"].get("transfer_policy") is None:
            sections["transfer"].pop("transfer_policy", None)
        return cls(engine=EngineConfig(**sections["engine"]), transfer=TransferConfig(**sections["transfer"]),
                   **sections["pool"])

    @property
    def model(self) -> str:
        return self.engine.model

    @property
    def device(self) -> str:
        return self.engine.device

    def device_of(self, rank: int) -> str:
        if self.device == "cpu":
            return "cpu"
        return f"cuda:{self.gpu_of_rank()[rank]}"

    def gpu_of_rank(self) -> list[int]:
        """Each rank's GPU (on CPU, each rank its own virtual one)."""
        if self.device == "cpu":
            return list(range(self.world_size))
        if self.gpus is None:
            raise ValueError("a CUDA pool's GPU count is set when the pool starts (PoolConfig.gpus); it is unset")
        return [r % self.gpus for r in range(self.world_size)]

    def engine_of(self, rank: int) -> EngineConfig:
        """Rank ``rank``'s engine: on its device, with its share of its GPU and its own seed.

        ``gpu_memory_utilization`` is the share of each GPU that the pool's replicas on it fill
        together: replicas sharing a GPU split it evenly, since each sizes its KV cache from
        what its own process sees. An explicit ``num_kv_blocks`` is taken as given. Each rank's
        sampler draws its own random stream (``seed + rank``); rank 0 keeps the seed, so a
        one-rank pool samples as an ``LLM`` would."""
        changes: dict = {"seed": self.engine.seed + rank} if rank else {}
        if self.device_of(rank) != self.device:
            changes["device"] = self.device_of(rank)
        gpus = self.gpu_of_rank()
        sharing = gpus.count(gpus[rank]) if self.device == "cuda" else 1
        if sharing > 1 and self.engine.num_kv_blocks is None:
            changes["gpu_memory_utilization"] = self.engine.gpu_memory_utilization / sharing
        return dataclasses.replace(self.engine, **changes) if changes else self.engine


# What a pool's ``reset`` may change: settings only its control process reads.
RESET_OPTIONS = ("routing", "routing_config", "transfer_mode", "kv_events")


def reset_config(config: PoolConfig, transfers_ready: bool, options: dict) -> PoolConfig:
    """``config`` with ``options`` applied, as a running pool's ``reset`` takes them: an option
    outside ``RESET_OPTIONS`` is a ``TypeError``, and a change its workers would read (whether
    they count cascade groups, release blocks through moves, or have a data path at all:
    ``transfers_ready``) a ``ValueError`` that says a new pool is needed."""
    unknown = sorted(set(options) - set(RESET_OPTIONS))
    if unknown:
        raise TypeError(f"a reset takes {', '.join(RESET_OPTIONS)}; got {', '.join(unknown)} (start a new pool for it)")
    routing_config = options.get("routing_config", config.routing_config)
    if routing_config is None:  # as a new pool takes it: the policies' default thresholds
        routing_config = RoutingConfig()
    if not isinstance(routing_config, RoutingConfig):
        raise ValueError(f"routing_config must be a RoutingConfig, got {type(routing_config).__name__}")
    if routing_config.cascade_groups != config.routing_config.cascade_groups:
        raise ValueError("a reset keeps routing_config.cascade_groups (the workers count the groups): start a new pool")
    transfer = config.transfer
    if "transfer_mode" in options:
        transfer = msgspec.structs.replace(transfer, transfer_mode=options["transfer_mode"])
    if transfer.transfer_mode != "none" and not transfers_ready:
        raise ValueError(f"transfer_mode {transfer.transfer_mode!r} needs a pool started with transfers "
                         "(enable_transfers=True)")
    if transfer.foreground_release != config.transfer.foreground_release:
        raise ValueError("a reset keeps foreground release on or off (the workers' eviction asks for moves): "
                         "start a new pool")
    return msgspec.structs.replace(config, routing=options.get("routing", config.routing),
                                   routing_config=routing_config, transfer=transfer,
                                   kv_events=options.get("kv_events", config.kv_events))
