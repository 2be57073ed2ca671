"""The claims a result makes, counted, with the setting each was measured under.

A runner's comparisons hold paired changes (``eval_metrics.paired_change``), each with a
claim: ahead / level / behind by the 95% interval of the per-repetition paired differences.
``finish`` lists every claim once with its workload key and setting, and counts them: each
holds at 95% on its own, so among N claims about 0.05 N "ahead"/"behind" verdicts can be
chance; the count is stated so a reader can judge (no correction is applied).
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.replay.eval_settings import trace_of


def _walk(node, path: tuple[str, ...]):
    if isinstance(node, dict):
        if "claim" in node and "difference" in node:
            yield path, node
            return
        for key, child in node.items():
            yield from _walk(child, (*path, str(key)))


def claim_rows(comparisons: dict, settings: dict[str, dict]) -> list[dict]:
    """One row per paired change with a claim: where it sits, its verdict and interval, and
    the setting (budget, window, arrival, order) of its workload key."""
    rows = []
    for path, change in _walk({k: v for k, v in comparisons.items() if k not in ("claims", "settings")}, ()):
        key = next((p for p in path if p in settings), None)
        diff = change["difference"]
        rows.append({"path": "/".join(path), "workload": key, "claim": change["claim"],
                     "difference_mean": diff["mean"], "difference_low": diff["low"], "difference_high": diff["high"],
                     "n": diff["n"], "setting": settings.get(key) if key else None})
    return rows


def _headlines(out: dict) -> list[dict]:
    """The acceptance blocks: one (``acceptance``), one per setting (``acceptance_by_setting``)
    or one per workload key (a dict of them), each naming its ``workload`` key."""
    blocks = [out.get("acceptance"), *(out.get("acceptance_by_setting") or {}).values()]
    if isinstance(out.get("acceptance"), dict) and "workload" not in out["acceptance"]:
        blocks += list(out["acceptance"].values())
    return [b for b in blocks if isinstance(b, dict) and isinstance(b.get("workload"), str)]


def finish(comparisons_of: Callable[[dict], dict], summary: dict, settings: dict[str, dict]) -> dict:
    """The runner's comparisons, plus ``settings`` (per workload key) and ``claims`` (every
    verdict, with ``count``: how many were decided by an interval)."""
    out = comparisons_of(summary)
    rows = claim_rows(out, settings)
    decided = [r for r in rows if r["claim"] is not None]
    out["settings"] = {k: v for k, v in settings.items() if k in summary}
    for block in _headlines(out):  # a headline says its setting
        block["setting"] = settings[block["workload"]]
    out["claims"] = {"confidence": 0.95, "count": len(decided),
                     "ahead": sum(r["claim"] == "ahead" for r in decided),
                     "behind": sum(r["claim"] == "behind" for r in decided),
                     "level": sum(r["claim"] == "level" for r in decided),
                     "rows": rows}
    return out

