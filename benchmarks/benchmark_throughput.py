"""Offline generation throughput of one engine, serial and overlapped stepping side by side
(and transformers' ``generate`` beside them).

N sequences with input and output lengths uniform in [min, max], random token ids,
``ignore_eos`` so every request produces exactly its output length. Prints output
tokens per second and writes JSON. The engine runs once per ``--paths`` entry:
``serial`` (``async_scheduling=False``) and ``overlapped`` (``True``, the default),
each on a fresh engine; the JSON's ``lmpool`` is the overlapped run, ``lmpool_serial``
the serial one, and ``overlapped_vs_serial`` their ratios and whether their greedy
tokens matched. With ``--compare-hf`` the same prompts run
through ``transformers`` ``generate`` (greedy, left-padded batches) on the same
weights in the same process, and the ratio is reported; HF is credited with every
token it generates, including those past a request's own output length.

LMPool's timed region is one ``LLM.generate`` call on all prompts (input checks,
scheduling, every step, detokenisation), after a warm-up on other prompts; CUDA
graph capture happens when the engine is built, before it.

    python -m benchmarks.benchmark_throughput --preset tiny --json out.json
    python -m benchmarks.benchmark_throughput --preset 0.6b --device cuda --num-seqs 256 \
        --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 --compare-hf

Defaults are sized for the CPU path (a few thousand tokens, well under a minute). A bar on
stderr counts each run's tokens as its steps return them (``--no-progress``: none).

``--prefill 16384,8192:8192`` also times long prefills on a fresh engine (``prefill_rate``:
NEW[:CACHED] tokens, TFLOP/s and the fraction of the GPU's tensor-core rate beside the decode
runs' HBM roofline), ``--paths none`` only those; ``--mps N`` runs everything as one of N MPS
clients (a quarter of the SMs for 4, as a pool's replica).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import prefill_rate
from benchmarks.device.mps import mps_share
from benchmarks.lib.progress import NoBar, bar
from benchmarks.lib.progress import add_argument as add_progress_argument
from benchmarks.lib.revision import git_revision
from lmpool import LLM, SamplingParams
from lmpool.model.config import ModelConfig
from lmpool.model.make_model import make_model


def workload(num_seqs: int, lo_in: int, hi_in: int, lo_out: int, hi_out: int, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_seqs):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(lo_in, hi_in))])
        outputs.append(rng.randint(lo_out, hi_out))
    return prompts, outputs


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# Path name -> the engine settings it runs: ``plain`` is ``overlapped`` with the decode kernels
# launched plainly, not started before the kernel ahead of them ends (EngineConfig.dependent_launch).
PATHS = {"serial": {"async_scheduling": False}, "overlapped": {"async_scheduling": True},
         "plain": {"async_scheduling": True, "dependent_launch": False}}


def run_prefill(model: str, args) -> list[dict]:
    """The ``--prefill`` cases on an engine of their own per prefill attention (``--prefill-attention``,
    one after the other), long enough for the longest; each row names its attention."""
    cases = prefill_rate.parse_cases(args.prefill)
    longest = max(new + cached for new, cached in cases)
    rows = []
    for attention in args.prefill_attention.split(","):
        llm = LLM(
            model, device=args.device, dtype=args.dtype, block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=longest + 16,
            enforce_eager=args.enforce_eager, use_kernels=not args.torch_ops, prefill_attention=attention,
        )
        ops = llm.engine.runner.ops.name  # "cuda+flash-gather": FlashAttention over keys gathered (torch 2.11)
        try:
            llm.generate([[1] * min(longest, 64)], SamplingParams(temperature=0, max_tokens=1))  # warm-up
            measured = prefill_rate.measure(llm, cases, args.prefill_reps, args.seed, args.prefill_kernels)
        finally:
            llm.shutdown()
        for row in measured:
            row["attention"], row["ops"] = attention, ops
            print(f"{attention} ({ops}): {prefill_rate.describe(row)}")
        rows += measured
    return rows


def run_lmpool(model: str, prompts, outputs, args, path: str = "overlapped") -> dict:
    llm = LLM(
        model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager, use_kernels=not args.torch_ops, **PATHS[path],
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    # Warm-up (kernels, allocators) on prompts of its own: the workload's prompts would
    # leave their prefixes cached and the timed run would skip part of their prefill.
    vocab = llm.engine.model_config.vocab_size
    warm, _ = workload(2, len(prompts[0]), len(prompts[0]), 1, 1, vocab, args.seed + 1)
    llm.generate(warm, params[:2])
    shown = bar(sum(outputs), f"lmpool {path}", unit="tok", enabled=not args.no_progress)
    records = StepRecorder(llm, shown)
    sync(args.device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(args.device)
    elapsed = time.perf_counter() - start
    shown.close()
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(outputs), "ignore_eos requests must produce exactly max_tokens"
    result = {
        "path": path,
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tok_s": tokens / elapsed,
        "engine_steps": records.launched,
        "mean_step_ms": elapsed / records.launched * 1e3,
        "steps": records.summary(elapsed),
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
        "num_kv_blocks": llm.engine.block_manager.num_blocks,
        "kv_ops": llm.engine.runner.ops.name,
        "cuda_graphs": llm.engine.runner.graphs is not None,
        "preemptions": llm.engine.scheduler.num_preemptions,
        # Compared between the paths, not asserted: bf16 results may depend on the batch a row
        # runs in, and the overlapped path frees a finished sequence's blocks one step later.
        "tokens_sha256": hashlib.sha256(repr([o.token_ids for o in outs]).encode()).hexdigest(),
    }
    result["decode_roofline"] = roofline(llm, prompts, outputs, elapsed)
    llm.shutdown()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()  # transformers runs next in this process
    return result


class StepRecorder:
    """Wall time of every engine step with its shape (sequences, tokens).

    A serial step ends by reading its tokens back, so its wall time is the device's
    time for it plus the host time the device was left waiting; an overlapped step
    ends by reading back the step before it, so in a steady state its wall time is
    the larger of the two. No synchronisation is added. Time outside steps is
    ``generate``'s own (input checks, outputs). A step's shape is the batch it launched.

    On CUDA, timing events queued before and after each launch give the device's span of
    every step and its idle time between steps (> 0: the device waited for the host to queue
    the next step), split by whether that next step decodes; read once the run has ended.
    """

    def __init__(self, llm: LLM, shown=NoBar()) -> None:
        self.steps: list[tuple[int, int, float]] = []
        self.marks: list[tuple[bool, torch.cuda.Event, torch.cuda.Event]] = []  # (decode, start, end)
        shape = [0, 0]
        engine, launch = llm.engine, llm.engine.runner.launch
        step = engine.step
        cuda = engine.runner.device.type == "cuda"

        def recorded_launch(batch, *args):
            shape[:] = len(batch.seqs), sum(batch.num_tokens)
            if not cuda:
                return launch(batch, *args)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            pending = launch(batch, *args)
            end.record()
            self.marks.append((shape[0] == shape[1], start, end))
            return pending

        def timed_step():
            shape[:] = 0, 0  # stays so when the call launches nothing (it only reads a step back)
            t0 = time.perf_counter()
            out = step()
            self.steps.append((shape[0], shape[1], time.perf_counter() - t0))
            # After the step's own time; in generate's, a counter and a clock read per step (a
            # redraw at most twice a second), microseconds against steps of milliseconds.
            shown.update(len(out))
            return out

        engine.runner.launch = recorded_launch
        engine.step = timed_step

    @property
    def launched(self) -> int:
        return sum(1 for n, _, _ in self.steps if n)

    def summary(self, elapsed: float, bucket: int = 32) -> dict:
        decode = [(n, t) for n, tokens, t in self.steps if n == tokens and n]
        other = [t for n, tokens, t in self.steps if n != tokens]
        read_back_only = [t for n, _, t in self.steps if not n]
        by_batch: dict[str, list[float]] = {}
        for n, t in decode:
            lo = (n - 1) // bucket * bucket + 1
            by_batch.setdefault(f"{lo}-{lo + bucket - 1}", []).append(t)
        return {
            "decode_steps": len(decode),
            "decode_s": sum(t for _, t in decode),
            "prefill_or_mixed_steps": len(other),
            "prefill_or_mixed_s": sum(other),
            "read_back_only_calls": len(read_back_only),
            "read_back_only_s": sum(read_back_only),
            "outside_steps_s": elapsed - sum(t for *_, t in self.steps),
            "decode_ms_by_batch": {k: 1e3 * sum(v) / len(v) for k, v in by_batch.items()},
            "decode_steps_by_batch": {k: len(v) for k, v in by_batch.items()},
            **self.device_timeline(),
        }

    def device_timeline(self) -> dict:
        """Seconds the device spent on the launched steps and idle between them (CUDA only;
        waits for the device, so call it once the run has ended)."""
        if not self.marks:
            return {}
        torch.cuda.synchronize()
        idle = {True: 0.0, False: 0.0}  # keyed by whether the step after the gap decodes
        for (_, _, prev_end), (decode, start, _) in zip(self.marks, self.marks[1:]):
            idle[decode] += prev_end.elapsed_time(start) / 1e3
        return {"device_span_s": sum(s.elapsed_time(e) for _, s, e in self.marks) / 1e3,
                "device_idle_before_decode_s": idle[True], "device_idle_before_other_s": idle[False]}


def roofline(llm: LLM, prompts, outputs, elapsed: float) -> dict | None:
    """Bytes every decode step must read (weights + live KV) over the measured copy bandwidth."""
    if not llm.config.device.startswith("cuda"):
        return None
    runner = llm.engine.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_per_token = runner.block_bytes / runner.block_size
    steps = max(outputs)
    # Each decode step reads the weights once and the KV of every live sequence.
    kv_bytes = 0.0
    for p, n in zip(prompts, outputs):
        kv_bytes += sum((len(p) + t) * kv_per_token for t in range(n))
    total = steps * weight_bytes + kv_bytes
    bw = copy_bandwidth()
    return {
        "bytes_read": total,
        "copy_bandwidth_GBps": bw / 1e9,
        "min_time_s": total / bw,
        "fraction_of_roofline": (total / bw) / elapsed,
    }


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    reps = 10
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * reps / (time.perf_counter() - start)


def run_hf(model: str, prompts, outputs, args) -> dict:
    from transformers import Qwen3ForCausalLM

    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
        args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    ]
    hf = Qwen3ForCausalLM.from_pretrained(model, dtype=dtype).to(args.device).eval()
    pad = 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    generated = 0
    shown = bar(len(order), "transformers", unit="seq", enabled=not args.no_progress)
    sync(args.device)
    start = time.perf_counter()
    for b in range(0, len(order), args.hf_batch):
        idx = order[b : b + args.hf_batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(idx):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        new = max(outputs[i] for i in idx)
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids.to(args.device), attention_mask=mask.to(args.device),
                max_new_tokens=new, min_new_tokens=new, do_sample=False,
                eos_token_id=None, pad_token_id=pad,
            )
        generated += (out.shape[1] - width) * len(idx)
        shown.update(len(idx))
    sync(args.device)
    elapsed = time.perf_counter() - start
    shown.close()
    return {"elapsed_s": elapsed, "output_tokens": generated, "output_tok_s": generated / elapsed,
            "batch_size": args.hf_batch}


def environment(device: str) -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": torch.get_num_threads(),
    }
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    env["git_revision"] = git_revision()
    return env


def report(lm: dict) -> None:
    st = lm["steps"]
    name = f"lmpool {lm['path']}"
    print(f"{name}: {lm['output_tok_s']:.1f} output tok/s ({lm['output_tokens']} tokens in "
          f"{lm['elapsed_s']:.2f} s; {lm['engine_steps']} engine steps, {lm['mean_step_ms']:.2f} ms each)")
    print(f"{name}: {st['decode_steps']} decode steps {st['decode_s']:.2f} s, "
          f"{st['prefill_or_mixed_steps']} prefill/mixed steps {st['prefill_or_mixed_s']:.2f} s, "
          f"outside steps {st['outside_steps_s']:.2f} s")
    if "device_span_s" in st:
        print(f"{name}: device span of the steps {st['device_span_s']:.2f} s, idle between steps "
              f"{st['device_idle_before_decode_s']:.2f} s before decode steps and "
              f"{st['device_idle_before_other_s']:.2f} s before the others")
    roof = lm["decode_roofline"]
    if roof:
        print(f"{name}: {roof['fraction_of_roofline']:.1%} of the HBM roofline "
              f"(copy bandwidth {roof['copy_bandwidth_GBps']:.0f} GB/s)")


def compare(run: dict, base: dict, names: tuple[str, str] = ("overlapped", "serial")) -> dict:
    """``run`` over ``base`` (named ``names``): throughput and mean step time ratios, whether their
    greedy tokens matched, and the roofline fractions of both."""
    ratios = {
        "output_tok_s": run["output_tok_s"] / base["output_tok_s"],
        "mean_step_ms": run["mean_step_ms"] / base["mean_step_ms"],
        "same_tokens": run["tokens_sha256"] == base["tokens_sha256"],
    }
    if run["decode_roofline"] and base["decode_roofline"]:
        ratios["fraction_of_roofline"] = {
            name: r["decode_roofline"]["fraction_of_roofline"] for name, r in ((names[1], base), (names[0], run))}
    return ratios


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint directory (default: generate --preset)")
    ap.add_argument("--preset", default="tiny", choices=["tiny", "0.6b", "1.7b"])
    # Resolved inside the MPS block: asking torch whether CUDA exists starts the driver, which then
    # never connects to an MPS daemon started after it (the --mps runs would time the whole GPU).
    ap.add_argument("--device", help="cuda or cpu (default: cuda where present)")
    ap.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--min-input", type=int, default=32)
    ap.add_argument("--max-input", type=int, default=256)
    ap.add_argument("--min-output", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--torch-ops", action="store_true", help="use the torch reference instead of the CUDA kernels")
    ap.add_argument("--compare-hf", action="store_true", help="also time transformers generate")
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--paths", default="serial,overlapped",
                    help="comma-separated engine runs: serial (async_scheduling off), overlapped (on) and/or "
                         "plain (overlapped, the decode kernels not started early: dependent_launch off); "
                         "none: only --prefill")
    ap.add_argument("--prefill", default="", metavar="NEW[:CACHED],...",
                    help="also time the prefill of NEW tokens after CACHED cached ones (prefill_rate)")
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--prefill-kernels", action="store_true",
                    help="profile each --prefill case once more: its device time by kernel (a GPU's)")
    ap.add_argument("--prefill-attention", default="lmpool", metavar="lmpool,flash",
                    help="the --prefill cases' attention (EngineConfig.prefill_attention), each on its own engine; "
                         "flash needs --block-size a multiple of 256")
    ap.add_argument("--mps", type=int, default=0, help="run as one of N MPS clients (1/N of the SMs); 0: whole GPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    add_progress_argument(ap)
    args = ap.parse_args(argv)
    paths = [] if args.paths == "none" else args.paths.split(",")
    if not set(paths) <= set(PATHS) or not (paths or args.prefill):
        ap.error(f"--paths takes serial, overlapped and/or plain (or none, with --prefill), got {args.paths!r}")
    if args.prefill:
        try:
            prefill_rate.parse_cases(args.prefill)
        except ValueError as e:
            ap.error(str(e))

    with tempfile.TemporaryDirectory() as tmp, mps_share(args.mps) as mps:
        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = args.model or str(make_model(Path(tmp) / "model", preset=args.preset, seed=args.seed))
        vocab = ModelConfig.from_pretrained(model).vocab_size
        prompts, outputs = workload(
            args.num_seqs, args.min_input, args.max_input, args.min_output, args.max_output, vocab, args.seed
        )
        result = {"config": vars(args) | {"model": Path(args.model).name if args.model else None, "json": None}, "environment": environment(args.device)}
        if mps is not None:
            result["mps"] = mps
        runs = {}
        for path in paths:
            runs[path] = run_lmpool(model, prompts, outputs, args, path)
            report(runs[path])
        if runs:
            result["lmpool"] = runs.get("overlapped") or runs[paths[-1]]
        if args.prefill:
            result["prefill"] = run_prefill(model, args)
        if "serial" in runs:
            result["lmpool_serial"] = runs["serial"]
        if "plain" in runs:
            result["lmpool_plain"] = runs["plain"]
        if "plain" in runs and "overlapped" in runs:
            result["overlapped_vs_plain"] = compare(runs["overlapped"], runs["plain"], ("overlapped", "plain"))
            ratio = result["overlapped_vs_plain"]
            print(f"overlapped / plain: {ratio['output_tok_s']:.2f}x output tok/s; same tokens: {ratio['same_tokens']}")
        if "serial" in runs and "overlapped" in runs:
            result["overlapped_vs_serial"] = compare(runs["overlapped"], runs["serial"])
            ratio = result["overlapped_vs_serial"]
            print(f"overlapped / serial: {ratio['output_tok_s']:.2f}x output tok/s; "
                  f"same tokens: {ratio['same_tokens']}")
        if args.compare_hf and runs:
            result["transformers"] = run_hf(model, prompts, outputs, args)
            ratio = result["lmpool"]["output_tok_s"] / result["transformers"]["output_tok_s"]
            result["speedup_vs_transformers"] = ratio
            print(f"transformers: {result['transformers']['output_tok_s']:.1f} output tok/s; "
                  f"lmpool is {ratio:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
