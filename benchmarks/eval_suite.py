"""A benchmark suite: every policy on every workload, repeated, each run on a fresh or reset pool.

Runs go repetition-major (repetition 0: every setting and workload under every policy;
then repetition 1; ...), so a suite cut short by ``--max-minutes`` still holds complete
repetitions of every policy. Within a repetition the policies run in that repetition's row
of a Williams design (``policy_order``; ``--order fixed`` only to reproduce old results),
and the JSON records every repetition's order and every run's position in it. A sweep
(``--sweep``, ``eval_settings``) runs every workload under every setting; each run and each
comparison says its KV budget, window, arrival process and order. Every run starts with empty
KV caches and a new control process (no learned state), and no policy inherits another's
cache: on a pool kept across runs and reset before each (``lib/pool_keeper.py``), or, with
``--fresh-pools``, on a pool of its own. All policies of a workload replay the same trace (same token ids,
order and arrivals); repetition r uses seed ``--seed + r``.

A policy whose pool constructor rejects its settings (``TypeError``/``ValueError``, e.g. a
transfer mode this build does not have) is marked ``unavailable`` with the error and
skipped; a policy whose runs fail twice (start-up, error, ``--run-timeout``) is marked
``failed`` and skipped. The JSON is rewritten after every run, so an interrupted suite
keeps what it measured. Progress goes to stderr (tqdm when installed, plain lines
otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import uvloop

from benchmarks.stats import claims
from benchmarks.workloads.dataset_profile import profile_trace
from benchmarks.replay.eval_driver import Arrival, replay
from benchmarks.stats.eval_metrics import run_metrics, summarize
from benchmarks.peers.eval_policies import (
    CANDIDATES, GATEWAYS, LMPOOL, LMPOOL_UNGROUPED, LMPOOL_OWNER_PULLS, LMPOOL_ROUTING, LMPOOL_VARIANTS, NAMED_ONLY,
    PEER_VARIANTS, PEERS, TRANSFER_MODES, TRANSFERS_IDLE, Policy, select_policies,
)
from benchmarks.replay.eval_settings import Setting, cell_key, parse_arrival, parse_sweep, settings
from benchmarks.device.mps import mps_daemon
from benchmarks.stats.policy_order import ORDERS, policy_order, run_order
from benchmarks.lib.pool_keeper import PoolKeeper
from benchmarks.lib.revision import git_record
from benchmarks.workloads.trace_file import load_trace, trace_name
from benchmarks.workloads.traces import max_request_tokens
from lmpool.config.engine import EngineConfig, piecewise_rows, prefill_attention
from lmpool.engine.model_runner import dtype_name, planned_cascades, resolve_dtype
from lmpool.model.config import ModelConfig
from lmpool.worker.loop_stages import LoopStages

# Runs write here unless --json names a file: the committed results change only when asked.
SCRATCH_DIR = Path(tempfile.gettempdir()) / "lmpool-eval"
SCHEMA = "lmpool-eval/1"
MAX_FAILURES = 2


# The policy tables live in ``eval_policies``; the runners and tests import them from here too.
__all__ = ["CANDIDATES", "GATEWAYS", "LMPOOL", "LMPOOL_UNGROUPED", "LMPOOL_OWNER_PULLS", "LMPOOL_ROUTING",
           "LMPOOL_VARIANTS", "PEERS", "PEER_VARIANTS", "Policy", "TRANSFERS_IDLE", "TRANSFER_MODES", "run_order",
           "select_policies"]


def chosen_policies(args: argparse.Namespace, available: tuple[Policy, ...], quick: str) -> list[Policy]:
    """``--policies`` ('all' or none: every one that runs a pool, Dynamo's router in front of one
    included); in quick mode without it, the runner's ``quick`` set, which the recorded config
    then names. Policies in ``NAMED_ONLY`` (the real gateway, the candidate default) run only when
    named, so 'all' costs what it did before them."""
    if args.quick and not args.policies:
        args.policies = quick
    if args.policies in (None, "all"):
        return [p for p in available if p not in NAMED_ONLY]
    return select_policies(available, args.policies)


# ---- command line ----------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags every runner shares; ``None`` defaults are filled by ``finish_arguments``."""
    ap.add_argument("--quick", action="store_true",
                    help="CPU quick mode: tiny model, 2 replicas, 1 repetition, lengths / 32, 8-token blocks, "
                         "4 output tokens, a handful of policies (--policies all for every one)")
    ap.add_argument("--model", help="checkpoint directory (default: generate --preset into the cache)")
    ap.add_argument("--preset", choices=["tiny", "0.6b", "1.7b"], help="random-weight Qwen3 shape (default tiny)")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default cpu")
    ap.add_argument("--world-size", type=int, help="replicas (default 2 on CPU, 4 on CUDA)")
    ap.add_argument("--num-kv-blocks", type=int, help="KV blocks of every worker (equal budgets)")
    ap.add_argument("--block-size", type=int, help="tokens per KV block (default 256; quick 8)")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="default: checkpoint's on CUDA")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="running sequences per worker")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (faster pool start)")
    ap.add_argument("--piecewise-graph-max-tokens", type=int, default=None, metavar="N",
                    help="steps that prefill, of at most N tokens, replay graphs around their attention "
                         "(EngineConfig.piecewise_graph_max_tokens; 0: never; default: the engine's)")
    ap.add_argument("--cascade-min-saved-tokens", type=int, default=None, metavar="N",
                    help="decode steps sharing prefixes read them once when that saves N key reads "
                         "(EngineConfig.cascade_min_saved_tokens; 0: never; default: the engine's)")
    ap.add_argument("--prefill-attention", choices=["lmpool", "flash"], default=None,
                    help="attention of the steps that prefill (EngineConfig.prefill_attention): LMPool's "
                         "kernel or torch's FlashAttention over the paged cache (blocks of a multiple of 256); "
                         "default: the engine's (flash where the CUDA kernels run in half precision)")
    ap.add_argument("--reps", type=int, help="repetitions (default 5; quick 1)")
    ap.add_argument("--first-rep", type=int, default=0,
                    help="number of the first repetition (seed --seed + number), to split a suite")
    ap.add_argument("--scale", type=float, help="multiply every prompt length (default 1; quick 1/32)")
    ap.add_argument("--max-tokens", type=int, help="output tokens of every request (default 32; quick 4)")
    ap.add_argument("--arrival", default="window",
                    help="'window' (closed loop), 'poisson' (at --rate) or 'poisson:RATE' requests/s")
    ap.add_argument("--window", type=int, default=16, help="most requests in flight (0: unlimited)")
    ap.add_argument("--rate", type=float, default=0.0, help="requests/s for --arrival poisson")
    ap.add_argument("--sweep", action="append", default=[], metavar="AXIS=V1,V2,...",
                    help="run every workload under every combination: kv_budget=BLOCKS_PER_WORKER,..., "
                         "window=16,64,0, arrival=window,poisson:RATE,... (repeatable; eval_settings.py)")
    ap.add_argument("--order", choices=ORDERS, default="williams",
                    help="policy order per repetition: a Williams design row (default) or as listed (fixed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", help="comma-separated subset of the runner's policies, or 'all'")
    ap.add_argument("--transfer-profile", type=Path,
                    help="calibration profile for the transfer modes' cost model (benchmark_kv_transfer.py JSON "
                         "of this machine and model shape; default: the pool's uncalibrated link model)")
    ap.add_argument("--mps", action="store_true",
                    help="start a private MPS daemon; each replica gets 100/replicas-per-GPU %% of the SMs")
    ap.add_argument("--run-timeout", type=float, default=600.0, help="seconds before a run is abandoned")
    ap.add_argument("--fresh-pools", action="store_true",
                    help="start a pool for every run (default: keep one across the runs its workers can serve, "
                         "reset between them: benchmarks/lib/pool_keeper.py)")
    ap.add_argument("--max-minutes", type=float, help="start no repetition that would end past this")
    ap.add_argument("--trace", type=Path, action="append", default=[],
                    help="a JSON Lines trace of one's own (trace_file.py says the format), run as workload "
                         "trace_<stem>; repeatable. With --trace, the built-in workloads run only if named")
    ap.add_argument("--json", type=Path, help=f"output file (default under {SCRATCH_DIR}: the committed results in "
                                              "benchmarks/results/ change only when named here)")
    ap.add_argument("--no-progress", action="store_true",
                    help="plain lines instead of progress bars (always so when stderr is not a terminal)")


def finish_arguments(args: argparse.Namespace, pool_blocks: int, name: str) -> argparse.Namespace:
    """Fill defaults (quick mode or full), validate, and pick the output path.

    ``pool_blocks`` is the runner's whole-pool KV budget: each worker gets
    ``pool_blocks // world_size`` blocks unless ``--num-kv-blocks`` says otherwise."""
    quick = args.quick
    if quick and (args.device == "cuda" or args.preset not in (None, "tiny")):
        raise SystemExit("--quick is the CPU tiny-model mode; drop --device cuda / --preset")
    args.preset_given = args.preset is not None
    args.preset = args.preset or "tiny"
    args.device = args.device or "cpu"
    if args.world_size is None:
        args.world_size = 4 if args.device == "cuda" else 2
    # Quick mode divides lengths and the block size alike, so prompts keep their block counts.
    defaults = {"block_size": 8 if quick else 256, "reps": 1 if quick else 5,
                "scale": 1 / 32 if quick else 1.0, "max_tokens": 4 if quick else 32}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.num_kv_blocks is None:
        args.num_kv_blocks = max(1, pool_blocks // args.world_size)
    for flag in ("world_size", "block_size", "reps", "max_tokens", "num_kv_blocks", "max_num_seqs"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1")
    if not args.scale > 0:
        raise SystemExit("--scale must be > 0")
    if args.json is None:
        tag = "cpu_quick" if quick else f"{args.device}_{args.preset}"
        args.json = SCRATCH_DIR / f"eval_{tag}_{name}.json"
    if args.first_rep < 0:
        raise SystemExit("--first-rep must be >= 0")
    args.rep_ids = list(range(args.first_rep, args.first_rep + args.reps))
    try:
        args.arrival, args.rate = parse_arrival(args.arrival, args.rate)
        args.arrival_process = Arrival(args.arrival, args.window, args.rate, args.seed)
        args.settings = settings(args.num_kv_blocks, args.arrival_process, parse_sweep(args.sweep))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return args


# ---- environment -----------------------------------------------------------------------

def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=Path(__file__).parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _portable(arg: str) -> str:
    # The record must not name this machine's directories; a file's name is enough.
    return f"<{Path(arg).name}>" if os.path.isabs(arg) else arg


def environment(device: str) -> dict:
    versions = {"python": platform.python_version()}
    for dist in ("lmpool", "torch", "msgspec", "numpy", "uvloop", "pyzmq", "ai-dynamo-runtime"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    hardware = {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count()}
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = Path("/proc/meminfo").read_text().split("\n")[0].split()
        hardware["memory_gib"] = round(int(mem[1]) / 2**20, 1)
    if device == "cuda":
        # Asked of nvidia-smi rather than torch, so this process makes no CUDA context.
        gpus = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
        hardware["gpus"] = gpus.splitlines() if gpus else None
        import torch

        versions["cuda"] = torch.version.cuda
    return {"versions": versions, "hardware": hardware, "git": git_record()}


def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from lmpool.cli import default_model

    return str(default_model(args.preset))


def vocab_size(args: argparse.Namespace) -> int:
    return ModelConfig.from_pretrained(resolve_model(args)).vocab_size


def file_traces(args: argparse.Namespace) -> dict[str, dict[int, object]]:
    """The ``--trace`` files as workloads: one trace per file, the same for every repetition
    (the file fixes its ids and order), text prompts encoded with the model's tokenizer."""
    if not args.trace:
        return {}
    from lmpool.tokenizer import encode_prompt, load_tokenizer

    from lmpool.model.config import ModelConfig

    model = resolve_model(args)
    tokenizer = load_tokenizer(model)
    encode = None if tokenizer is None else (lambda text: encode_prompt(tokenizer, text))
    config = ModelConfig.from_pretrained(model)
    vocab, longest = config.vocab_size, config.max_context
    out: dict[str, dict[int, object]] = {}
    for path in args.trace:
        name = trace_name(path)
        if name in out:
            raise SystemExit(f"two --trace files would both run as {name}: rename one")
        try:
            trace = load_trace(path, args.seed, vocab, encode, args.max_tokens, args.world_size)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--trace {_portable(str(path))}: {e}") from None
        if max_request_tokens([trace]) > longest:
            raise SystemExit(f"--trace {_portable(str(path))}: a request needs {max_request_tokens([trace])} "
                             f"tokens (prompt and output), more than the model's {longest}")
        out[name] = {r: dataclasses.replace(trace, seed=args.seed + r) for r in args.rep_ids}
    return out


def model_record(model: str, preset: str | None) -> dict:
    from lmpool.model.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model)
    return {"name": Path(model).name, "preset": preset, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "layers": cfg.num_hidden_layers,
            "attention_heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "torch_dtype": cfg.torch_dtype,
            "max_position_embeddings": cfg.max_position_embeddings}


def visible_gpus() -> int:
    """GPUs this process may use, counted without initialising CUDA here: a process that
    initialised CUDA before the MPS daemon started would not be its client."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    listed = _run(["nvidia-smi", "-L"])
    return len(listed.splitlines()) if listed else 0


def replicas_per_gpu(args: argparse.Namespace) -> int:
    gpus = visible_gpus()
    if gpus < 1:
        raise SystemExit("--mps needs a CUDA device")
    return -(-args.world_size // gpus)


@contextlib.contextmanager
def mps_if_asked(args: argparse.Namespace) -> Iterator[dict]:
    if not args.mps:
        yield {"enabled": False}
        return
    with mps_daemon(replicas_per_gpu(args)) as info:
        if not info["enabled"]:
            print(f"warning: running without MPS: {info['error']}", file=sys.stderr)
        yield info


# ---- progress --------------------------------------------------------------------------

class Progress:
    """A bar over every run and one over each run's requests (tqdm, on a terminal), or plain
    lines with the elapsed time and an estimate of the rest (logs, or without tqdm)."""

    def __init__(self, total_runs: int, enabled: bool) -> None:
        self._tqdm = None
        if enabled and sys.stderr.isatty():
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self._tqdm = tqdm
        self.total = total_runs
        self.done = 0
        self._ran = 0
        self._start = time.perf_counter()
        self._outer = self._tqdm(total=total_runs, desc="runs", file=sys.stderr, position=0) if self._tqdm else None

    def run_bar(self, desc: str, total: int):
        if self._tqdm is None:
            print(f"[{self.done + 1}/{self.total}] {desc}: {total} requests ...", file=sys.stderr, flush=True)
            return None
        return self._tqdm(total=total, desc=desc, file=sys.stderr, position=1, leave=False)

    def skipped(self) -> None:
        self.done += 1
        if self._outer is not None:
            self._outer.update(1)

    def finished(self, line: str) -> None:
        self.done += 1
        self._ran += 1
        if self._outer is not None:
            self._outer.update(1)
            self._outer.write(line, file=sys.stderr)
            return
        elapsed = time.perf_counter() - self._start
        left = elapsed / self._ran * (self.total - self.done)
        print(f"{line}  [{elapsed / 60:.1f} min elapsed, ~{left / 60:.1f} min left]", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._outer is not None:
            self._outer.close()


# ---- runs ------------------------------------------------------------------------------

def engine_record(args: argparse.Namespace, model: str) -> dict:
    """What the pools' engines run, as they resolve their defaults with their dtype: the key
    reads they run cascades at (0: none; ``config.engine.cascade_min_saved``) and the attention
    they prefill with, and the most tokens of a step that prefills through piecewise graphs."""
    engine = EngineConfig(model, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          cascade_min_saved_tokens=args.cascade_min_saved_tokens,
                          prefill_attention=args.prefill_attention, **piecewise_arg(args))
    model_config = ModelConfig.from_pretrained(model)
    dtype = dtype_name(resolve_dtype(engine, model_config))
    return {"cascade_min_saved": planned_cascades(engine, model_config),
            "prefill_attention": prefill_attention(engine, dtype, model_config.head_dim),
            "piecewise_graph_max_tokens": piecewise_rows(engine)}


def piecewise_arg(args: argparse.Namespace) -> dict:
    """``--piecewise-graph-max-tokens`` as an engine argument, where it was given."""
    n = args.piecewise_graph_max_tokens
    return {} if n is None else {"piecewise_graph_max_tokens": n}


def engine_args(args: argparse.Namespace, setting: Setting, max_model_len: int) -> dict:
    kw = {"block_size": args.block_size, "num_kv_blocks": setting.kv_blocks, "max_num_seqs": args.max_num_seqs,
          "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": max_model_len,
          "enforce_eager": args.enforce_eager, "cascade_min_saved_tokens": args.cascade_min_saved_tokens,
          "prefill_attention": args.prefill_attention, **piecewise_arg(args)}
    if args.dtype:
        kw["dtype"] = args.dtype
    return kw


def new_pool(model: str, args: argparse.Namespace, policy: Policy, setting: Setting, max_model_len: int,
             kept: bool = False, **extra):
    """An unstarted pool for one run of ``policy`` (``extra``: more of the pool's settings), or,
    ``kept``, for every run its workers can serve (transfers set up for any of them);
    ``PolicyUnavailable`` when its constructor refuses the policy's settings."""
    from lmpool.frontend.api import AsyncLMPool

    try:
        if (kept or policy.transfer_mode != "none") and args.transfer_profile is not None:
            from lmpool.config.transfer import TransferPolicyConfig

            extra["transfer_policy"] = TransferPolicyConfig(transfer_profile=str(args.transfer_profile))
        if kept:
            extra["enable_transfers"] = True
        # A start that hangs is bounded too (the pool's own default waits 300 s).
        return AsyncLMPool(model, world_size=args.world_size, device=args.device,
                           ready_timeout=min(300.0, max(60.0, args.run_timeout)),
                           **(policy.pool_kwargs() | extra), **engine_args(args, setting, max_model_len))
    except (TypeError, ValueError) as e:
        raise PolicyUnavailable(f"{type(e).__name__}: {e}") from e


def pool_figures(stats: dict) -> dict:
    """What a run records of the pool's ``stats()``: its transfer counters and each rank's row."""
    transfers = stats.get("transfers")
    return {"transfers": dict(transfers) if isinstance(transfers, dict) else None,
            "rank_stats": [{k: r.get(k) for k in ("rank", "prompt_tokens", "prefix_hit_tokens", "blocks_used",
                                                 "blocks_reclaimable", "blocks_free", "cached_blocks", "step_fit",
                                                 "loop_ms", "start_phases")}
                           for r in stats.get("ranks", [])]}


async def run_one(model: str, args: argparse.Namespace, policy: Policy, trace, setting: Setting,
                  max_model_len: int, bar, keeper: PoolKeeper | None = None) -> dict:
    """Replay ``trace`` on a pool for ``policy`` (``keeper``'s: a kept one, reset, or a new one;
    without a keeper, a pool of its own). Raises ``PolicyUnavailable`` when the pool constructor
    refuses the policy (or, for a policy with a ``runner``, when that system cannot run here)."""
    keeper = keeper or pool_keeper(model, args, max_model_len, keep=False)
    if policy.runner is not None:
        return await run_external(model, args, policy, trace, setting, max_model_len, bar, keeper)
    pool, record = await acquire(keeper, policy, setting, trace)
    try:
        async with asyncio.timeout(args.run_timeout):
            record.update(await measure(pool, trace, setting, bar))
    except BaseException:
        await keeper.release(failed=True)
        raise
    await keeper.release()
    return record


async def acquire(keeper: PoolKeeper, policy: Policy, setting: Setting, trace, **control) -> tuple:
    """``keeper.acquire``; settings the pool refuses (``TypeError``/``ValueError``, from a new
    pool's constructor or a kept one's reset) make the policy ``PolicyUnavailable``."""
    try:
        return await keeper.acquire(policy, setting, trace, **control)
    except (TypeError, ValueError) as e:
        raise PolicyUnavailable(f"{type(e).__name__}: {e}") from e


async def measure(pool, trace, setting: Setting, bar) -> dict:
    """Replay ``trace`` on a started ``pool``; its requests' records and the pool's figures."""
    record: dict = {}
    t = time.perf_counter()
    # The user process's own garbage collections: they hold its loop, which submits,
    # routes and hands over every request, and delivers every token.
    driver = LoopStages()
    stop = driver.watch_collections()
    try:
        record["requests"] = await replay(pool, trace, setting.arrival,
                                          bar.update if bar is not None else (lambda *a: None))
    finally:
        stop()
    record["replay_s"] = time.perf_counter() - t
    record["frontend_collect_ms"] = driver.snapshot()["collect"]
    record.update(pool_figures(await pool.stats()))
    return record


def pool_keeper(model: str, args: argparse.Namespace, max_model_len: int, keep: bool) -> PoolKeeper:
    """The suite's pools: kept across runs, or (``keep`` off, ``--fresh-pools``) one per run; a
    kept pool sets up transfers for every policy it may serve, and warms up on its first run's trace."""

    def make(policy: Policy, setting: Setting, kv_events):
        extra = {} if kv_events is None else {"kv_events": kv_events}
        return new_pool(model, args, policy, setting, max_model_len, kept=keep, **extra)

    async def warm_up(pool, trace, setting: Setting) -> None:
        async with asyncio.timeout(args.run_timeout):
            await replay(pool, trace, setting.arrival, lambda *a: None)

    return PoolKeeper(make, warm_up, keep)


# Dynamo's router pins every request it routes, so the pool's own routing never runs (only a
# request moved off a dead rank would meet it); no transfers, as under every routing-only peer.
DYNAMO_POOL = Policy("dynamo_kv's pool", "round_robin")


async def run_external(model: str, args: argparse.Namespace, policy: Policy, trace, setting: Setting,
                       max_model_len: int, bar, keeper: PoolKeeper) -> dict:
    """``run_one`` for a policy that names an external router (``eval_gateway``, ``eval_dynamo``):
    the gateway fronts hosts of its own (``keeper``'s pool is closed first), Dynamo's router a
    pool of ``keeper``'s that publishes KV events."""
    on_done = bar.update if bar is not None else (lambda *a: None)
    if policy.runner == "smg":
        from benchmarks.peers.eval_gateway import GatewayUnavailable, run_gateway

        await keeper.close()
        try:
            return await run_gateway(model, args, trace, setting, max_model_len, replay, on_done)
        except GatewayUnavailable as e:
            raise PolicyUnavailable(str(e)) from e
    if policy.runner == "dynamo":
        from benchmarks.peers.eval_dynamo import DynamoUnavailable, events_config, run_dynamo, selection_service

        try:
            selection_service()  # before any pool is made
        except DynamoUnavailable as e:
            raise PolicyUnavailable(str(e)) from e
        pool, record = await acquire(keeper, DYNAMO_POOL, setting, trace, kv_events=events_config())
        try:
            record.update(await run_dynamo(pool, args, trace, setting, replay, on_done, pool_figures))
        except BaseException:
            await keeper.release(failed=True)
            raise
        await keeper.release()
        return record
    raise PolicyUnavailable(f"no runner {policy.runner!r}")


class PolicyUnavailable(Exception):
    pass


def _line(run: dict) -> str:
    head = f"{run['workload']:<14} {run['policy']:<21} rep {run['rep']}"
    if run["status"] != "ok":
        return f"{head}: {run['status']}: {run['error']}"
    m = run["metrics"]
    tput = m.get("throughput_tok_s") or 0.0
    return (f"{head}: {tput:8.1f} tok/s  TTFT {m.get('ttft_mean_ms', 0):8.1f} ms  E2E {m.get('e2e_mean_ms', 0):8.1f} ms"
            f"  tok reuse {m['dp_tok_reuse']:.3f}  ({run['wall_s']:.1f} s)")


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    # Compact: thousands of per-request records; ``python -m json.tool`` pretty-prints it.
    tmp.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    os.replace(tmp, path)


def _describe(e: BaseException) -> str:
    """The error and, for a group of them (a replay's failed requests), its first one."""
    text = f"{type(e).__name__}: {e}"
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
        text += f"; first: {type(e).__name__}: {e}"
    return text


async def _run_policy(args: argparse.Namespace, model: str, policy: Policy, cell: dict, rep: int,
                      max_model_len: int, state: dict, failures: dict[str, int], progress: Progress,
                      keeper: PoolKeeper | None = None) -> dict:
    """One run's record; updates the policy's ``state`` when it turns out unavailable or failed.
    ``cell`` is the run's workload key, trace, setting, and its place in the repetition's order."""
    trace, setting, key = cell["trace"], cell["setting"], cell["key"]
    run = {"workload": key, "trace": trace.workload, "policy": policy.name, "rep": rep, "seed": trace.seed,
           "setting": setting.record(args.order), "order_position": cell["position"],
           "status": "skipped", "error": None}
    if state["status"] != "ok":
        progress.skipped()
        return run
    bar = progress.run_bar(f"{key} {policy.name} rep {rep}", len(trace.requests))
    t = time.perf_counter()
    try:
        record = await run_one(model, args, policy, trace, setting, max_model_len, bar, keeper)
        run.update(record, status="ok")
        run["metrics"] = run_metrics(record["requests"], record["transfers"], args.world_size)
    except PolicyUnavailable as e:
        state.update(status="unavailable", error=str(e))
        run.update(status="unavailable", error=str(e))
    except Exception as e:  # noqa: BLE001 - a failed run is recorded, the suite goes on
        failures[policy.name] += 1
        error = (f"the run exceeded --run-timeout {args.run_timeout:g} s" if isinstance(e, TimeoutError)
                 else _describe(e))
        run.update(status="failed", error=error)
        if failures[policy.name] >= MAX_FAILURES:
            state.update(status="failed", error=error)
    finally:
        if bar is not None:
            bar.close()
    run["wall_s"] = time.perf_counter() - t
    progress.finished(_line(run))
    return run


def run_suite(args: argparse.Namespace, benchmark: str, traces: dict[str, dict[int, object]],
              policies: list[Policy], comparisons: Callable[[dict], dict]) -> dict:
    """Run ``traces[workload][rep]`` under every policy; write and return the result."""
    if not traces:
        raise SystemExit("no workload to run: name built-in ones or give --trace files")
    model = resolve_model(args)
    every = [t for ts in traces.values() for t in ts.values()]
    swept = bool(args.sweep)
    max_model_len = -(-max_request_tokens(every) // args.block_size) * args.block_size
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("arrival_process", "rep_ids", "preset_given", "settings")}
    config["json"] = _portable(str(args.json))
    config["trace"] = [_portable(str(path)) for path in args.trace]
    if config.get("model"):
        config["model"] = _portable(config["model"])
    result = {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "metadata": {
            "command": [_portable(a) for a in sys.argv],
            "config": config | {"max_model_len": max_model_len} | engine_record(args, model),
            "model": model_record(model, args.preset if args.preset_given or not args.model else None),
            **environment(args.device),
            "pools": ("fresh: one per run" if args.fresh_pools
                      else "kept: one pool across the runs its workers can serve, reset between them"),
            "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            # The profile does not depend on the seed (``workloads``): the first repetition's.
            "dataset_profile": {wl: profile_trace(ts[args.rep_ids[0]], args.block_size) for wl, ts in traces.items()},
        },
        "policies": {p.name: p.record() | {"status": "ok", "error": None} for p in policies},
        "settings": {cell_key(w, st, swept): {"workload": w, **st.record(args.order)}
                     for st in args.settings for w in traces},
        "orders": {},
        "runs": [],
    }
    failures = {p.name: 0 for p in policies}
    progress = Progress(args.reps * len(args.settings) * len(traces) * len(policies), not args.no_progress)

    def compare() -> dict:
        return claims.finish(comparisons, result["summary"], result["settings"])

    suite_start = time.perf_counter()
    rep_seconds: list[float] = []

    async def run_reps() -> None:
        keeper = pool_keeper(model, args, max_model_len, keep=not args.fresh_pools)
        try:
            for done_reps, rep in enumerate(args.rep_ids):
                elapsed = time.perf_counter() - suite_start
                if args.max_minutes and rep_seconds and elapsed + rep_seconds[-1] > 60 * args.max_minutes:
                    result["stopped_early"] = (f"after {done_reps} repetitions: another would end past "
                                               f"--max-minutes {args.max_minutes}")
                    print(result["stopped_early"], file=sys.stderr)
                    break
                rep_start = time.perf_counter()
                order = policy_order(policies, rep, args.order)
                result["orders"][str(rep)] = [p.name for p in order]
                for setting in args.settings:
                    for workload, reps in traces.items():
                        for position, policy in enumerate(order):
                            cell = {"key": cell_key(workload, setting, swept), "trace": reps[rep],
                                    "setting": setting, "position": position}
                            run = await _run_policy(args, model, policy, cell, rep, max_model_len,
                                                    result["policies"][policy.name], failures, progress, keeper)
                            result["runs"].append(run)
                            result["summary"] = summarize(result["runs"])
                            result["comparisons"] = compare()
                            write_json(args.json, result)
                rep_seconds.append(time.perf_counter() - rep_start)
        finally:
            await keeper.close()

    try:
        with mps_if_asked(args) as mps:
            result["metadata"]["mps"] = mps
            uvloop.run(run_reps())
    finally:
        progress.close()
        result["metadata"]["finished_at"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        result["metadata"]["suite_s"] = time.perf_counter() - suite_start
        result["summary"] = summarize(result["runs"])
        result["comparisons"] = compare()
        write_json(args.json, result)
    print(f"saved json: {args.json}", file=sys.stderr)
    return result
