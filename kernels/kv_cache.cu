// KV-cache data movement: writing new tokens' K/V at their slots, and packing
// (gather) / unpacking (scatter) whole blocks of every layer for transfers.
//
// Invariants: copies are byte-exact (the host converts dtypes beforehand), so
// these kernels are dtype-agnostic. Indices come from device tensors and are
// bounds-checked on the device: a slot or block id out of range is skipped
// (pack reads it as zeros) instead of corrupting memory, and nothing here ever
// waits on the host, so every launch can be captured in a CUDA graph.
#include "common.cuh"
#include "launchers.h"

namespace lmpool {

// ---------------------------------------------------------------------------
// write_kv: one CTA per token; a thread copies one 16-byte (or one-element)
// piece of the token's K row and the matching piece of its V row.

constexpr int kWriteThreads = 128;

template <typename Idx, typename Piece>
__global__ void __launch_bounds__(kWriteThreads) write_kv_kernel(const WriteKVArgs a) {
  const int token = blockIdx.x;
  const int64_t slot = static_cast<const Idx*>(a.slot_mapping)[token];
  if (slot < 0 || slot >= a.num_slots) return;  // -1 marks padding

  // Elements per piece; the host guarantees every stride is a multiple of it.
  const int per_piece = static_cast<int>(sizeof(Piece)) / a.elem_size;
  const int pieces_per_head = a.head_dim / per_piece;
  const int pieces = a.kv_heads * pieces_per_head;
  const int64_t cache_row = slot * pieces;  // a slot's row is kv_heads * head_dim contiguous
  const Piece* key = static_cast<const Piece*>(a.key);
  const Piece* value = static_cast<const Piece*>(a.value);
  Piece* k_cache = static_cast<Piece*>(a.k_cache);
  Piece* v_cache = static_cast<Piece*>(a.v_cache);
  for (int p = threadIdx.x; p < pieces; p += kWriteThreads) {
    const int head = p / pieces_per_head, i = p % pieces_per_head;
    const int64_t k_src = (token * a.key_row_stride + head * a.key_head_stride) / per_piece + i;
    const int64_t v_src =
        (token * a.value_row_stride + head * a.value_head_stride) / per_piece + i;
    k_cache[cache_row + p] = key[k_src];
    v_cache[cache_row + p] = value[v_src];
  }
}

template <typename Idx>
cudaError_t launch_write_kv_idx(const WriteKVArgs& a, cudaStream_t stream) {
  if (a.vectorized)
    write_kv_kernel<Idx, uint4><<<a.num_tokens, kWriteThreads, 0, stream>>>(a);
  else if (a.elem_size == 4)
    write_kv_kernel<Idx, uint32_t><<<a.num_tokens, kWriteThreads, 0, stream>>>(a);
  else
    write_kv_kernel<Idx, uint16_t><<<a.num_tokens, kWriteThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_write_kv(const WriteKVArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  return a.slots_int64 ? launch_write_kv_idx<int64_t>(a, stream)
                       : launch_write_kv_idx<int32_t>(a, stream);
}

// ---------------------------------------------------------------------------
// pack / unpack: the cache is viewed as [planes, num_blocks, block_vecs] and the
// payload as [planes, num_ids, block_vecs] of 16-byte vectors (planes = layers
// x {K, V}). One launch covers every plane and block: work item `w` is tile
// w % tiles of (plane, id) pair w / tiles, and CTA b takes items b, b + grid, ...
// (one item each unless `max_ctas` caps the grid, which leaves SMs free for a
// transfer's NCCL kernels running beside a pack or unpack). Each thread issues
// all its loads before its stores so kUnroll 16-byte loads are in flight per thread.

constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;
constexpr int kCopyTile = kCopyThreads * kCopyUnroll;  // vectors per CTA

// kKeep (pack only): the payload is stored without the evict-first hint (keep_payload).
template <typename Idx, bool kPack, bool kKeep>
__global__ void __launch_bounds__(kCopyThreads)
    block_copy_kernel(uint4* __restrict__ cache, uint4* __restrict__ payload,
                      const Idx* __restrict__ ids, int64_t num_blocks, int64_t num_ids,
                      int64_t block_vecs, int64_t tiles, int64_t items) {
  for (int64_t work = blockIdx.x; work < items; work += gridDim.x) {
    const int64_t tile = work % tiles;
    const int64_t pair = work / tiles;  // plane * num_ids + i
    const int64_t plane = pair / num_ids;
    const int64_t id = static_cast<int64_t>(ids[pair % num_ids]);
    const bool in_range = id >= 0 && id < num_blocks;
    uint4* cache_block = cache + (plane * num_blocks + (in_range ? id : 0)) * block_vecs;
    uint4* payload_block = payload + pair * block_vecs;
    const int64_t first = tile * kCopyTile + threadIdx.x;

    if (kPack) {
      uint4 r[kCopyUnroll];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int64_t v = first + u * kCopyThreads;
        // Streaming hints: the copied bytes are not reused, so keep them out of L2's way.
        r[u] = (in_range && v < block_vecs) ? __ldcs(cache_block + v) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int64_t v = first + u * kCopyThreads;
        if (v < block_vecs) {
          if (kKeep) payload_block[v] = r[u];
          else __stcs(payload_block + v, r[u]);
        }
      }
    } else {
      if (!in_range) continue;
      uint4 r[kCopyUnroll];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int64_t v = first + u * kCopyThreads;
        if (v < block_vecs) r[u] = __ldcs(payload_block + v);
      }
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int64_t v = first + u * kCopyThreads;
        if (v < block_vecs) __stcs(cache_block + v, r[u]);
      }
    }
  }
}

template <bool kPack, bool kKeep>
cudaError_t launch_block_copy(const BlockCopyArgs& a, cudaStream_t stream) {
  if (a.num_ids == 0 || a.planes == 0) return cudaSuccess;
  const int64_t block_vecs = a.block_bytes / 16;
  const int64_t tiles = (block_vecs + kCopyTile - 1) / kCopyTile;
  const int64_t items = a.planes * a.num_ids * tiles;
  if (items > 0x7fffffffLL) return cudaErrorInvalidConfiguration;  // the host checks this first
  const int64_t ctas = a.max_ctas > 0 && a.max_ctas < items ? a.max_ctas : items;
  uint4* cache = static_cast<uint4*>(a.kv_cache);
  uint4* payload = static_cast<uint4*>(a.payload);
  if (a.ids_int64)
    block_copy_kernel<int64_t, kPack, kKeep><<<static_cast<unsigned>(ctas), kCopyThreads, 0, stream>>>(
        cache, payload, static_cast<const int64_t*>(a.block_ids), a.num_blocks, a.num_ids,
        block_vecs, tiles, items);
  else
    block_copy_kernel<int32_t, kPack, kKeep><<<static_cast<unsigned>(ctas), kCopyThreads, 0, stream>>>(
        cache, payload, static_cast<const int32_t*>(a.block_ids), a.num_blocks, a.num_ids,
        block_vecs, tiles, items);
  return cudaGetLastError();
}

cudaError_t launch_pack_kv(const BlockCopyArgs& a, cudaStream_t stream) {
  return a.keep_payload ? launch_block_copy<true, true>(a, stream) : launch_block_copy<true, false>(a, stream);
}

cudaError_t launch_unpack_kv(const BlockCopyArgs& a, cudaStream_t stream) {
  return launch_block_copy<false, false>(a, stream);
}

}  // namespace lmpool
