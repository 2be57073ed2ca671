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

    python benchmarks/profile_decode.py --preset 0.6b --device cuda --dtype bfloat16 \\
        --batches 1,8,32,64 --context 2048 --json decode_profile.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lmpool import LLM, SamplingParams
from lmpool.engine.model_runner import PendingTokens
from lmpool.model.make_model import PRESETS, make_model
from revision import git_record

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories of device time
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


def decode_steps(llm: LLM, batch: int, context: int, steps: int, seed: int) -> tuple[list[float], float, dict]:
    """Wall seconds of ``steps`` decode steps and the seconds they waited for the device, then
    the profiler's kernel totals over as many steps."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}", [rng.randrange(vocab) for _ in range(context)], params)
    while any(not s.num_output_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (chunked) until every sequence decodes
    engine.step()
    walls, waits = [], []
    with timed_waits(waits):
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    cuda = engine.runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(engine.runner.device)  # an overlapped step may still run: not profiled
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize(engine.runner.device)  # exactly the kernels of the steps launched
    kernels: dict[str, float] = collections.defaultdict(float)
    with tempfile.TemporaryDirectory() as tmp:  # the exported trace names kernels in every torch version
        prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
        events = json.loads((Path(tmp) / "trace.json").read_text())["traceEvents"]
    for event in events:
        if event.get("cat") in DEVICE_WORK:
            kernels[event["name"]] += event["dur"] / 1e3 / steps  # ms per step
    while engine.has_unfinished():
        engine.step()
    return walls, sum(waits), dict(kernels)


@contextlib.contextmanager
def torch_norms(active: bool):
    """While active, engines built take the norms and rotary from the torch reference even on
    CUDA (the graphs they capture hold those ops): the path before the fused kernels."""
    if not active:
        yield
        return
    from lmpool.ops import cuda, reference

    fused = cuda.CUDA_OPS
    cuda.CUDA_OPS = dataclasses.replace(fused, rms_norm=reference.rms_norm, qk_norm_rope=reference.qk_norm_rope)
    try:
        yield
    finally:
        cuda.CUDA_OPS = fused


def profile_row(llm: LLM, norms: str, path: str, batch: int, args) -> dict:
    """One batch size on one engine: wall and device time per decode step, the top kernels."""
    walls, waited, kernels = decode_steps(llm, batch, args.context, args.steps, seed=batch)
    host_ms = (sum(walls) - waited) / len(walls) * 1e3  # host time of a step: its wall time not spent waiting
    # The mean, not the median: an overlapped step's wall time alternates between host-bound
    # and device-bound calls, and only their mean is the time per step.
    wall_ms = statistics.fmean(walls) * 1e3
    device_ms = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:args.top]
    over = f"{wall_ms / device_ms:5.2f}" if device_ms else "  n/a"
    print(f"{norms:>5} {path:>10} B={batch:4d} context {args.context}: wall {wall_ms:7.3f} ms/step, "
          f"device busy {device_ms:7.3f} ms/step, wall / device {over}, host {host_ms:7.3f} ms/step")
    for name, ms in top:
        print(f"      {ms:7.3f} ms  {name[:110]}")
    return {"norms": norms, "path": path, "batch": batch, "wall_ms_per_step": wall_ms, "host_ms_per_step": host_ms,
            "wall_ms_median": statistics.median(walls) * 1e3, "device_ms_per_step": device_ms,
            "wall_over_device": wall_ms / device_ms if device_ms else None, "top_kernels_ms_per_step": dict(top)}


def path_ratios(rows: list[dict]) -> list[dict]:
    """Overlapped over serial wall time per step, for each (norms, batch) both paths ran."""
    by_key = {(r["norms"], r["batch"], r["path"]): r for r in rows}
    out = []
    for (norms, batch, path), r in by_key.items():
        serial = by_key.get((norms, batch, "serial"))
        if path == "overlapped" and serial is not None:
            out.append({"norms": norms, "batch": batch,
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
                    help="comma-separated, run in turn: 'fused' (the norm kernels) and/or 'torch' (the norms "
                         "and rotary as plain torch ops on the GPU, as before kernels/norm_rope.cu)")
    ap.add_argument("--paths", default="serial,overlapped",
                    help="comma-separated: serial (async_scheduling off) and/or overlapped (on)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not set(args.paths.split(",")) <= set(PATHS):
        ap.error(f"--paths takes serial and/or overlapped, got {args.paths!r}")
    batches = [int(b) for b in args.batches.split(",")]
    if not set(args.norms.split(",")) <= {"fused", "torch"}:
        ap.error(f"--norms takes 'fused' and/or 'torch', got {args.norms!r}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_model(Path(tmp) / "model", preset=args.preset, seed=0))
        for norms in args.norms.split(","):
            for path in args.paths.split(","):
                with torch_norms(norms == "torch"), LLM(
                        model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                        max_model_len=args.context + 2 * args.steps + 16, max_num_seqs=max(batches),
                        enforce_eager=args.enforce_eager, async_scheduling=PATHS[path]) as llm:
                    for batch in batches:
                        rows.append(profile_row(llm, norms, path, batch, args))
    ratios = path_ratios(rows)
    for r in ratios:
        print(f"{r['norms']:>5} B={r['batch']:4d}: overlapped / serial wall per step {r['wall_ratio']:.2f}")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "model")}
        config["model"] = Path(args.model).name if args.model else f"generated {args.preset}"
        args.json.write_text(json.dumps({"benchmark": "profile_decode", "config": config, "git": git_record(),
                                         "torch": torch.__version__, "rows": rows,
                                         "overlapped_vs_serial": ratios}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
