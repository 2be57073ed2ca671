"""Block-to-block copy between two KV caches, the data path of a pull:
``copy_blocks(src_cache, src_ids, dst_cache, dst_ids)``, one CUDA kernel
(``kernels/kv_transfer.cu``) that reads each byte once and writes it once; the source may be
another process's cache mapped through CUDA IPC, or on a peer GPU.

Invariants: both caches have ``lmpool.ops.reference``'s layout; ids are validated on the
host before any launch and again by the kernel; the copy is enqueued on the destination's
current stream and never waits, so later work there is ordered after it.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

_SOURCES = ("kv_transfer_bindings.cpp", "kv_transfer.cu")
_HEADERS = ("kv_transfer.h",)


@functools.cache
def load_extension() -> ModuleType:
    """Build (once per cache key on disk) and import the transfer kernel's extension."""
    from lmpool.ops.cuda import build_extension

    return build_extension("kv_transfer", _SOURCES, _HEADERS)


def check_blocks(src_cache: torch.Tensor, src_ids: list[int], dst_cache: torch.Tensor, dst_ids: list[int]) -> None:
    """Raise ValueError, saying what is wrong, unless the copy is well defined."""
    for name, cache in (("src_cache", src_cache), ("dst_cache", dst_cache)):
        if cache.dim() != 6 or cache.shape[1] != 2:
            raise ValueError(f"{name} must be [layers, 2, num_blocks, block_size, kv_heads, head_dim], "
                             f"got {tuple(cache.shape)}")
    if src_cache.dtype != dst_cache.dtype or [src_cache.shape[i] for i in (0, 3, 4, 5)] != [
            dst_cache.shape[i] for i in (0, 3, 4, 5)]:
        raise ValueError(f"the caches hold different KV shapes: {src_cache.dtype} {tuple(src_cache.shape)} "
                         f"vs {dst_cache.dtype} {tuple(dst_cache.shape)}")
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source block ids but {len(dst_ids)} destination block ids")
    for name, ids, limit in (("source", src_ids, src_cache.shape[2]), ("destination", dst_ids, dst_cache.shape[2])):
        bad = [b for b in ids if not 0 <= b < limit]
        if bad:
            raise ValueError(f"{name} block ids {bad[:8]} are outside [0, {limit})")
    if len(set(dst_ids)) != len(dst_ids):
        raise ValueError("destination block ids repeat: two source blocks would race for one destination block")


def copy_blocks(src_cache: torch.Tensor, src_ids: list[int], dst_cache: torch.Tensor, dst_ids: list[int],
                use_kernel: bool = True) -> None:
    """``dst_cache[:, :, dst_ids] = src_cache[:, :, src_ids]``, enqueued on the destination
    device's current stream (see the module docstring)."""
    check_blocks(src_cache, src_ids, dst_cache, dst_ids)
    if not dst_ids:
        return
    device = dst_cache.device
    block_bytes = dst_cache[0, 0, 0].nbytes
    if device.type == "cuda" and use_kernel and block_bytes % 16 == 0:  # the kernel moves 16-byte vectors
        # The ids ride in the kernel's parameters: no id tensor, no copy to the device.
        load_extension().copy_blocks(src_cache, src_ids, dst_cache, dst_ids)
        return
    # The reference: an index gather (materialised) then a scatter; correct on any device.
    gathered = src_cache[:, :, torch.tensor(src_ids, device=src_cache.device)]
    dst_cache[:, :, torch.tensor(dst_ids, device=device)] = gathered.to(device)
