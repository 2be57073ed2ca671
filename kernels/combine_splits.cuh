// Merge of split-K partial attention outputs (flash-decoding's second pass),
// shared by the decode rows kernel and the tensor-core prefill kernel.
//
// Layout: partial_out [rows, q_heads, num_splits, D] holds each split's
// normalized output, partial_lse [rows, q_heads, num_splits] its log2-sum-exp
// in the kernels' exp2 domain. A split that saw no key writes -inf and no
// output; the merge skips it, and a row every split skipped reads as zeros.
#pragma once

#include <cmath>

#include "common.cuh"

namespace lmpool {

// Merge the splits of one (row, q head): grid (rows, q_heads), D threads.
template <typename T, int D>
__global__ void __launch_bounds__(D)
    combine_splits_kernel(const float* __restrict__ partial_out,
                          const float* __restrict__ partial_lse, T* __restrict__ out,
                          int num_splits) {
  dependent_wait();
  const int64_t rh = (int64_t)blockIdx.x * gridDim.y + blockIdx.y;
  const int d = threadIdx.x;
  const float* lse = partial_lse + rh * num_splits;
  float max_lse = -INFINITY;
  for (int s = 0; s < num_splits; ++s) max_lse = fmaxf(max_lse, lse[s]);
  float sum = 0.f, o = 0.f;
  if (max_lse != -INFINITY) {
    for (int s = 0; s < num_splits; ++s) {
      const float ls = lse[s];
      // Empty splits never wrote partial_out: skip them rather than weigh garbage by 0.
      if (ls == -INFINITY) continue;
      const float w = exp2f(ls - max_lse);
      sum += w;
      o = fmaf(w, partial_out[(rh * num_splits + s) * D + d], o);
    }
  }
  out[rh * D + d] = float_to<T>(sum > 0.f ? o / sum : 0.f);
}

// Enqueue the merge of `rows` x `q_heads` outputs from `num_splits` partials.
template <typename T, int D>
cudaError_t launch_combine_splits(const float* partial_out, const float* partial_lse, void* out,
                                  int rows, int q_heads, int num_splits, cudaStream_t stream) {
  return launch(combine_splits_kernel<T, D>, dim3(rows, q_heads), D, 0, stream, partial_out, partial_lse,
                static_cast<T*>(out), num_splits);
}

}  // namespace lmpool
