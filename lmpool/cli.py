"""The ``lmpool`` command: ``demo``, ``serve``, ``make-model``, and the operator tools ``ps`` and ``top``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# Two instructions, each shared by half of the prompts: the pool routes each half to the
# replica that holds its instruction's blocks, so the demo shows prefix-cache hits and both
# replicas at work.
STORYTELLER = (
    "You are a careful storyteller. Continue the text below in the same voice, keep the "
    "sentences short, and never repeat yourself. Text: "
)
TEACHER = (
    "You are a patient teacher. Explain the idea below to a curious student in plain words, "
    "one step at a time, with one small example. Idea: "
)
DEMO_PROMPTS = [
    (STORYTELLER, "The harbour town woke slowly on winter mornings."),
    (TEACHER, "A library is a quiet machine for remembering."),
    (STORYTELLER, "In the mountains the weather changes faster than any forecast."),
    (TEACHER, "A system is only as fast as its slowest part."),
    (STORYTELLER, "Good soup begins with patience."),
    (TEACHER, "The history of numbers is a history of people trying to count."),
]


def cache_dir() -> Path:
    base = os.environ.get("LMPOOL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lmpool"
    )
    return Path(base)


def default_model(preset: str = "tiny", seed: int = 0) -> Path:
    """A generated random-weight checkpoint, made once and reused."""
    from lmpool.model.make_model import make_model

    path = cache_dir() / "models" / f"{preset}-seed{seed}"
    if not (path / "config.json").exists():
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        make_model(tmp, preset=preset, seed=seed)
        os.replace(tmp, path)  # atomic: a half-written model is never picked up
    return path


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (0 or a negative count is an error, not the default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def demo(argv: list[str]) -> int:
    import torch

    from lmpool import LMPool, SamplingParams

    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="lmpool demo", description="Serve a small model from a pool of replicas.")
    parser.add_argument("--model", help="a Qwen3 checkpoint directory (default: a generated tiny model)")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--world-size", type=positive_int, help="replicas (default: one per GPU, at least 2)")
    parser.add_argument("--max-tokens", type=positive_int, default=24)
    args = parser.parse_args(argv)
    world_size = args.world_size
    if world_size is None:
        world_size = max(2, torch.cuda.device_count()) if args.device == "cuda" else 2
    model = args.model or str(default_model())
    print(f"model: {model}\ndevice: {args.device}, {world_size} replicas")
    with LMPool(model, world_size=world_size, device=args.device, block_size=16) as pool:
        print(f"pool: {pool.pool_id} (watch it with: lmpool top {pool.pool_id[:8]})")
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, seed=0)
        prompts = [instruction + text for instruction, text in DEMO_PROMPTS]
        start = time.perf_counter()
        # The second round finds the prompts' blocks cached where the first round put them.
        outs = pool.generate(prompts, params) + pool.generate(prompts, params)
        elapsed = time.perf_counter() - start
        stats = pool.stats()
    for (_, text), out in zip(DEMO_PROMPTS, outs):
        print(f"\n> {text}\n  {out.text!r}")
    print(summary(outs, stats, elapsed))
    return 0


def summary(outs, stats: dict, elapsed: float) -> str:
    """Per-rank requests, prefix hits and tokens, then the totals."""
    lines = ["", f"{'rank':>4} {'requests':>8} {'prompt tokens':>13} {'cached':>6} {'hit rate':>8} "
                 f"{'output tokens':>13}"]
    for row in stats["ranks"]:
        mine = [o for o in outs if o.rank == row["rank"]]
        prompt = sum(len(o.prompt_token_ids) for o in mine)
        cached = sum(o.num_cached_tokens for o in mine)
        lines.append(
            f"{row['rank']:>4} {len(mine):>8} {prompt:>13} {cached:>6} {_rate(cached, prompt):>8} "
            f"{sum(len(o.token_ids) for o in mine):>13}"
        )
    tokens = sum(len(o.token_ids) for o in outs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    lines.append(
        f"\n{len(outs)} requests on {len(stats['ranks'])} ranks: {tokens} output tokens in {elapsed:.2f} s "
        f"({tokens / elapsed:.0f} tok/s); prefix cache hit rate {_rate(cached, prompt)} "
        f"({cached}/{prompt} prompt tokens)"
    )
    return "\n".join(lines)


def _rate(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def make_model_command(argv: list[str]) -> int:
    from lmpool.model import make_model

    return make_model.main(argv)


def serve_command(argv: list[str]) -> int:
    from lmpool.frontend.serve import server

    return server.main(argv)


def top_command(argv: list[str]) -> int:
    from lmpool_tools import top

    return top.main(argv)


def ps_command(argv: list[str]) -> int:
    from lmpool_tools import ps

    return ps.main(argv)


COMMANDS = {"demo": demo, "serve": serve_command, "make-model": make_model_command, "ps": ps_command,
            "top": top_command}


HELP = """usage: lmpool {demo,serve,make-model,ps,top} [args...]

  demo        serve a generated tiny model from a pool of replicas and show where prompts went
  serve       serve a model over an OpenAI-compatible HTTP API
  make-model  write a random-weight Qwen3 checkpoint (config, weights, tokenizer)
  ps          list the pools on this machine
  top         live view of one pool

'lmpool COMMAND --help' describes a command's arguments."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help", "help"):
        print(HELP)
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(HELP, file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
