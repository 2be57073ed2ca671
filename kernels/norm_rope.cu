// RMSNorm (optionally after the residual add that feeds it), and RMSNorm followed by rotary
// embedding for the per-head q/k norms of Qwen3 (alone, or over a whole qkv projection with the
// keys and values stored into the paged cache), each one kernel where torch runs eight to
// twenty small ones (at small batches a decode step was mostly the launch floor of those:
// results/h200/runs/NOTES.md, run 41).
//
// The residual add rounds the sum to the model dtype (torch's add in that dtype) and writes
// it out: the next layer's residual. Rows whose pointers, row strides and width allow it are
// read and written 16 bytes a lane with every load of a lane's row issued before the first
// is used: a lane reading its row element by element waited on each load in turn, about
// 12 us a norm on an H200 at any batch (results/profile_decode_h200_0.6b.json).
//
// Numerics follow lmpool/ops/reference.py rounding for rounding (its RMSNorm is
// transformers' Qwen3 one; its rotation works in fp32): the sum of squares and the scaling
// in fp32, the result rounded to the model dtype, then multiplied by the weight in fp32 and
// rounded again; the rotation in fp32 from those rounded values, each product and sum
// rounded on its own (the _rn intrinsics keep the compiler from fusing them into FMAs,
// which torch's separate kernels never do), and the result rounded to the model dtype.
// Only the order of the sum of squares differs. A position outside the tables is clamped
// (the reference's index_select raises): the engine never passes one.
//
// Layout: one warp per row (a token's hidden state, or one head of one token); rows are
// read through strides, outputs are contiguous.
#include "common.cuh"
#include "launchers.h"

namespace lmpool {
namespace {

constexpr int kNormWarps = 4;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <typename T>
__device__ __forceinline__ float rounded(float x) {
  return scalar_to_float<T>(float_to<T>(x));
}

// 1 / sqrt(mean of squares + eps), as torch computes it from the row's sum of squares.
__device__ __forceinline__ float inverse_rms(float sum_squares, int dim, float eps) {
  return rsqrtf(__fadd_rn(__fmul_rn(sum_squares, 1.0f / static_cast<float>(dim)), eps));
}

// Element i of the row: x's, or x's plus the residual's rounded to T (the add's result).
template <typename T, bool kAdd>
__device__ __forceinline__ float row_value(const T* x, const T* residual, int i) {
  const float v = scalar_to_float<T>(x[i]);
  if constexpr (kAdd) return rounded<T>(__fadd_rn(v, scalar_to_float<T>(residual[i])));
  return v;
}

template <typename T, bool kAdd>
__global__ void rms_norm_kernel(RmsNormArgs a) {
  dependent_wait();
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kNormWarps + threadIdx.x / 32;
  if (row >= a.rows) return;  // warp-uniform: the whole warp leaves together
  const T* x = static_cast<const T*>(a.x) + row * a.x_row_stride;
  const T* residual = kAdd ? static_cast<const T*>(a.residual) + row * a.residual_row_stride : nullptr;
  const T* weight = static_cast<const T*>(a.weight);
  T* out = static_cast<T*>(a.out) + row * a.dim;
  float sum = 0.f;
  for (int i = lane; i < a.dim; i += 32) {
    const float v = row_value<T, kAdd>(x, residual, i);
    if constexpr (kAdd) static_cast<T*>(a.sum_out)[row * a.dim + i] = float_to<T>(v);
    sum = __fadd_rn(sum, __fmul_rn(v, v));
  }
  const float inv = inverse_rms(warp_sum(sum), a.dim, a.eps);
  for (int i = lane; i < a.dim; i += 32) {  // the second read of the row comes from L1
    const float normed = rounded<T>(__fmul_rn(row_value<T, kAdd>(x, residual, i), inv));
    out[i] = float_to<T>(__fmul_rn(scalar_to_float<T>(weight[i]), normed));
  }
}

// A lane's 16-byte vector v of the row, as floats: x's, or rounded x + residual.
template <typename T, bool kAdd, int N>
__device__ __forceinline__ void row_vector(const T* x, const T* residual, int v, float (&f)[N]) {
  vec_to_float<T>(load16(x + v * N), f);
  if constexpr (kAdd) {
    float r[N];
    vec_to_float<T>(load16(residual + v * N), r);
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = rounded<T>(__fadd_rn(f[i], r[i]));
  }
}

// ``rms_norm_kernel`` 16 bytes at a time; the launcher checks the alignment it needs.
template <typename T, bool kAdd>
__global__ void rms_norm_vec_kernel(RmsNormArgs a) {
  constexpr int N = Vec16<T>::kElems;
  dependent_wait();
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kNormWarps + threadIdx.x / 32;
  if (row >= a.rows) return;  // warp-uniform
  const T* x = static_cast<const T*>(a.x) + row * a.x_row_stride;
  const T* residual = kAdd ? static_cast<const T*>(a.residual) + row * a.residual_row_stride : nullptr;
  const T* weight = static_cast<const T*>(a.weight);
  T* out = static_cast<T*>(a.out) + row * a.dim;
  const int vectors = a.dim / N;
  float sum = 0.f;
#pragma unroll 4
  for (int v = lane; v < vectors; v += 32) {
    float f[N];
    row_vector<T, kAdd>(x, residual, v, f);
    if constexpr (kAdd) reinterpret_cast<uint4*>(static_cast<T*>(a.sum_out) + row * a.dim)[v] = float_to_vec<T>(f);
#pragma unroll
    for (int i = 0; i < N; ++i) sum = __fadd_rn(sum, __fmul_rn(f[i], f[i]));
  }
  const float inv = inverse_rms(warp_sum(sum), a.dim, a.eps);
#pragma unroll 4
  for (int v = lane; v < vectors; v += 32) {  // the inputs again (read-only, from L1), not sum_out
    float f[N], w[N];
    row_vector<T, kAdd>(x, residual, v, f);
    vec_to_float<T>(load16(weight + v * N), w);
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = __fmul_rn(w[i], rounded<T>(__fmul_rn(f[i], inv)));
    reinterpret_cast<uint4*>(out)[v] = float_to_vec<T>(f);
  }
}

// The token's position, clamped into the tables: the engine's positions lie below the table's
// length (max_model_len); clamping keeps every read in bounds whatever a caller passes.
template <typename Pos>
__device__ __forceinline__ int64_t table_row(const void* positions, int64_t token, int64_t num_positions) {
  const int64_t pos = static_cast<int64_t>(static_cast<const Pos*>(positions)[token]);
  return pos < 0 ? 0 : (pos >= num_positions ? num_positions - 1 : pos);
}

// One head's row x (``dim`` elements) RMSNormed by ``weight``, then rotated by the tables' row
// ``pos``, into ``out``; by one warp, staging the row in its shared ``values``.
template <typename T>
__device__ __forceinline__ void norm_rope_row(const T* x, const T* weight, int dim, float eps, const float* cos_table,
                                              const float* sin_table, int64_t pos, T* out, float* values, int lane) {
  float sum = 0.f;
#pragma unroll 4
  for (int i = lane; i < dim; i += 32) {
    const float v = scalar_to_float<T>(x[i]);
    values[i] = v;
    sum = __fadd_rn(sum, __fmul_rn(v, v));
  }
  const float inv = inverse_rms(warp_sum(sum), dim, eps);
  for (int i = lane; i < dim; i += 32) {  // each lane rewrites only the elements it read
    const float normed = rounded<T>(__fmul_rn(values[i], inv));
    values[i] = rounded<T>(__fmul_rn(scalar_to_float<T>(weight[i]), normed));
  }
  __syncwarp();  // the rotation pairs element i with i + dim / 2, written by another lane
  const int half = dim / 2;
  const float* cos = cos_table + pos * half;
  const float* sin = sin_table + pos * half;
  for (int i = lane; i < half; i += 32) {
    const float x1 = values[i], x2 = values[i + half], c = cos[i], s = sin[i];
    out[i] = float_to<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    out[i + half] = float_to<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
  }
}

template <typename T, typename Pos>
__global__ void qk_norm_rope_kernel(QkNormRopeArgs a) {
  __shared__ float rows[kNormWarps][kMaxRopeHeadDim];
  dependent_wait();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kNormWarps + warp;
  if (row >= static_cast<int64_t>(a.tokens) * a.heads) return;  // warp-uniform
  const int64_t token = row / a.heads;
  const int head = static_cast<int>(row % a.heads);
  const T* x = static_cast<const T*>(a.x) + token * a.x_token_stride + head * a.x_head_stride;
  norm_rope_row<T>(x, static_cast<const T*>(a.weight), a.dim, a.eps, a.cos, a.sin,
                   table_row<Pos>(a.positions, token, a.num_positions), static_cast<T*>(a.out) + row * a.dim,
                   rows[warp], lane);
}

// A whole qkv projection row's heads, one warp each: q heads normed and rotated into q_out, k
// heads normed and rotated into the key cache at the token's slot, v heads copied into the
// value cache there (a slot of -1, padding, stores nothing).
template <typename T, typename Pos, typename Slot>
__global__ void qkv_norm_rope_store_kernel(QkvNormRopeStoreArgs a) {
  __shared__ float rows[kNormWarps][kMaxRopeHeadDim];
  dependent_wait();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int all = a.heads + 2 * a.kv_heads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kNormWarps + warp;
  if (row >= static_cast<int64_t>(a.tokens) * all) return;  // warp-uniform
  const int64_t token = row / all;
  const int head = static_cast<int>(row % all);
  const T* x = static_cast<const T*>(a.qkv) + token * a.qkv_token_stride + static_cast<int64_t>(head) * a.dim;
  const int64_t pos = table_row<Pos>(a.positions, token, a.num_positions);
  if (head < a.heads) {
    T* out = static_cast<T*>(a.q_out) + (token * a.heads + head) * a.dim;
    norm_rope_row<T>(x, static_cast<const T*>(a.q_weight), a.dim, a.eps, a.cos, a.sin, pos, out, rows[warp], lane);
    return;
  }
  const int64_t slot = static_cast<int64_t>(static_cast<const Slot*>(a.slot_mapping)[token]);
  if (slot < 0 || slot >= a.num_slots) return;  // warp-uniform
  const int kv = head - a.heads;  // keys, then values
  if (kv < a.kv_heads) {
    T* out = static_cast<T*>(a.k_cache) + (slot * a.kv_heads + kv) * a.dim;
    norm_rope_row<T>(x, static_cast<const T*>(a.k_weight), a.dim, a.eps, a.cos, a.sin, pos, out, rows[warp], lane);
    return;
  }
  T* out = static_cast<T*>(a.v_cache) + (slot * a.kv_heads + kv - a.kv_heads) * a.dim;
#pragma unroll 4
  for (int i = lane; i < a.dim; i += 32) out[i] = x[i];
}

int norm_blocks(int64_t rows) { return static_cast<int>((rows + kNormWarps - 1) / kNormWarps); }

template <typename T>
cudaError_t launch_qk_for(const QkNormRopeArgs& a, cudaStream_t stream) {
  const int blocks = norm_blocks(static_cast<int64_t>(a.tokens) * a.heads);
  if (a.positions_int64) {
    launch(qk_norm_rope_kernel<T, int64_t>, blocks, kNormWarps * 32, 0, stream, a);
  } else {
    launch(qk_norm_rope_kernel<T, int>, blocks, kNormWarps * 32, 0, stream, a);
  }
  return cudaGetLastError();
}

template <typename T, typename Pos>
void launch_qkv_for(const QkvNormRopeStoreArgs& a, cudaStream_t stream) {
  const int blocks = norm_blocks(static_cast<int64_t>(a.tokens) * (a.heads + 2 * a.kv_heads));
  if (a.slots_int64) {
    launch(qkv_norm_rope_store_kernel<T, Pos, int64_t>, blocks, kNormWarps * 32, 0, stream, a);
  } else {
    launch(qkv_norm_rope_store_kernel<T, Pos, int>, blocks, kNormWarps * 32, 0, stream, a);
  }
}

template <typename T>
void launch_qkv_for(const QkvNormRopeStoreArgs& a, cudaStream_t stream) {
  if (a.positions_int64) {
    launch_qkv_for<T, int64_t>(a, stream);
  } else {
    launch_qkv_for<T, int>(a, stream);
  }
}

}  // namespace

cudaError_t launch_qkv_norm_rope_store(DType dtype, const QkvNormRopeStoreArgs& a, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32: launch_qkv_for<float>(a, stream); break;
    case DType::kF16: launch_qkv_for<__half>(a, stream); break;
    default: launch_qkv_for<__nv_bfloat16>(a, stream); break;
  }
  return cudaGetLastError();
}

namespace {

// Whether every row of ``a`` can be read and written in 16-byte vectors of T.
template <typename T>
bool vector_rows(const RmsNormArgs& a) {
  constexpr int N = Vec16<T>::kElems;
  bool ok = a.dim % N == 0 && a.x_row_stride % N == 0 && aligned16(a.x) && aligned16(a.weight) && aligned16(a.out);
  if (a.residual != nullptr) {
    ok = ok && a.residual_row_stride % N == 0 && aligned16(a.residual) && aligned16(a.sum_out);
  }
  return ok;
}

template <typename T, bool kAdd>
void launch_norm_for(const RmsNormArgs& a, cudaStream_t stream) {
  const int blocks = norm_blocks(a.rows);
  if (vector_rows<T>(a)) {
    launch(rms_norm_vec_kernel<T, kAdd>, blocks, kNormWarps * 32, 0, stream, a);
  } else {
    launch(rms_norm_kernel<T, kAdd>, blocks, kNormWarps * 32, 0, stream, a);
  }
}

template <typename T>
void launch_norm_for(const RmsNormArgs& a, cudaStream_t stream) {
  if (a.residual != nullptr) {
    launch_norm_for<T, true>(a, stream);
  } else {
    launch_norm_for<T, false>(a, stream);
  }
}

}  // namespace

cudaError_t launch_rms_norm(DType dtype, const RmsNormArgs& a, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32: launch_norm_for<float>(a, stream); break;
    case DType::kF16: launch_norm_for<__half>(a, stream); break;
    default: launch_norm_for<__nv_bfloat16>(a, stream); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_qk_norm_rope(DType dtype, const QkNormRopeArgs& a, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32: return launch_qk_for<float>(a, stream);
    case DType::kF16: return launch_qk_for<__half>(a, stream);
    default: return launch_qk_for<__nv_bfloat16>(a, stream);
  }
}

}  // namespace lmpool
