"""Host time of one engine decode step, with the model replaced by a stub: only the CPU side is timed.

Every step of the engine does host work while a GPU would wait: scheduling,
building the step's inputs, sampling, block accounting, appending tokens and
checking stop conditions. This benchmark runs that work on CPU with a model whose
forward returns fixed hidden states and whose logits are a fixed (small) matrix,
so nothing but host work is measured. B sequences with contexts uniform in
[min, max] are prefilled through the stub, then decode steps are timed.

Two paths run side by side on identical engines, both ``EngineCore.step``:
``serial`` (``async_scheduling=False``) and ``overlapped`` (``True``). The ratio is
serial / overlapped host time per step (medians over interleaved repeats). Each
phase is timed by wrapping the method that does it (``complete_step`` is the
scheduler's ``advance`` plus ``commit``); ``outputs`` is the rest of the step
(appending tokens, stop checks, step outputs, the token read-back, and in
``overlapped`` the device-side fill of pending input tokens).

What a CPU run cannot show: with a GPU, the serial path adds this host time to
every step's device time, while the overlapped path spends it while the device
runs the step before (see ``profile_decode.py`` for wall against device time).

``--bursts Q:D,...`` times a hot-context burst's host work on the overlapped engine: Q questions
(D cached document tokens and 64 of their own each) admitted as a pool worker admits them
(``add_checked_request`` with the int32 ids and the block hashes its frontend sent, then the
prefix it finds cached, ``cached_prefix_tokens``), then the launch of the step that takes them
(``begin_step``: scheduling, each prefix hit verified along its chain, the step's inputs). On a
GPU the device waits for both when the step before has ended (medians over the repeats, ms).

    python -m benchmarks.benchmark_host_overhead --json host_overhead.json
    python -m benchmarks.benchmark_host_overhead --batches 256 --steps 20 --repeats 3
    python -m benchmarks.benchmark_host_overhead --batches "" --bursts 13:16384,32:32768
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.lib.revision import git_revision
from lmpool.config.engine import EngineConfig
from lmpool.engine.core import EngineCore
from lmpool.engine.hashing import chain_hashes
from lmpool.model.make_model import make_model
from lmpool.sampling_params import SamplingParams

PHASES = ("schedule", "prepare", "forward", "sample", "complete_step", "outputs")
PATHS = {"serial": False, "overlapped": True}  # path name -> EngineConfig.async_scheduling


class PhaseTimer:
    """Accumulates nanoseconds per phase; ``wrap`` times a bound method in place."""

    def __init__(self) -> None:
        self.ns = dict.fromkeys(PHASES, 0)

    def reset(self) -> None:
        self.ns = dict.fromkeys(PHASES, 0)

    def wrap(self, obj, attr: str, phase: str) -> None:
        fn = getattr(obj, attr)
        clock = time.perf_counter_ns

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns[phase] += clock() - t0

        setattr(obj, attr, timed)


class StubModel:
    """Stands in for ``Qwen3ForCausalLM``: fixed hidden states and fixed logits, no device work."""

    def __init__(self, hidden_size: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.hidden_size = hidden_size
        self.hidden = torch.zeros(0, hidden_size)
        self.logits_table = torch.randn(1, vocab, generator=g)
        self.logits = self.logits_table

    def __call__(self, ids, positions, meta, kv_cache, ops) -> torch.Tensor:
        return self.forward(ids, positions, meta, kv_cache, ops)  # an attribute, so it can be timed

    def forward(self, ids, positions, meta, kv_cache, ops) -> torch.Tensor:
        n = ids.shape[0]
        if self.hidden.shape[0] < n:
            self.hidden = torch.zeros(n, self.hidden_size)
        return self.hidden[:n]

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True, ops: object = None) -> torch.Tensor:
        n = hidden.shape[0]
        if self.logits.shape[0] < n:
            self.logits = self.logits_table.repeat(n, 1)
        return self.logits[:n]


# ---- workload and measurement ------------------------------------------------------------


def stubbed_engine(config: EngineConfig, args) -> EngineCore:
    """An engine of ``config`` whose model is the stub: only its host work is left to time."""
    core = EngineCore(config)
    core.runner.model = StubModel(core.model_config.hidden_size, args.stub_vocab, args.seed)
    return core


def make_engine(model_dir: str, args, batch: int, contexts: list[int], max_tokens: int,
                async_scheduling: bool) -> EngineCore:
    bs = args.block_size
    blocks = sum(-(-(c + max_tokens) // bs) for c in contexts) + batch
    config = EngineConfig(
        model=model_dir, device="cpu", block_size=bs, num_kv_blocks=blocks, max_num_seqs=batch,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_context + max_tokens,
        enable_prefix_caching=True, async_scheduling=async_scheduling,
    )
    core = stubbed_engine(config, args)
    rng = random.Random(args.seed)
    vocab = core.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, n in enumerate(contexts):
        core.add_request(f"b{i}", [rng.randrange(vocab) for _ in range(n)], params)
    while core.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in core.scheduler.running):
        core.step()  # prefill through the stub; not timed
    assert len(core.scheduler.running) == batch, "every sequence must be decoding"
    return core


def measure(step, timer: PhaseTimer, steps: int) -> dict:
    gc.collect()
    timer.reset()
    t0 = time.perf_counter_ns()
    for _ in range(steps):
        step()
    total = time.perf_counter_ns() - t0
    phases = {p: timer.ns[p] / steps / 1e3 for p in PHASES[:-1]}
    phases["outputs"] = total / steps / 1e3 - sum(phases.values())
    return {"total_us": total / steps / 1e3, "phases_us": phases}


def run_batch(model_dir: str, args, batch: int) -> dict:
    rng = random.Random(args.seed + batch)
    contexts = [rng.randint(args.min_context, args.max_context) for _ in range(batch)]
    max_tokens = args.warmup + args.repeats * args.steps + 2  # nothing finishes while timed
    paths = {}
    for name, async_scheduling in PATHS.items():
        core = make_engine(model_dir, args, batch, contexts, max_tokens, async_scheduling)
        timer = PhaseTimer()
        timer.wrap(core.scheduler, "schedule", "schedule")
        timer.wrap(core.scheduler, "advance", "complete_step")
        timer.wrap(core.scheduler, "commit", "complete_step")
        timer.wrap(core.runner.model, "forward", "forward")
        timer.wrap(core.runner, "prepare", "prepare")
        timer.wrap(core.runner, "sample", "sample")
        for _ in range(args.warmup):
            core.step()
        paths[name] = (core, timer, core.step)
    runs: dict[str, list[dict]] = {name: [] for name in PATHS}
    for _ in range(args.repeats):  # interleaved, so both paths see the same machine noise
        for name, (core, timer, step) in paths.items():
            runs[name].append(measure(step, timer, args.steps))
    # The overlapped engine has read one step fewer back: compare the tokens both know.
    known = {name: [s.output_token_ids for s in core.scheduler.running] for name, (core, _, _) in paths.items()}
    for serial, overlapped in zip(known["serial"], known["overlapped"], strict=True):
        assert serial[: len(overlapped)] == overlapped, "both paths must produce the same tokens"
    result = {"batch": batch, "contexts": [min(contexts), max(contexts)]}
    for name, rs in runs.items():  # medians over repeats: the machine may be shared
        result[name] = {
            "total_us": statistics.median(r["total_us"] for r in rs),
            "phases_us": {p: statistics.median(r["phases_us"][p] for r in rs) for p in PHASES},
            "repeats_total_us": [r["total_us"] for r in rs],
        }
    result["serial_over_overlapped"] = result["serial"]["total_us"] / result["overlapped"]["total_us"]
    return result


QUESTION_TOKENS = 64  # a burst question's own tokens after the document


def run_burst(model_dir: str, args, questions: int, document: int) -> dict:
    """Admission and launch of ``questions`` questions over a cached ``document``-token prefix
    (the module docstring's ``--bursts``), ``args.repeats`` times on fresh engines."""
    bs = args.block_size
    admit, launch = [], []
    for rep in range(args.repeats):
        blocks = -(-document // bs) + questions * (-(-QUESTION_TOKENS // bs) + 2)
        core = stubbed_engine(EngineConfig(
            model=model_dir, device="cpu", block_size=bs, max_num_seqs=max(questions, 1), num_kv_blocks=blocks,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=document + 2 * QUESTION_TOKENS,
            enable_prefix_caching=True, async_scheduling=True,
        ), args)
        rng = random.Random(args.seed + rep)
        vocab = core.model_config.vocab_size
        doc = [rng.randrange(vocab) for _ in range(document)]
        core.add_request("document", doc, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        while core.has_unfinished():
            core.step()  # the document's prefill, cached once it ends: not timed
        wire = []
        for q in range(questions):
            ids = doc + [rng.randrange(vocab) for _ in range(QUESTION_TOKENS)]
            wire.append((f"q{q}", np.asarray(ids, dtype=np.int32), chain_hashes(ids, bs)))
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        gc.collect()
        t0 = time.perf_counter_ns()
        for request_id, ids, hashes in wire:
            core.add_checked_request(request_id, ids, params, [], hashes)
            core.cached_prefix_tokens(request_id)
        t1 = time.perf_counter_ns()
        step = core.begin_step()
        t2 = time.perf_counter_ns()
        core.end_step(step)
        assert len(step.batch.seqs) == questions, "every question must join the first step"
        admit.append((t1 - t0) / 1e6)
        launch.append((t2 - t1) / 1e6)
    return {"questions": questions, "document": document, "admit_ms": statistics.median(admit),
            "launch_ms": statistics.median(launch), "repeats_admit_ms": admit, "repeats_launch_ms": launch}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="256,64,16,1", help="comma-separated numbers of decoding sequences")
    ap.add_argument("--min-context", type=int, default=100)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--stub-vocab", type=int, default=8, help="logit columns (kept small: argmax is device work)")
    ap.add_argument("--bursts", default="", help="comma-separated QUESTIONS:DOCUMENT_TOKENS bursts to time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    result = {
        "config": vars(args) | {"json": None},
        "environment": {
            "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "git_revision": git_revision(),
        },
        "results": [],
        "bursts": [],
    }
    bursts = [tuple(map(int, b.split(":"))) for b in args.bursts.split(",") if b]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_model(Path(tmp) / "model", preset="tiny", seed=args.seed))
        if bursts:  # a model whose positions reach the longest document
            positions = {"max_position_embeddings": max(d for _, d in bursts) + 2 * QUESTION_TOKENS}
            burst_dir = str(make_model(Path(tmp) / "burst", preset="tiny", seed=args.seed, overrides=positions))
            print("a burst's host ms: its questions' admission, then the launch of their step")
            for questions, document in bursts:
                b = run_burst(burst_dir, args, questions, document)
                result["bursts"].append(b)
                print(f"{questions:>4} questions over {document:>6} tokens: admit {b['admit_ms']:8.2f}"
                      f"  launch {b['launch_ms']:8.2f}")
        batches = [int(b) for b in args.batches.split(",") if b]
        if batches:
            print("host microseconds per decode step")
            print(f"{'batch':>5} {'path':>10} " + " ".join(f"{p:>13}" for p in PHASES) + f" {'total':>9}")
        for batch in batches:
            r = run_batch(model_dir, args, batch)
            result["results"].append(r)
            for name in PATHS:
                ph = r[name]["phases_us"]
                print(f"{batch:>5} {name:>10} " + " ".join(f"{ph[p]:>13.1f}" for p in PHASES)
                      + f" {r[name]['total_us']:>9.1f}")
            print(f"{batch:>5} serial / overlapped = {r['serial_over_overlapped']:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
