// The boundary between the torch-facing host code (bindings.cpp) and the CUDA
// translation units. Nothing here includes torch, so the .cu files compile
// without ATen's heavy headers and can be built in parallel.
//
// Invariants the host side guarantees before calling a launcher:
// - every tensor lives on the current device, is 16-byte aligned, and has the
//   layout documented in lmpool/ops/reference.py (the cache and outputs are
//   contiguous; q and key/value rows only need a contiguous last dimension);
// - dtypes match (the cache dtype is the compute input dtype);
// - index tensors are int32 unless a field says otherwise.
// Launchers only enqueue work on `stream` and return the launch status; they
// never synchronize, so they are safe to capture in a CUDA graph.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace lmpool {

enum class DType { kF32, kF16, kBF16 };

inline int dtype_size(DType t) { return t == DType::kF32 ? 4 : 2; }

// Whether the decode path's kernels (norms, rotary and KV store, attention and its split merge,
// SiLU x up, the skinny linear kernels) start before the kernel ahead of them in the stream ends
// (programmatic dependent launch, common.cuh): their launch and the weights they read overlap that
// kernel's tail. One flag a process, off until bindings.cpp's set_dependent_launch turns it on
// (only where the device has compute capability 9.0 or more; an engine does, by default).
inline bool& dependent_launch_on() {
  static bool on = false;
  return on;
}

// ---------------------------------------------------------------------------
// Paged attention, one CTA per (query row, kv head [, q-head chunk], split).
// Used for decode (row == sequence) and as the general prefill path.

constexpr int kRowsThreads = 128;
// A split never gets fewer keys than this: below it the per-CTA setup and the
// cross-split reduction cost more than the parallelism they buy.
constexpr int kMinPartitionTokens = 256;

// Query heads one CTA handles; a GQA group larger than this is split in chunks.
inline int rows_heads_per_cta(int group) {
  return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8;
}

// Tokens a CTA consumes per loop iteration: (threads / lanes per token) token
// groups times the tokens each group keeps in flight. Fewer in flight when more
// heads share a CTA, to bound registers. Must match attention_rows.cuh.
constexpr int rows_unroll(int heads_per_cta) {
  return heads_per_cta <= 2 ? 8 : heads_per_cta == 4 ? 4 : 2;
}
constexpr int rows_tile_tokens(int elem_size, int head_dim, int heads_per_cta) {
  return (kRowsThreads / (head_dim / (16 / elem_size))) * rows_unroll(heads_per_cta);
}

struct AttentionRowsArgs {
  const void* q;  // [rows, q_heads, head_dim]
  int64_t q_row_stride;
  int64_t q_head_stride;
  const void* k_cache;  // [num_blocks, block_size, kv_heads, head_dim]
  const void* v_cache;
  const int* block_tables;  // [num_seqs, max_blocks]
  int64_t block_table_stride;
  const int* context_lens;     // [num_seqs]
  const int* query_start_loc;  // [num_seqs + 1]; nullptr: decode, row b is sequence b
  const int* kv_start;         // [rows] the first key each row attends to; nullptr: 0 (a cascade's suffix)
  void* out;                   // [rows, q_heads, head_dim], contiguous
  float* partial_out;          // [rows, q_heads, split_stride, head_dim] if split_stride > 1
  float* partial_lse;          // [rows, q_heads, split_stride] (log2 domain)
  int num_rows;
  int num_seqs;
  int q_heads;
  int kv_heads;
  int block_size;
  int block_shift;  // log2(block_size) if a power of two, else -1
  int max_blocks;   // block_tables.size(1): bounds every read of the table
  int num_splits;
  // Partial slots per (row, q head): num_splits, or more when a cascade's prefix pass has
  // filled the slots after this launch's. Over 1, the splits write partials (slots [0,
  // num_splits)) and the launch merges all split_stride of them; 1: the output directly.
  int split_stride;
  float scale_log2;  // softmax scale * log2(e): kernels work in the exp2 domain
};

// One translation unit per dtype (attention_rows_*.cu) so they compile in parallel.
cudaError_t launch_attention_rows_f32(int head_dim, const AttentionRowsArgs& args, cudaStream_t stream);
cudaError_t launch_attention_rows_f16(int head_dim, const AttentionRowsArgs& args, cudaStream_t stream);
cudaError_t launch_attention_rows_bf16(int head_dim, const AttentionRowsArgs& args, cudaStream_t stream);

// CTAs of the row kernel for (dtype, head_dim, GQA group) one SM holds at once; 0 if unknown.
int attention_rows_ctas_per_sm_f32(int head_dim, int group);
int attention_rows_ctas_per_sm_f16(int head_dim, int group);
int attention_rows_ctas_per_sm_bf16(int head_dim, int group);

inline int attention_rows_ctas_per_sm(DType dtype, int head_dim, int group) {
  switch (dtype) {
    case DType::kF32: return attention_rows_ctas_per_sm_f32(head_dim, group);
    case DType::kF16: return attention_rows_ctas_per_sm_f16(head_dim, group);
    default: return attention_rows_ctas_per_sm_bf16(head_dim, group);
  }
}

inline cudaError_t launch_attention_rows(DType dtype, int head_dim, const AttentionRowsArgs& args,
                                         cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32: return launch_attention_rows_f32(head_dim, args, stream);
    case DType::kF16: return launch_attention_rows_f16(head_dim, args, stream);
    default: return launch_attention_rows_bf16(head_dim, args, stream);
  }
}

// ---------------------------------------------------------------------------
// Prefill over a cached prefix on tensor cores (fp16/bf16, head_dim 64/128).
// One CTA per (64-row tile of (token, q head) pairs of one sequence, kv head,
// split of the keys). Splits exist for short queries over long contexts: a
// 64-token question over 16k cached tokens is 2 tiles x 8 kv heads, 16 CTAs
// that would each walk all 16k keys alone.

constexpr int kPrefillRows = 64;
// A prefill split never gets fewer keys than this (8 key tiles): below it the
// partial-output traffic and the merge cost more than the parallelism buys.
constexpr int kMinPrefillSplitKeys = 512;

struct PrefillArgs {
  const void* q;  // [total_q, q_heads, head_dim]; both strides multiples of 8
  int64_t q_row_stride;
  int64_t q_head_stride;
  const void* k_cache;
  const void* v_cache;
  const int* block_tables;
  int64_t block_table_stride;
  const int* context_lens;
  const int* query_start_loc;
  // [total_q] the q (and out) row of each query token; nullptr: the token's own index. A
  // cascade's prefix pass: a sequence is a group of decode rows sharing a prefix.
  const int* q_rows;
  void* out;  // [total_q, q_heads, head_dim], contiguous
  float* partial_out;  // [rows, q_heads, split_stride, head_dim] if split_stride > 1
  float* partial_lse;  // [rows, q_heads, split_stride] (log2 domain)
  int total_q;
  int num_seqs;
  int q_heads;
  int kv_heads;
  int block_size;
  int block_shift;
  int max_blocks;
  int tokens_per_tile;  // kPrefillRows / group: a tile holds whole GQA groups
  int num_tiles;        // grid size: an upper bound on the tiles of all sequences
  int num_splits;       // grid.z: each tile's keys in this many tile-aligned shares
  // Partial slots per (row, q head), this launch's from split_base on. Over 1 the splits
  // write partials; the launch merges them only when it owns every slot (split_stride ==
  // num_splits), else whoever fills the rest does (a cascade's suffix pass).
  int split_stride;
  int split_base;
  int causal;  // 0: every query sees all of its sequence's keys (a cascade's shared prefix)
  float scale_log2;
};

cudaError_t launch_prefill_mma_f16(int head_dim, const PrefillArgs& args, cudaStream_t stream);
cudaError_t launch_prefill_mma_bf16(int head_dim, const PrefillArgs& args, cudaStream_t stream);

inline cudaError_t launch_prefill_mma(DType dtype, int head_dim, const PrefillArgs& args,
                                      cudaStream_t stream) {
  return dtype == DType::kF16 ? launch_prefill_mma_f16(head_dim, args, stream)
                              : launch_prefill_mma_bf16(head_dim, args, stream);
}

// ---------------------------------------------------------------------------
// KV-cache write by slot, and whole-block gather/scatter across all layers.

struct WriteKVArgs {
  const void* key;  // [tokens, kv_heads, head_dim]
  const void* value;
  int64_t key_row_stride, key_head_stride;  // elements
  int64_t value_row_stride, value_head_stride;
  void* k_cache;  // [num_blocks, block_size, kv_heads, head_dim]
  void* v_cache;
  const void* slot_mapping;  // [tokens], int32 or int64
  bool slots_int64;
  int num_tokens;
  int kv_heads;
  int head_dim;
  int elem_size;
  int64_t num_slots;  // num_blocks * block_size: larger slots are skipped
  bool vectorized;    // all rows 16-byte aligned: copy in 16-byte vectors
};

cudaError_t launch_write_kv(const WriteKVArgs& args, cudaStream_t stream);

struct BlockCopyArgs {
  void* kv_cache;         // [planes = layers * 2, num_blocks, block_bytes]
  void* payload;          // [planes, num_ids, block_bytes]
  const void* block_ids;  // [num_ids], int32 or int64
  bool ids_int64;
  int64_t planes;
  int64_t num_blocks;
  int64_t num_ids;
  int64_t block_bytes;  // multiple of 16
  int64_t max_ctas;     // 0: one CTA per tile; else at most this many, each looping over tiles
  bool keep_payload;    // pack: plain stores, so a reader right after (a send) may find the
                        // payload in L2; false: evict-first stores (read once, later)
};

// pack: cache -> payload (blocks with an id outside [0, num_blocks) read as zeros);
// unpack: payload -> cache (such blocks are skipped).
cudaError_t launch_pack_kv(const BlockCopyArgs& args, cudaStream_t stream);
cudaError_t launch_unpack_kv(const BlockCopyArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------------------
// RMSNorm of rows (optionally after a residual add), and RMSNorm then rotary embedding of q/k
// heads (norm_rope.cu); SwiGLU's SiLU(gate) * up (silu_mul.cu).

constexpr int kMaxRopeHeadDim = 512;  // a head's row is staged in shared memory

struct RmsNormArgs {
  const void* x;  // [rows, dim], last dimension contiguous
  int64_t x_row_stride;
  const void* residual;  // null, or [rows, dim] added to x first (last dimension contiguous)
  int64_t residual_row_stride;
  void* sum_out;       // with residual: [rows, dim], contiguous, x + residual in the dtype of x
                       // (out and sum_out never alias x or residual: the kernels read those twice)
  const void* weight;  // [dim], the dtype of x
  void* out;           // [rows, dim], contiguous
  int64_t rows;
  int dim;
  float eps;
};

struct SiluMulArgs {
  const void* gate_up;  // [rows, 2 * dim]: gate then up, last dimension contiguous
  int64_t row_stride;
  void* out;  // [rows, dim], contiguous
  int64_t rows;
  int dim;
};

struct QkNormRopeArgs {
  const void* x;  // [tokens, heads, dim], last dimension contiguous
  int64_t x_token_stride, x_head_stride;
  const void* weight;  // [dim], the dtype of x
  const float* cos;    // [num_positions, dim / 2], contiguous
  const float* sin;
  const void* positions;  // [tokens], int32 or int64
  bool positions_int64;
  int64_t num_positions;
  void* out;  // [tokens, heads, dim], contiguous
  int tokens;
  int heads;
  int dim;  // even, at most kMaxRopeHeadDim
  float eps;
};

struct QkvNormRopeStoreArgs {
  const void* qkv;  // [tokens, (heads + 2 * kv_heads) * dim]: q heads, k heads, v heads
  int64_t qkv_token_stride;
  const void* q_weight;  // [dim] each, the dtype of qkv
  const void* k_weight;
  const float* cos;  // [num_positions, dim / 2], contiguous
  const float* sin;
  const void* positions;  // [tokens], int32 or int64
  bool positions_int64;
  int64_t num_positions;
  void* q_out;    // [tokens, heads, dim], contiguous
  void* k_cache;  // [num_blocks, block_size, kv_heads, dim], contiguous, the dtype of qkv
  void* v_cache;
  const void* slot_mapping;  // [tokens], int32 or int64; -1 (padding) stores nothing
  bool slots_int64;
  int64_t num_slots;  // num_blocks * block_size: larger slots are skipped
  int tokens;
  int heads;
  int kv_heads;
  int dim;  // even, at most kMaxRopeHeadDim
  float eps;
};

cudaError_t launch_rms_norm(DType dtype, const RmsNormArgs& args, cudaStream_t stream);
cudaError_t launch_qkv_norm_rope_store(DType dtype, const QkvNormRopeStoreArgs& args, cudaStream_t stream);
cudaError_t launch_qk_norm_rope(DType dtype, const QkNormRopeArgs& args, cudaStream_t stream);
cudaError_t launch_silu_mul(DType dtype, const SiluMulArgs& args, cudaStream_t stream);

// y[rows, n] = x[rows, k] @ w[n, k]^T for a few rows (``kernels/skinny_linear.cu``).
constexpr int kSkinnyMaxRows = 8;
// ``linear`` sends it steps of at most this many rows, and those of up to kSkinnyMaxRows to
// ``launch_skinny_linear_mma``. On an H100 (the kernel benchmark's ``linear`` case, 0.6B shapes)
// the kernel beat cuBLAS and the tensor-core kernel at 1 and 2 rows in every projection (0.036
// against 0.042 ms a layer at 1 row); the tensor-core kernel beat both at 4 and 8 rows over a
// layer's four projections (0.0415 against cuBLAS's 0.0424 ms at 4 rows, 0.0413 against 0.0429
// at 8) and over the LM head's 151,936 outputs (0.115 against 0.124 ms at 4, 0.116 against 0.125
// at 8), where this kernel lost from 4 rows. Both give a row the same bits whatever rows are
// beside it, so an eager step of 3 rows and its CUDA graph padded to 4, or of 5-7 and the graph
// padded to 8, give the same tokens (cuBLAS at different row counts need not).
constexpr int kSkinnyLinearRows = 2;
struct SkinnyLinearArgs {
  const void* x;  // [rows, k], last dimension contiguous
  int64_t x_stride;
  const void* w;  // [n, k], last dimension contiguous
  int64_t w_stride;
  void* out;  // [rows, n], contiguous
  int rows;  // 1..kSkinnyMaxRows
  int k;  // a multiple of 8
  int64_t n;
};
cudaError_t launch_skinny_linear(DType dtype, const SkinnyLinearArgs& args, cudaStream_t stream);
// The same product on the tensor cores (m16n8k16, 16 outputs a block): ``linear``'s for 3-8 rows.
cudaError_t launch_skinny_linear_mma(DType dtype, const SkinnyLinearArgs& args, cudaStream_t stream);

}  // namespace lmpool
