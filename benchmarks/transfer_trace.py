"""Where a GPU transfer's time goes, from the kernel traces of a ``benchmark_kv_transfer.py
--trace DIR`` run: per path, direction and block count, the medians over the measured
repetitions of what each end's kernels did.

    python -m benchmarks.transfer_trace DIR [--json breakdown.json]

Each end is read on its own clock (no figure compares timestamps of two processes):

- sender (a packed path): from its first pack's start, when the first chunk went on the
  wire (``first_send_us``), how long the wire was busy from then (``wire_us``: first send's
  start to last send's end) and how long the sender took in all (``sender_us``); the first
  pack alone (``pack0_us``), all packs (``packs_us``), and how many NCCL kernels were on the
  wire at once on average (``lanes_busy``: their summed time over ``wire_us``);
- receiver (a packed path): from the last receive's end to the last unpack's start
  (``tail_wait_us``: the host seeing the chunk and launching its unpack, or the unpack
  queued behind earlier ones) and to its end (``tail_us``);
- an unpacked path (raw, and nccl's ``send`` and ``chunks``): from the first send kernel's
  start to the last one's end on the sender (``send_us``), and how many there were (``ops``).

``sender_us + tail_us`` estimates a packed transfer's GPU time, to set beside raw's
``send_us``; NCCL's send kernel ends when the peer has the bytes, within microseconds of the
receive's end. A transfer's kernels are those its range (``PATH/SRC->DST/BLOCKS#REP``)
launched on that end, found by time within the range; NCCL kernels of the go message
(outside the timed span) are left out: on the sender the go's receive is its first NCCL
kernel and ends before the first pack, on the receiver it is not among the last-ending
receives.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

RANGE = re.compile(r"^(?P<path>[^/]+(?:/\d+)?)/(?P<src>\d)->(?P<dst>\d)/(?P<n>\d+)#(?P<rep>-?\d+)$")


def load(path: Path) -> tuple[list[dict], list[dict]]:
    """The trace's transfer ranges and its GPU kernels, each sorted by start."""
    events = json.loads(path.read_text())["traceEvents"]
    ranges = sorted((e for e in events if e.get("cat") == "user_annotation" and RANGE.match(e.get("name", ""))),
                    key=lambda e: e["ts"])
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    return ranges, kernels


def within(kernels: list[dict], span: dict) -> list[dict]:
    begin, end = span["ts"], span["ts"] + span["dur"]
    return [k for k in kernels if begin <= k["ts"] and k["ts"] + k["dur"] <= end]


def kind(kernel: dict) -> str:
    name = kernel["name"]
    if "nccl" in name.lower():
        return "nccl"
    if "block_copy_kernel" in name:
        return "pack" if "true" in name else "unpack"
    return "other"


def end(k: dict) -> float:
    return k["ts"] + k["dur"]


def sender_figures(kernels: list[dict], packed: bool) -> dict[str, float] | None:
    nccl = [k for k in kernels if kind(k) == "nccl"]
    if not packed:
        sends = nccl[1:]  # the first is the go's receive
        return {"send_us": max(map(end, sends)) - sends[0]["ts"], "ops": len(sends)} if sends else None
    packs = [k for k in kernels if kind(k) == "pack"]
    if not packs:
        return None
    start = packs[0]["ts"]
    sends = [k for k in nccl if k["ts"] >= start]  # the go's receive ended before the first pack
    if not sends:
        return None
    wire = max(map(end, sends)) - sends[0]["ts"]
    return {"pack0_us": packs[0]["dur"], "packs_us": sum(k["dur"] for k in packs),
            "first_send_us": sends[0]["ts"] - start, "wire_us": wire, "sender_us": max(map(end, sends)) - start,
            "lanes_busy": sum(k["dur"] for k in sends) / wire if wire > 0 else 0.0}


def receiver_figures(kernels: list[dict]) -> dict[str, float] | None:
    unpacks = [k for k in kernels if kind(k) == "unpack"]
    receives = sorted((k for k in kernels if kind(k) == "nccl"), key=end)[-len(unpacks):] if unpacks else []
    if not unpacks or not receives:
        return None
    last = end(receives[-1])
    return {"tail_wait_us": unpacks[-1]["ts"] - last, "tail_us": end(unpacks[-1]) - last,
            "last_unpack_us": unpacks[-1]["dur"], "unpacks_us": sum(k["dur"] for k in unpacks)}


def breakdown(trace_dir: Path) -> dict:
    """``{path: {"SRC->DST": {blocks: {figure: median}}}}`` over the measured repetitions."""
    traces = {rank: load(trace_dir / f"trace_rank{rank}.json") for rank in (0, 1)}
    samples: dict = defaultdict(lambda: defaultdict(list))
    for rank, (ranges, kernels) in traces.items():
        for span in ranges:
            m = RANGE.match(span["name"])
            if int(m["rep"]) < 0 or m["path"] == "pull":
                continue
            packed = m["path"].startswith("pack")
            mine = within(kernels, span)
            if rank == int(m["src"]):
                figures = sender_figures(mine, packed)
            else:
                figures = receiver_figures(mine) if packed else None
            for name, value in (figures or {}).items():
                samples[(m["path"], f"{m['src']}->{m['dst']}", int(m["n"]))][name].append(value)
    out: dict = {}
    for (path, pair, n), figures in sorted(samples.items()):
        point = {name: round(statistics.median(values), 2) for name, values in figures.items()}
        if "sender_us" in point and "tail_us" in point:
            point["estimate_us"] = round(point["sender_us"] + point["tail_us"], 2)
        out.setdefault(path, {}).setdefault(pair, {})[str(n)] = point
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace_dir", type=Path)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = breakdown(args.trace_dir)
    for path, pairs in result.items():
        for pair, points in pairs.items():
            for n, point in points.items():
                raw = result.get("raw", {}).get(pair, {}).get(n, {}).get("send_us")
                versus = f"  raw send {raw:.0f} us" if raw and path != "raw" else ""
                print(f"{path:>16} {pair} {n:>3} blocks: " + ", ".join(f"{k} {v:g}" for k, v in point.items()) + versus)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
