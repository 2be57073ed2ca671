"""The ``lmpool`` command: ``make-model`` and ``demo``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# A shared preamble, so the demo shows prefix-cache hits across requests.
PREAMBLE = (
    "You are a careful storyteller. Continue the text below in the same voice, keep the "
    "sentences short, and never repeat yourself. Text: "
)
DEMO_PROMPTS = [
    "The harbour town woke slowly on winter mornings.",
    "A library is a quiet machine for remembering.",
    "Engineers like to say that a system is only as fast as",
    "In the mountains the weather changes faster than any forecast.",
    "Good soup begins with patience.",
    "The history of numbers is a history of people trying to count",
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


def demo(argv: list[str]) -> int:
    import torch

    from lmpool import LLM, SamplingParams

    parser = argparse.ArgumentParser(prog="lmpool demo", description="Generate from a small model.")
    parser.add_argument("--model", help="a Qwen3 checkpoint directory (default: a generated tiny model)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    model = args.model or str(default_model())
    print(f"model: {model}\ndevice: {args.device}")
    with LLM(model, device=args.device, block_size=16) as llm:
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, seed=0)
        start = time.perf_counter()
        prompts = [PREAMBLE + p for p in DEMO_PROMPTS]
        outs = llm.generate(prompts, params)
        again = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    for prompt, out in zip(DEMO_PROMPTS, outs):
        print(f"\n> {prompt}\n  {out.text!r}")
    tokens = sum(len(o.token_ids) for o in outs + again)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs + again)
    hits = sum(o.num_cached_tokens for o in outs + again)
    print(
        f"\n{len(outs) + len(again)} requests, {tokens} output tokens in {elapsed:.2f} s "
        f"({tokens / elapsed:.0f} tok/s); prefix cache served {hits}/{prompt_tokens} prompt tokens"
    )
    return 0


def make_model_command(argv: list[str]) -> int:
    from lmpool.model import make_model

    return make_model.main(argv)


COMMANDS = {"demo": demo, "make-model": make_model_command}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        names = ", ".join(COMMANDS)
        print(f"usage: lmpool {{{names}}} [args...]", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
