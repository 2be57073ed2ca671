// The boundary between the torch-facing host code of KV transfers
// (kv_transfer_bindings.cpp) and their CUDA kernel (kv_transfer.cu).
//
// Invariants the host side guarantees before calling the launcher:
// - both caches have the layout [layers, 2, num_blocks, block_size, kv_heads,
//   head_dim] (lmpool/ops/reference.py), are contiguous and 16-byte aligned,
//   and agree on everything but num_blocks;
// - the id tensors live on the device the kernel runs on (the destination's);
//   the source cache is on that device or on a peer the device can access;
// - block_bytes (one block of one layer's K or V) is a multiple of 16.
// The launcher only enqueues work on `stream`; it never synchronizes.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace lmpool {

struct CopyBlocksArgs {
  const void* src_cache;  // [planes = layers * 2, src_num_blocks, block_bytes]
  void* dst_cache;        // [planes, dst_num_blocks, block_bytes]
  const void* src_ids;    // [num_ids]; int32 or int64, like dst_ids
  const void* dst_ids;    // [num_ids]
  bool ids_int64;
  int64_t planes;
  int64_t src_num_blocks;
  int64_t dst_num_blocks;
  int64_t num_ids;
  int64_t block_bytes;
};

// For every plane p and pair i: dst[p, dst_ids[i]] = src[p, src_ids[i]]. A pair
// with either id out of range is skipped (nothing read, nothing written).
cudaError_t launch_copy_blocks(const CopyBlocksArgs& args, cudaStream_t stream);

// CTAs a launch uses: the host checks this fits a 1-D grid before launching.
int64_t copy_blocks_ctas(const CopyBlocksArgs& args);

}  // namespace lmpool
