"""Re-price recorded requests' time to first token with the pricing as it is now, against the
state their run's records show at each route: how good the price's formula is, apart from how
stale the control plane's view was when it priced.

At a request's route (its arrival plus its front-end wait, ``dispatch_s``), the requests of its
rank that had a first token and were not done are running (their prompt and half their output as
context, the rest of their output to decode); those routed there before it without a first
token yet are reserved, as the route stage reserves them (their uncached prompt tokens to
prefill). Each rank is priced by the step fit its run ended with (``rank_stats[].step_fit``).
Routes that opened a pull are left out (their copy's wait is not in the records); a later
request that waited on that pull is answered once the copy lands, so ``dispatch_s`` holds its
wait and it is measured from then, against a replayed price without the wait. Printed per
run: the share of requests whose priced time is within 25 % of the measured time from the route
to the first token, and the median priced / measured, for the recorded prices and the replay.
The replay models neither cascade decode (every running request reads its whole context) nor a
launched prefill (it counts every routed request without a first token as queued): on a run
with cascades, only the recorded prices hold.

    python -m benchmarks.ttft_replay benchmarks/results/eval_h200_0.6b_hot_context_16k.json [--phase burst]
    python -m benchmarks.ttft_replay --table benchmarks/results/eval_h200_*.json   # the distribution per workload
                                                     # (and the step fits' accuracy by kind of step, where recorded)
    python -m benchmarks.ttft_replay --places FILE --phase burst   # priced against measured by a request's
                                                     # place on its rank, with the measured time's parts
    python -m benchmarks.ttft_replay --joiners FILE ...   # the recorded prices within 25 %, with the joiners'
                                                     # own prefill added (known afterwards: a bound), and
                                                     # with the forecast a route could make (``joiner_table``)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections.abc import Iterable

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.control.pricing.price import Limits, Pricer, request_shape
from lmpool.control.pricing.step_model import StepCoefficients
from lmpool.control.topology import Topology
from lmpool.protocol import LoadReport, RouteQuery
from lmpool.protocol.base import attention_pairs, prefill_keys
from lmpool.protocol.kv_events import KVSnapshot

BLOCKS = 1 << 20  # every rank's capacity in the replay: room is not what it prices


class FixedFits:
    """An engine model of fixed coefficients per rank (what ``Pricer`` reads of one)."""

    def __init__(self, fits: dict[int, StepCoefficients]) -> None:
        self.fits = fits

    def coefficients(self, rank: int) -> StepCoefficients:
        return self.fits[rank]


def coefficients(fit: dict) -> StepCoefficients:
    """A rank's ``step_fit`` record as step coefficients (seconds). A record from before cascade
    pairs had a coefficient of their own has none: its routes priced them at the attention pair's
    (and one from before prefill keys, none for them)."""
    attention = fit["attention_ns_per_pair"]
    return StepCoefficients(fit["base_ms"] * 1e-3, fit["prefill_us_per_token"] * 1e-6, attention * 1e-9,
                            fit["decode_us_per_seq"] * 1e-6, fit["context_us_per_token"] * 1e-6,
                            fit.get("cascade_ns_per_pair", attention) * 1e-9, fit.get("prefill_ns_per_key", 0.0) * 1e-9)


def requests(run: dict) -> list[dict]:
    """The run's request records as dicts, in the order they were routed."""
    cols = run["requests"]
    rows = [{k: cols[k][i] for k in cols} for i in range(len(cols["index"]))]
    for r in rows:
        r["routed_s"] = r["arrival_s"] + (r.get("dispatch_s") or 0.0)
    return sorted(rows, key=lambda r: r["routed_s"])


def replay_run(run: dict, limits: Limits, phase: str | None = None) -> list[tuple[float, float]]:
    """(recorded, replayed) priced over measured time to first token of ``run``'s priced requests."""
    fits = {s["rank"]: coefficients(s["step_fit"]) for s in run["rank_stats"] if s.get("step_fit")}
    rows = requests(run)
    out = []
    for i, r in enumerate(rows):
        measured = r["first_token_s"] - r["routed_s"]
        if (r.get("predicted_ttft_s") is None or measured <= 0 or r["rank"] not in fits
                or (phase and r.get("phase") != phase) or str(r.get("route", "")).startswith("pull")):
            continue
        replayed = price_at(rows[:i], r, fits, limits)
        recorded = r["predicted_ttft_s"] - (r.get("dispatch_s") or 0.0)
        out.append((recorded / measured, replayed / measured))
    return out


def price_at(earlier: Iterable[dict], r: dict, fits: dict[int, StepCoefficients], limits: Limits) -> float:
    """``r``'s time to first token on its rank, priced against what ``earlier`` requests left there."""
    t, rank, block = r["routed_s"], r["rank"], limits.block_size
    gbm = GlobalBlockManager(1, block)
    gbm.register_rank(0, 1, BLOCKS)
    gbm.apply_snapshot(0, 1, KVSnapshot(0, []))
    running = context = left = 0
    reserved = []
    for e in earlier:
        if e["rank"] != rank or e["completion_s"] <= t:
            continue
        if e["first_token_s"] <= t:
            running += 1
            context += e["prompt_len"] + e["output_len"] // 2
            left += e["output_len"] - e["output_len"] // 2
        else:
            reserved.append(e)
    gbm.update_load(0, 1, LoadReport(num_running=running, context_tokens=context, decode_tokens_left=left,
                                     blocks_free=BLOCKS))
    for k, e in enumerate(reserved):
        missing = e["prompt_len"] - e["num_cached_tokens"]
        gbm.reserve(f"r{k}", 0, 0, missing, attention_pairs(missing, e["num_cached_tokens"]), e["prompt_len"],
                    max(1, e["max_tokens"]), keys=prefill_keys(missing, e["num_cached_tokens"]))
    pricer = Pricer(gbm, Topology.virtual(1), FixedFits({0: fits[rank]}), limits, lambda _: 0.0)
    query = RouteQuery("q", [], r["prompt_len"], r["max_tokens"])
    m, _, _ = request_shape(query, r["num_cached_tokens"] // block, block)
    return pricer.price(query, 0, m, 0.0, None).ttft_s


def within(ratios: list[float], tolerance: float = 0.25) -> float:
    return sum(1 - tolerance <= x <= 1 + tolerance for x in ratios) / len(ratios)


def summary(pairs: list[tuple[float, float]]) -> dict:
    recorded, replayed = [p[0] for p in pairs], [p[1] for p in pairs]
    return {"requests": len(pairs), "recorded_25pct": within(recorded), "replayed_25pct": within(replayed),
            "recorded_median": statistics.median(recorded), "replayed_median": statistics.median(replayed)}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(paths: list[str], policy: str, phase: str | None) -> list[str]:
    """One markdown row per file and workload, its repetitions pooled: the priced requests, the
    share within 25 % (recorded, replayed) and the recorded priced / measured at its 10th, 50th
    and 90th percentiles (the goal's distribution)."""
    rows = ["| file | workload | requests | within 25 %, recorded | replayed | recorded p10 / p50 / p90 |",
            "| --- | --- | ---: | ---: | ---: | --- |"]
    for path in paths:
        data = json.load(open(path))
        limits = limits_of(data)
        pooled: dict[str, list[tuple[float, float]]] = {}
        for run in data["runs"]:
            if run["policy"] == policy and run.get("status", "ok") == "ok":
                pooled.setdefault(run["workload"], []).extend(replay_run(run, limits, phase))
        name = path.rsplit("/", 1)[-1].removesuffix(".json")
        for workload, pairs in pooled.items():
            if not pairs:
                continue
            s, recorded = summary(pairs), [p[0] for p in pairs]
            spread = " / ".join(f"{quantile(recorded, q):.2f}" for q in (0.1, 0.5, 0.9))
            rows.append(f"| `{name}` | {workload} | {s['requests']} | {s['recorded_25pct']:.2f} | "
                        f"{s['replayed_25pct']:.2f} | {spread} |")
    return rows


def step_table(paths: list[str], policy: str) -> list[str]:
    """One markdown row per file, workload and kind of step: how well the ranks' priced step
    times predicted their steps (``step_fit.kinds``, recorded since the step accuracy existed),
    each rank's recent figures weighted by its steps of that kind, over the repetitions."""
    rows = ["| file | workload | kind | steps | predicted / measured | within 25 % |",
            "| --- | --- | --- | ---: | ---: | ---: |"]
    for path in paths:
        data = json.load(open(path))
        pooled: dict[tuple[str, str], list[tuple[int, float, float]]] = {}
        for run in data["runs"]:
            if run["policy"] != policy or run.get("status", "ok") != "ok":
                continue
            for rank in run.get("rank_stats") or []:
                for k in (rank.get("step_fit") or {}).get("kinds", []):
                    pooled.setdefault((run["workload"], k["kind"]), []).append(
                        (k["steps"], k["predicted_over_measured"], k["within_25pct"]))
        name = path.rsplit("/", 1)[-1].removesuffix(".json")
        for (workload, kind), figures in pooled.items():
            steps = sum(n for n, _, _ in figures)
            ratio = math.exp(sum(n * math.log(r) for n, r, _ in figures) / steps)
            share = sum(n * w for n, _, w in figures) / steps
            rows.append(f"| `{name}` | {workload} | {kind} | {steps} | {ratio:.2f} | {share:.2f} |")
    return rows


PARTS = ("dispatch_s", "intake_s", "queued_s", "first_step_s")  # a first token's measured parts, in order
PLACES = 4  # requests a row of the places table holds, in order of hand-over on their rank
# Two parts of a route's priced time to first token, in its reason (``price.describe``): the wait for
# the step under way and its own prefill.
PRICED_PARTS = re.compile(r"busy=([0-9.]+)ms own=([0-9.]+)ms")


def priced_parts(route: str | None) -> tuple[float, float] | None:
    """(busy, own) seconds of the chosen rank's price in a request's route record, or None where
    the record has none (files from before they were recorded). A route that overrode another
    (a pull, a lease: "... over <the overridden route>") names its own before "over"; what
    follows is the overridden rank's (a pull's record from before it named its own has none)."""
    found = PRICED_PARTS.search((route or "").split(" over ", 1)[0])
    return None if found is None else (float(found[1]) / 1e3, float(found[2]) / 1e3)


def place_table(path: str, policy: str, phase: str | None, rows: int = 6) -> list[str]:
    """One markdown row per workload and place on a rank: a rank's requests in order of hand-over
    (arrival plus ``dispatch_s``), ``PLACES`` a row, the last row all the rest; repetitions and
    ranks pooled. Each row: the recorded price and the measured time to first token (mean ms), the
    share within 25 %, and the measured time's parts (``PARTS``, where recorded; a record without
    one counts 0 for it, its time left in ``rest``: what the parts leave, the token's way back to
    the caller). Where the routes recorded them, the price's own parts follow: the wait for the
    step under way (``busy``) and the request's own prefill (``own``), against the measured intake
    and first step."""
    data = json.load(open(path))
    pooled: dict[tuple[str, int], list[dict]] = {}
    for run in data["runs"]:
        if run["policy"] != policy or run.get("status", "ok") != "ok":
            continue
        by_rank: dict[int, list[dict]] = {}
        for r in requests(run):
            if (phase is None or r.get("phase") == phase) and r.get("predicted_ttft_s") is not None:
                by_rank.setdefault(r["rank"], []).append(r)
        for ranked in by_rank.values():
            ranked.sort(key=lambda r: r["arrival_s"] + (r.get("dispatch_s") or 0.0))
            for k, r in enumerate(ranked):
                pooled.setdefault((run["workload"], min(k // PLACES, rows - 1)), []).append(r)
    parts = [p for p in PARTS if any(r.get(p) is not None for group in pooled.values() for r in group)]
    priced = any(priced_parts(r.get("route_reason")) for group in pooled.values() for r in group)
    out = ["| workload | place | requests | priced ms | measured ms | within 25 % | "
           + " | ".join(p.removesuffix("_s") for p in parts) + " | rest |" + (" priced busy | priced own |" if priced else ""),
           "| --- | --- | ---: | ---: | ---: | ---: |" + " ---: |" * (len(parts) + 1 + 2 * priced)]
    for (workload, row), group in sorted(pooled.items()):
        measured = [r["first_token_s"] - r["arrival_s"] for r in group]
        ratios = [r["predicted_ttft_s"] / m for r, m in zip(group, measured) if m > 0]
        means = [statistics.fmean(r.get(p) or 0.0 for r in group) for p in parts]
        lo = row * PLACES
        place = f"{lo}-{lo + PLACES - 1}" if row < rows - 1 else f"{lo}+"
        mean_measured = statistics.fmean(measured)
        cells = [f"{1e3 * m:.0f}" for m in (*means, mean_measured - sum(means))]
        if priced:
            found = [p for p in (priced_parts(r.get("route_reason")) for r in group) if p is not None]
            cells += [f"{1e3 * statistics.fmean(p[i] for p in found):.0f}" if found else "" for i in (0, 1)]
        out.append(f"| {workload} | {place} | {len(group)} | "
                   f"{1e3 * statistics.fmean(r['predicted_ttft_s'] for r in group):.0f} | {1e3 * mean_measured:.0f} | "
                   f"{within(ratios) if ratios else 0.0:.2f} | " + " | ".join(cells) + " |")
    return out


# First tokens of one step reach the caller in one message, stamped microseconds apart; a rank's
# steps are milliseconds apart.
SAME_STEP_S = 1e-4


def joiner_ratios(run: dict, phase: str | None) -> tuple[list[float], list[float], list[float]]:
    """Per priced request of ``run`` (pulls apart, as ``replay_run``): recorded priced over measured
    time to first token; the same with the recorded own prefill (``own=``) of the requests routed
    after it to its rank that got their first token in the same step added (the joiners, known
    only afterwards); and with a forecast from what its route knew: the own prefill routed to its
    rank over the last ``busy`` seconds (its price's wait for the step under way), as much again
    over the next."""
    rows = requests(run)
    recorded: list[float] = []
    bound: list[float] = []
    forecast: list[float] = []
    parts = [priced_parts(r.get("route_reason")) or (0.0, 0.0) for r in rows]  # (busy, own) per row
    routed: dict[int, list[tuple[float, float]]] = {}  # rank -> (route time, own prefill) so far
    for i, r in enumerate(rows):
        busy, own = parts[i]
        earlier = routed.setdefault(r["rank"], [])
        recent = sum(o for t, o in earlier if t >= r["routed_s"] - busy)
        earlier.append((r["routed_s"], own))
        measured = r["first_token_s"] - r["routed_s"]
        if (r.get("predicted_ttft_s") is None or measured <= 0 or (phase and r.get("phase") != phase)
                or str(r.get("route", "")).startswith("pull")):
            continue
        joiners = sum(parts[j][1] for j in range(i + 1, len(rows)) if rows[j]["rank"] == r["rank"]
                      and abs(rows[j]["first_token_s"] - r["first_token_s"]) < SAME_STEP_S)
        price = r["predicted_ttft_s"] - (r.get("dispatch_s") or 0.0)
        recorded.append(price / measured)
        bound.append((price + joiners) / measured)
        forecast.append((price + recent) / measured)
    return recorded, bound, forecast


def joiner_table(paths: list[str], policy: str, phase: str | None) -> list[str]:
    """One markdown row per file and workload (repetitions pooled): the share of priced requests
    within 25 % as recorded, with the joiners' bound and with the forecast (``joiner_ratios``)."""
    out = ["| file | workload | requests | recorded | with the joiners (bound) | with the forecast |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
    for path in paths:
        pooled: dict[str, tuple[list[float], list[float], list[float]]] = {}
        for run in json.load(open(path))["runs"]:
            if run["policy"] == policy and run.get("status", "ok") == "ok":
                into = pooled.setdefault(run["workload"], ([], [], []))
                for acc, got in zip(into, joiner_ratios(run, phase)):
                    acc.extend(got)
        name = path.rsplit("/", 1)[-1].removesuffix(".json")
        for workload, (recorded, bound, forecast) in sorted(pooled.items()):
            if recorded:
                out.append(f"| `{name}` | {workload} | {len(recorded)} | {within(recorded):.2f} | "
                           f"{within(bound):.2f} | {within(forecast):.2f} |")
    return out


def limits_of(data: dict) -> Limits:
    """The scheduler limits a result file's pool ran with."""
    config = data["metadata"]["config"]
    # Overlapped on a GPU only, as the live pricer prices today's workers (``control.build.limits``).
    return Limits(config["block_size"], config["max_num_seqs"], config["max_num_batched_tokens"],
                  str(config.get("device", "cuda")).startswith("cuda"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--policy", default="lmpool")
    ap.add_argument("--phase", default=None, help="only requests of this phase (say, burst)")
    ap.add_argument("--table", action="store_true",
                    help="one markdown row per file and workload, repetitions pooled, with the distribution")
    ap.add_argument("--places", action="store_true",
                    help="priced against measured by a request's place on its rank, with the measured parts")
    ap.add_argument("--joiners", action="store_true",
                    help="within 25 %% as recorded, with the joiners' own prefill (a bound) and with a forecast")
    args = ap.parse_args(argv)
    if args.joiners:
        print("\n".join(joiner_table(args.files, args.policy, args.phase)))
        return
    if args.places:
        for path in args.files:
            print("\n".join(place_table(path, args.policy, args.phase)))
        return
    if args.table:
        print("\n".join(table(args.files, args.policy, args.phase)))
        steps = step_table(args.files, args.policy)
        if len(steps) > 2:  # files recorded with the step accuracy
            print("\n" + "\n".join(steps))
        return
    for path in args.files:
        data = json.load(open(path))
        limits = limits_of(data)
        for run in data["runs"]:
            if run["policy"] != args.policy or run.get("status", "ok") != "ok":
                continue
            pairs = replay_run(run, limits, args.phase)
            if pairs:
                s = summary(pairs)
                print(f"{run['workload']} rep {run['rep']}: {s['requests']} requests, within 25 %: recorded "
                      f"{s['recorded_25pct']:.2f}, replayed {s['replayed_25pct']:.2f}; median priced/measured "
                      f"{s['recorded_median']:.2f} / {s['replayed_median']:.2f}")


if __name__ == "__main__":
    main()
