"""What the KV-transfer benchmark's two paths share (``benchmark_kv_transfer`` measures the
data paths, ``kv_transfer_pool`` the pool's): the KV block's shape, the percentile both
report, and the machine a run records. Here, not in the runner, so the pool path need not
import the runner that imports it."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from benchmarks.lib.revision import git_record
from lmpool.model.make_model import PRESETS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shape(args) -> dict:
    preset = PRESETS[args.preset]
    layers, kv_heads, head_dim = preset["num_hidden_layers"], preset["num_key_value_heads"], preset["head_dim"]
    element = torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    return {
        "preset": args.preset, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
        "block_size": args.block_size, "dtype": args.dtype,
        "kv_bytes_per_block": layers * 2 * args.block_size * kv_heads * head_dim * element,
    }


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(round(q * (len(sorted_values) - 1))))]


def environment(args) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "os": platform.platform(),
           "cpus": os.cpu_count(), "device": args.device, "git": git_record(),
           "worker_cpus": [sorted(c) for c in args.cpus] if args.cpus else None}
    try:
        model = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name"))
        env["cpu"] = model.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        pass
    if args.kind != "gloo" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        if args.kind == "nccl" and torch.cuda.device_count() > 1:
            env["peer_access_0_1"] = torch.cuda.can_device_access_peer(0, 1)
            version = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
            env["NCCL_NVLS_ENABLE"] = os.environ.get("NCCL_NVLS_ENABLE", "0")
    return env
