"""KV-cache operations (and the model's fused norms and projections) behind one interface,
backed by torch or by LMPool's CUDA kernels.

``get_backend(device)`` returns a ``KVOps`` whose functions all follow the layouts
documented in ``lmpool.ops.reference``. The torch reference is the CPU path and the
test oracle; on CUDA the compiled kernels (``lmpool.ops.cuda``) are used unless the
caller asks for the reference explicitly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from lmpool.config.engine import FLASH_BLOCK_MULTIPLE, KERNEL_HEAD_DIMS
from lmpool.ops import reference


@dataclass(frozen=True)
class KVOps:
    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    paged_decode_attention: Callable[..., torch.Tensor]
    cascade_decode_attention: Callable[..., torch.Tensor]
    pack_kv: Callable[..., torch.Tensor]
    unpack_kv: Callable[..., None]
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[..., torch.Tensor]
    linear: Callable[..., torch.Tensor]
    qkv_norm_rope_store: Callable[..., torch.Tensor]


TORCH_OPS = KVOps(
    name="torch",
    write_kv=reference.write_kv,
    paged_attention=reference.paged_attention,
    paged_decode_attention=reference.paged_decode_attention,
    cascade_decode_attention=reference.cascade_decode_attention,
    pack_kv=reference.pack_kv,
    unpack_kv=reference.unpack_kv,
    rms_norm=reference.rms_norm,
    add_rms_norm=reference.add_rms_norm,
    silu_mul=reference.silu_mul,
    linear=reference.linear,
    qkv_norm_rope_store=reference.qkv_norm_rope_store,
)




def get_backend(device: torch.device | str, use_kernels: bool = True, head_dim: int | None = None,
                prefill_attention: str = "lmpool", block_size: int = FLASH_BLOCK_MULTIPLE) -> KVOps:
    """The ops for tensors on ``device``: CUDA kernels on a GPU unless ``use_kernels`` is False,
    or unless the model's ``head_dim`` is one the kernels are not compiled for: such a model
    still runs, on the torch reference, with a warning that says so. ``prefill_attention``
    "flash" takes the prefill's attention from torch's FlashAttention (``EngineConfig``): reading
    the paged cache by its block tables, or, where this torch's cannot (2.11) or the cache's
    ``block_size`` is no multiple of its pages', over the keys and values gathered out of it."""
    if torch.device(device).type != "cuda" or not use_kernels:
        return TORCH_OPS
    if head_dim is not None and head_dim not in KERNEL_HEAD_DIMS:
        warnings.warn(
            f"LMPool's CUDA attention kernels take head_dim {' or '.join(map(str, KERNEL_HEAD_DIMS))}, this "
            f"model has {head_dim}: it runs on the torch reference ops instead (same results, slower, "
            "no CUDA graphs)", RuntimeWarning, stacklevel=2,
        )
        return TORCH_OPS
    from lmpool.ops import cuda  # builds the extension on first use

    if prefill_attention != "flash":
        return cuda.CUDA_OPS
    if cuda.flash_paged_unavailable() or block_size % FLASH_BLOCK_MULTIPLE:
        return cuda.FLASH_GATHER_OPS
    return cuda.FLASH_PREFILL_OPS
