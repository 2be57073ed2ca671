// A linear layer of few rows, y[m, n] = sum_k x[m, k] * w[n, k], as a decode step of 1-8
// sequences runs its projections: reading the weights is all of its cost, and cuBLAS's tiles
// for a handful of rows reach ~1.4 TB/s of the H200's ~4. ``linear`` sends it at most
// kSkinnyLinearRows (4): at 8 rows cuBLAS was faster on an H100.
//
// Layout: a block of kThreads threads computes kRows consecutive outputs n for every row m.
// Its threads stride over k in 16-byte vectors: each loads the kRows weight vectors at its k
// first (kRows loads in flight a thread), then the rows' x vectors there (few, L1-resident:
// x is read kRows times less than the weights), and keeps fp32 sums; a warp's sums are
// reduced by shuffles, the warps' through shared memory. One rounding to the dtype at the end.
//
// Numerics: fp32 products and sums of the dtype's values; the order of the sums differs from
// cuBLAS's, so results agree to the dtype's rounding, not bit for bit.
// Requirements (the launcher's caller checks them): fp16 or bf16, 1 <= rows <= kMaxRows, k a
// multiple of 8, x's rows and w's rows 16-byte aligned, the output contiguous.
#include "common.cuh"
#include "launchers.h"

namespace lmpool {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 4;  // outputs a block computes

template <typename T, int M>
__global__ void __launch_bounds__(kThreads) skinny_linear_kernel(SkinnyLinearArgs a) {
  constexpr int N = Vec16<T>::kElems;
  const int vectors = a.k / N;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kRows;
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w) + first * a.w_stride;
  // Rows past the end read the last row (in bounds) and are never written.
  int64_t offset[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) offset[r] = (first + r < a.n ? r : a.n - 1 - first) * a.w_stride;

  float sum[kRows][M];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) sum[r][m] = 0.0f;

  for (int v = threadIdx.x; v < vectors; v += kThreads) {
    uint4 wv[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) wv[r] = load16(w + offset[r] + v * N);
    // Each weight converted once, each x vector once: at 8 rows the step is near the SM's issue
    // rate, so no conversion repeats in the inner loop.
    float wf[kRows][N];
#pragma unroll
    for (int r = 0; r < kRows; ++r) vec_to_float<T>(wv[r], wf[r]);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xf[N];
      vec_to_float<T>(load16(x + m * a.x_stride + v * N), xf);
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int i = 0; i < N; ++i) sum[r][m] = fmaf(xf[i], wf[r][i], sum[r][m]);
    }
  }

  __shared__ float partial[kWarps][kRows * M];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float s = sum[r][m];
#pragma unroll
      for (int d = 16; d > 0; d >>= 1) s += __shfl_xor_sync(0xffffffffu, s, d);
      if (lane == 0) partial[warp][r * M + m] = s;
    }
  __syncthreads();
  for (int i = threadIdx.x; i < kRows * M; i += kThreads) {
    const int r = i / M, m = i % M;
    if (first + r >= a.n) continue;
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < kWarps; ++j) s += partial[j][i];
    static_cast<T*>(a.out)[m * a.n + first + r] = float_to<T>(s);
  }
}

template <typename T, int M>
void launch_rows(const SkinnyLinearArgs& a, cudaStream_t stream) {
  const int64_t blocks = (a.n + kRows - 1) / kRows;
  skinny_linear_kernel<T, M><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
}

template <typename T>
void launch_for(const SkinnyLinearArgs& a, cudaStream_t stream) {
  switch (a.rows) {
    case 1: launch_rows<T, 1>(a, stream); break;
    case 2: launch_rows<T, 2>(a, stream); break;
    case 3: launch_rows<T, 3>(a, stream); break;
    case 4: launch_rows<T, 4>(a, stream); break;
    case 5: launch_rows<T, 5>(a, stream); break;
    case 6: launch_rows<T, 6>(a, stream); break;
    case 7: launch_rows<T, 7>(a, stream); break;
    default: launch_rows<T, 8>(a, stream); break;
  }
}

}  // namespace

cudaError_t launch_skinny_linear(DType dtype, const SkinnyLinearArgs& a, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF16: launch_for<__half>(a, stream); break;
    case DType::kBF16: launch_for<__nv_bfloat16>(a, stream); break;
    default: return cudaErrorInvalidValue;  // fp32 runs cuBLAS (``ops.cuda.linear``)
  }
  return cudaGetLastError();
}

}  // namespace lmpool
