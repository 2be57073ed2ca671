"""The policies the evaluation runs, as the pool is asked to build them.

A ``Policy`` names a routing rule, a transfer mode and the ``RoutingConfig`` fields that
differ from the defaults. Peers are LMPool's reimplementations of other systems' routing
rules; a peer variant pins an older rule set through ``RoutingConfig`` fields, so a build
whose routing lacks one of those fields refuses it (``TypeError``) and the suite records
the variant as unavailable instead of silently running the current rule under its name.

A policy that names a ``runner`` is not LMPool's routing at all: ``smg_cache_aware`` runs the
real SGLang model gateway in front of single-replica ``lmpool serve`` hosts (``eval_gateway``),
to check the ``sglang_cache_aware`` reimplementation against the router it copies; ``dynamo_kv``
runs NVIDIA Dynamo's own KV router in front of a pool, fed by the pool's KV events
(``eval_dynamo``), and ``dynamo_kv_copy`` is LMPool's reimplementation of its rule.

Invariant: a policy passes a keyword only when it has something to say, so it runs on
every build that has the features it uses; ``transfer_mode=None`` passes none at all and
runs the pool's default mode (whatever a later build makes it).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    routing: str
    transfer_mode: str | None = "none"  # None: the pool's default mode
    routing_config: tuple[tuple[str, object], ...] = ()  # RoutingConfig fields that differ from the defaults
    enable_transfers: bool = False  # transfers set up without a mode that plans any (a control)
    runner: str | None = None  # an external router that runs instead of LMPool's ("smg", "dynamo")

    def pool_kwargs(self) -> dict:
        kw: dict = {"routing": self.routing}
        if self.transfer_mode not in (None, "none"):
            kw["transfer_mode"] = self.transfer_mode
        if self.transfer_mode == "none" and default_transfer_mode() != "none":
            # Routing only must stay routing only when a build turns transfers on by default.
            kw["transfer_mode"] = "none"
        if self.enable_transfers:
            kw["enable_transfers"] = True
        if self.routing_config:
            from lmpool.config import RoutingConfig

            kw["routing_config"] = RoutingConfig(**dict(self.routing_config))
        return kw

    def record(self) -> dict:
        """What the JSON says of this policy: the mode it ran and every routing field of its rule."""
        if self.runner == "smg":
            from benchmarks.peers.eval_gateway import gateway_record

            return {"routing": self.routing, "transfer_mode": "none", "runner": "smg",
                    "implementation": "the real SGLang model gateway (smg) in front of single-replica "
                                      "lmpool serve hosts, not a reimplementation",
                    "gateway": gateway_record()}
        if self.runner == "dynamo":
            from benchmarks.peers.eval_dynamo import dynamo_record

            return {"routing": self.routing, "transfer_mode": "none", "runner": "dynamo",
                    "implementation": "NVIDIA Dynamo's own KV router (ai-dynamo-runtime's SelectionService) "
                                      "in front of the pool, fed by the pool's KV events, not a reimplementation",
                    "dynamo": dynamo_record()}
        mode = self.transfer_mode if self.transfer_mode is not None else f"default ({default_transfer_mode()})"
        out: dict = {"routing": self.routing, "transfer_mode": mode}
        if self.routing_config:
            out["routing_config"] = dict(self.routing_config)
        fields = rule_fields(self.routing, dict(self.routing_config))
        if fields:
            out["rule_fields"] = fields
        return out


def default_transfer_mode() -> str:
    from lmpool.config.pool import TransferConfig

    return TransferConfig().transfer_mode


def rule_fields(routing: str, overrides: dict) -> dict:
    """The ``RoutingConfig`` fields a peer's rule reads (``sglang_*``, ``dynamo_*``) as the run
    used them, so a result says which thresholds ran even after the defaults change."""
    prefix = {"sglang_cache_aware": "sglang_", "dynamo_kv": "dynamo_"}.get(routing)
    if prefix is None:
        return {}
    from lmpool.config import RoutingConfig

    try:
        config = RoutingConfig(**overrides)
    except (TypeError, ValueError):
        return {}  # the run records why the pool refused it
    return {k: v for k, v in dataclasses.asdict(config).items() if k.startswith(prefix)}


# NVIDIA Dynamo's own KV router in front of the pool (eval_dynamo). ``dynamo_kv_copy`` below is
# LMPool's reimplementation of its rule (the pool's routing "dynamo_kv"), kept because running the
# two side by side checks the copy, as smg's gateway checks the SGLang copy.
DYNAMO = Policy("dynamo_kv", "dynamo", runner="dynamo")
PEERS = (
    Policy("round_robin", "round_robin"),
    Policy("least_loaded", "least_loaded"),
    Policy("sglang_cache_aware", "sglang_cache_aware"),
    DYNAMO,
    Policy("dynamo_kv_copy", "dynamo_kv"),
)
# Older rule sets of the peers, named by what they pin. SGLang's gateway before its current
# defaults: cache threshold 0.5, balance thresholds 32 / 1.0001 in the max - min switch (smg 1.9
# and before), a cache miss to the smallest tree. Dynamo's router charging a queued request its full prompt and not de-duplicating
# active blocks (LMPool's first copy of it).
PEER_VARIANTS = (
    Policy("sglang_cache_aware_v0", "sglang_cache_aware", routing_config=(
        ("sglang_cache_threshold", 0.5), ("sglang_balance_abs_threshold", 32),
        ("sglang_balance_rel_threshold", 1.0001), ("sglang_miss_rule", "smallest_tree"),
        ("sglang_balance_rule", "max_min"))),
    Policy("dynamo_kv_copy_v0", "dynamo_kv", routing_config=(
        ("dynamo_prefill_tokens", "full"), ("dynamo_assume_kv_reuse", False))),
)
# The real gateway whose rule ``sglang_cache_aware`` reimplements (eval_gateway): it starts server
# processes of its own, so it runs only when named.
SMG = Policy("smg_cache_aware", "cache_aware", runner="smg")
GATEWAYS = (SMG,)
LMPOOL = Policy("lmpool", "lmpool", transfer_mode=None)  # LMPool as a user gets it: the pool's default mode
LMPOOL_ROUTING = Policy("lmpool-routing", "lmpool")  # routing only, whatever the pool's default mode
# LMPool routing without one of its parts, to measure what that part is worth.
LMPOOL_VARIANTS = (
    Policy("lmpool-pending", "lmpool", routing_config=(("pending_ttl_s", 0.0),)),
)
# A candidate for the default, run beside it: its pulls allowed from an owner the gate keeps
# (``RoutingConfig.owner_pulls``: a session's history moved to a cheaper rank, not recomputed).
LMPOOL_OWNER_PULLS = Policy("lmpool-owner-pulls", "lmpool", transfer_mode=None,
                            routing_config=(("owner_pulls", True),))
# The default before cascade groups, run beside it: a request's shared prefix priced as read once
# wherever the sequences in flight could save a cascade's worth with it, whatever their prefixes
# (``RoutingConfig.cascade_groups`` off: a document's questions spread over every replica).
LMPOOL_UNGROUPED = Policy("lmpool-ungrouped", "lmpool", transfer_mode=None, routing_config=(("cascade_groups", False),))
CANDIDATES = (LMPOOL_OWNER_PULLS, LMPOOL_UNGROUPED)
# Policies that run only when named (``--policies all`` leaves them out): the real gateway starts
# server processes of its own; the candidate defaults are run beside the default, not in every suite.
NAMED_ONLY = (*GATEWAYS, *CANDIDATES)
TRANSFER_MODES = (
    Policy("lmpool+background", "lmpool", "background"),
    Policy("lmpool+foreground", "lmpool", "foreground"),
    Policy("lmpool+both", "lmpool", "both"),
    Policy("lmpool+pull", "lmpool", "pull"),  # route-time pulls (lmpool.control.transfers.pull)
    Policy("lmpool+all", "lmpool", "all"),  # pulls, background placement and foreground release
)
# Routing only, in a pool whose transfer paths are set up (workers connected, caches
# exported) but which plans no transfer: what a transfer mode's run owes to the set-up
# alone, apart from the transfers it makes.
TRANSFERS_IDLE = Policy("lmpool+idle", "lmpool", enable_transfers=True)
# Every rule that decides where a request runs and moves no KV.
ROUTING_ONLY = (*PEERS, *PEER_VARIANTS, *GATEWAYS, LMPOOL_ROUTING)
PEER_NAMES = frozenset(p.name for p in (*PEERS, *PEER_VARIANTS, *GATEWAYS))


def select_policies(available: tuple[Policy, ...], names: str | None) -> list[Policy]:
    if not names:
        return list(available)
    by_name = {p.name: p for p in available}
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {sorted(by_name)}")
    return [by_name[n] for n in names.split(",")]
