"""What dense attention's plans cost (``lmpool.ops.dense_attention``): the first call at each new
length against the calls after it, with cuDNN's plans keyed by every length
(``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=0``) and by power-of-two buckets (``=1``, the engine's
default), each in a process of its own (torch reads the variable once); every result against
the reference where it fits; and ``warm``'s calls and seconds for the 0.6B shape (16 query heads
over 8 key heads of 128, queries of 512 to 8,192 tokens over up to 40,960 keys). A first call
that took more than ``BUILT_MS`` longer than the next ones built a plan: with bucketed plans,
lengths sharing a bucket with an earlier one should build none, and nothing should after warm.
Then, once warm, each setting's steady calls at a few lengths (the median of ``STEADY_CALLS``
timed by CUDA events): whether a bucket's plan, built for its bucket's length, runs the lengths
under it slower than a plan of their own. ``--rounds 2`` runs the settings in both orders (four
processes) and prints them side by side.

    python -m tools.diagnostics.probe_dense_plans --json dense_plans.json [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from benchmarks.lib.revision import git_record

# (query, cached prefix): lengths new to a process, then ones sharing their buckets.
SHAPES = [(4096, 0), (5003, 0), (4097, 0), (6000, 0), (777, 0), (2000, 8192), (2001, 8192), (3000, 9000),
          (600, 1200), (513, 300), (8192, 0), (8192, 8192), (8000, 8300), (1500, 20000), (5003, 0)]
AFTER_WARM = [(4500, 0), (1111, 7777), (3333, 12345), (700, 25000), (8100, 8100)]
STEADY = [(8192, 0), (8192, 8192), (5003, 0), (4096, 0), (777, 0), (3000, 9000), (1500, 20000)]
STEADY_CALLS = 20
CHECKED = 3000 * 9000  # query x context at most, for the reference (its fp32 scores)
CHILD_S = 150  # a setting's process at most
BUILT_MS = 10.0  # a first call this much slower than the next ones built a plan (a build: 43-90 ms)


def operands(n: int, prefix: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random queries of ``n`` tokens (16 heads of 128) over keys and values of ``prefix + n`` (8 heads)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(rows, heads, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                 for rows, heads in ((n, 16), (n + prefix, 8), (n + prefix, 8)))


def timed_call(n: int, prefix: int, seed: int) -> dict:
    from lmpool.ops import dense_attention, reference
    q, k, v = operands(n, prefix, seed)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = dense_attention.one_sequence_attention(q, k, v, 128**-0.5)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(3):
        dense_attention.one_sequence_attention(q, k, v, 128**-0.5)
    torch.cuda.synchronize()
    again = (time.perf_counter() - start) / 3
    err = None
    if n * (n + prefix) <= CHECKED:
        want = reference.attention_over(q.float(), k.float(), v.float(), 128**-0.5)
        err = float((out.float() - want).abs().max())
    return {"n": n, "prefix": prefix, "first_ms": first * 1e3, "again_ms": again * 1e3, "max_abs_err": err}


def steady_call(n: int, prefix: int, seed: int) -> dict:
    """The median of ``STEADY_CALLS`` calls at one length, after three untimed ones."""
    from lmpool.ops import dense_attention
    q, k, v = operands(n, prefix, seed)
    for _ in range(3):
        dense_attention.one_sequence_attention(q, k, v, 128**-0.5)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(STEADY_CALLS)]
    for start, end in events:
        start.record()
        dense_attention.one_sequence_attention(q, k, v, 128**-0.5)
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return {"n": n, "prefix": prefix, "median_ms": times[len(times) // 2], "min_ms": times[0]}


def one_setting(flag: str) -> dict:
    """This process's measurements with the variable at ``flag`` (set before torch's first use)."""
    os.environ["TORCH_CUDNN_SDPA_AVOID_RECOMPILE"] = flag
    from lmpool.ops import dense_attention
    device = torch.device("cuda", 0)
    start = time.perf_counter()
    result: dict = {"avoid_recompile": flag, "usable": dense_attention.usable(device),
                    "usable_s": time.perf_counter() - start}
    result["shapes"] = [timed_call(n, p, i) for i, (n, p) in enumerate(SHAPES)]
    start = time.perf_counter()
    result["warm_calls"] = dense_attention.warm(device, torch.bfloat16, 16, 8, 128, 512, 8192, 40960)
    result["warm_s"] = time.perf_counter() - start
    result["after_warm"] = [timed_call(n, p, 100 + i) for i, (n, p) in enumerate(AFTER_WARM)]
    result["steady"] = [steady_call(n, p, 200 + i) for i, (n, p) in enumerate(STEADY)]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of both settings, in alternating order")
    parser.add_argument("--setting", default=None, help=argparse.SUPPRESS)  # the child's flag
    args = parser.parse_args()
    if args.setting is not None:
        print(json.dumps(one_setting(args.setting)))
        return
    runs: list[dict] = []
    for round_ in range(args.rounds):
        for flag in ("1", "0") if round_ % 2 == 0 else ("0", "1"):
            # Each written as it ends: a later one's timeout keeps the earlier.
            runs.append(child_run(flag) | {"round": round_})
            report(runs[-1])
            if args.json:
                with open(args.json, "w") as f:
                    record = {"benchmark": "dense_plans", "git": git_record(), "torch": torch.__version__,
                              "runs": runs, "steady": side_by_side(runs)}
                    json.dump(record, f, indent=1)
    for row in side_by_side(runs):
        print(f"steady {row['n']:>5} over {row['prefix']:>5}: bucketed {row['bucketed_ms']:7.3f} ms, "
              f"per length {row['per_length_ms']:7.3f} ms, ratio {row['ratio']:.3f}")


def child_run(flag: str) -> dict:
    command = [sys.executable, "-m", "tools.diagnostics.probe_dense_plans", "--setting", flag]
    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_S)
    except subprocess.TimeoutExpired:
        return {"avoid_recompile": flag, "error": f"timed out after {CHILD_S} s"}
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    run = json.loads(lines[-1]) if lines else {"avoid_recompile": flag, "error": child.stderr[-3000:]}
    for s in run.get("shapes", []) + run.get("after_warm", []):
        s["built"] = s["first_ms"] - s["again_ms"] > BUILT_MS
    return run


def side_by_side(runs: list[dict]) -> list[dict]:
    """Per steady length, the mean over rounds of each setting's median, and bucketed over per length."""
    by_flag: dict[str, dict[tuple[int, int], list[float]]] = {"1": {}, "0": {}}
    for run in runs:
        for s in run.get("steady", []):
            by_flag[run["avoid_recompile"]].setdefault((s["n"], s["prefix"]), []).append(s["median_ms"])
    rows = []
    for key in by_flag["1"].keys() & by_flag["0"].keys():
        bucketed, own = (sum(v) / len(v) for v in (by_flag["1"][key], by_flag["0"][key]))
        rows.append({"n": key[0], "prefix": key[1], "bucketed_ms": bucketed, "per_length_ms": own,
                     "ratio": bucketed / own})
    return sorted(rows, key=lambda r: (r["n"], r["prefix"]))


def report(run: dict) -> None:
    shapes = run.get("shapes", []) + run.get("after_warm", [])
    print(f"avoid_recompile={run['avoid_recompile']} usable={run.get('usable')} "
          f"warm: {run.get('warm_calls')} calls in {run.get('warm_s', float('nan')):.2f} s; "
          f"{sum(s['built'] for s in shapes)} of {len(shapes)} calls built a plan {run.get('error', '')}")
    for s in shapes:
        print(f"  {s['n']:>5} over {s['prefix']:>5}: first {s['first_ms']:8.1f} ms, then {s['again_ms']:7.2f} ms,"
              f" max |err| {s['max_abs_err']}{'  (built)' if s['built'] else ''}")


if __name__ == "__main__":
    main()
