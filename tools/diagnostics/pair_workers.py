"""Two worker processes of a diagnostic script, one per GPU, meeting at a shared rendezvous.

The script's module re-runs (``python -m``, from the same working directory: the repository
root) with ``--rendezvous ADDRESS --worker R`` for R in 0 and 1; each worker prints its result
as the last line of its stdout.
"""

from __future__ import annotations

import subprocess
import sys

import torch

from lmpool.model.make_model import PRESETS
from lmpool.dataplane import Rendezvous


def run_pair(module: str, argv: list[str], timeout_s: float = 600.0) -> list[str] | None:
    """Both workers' last stdout lines, or None (said on stderr) when either failed."""
    rendezvous = Rendezvous.create()
    command = [sys.executable, "-m", module, *argv, "--rendezvous", rendezvous.address]
    try:
        workers = [subprocess.Popen([*command, "--worker", str(r)], stdout=subprocess.PIPE, text=True)
                   for r in (0, 1)]
        outputs = [w.communicate(timeout=timeout_s)[0] for w in workers]
    finally:
        rendezvous.close()
    if any(w.returncode for w in workers):
        print(f"a worker failed: {[w.returncode for w in workers]}", file=sys.stderr)
        return None
    return [o.strip().splitlines()[-1] for o in outputs]


def this_end(worker: int) -> tuple[int, int, torch.device]:
    """This worker's rank, its peer's, and its GPU (made the current device)."""
    device = torch.device(f"cuda:{worker}")
    torch.cuda.set_device(device)
    return worker, 1 - worker, device


def kv_shape(preset: str) -> tuple[int, int, int]:
    """A preset's layers, KV heads and head size: the shape of its KV cache but the blocks."""
    cfg = PRESETS[preset]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], cfg["num_key_value_heads"], head_dim
