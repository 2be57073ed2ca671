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

    python -m benchmarks.benchmark_host_overhead --json host_overhead.json
    python -m benchmarks.benchmark_host_overhead --batches 256 --steps 20 --repeats 3
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

import torch

from lmpool.config.engine import EngineConfig
from lmpool.engine.core import EngineCore
from lmpool.model.make_model import make_model
from lmpool.sampling_params import SamplingParams
from benchmarks.lib.revision import git_revision

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


def make_engine(model_dir: str, args, batch: int, contexts: list[int], max_tokens: int,
                async_scheduling: bool) -> EngineCore:
    bs = args.block_size
    blocks = sum(-(-(c + max_tokens) // bs) for c in contexts) + batch
    config = EngineConfig(
        model=model_dir, device="cpu", block_size=bs, num_kv_blocks=blocks, max_num_seqs=batch,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_context + max_tokens,
        enable_prefix_caching=True, async_scheduling=async_scheduling,
    )
    core = EngineCore(config)
    core.runner.model = StubModel(core.model_config.hidden_size, args.stub_vocab, args.seed)
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
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_model(Path(tmp) / "model", preset="tiny", seed=args.seed))
        header = f"{'batch':>5} {'path':>10} " + " ".join(f"{p:>13}" for p in PHASES) + f" {'total':>9}"
        print("host microseconds per decode step")
        print(header)
        for batch in (int(b) for b in args.batches.split(",")):
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
