// bf16 instantiations of the tensor-core prefill kernel (prefill_mma.cuh).
#include "prefill_mma.cuh"

namespace lmpool {

cudaError_t launch_prefill_mma_bf16(int head_dim, const PrefillArgs& args, cudaStream_t stream) {
  return launch_prefill_for<__nv_bfloat16>(head_dim, args, stream);
}

}  // namespace lmpool
