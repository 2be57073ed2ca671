// Prefill attention over a cached prefix on tensor cores (mma.sync m16n8k16,
// fp16/bf16 inputs, fp32 accumulation), FlashAttention-2 style.
//
// Rows of a tile are (new token, q head) pairs of one sequence and one GQA
// group, token-major: row r is token tok0 + r / group, head r % group. Packing
// the group into the rows means each K/V tile loaded into shared memory serves
// every q head of the group. A CTA of 4 warps owns 64 rows (16 per warp) and
// walks the keys in tiles of 64: S = Q K^T on tensor cores, causal mask, online
// softmax in registers, then O += P V with P reused straight from the S
// accumulators as the A operand. K/V tiles are double-buffered in shared memory
// (cp.async), so the next tile streams in while this one is computed.
//
// Tiles of all sequences share grid.x without a host-side count: sequence b's
// tiles start at slot (query_start_loc[b] + b * (tokens_per_tile - 1)) /
// tokens_per_tile, which leaves room for ceil(n_b / tokens_per_tile) tiles; a
// CTA binary-searches its sequence and exits if its slot is a gap.
//
// With num_splits > 1 (grid.z), each tile's visible keys [0, kv_end) are cut
// into equal tile-aligned shares of at least kMinPrefillSplitKeys; a CTA walks
// one share and writes its normalized output and log2-sum-exp per row, and
// combine_splits_kernel merges them. A share past kv_end, or one whose keys a
// row may not see, writes -inf for that row, which the merge skips.
//
// A cascade's prefix pass (cascade_decode_attention) runs it non-causal: a
// "sequence" is a group of decode rows sharing a prefix (q_rows names their q
// rows), every row sees all of the prefix's keys, and the splits write into the
// slots after those of the rows kernel that then attends to the rest. Rows in
// no group are not its queries (the rows kernel marks their slots empty).
#pragma once

#include <cmath>

#include "combine_splits.cuh"
#include "common.cuh"
#include "launchers.h"

namespace lmpool {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy that bypasses registers; src_bytes = 0 zero-fills.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

template <typename T, int D>
struct PrefillTiles {
  static constexpr int kKeys = 64;             // keys per tile
  static constexpr int kChunks = D / 8;        // 16-byte chunks per row
  static constexpr int kStride = D + 8;        // padded so ldmatrix's 8 row addresses hit distinct banks
  static constexpr int kTileElems = kKeys * kStride;
  // Two stages of {K, V}: the next tile streams in while this one is computed.
  static constexpr int kSmemBytes = 2 * 2 * kTileElems * static_cast<int>(sizeof(T));
};

template <typename T, int D>
__global__ void __launch_bounds__(128) prefill_mma_kernel(const PrefillArgs a) {
  using L = PrefillTiles<T, D>;
  constexpr int kRows = kPrefillRows, kKeys = L::kKeys, kChunks = L::kChunks, kStride = L::kStride;
  static_assert(kRows == 64 && kRows <= kKeys, "4 warps x 16 rows; Q is staged in a K buffer");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const smem = reinterpret_cast<T*>(smem_raw);  // [stage][K, V][kKeys * kStride]

  const int kv_head = blockIdx.y;
  const int group = a.q_heads / a.kv_heads;
  const int tpt = a.tokens_per_tile;
  const int* qsl = a.query_start_loc;

  // Which sequence owns this tile slot (see the file comment).
  const int slot = blockIdx.x;
  int lo = 0, hi = a.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if ((__ldg(qsl + mid) + mid * (tpt - 1)) / tpt <= slot) lo = mid; else hi = mid - 1;
  }
  const int seq = lo;
  const int q_start = __ldg(qsl + seq);
  const int n = __ldg(qsl + seq + 1) - q_start;
  const int tok0 = (slot - (q_start + seq * (tpt - 1)) / tpt) * tpt;
  if (tok0 < 0 || tok0 >= n) return;  // a gap slot: uniform exit, before any barrier

  const int ctx = min(__ldg(a.context_lens + seq), a.max_blocks * a.block_size);
  const int prefix = ctx - n;  // keys cached before this step's tokens
  const int tok_end = min(tok0 + tpt, n);
  const int rows_valid = (tok_end - tok0) * group;
  const bool causal = a.causal != 0, partial = a.split_stride > 1;
  const int kv_end = causal ? max(0, min(ctx, prefix + tok_end)) : ctx;  // keys any row here may see
  // The q and output row of query token t of this sequence.
  auto q_row = [&](int t) { return a.q_rows == nullptr ? q_start + t : __ldg(a.q_rows + q_start + t); };

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T* q = static_cast<const T*>(a.q);

  // This CTA's share of the keys: [kv_begin, kv_stop), a whole number of tiles
  // unless it ends at kv_end.
  const int split = blockIdx.z;
  int kv_begin = 0, kv_stop = kv_end;
  if (a.num_splits > 1) {
    const int share = max(ceil_div(ceil_div(kv_end, a.num_splits), kKeys) * kKeys, kMinPrefillSplitKeys);
    kv_begin = min(kv_end, split * share);
    kv_stop = min(kv_end, kv_begin + share);
  }
  if (partial && kv_begin == kv_stop) {  // an empty share: uniform exit, before any barrier
    for (int r = tid; r < rows_valid; r += 128) {
      const int64_t rh = (int64_t)q_row(tok0 + r / group) * a.q_heads + kv_head * group + r % group;
      a.partial_lse[rh * a.split_stride + a.split_base + split] = -INFINITY;
    }
    return;
  }

  // Stage this tile's queries through shared memory, then keep them in registers.
  for (int c = tid; c < kRows * kChunks; c += 128) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < rows_valid) {
      const int t = tok0 + r / group, h = kv_head * group + r % group;
      v = *reinterpret_cast<const uint4*>(q + (int64_t)q_row(t) * a.q_row_stride +
                                          (int64_t)h * a.q_head_stride + col);
    }
    *reinterpret_cast<uint4*>(&smem[r * kStride + col]) = v;
  }
  __syncthreads();
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    ldmatrix_x4(qf[kk], &smem[(warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * kStride +
                              kk * 16 + (lane / 16) * 8]);
  __syncthreads();  // the first tile's copies overwrite the staged queries

  // This thread's two rows (mma C layout: lane/4 and lane/4 + 8 of the warp's 16)
  // and the first key each may not see. Padding rows see every loaded key so
  // they stay finite; they are never stored.
  int limit[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int rr = warp * 16 + lane / 4 + r * 8;
    limit[r] = rr >= rows_valid ? kv_end : causal ? min(ctx, prefix + tok0 + rr / group + 1) : ctx;
  }
  const int unmasked_end = causal ? min(ctx, prefix + tok0 + 1) : ctx;  // keys below it are visible to all rows

  float o[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

  const int* table = a.block_tables + (int64_t)seq * a.block_table_stride;
  const int64_t token_stride = (int64_t)a.kv_heads * D;
  const T* k_cache = static_cast<const T*>(a.k_cache) + kv_head * D;
  const T* v_cache = static_cast<const T*>(a.v_cache) + kv_head * D;
  const int bs = a.block_size, shift = a.block_shift;

  // Copy keys [kv0, kv0 + kKeys) of K and V into `stage` as one cp.async group.
  // Keys past kv_end are zero-filled: 0 * garbage could be NaN in P V.
  auto load_tile = [&](int stage, int kv0) {
    T* k_dst = smem + stage * 2 * L::kTileElems;
    T* v_dst = k_dst + L::kTileElems;
#pragma unroll
    for (int i = 0; i < kKeys * kChunks / 128; ++i) {
      const int c = tid + i * 128;
      const int t = kv0 + c / kChunks;
      const int dst = (c / kChunks) * kStride + (c % kChunks) * 8;
      int64_t src = 0;
      if (t < kv_end) {
        const int lb = shift >= 0 ? t >> shift : t / bs;
        const int off = shift >= 0 ? t & (bs - 1) : t - lb * bs;
        src = ((int64_t)__ldg(table + lb) * bs + off) * token_stride + (c % kChunks) * 8;
      }
      cp_async16(k_dst + dst, k_cache + src, t < kv_end);
      cp_async16(v_dst + dst, v_cache + src, t < kv_end);
    }
    cp_async_commit();
  };

  const int num_tiles = ceil_div(kv_stop - kv_begin, kKeys);
  if (num_tiles > 0) load_tile(0, kv_begin);
  for (int it = 0; it < num_tiles; ++it) {
    const int kv0 = kv_begin + it * kKeys;
    if (it + 1 < num_tiles) {
      load_tile((it + 1) & 1, kv0 + kKeys);
      cp_async_wait<1>();  // this tile's group is complete; the next one may still fly
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* k_tile = smem + (it & 1) * 2 * L::kTileElems;
    const T* v_tile = k_tile + L::kTileElems;

    float s[kKeys / 8][4];
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; nt += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, &k_tile[(nt * 8 + (lane % 8) + (lane / 16) * 8) * kStride + kk * 16 +
                               ((lane / 8) % 2) * 8]);
        mma_16816<T>(s[nt], qf[kk], b[0], b[1]);
        mma_16816<T>(s[nt + 1], qf[kk], b[2], b[3]);
      }
    }

    const bool masked = kv0 + kKeys > unmasked_end;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tile_max = row_max[r];
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = s[nt][2 * r + e] * a.scale_log2;
          if (masked && kv0 + nt * 8 + (lane % 4) * 2 + e >= limit[r]) x = -INFINITY;
          s[nt][2 * r + e] = x;
          tile_max = fmaxf(tile_max, x);
        }
      }
      // The 4 lanes of a quad hold the same row.
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float ref = tile_max == -INFINITY ? 0.f : tile_max;
      const float alpha = exp2f(row_max[r] - ref);
      row_max[r] = tile_max;
      row_sum[r] *= alpha;  // a per-lane partial sum; the quad adds its parts at the end
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        o[dt][2 * r] *= alpha;
        o[dt][2 * r + 1] *= alpha;
      }
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = exp2f(s[nt][2 * r + e] - ref);
          s[nt][2 * r + e] = p;
          row_sum[r] += p;
        }
      }
    }

#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      // The S accumulators of key tiles 2kk and 2kk+1 are exactly the A fragment of P.
      const uint32_t pa[4] = {pack_pair<T>(s[2 * kk][0], s[2 * kk][1]),
                              pack_pair<T>(s[2 * kk][2], s[2 * kk][3]),
                              pack_pair<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_pair<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dt = 0; dt < D / 8; dt += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, &v_tile[(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * kStride +
                                     dt * 8 + (lane / 16) * 8]);
        mma_16816<T>(o[dt], pa, b[0], b[1]);
        mma_16816<T>(o[dt + 1], pa, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }

  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;  // a row with no key reads as zeros
    const int rr = warp * 16 + lane / 4 + r * 8;
    if (rr >= rows_valid) continue;
    const int64_t rh = (int64_t)q_row(tok0 + rr / group) * a.q_heads + kv_head * group + rr % group;
    if (!partial) {
      T* dst = out + rh * D + (lane % 4) * 2;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<uint32_t*>(dst + dt * 8) =
            pack_pair<T>(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
    } else {
      // row_max and the sum are the quad's (reduced above), so any lane may write the lse.
      const int64_t slot = rh * a.split_stride + a.split_base + split;
      float* dst = a.partial_out + slot * D + (lane % 4) * 2;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
        *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
      if (lane % 4 == 0)
        a.partial_lse[slot] = sum > 0.f ? row_max[r] + log2f(sum) : -INFINITY;
    }
  }
}

template <typename T, int D>
cudaError_t launch_prefill_dim(const PrefillArgs& a, cudaStream_t stream) {
  constexpr int kSmem = PrefillTiles<T, D>::kSmemBytes;
  // Over 48 KiB of dynamic shared memory needs an opt-in, once per device.
  static bool opted_in[64] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 64 && !opted_in[device]) {
    err = cudaFuncSetAttribute(prefill_mma_kernel<T, D>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
    opted_in[device] = true;
  }
  prefill_mma_kernel<T, D><<<dim3(a.num_tiles, a.kv_heads, a.num_splits), 128, kSmem, stream>>>(a);
  err = cudaGetLastError();
  // A launch merges its splits only when it owns every slot (a cascade's suffix pass merges).
  if (err != cudaSuccess || a.split_stride <= 1 || a.split_stride != a.num_splits) return err;
  // Only real (token, q head) rows are merged: total_q is the last sequence's end.
  return launch_combine_splits<T, D>(a.partial_out, a.partial_lse, a.out, a.total_q, a.q_heads,
                                     a.num_splits, stream);
}

template <typename T>
cudaError_t launch_prefill_for(int head_dim, const PrefillArgs& a, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return launch_prefill_dim<T, 64>(a, stream);
    case 128: return launch_prefill_dim<T, 128>(a, stream);
    default: return cudaErrorInvalidValue;  // the host checks head_dim first
  }
}

}  // namespace lmpool
