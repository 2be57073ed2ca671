"""The settings a suite runs its workloads under: KV budget per worker and arrival process.

A ``Setting`` is one point of a sweep: the KV blocks every worker gets and the ``Arrival``
(window cap, closed loop or Poisson at a rate). ``--sweep AXIS=V1,V2,...`` (repeatable) takes
the product of its axes; an axis not swept keeps its plain flag (``--num-kv-blocks``,
``--window``, ``--arrival``). Axes:

- ``kv_budget``: KV blocks per worker, integers >= 1;
- ``window``: most requests in flight, integers >= 0 (0: no cap);
- ``arrival``: ``window`` (requests enter as slots free up) or ``poisson:RATE`` (requests/s).

Invariants: settings come out in a fixed order (kv budget, then window, then arrival, each
as given), with no duplicates; a sweep's results are keyed ``<workload>@<label>`` and a
suite without a sweep keeps plain workload names, so older results read the same.
"""

from __future__ import annotations

import dataclasses
import itertools

from benchmarks.replay.eval_driver import Arrival

AXES = ("kv_budget", "window", "arrival")


@dataclasses.dataclass(frozen=True)
class Setting:
    kv_blocks: int  # per worker
    arrival: Arrival

    def label(self) -> str:
        """``kv96_w16`` (window arrivals) or ``kv96_w0_poisson8`` (Poisson at 8 requests/s)."""
        text = f"kv{self.kv_blocks}_w{self.arrival.window}"
        return text if self.arrival.mode == "window" else f"{text}_poisson{self.arrival.rate:g}"

    def record(self, order: str) -> dict:
        """What every result of this setting says beside its figures."""
        return {"kv_blocks_per_worker": self.kv_blocks, "window": self.arrival.window,
                "arrival": self.arrival.mode, "rate": self.arrival.rate if self.arrival.mode == "poisson" else None,
                "order": order}


def parse_arrival(text: str, rate: float = 0.0) -> tuple[str, float]:
    """``window``, ``poisson`` (rate from ``--rate``) or ``poisson:RATE``."""
    mode, _, given = text.partition(":")
    if mode not in ("window", "poisson") or (given and mode != "poisson"):
        raise ValueError(f"an arrival is 'window', 'poisson' or 'poisson:RATE', got {text!r}")
    if given:
        try:
            rate = float(given)
        except ValueError:
            raise ValueError(f"a Poisson rate is a number of requests/s, got {given!r}") from None
    return mode, rate


def _values(axis: str, text: str) -> list:
    items = [v for v in text.split(",") if v]
    if not items:
        raise ValueError(f"--sweep {axis}= needs at least one value")
    if axis == "arrival":
        return [parse_arrival(v) for v in items]
    try:
        values = [int(v) for v in items]
    except ValueError:
        raise ValueError(f"--sweep {axis} takes integers, got {text!r}") from None
    low = 1 if axis == "kv_budget" else 0
    if any(v < low for v in values):
        raise ValueError(f"--sweep {axis} values must be >= {low}, got {text!r}")
    return values


def parse_sweep(specs: list[str]) -> dict[str, list]:
    """``["kv_budget=96,192", "window=16,0"]`` -> ``{"kv_budget": [96, 192], "window": [16, 0]}``."""
    axes: dict[str, list] = {}
    for spec in specs:
        axis, sep, text = spec.partition("=")
        if not sep or axis not in AXES:
            raise ValueError(f"a sweep is AXIS=V1,V2,... with AXIS one of {AXES}, got {spec!r}")
        if axis in axes:
            raise ValueError(f"--sweep {axis} given twice")
        values = _values(axis, text)
        if len(set(values)) != len(values):
            raise ValueError(f"--sweep {axis} repeats a value: {text!r}")
        axes[axis] = values
    return axes


def settings(kv_blocks: int, arrival: Arrival, sweep: dict[str, list]) -> list[Setting]:
    """Every setting of the sweep, the plain flags filling the axes it leaves out."""
    budgets = sweep.get("kv_budget", [kv_blocks])
    windows = sweep.get("window", [arrival.window])
    arrivals = sweep.get("arrival", [(arrival.mode, arrival.rate)])
    return [Setting(b, Arrival(mode, w, rate, arrival.seed))
            for b, w, (mode, rate) in itertools.product(budgets, windows, arrivals)]


def cell_key(workload: str, setting: Setting, swept: bool) -> str:
    return f"{workload}@{setting.label()}" if swept else workload


def trace_of(key: str) -> str:
    """The workload of a result key (``locality_5x@kv96_w16`` -> ``locality_5x``)."""
    return key.split("@", 1)[0]
