"""Engine settings, checked once when an engine is built: each wrong type or value is a
``ValueError`` naming the setting (a wrong type also a ``TypeError``: ``ArgumentTypeError``).

Free of torch, as the whole configuration tree is: the control process decodes it and never
imports torch. Whether a device exists is checked where one is used (``ModelRunner``, and the
pool's start for its GPU count)."""

from __future__ import annotations

from dataclasses import dataclass

from lmpool.errors import ArgumentTypeError, strict_bool, strict_float, strict_int

DTYPE_NAMES = ("float32", "float16", "bfloat16")  # the engine's torch dtypes: ``model_runner.DTYPES``
PREFILL_ATTENTION = ("lmpool", "flash")  # ``EngineConfig.prefill_attention``
FLASH_BLOCK_MULTIPLE = 256  # FlashAttention 2's paged KV cache takes pages of a multiple of this
# The key reads a decode step's shared prefixes must save for it to run as a cascade, by default
# where the kernels run: on the H200, 32-48 rows over one shared 16k document decode 8x faster so.
CASCADE_MIN_SAVED_TOKENS = 65536
# The head sizes LMPool's CUDA attention kernels are compiled for: Qwen3's 128, and 64.
KERNEL_HEAD_DIMS = (64, 128)


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
    # A step that prefills (or a decode step no decode graph takes) of at most this many token
    # rows replays CUDA graphs of every layer's work but its attention
    # (``lmpool.engine.piecewise_graphs``): launched op by op from Python, a step prefilling one
    # question over a long document took 17 ms of host time on an H200 host, 5 ms so. 0: never.
    piecewise_graph_max_tokens: int = 512
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
    # A decode step whose rows share cached prefixes reads each prefix once for all of its rows
    # (cascade attention, ``lmpool.engine.cascade``) when that saves at least this many key
    # reads (with CUDA graphs, a cascade graph of its size when its groups are few). 0: never.
    # None: ``CASCADE_MIN_SAVED_TOKENS`` where LMPool's kernels run in half precision, else 0
    # (the torch reference computes a cascade row by row: it gains nothing from one); what an
    # engine plans with is ``cascade_min_saved``'s.
    cascade_min_saved_tokens: int | None = None
    # Attention of the steps that prefill, on CUDA: "lmpool" (LMPool's tensor-core kernel) or
    # "flash" (torch's FlashAttention reading the paged cache through the block tables; where
    # this torch's reads none, 2.11, or the blocks are no multiple of ``FLASH_BLOCK_MULTIPLE``, over
    # the keys gathered out of it for long prompts, LMPool's kernel for short queries; fp16 or
    # bf16). Decode always runs LMPool's kernels. None: "flash" where LMPool's kernels run in half
    # precision (on the H200 it prefills a 16k prompt in 0.56x the time), else "lmpool"; what an
    # engine runs is ``prefill_attention``'s.
    prefill_attention: str | None = None
    # LMPool's decode-path kernels start before the kernel ahead of them in the stream ends
    # (programmatic dependent launch, GPUs of compute capability 9.0 or more; elsewhere ignored):
    # each waits for that kernel's results on the device, and a linear layer's weights load
    # meanwhile (on an H100 a decode step of 1 sequence at 2,048 tokens took 0.89x the time).
    # One setting a process: the last engine built in a process sets it for all.
    dependent_launch: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ArgumentTypeError(f"model must be a checkpoint directory path (a string), got {self.model!r}")
        if not isinstance(self.device, str):
            raise ArgumentTypeError(f"device must be a string ('cpu', 'cuda' or 'cuda:N'), got {self.device!r}")
        kind = self.device.split(":")[0]
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' (optionally 'cuda:N'), got {self.device!r}")
        index = self.device.partition(":")[2]
        if ":" in self.device and (kind != "cuda" or not index.isdigit()):
            raise ValueError(f"device must be 'cpu' or 'cuda' (optionally 'cuda:N'), got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        self._check_integers()
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        attention = self.prefill_attention
        if attention is not None and attention not in PREFILL_ATTENTION:
            raise ValueError(f"prefill_attention must be one of {list(PREFILL_ATTENTION)}, got {attention!r}")
        for name in ("enable_prefix_caching", "use_kernels", "enforce_eager", "dependent_launch"):
            strict_bool(getattr(self, name), name)
        utilization = strict_float(self.gpu_memory_utilization, "gpu_memory_utilization")
        if not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def _check_integers(self) -> None:
        """Every integer setting is an int (not a bool, nor a string of digits) at least its minimum."""
        minimum = {"block_size": 1, "num_kv_blocks": 1, "max_num_seqs": 1, "max_num_batched_tokens": 1,
                   "max_model_len": 1, "cpu_kv_cache_bytes": 1, "cpu_threads": 1, "seed": None,
                   "cascade_min_saved_tokens": 0, "piecewise_graph_max_tokens": 0}
        for name, low in minimum.items():
            value = getattr(self, name)
            if value is None and name in ("num_kv_blocks", "max_model_len", "cascade_min_saved_tokens"):
                continue  # sized from memory / the model's context / the device's default
            wanted = "an integer" if low is None else f"an integer >= {low}"
            try:
                value = strict_int(value, name)
            except ArgumentTypeError:
                raise ArgumentTypeError(f"{name} must be {wanted}, got {value!r} ({type(value).__name__})") from None
            if low is not None and value < low:
                raise ValueError(f"{name} must be {wanted}, got {value!r}")
            setattr(self, name, value)


# ---- checks of the pool's settings (``lmpool.pool``), named like the engine's ----------------

# A process silent for this many of its heartbeat intervals may be hung; less than that
# and a healthy worker between two beats would be killed.
MIN_HANG_BEATS = 4


def check_world_size(value) -> int:
    world_size = strict_int(value, "world_size")
    if world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {value!r}")
    return world_size


def check_hang_timeout(value, heartbeat_interval: float) -> float | None:
    """Seconds of silence before a process is taken for hung; None turns it off."""
    if value is None:
        return None
    wanted = "hang_timeout must be a positive number of seconds, None or 'auto'"
    if isinstance(value, (bool, str)):
        raise ArgumentTypeError(f"{wanted}; got {value!r}")
    timeout = strict_float(value, "hang_timeout", finite=False)
    if timeout == float("inf"):
        raise ValueError(f"{wanted}; got inf: it must be finite (None turns hang detection off)")
    floor = MIN_HANG_BEATS * heartbeat_interval
    if not timeout >= floor:
        raise ValueError(f"{wanted}; got {value!r}: at least {floor:g} s ({MIN_HANG_BEATS} heartbeat intervals)")
    return timeout


def check_port(value, what: str) -> int | None:
    """A TCP port to listen on (0: any free one), or None for off."""
    if value is None:
        return None
    port = strict_int(value, what)
    if not 0 <= port <= 65535:
        raise ValueError(f"{what} must be a TCP port in [0, 65535] (0: any free one) or None, got {value!r}")
    return port


def piecewise_rows(engine: EngineConfig) -> int:
    """The most token rows of a step the engine's piecewise graphs take: at most a step's tokens,
    on CUDA with LMPool's kernels and CUDA graphs (not ``enforce_eager``); 0 where it captures
    none. (A model whose head size the kernels lack runs the torch ops, without graphs, too.)"""
    if engine.enforce_eager or not engine.use_kernels or engine.device.split(":")[0] != "cuda":
        return 0
    return min(engine.piecewise_graph_max_tokens, engine.max_num_batched_tokens)


def cascade_min_saved(engine: EngineConfig, dtype: str, head_dim: int) -> int:
    """The key reads a decode step's shared prefixes must save for the engine to run it as a
    cascade (0: it never does), given the engine's resolved ``dtype`` name and the model's
    ``head_dim``: the one rule the engine plans by and the control plane prices by. LMPool's
    kernels read a shared prefix on tensor cores, so in fp32 they run none; the torch
    reference computes one row by row, so it runs them only when asked."""
    kernels = _kernels_run(engine, head_dim)
    if kernels and dtype == "float32":
        return 0
    if engine.cascade_min_saved_tokens is None:
        return CASCADE_MIN_SAVED_TOKENS if kernels else 0
    return engine.cascade_min_saved_tokens


def prefill_attention(engine: EngineConfig, dtype: str, head_dim: int) -> str:
    """The attention an engine of ``engine`` prefills with, given its resolved ``dtype`` name and
    the model's ``head_dim``: the one asked for, else "flash" where LMPool's kernels run in half
    precision (FlashAttention takes no fp32) and "lmpool" elsewhere (where the torch reference
    runs, both name the same ops)."""
    if engine.prefill_attention is not None:
        return engine.prefill_attention
    return "flash" if _kernels_run(engine, head_dim) and dtype != "float32" else "lmpool"


def _kernels_run(engine: EngineConfig, head_dim: int) -> bool:
    """Whether an engine of ``engine`` runs LMPool's CUDA kernels for a model of ``head_dim``."""
    return engine.device.startswith("cuda") and engine.use_kernels and head_dim in KERNEL_HEAD_DIMS
