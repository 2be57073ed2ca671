// Block-to-block copy between two KV caches: the data path of a transfer whose
// destination can address the source's cache (CUDA IPC on one GPU, or a peer
// GPU's memory over NVLink). Each byte is read once from the source cache and
// written once into the destination cache; no packed payload is materialised.
//
// Invariants: dtype-agnostic and byte-exact (both caches share one dtype);
// ids come in the kernel's parameters (read through the constant cache, the
// same id for the whole CTA) and are bounds-checked on the device too, so a bad
// id skips its block instead of touching memory outside either cache.
#include "kv_transfer.h"

namespace lmpool {
namespace {

// CTA `w` copies tile w % tiles of (plane, pair) w / tiles, like pack/unpack in
// kv_cache.cu. Every thread issues all its loads before its stores, so
// kUnroll 16-byte loads per thread are in flight: that is what hides the
// latency of reads that cross NVLink to a peer GPU.
constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kTile = kThreads * kUnroll;  // 16-byte vectors per CTA

__global__ void __launch_bounds__(kThreads)
    copy_blocks_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                       const __grid_constant__ BlockPairs pairs, int64_t src_num_blocks,
                       int64_t dst_num_blocks, int64_t num_ids, int64_t block_vecs, int64_t tiles) {
  const int64_t work = blockIdx.x;
  const int64_t tile = work % tiles;
  const int64_t pair = work / tiles;  // plane * num_ids + i
  const int64_t plane = pair / num_ids;
  const int64_t i = pair % num_ids;
  const int64_t s = pairs.src[i];
  const int64_t d = pairs.dst[i];
  if (s < 0 || s >= src_num_blocks || d < 0 || d >= dst_num_blocks) return;
  const uint4* from = src + (plane * src_num_blocks + s) * block_vecs;
  uint4* to = dst + (plane * dst_num_blocks + d) * block_vecs;
  const int64_t first = tile * kTile + threadIdx.x;

  uint4 r[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = first + u * kThreads;
    // Streaming hints: the source bytes are not reused by this kernel.
    if (v < block_vecs) r[u] = __ldcs(from + v);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = first + u * kThreads;
    if (v < block_vecs) __stcs(to + v, r[u]);
  }
}

}  // namespace

int64_t copy_blocks_ctas(const CopyBlocksArgs& a) {
  const int64_t tiles = (a.block_bytes / 16 + kTile - 1) / kTile;
  return a.planes * a.num_ids * tiles;
}

cudaError_t launch_copy_blocks(const CopyBlocksArgs& a, const BlockPairs& pairs, cudaStream_t stream) {
  if (a.num_ids == 0 || a.planes == 0) return cudaSuccess;
  if (a.num_ids > kMaxPairs) return cudaErrorInvalidValue;  // the host splits larger copies
  const int64_t block_vecs = a.block_bytes / 16;
  const int64_t tiles = (block_vecs + kTile - 1) / kTile;
  const int64_t ctas = copy_blocks_ctas(a);
  if (ctas > 0x7fffffffLL) return cudaErrorInvalidConfiguration;  // the host checks this first
  copy_blocks_kernel<<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(
      static_cast<const uint4*>(a.src_cache), static_cast<uint4*>(a.dst_cache), pairs,
      a.src_num_blocks, a.dst_num_blocks, a.num_ids, block_vecs, tiles);
  return cudaGetLastError();
}

}  // namespace lmpool
