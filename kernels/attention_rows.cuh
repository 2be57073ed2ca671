// Paged attention of single query rows over their sequence's cached keys:
// the decode kernel, and the general (any dtype, any GQA ratio) prefill path.
//
// Work split: one CTA per (query row, kv head, chunk of the GQA group, split of
// the keys). The CTA reads each K/V row of its split exactly once and scores it
// against every query head of the chunk, so GQA costs no extra HBM traffic.
// Inside a CTA, `kLanes` threads share one token row (16 bytes each), and the
// CTA's `kGroups` token groups walk the split's keys interleaved, each keeping
// its own online-softmax state; the groups merge once, at the end, through
// shared memory. No barrier in the main loop: warps stream independently.
//
// With more than one split (flash-decoding), each split writes its normalized
// partial output and log2-sum-exp; `combine_splits_kernel` merges them. In a
// cascade (cascade_decode_attention), a row attends only to its keys from
// kv_start[row] on, and the merge also takes the slots its shared prefix's pass
// (the tensor-core prefill kernel, over the group's rows at once) wrote; a row
// that shares no prefix (kv_start 0) is in no group, and its first split's CTA
// marks those slots empty.
//
// The split count is fixed by the host from shapes alone (no device->host
// read), and each row sizes its partitions from its own length on the device,
// so short rows leave trailing splits empty instead of the grid shrinking.
#pragma once

#include <cmath>

#include "combine_splits.cuh"
#include "common.cuh"
#include "launchers.h"

namespace lmpool {

template <typename T, int D, int GT>
struct RowsConfig {
  static constexpr int kThreads = kRowsThreads;
  static constexpr int kVec = Vec16<T>::kElems;
  static constexpr int kLanes = D / kVec;  // threads that share one token row
  static constexpr int kGroups = kThreads / kLanes;
  static constexpr int kUnroll = rows_unroll(GT);  // tokens in flight per group
  static constexpr int kTile = kGroups * kUnroll;
  static_assert(kLanes <= 32 && (32 % kLanes) == 0, "a token row must fit in one warp");
  static_assert(kTile == rows_tile_tokens(sizeof(T), D, GT), "host and device tile sizes differ");
};

// Which sequence a query row belongs to, and how many keys it attends to.
__device__ __forceinline__ void locate_row(const AttentionRowsArgs& a, int row, int& seq,
                                           int& kv_len) {
  const int* ctx_lens = a.context_lens;
  if (a.query_start_loc == nullptr) {
    seq = row;
    kv_len = ctx_lens[row];
  } else {
    const int* qsl = a.query_start_loc;
    int lo = 0, hi = a.num_seqs - 1;  // last sequence whose first row is <= row
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (__ldg(qsl + mid) <= row) lo = mid; else hi = mid - 1;
    }
    seq = lo;
    const int first = __ldg(qsl + seq), next = __ldg(qsl + seq + 1);
    // Rows past the batch's last query (padding) attend to nothing.
    kv_len = row < next ? __ldg(ctx_lens + seq) - (next - first) + (row - first) + 1 : 0;
  }
  // Never read the block table past its width, whatever context_lens says.
  kv_len = max(0, min(kv_len, a.max_blocks * a.block_size));
}

// Keys per split for a row of `kv_len` keys: equal shares, tile-aligned, and
// at least kMinPartitionTokens so a split is never mostly overhead.
template <int kTile>
__device__ __forceinline__ int partition_tokens(int kv_len, int num_splits) {
  const int share = ceil_div(ceil_div(kv_len, num_splits), kTile) * kTile;
  return max(share, ceil_div(kMinPartitionTokens, kTile) * kTile);
}

template <typename T, int D, int GT>
__global__ void __launch_bounds__(kRowsThreads)
    attention_rows_kernel(const AttentionRowsArgs a) {
  using C = RowsConfig<T, D, GT>;
  constexpr int kVec = C::kVec, kLanes = C::kLanes, kGroups = C::kGroups;
  constexpr int kUnroll = C::kUnroll, kTile = C::kTile;
  dependent_wait();  // the query, the key and value just stored and the step's tables

  const int row = blockIdx.x;
  const int split = blockIdx.z;
  const int group = a.q_heads / a.kv_heads;
  const int chunks = ceil_div(group, GT);
  const int kv_head = blockIdx.y / chunks;
  const int q_head0 = kv_head * group + (blockIdx.y % chunks) * GT;
  const int heads_here = min(GT, kv_head * group + group - q_head0);

  int seq, kv_len;
  locate_row(a, row, seq, kv_len);
  const int first = a.kv_start == nullptr ? 0 : min(kv_len, max(0, __ldg(a.kv_start + row)));
  const int part = partition_tokens<kTile>(kv_len - first, a.num_splits);
  const int start = first + split * part;
  const int end = min(kv_len, start + part);
  const bool partial = a.split_stride > 1;

  const int tid = threadIdx.x;
  const int lane = tid % kLanes;  // which 16-byte slice of head_dim
  const int grp = tid / kLanes;   // which token of each kGroups-token step
  const int64_t out_row = (int64_t)row * a.q_heads;
  if (a.kv_start != nullptr && split == 0 && __ldg(a.kv_start + row) <= 0) {  // no prefix pass wrote its slots
    for (int i = tid; i < heads_here * (a.split_stride - a.num_splits); i += kRowsThreads)
      a.partial_lse[(out_row + q_head0 + i % heads_here) * a.split_stride + a.num_splits +
                    i / heads_here] = -INFINITY;
  }

  if (start >= end) {  // nothing to attend to in this split
    if (partial) {
      if (tid < heads_here)
        a.partial_lse[(out_row + q_head0 + tid) * a.split_stride + split] = -INFINITY;
    } else {
      T* out = static_cast<T*>(a.out);
      for (int i = tid; i < heads_here * D; i += kRowsThreads)
        out[(out_row + q_head0) * D + i] = float_to<T>(0.f);
    }
    return;
  }

  // Queries pre-scaled into the exp2 domain; absent heads of a partial chunk stay 0.
  float q[GT][kVec];
  {
    const T* qp = static_cast<const T*>(a.q) + (int64_t)row * a.q_row_stride + lane * kVec;
#pragma unroll
    for (int h = 0; h < GT; ++h) {
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        q[h][i] = h < heads_here
                      ? scalar_to_float<T>(qp[(int64_t)(q_head0 + h) * a.q_head_stride + i]) *
                            a.scale_log2
                      : 0.f;
    }
  }

  float m[GT], l[GT], acc[GT][kVec];
#pragma unroll
  for (int h = 0; h < GT; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[h][i] = 0.f;
  }

  const int* table = a.block_tables + (int64_t)seq * a.block_table_stride;
  const int64_t token_stride = (int64_t)a.kv_heads * D;
  const T* k_base = static_cast<const T*>(a.k_cache) + kv_head * D + lane * kVec;
  const T* v_base = static_cast<const T*>(a.v_cache) + kv_head * D + lane * kVec;
  const int bs = a.block_size, shift = a.block_shift;

  // The loop bounds are uniform across the CTA, so every lane reaches the
  // shuffles below; tokens past `end` are masked, not skipped.
  for (int tile = start; tile < end; tile += kTile) {
    uint4 kr[kUnroll], vr[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = tile + u * kGroups + grp;
      if (t < end) {
        // Block sizes are powers of two in practice; the division is the fallback.
        const int lb = shift >= 0 ? t >> shift : t / bs;
        const int off = shift >= 0 ? t & (bs - 1) : t - lb * bs;
        const int64_t row_off = ((int64_t)__ldg(table + lb) * bs + off) * token_stride;
        kr[u] = load16(k_base + row_off);
        vr[u] = load16(v_base + row_off);
      } else {
        kr[u] = make_uint4(0, 0, 0, 0);
        vr[u] = make_uint4(0, 0, 0, 0);
      }
    }

    float s[kUnroll][GT];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[kVec];
      vec_to_float<T>(kr[u], kf);
#pragma unroll
      for (int h = 0; h < GT; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < kVec; ++i) dot = fmaf(q[h][i], kf[i], dot);
        s[u][h] = dot;
      }
    }
    // Butterfly over the lanes of one token row: every lane ends with the full dot.
#pragma unroll
    for (int off = kLanes / 2; off > 0; off >>= 1) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int h = 0; h < GT; ++h) s[u][h] += __shfl_xor_sync(0xffffffffu, s[u][h], off);
      }
    }

#pragma unroll
    for (int h = 0; h < GT; ++h) {
      float tile_max = m[h];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (tile + u * kGroups + grp >= end) s[u][h] = -INFINITY;
        tile_max = fmaxf(tile_max, s[u][h]);
      }
      // A group that has seen no key yet keeps m = -inf; exp2 of (-inf - 0) is 0.
      const float ref = tile_max == -INFINITY ? 0.f : tile_max;
      const float alpha = exp2f(m[h] - ref);
      m[h] = tile_max;
      l[h] *= alpha;
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[h][i] *= alpha;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        s[u][h] = exp2f(s[u][h] - ref);
        l[h] += s[u][h];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float vf[kVec];
      vec_to_float<T>(vr[u], vf);
#pragma unroll
      for (int h = 0; h < GT; ++h) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[h][i] = fmaf(s[u][h], vf[i], acc[h][i]);
      }
    }
  }

  // Merge the token groups' softmax states.
  __shared__ float sm_m[kGroups][GT];
  __shared__ float sm_l[kGroups][GT];
  __shared__ __align__(16) float sm_acc[kGroups][GT][D];
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < GT; ++h) {
      sm_m[grp][h] = m[h];
      sm_l[grp][h] = l[h];
    }
  }
#pragma unroll
  for (int h = 0; h < GT; ++h) {
#pragma unroll
    for (int i = 0; i < kVec; i += 4)
      *reinterpret_cast<float4*>(&sm_acc[grp][h][lane * kVec + i]) =
          make_float4(acc[h][i], acc[h][i + 1], acc[h][i + 2], acc[h][i + 3]);
  }
  __syncthreads();

  for (int idx = tid; idx < GT * D; idx += kRowsThreads) {
    const int h = idx / D, d = idx % D;
    if (h >= heads_here) break;  // idx only grows, so later h are absent too
    float row_max = -INFINITY;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) row_max = fmaxf(row_max, sm_m[g][h]);
    float sum = 0.f, o = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      // Groups that saw no key have m = -inf and weigh exactly 0.
      const float w = exp2f(sm_m[g][h] - row_max);
      sum = fmaf(sm_l[g][h], w, sum);
      o = fmaf(sm_acc[g][h][d], w, o);
    }
    // start < end guarantees one key, so sum >= 1 here.
    const float value = o / sum;
    const int64_t rh = out_row + q_head0 + h;
    if (!partial) {
      static_cast<T*>(a.out)[rh * D + d] = float_to<T>(value);
    } else {
      a.partial_out[(rh * a.split_stride + split) * D + d] = value;
      if (d == 0) a.partial_lse[rh * a.split_stride + split] = row_max + log2f(sum);
    }
  }
}

template <typename T, int D, int GT>
cudaError_t launch_rows(const AttentionRowsArgs& a, cudaStream_t stream) {
  const int group = a.q_heads / a.kv_heads;
  const dim3 grid(a.num_rows, a.kv_heads * ceil_div(group, GT), a.num_splits);
  cudaError_t err = launch(attention_rows_kernel<T, D, GT>, grid, kRowsThreads, 0, stream, a);
  if (err != cudaSuccess || a.split_stride <= 1) return err;
  return launch_combine_splits<T, D>(a.partial_out, a.partial_lse, a.out, a.num_rows, a.q_heads,
                                     a.split_stride, stream);
}

// The kernel instance for (T, head_dim, GQA group): calls f(RowsKernel<T, D, GT>{}), so the
// launch and the occupancy query pick the same instance. head_dim is checked by the host first.
template <typename T, int D, int GT>
struct RowsKernel {
  static cudaError_t launch(const AttentionRowsArgs& a, cudaStream_t stream) {
    return launch_rows<T, D, GT>(a, stream);
  }
  // CTAs of this kernel one SM holds at once; 0 if the runtime cannot say.
  static int ctas_per_sm() {
    int n = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, attention_rows_kernel<T, D, GT>,
                                                         kRowsThreads, 0) == cudaSuccess ? n : 0;
  }
};

template <typename T, int D, typename F>
auto with_rows_kernel_for_dim(int group, F&& f) {
  switch (rows_heads_per_cta(group)) {
    case 1: return f(RowsKernel<T, D, 1>{});
    case 2: return f(RowsKernel<T, D, 2>{});
    case 4: return f(RowsKernel<T, D, 4>{});
    default: return f(RowsKernel<T, D, 8>{});
  }
}

template <typename T, typename F>
auto with_rows_kernel(int head_dim, int group, F&& f) {
  return head_dim == 64 ? with_rows_kernel_for_dim<T, 64>(group, f)
                        : with_rows_kernel_for_dim<T, 128>(group, f);
}

template <typename T>
cudaError_t launch_rows_for(int head_dim, const AttentionRowsArgs& a, cudaStream_t stream) {
  if (head_dim != 64 && head_dim != 128) return cudaErrorInvalidValue;  // the host checks head_dim first
  return with_rows_kernel<T>(head_dim, a.q_heads / a.kv_heads,
                             [&](auto kernel) { return decltype(kernel)::launch(a, stream); });
}

template <typename T>
int rows_ctas_per_sm_for(int head_dim, int group) {
  if (head_dim != 64 && head_dim != 128) return 0;
  return with_rows_kernel<T>(head_dim, group, [](auto kernel) { return decltype(kernel)::ctas_per_sm(); });
}

}  // namespace lmpool
