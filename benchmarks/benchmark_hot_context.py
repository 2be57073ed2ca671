"""Hot contexts: long shared contexts read once on their owners, then a burst of questions
about them, under every routing-only policy and LMPool's transfer modes; and the same
burst with every context pre-placed on every replica (the oracle), to show what placing
context could be worth (``hot_context.py`` says the traces).

    python -m benchmarks.benchmark_hot_context --quick                       # CPU, a minute or two
    python -m benchmarks.benchmark_hot_context --device cuda --preset 0.6b --world-size 4 \\
        --dtype bfloat16 --block-size 256 --reps 3 --mps --contexts 16384 --hot 1,2
    ... --window 0 --sweep arrival=window,poisson:16,poisson:64            # burst and Poisson arrivals

Window 0 by default: the burst arrives at once. Writes one JSON (``--json``; default
``eval_<device>_<preset>_hot_context.json`` under the temporary directory's ``lmpool-eval/``: the
committed results change only when ``--json`` names them); ``plot_results.py`` draws
one figure per workload.
"""

from __future__ import annotations

import argparse
import sys


from benchmarks.stats.eval_metrics import paired_change
from benchmarks.peers.eval_policies import ROUTING_ONLY
from benchmarks.replay.eval_settings import trace_of
from benchmarks.eval_suite import (
    CANDIDATES, LMPOOL, TRANSFER_MODES, add_arguments, chosen_policies, file_traces, finish_arguments, run_suite,
    vocab_size,
)
from benchmarks.workloads.hot_context import CONTEXT_LENGTHS, HOT_COUNTS, QUESTIONS, hot_context, workload_name

POLICIES = (*ROUTING_ONLY, LMPOOL, *TRANSFER_MODES, *CANDIDATES)
ROUTING_ONLY_NAMES = {p.name for p in ROUTING_ONLY}
QUICK_POLICIES = "round_robin,lmpool,lmpool-routing"
POOL_BLOCKS = 2048  # whole-pool KV budget: 512 blocks per worker at 4 replicas, two 32k contexts fit everywhere
COMPARED = ("burst/throughput_tok_s", "burst/ttft_mean_ms", "burst/e2e_mean_ms", "throughput_tok_s",
            "ttft_mean_ms", "e2e_mean_ms", "burst/dp_tok_reuse")
# (summary metric, higher is better) for the oracle's gain and how much of it a policy captures.
CAPTURED = (("burst/throughput_tok_s", True), ("burst/ttft_mean_ms", False))


def oracle_key(key: str) -> str:
    """The oracle's key of a real trace's key, setting kept: ``w@kv96_w0`` -> ``w_oracle@kv96_w0``."""
    workload, sep, label = key.partition("@")
    return f"{workload}_oracle{sep}{label}"


def _mean(by_policy: dict, policy: str, metric: str) -> float | None:
    return (by_policy.get(policy, {}).get(metric) or {}).get("mean")


def _best(by_policy: dict, policies, metric: str, higher: bool) -> tuple[str, float] | None:
    means = [(p, _mean(by_policy, p, metric)) for p in policies]
    means = [(p, m) for p, m in means if m is not None]
    if not means:
        return None
    return (max if higher else min)(means, key=lambda pm: pm[1])


def capture(real: dict, oracle: dict, metric: str, higher: bool) -> dict | None:
    """The oracle's gain over the best routing-only policy on ``metric``, and the share of it
    each transfer-moving candidate captures ((candidate - best) / (oracle - best), on means)."""
    best, top = _best(real, ROUTING_ONLY_NAMES, metric, higher), _best(oracle, oracle.keys(), metric, higher)
    if best is None or top is None:
        return None
    gain = top[1] - best[1]
    out = {"best_routing_only": best[0], "best_routing_only_mean": best[1], "oracle_best": top[0],
           "oracle_mean": top[1], "oracle_gain": gain / best[1] if best[1] else None, "captured": {}}
    for candidate in real:
        value = _mean(real, candidate, metric)
        if candidate not in ROUTING_ONLY_NAMES and value is not None:
            out["captured"][candidate] = (value - best[1]) / gain if (gain > 0) == higher and gain else None
    return out


def acceptance_at(summary: dict, out: dict, key: str) -> dict:
    """The acceptance figures of one real trace and setting: the oracle's gain and its capture,
    whether each candidate is ahead of every routing-only policy in burst throughput and never
    behind in mean E2E (paired intervals), and LMPool routing against round robin on the oracle."""
    acc: dict = {"workload": key, "oracle": oracle_key(key)}
    oracle = summary.get(oracle_key(key), {})
    acc["capture"] = {m: capture(summary[key], oracle, m, h) for m, h in CAPTURED} if oracle else None
    acc["candidates"] = {}
    for candidate, rows in out.get(key, {}).items():
        if candidate in ROUTING_ONLY_NAMES:
            continue
        said = {b: {m: (rows[b].get(m) or {}).get("claim") for m in ("burst/throughput_tok_s", "e2e_mean_ms")}
                for b in rows}
        ahead = [s["burst/throughput_tok_s"] == "ahead" for s in said.values()]
        acc["candidates"][candidate] = {
            "ahead_of_every_routing_only": bool(ahead) and all(ahead),
            "behind_on_e2e": sorted(b for b, s in said.items() if s["e2e_mean_ms"] == "behind")}
    on_oracle = paired_change(oracle, "lmpool", "round_robin", "burst/throughput_tok_s") if oracle else None
    acc["oracle_lmpool_vs_round_robin"] = on_oracle and on_oracle["claim"]
    return acc


def comparisons(summary: dict) -> dict:
    """Per workload key (real and oracle): LMPool routing only and every transfer-moving policy
    against every routing-only peer, paired by repetition; ``acceptance`` per real key."""
    out: dict = {}
    for key, by_policy in sorted(summary.items()):
        baselines = sorted(p for p in by_policy if p in ROUTING_ONLY_NAMES and p != "lmpool-routing")
        candidates = sorted(p for p in by_policy if p == "lmpool-routing" or p not in ROUTING_ONLY_NAMES)
        out[key] = {c: {b: {m: paired_change(by_policy, c, b, m) for m in COMPARED} for b in baselines}
                    for c in candidates}
    real = [k for k in summary if not trace_of(k).endswith("_oracle")]
    out["acceptance"] = {k: acceptance_at(summary, out, k) for k in sorted(real)}
    return out


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"{flag} needs integers >= 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.set_defaults(window=0)
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXT_LENGTHS)),
                    help="context lengths in tokens at scale 1 (default 4096,16384,32768)")
    ap.add_argument("--hot", default=",".join(map(str, HOT_COUNTS)), help="hot contexts per trace (default 1,2)")
    ap.add_argument("--questions", type=int, default=QUESTIONS, help="requests in the burst (default 128)")
    oracle = ap.add_mutually_exclusive_group()
    oracle.add_argument("--no-oracle", action="store_true", help="leave out the oracle traces")
    oracle.add_argument("--oracle-only", action="store_true",
                        help="only the oracle traces: run them with fewer policies than the real ones "
                             "(the capture reads the oracle's best), then merge the two files")
    args = finish_arguments(ap.parse_args(argv), POOL_BLOCKS, "hot_context")
    lengths, counts = _ints(args.contexts, "--contexts"), _ints(args.hot, "--hot")
    if args.questions < max(counts):
        raise SystemExit(f"--questions must be at least the most hot contexts ({max(counts)})")
    policies = chosen_policies(args, POLICIES, QUICK_POLICIES)
    vocab = vocab_size(args)
    traces: dict[str, dict[int, object]] = {}
    for length in lengths:
        for n in counts:
            for oracle in (False,) if args.no_oracle else (True,) if args.oracle_only else (False, True):
                traces[workload_name(length, n, oracle)] = {
                    r: hot_context(length, n, args.seed + r, vocab, args.world_size, args.scale, args.max_tokens,
                                   args.questions, oracle) for r in args.rep_ids}
    return run_suite(args, "hot_context", traces | file_traces(args), policies, comparisons)


if __name__ == "__main__":
    main(sys.argv[1:])
