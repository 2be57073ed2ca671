"""LMPool's CUDA kernels behind the ``KVOps`` interface, built from ``kernels/`` on first use.

Owns: finding the kernel sources, compiling them once per (sources, torch, CUDA,
GPU architecture) into a cached build directory, and the thin wrappers that give
each kernel exactly the signature of its reference in ``lmpool.ops.reference``.
``build_extension`` is the one loader of every extension under ``kernels/`` (the
KV-transfer kernel's too).

Invariants:
- Importing this module never compiles anything and works without a GPU; the
  first kernel call builds (or loads the cached build of) the extension, and
  raises a ``RuntimeError`` naming what is missing when it cannot.
- No wrapper reads device memory from the host or synchronizes, so the engine
  can capture them in CUDA graphs. Index tensors that are not int32 are
  converted on the device; inputs whose dtype differs from the cache's are cast
  to it, as the reference does.
- The build directory name hashes everything that changes the binary, so a
  stale build is never loaded and concurrent processes share one build (torch
  serializes builders with a lock file in that directory).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import os
import subprocess
from pathlib import Path
from types import ModuleType

import torch

from lmpool.ops import KVOps, dense_attention, reference

_SOURCES = (
    "bindings.cpp",
    "attention_rows_f32.cu",
    "attention_rows_f16.cu",
    "attention_rows_bf16.cu",
    "prefill_mma_f16.cu",
    "prefill_mma_bf16.cu",
    "kv_cache.cu",
    "norm_rope.cu",
    "silu_mul.cu",
    "skinny_linear.cu",
)
_HEADERS = ("launchers.h", "common.cuh", "combine_splits.cuh", "attention_rows.cuh", "prefill_mma.cuh")
_CUDA_FLAGS = ("-O3", "-lineinfo")
_CXX_FLAGS = ("-O3",)
CACHE_ENV = "LMPOOL_KERNEL_CACHE"


def kernel_source_dir() -> Path:
    """The folder holding the kernel sources.

    Installed, they are the data package ``lmpool_kernels``; in a source tree
    that is not installed (``PYTHONPATH`` pointing at the checkout) they are the
    ``kernels/`` folder beside the ``lmpool/`` package. ``lmpool_kernels`` is a
    namespace package (no ``__init__.py``, so that the checkout's ``kernels/``
    never shadows the Hugging Face ``kernels`` package transformers imports):
    its folders are its spec's search locations, not ``importlib.resources``,
    which cannot read an editable install's namespace path.
    """
    spec = importlib.util.find_spec("lmpool_kernels")
    locations = spec.submodule_search_locations if spec is not None else None
    candidates = [Path(folder) for folder in locations or ()]
    candidates.append(Path(__file__).resolve().parents[2] / "kernels")
    for folder in candidates:
        if all((folder / name).is_file() for name in _SOURCES + _HEADERS):
            return folder
    raise RuntimeError(
        "LMPool's CUDA kernel sources were not found; looked in "
        + ", ".join(str(c) for c in candidates)
        + f" for {', '.join(_SOURCES)}. Reinstall lmpool (pip install -e .) from a full checkout."
    )


def arch_flags(capability: tuple[int, int]) -> list[str]:
    """nvcc targets: machine code for this GPU (sm_90a on Hopper) plus compute_80 PTX.

    The PTX lets the driver compile the kernels for any later GPU (they need
    sm_80 for bf16 and cp.async); the machine code avoids that JIT on this one.
    """
    major, minor = capability
    if (major, minor) == (9, 0):
        native = "-gencode=arch=compute_90a,code=sm_90a"
    else:
        native = f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"
    return [native, "-gencode=arch=compute_80,code=compute_80"]


def _require_toolchain() -> str:
    """Check that a build can run here; returns the nvcc path or raises a RuntimeError."""
    if torch.version.cuda is None:
        raise RuntimeError(
            f"LMPool's CUDA kernels need a CUDA build of torch, but torch {torch.__version__} "
            "is a CPU-only build. Install a CUDA wheel of torch on a GPU machine, or use the "
            "torch reference ops: lmpool.ops.get_backend(device, use_kernels=False)."
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"LMPool's CUDA kernels need a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda}). Check the NVIDIA driver "
            "and CUDA_VISIBLE_DEVICES, or use the torch reference ops: "
            "lmpool.ops.get_backend(device, use_kernels=False)."
        )
    from torch.utils import cpp_extension

    cuda_home = cpp_extension.CUDA_HOME
    nvcc = Path(cuda_home, "bin", "nvcc") if cuda_home else None
    if nvcc is None or not nvcc.is_file():
        raise RuntimeError(
            "LMPool compiles its CUDA kernels on first use, but nvcc was not found "
            f"(CUDA_HOME={cuda_home!r}). Install the CUDA toolkit {torch.version.cuda} "
            "and set CUDA_HOME to it (or put its bin/ on PATH)."
        )
    if not cpp_extension.is_ninja_available():
        raise RuntimeError(
            "LMPool compiles its CUDA kernels with torch.utils.cpp_extension, which needs "
            "ninja: pip install ninja."
        )
    return str(nvcc)


def _build_dir(source_dir: Path, files: tuple[str, ...], flags: list[str], nvcc: str) -> tuple[Path, str]:
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode())
        digest.update((source_dir / name).read_bytes())
    nvcc_version = subprocess.run(
        [nvcc, "--version"], capture_output=True, text=True, check=False
    ).stdout
    for part in (torch.__version__, str(torch.version.cuda), nvcc_version, *flags):
        digest.update(part.encode())
    key = digest.hexdigest()[:16]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lmpool" / "kernels")
    return root / key, key


def build_extension(tag: str, sources: tuple[str, ...], headers: tuple[str, ...]) -> ModuleType:
    """Build (once per cache key on disk) and import the extension ``lmpool_{tag}_{key}`` made of
    ``sources`` (and ``headers``) of ``kernel_source_dir()``.

    The key hashes the files' names and contents, torch, CUDA, nvcc and the flags, so
    distinct extensions never share a build directory. Callers cache the module.
    """
    nvcc = _require_toolchain()
    from torch.utils import cpp_extension

    source_dir = kernel_source_dir()
    missing = [n for n in sources + headers if not (source_dir / n).is_file()]
    if missing:
        raise RuntimeError(f"LMPool's {tag} kernel sources are missing from {source_dir}: {', '.join(missing)}")
    archs = arch_flags(torch.cuda.get_device_capability())
    cuda_flags = [*_CUDA_FLAGS, *archs]
    build_dir, key = _build_dir(source_dir, sources + headers, cuda_flags + list(_CXX_FLAGS), nvcc)
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=f"lmpool_{tag}_{key}",
        sources=[str(source_dir / name) for name in sources],
        extra_cflags=list(_CXX_FLAGS),
        extra_cuda_cflags=cuda_flags,
        extra_include_paths=[str(source_dir)],
        build_directory=str(build_dir),
        verbose=os.environ.get("LMPOOL_KERNEL_VERBOSE") == "1",
    )


@functools.cache
def load_extension() -> ModuleType:
    """The engine's kernels, built once per process (every kernel call asks for it)."""
    return build_extension("cuda", _SOURCES, _HEADERS)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` rows ``[T, kv_heads, head_dim]`` at their slots; skip slot -1."""
    load_extension().write_kv(
        key.to(k_cache.dtype), value.to(v_cache.dtype), k_cache, v_cache, slot_mapping
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    key_starts: torch.Tensor | None = None,
    max_query_len: int = 0,
    max_context_len: int = 0,
    key_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ragged new queries over their sequences' paged KV (the last four
    arguments are the FlashAttention paths', unused here)."""
    return load_extension().paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        _int32(block_tables),
        _int32(context_lens),
        _int32(query_start_loc),
        float(scale),
    )


def flash_paged_unavailable() -> str | None:
    """None where this torch's FlashAttention reads a paged KV cache through block tables, else
    why not (its ``aten._flash_attention_forward`` gained ``block_table`` after torch 2.11)."""
    schema = str(torch.ops.aten._flash_attention_forward.default._schema)
    if "block_table" in schema:
        return None
    return (f"torch {torch.__version__}'s FlashAttention reads no block tables (aten._flash_attention_forward "
            f"has no block_table): prefill_attention 'flash' reads the keys gathered out of the paged cache")


def flash_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    key_starts: torch.Tensor | None = None,
    max_query_len: int = 0,
    max_context_len: int = 0,
    key_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_attention`` through torch's FlashAttention reading the paged cache by the block
    tables (``aten._flash_attention_forward``, as ``torch.nn.attention.varlen.varlen_attn`` calls
    it): its causal mask is aligned bottom right, as a sequence's new tokens end its context.
    Needs ``key_starts`` and the longest query and context (launch sizes read on the host), blocks
    of a multiple of 256 tokens, and fp16 or bf16."""
    if key_starts is None or max_query_len < 1 or max_context_len < 1:
        raise ValueError("flash_paged_attention needs key_starts, max_query_len and max_context_len")
    return torch.ops.aten._flash_attention_forward(
        q, k_cache, v_cache, _int32(query_start_loc), _int32(key_starts), int(max_query_len), int(max_context_len),
        0.0, True, return_debug_mask=False, scale=float(scale), seqused_k=_int32(context_lens),
        block_table=_int32(block_tables),
    )[0]


def flash_gathered_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    key_starts: torch.Tensor | None = None,
    max_query_len: int = 0,
    max_context_len: int = 0,
    key_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_attention`` through torch's FlashAttention (varlen) over each context's keys and
    values gathered out of the paged cache, for a torch whose FlashAttention reads no block tables
    (2.11). ``key_slots`` lists every context's slots, context after context: a step lists them
    where its queries are long enough to pay for the copy (``StepInputBuilder``), and where it
    lists none this is LMPool's kernel (a burst's short questions over a long document, which
    its split kernel spreads over the GPU). The copy reads and writes each key and value once a
    layer; the attention then reads them ``ceil(query / 128)`` times, at FlashAttention's rate.
    A step of one sequence (a long prompt's chunk) runs torch's dense attention instead where it
    is usable (``dense_attention``: cuDNN's on Hopper, twice the varlen rate on long prompts)."""
    if key_slots is None:
        return paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)
    if key_starts is None or max_query_len < 1 or max_context_len < 1:
        raise ValueError("flash_gathered_attention needs key_starts, max_query_len and max_context_len")
    k, v = reference.gather_slots(k_cache, key_slots), reference.gather_slots(v_cache, key_slots)
    if query_start_loc.shape[0] == 2 and dense_attention.usable(q.device):  # shapes: read without a sync
        return dense_attention.one_sequence_attention(q, k, v, scale)
    return torch.ops.aten._flash_attention_forward(
        q, k, v, _int32(query_start_loc), _int32(key_starts), int(max_query_len), int(max_context_len),
        0.0, True, return_debug_mask=False, scale=float(scale),
    )[0]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One new query per sequence: ``q[batch, q_heads, head_dim]``."""
    return load_extension().paged_decode_attention(
        q, k_cache, v_cache, _int32(block_tables), _int32(context_lens), float(scale)
    )


def cascade_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    kv_start: torch.Tensor,
    prefix_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    prefix_starts: torch.Tensor,
    prefix_rows: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode with groups of rows reading their shared cached prefix once (``reference.cascade_decode_attention``).
    The prefix pass runs on tensor cores: fp32 decodes every row's whole context instead (the same
    result), as it would without a cascade."""
    if q.dtype == torch.float32:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    return load_extension().cascade_decode_attention(
        q, k_cache, v_cache, _int32(block_tables), _int32(context_lens), _int32(kv_start), _int32(prefix_tables),
        _int32(prefix_lens), _int32(prefix_starts), _int32(prefix_rows), float(scale),
    )


def pack_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, max_ctas: int = 0,
            keep_payload: bool = False) -> torch.Tensor:
    """Gather blocks of every layer into one ``[layers, 2, B, block_size, kv_heads, head_dim]``.
    ``max_ctas`` > 0 caps the kernel's grid, leaving SMs to kernels that run beside it. The
    payload is stored with evict-first hints (it is read once, later) unless ``keep_payload``:
    plain stores, so that a reader right after (a send) may find it in L2. Side by side in the
    packed NCCL transfer on the H200 pair, plain stores read level with the hints or below
    (-2.9 to +2.3 points of raw NCCL from 252 MiB, results/h200x2/direct/ runs 29-30), so the
    transfer keeps the hints."""
    return load_extension().pack_kv(kv_cache, block_ids, max_ctas, keep_payload)


def unpack_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, payload: torch.Tensor, max_ctas: int = 0) -> None:
    """Scatter a packed payload into ``block_ids`` of every layer (inverse of ``pack_kv``)."""
    if payload.shape[2] != block_ids.numel():
        raise ValueError(
            f"payload holds {payload.shape[2]} blocks but {block_ids.numel()} block ids were given"
        )
    load_extension().unpack_kv(kv_cache, block_ids, payload.to(kv_cache.dtype), max_ctas)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x[..., dim]`` in one kernel (``reference.rms_norm``'s roundings)."""
    flat = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return load_extension().rms_norm(flat, weight, float(eps)).view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.add_rms_norm`` in one kernel: (RMSNorm of ``x + residual``, the sum)."""
    shape = x.shape
    out, total = load_extension().add_rms_norm(x.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1]), weight,
                                               float(eps))
    return out.view(shape), total.view(shape)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``reference.linear``; a decode step's few rows (fp16 or bf16, 1-8) read each weight once in
    one kernel (``kernels/skinny_linear.cu``: the skinny kernel at 1-2 rows, its tensor-core kernel
    at 3-8), where cuBLAS's tiles read them at a fraction of the bandwidth; other shapes go to
    cuBLAS."""
    if x.dim() == 2:
        return load_extension().linear(x, weight)
    return load_extension().linear(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``reference.silu_mul`` in one kernel."""
    shape = gate_up.shape
    return load_extension().silu_mul(gate_up.reshape(-1, shape[-1])).view(*shape[:-1], shape[-1] // 2)


def qkv_norm_rope_store(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                        cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, heads: int) -> torch.Tensor:
    """``reference.qkv_norm_rope_store`` in one kernel."""
    return load_extension().qkv_norm_rope_store(qkv, q_weight, k_weight, float(eps), cos, sin, positions, k_cache,
                                                v_cache, slot_mapping, int(heads))


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm then rotary embedding of ``x[tokens, heads, head_dim]`` in one kernel."""
    return load_extension().qk_norm_rope(x, weight, float(eps), cos, sin, positions)


CUDA_OPS = KVOps(
    name="cuda",
    write_kv=write_kv,
    paged_attention=paged_attention,
    paged_decode_attention=paged_decode_attention,
    cascade_decode_attention=cascade_decode_attention,
    pack_kv=pack_kv,
    unpack_kv=unpack_kv,
    rms_norm=rms_norm,
    add_rms_norm=add_rms_norm,
    silu_mul=silu_mul,
    linear=linear,
    qkv_norm_rope_store=qkv_norm_rope_store,
)
# Prefill attention through torch's FlashAttention (``EngineConfig.prefill_attention``).
FLASH_PREFILL_OPS = dataclasses.replace(CUDA_OPS, name="cuda+flash", paged_attention=flash_paged_attention)
# ... where this torch's FlashAttention reads no block tables: over the keys gathered.
FLASH_GATHER_OPS = dataclasses.replace(CUDA_OPS, name="cuda+flash-gather", paged_attention=flash_gathered_attention)
