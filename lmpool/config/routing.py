"""The routing policies' thresholds (``AsyncLMPool(routing_config=...)``), checked at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingConfig:
    # LMPool's rule (``lmpool.control.routing.lmpool``): routes are priced in predicted seconds
    # from each rank's measured step time. A rank owns a request when its cached prefix covers more
    # than this share of the prompt (SGLang's cache threshold); a request leaves its owner only when
    # the owner is overloaded against the pool, by smg 1.13's spill gate and its defaults
    # (``lmpool.control.pricing.gate``: past the mean in-flight count by min(abs, max(4, 2 sqrt(mean)))
    # and by rel times it).
    owner_min_match: float = 0.3
    gate_abs_threshold: int = 64
    gate_rel_threshold: float = 1.5
    # Whether a route-time pull may still bring an owner's prefix to a rank priced cheaper with it
    # there, when the gate keeps the owner (a pull moves a session's history rather than
    # recomputing it). Off: the owner keeps it. The "lmpool-owner-pulls" evaluation policy; a CPU
    # red-team found sessions that all opened on one replica kept there (``agent_sessions_scaleout``).
    owner_pulls: bool = False
    # Where the ranks decode shared prefixes once (cascades), whether a request's shared prefix is
    # priced as read once only on a rank whose sequences (as last reported, or routed there since)
    # are of its group, keyed by that shared prefix's last block (so documents behind one shared
    # system-prompt block are groups apart, as the engine's cascades group them): a cascade group
    # there, or one coming. Off: wherever the rank's sequences in flight, whatever their prefixes,
    # could save a cascade's worth with it, so a document's questions spread over every replica,
    # each decoding every document: the "lmpool-ungrouped" evaluation policy. On since the 16k
    # hot-context pair on an H100 (1dc4676): it captured 80 % of the oracle's gain where off took 66 %,
    # and was level with SGLang's router on the oracle where off was behind.
    cascade_groups: bool = True
    # Prices within this fraction of the cheapest are equal (the step fits err by a few percent);
    # among them ``lmpool.control.pricing.price.cheapest``'s order decides (the seed's affinity, the
    # match, the request's cascade group, the count in flight, free blocks).
    price_tie: float = 0.03
    # A route reservation counts until its rank reports the request admitted, or this long
    # (a request that never reached its rank).
    reservation_ttl_s: float = 10.0
    # Blocks of prompts routed to a rank count as held there this long, until it reports
    # them (``lmpool.control.routing.pending``); 0 turns that off (the "lmpool-pending" evaluation policy).
    pending_ttl_s: float = 10.0
    # SGLang's model gateway, cache_aware policy, as ``smg launch`` 1.13 runs it (its command-line
    # defaults; ``lmpool.control.routing.sglang_cache_aware``). The older rule set: 0.5 / 32 /
    # 1.0001, the max - min balance switch, and a miss to the smallest tree.
    sglang_cache_threshold: float = 0.3
    sglang_balance_abs_threshold: int = 64
    sglang_balance_rel_threshold: float = 1.5
    # "fleet_mean": smg 1.13's spill gate (a matched worker loaded past the fleet mean goes to the
    # least loaded); "max_min": smg 1.9 and before (the whole pool imbalanced: shortest queue).
    sglang_balance_rule: str = "fleet_mean"
    sglang_miss_rule: str = "least_loaded"  # a cache miss goes to: "least_loaded" | "smallest_tree"
    sglang_tree: str = "approximate"  # "approximate": fed by routed requests; "page_table": worker events
    sglang_max_tree_blocks: int = 100_000  # per rank, evicted least recently routed first
    # NVIDIA Dynamo KV router (--kv-overlap-score-weight, --router-temperature defaults;
    # ``lmpool.control.routing.dynamo_kv``). Its prefill term counts only the tokens a request
    # must compute ("new": prompt less the cached overlap, queued requests included; "full":
    # every uncomputed prompt token as reported), and with ``router_assume_kv_reuse`` its decode
    # term counts only the blocks a request adds to a rank.
    dynamo_overlap_score_weight: float = 1.0
    dynamo_temperature: float = 0.0
    dynamo_prefill_tokens: str = "new"
    dynamo_assume_kv_reuse: bool = True
    seed: int = 0  # for Dynamo's softmax sampling

    def __post_init__(self) -> None:
        if not 0 <= self.owner_min_match < 1:
            raise ValueError(f"owner_min_match must be in [0, 1), got {self.owner_min_match!r}")
        if not 0 <= self.price_tie < 1:
            raise ValueError(f"price_tie must be in [0, 1), got {self.price_tie!r}")
        if not self.gate_abs_threshold >= 0 or not self.gate_rel_threshold >= 1:
            raise ValueError(f"need gate_abs_threshold >= 0 and gate_rel_threshold >= 1, got "
                             f"{self.gate_abs_threshold!r}, {self.gate_rel_threshold!r}")
        if self.sglang_miss_rule not in ("least_loaded", "smallest_tree"):
            raise ValueError("sglang_miss_rule must be 'least_loaded' or 'smallest_tree', "
                             f"got {self.sglang_miss_rule!r}")
        if self.dynamo_prefill_tokens not in ("new", "full"):
            raise ValueError(f"dynamo_prefill_tokens must be 'new' or 'full', got {self.dynamo_prefill_tokens!r}")
        if self.sglang_balance_rule not in ("fleet_mean", "max_min"):
            raise ValueError(f"sglang_balance_rule must be 'fleet_mean' or 'max_min', got {self.sglang_balance_rule!r}")
        if self.sglang_tree not in ("approximate", "page_table"):
            raise ValueError(f"sglang_tree must be 'approximate' or 'page_table', got {self.sglang_tree!r}")
        if not self.reservation_ttl_s > 0:
            raise ValueError(f"reservation_ttl_s must be > 0, got {self.reservation_ttl_s!r}")
        if not self.pending_ttl_s >= 0:
            raise ValueError(f"pending_ttl_s must be >= 0 (0: off), got {self.pending_ttl_s!r}")
