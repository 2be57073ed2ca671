"""Where two policies of one evaluation JSON sent the same requests, request by request.

    python -m benchmarks.route_diff benchmarks/results/eval_cpu_quick_smg_kv_routing.json \
        --a smg_cache_aware --b sglang_cache_aware

Both policies replayed the same trace in each (workload, repetition), so request ``i`` is
the same prompt in both runs. Rank numbers are only labels (which host a gateway's tie goes
to first is its own business), so requests are compared by what labels cannot change:
whether a request ran where the first routed request of its group ran ("stays"), and how
many tokens it found cached. Per workload and repetition it prints the routed requests that
stayed and the cold ones (no cached token) under each policy, the groups spread over more
than one host, and every request on which the two differ. Pinned requests are left out:
the workload placed them, not the policy.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path



def columns(data: dict, policy: str) -> dict[tuple[str, int], dict]:
    return {(r["workload"], r["rep"]): r["requests"] for r in data["runs"]
            if r["policy"] == policy and r["status"] == "ok"}


def stays(req: dict, routed: list[int]) -> dict[int, bool]:
    """Per routed request: whether it ran on the host of its group's first routed request."""
    home: dict[str, int] = {}
    out = {}
    for i in routed:
        home.setdefault(req["group"][i], req["rank"][i])
        out[i] = req["rank"][i] == home[req["group"][i]]
    return out


def spread(req: dict, routed: list[int]) -> dict[str, int]:
    """Hosts used by each group's routed requests, for groups that used more than one."""
    hosts = defaultdict(set)
    for i in routed:
        hosts[req["group"][i]].add(req["rank"][i])
    return {g: len(h) for g, h in sorted(hosts.items()) if len(h) > 1}


def compare(a: dict, b: dict) -> dict:
    routed = [i for i, pin in enumerate(a["pinned_rank"]) if pin is None]
    sa, sb = stays(a, routed), stays(b, routed)
    ca, cb = a["num_cached_tokens"], b["num_cached_tokens"]
    return {
        "routed": len(routed), "stay": (sum(sa.values()), sum(sb.values())),
        "cold": (sum(ca[i] == 0 for i in routed), sum(cb[i] == 0 for i in routed)),
        "cached": (sum(ca[i] for i in routed), sum(cb[i] for i in routed)),
        "spread": (spread(a, routed), spread(b, routed)),
        "differ": [(i, a["phase"][i], a["group"][i], sa[i], sb[i], ca[i], cb[i])
                   for i in routed if sa[i] != sb[i] or ca[i] != cb[i]],
    }


def report(path: Path, pa: str, pb: str, limit: int) -> str:
    data = json.loads(path.read_text())
    runs_a, runs_b = columns(data, pa), columns(data, pb)
    lines = [f"{path.name}: {pa} (a) vs {pb} (b)"]
    for key in sorted(runs_a.keys() & runs_b.keys()):
        c = compare(runs_a[key], runs_b[key])
        lines.append(f"- {key[0]} rep {key[1]}, {c['routed']} routed requests: stayed with their group "
                     f"a {c['stay'][0]}, b {c['stay'][1]}; cold a {c['cold'][0]}, b {c['cold'][1]}; "
                     f"cached tokens a {c['cached'][0]}, b {c['cached'][1]}")
        for name, groups in zip("ab", c["spread"]):
            if groups:
                lines.append(f"  {name}: groups on more than one host {groups}")
        for i, phase, group, sa, sb, ca, cb in c["differ"][:limit]:
            where = {True: "stayed", False: "moved"}
            lines.append(f"  request {i} ({phase}, {group}): a {where[sa]}, {ca} cached; b {where[sb]}, {cb} cached")
        if len(c["differ"]) > limit:
            lines.append(f"  ... and {len(c['differ']) - limit} more")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path, nargs="+")
    ap.add_argument("--a", default="smg_cache_aware")
    ap.add_argument("--b", default="sglang_cache_aware")
    ap.add_argument("--limit", type=int, default=12, help="differing requests listed per run")
    args = ap.parse_args()
    print("\n\n".join(report(p, args.a, args.b, args.limit) for p in args.json))


if __name__ == "__main__":
    main()
