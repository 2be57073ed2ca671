// SwiGLU's gating, SiLU(gate) * up, in one kernel where torch runs two (a SiLU, then a
// multiply reading its result back): the MLP's input is the fused gate/up projection's
// output, gate in the first half of each row and up in the second.
//
// Numerics follow torch's two kernels in the model dtype, rounding for rounding: SiLU in fp32
// as x / (1 + exp(-x)) (IEEE division and expf, no fast-math), rounded to the dtype; the
// product of that and up in fp32, rounded again. The _rn intrinsics keep the compiler from
// fusing them into FMAs, which torch's separate kernels never do.
//
// Layout: one thread per 16-byte vector of the output where the rows allow it (alignment and
// width checked by the launcher), else one per element; rows through a stride.
#include "common.cuh"
#include "launchers.h"

namespace lmpool {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ float gated(float gate, float up) {
  const float silu = scalar_to_float<T>(float_to<T>(__fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate)))));
  return __fmul_rn(silu, up);
}

// Element (row, i) of the output per thread, i over dim.
template <typename T>
__global__ void silu_mul_kernel(SiluMulArgs a) {
  dependent_wait();
  const int64_t total = a.rows * a.dim;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = k / a.dim;
    const int i = static_cast<int>(k % a.dim);
    const T* in = static_cast<const T*>(a.gate_up) + row * a.row_stride;
    static_cast<T*>(a.out)[k] = float_to<T>(gated<T>(scalar_to_float<T>(in[i]), scalar_to_float<T>(in[a.dim + i])));
  }
}

// ``silu_mul_kernel`` 16 bytes at a time: vector v of a row's output.
template <typename T>
__global__ void silu_mul_vec_kernel(SiluMulArgs a) {
  constexpr int N = Vec16<T>::kElems;
  dependent_wait();
  const int vectors = a.dim / N;
  const int64_t total = a.rows * vectors;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = k / vectors;
    const int v = static_cast<int>(k % vectors);
    const T* in = static_cast<const T*>(a.gate_up) + row * a.row_stride;
    float gate[N], up[N];
    vec_to_float<T>(load16(in + v * N), gate);
    vec_to_float<T>(load16(in + a.dim + v * N), up);
#pragma unroll
    for (int i = 0; i < N; ++i) gate[i] = gated<T>(gate[i], up[i]);
    reinterpret_cast<uint4*>(static_cast<T*>(a.out) + row * a.dim)[v] = float_to_vec<T>(gate);
  }
}

template <typename T>
void launch_for(const SiluMulArgs& a, cudaStream_t stream) {
  constexpr int N = Vec16<T>::kElems;
  const bool vectors = a.dim % N == 0 && a.row_stride % N == 0 && aligned16(a.gate_up) && aligned16(a.out);
  const int64_t work = vectors ? a.rows * (a.dim / N) : a.rows * a.dim;
  // Enough blocks to fill any GPU several times over; the grid-stride loops take the rest.
  const int blocks = static_cast<int>(work / kThreads + 1 < 65536 ? work / kThreads + 1 : 65536);
  if (vectors) {
    launch(silu_mul_vec_kernel<T>, blocks, kThreads, 0, stream, a);
  } else {
    launch(silu_mul_kernel<T>, blocks, kThreads, 0, stream, a);
  }
}

}  // namespace

cudaError_t launch_silu_mul(DType dtype, const SiluMulArgs& a, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32: launch_for<float>(a, stream); break;
    case DType::kF16: launch_for<__half>(a, stream); break;
    default: launch_for<__nv_bfloat16>(a, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace lmpool
