"""Where the time of one pull goes (diagnostic, one GPU, one process): the host cost of each
step of ``CudaIpcTransport.pull`` and the kernel's own time, per block count.

    python -m tools.diagnostics.profile_pull --preset 0.6b --sizes 1,8,64 --json pull_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from lmpool.model.make_model import PRESETS
from lmpool.dataplane.block_copy import check_blocks, copy_blocks, load_extension
from lmpool.dataplane.cuda_ipc import process_start

REPS = 30


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def timed(fn, reps: int = REPS) -> float:
    samples = []
    for _ in range(reps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return median(samples[3:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="0.6b", choices=sorted(PRESETS))
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--sizes", default="1,8,64")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cfg = PRESETS[args.preset]
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    sizes = [int(s) for s in args.sizes.split(",")]
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    blocks = 2 * max(sizes)
    src = torch.randn(layers, 2, blocks, args.block_size, kv_heads, head_dim, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ext = load_extension()
    out = {}
    for n in sizes:
        src_ids = list(range(0, 2 * n, 2))
        dst_ids = list(range(1, 2 * n, 2))
        ids = torch.tensor([src_ids, dst_ids], dtype=torch.int32, device=device)
        row: dict[str, float] = {}
        row["check_blocks_s"] = timed(lambda: check_blocks(src, src_ids, dst, dst_ids))
        row["ids_to_device_s"] = timed(
            lambda: torch.tensor([src_ids, dst_ids], dtype=torch.int32).pin_memory().to(device, non_blocking=True))
        row["event_record_s"] = timed(lambda: torch.cuda.Event().record())
        row["process_start_s"] = timed(lambda: process_start(os.getpid()))
        row["kernel_call_host_s"] = timed(lambda: ext.copy_blocks(src, ids[0], dst, ids[1]))
        row["copy_blocks_host_s"] = timed(lambda: copy_blocks(src, src_ids, dst, dst_ids))
        # The kernel itself, by CUDA events around the launch.
        kernel = []
        for _ in range(REPS + 3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            ext.copy_blocks(src, ids[0], dst, ids[1])
            b.record()
            b.synchronize()
            kernel.append(a.elapsed_time(b) / 1e3)
        row["kernel_gpu_s"] = median(kernel[3:])
        nbytes = src[:, :, :n].nbytes
        flat_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        flat_dst = torch.empty_like(flat_src)
        copy = []
        for _ in range(REPS + 3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            flat_dst.copy_(flat_src)
            b.record()
            b.synchronize()
            copy.append(a.elapsed_time(b) / 1e3)
        row["copy_gpu_s"] = median(copy[3:])
        del flat_src, flat_dst

        def whole() -> None:  # what the benchmark's pull path times, minus IPC
            copy_blocks(src, src_ids, dst, dst_ids)
            done = torch.cuda.Event()
            done.record()
            while not done.query():
                pass
        row["whole_host_s"] = timed(whole)
        row["bytes"] = nbytes
        out[str(n)] = row
        print(n, " ".join(f"{k}={v * 1e6:.1f}us" if k.endswith("_s") else f"{k}={v}" for k, v in row.items()),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "block_size": args.block_size, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
