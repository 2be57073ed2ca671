"""Engine settings, checked once when an engine is built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str | None = None  # None: the checkpoint's dtype on CUDA, float32 on CPU
    block_size: int = 256
    num_kv_blocks: int | None = None  # None: sized from memory
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's context (``ModelConfig.max_context``)
    enable_prefix_caching: bool = True
    use_kernels: bool = True  # CUDA kernels on GPU; False forces the torch reference
    enforce_eager: bool = False  # no CUDA graphs
    gpu_memory_utilization: float = 0.9  # share of the GPU this engine may fill
    cpu_kv_cache_bytes: int = 1 << 30
    # Torch intra-op threads for a CPU engine. The engine's ops are small, and with
    # several replicas (or any other busy process) sharing few cores, OpenMP workers
    # spin against each other and a step gets tens of times slower than on one thread.
    cpu_threads: int = 1
    seed: int = 0
    # Overlapped stepping: the host schedules and launches step N+1 before reading step N's
    # tokens back (``lmpool.engine.core``); False runs each step to its end first.
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        kind = str(self.device).split(":")[0]
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' (optionally 'cuda:N'), got {self.device!r}")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool) or
                                               not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be an integer >= 1 (or None: the model's), got {self.max_model_len!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
