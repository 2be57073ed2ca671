"""How long a step's launch holds the host while a long prefill runs (diagnostic).

A pool worker reads its links (requests, transfer orders) only when its step loop yields; a
loop stage that holds the host holds them too. This drives one engine as a worker does under a
hot-context burst: a document is read once (cached), then waves of questions over it arrive,
one wave before each step, so each step's launch comes while the step before (a prefill of the
previous wave's questions over the whole document) runs on the device. Per step: its prefill
tokens and decoding sequences, the host seconds of ``begin_step`` (scheduling and launching),
the wait for the step before (yielding, as ``Worker.while_stepping`` does) and ``end_step``
(reading it back); the document's own chunks of prefill are timed the same way (pass "read").
A launch that takes about as long as the step before it ran waited for the device. On CUDA the
steps run under ``torch.cuda.set_sync_debug_mode("warn")``: every call that synchronises
with the device is listed by file and line. Where the launches wait is shown
two ways: a thread samples the host's stack every half millisecond while ``begin_step`` runs
(the lines where most samples fall, per kind of step: ``launch_stacks``), and with ``--trace``
the steps run under torch's profiler, whose CUDA runtime calls are summed by name (count, total and longest
milliseconds, ``runtime_calls``): a launch queue that is full shows as long kernel launches, the
allocator growing or returning memory as long mallocs or frees.

With ``--orders``, passes take the given read-back orders in turn: "late" reads a step's tokens
after the next step's launch, "early" first where the device has finished it, as a pool worker
does (``EngineCore.read_finished``); each step lists the first tokens it read back and their
milliseconds since their requests were added, and ``first_token_ms`` sums them per order.
With ``--pieces``, passes take the given settings in turn: "on" runs the steps that prefill
through the piecewise graphs (``lmpool.engine.piecewise_graphs``), "off" launches them op by op;
the summaries are then per order and setting (``late+pieces``, ``early``, ...).

    python -m tools.diagnostics.profile_launch --preset 0.6b --device cuda --dtype bfloat16 \\
        --context 16384 --waves 4 --questions 16 --mps 4
    python -m tools.diagnostics.profile_launch ... --questions 1 --passes 4 --orders late,early,early,late
    python -m tools.diagnostics.profile_launch ... --questions 1 --passes 4 --orders early --pieces on,off,off,on
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

from benchmarks.device.mps import mps_share
from benchmarks.lib.revision import git_record
from lmpool import SamplingParams
from lmpool.config.engine import EngineConfig
from lmpool.engine.core import EngineCore
from lmpool.model.make_model import PRESETS, make_model
from tools.diagnostics.profile_decode import sync_warnings


class StackSampler:
    """Samples one thread's innermost frames while ``sampling`` is on: each sample counts the line
    of the innermost frame of this repository's code and the innermost frame of all, under the
    kind of step the samples were taken in (``file``: the document's read, a step that prefills
    questions, a decode step), so that one kind's long launches do not hide another's."""

    def __init__(self, thread_id: int, interval_s: float = 0.0005) -> None:
        self.thread_id, self.interval_s = thread_id, interval_s
        self.counts: dict[str, Counter[str]] = {}
        self._current: Counter[str] = Counter()  # the samples of the launch under way
        self._on = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @contextmanager
    def sampling(self):
        self._on.set()
        try:
            yield
        finally:
            self._on.clear()

    def file(self, kind: str) -> None:
        """Count the samples since the last ``file`` under ``kind``."""
        current, self._current = self._current, Counter()
        self.counts.setdefault(kind, Counter()).update(current)

    def _run(self) -> None:
        root = str(Path(__file__).resolve().parents[2])
        while not self._stop.wait(self.interval_s):
            if not self._on.is_set():
                continue
            frame = sys._current_frames().get(self.thread_id)
            innermost, ours = frame, None
            while frame is not None:
                if ours is None and frame.f_code.co_filename.startswith(root):
                    ours = frame
                frame = frame.f_back
            for f in (innermost, ours):
                if f is not None:
                    self._current[f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}"] += 1

    def top(self, n: int = 8) -> dict[str, list[list]]:
        return {kind: [[where, count] for where, count in counts.most_common(n)]
                for kind, counts in self.counts.items()}


def runtime_calls(prof) -> dict[str, dict]:
    """The profiler's CUDA runtime and driver calls summed by name: count, total and longest ms."""
    calls: dict[str, dict] = {}
    for event in prof.events():
        if not event.name.startswith(("cuda", "cu")):
            continue
        ms = event.time_range.elapsed_us() / 1e3
        c = calls.setdefault(event.name, {"count": 0, "total_ms": 0.0, "max_ms": 0.0})
        c["count"] += 1
        c["total_ms"] += ms
        c["max_ms"] = max(c["max_ms"], ms)
    return dict(sorted(calls.items(), key=lambda kv: -kv[1]["total_ms"]))


def run_steps(core: EngineCore, rng: random.Random, doc: list[int], args, vocab: int,
              sampler: StackSampler, questions: int, early: bool = False, tag: str = "") -> list[dict]:
    """The waves' steps, then the steps until every request is done; one row per step, with the
    first tokens it read back and their mean milliseconds since their requests were added."""
    rows, waves, n, added = [], 0, 0, {}
    while waves < args.waves or core.has_unfinished():
        if waves < args.waves:
            for _ in range(questions):
                question = [rng.randrange(vocab) for _ in range(args.question_tokens)]
                params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
                rid = f"q{tag}{questions}-{n}"
                core.add_request(rid, doc + question, params)
                added[rid] = time.perf_counter()
                n += 1
            waves += 1
        rows.append(timed_step(core, sampler, early, added))
    return rows


def read_document(core: EngineCore, doc: list[int], sampler: StackSampler) -> list[dict]:
    """The document's own steps (its chunks of prefill, each launched while the one before runs),
    timed as the waves' are; it is cached once they are done."""
    core.add_request("read", doc + [1], SamplingParams(temperature=0, max_tokens=1))
    rows = []
    while core.has_unfinished():
        rows.append(timed_step(core, sampler, kind="read"))
    rows.append(timed_step(core, sampler, kind="read"))  # an overlapped engine reads its last step back one call later
    return rows


def timed_step(core: EngineCore, sampler: StackSampler, early: bool = False, added: dict | None = None,
               kind: str | None = None) -> dict:
    """One step, its launch sampled: its shape and the host milliseconds of its three parts.
    ``early``: first read back the launched step if the device has finished it, as a pool
    worker does (``EngineCore.read_finished``). ``added``: when each request was added, for its
    first token's milliseconds (the mean over the step's first tokens). Its launch's samples
    count under ``kind``, else "prefill" or "decode" by its batch."""
    firsts = []
    if early:
        firsts += first_tokens(core.read_finished(), added)
    t0 = time.perf_counter()
    with sampler.sampling():
        step = core.begin_step()
    t1 = time.perf_counter()
    while not step.ready():
        time.sleep(0)
    t2 = time.perf_counter()
    firsts += first_tokens(core.end_step(step), added)
    t3 = time.perf_counter()
    batch = step.batch
    sampler.file(kind or ("prefill" if batch.prefill_tokens else "decode"))
    return {"prefill_tokens": batch.prefill_tokens, "decode_seqs": batch.decode_seqs,
            "launch_ms": (t1 - t0) * 1e3, "wait_ms": (t2 - t1) * 1e3, "read_back_ms": (t3 - t2) * 1e3,
            "first_tokens": len(firsts), "first_token_ms": statistics.fmean(firsts) if firsts else None}


def first_tokens(outputs, added: dict | None) -> list[float]:
    """Milliseconds from each of ``outputs``' requests' adding to its first token, read back now."""
    now = time.perf_counter()
    return [(now - added[o.request_id]) * 1e3 for o in outputs
            if added and o.request_id in added and len(o.seq.output_token_ids) == 1]


def allocator_counts(on_cuda: bool) -> dict[str, int]:
    """The CUDA caching allocator's device allocations, frees and retries (a retry frees cached
    memory, which waits for the device) so far; none off CUDA."""
    if not on_cuda:
        return {}
    import torch

    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                                               "num_sync_all_streams")}


def profiler(on_cuda: bool):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    return torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else []))


def profile(model: str, args) -> dict:
    config = EngineConfig(model=model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                          max_num_batched_tokens=args.max_batched_tokens,
                          max_model_len=args.context + args.question_tokens + args.max_tokens + args.block_size)
    started = time.perf_counter()
    core = EngineCore(config)
    start_s = time.perf_counter() - started
    vocab = core.model_config.vocab_size
    rng = random.Random(args.seed)
    doc = [rng.randrange(vocab) for _ in range(args.context)]
    on_cuda = args.device.startswith("cuda")
    allocated_before = allocator_counts(on_cuda)
    trace = profiler(on_cuda) if args.trace else nullcontext()
    with sync_warnings(on_cuda) as syncs, StackSampler(threading.get_ident()) as sampler, trace as prof:
        rows = [dict(row, passed="read") for row in read_document(core, doc, sampler)]
        captured = core.runner.pieces
        for p in range(args.passes):
            order = args.orders[p % len(args.orders)]
            pieces = args.pieces[p % len(args.pieces)] == "on" and captured is not None
            core.runner.pieces = captured if pieces else None
            label = order + ("+pieces" if pieces else "")
            rows += [dict(row, passed=p, order=label)
                     for row in run_steps(core, rng, doc, args, vocab, sampler, max(1, args.questions - p),
                                          order == "early", f"{p}-")]
        core.runner.pieces = captured
    allocated_after = allocator_counts(on_cuda)
    return {"engine_start_s": start_s, "steps": rows, "syncs": syncs, "launch_stacks": sampler.top(),
            "first_token_ms": first_token_summary(rows),
            "runtime_calls": runtime_calls(prof) if prof is not None else {},
            "allocator": {k: allocated_after[k] - allocated_before[k] for k in allocated_after},
            "prefill_launch_ms": prefill_launch_summary(rows)}


def prefill_launch_summary(rows: list[dict]) -> dict[str, dict]:
    """Per order (and piecewise setting), the host milliseconds of the launches of the questions'
    steps that prefill: mean and longest."""
    out = {}
    for order in sorted({r["order"] for r in rows if "order" in r}):
        ms = [r["launch_ms"] for r in rows if r.get("order") == order and r["prefill_tokens"]]
        if ms:
            out[order] = {"mean": statistics.fmean(ms), "max": max(ms), "steps": len(ms)}
    return out


def first_token_summary(rows: list[dict]) -> dict[str, dict]:
    """Per read-back order, the mean milliseconds from a request's adding to its first token, over
    all its passes' questions and over the first wave's alone (the wave that found the rank idle)."""
    out: dict[str, dict] = {}
    for order in sorted({r["order"] for r in rows if "order" in r}):
        ms, first = [], []
        for p in sorted({r["passed"] for r in rows if r.get("order") == order}):
            timed = [r for r in rows if r.get("passed") == p and r["first_tokens"]]
            ms += [r["first_token_ms"] for r in timed for _ in range(r["first_tokens"])]
            if timed:
                first.append(timed[0]["first_token_ms"])
        out[order] = {"mean": statistics.fmean(ms) if ms else None,
                      "first_wave": statistics.fmean(first) if first else None, "questions": len(ms)}
    return out


def read_back_orders(value: str) -> list[str]:
    """``--orders``: comma-separated "late" and "early"."""
    return choices(value, ("late", "early"), "orders")


def piece_settings(value: str) -> list[str]:
    """``--pieces``: comma-separated "on" and "off"."""
    return choices(value, ("on", "off"), "piecewise settings")


def choices(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = value.split(",")
    if any(item not in allowed for item in items):
        raise argparse.ArgumentTypeError(f"{what} are {' and '.join(map(repr, allowed))}, comma-separated; "
                                         f"got {value!r}")
    return items


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: a random one of --preset)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--context", type=int, default=16384, help="the document's tokens")
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--questions", type=int, default=16, help="questions a wave")
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--mps", type=int, default=0, help="run as one of N MPS clients (1/N of the SMs); 0: whole GPU")
    ap.add_argument("--passes", type=int, default=1,
                    help="run the waves this many times over, each pass with one question fewer a wave, so its "
                         "shapes are new (a stall only the first pass shows comes with a first use, not a shape)")
    ap.add_argument("--orders", type=read_back_orders, default=["late"],
                    help="read-back orders the passes take in turn: 'late' (a step's tokens after the next "
                         "launch) and 'early' (first, where the device has finished it, as a pool worker does)")
    ap.add_argument("--pieces", type=piece_settings, default=["on"],
                    help="piecewise graphs for the steps that prefill, passes taking them in turn: 'on' (where "
                         "the engine captured them) or 'off' (launched op by op)")
    ap.add_argument("--trace", action="store_true",
                    help="run the steps under torch's profiler and sum its runtime calls")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "model")
            make_model(model, preset=args.preset, seed=args.seed)
        with mps_share(args.mps):
            result = profile(model, args)
    result |= {"args": {k: v for k, v in vars(args).items() if k != "json"}, "git": git_record()}
    for r in result["steps"]:
        first = r.get("first_tokens") and f"  first tokens {r['first_tokens']:3d} at {r['first_token_ms']:8.2f} ms"
        print(f"pass {r['passed']:>4} {r.get('order', ''):>5}  prefill {r['prefill_tokens']:6d}  "
              f"decode {r['decode_seqs']:4d}  launch {r['launch_ms']:8.2f} ms  wait {r['wait_ms']:8.2f} ms  "
              f"read back {r['read_back_ms']:7.2f} ms{first or ''}")
    print("syncs:", *result["syncs"] or ["none"], sep="\n  ")
    for kind, stacks in result["launch_stacks"].items():
        print(f"where the {kind} launches were:", *(f"{n:6d}  {w}" for w, n in stacks), sep="\n  ")
    print("runtime calls (count, total ms, longest ms):",
          *(f"{name}: {c['count']}  {c['total_ms']:.1f}  {c['max_ms']:.2f}"
            for name, c in list(result["runtime_calls"].items())[:10]), sep="\n  ")
    print("allocator:", result["allocator"], " engine start:", f"{result['engine_start_s']:.2f} s")
    print("first token ms (mean, first wave, questions):",
          *(f"{o}: {f['mean']:.2f}  {f['first_wave']:.2f}  {f['questions']}"
            for o, f in result["first_token_ms"].items() if f["mean"] is not None), sep="\n  ")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
