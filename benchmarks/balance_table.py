"""How evenly each policy's requests shared their ranks, from an evaluation JSON's records.

    python -m benchmarks.balance_table benchmarks/results/eval_h200_0.6b_e2e_agent80.json

Per policy, repetitions pooled, one markdown row:
- **co-runners**: for each request, the other requests on its rank over its life (their overlap
  with its arrival-to-completion span, divided by that span), the mean and standard deviation
  over requests. With ``w`` requests in flight over ``R`` ranks, an even pool gives ``w/R - 1``;
  a crowded rank's requests are the many that see it, so imbalance raises the mean;
- **E2E**: the mean, and the least-squares slope of a request's E2E on its co-runners (what one
  more request beside it cost it);
- **phase tails**: the share of the ranks' time, phase by phase (phases are barriers), that a
  rank spent done while the phase's last request ran elsewhere.

The slope times the mean's excess over an even pool bounds what balancing (with every cache
kept) could take off the mean E2E. Requests without a completion (failed) are left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def co_runners(arrival: list[float], completion: list[float], ranks: list[int]) -> list[float]:
    """Per request, the mean count of other requests on its rank over its life."""
    by_rank: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(ranks):
        by_rank[r].append(i)
    out = []
    for i, r in enumerate(ranks):
        a, c = arrival[i], completion[i]
        overlap = sum(max(0.0, min(c, completion[j]) - max(a, arrival[j])) for j in by_rank[r] if j != i)
        out.append(overlap / (c - a) if c > a else 0.0)
    return out


def tail_share(arrival: list[float], completion: list[float], ranks: list[int], phases: list[str],
               world: int) -> float:
    """The ranks' idle share at the phases' tails: sum over phases of each rank's time from its
    last completion to the phase's, over world x the phases' spans."""
    by_phase: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(phases):
        by_phase[p].append(i)
    span = idle = 0.0
    for members in by_phase.values():
        start = min(arrival[i] for i in members)
        end = max(completion[i] for i in members)
        last = dict.fromkeys(range(world), start)
        for i in members:
            last[ranks[i]] = max(last[ranks[i]], completion[i])
        span += world * (end - start)
        idle += sum(end - t for t in last.values())
    return idle / span if span > 0 else 0.0


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` on ``xs`` (0 when ``xs`` do not vary)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0


def rows(data: dict) -> dict[str, dict]:
    """Per policy: co-runners (mean, sd), E2E (mean, slope per co-runner) in seconds, tails' share,
    requests and repetitions."""
    pooled: dict[str, dict] = defaultdict(lambda: {"x": [], "y": [], "tails": []})
    for run in data["runs"]:
        if run.get("status") != "ok":
            continue
        q = run["requests"]
        done = [i for i, c in enumerate(q["completion_s"]) if c is not None]
        arrival = [q["arrival_s"][i] for i in done]
        completion = [q["completion_s"][i] for i in done]
        ranks = [q["rank"][i] for i in done]
        p = pooled[run["policy"]]
        p["x"] += co_runners(arrival, completion, ranks)
        p["y"] += [c - a for a, c in zip(arrival, completion)]
        world = max(len(run.get("rank_stats") or ()), max(ranks, default=-1) + 1)  # a rank may serve none
        p["tails"].append(tail_share(arrival, completion, ranks, [q["phase"][i] for i in done], world))
    return {policy: {"co_runners": statistics.fmean(p["x"]), "sd": statistics.pstdev(p["x"]),
                     "e2e_s": statistics.fmean(p["y"]), "e2e_per_co_runner_s": slope(p["x"], p["y"]),
                     "tails": statistics.fmean(p["tails"]), "requests": len(p["x"]), "runs": len(p["tails"])}
            for policy, p in pooled.items()}


def table(path: Path) -> str:
    lines = [f"`{path.name}`", "",
             "| policy | runs | requests | co-runners, mean (sd) | E2E ms | E2E per co-runner ms | phase tails |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for policy, r in rows(json.loads(path.read_text())).items():
        lines.append(f"| `{policy}` | {r['runs']} | {r['requests']} | {r['co_runners']:.2f} ({r['sd']:.2f}) | "
                     f"{r['e2e_s'] * 1e3:.0f} | {r['e2e_per_co_runner_s'] * 1e3:.1f} | {r['tails']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path, nargs="+")
    args = ap.parse_args()
    print("\n\n".join(table(p) for p in args.json))


if __name__ == "__main__":
    main()
