"""The device time a piece of work spends in each kernel, from ``torch.profiler``.

``device_kernels(work, device, calls)`` runs ``work`` once under the profiler (CPU activity, and
CUDA's on a GPU, synchronised before and after so exactly its kernels are counted) and returns
milliseconds per call of ``calls`` by kernel name, largest first. Kernels are read from the
exported trace, which names them in every torch version. On a CPU the profiler records
operators, not kernels: the table is empty there.
"""

from __future__ import annotations

import collections
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories of device time


def device_kernels(work: Callable[[], object], device: torch.device | str, calls: int = 1) -> dict[str, float]:
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)  # earlier work still running is not this work's
    with profile(activities=activities) as prof:
        work()
        if cuda:
            torch.cuda.synchronize(device)  # exactly the kernels ``work`` launched
    kernels: dict[str, float] = collections.defaultdict(float)
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
        events = json.loads((Path(tmp) / "trace.json").read_text())["traceEvents"]
    for event in events:
        if event.get("cat") in DEVICE_WORK:
            kernels[event["name"]] += event["dur"] / 1e3 / calls
    return dict(sorted(kernels.items(), key=lambda kv: -kv[1]))


def top(kernels: dict[str, float], n: int = 12) -> list[tuple[str, float]]:
    """The ``n`` largest, then everything else as one "(the rest)" entry."""
    items = list(kernels.items())
    head, rest = items[:n], sum(ms for _, ms in items[n:])
    return head + ([("(the rest)", rest)] if rest else [])
