"""How fast an engine prefills one long prompt, against the GPU's tensor-core rate.

A case is NEW prompt tokens after CACHED cached ones. Its CACHED tokens are read once (then
found in the prefix cache), and ``reps`` prompts sharing them, each with NEW fresh tokens, are
timed from submission to their one output token: the prefill of NEW tokens. Its FLOPs are every
linear layer's ``2 * in * out`` a token (the language-model head once, for the sampled row) and
attention's ``4 * q_heads * head_dim`` a causal (query, key) pair (QK^T and PV), over the
layers. Reported: TFLOP/s over the median time, as a fraction of a large matmul's rate measured
in the same process (this process's share of the GPU, under MPS too) and of the spec peak of
this process's share of the SMs, where the device is known. With ``kernels``, one more prompt of
the case runs under ``torch.profiler``: its device time by kernel (``lib.kernel_table``), the
largest first, the per-kernel table beside the rate.
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from benchmarks.lib.kernel_table import device_kernels, top
from lmpool import LLM, SamplingParams
from lmpool.model.config import ModelConfig
from lmpool.protocol.base import attention_pairs

# Dense bf16/fp16 tensor-core peak FLOP/s and SM count, by device name (the vendor's figures).
SPEC_PEAK = {"NVIDIA H200": (989.4e12, 132), "NVIDIA H100 80GB HBM3": (989.4e12, 132)}


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``"16384,8192:8192"`` -> [(16384, 0), (8192, 8192)]: NEW[:CACHED] prompt tokens."""
    cases = []
    for item in text.split(","):
        new, _, cached = item.strip().partition(":")
        case = (int(new), int(cached or 0))
        if case[0] < 1 or case[1] < 0:
            raise ValueError(f"a prefill case is NEW[:CACHED] with NEW >= 1 and CACHED >= 0, got {item!r}")
        cases.append(case)
    return cases


def prefill_flops(config: ModelConfig, new: int, cached: int) -> float:
    """FLOPs of computing ``new`` prompt tokens after ``cached`` cached ones (one sampled row)."""
    hidden, inter, head = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    per_token = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter  # qkv, o, gate/up/down
    layers, head_row = config.num_hidden_layers, 2.0 * hidden * config.vocab_size
    attention = 4.0 * config.num_attention_heads * head * attention_pairs(new, cached)
    return layers * (2.0 * per_token * new + attention) + head_row


def matmul_rate(device: str, dtype: torch.dtype, n: int = 8192) -> float:
    """FLOP/s of an ``n``-cube matmul on ``device`` (CUDA only), median of a few timed ones."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2.0 * n**3 / statistics.median(times[1:])


def measure(llm: LLM, cases: list[tuple[int, int]], reps: int, seed: int = 0, kernels: bool = False) -> list[dict]:
    """Each case's prefill, timed ``reps`` times, and with ``kernels`` profiled once more (see
    the module docstring)."""
    config = llm.engine.model_config
    device = llm.config.device
    rng = random.Random(seed)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    cuda = device.startswith("cuda")
    rate = matmul_rate(device, llm.engine.runner.dtype) if cuda else None
    spec = None
    if cuda:
        props = torch.cuda.get_device_properties(torch.device(device))
        peak = SPEC_PEAK.get(props.name)
        if peak is not None:
            spec = peak[0] * props.multi_processor_count / peak[1]
    rows = []
    for new, cached in cases:
        prefix = [rng.randrange(config.vocab_size) for _ in range(cached)]
        if prefix:
            llm.generate([prefix], one)  # cached from now on
        seconds = []
        for _ in range(reps):
            prompt = prefix + [rng.randrange(config.vocab_size) for _ in range(new)]
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = llm.generate([prompt], one)[0]
            seconds.append(time.perf_counter() - start)
            if out.num_cached_tokens < cached // llm.config.block_size * llm.config.block_size:
                raise RuntimeError(f"the {cached}-token prefix was not found cached ({out.num_cached_tokens})")
        median = statistics.median(seconds)
        flops = prefill_flops(config, new, cached)
        row = {"new_tokens": new, "cached_tokens": cached, "reps": reps, "seconds": seconds, "median_s": median,
               "tflops": flops / median / 1e12}
        if rate is not None:
            row["matmul_tflops"] = rate / 1e12
            row["fraction_of_matmul"] = flops / median / rate
        if spec is not None:
            row["spec_tflops_of_share"] = spec / 1e12
            row["fraction_of_spec"] = flops / median / spec
        if kernels:
            prompt = prefix + [rng.randrange(config.vocab_size) for _ in range(new)]
            table = device_kernels(lambda: llm.generate([prompt], one), device)
            row["kernels_ms"] = [[name, round(ms, 4)] for name, ms in top(table)]
        rows.append(row)
    return rows


def describe(row: dict) -> str:
    text = (f"prefill {row['new_tokens']} after {row['cached_tokens']} cached: {row['median_s'] * 1e3:.1f} ms, "
            f"{row['tflops']:.1f} TFLOP/s")
    if "fraction_of_matmul" in row:
        text += f", {row['fraction_of_matmul']:.1%} of the matmul rate ({row['matmul_tflops']:.0f})"
    if "fraction_of_spec" in row:
        text += f", {row['fraction_of_spec']:.1%} of the spec peak of this share ({row['spec_tflops_of_share']:.0f})"
    for name, ms in row.get("kernels_ms", []):
        text += f"\n    {ms:9.3f} ms  {name[:100]}"
    return text
