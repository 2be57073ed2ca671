// A linear layer of few rows, y[m, n] = sum_k x[m, k] * w[n, k], as a decode step of 1-8
// sequences runs its projections: reading the weights is all of its cost, and cuBLAS's tiles
// for a handful of rows reach ~1.4 TB/s of the H200's ~4. ``linear`` sends it at most
// kSkinnyLinearRows (2); steps of 3-8 rows go to the tensor-core kernel below.
//
// Layout: a block of kThreads threads computes kRows consecutive outputs n for every row m.
// Its threads stride over k in 16-byte vectors: each holds the kRows weight vectors at its k
// (the next k's in flight while it sums these; the first loaded before the kernel waits for the
// one ahead of it, ``dependent_wait``), then reads the rows' x vectors there (few, L1-resident:
// x is read kRows times less than the weights), and keeps fp32 sums; a warp's sums are
// reduced by shuffles (``reduce_lanes``), the warps' through shared memory. One rounding to the
// dtype at the end.
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

// The kRows weight vectors at vector v of the block's outputs.
template <typename T>
__device__ __forceinline__ void load_weights(const T* w, const int64_t (&offset)[kRows], int v,
                                             uint4 (&wv)[kRows]) {
  constexpr int N = Vec16<T>::kElems;
#pragma unroll
  for (int r = 0; r < kRows; ++r) wv[r] = load16(w + offset[r] + v * N);
}

// log2 of the values a warp reduction below holds for v sums: v rounded up to a power of two,
// at most 32.
__host__ __device__ constexpr int levels_for(int v) {
  return v <= 1 ? 0 : v <= 2 ? 1 : v <= 4 ? 2 : v <= 8 ? 3 : v <= 16 ? 4 : 5;
}

// The sums over the warp's 32 lanes of each of the P values in ``t`` (P a power of two <= 32;
// ``t`` is consumed): afterwards lane l holds value (l >> (5 - log2 P))'s total, in the lanes
// where l % (32 / P) == 0. Each value's sum is the same tree over the lanes, in the same order,
// as the plain xor reduction of that value alone (a + b and b + a are the same bits), so a row's
// result does not depend on how many values share the reduction; but each level sends half of
// the values it holds: 31 shuffles for 32 values, where reducing each alone takes 160.
template <int Half, int P>
__device__ __forceinline__ void fold_level(float (&t)[P], int lane) {
  if constexpr (Half >= 1) {
    constexpr int kLevel = 16 * 2 * Half / P;  // lanes this far apart hold the same values
    const bool upper = lane & kLevel;          // keeps the upper half of the values, sends the lower
#pragma unroll
    for (int i = 0; i < Half; ++i) {
      const float lo = t[i], hi = t[i + Half];
      t[i] = (upper ? hi : lo) + __shfl_xor_sync(0xffffffffu, upper ? lo : hi, kLevel);
    }
    fold_level<Half / 2>(t, lane);
  }
}

template <int P>
__device__ __forceinline__ float reduce_lanes(float (&t)[P], int lane) {
  constexpr int kLevels = levels_for(P);
  static_assert(P == 1 << kLevels, "a power of two, at most 32 values");
  fold_level<P / 2>(t, lane);
#pragma unroll
  for (int level = 16 >> kLevels; level > 0; level /= 2) t[0] += __shfl_xor_sync(0xffffffffu, t[0], level);
  return t[0];
}

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

  // No kernel writes the weights: their first vectors load while the kernel ahead still runs.
  uint4 wv[kRows];
  int v = threadIdx.x;
  if (v < vectors) load_weights(w, offset, v, wv);
  dependent_wait();  // x is the kernel ahead's output

  constexpr int kLevels = levels_for(kRows * M);
  float sum[1 << kLevels];  // [r * M + m], padded with zeros to a power of two
#pragma unroll
  for (int i = 0; i < (1 << kLevels); ++i) sum[i] = 0.0f;

  for (; v < vectors; v += kThreads) {
    // Each weight converted once, each x vector once: at 8 rows the step is near the SM's issue
    // rate, so no conversion repeats in the inner loop.
    float wf[kRows][N];
#pragma unroll
    for (int r = 0; r < kRows; ++r) vec_to_float<T>(wv[r], wf[r]);
    if (v + kThreads < vectors) load_weights(w, offset, v + kThreads, wv);  // in flight during the sums
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xf[N];
      vec_to_float<T>(load16(x + m * a.x_stride + v * N), xf);
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int i = 0; i < N; ++i) sum[r * M + m] = fmaf(xf[i], wf[r][i], sum[r * M + m]);
    }
  }

  __shared__ float partial[kWarps][kRows * M];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int shift = 5 - kLevels;
  const float total = reduce_lanes(sum, lane);
  const int value = lane >> shift;
  if ((lane & ((1 << shift) - 1)) == 0 && value < kRows * M) partial[warp][value] = total;
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
  launch(skinny_linear_kernel<T, M>, static_cast<unsigned>(blocks), kThreads, 0, stream, a);
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

// ---- The same product on the tensor cores (``launch_skinny_linear_mma``) -------------------------
// A block of kMmaWarps warps computes a tile of 16 outputs for every row (the mma's 8 columns are
// the rows; those past ``a.rows`` are zeros). Its warps take the k axis in chunks of 32 elements,
// warp w the chunks w, w + kMmaWarps, ...: in a chunk, lane (g, quarter) loads 16 bytes of the
// tile's weight rows g and g + 8 and of x's row g at its quarter, and feeds them to two m16n8k16
// mmas as if the chunk's k were permuted so that a lane's 8 consecutive elements fill its fragment
// slots. The weights and x take the same permutation, so each output is still the sum of the same
// products. A column of an mma depends on its own row of x only, so a row's bits do not depend on
// the rows beside it. The warps' tiles are added in warp order through shared memory and rounded
// once. The weights of a lane's first chunks load before ``dependent_wait``, as above.
constexpr int kMmaWarps = 8;
constexpr int kMmaUnroll = 4;  // chunks a lane has in flight
constexpr int kMmaChunk = 32;  // k elements a warp's two mmas take

// The 16-byte vectors of weight rows lo and hi at lane quarter ``quarter`` of the chunks c0,
// c0 + kMmaWarps, ...; zeros past k.
template <typename T>
__device__ __forceinline__ void load_tile_weights(const T* lo, const T* hi, int k, int c0, int quarter,
                                                  uint4 (&wl)[kMmaUnroll], uint4 (&wh)[kMmaUnroll]) {
#pragma unroll
  for (int u = 0; u < kMmaUnroll; ++u) {
    const int e = (c0 + u * kMmaWarps) * kMmaChunk + quarter * Vec16<T>::kElems;
    const bool in = e < k;
    wl[u] = in ? load16(lo + e) : make_uint4(0, 0, 0, 0);
    wh[u] = in ? load16(hi + e) : make_uint4(0, 0, 0, 0);
  }
}

template <typename T>
__global__ void __launch_bounds__(kMmaWarps * 32) skinny_linear_mma_kernel(SkinnyLinearArgs a) {
  constexpr int N = Vec16<T>::kElems;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, quarter = lane & 3;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * 16;
  // Rows past the end read the last row (in bounds) and are never written.
  const T* w_lo = static_cast<const T*>(a.w) + min(n0 + g, a.n - 1) * a.w_stride;
  const T* w_hi = static_cast<const T*>(a.w) + min(n0 + g + 8, a.n - 1) * a.w_stride;
  const bool has_row = g < a.rows;
  const T* x = static_cast<const T*>(a.x) + (has_row ? g : 0) * a.x_stride;
  const int chunks = (a.k + kMmaChunk - 1) / kMmaChunk;
  constexpr int kStride = kMmaWarps * kMmaUnroll;

  uint4 wl[kMmaUnroll], wh[kMmaUnroll];
  load_tile_weights(w_lo, w_hi, a.k, warp, quarter, wl, wh);
  dependent_wait();  // x is the kernel ahead's output

  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int c0 = warp; c0 < chunks; c0 += kStride) {
    uint4 xv[kMmaUnroll], cl[kMmaUnroll], ch[kMmaUnroll];
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const int e = (c0 + u * kMmaWarps) * kMmaChunk + quarter * N;
      xv[u] = has_row && e < a.k ? load16(x + e) : make_uint4(0, 0, 0, 0);
      cl[u] = wl[u];
      ch[u] = wh[u];
    }
    if (c0 + kStride < chunks) load_tile_weights(w_lo, w_hi, a.k, c0 + kStride, quarter, wl, wh);
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const uint32_t first[4] = {cl[u].x, ch[u].x, cl[u].y, ch[u].y};
      mma_16816<T>(d, first, xv[u].x, xv[u].y);
      const uint32_t second[4] = {cl[u].z, ch[u].z, cl[u].w, ch[u].w};
      mma_16816<T>(d, second, xv[u].z, xv[u].w);
    }
  }

  __shared__ float tiles[kMmaWarps][16][8];  // [warp][output][row]
  tiles[warp][g][quarter * 2] = d[0];
  tiles[warp][g][quarter * 2 + 1] = d[1];
  tiles[warp][g + 8][quarter * 2] = d[2];
  tiles[warp][g + 8][quarter * 2 + 1] = d[3];
  __syncthreads();
  if (threadIdx.x < 16 * 8) {
    const int r = threadIdx.x / 8, m = threadIdx.x % 8;
    if (m < a.rows && n0 + r < a.n) {
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < kMmaWarps; ++j) s += tiles[j][r][m];
      static_cast<T*>(a.out)[m * a.n + n0 + r] = float_to<T>(s);
    }
  }
}

template <typename T>
void launch_mma_for(const SkinnyLinearArgs& a, cudaStream_t stream) {
  const int64_t blocks = (a.n + 15) / 16;
  launch(skinny_linear_mma_kernel<T>, static_cast<unsigned>(blocks), kMmaWarps * 32, 0, stream, a);
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

cudaError_t launch_skinny_linear_mma(DType dtype, const SkinnyLinearArgs& a, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF16: launch_mma_for<__half>(a, stream); break;
    case DType::kBF16: launch_mma_for<__nv_bfloat16>(a, stream); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace lmpool
