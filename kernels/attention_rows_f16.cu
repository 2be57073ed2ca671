// fp16 instantiations of the paged row-attention kernels (attention_rows.cuh).
// One file per dtype so the JIT build compiles them in parallel.
#include "attention_rows.cuh"

namespace lmpool {

cudaError_t launch_attention_rows_f16(int head_dim, const AttentionRowsArgs& args,
                                      cudaStream_t stream) {
  return launch_rows_for<__half>(head_dim, args, stream);
}

int attention_rows_ctas_per_sm_f16(int head_dim, int group) {
  return rows_ctas_per_sm_for<__half>(head_dim, group);
}

}  // namespace lmpool
