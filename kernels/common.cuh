// Shared device helpers for LMPool's kernels: 16-byte vector loads and the
// conversions between the cache dtypes (fp32, fp16, bf16) and fp32 math.
//
// Invariant: every "vector" here is exactly 16 bytes (a uint4), so a vector
// holds 4 fp32 or 8 fp16/bf16 elements; callers guarantee 16-byte alignment.
#pragma once

#include <cstdint>
#include <utility>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "launchers.h"

namespace lmpool {

// Programmatic dependent launch (compute capability 9.0 and later): a kernel started by ``launch``
// below while ``dependent_launch_on()`` may begin while the kernel before it in its stream still
// runs. Every CTA of such a kernel calls ``dependent_wait()`` before it reads anything an earlier
// kernel wrote, before it writes anything, and before it returns: a CTA that returned first could
// let its grid end before the grid it depends on, and the kernel after it would then not wait for
// that one. Before the wait a kernel reads only what no kernel writes (weights). After it, the
// next kernel may start (at most one kernel waits ahead of the one running).
__device__ __forceinline__ void dependent_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ``kernel<<<grid, block, smem, stream>>>(args...)``, started early as above when
// ``dependent_launch_on()``; else a plain launch. Returns the launch's status.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute early[1];
  early[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = early;
  config.numAttrs = dependent_launch_on() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <typename T>
struct Vec16 {
  static constexpr int kElems = 16 / sizeof(T);
};

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Whether a pointer may be read or written as 16-byte vectors (launchers pick their kernels by it).
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Read-only, L1-cached 16-byte load: K/V rows and block-table entries are never
// written while a kernel runs, so the non-coherent path is safe.
__device__ __forceinline__ uint4 load16(const void* ptr) {
  return __ldg(reinterpret_cast<const uint4*>(ptr));
}

// Convert one 16-byte vector to fp32 lanes.
__device__ __forceinline__ void to_float(const uint4& v, float (&out)[4]) {
  out[0] = __uint_as_float(v.x);
  out[1] = __uint_as_float(v.y);
  out[2] = __uint_as_float(v.z);
  out[3] = __uint_as_float(v.w);
}

__device__ __forceinline__ float2 pair_to_float2(uint32_t bits, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}

__device__ __forceinline__ float2 pair_to_float2(uint32_t bits, __nv_bfloat16) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}

template <typename T>
__device__ __forceinline__ void to_float(const uint4& v, float (&out)[8]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = pair_to_float2(words[i], T{});
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// Dispatch helper so kernels can write `vec_to_float<T>(v, arr)` for any T.
template <typename T, int N>
__device__ __forceinline__ void vec_to_float(const uint4& v, float (&out)[N]) {
  if constexpr (sizeof(T) == 4) {
    to_float(v, out);
  } else {
    to_float<T>(v, out);
  }
}

template <typename T>
__device__ __forceinline__ float scalar_to_float(T x);

// Two fp32 values packed into one 32-bit register of 16-bit elements (each rounded to
// nearest), the operand format of the tensor-core mma instructions.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack_pair<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack_pair<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// fp32 lanes to one 16-byte vector of T, each rounded to nearest: ``vec_to_float``'s inverse.
template <typename T, int N>
__device__ __forceinline__ uint4 float_to_vec(const float (&f)[N]) {
  if constexpr (sizeof(T) == 4) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  } else {
    return make_uint4(pack_pair<T>(f[0], f[1]), pack_pair<T>(f[2], f[3]), pack_pair<T>(f[4], f[5]),
                      pack_pair<T>(f[6], f[7]));
  }
}
template <>
__device__ __forceinline__ float scalar_to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float scalar_to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float scalar_to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T float_to(float x);
template <>
__device__ __forceinline__ float float_to<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half float_to<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 float_to<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// d += a (16 x 16, row-major fragments) * b (16 x 8, column fragments) on the tensor cores, fp32
// accumulators (mma.sync m16n8k16; sm_80 and later).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace lmpool
