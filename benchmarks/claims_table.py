"""Where LMPool stands against each peer, per workload and setting, as a Markdown table.

    python -m benchmarks.claims_table benchmarks/results/eval_h200_0.6b_kv_routing.json ...

Recomputes the comparisons from each JSON's runs (so older results are read by today's rule:
the paired differences' 95% interval), then prints one row per (file, workload key, peer):
ahead / level / behind on throughput, mean TTFT and mean E2E, with the mean paired relative
change, the repetitions paired, and the setting (budget, window, arrival, order) the runs
had. A setting the JSON does not record is read from its config and marked "order not
recorded" where the order was not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


from benchmarks.stats.eval_metrics import paired_change, summarize
from benchmarks.peers.eval_policies import PEER_NAMES

METRICS = (("throughput_tok_s", "tok/s"), ("ttft_mean_ms", "mean TTFT"), ("e2e_mean_ms", "mean E2E"))
CANDIDATES = ("lmpool-default", "lmpool")  # the first one a file ran is LMPool's row


def setting_text(data: dict, key: str) -> str:
    s = (data.get("settings") or {}).get(key)
    if s is None:
        cfg = data["metadata"]["config"]
        s = {"kv_blocks_per_worker": cfg["num_kv_blocks"], "window": cfg.get("window", 16),
             "arrival": cfg.get("arrival", "window"), "rate": cfg.get("rate"), "order": cfg.get("order")}
    arrival = "closed loop" if s["arrival"] == "window" else f"Poisson {s['rate']:g}/s"
    order = f"{s['order']} order" if s.get("order") else "order not recorded"
    return f"{s['kv_blocks_per_worker']} blocks/worker, window {s['window'] or 'unlimited'}, {arrival}, {order}"


def cell(change: dict | None) -> str:
    if change is None:
        return "-"
    rel = change.get("relative_change") or {}
    pct = f" {100 * rel['mean']:+.1f}%" if rel.get("mean") is not None else ""
    return f"{change['claim'] or 'no interval'}{pct}"


def rows(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    summary = summarize(data["runs"])
    out = []
    for key, by_policy in sorted(summary.items()):
        lmpool = next((c for c in CANDIDATES if c in by_policy), None)
        if lmpool is None:
            continue
        for peer in sorted(p for p in by_policy if p in PEER_NAMES):
            changes = [paired_change(by_policy, lmpool, peer, m) for m, _ in METRICS]
            n = next((c["difference"]["n"] for c in changes if c), 0)
            out.append(f"| {path.stem} | {key} | {setting_text(data, key)} | {lmpool} vs {peer} | "
                       + " | ".join(cell(c) for c in changes) + f" | {n} |")
    return out


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    lines = ["| file | workload | setting | comparison | " + " | ".join(label for _, label in METRICS) + " | pairs |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in METRICS) + " | ---: |"]
    for path in args.files:
        lines += rows(path)
    decided = sum(line.count("ahead") + line.count("behind") + line.count("level") for line in lines[2:])
    lines.append(f"\n{decided} claims, each at 95% on its own (no correction for their number).")
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
