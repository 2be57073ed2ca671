"""Settings of the automatic KV transfer policies: background placement and foreground release.

``TRANSFER_MODES`` names which policies run: ``"none"`` (transfers only when the API
asks, if enabled at all), ``"background"`` (hot chains are copied to less loaded
partners), ``"foreground"`` (a rank short of blocks moves cold cached blocks to a
partner instead of evicting them), ``"both"`` (those two), ``"pull"`` (route-time pulls: a
request may be sent to a rank that first copies its cached prefix from another,
``lmpool.control.transfers.pull``) or ``"all"`` (background, foreground and pull).

``TransferPolicyConfig`` holds the thresholds; ``check()`` names the first bad one.
Every duration and load is in seconds (a rank's load: the predicted seconds of the work in
flight there, ``lmpool.control.pricing``), heat in decayed accesses (see
``GlobalBlockManager.record_route``).
"""

from __future__ import annotations

import msgspec

TRANSFER_MODES = ("none", "background", "foreground", "both", "pull", "all")

# An uncalibrated link, per device kind: (fixed seconds, bytes per second). Pessimistic next
# to what benchmarks/benchmark_kv_transfer.py measured (gloo on a 2-core VM: ~1 ms + 1.5 ms
# per MiB; CUDA IPC on an H200: ~0.6 ms + ~0.4 TB/s); completed plans correct them online.
UNCALIBRATED_LINK = {"cpu": (2e-3, 0.5e9), "cuda": (1e-3, 50e9)}
DEFAULT_PREFILL_S_PER_TOKEN = 1e-6  # the admission gate's figure for a decision given none (a pool's give theirs)


def check_mode(mode: str, max_blocks: int, batch_max_blocks: int) -> None:
    """Raise ``ValueError`` for an unknown transfer mode or copy caps that cannot work."""
    if mode not in TRANSFER_MODES:
        raise ValueError(f"transfer_mode must be one of {', '.join(TRANSFER_MODES)}; got {mode!r}")
    for name, value in (("background_copy_max_blocks", max_blocks),
                        ("background_copy_batch_max_blocks", batch_max_blocks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if batch_max_blocks < max_blocks:
        raise ValueError(
            f"background_copy_batch_max_blocks ({batch_max_blocks}) must be >= background_copy_max_blocks "
            f"({max_blocks}): a batch holds at least one chain's copy"
        )


class TransferPolicyConfig(msgspec.Struct, kw_only=True, frozen=True):
    # ---- background placement (a control-plane task every ``interval_s``) ----
    interval_s: float = 0.5
    # Routes drive placement too: a pass runs this soon after a route, at most once per this long.
    react_interval_s: float = 0.005
    # A pass runs in slices of this long and one chain more, so a route waits for one slice at most.
    placement_slice_s: float = 20e-6
    hot_threshold: float = 4.0  # a block is hot from this heat on
    heat_half_life_s: float = 30.0
    route_hit_weight: float = 0.5  # extra heat when a route used the block, not just asked for it
    recent_chains: int = 1024  # routed chains remembered as placement candidates
    min_load_skew_s: float = 0.05  # source load minus destination load, at least
    cooldown_s: float = 10.0  # a chain copied to its leaf (or refused) is not looked at again before this
    lease_s: float = 30.0  # routes for a copied chain are steered to the copy this long
    # ---- foreground release (a worker short of blocks asks the control plane) ----
    foreground_wait_s: float = 1.0  # a worker waits this long for a move before evicting
    foreground_retry_s: float = 1.0  # after a refused or failed move, evict for this long
    # ---- the admission gate ----
    prefill_s_per_token: float | None = None  # None: each rank's fitted step time (``lmpool.control.pricing``)
    admission_margin: float = 1.0  # admit when saved prefill > margin * transfer cost
    reuse_discount: float = 0.5  # foreground: each further expected reuse is worth this much less
    transfer_profile: str | None = None  # a calibration profile (benchmark_kv_transfer.py JSON)

    def check(self) -> None:
        positive = ("interval_s", "hot_threshold", "heat_half_life_s", "lease_s", "foreground_wait_s",
                    "admission_margin", "placement_slice_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("route_hit_weight", "min_load_skew_s", "cooldown_s", "foreground_retry_s", "react_interval_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.recent_chains < 1:
            raise ValueError(f"recent_chains must be >= 1, got {self.recent_chains}")
        if self.prefill_s_per_token is not None and not self.prefill_s_per_token > 0:
            raise ValueError(f"prefill_s_per_token must be > 0 (or None), got {self.prefill_s_per_token!r}")
        if not 0 <= self.reuse_discount < 1:
            raise ValueError(f"reuse_discount must be in [0, 1), got {self.reuse_discount!r}")
