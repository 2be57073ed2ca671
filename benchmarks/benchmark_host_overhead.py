"""Host time of one engine decode step, with the model replaced by a stub: only the CPU side is timed.

Every step of the engine does host work while a GPU would wait: scheduling,
building the step's inputs, sampling, block accounting, appending tokens and
checking stop conditions. This benchmark runs that work on CPU with a model whose
forward returns fixed hidden states and whose logits are a fixed (small) matrix,
so nothing but host work is measured. B sequences with contexts uniform in
[min, max] are prefilled through the stub, then decode steps are timed.

Two paths run side by side on identical engines: ``before`` is the engine's
host path as it was before the step-input arena (a frozen copy below:
``LegacyStep``), ``after`` is ``EngineCore.step`` as it is now. The ratio is
before / after per step (medians over interleaved repeats). Each phase is
timed by wrapping the method that does it; ``outputs`` is the rest of the step (appending tokens, stop checks, step
outputs, and in ``after`` the token read-back).

What a CPU run cannot show: on CUDA the ``before`` path also made seven
synchronous host-to-device copies per decode step (each waits for the device
queue to drain) plus seven device copies before a graph replay; ``after`` makes
one asynchronous copy, two device copies and one token read-back.

    python benchmarks/benchmark_host_overhead.py --json host_overhead.json
    python benchmarks/benchmark_host_overhead.py --batches 256 --steps 20 --repeats 3
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
from dataclasses import dataclass
from pathlib import Path

import torch

from lmpool.config.engine import EngineConfig
from lmpool.engine.core import EngineCore
from lmpool.engine.scheduler import ScheduledBatch
from lmpool.engine.sequence import Sequence
from lmpool.model.make_model import make_model
from lmpool.model.qwen3 import AttentionMetadata
from lmpool.sampling_params import SamplingParams
from revision import git_revision

PHASES = ("schedule", "prepare", "forward", "sample", "complete_step", "outputs")


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

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        n = hidden.shape[0]
        if self.logits.shape[0] < n:
            self.logits = self.logits_table.repeat(n, 1)
        return self.logits[:n]


# ---- the host path before the step-input arena, frozen for side-by-side ratios --------


@dataclass  # the former StepOutput, which had no slots: part of what ``before`` times
class LegacyStepOutput:
    request_id: str
    new_token_id: int
    finished: bool
    finish_reason: str | None
    seq: Sequence


class LegacyStep:
    """``EngineCore.step`` with the former ``ModelRunner.run``/``prepare`` and ``Sampler.__call__``."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.runner = core.runner

    def step(self) -> list[LegacyStepOutput]:
        core = self.core
        batch = core.scheduler.schedule()
        if not batch.seqs:
            return []
        sampling = [seq for i, seq in enumerate(batch.seqs) if batch.samples(i)]
        tokens = self.run(batch)
        core.scheduler.complete_step(batch)
        outputs = []
        for seq, token in zip(sampling, tokens):
            seq.append_token(token)
            reason = self.finish_reason(seq, token)
            if reason is not None:
                core.scheduler.running.remove(seq)
                core.scheduler.finish(seq, reason)
                self.runner.sampler.release(seq.request_id)
                del core.requests[seq.request_id]
            outputs.append(LegacyStepOutput(seq.request_id, token, reason is not None, reason, seq))
        return outputs

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.core.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.core.max_model_len:
            return "length"
        return None

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        ids, pos, meta, sample_rows = self.prepare(batch)
        hidden = self.forward_hidden(ids, pos, meta)
        if not sample_rows:
            return []
        return self.sample(batch, hidden, sample_rows)

    @torch.inference_mode()
    def forward_hidden(self, ids, pos, meta) -> torch.Tensor:
        return self.runner.model(ids, pos, meta, self.runner.kv_cache, self.runner.ops)

    def prepare(self, batch: ScheduledBatch):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        query_start = [0]
        sample_rows: list[int] = []
        bs = self.runner.block_size
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            context_lens.append(start + n)
            query_start.append(query_start[-1] + n)
            if batch.samples(i):
                sample_rows.append(query_start[-1] - 1)
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
        dev = self.runner.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            is_decode=len(input_ids) == len(batch.seqs),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta, sample_rows

    def sample(self, batch: ScheduledBatch, hidden: torch.Tensor, sample_rows: list[int]) -> list[int]:
        rows = torch.tensor(sample_rows, device=self.runner.device)
        logits = self.runner.model.compute_logits(hidden[rows])
        sampling = [i for i in range(len(batch)) if batch.samples(i)]
        params = [batch.seqs[i].params for i in sampling]
        # The former Sampler.__call__, greedy branch (the benchmark's requests are greedy).
        greedy = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            raise NotImplementedError("the frozen path is only kept for greedy requests")
        return greedy.tolist()


# ---- workload and measurement ------------------------------------------------------------


def make_engine(model_dir: str, args, batch: int, contexts: list[int], max_tokens: int) -> EngineCore:
    bs = args.block_size
    blocks = sum(-(-(c + max_tokens) // bs) for c in contexts) + batch
    config = EngineConfig(
        model=model_dir, device="cpu", block_size=bs, num_kv_blocks=blocks, max_num_seqs=batch,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_context + max_tokens,
        enable_prefix_caching=True,
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
    for name in ("before", "after"):
        core = make_engine(model_dir, args, batch, contexts, max_tokens)
        timer = PhaseTimer()
        timer.wrap(core.scheduler, "schedule", "schedule")
        timer.wrap(core.scheduler, "complete_step", "complete_step")
        timer.wrap(core.runner.model, "forward", "forward")
        if name == "before":
            legacy = LegacyStep(core)
            timer.wrap(legacy, "prepare", "prepare")
            timer.wrap(legacy, "sample", "sample")
            step = legacy.step
        else:
            timer.wrap(core.runner, "prepare", "prepare")
            timer.wrap(core.runner, "sample", "sample")
            step = core.step
        for _ in range(args.warmup):
            step()
        paths[name] = (core, timer, step)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.repeats):  # interleaved, so both paths see the same machine noise
        for name, (core, timer, step) in paths.items():
            runs[name].append(measure(step, timer, args.steps))
    tokens = {name: [s.token_ids[-1] for s in core.scheduler.running] for name, (core, _, _) in paths.items()}
    assert tokens["before"] == tokens["after"], "both paths must produce the same tokens"
    result = {"batch": batch, "contexts": [min(contexts), max(contexts)]}
    for name, rs in runs.items():  # medians over repeats: the machine may be shared
        result[name] = {
            "total_us": statistics.median(r["total_us"] for r in rs),
            "phases_us": {p: statistics.median(r["phases_us"][p] for r in rs) for p in PHASES},
            "repeats_total_us": [r["total_us"] for r in rs],
        }
    result["speedup"] = result["before"]["total_us"] / result["after"]["total_us"]
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
        header = f"{'batch':>5} {'path':>6} " + " ".join(f"{p:>13}" for p in PHASES) + f" {'total':>9}"
        print("host microseconds per decode step")
        print(header)
        for batch in (int(b) for b in args.batches.split(",")):
            r = run_batch(model_dir, args, batch)
            result["results"].append(r)
            for name in ("before", "after"):
                ph = r[name]["phases_us"]
                print(f"{batch:>5} {name:>6} " + " ".join(f"{ph[p]:>13.1f}" for p in PHASES)
                      + f" {r[name]['total_us']:>9.1f}")
            print(f"{batch:>5} before/after = {r['speedup']:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
