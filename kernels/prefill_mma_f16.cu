// fp16 instantiations of the tensor-core prefill kernel (prefill_mma.cuh).
#include "prefill_mma.cuh"

namespace lmpool {

cudaError_t launch_prefill_mma_f16(int head_dim, const PrefillArgs& args, cudaStream_t stream) {
  return launch_prefill_for<__half>(head_dim, args, stream);
}

}  // namespace lmpool
