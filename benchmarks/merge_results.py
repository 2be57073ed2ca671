"""Merge evaluation JSONs that split one suite (by policy, level, workload or repetition
range) into one file, recomputing the summary and the comparisons from the merged runs.

    python -m benchmarks.merge_results -o merged.json part1.json part2.json ...

Used when a suite is spread over several GPUs or several sessions: each part runs a
subset (``--policies``, ``--levels``, ``--workloads``, ``--first-rep``, or some of a sweep's
settings) with otherwise identical settings. Parts must agree on the benchmark, the model and every setting that
shapes a run; two parts may not both hold the same (workload, policy, repetition).
Parts should also come from the same code; the revisions the parts recorded are listed
in ``metadata.revisions``, with a warning when they differ (not an error: a copy of the
tree without its own git history can record a wrong one, see ``eval_suite.environment``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


from benchmarks.stats import claims
from benchmarks.stats.eval_metrics import summarize
from benchmarks.eval_suite import write_json

# Settings that change what a run measures; the others (policies, levels, workloads,
# repetition range, output path, progress, time limits) may differ between parts.
MUST_MATCH = ("device", "world_size", "block_size", "dtype", "max_num_seqs", "max_num_batched_tokens",
              "enforce_eager", "scale", "max_tokens", "seed", "mps", "transfer_profile", "order")
# A run's own setting: parts that record it per workload key (``settings``) may split a sweep
# between them; older parts, which do not, must agree on it.
SETTING_FLAGS = ("num_kv_blocks", "arrival", "window", "rate")


def comparisons_for(benchmark: str):
    if benchmark == "kv_routing":
        from benchmarks.benchmark_kv_routing import comparisons
    elif benchmark == "e2e":
        from benchmarks.benchmark_e2e import comparisons
    elif benchmark == "hot_context":
        from benchmarks.benchmark_hot_context import comparisons
    else:
        raise ValueError(f"not an evaluation benchmark: {benchmark!r}")
    return comparisons


def merge(parts: list[dict]) -> dict:
    if not parts:
        raise ValueError("nothing to merge")
    first = parts[0]
    for i, part in enumerate(parts[1:], 1):
        if part["benchmark"] != first["benchmark"]:
            raise ValueError(f"part {i} is {part['benchmark']}, part 0 is {first['benchmark']}")
        if part["metadata"]["model"] != first["metadata"]["model"]:
            raise ValueError(f"part {i} served another model")
        a, b = first["metadata"]["config"], part["metadata"]["config"]
        flags = MUST_MATCH if all("settings" in p for p in parts) else (*MUST_MATCH, *SETTING_FLAGS)
        differ = [k for k in flags if a.get(k) != b.get(k)]
        if differ:
            raise ValueError(f"part {i} differs from part 0 in {differ}")
    merged = json.loads(json.dumps(first))  # a deep copy
    merged["metadata"]["merged_from"] = [p["metadata"] for p in parts]
    seen = set()
    merged["runs"], merged["policies"] = [], {}
    merged_settings = _merged_settings(parts)
    if merged_settings is not None:
        merged["settings"] = merged_settings
        # Parts split by policy ran different orders in one repetition: keep each part's.
        merged.pop("orders", None)
        merged["part_orders"] = [p.get("orders", {}) for p in parts]
    for part in parts:
        for run in part["runs"]:
            key = (run["workload"], run["policy"], run["rep"])
            if key in seen:
                raise ValueError(f"two parts hold {key}")
            seen.add(key)
            merged["runs"].append(run)
        merged["metadata"]["dataset_profile"].update(part["metadata"]["dataset_profile"])
        for name, state in part["policies"].items():
            # A policy is as good as its worst part: an unavailable or failed part shows.
            if merged["policies"].get(name, {}).get("status", "ok") == "ok":
                merged["policies"][name] = state
    merged["runs"].sort(key=lambda r: (r["rep"], r["workload"], r["policy"]))
    revisions = sorted({str((p["metadata"].get("git") or {}).get("revision")) for p in parts})
    merged["metadata"]["revisions"] = revisions
    if len(revisions) > 1:
        print(f"warning: the parts recorded different revisions {revisions}: merge only parts run from "
              f"the same code", file=sys.stderr)
    merged["summary"] = summarize(merged["runs"])
    compare = comparisons_for(merged["benchmark"])
    merged["comparisons"] = (claims.finish(compare, merged["summary"], merged_settings) if merged_settings is not None
                             else compare(merged["summary"]))
    stopped = _uncovered_stops(parts, merged["runs"])
    merged.pop("stopped_early", None)
    if stopped:
        merged["stopped_early"] = "; ".join(stopped)
    return merged


def _merged_settings(parts: list[dict]) -> dict | None:
    """Every part's workload keys and their settings; a key two parts ran under different
    settings is refused. None when some part predates recorded settings."""
    if not all("settings" in p for p in parts):
        return None
    merged: dict = {}
    for i, part in enumerate(parts):
        for key, setting in part["settings"].items():
            if merged.setdefault(key, setting) != setting:
                raise ValueError(f"part {i} ran {key} under {setting}, another part under {merged[key]}")
    return merged


def _uncovered_stops(parts: list[dict], runs: list[dict]) -> list[str]:
    """The early stops of parts whose missing repetitions no other part ran: a part that
    stopped after N repetitions and was continued by another (``--first-rep``) leaves the
    merged suite whole, and saying it stopped early would misread it."""
    held = {(r["workload"], r["policy"], r["rep"]) for r in runs}
    notes = []
    for part in parts:
        if not part.get("stopped_early"):
            continue
        config = part["metadata"]["config"]
        if "reps" not in config:  # what it asked for is unknown: keep its note
            notes.append(part["stopped_early"])
            continue
        asked = range(config.get("first_rep", 0), config.get("first_rep", 0) + config["reps"])
        cells = {(r["workload"], r["policy"]) for r in part["runs"]}
        missing = sorted({rep for rep in asked for w, p in cells if (w, p, rep) not in held})
        if missing:
            notes.append(f"{part['stopped_early']} (repetitions {missing} not run)")
    return notes


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("parts", nargs="+", type=Path)
    args = ap.parse_args(argv)
    merged = merge([json.loads(p.read_text()) for p in args.parts])
    write_json(args.output, merged)
    print(f"saved json: {args.output} ({len(merged['runs'])} runs)")
    return merged


if __name__ == "__main__":
    main(sys.argv[1:])
