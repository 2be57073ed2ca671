"""Where one decode step's time goes (diagnostic): wall time per step against the device's
busy time, and the kernels that fill it, for batches of sequences at a given context, with
serial and overlapped stepping (``async_scheduling`` off and on) side by side.

B sequences of a C-token random prompt are prefilled, then S decode steps are timed by the
wall clock (a serial step ends with its token read-back, so it covers the device's work; an
overlapped step ends with the previous step's read-back, so over S steps the mean covers the
device's work too) and again under ``torch.profiler``, whose kernel records give the device
time per step and by kernel name. Wall over device time is what the host and launch gaps
cost (1.0: the device never waits); host time is a step's wall time less its wait for the
device. On a CPU the profiler sees operators, not kernels: use it
there only to check the script runs.

Both windows must run the same B sequences: requests get enough output tokens to outlast the
prefill and both windows (``decode_headroom``), each window's sequences per step are printed
and flagged when they differ from B, and the requests are aborted afterwards. On CUDA the
timed steps also give, from events queued with them, the device's span per step and its idle
time between steps (same steps as the wall clock, no profiler), and run under
``torch.cuda.set_sync_debug_mode("warn")``: every call that synchronises with the device is
listed by file and line (``--no-sync-debug`` turns that off).

``--shared-prefix`` gives every sequence the same C-token document (prefilled once, then
shared through the prefix cache) and a short prompt of its own, as in a hot-context burst
where every decoding row reads one document's blocks; ``--mps N`` runs the engine as one of N
MPS clients (1/N of the SMs), as a pool's replica does. Each row records the decode
attention's split count at the batch's padded graph size.

    python -m tools.diagnostics.profile_decode --preset 0.6b --device cuda --dtype bfloat16 \\
        --batches 1,8,32,64 --context 2048 --json decode_profile.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.device.mps import mps_share
from benchmarks.lib.kernel_table import device_kernels
from benchmarks.lib.revision import git_record
from lmpool import LLM, SamplingParams
from lmpool.engine.model_runner import PendingTokens
from lmpool.model.make_model import PRESETS, make_model

PATHS = {"serial": False, "overlapped": True}  # path name -> EngineConfig.async_scheduling


@contextlib.contextmanager
def timed_waits(waits: list[float]):
    """While active, the seconds of every ``PendingTokens.result`` call (the step's wait for
    the device) are appended to ``waits``: a step's wall time less them is host time."""
    result = PendingTokens.result

    def timed(self):
        t0 = time.perf_counter()
        try:
            return result(self)
        finally:
            waits.append(time.perf_counter() - t0)

    PendingTokens.result = timed
    try:
        yield
    finally:
        PendingTokens.result = result


class StepMarks:
    """While active, every ``ModelRunner.launch`` records its batch size and, on CUDA, timing
    events around the step's device work (queued with it: no synchronisation is added).

    From the events: a step's device span (its first queued copy to its token read-back copy,
    idle gaps inside it included) and the device's idle time before it (the end of the step
    before to its start: > 0 when the device waited for the host to queue the step). Wall and
    device figures then come from the same steps."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.cuda = runner.device.type == "cuda"
        self.batches: list[int] = []
        self.events: list[tuple] = []

    def __enter__(self) -> StepMarks:
        self.wrapped = vars(self.runner).get("launch")  # another tool's wrapper, if any
        launch = self.runner.launch

        def marked(batch, *args):
            self.batches.append(len(batch.seqs))
            if not self.cuda:
                return launch(batch, *args)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            pending = launch(batch, *args)
            end.record()
            self.events.append((start, end))
            return pending

        self.runner.launch = marked
        return self

    def __exit__(self, *exc) -> None:
        if self.wrapped is None:
            del self.runner.launch  # the class's method again
        else:
            self.runner.launch = self.wrapped

    def device_timeline(self) -> dict:
        """Mean device span of a step and mean device idle before one, in ms (CUDA only)."""
        if not self.events:
            return {}
        torch.cuda.synchronize(self.runner.device)
        spans = [s.elapsed_time(e) for s, e in self.events]
        idles = [prev_end.elapsed_time(s) for (_, prev_end), (s, _) in zip(self.events, self.events[1:])]
        return {"device_span_ms_per_step": statistics.fmean(spans),
                "device_idle_ms_before_step": statistics.fmean(idles) if idles else 0.0}


@contextlib.contextmanager
def sync_warnings(active: bool):
    """While active (CUDA only), torch warns at every call that synchronises the host with the
    device (``.item()``, ``.tolist()`` or ``.cpu()`` of a device tensor, ``nonzero``, boolean
    indexing, a copy to pageable memory, a stream or device synchronize); the warnings are
    collected as ``file:line: message``. The step's one intended wait (``Event.synchronize``
    in ``PendingTokens.result``) is not such a call, so a clean step path yields none."""
    found: list[str] = []
    if not active:
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            found.append(f"{Path(w.filename).name}:{w.lineno}: {w.message}")
        else:  # not ours to swallow
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def decode_headroom(batch: int, context: int, steps: int, budget: int) -> int:
    """Output tokens a request may need before the measured steps end: one per step while the
    batch is prefilled (a sequence decodes as soon as its prompt is in, while later ones still
    prefill) plus the two windows of ``steps``. Fewer would let early sequences finish by length
    during the windows, so the measured batch would shrink (at 256 x 2,048 tokens and 8,192 per
    step the prefill takes ~66 steps: with 2 x 20 + 8 output tokens the windows ran 181 down to
    28 sequences, and the device was timed on smaller batches than the wall clock)."""
    if budget <= batch:
        raise ValueError(f"max_num_batched_tokens ({budget}) must exceed the batch ({batch}) to prefill it")
    prefill_steps = -(-batch * context // (budget - batch)) + 2
    return prefill_steps + 2 * steps + 8


def prompts(batch: int, context: int, vocab: int, seed: int, shared: int) -> list[list[int]]:
    """``batch`` random prompts of ``context`` tokens, or, with ``shared`` > 0, one random
    ``context``-token document followed by ``shared`` random tokens of each prompt's own."""
    rng = random.Random(seed)
    if not shared:
        return [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
    document = [rng.randrange(vocab) for _ in range(context)]
    return [document + [rng.randrange(vocab) for _ in range(shared)] for _ in range(batch)]


def prefill(engine, requests: list[tuple[str, list[int]]], params: SamplingParams, shared: bool) -> None:
    """Adds the requests and steps until every one decodes. A shared document is read once, by
    the first request, before the others arrive to find it in the prefix cache."""
    def settle():
        while any(not s.num_output_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()  # prefill (chunked) until every sequence decodes

    first = 1 if shared else len(requests)
    for request_id, prompt in requests[:first]:
        engine.add_request(request_id, prompt, params)
    settle()
    for request_id, prompt in requests[first:]:
        engine.add_request(request_id, prompt, params)
    settle()


def decode_steps(llm: LLM, batch: int, context: int, steps: int, seed: int, max_tokens: int,
                 sync_debug: bool, shared: int = 0) -> dict:
    """Wall seconds of ``steps`` decode steps, the seconds they waited for the device, their batch
    sizes, device timeline and synchronising calls, then the profiler's kernel totals over as
    many steps; the requests are aborted afterwards."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batch_prompts = prompts(batch, context, engine.model_config.vocab_size, seed, shared)
    prefill(engine, [(f"p{batch}-{i}", p) for i, p in enumerate(batch_prompts)], params, shared > 0)
    cached = sum(s.num_cached_tokens for s in engine.scheduler.running)
    engine.step()
    walls, waits = [], []
    with timed_waits(waits), StepMarks(engine.runner) as marks, sync_warnings(sync_debug) as syncs:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    timeline = marks.device_timeline()  # synchronises: after the timed steps
    with StepMarks(engine.runner) as profiled:  # ms per step by kernel (an overlapped step still running is not)
        kernels = device_kernels(lambda: [engine.step() for _ in range(steps)], engine.runner.device, steps)
    for request_id in list(engine.requests):  # the next batch starts from an idle engine
        engine.abort_request(request_id)
    while engine.in_flight is not None:
        engine.step()  # reads the last launched step back (its tokens are dropped)
    return {"walls": walls, "waited": sum(waits), "kernels": kernels, "timeline": timeline,
            "batches": marks.batches, "profiled_batches": profiled.batches, "syncs": syncs,
            "cached_prompt_tokens": cached}


@contextlib.contextmanager
def torch_norms(active: bool):
    """While active, engines built take the norms and rotary from the torch reference even on
    CUDA (the graphs they capture hold those ops): the path before the fused kernels."""
    if not active:
        yield
        return
    from lmpool.ops import cuda, reference

    def qkv_norm_rope_store(qkv, q_weight, k_weight, eps, cos, sin, positions, k_cache, v_cache, slots, heads):
        # The rotations as torch ops, the store as the kernel (the reference's store reads the
        # slots on the host, which a CUDA graph's capture refuses)
        kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        k = reference.qk_norm_rope(k.view(-1, kv_heads, dim), k_weight, eps, cos, sin, positions)
        cuda.write_kv(k, v.view(-1, kv_heads, dim), k_cache, v_cache, slots)
        return reference.qk_norm_rope(q.view(-1, heads, dim), q_weight, eps, cos, sin, positions)

    fused = cuda.CUDA_OPS
    cuda.CUDA_OPS = dataclasses.replace(fused, rms_norm=reference.rms_norm, add_rms_norm=reference.add_rms_norm,
                                        silu_mul=reference.silu_mul, qkv_norm_rope_store=qkv_norm_rope_store)
    try:
        yield
    finally:
        cuda.CUDA_OPS = fused


def profile_row(llm: LLM, norms: str, path: str, batch: int, args, early: bool = False) -> dict:
    """One batch size on one engine: wall and device time per decode step, the top kernels."""
    run = decode_steps(llm, batch, args.context, args.steps, batch, args.max_tokens, args.sync_debug,
                       args.shared_prefix)
    walls, kernels, timeline = run["walls"], run["kernels"], run["timeline"]
    host_ms = (sum(walls) - run["waited"]) / len(walls) * 1e3  # host time of a step: its wall time not spent waiting
    # The mean, not the median: an overlapped step's wall time alternates between host-bound
    # and device-bound calls, and only their mean is the time per step.
    wall_ms = statistics.fmean(walls) * 1e3
    device_ms = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:args.top]
    over = f"{wall_ms / device_ms:5.2f}" if device_ms else "  n/a"
    print(f"{norms:>5} {path:>10} {'early' if early else 'plain'} B={batch:4d} context {args.context}: "
          f"wall {wall_ms:7.3f} ms/step, "
          f"device busy {device_ms:7.3f} ms/step, wall / device {over}, host {host_ms:7.3f} ms/step")
    print(f"      {batch_line(batch, run['batches'], run['profiled_batches'])}")
    splits = attention_splits(llm, batch)
    if splits:
        print(f"      decode attention: {splits['graph_rows']} rows (graph size), {splits['splits']} key splits, "
              f"{splits['sms']} SMs seen")
    if timeline:
        print(f"      same steps as the wall clock: device span {timeline['device_span_ms_per_step']:7.3f} ms/step, "
              f"device idle before a step {timeline['device_idle_ms_before_step']:7.3f} ms")
    if args.sync_debug:
        print(f"      synchronising calls in the timed steps: {len(run['syncs'])}")
        for where, count in collections.Counter(run["syncs"]).most_common(args.top):
            print(f"        {count:4d} x {where[:160]}")
    for name, ms in top:
        print(f"      {ms:7.3f} ms  {name[:110]}")
    return {"norms": norms, "path": path, "dependent_launch": early, "batch": batch, "wall_ms_per_step": wall_ms, "host_ms_per_step": host_ms,
            "wall_ms_median": statistics.median(walls) * 1e3, "device_ms_per_step": device_ms,
            "wall_over_device": wall_ms / device_ms if device_ms else None, **timeline,
            "batch_sizes_timed": run["batches"], "batch_sizes_profiled": run["profiled_batches"],
            "sync_calls": run["syncs"] if args.sync_debug else None, "top_kernels_ms_per_step": dict(top),
            "attention_splits": splits, "cached_prompt_tokens": run["cached_prompt_tokens"]}


def attention_splits(llm: LLM, batch: int) -> dict | None:
    """The decode attention's key splits at the batch's padded graph size (CUDA only), and the SM
    count the device reports to this process (all of them, or its MPS share)."""
    runner = llm.engine.runner
    if runner.device.type != "cuda":
        return None
    from lmpool.ops import cuda

    graphs = runner.graphs
    rows = (graphs.padded_size(batch) if graphs is not None else None) or batch
    config = llm.engine.model_config
    width = runner.max_blocks_per_seq * runner.block_size
    index = runner.device.index or 0
    splits = cuda.load_extension().decode_splits(rows, config.num_attention_heads, config.num_key_value_heads,
                                                 width, index)
    return {"graph_rows": rows, "splits": splits,
            "sms": torch.cuda.get_device_properties(index).multi_processor_count}


def batch_line(batch: int, timed: list[int], profiled: list[int]) -> str:
    """The sequences each window's steps ran, flagged when not the requested batch."""
    spans = [f"{name} {min(b)}-{max(b)}" if b else f"{name} none" for name, b in
             (("timed", timed), ("profiled", profiled))]
    ok = all(b and min(b) == max(b) == batch for b in (timed, profiled))
    return f"sequences per step: {', '.join(spans)}" + ("" if ok else f"  <- not {batch}: figures not comparable")


def path_ratios(rows: list[dict]) -> list[dict]:
    """Overlapped over serial wall time per step, for each (norms, launch, batch) both paths ran."""
    by_key = {(r["norms"], r["dependent_launch"], r["batch"], r["path"]): r for r in rows}
    out = []
    for (norms, early, batch, path), r in by_key.items():
        serial = by_key.get((norms, early, batch, "serial"))
        if path == "overlapped" and serial is not None:
            out.append({"norms": norms, "dependent_launch": early, "batch": batch,
                        "wall_ratio": r["wall_ms_per_step"] / serial["wall_ms_per_step"]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Qwen3 directory (default: generate --preset)")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--top", type=int, default=8, help="kernels listed per batch")
    ap.add_argument("--norms", default="fused",
                    help="comma-separated, run in turn: 'fused' (the norm and SwiGLU kernels) and/or 'torch' (the "
                         "norms, residual adds, rotary and gating as plain torch ops on the GPU)")
    ap.add_argument("--paths", default="serial,overlapped",
                    help="comma-separated: serial (async_scheduling off) and/or overlapped (on)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--no-sync-debug", dest="sync_debug", action="store_false",
                    help="CUDA: do not list the calls that synchronise with the device in the timed steps")
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="every sequence: one shared --context-token document, then N tokens of its own")
    ap.add_argument("--mps", type=int, default=0, help="run as one of N MPS clients (1/N of the SMs); 0: whole GPU")
    ap.add_argument("--cascade-min-saved-tokens", type=int, default=None, metavar="N",
                    help="decode steps sharing prefixes read them once when that saves N key reads "
                         "(EngineConfig.cascade_min_saved_tokens; 0: never; default: the engine's)")
    ap.add_argument("--dependent-launch", default="off", metavar="off,on,on,off",
                    help="comma-separated, each an engine of its own in this order: the decode kernels launched "
                         "plainly (off) or started early (on; EngineConfig.dependent_launch)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not set(args.paths.split(",")) <= set(PATHS):
        ap.error(f"--paths takes serial and/or overlapped, got {args.paths!r}")
    batches = [int(b) for b in args.batches.split(",")]
    args.max_tokens = max(decode_headroom(b, args.context, args.steps, args.max_num_batched_tokens) for b in batches)
    context = args.context + args.shared_prefix
    args.sync_debug = args.sync_debug and args.device.startswith("cuda")
    if not set(args.norms.split(",")) <= {"fused", "torch"}:
        ap.error(f"--norms takes 'fused' and/or 'torch', got {args.norms!r}")
    launches = args.dependent_launch.split(",")
    if not set(launches) <= {"off", "on"}:
        ap.error(f"--dependent-launch takes 'off' and/or 'on', got {args.dependent_launch!r}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, mps_share(args.mps) as mps:
        model = args.model or str(make_model(Path(tmp) / "model", preset=args.preset, seed=0))
        for norms, launch, path in itertools.product(args.norms.split(","), launches, args.paths.split(",")):
            with torch_norms(norms == "torch"), LLM(
                    model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                    max_model_len=context + args.max_tokens + 16, max_num_seqs=max(batches),
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    enforce_eager=args.enforce_eager, async_scheduling=PATHS[path],
                    cascade_min_saved_tokens=args.cascade_min_saved_tokens,
                    dependent_launch=launch == "on") as llm:
                for batch in batches:
                    rows.append(profile_row(llm, norms, path, batch, args, early=launch == "on"))
    ratios = path_ratios(rows)
    for r in ratios:
        print(f"{r['norms']:>5} B={r['batch']:4d}: overlapped / serial wall per step {r['wall_ratio']:.2f}")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "model")}
        config["model"] = Path(args.model).name if args.model else f"generated {args.preset}"
        args.json.write_text(json.dumps({"benchmark": "profile_decode", "config": config, "git": git_record(),
                                         "torch": torch.__version__, "mps": mps, "rows": rows,
                                         "overlapped_vs_serial": ratios}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
