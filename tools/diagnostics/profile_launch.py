"""How long a step's launch holds the host while a long prefill runs (diagnostic).

A pool worker reads its links (requests, transfer orders) only when its step loop yields; a
loop stage that holds the host holds them too. This drives one engine as a worker does under a
hot-context burst: a document is read once (cached), then waves of questions over it arrive,
one wave before each step, so each step's launch comes while the step before (a prefill of the
previous wave's questions over the whole document) runs on the device. Per step: its prefill
tokens and decoding sequences, the host seconds of ``begin_step`` (scheduling and launching),
the wait for the step before (yielding, as ``Worker.while_stepping`` does) and ``end_step``
(reading it back). A launch that takes about as long as the step before it ran waited for the
device. On CUDA the steps run under ``torch.cuda.set_sync_debug_mode("warn")``: every call
that synchronises with the device is listed by file and line.

    python -m tools.diagnostics.profile_launch --preset 0.6b --device cuda --dtype bfloat16 \\
        --context 16384 --waves 4 --questions 16 --mps 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.lib.revision import git_record
from lmpool import SamplingParams
from lmpool.config.engine import EngineConfig
from lmpool.engine.core import EngineCore
from lmpool.model.make_model import PRESETS, make_model
from tools.diagnostics.profile_decode import sync_warnings


def run_steps(core: EngineCore, rng: random.Random, doc: list[int], args, vocab: int) -> list[dict]:
    """The waves' steps, then the steps until every request is done; one row per step."""
    rows, waves, n = [], 0, 0
    while waves < args.waves or core.has_unfinished():
        if waves < args.waves:
            for _ in range(args.questions):
                question = [rng.randrange(vocab) for _ in range(args.question_tokens)]
                core.add_request(f"q{n}", doc + question, SamplingParams(temperature=0, max_tokens=args.max_tokens))
                n += 1
            waves += 1
        t0 = time.perf_counter()
        step = core.begin_step()
        t1 = time.perf_counter()
        while not step.ready():
            time.sleep(0)
        t2 = time.perf_counter()
        core.end_step(step)
        t3 = time.perf_counter()
        batch = step.batch
        rows.append({"prefill_tokens": batch.prefill_tokens, "decode_seqs": batch.decode_seqs,
                     "launch_ms": (t1 - t0) * 1e3, "wait_ms": (t2 - t1) * 1e3, "read_back_ms": (t3 - t2) * 1e3})
    return rows


def profile(model: str, args) -> dict:
    config = EngineConfig(model=model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                          max_num_batched_tokens=args.max_batched_tokens,
                          max_model_len=args.context + args.question_tokens + args.max_tokens + args.block_size)
    core = EngineCore(config)
    vocab = core.model_config.vocab_size
    rng = random.Random(args.seed)
    doc = [rng.randrange(vocab) for _ in range(args.context)]
    core.add_request("read", doc + [1], SamplingParams(temperature=0, max_tokens=1))
    while core.has_unfinished():
        core.step()
    core.step()  # an overlapped engine reads its last step back one call later
    with sync_warnings(args.device.startswith("cuda")) as syncs:
        rows = run_steps(core, rng, doc, args, vocab)
    prefills = [r for r in rows if r["prefill_tokens"]]
    return {"steps": rows, "syncs": syncs,
            "prefill_launch_ms": {"mean": statistics.fmean(r["launch_ms"] for r in prefills),
                                  "max": max(r["launch_ms"] for r in prefills)} if prefills else {}}


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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "model")
            make_model(model, preset=args.preset, seed=args.seed)
        if args.mps:
            from benchmarks.device.mps import mps_daemon

            with mps_daemon(args.mps):
                result = profile(model, args)
        else:
            result = profile(model, args)
    result |= {"args": {k: v for k, v in vars(args).items() if k != "json"}, "git": git_record()}
    for r in result["steps"]:
        print(f"prefill {r['prefill_tokens']:6d}  decode {r['decode_seqs']:4d}  launch {r['launch_ms']:8.2f} ms  "
              f"wait {r['wait_ms']:8.2f} ms  read back {r['read_back_ms']:7.2f} ms")
    print("syncs:", *result["syncs"] or ["none"], sep="\n  ")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
