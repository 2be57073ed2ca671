// bf16 instantiations of the paged row-attention kernels (attention_rows.cuh).
// One file per dtype so the JIT build compiles them in parallel.
#include "attention_rows.cuh"

namespace lmpool {

cudaError_t launch_attention_rows_bf16(int head_dim, const AttentionRowsArgs& args,
                                       cudaStream_t stream) {
  return launch_rows_for<__nv_bfloat16>(head_dim, args, stream);
}

int attention_rows_ctas_per_sm_bf16(int head_dim, int group) {
  return rows_ctas_per_sm_for<__nv_bfloat16>(head_dim, group);
}

}  // namespace lmpool
