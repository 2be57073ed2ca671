// The boundary between the torch-facing host code of KV transfers
// (kv_transfer_bindings.cpp) and their CUDA kernel (kv_transfer.cu).
//
// Invariants the host side guarantees before calling the launcher:
// - both caches have the layout [layers, 2, num_blocks, block_size, kv_heads,
//   head_dim] (lmpool/ops/reference.py), are contiguous and 16-byte aligned,
//   and agree on everything but num_blocks;
// - the kernel runs on the destination cache's device; the source cache is on
//   that device or addressable from it (mapped there, or a peer's memory);
// - block_bytes (one block of one layer's K or V) is a multiple of 16;
// - at most kMaxPairs pairs per launch: the ids travel inside the kernel's
//   parameters, so a copy needs no id tensor, no host-to-device copy of them.
// The launcher only enqueues work on `stream`; it never synchronizes.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace lmpool {

// 2 x 480 int32 ids keep the parameters under the 4 KiB every CUDA version accepts.
constexpr int kMaxPairs = 480;

struct BlockPairs {
  int32_t src[kMaxPairs];
  int32_t dst[kMaxPairs];
};

struct CopyBlocksArgs {
  const void* src_cache;  // [planes = layers * 2, src_num_blocks, block_bytes]
  void* dst_cache;        // [planes, dst_num_blocks, block_bytes]
  int64_t planes;
  int64_t src_num_blocks;
  int64_t dst_num_blocks;
  int64_t num_ids;        // pairs used in `pairs`, <= kMaxPairs
  int64_t block_bytes;
};

// For every plane p and pair i: dst[p, pairs.dst[i]] = src[p, pairs.src[i]]. A
// pair with either id out of range is skipped (nothing read, nothing written).
cudaError_t launch_copy_blocks(const CopyBlocksArgs& args, const BlockPairs& pairs, cudaStream_t stream);

// CTAs a launch uses: the host checks this fits a 1-D grid before launching.
int64_t copy_blocks_ctas(const CopyBlocksArgs& args);

}  // namespace lmpool
