// Torch-facing entry points of LMPool's CUDA kernels and their Python module.
//
// This file owns input validation (every check names the argument and says
// what was expected), output and workspace allocation, and the launch
// heuristics; the .cu files only enqueue kernels. Nothing here reads device
// memory from the host or synchronizes: launch shapes come from tensor shapes
// alone, so every entry point can be captured in a CUDA graph. Workspaces come
// from torch's caching allocator (a capture's private pool during capture).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <climits>
#include <tuple>

#include "launchers.h"

namespace lmpool {
namespace {

constexpr double kLog2E = 1.4426950408889634;  // the kernels use exp2: exp(x) = exp2(x * log2(e))

// Messages format numbers, shapes and devices into strings here instead of
// streaming them through c10::str: on the CUDA image, streaming an integer
// from inside this JIT-built module crashed in libstdc++'s number formatting
// (the compiler's headers and the libstdc++ loaded at run time disagree), so
// only character strings ever reach an ostream from this file.
std::string num(int64_t v) { return std::to_string(v); }

std::string shape(at::IntArrayRef dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

std::string dev(const at::Device& d) { return d.str(); }

const char* dtype_name(const at::Tensor& t) { return c10::toString(t.scalar_type()); }

DType dtype_of(at::ScalarType type, const char* name) {
  switch (type) {
    case at::kFloat: return DType::kF32;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    default:
      TORCH_CHECK(false, name, " must be float32, float16 or bfloat16, got ", c10::toString(type));
  }
}

DType dtype_of(const at::Tensor& t, const char* name) { return dtype_of(t.scalar_type(), name); }

void check_device(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got a tensor on ", dev(t.device()));
  TORCH_CHECK(t.device() == device, name, " is on ", dev(t.device()), " but the other inputs are on ",
              dev(device));
}

bool is_aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

void check_aligned16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(is_aligned16(t), name,
              "'s data must be 16-byte aligned for vector access (a storage offset breaks it)");
}

void check_int32(const at::Tensor& t, const char* name, int64_t dims, const at::Device& device) {
  check_device(t, name, device);
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", dtype_name(t));
  TORCH_CHECK(t.dim() == dims, name, " must be ", num(dims), "-D, got shape ", shape(t.sizes()));
  TORCH_CHECK(t.stride(-1) == 1, name, "'s last dimension must be contiguous, got strides ",
              shape(t.strides()));
}

void check_ids(const at::Tensor& t, const char* name, const at::Device& device) {
  check_device(t, name, device);
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
              " must be int32 or int64, got ", dtype_name(t));
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), name, " must be a contiguous 1-D tensor, got shape ",
              shape(t.sizes()), " strides ", shape(t.strides()));
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, ": kernel launch failed: ", cudaGetErrorString(err));
}

int block_shift(int64_t block_size) {
  if (block_size <= 0 || (block_size & (block_size - 1)) != 0) return -1;
  int shift = 0;
  while ((int64_t{1} << shift) < block_size) ++shift;
  return shift;
}

struct CacheShape {
  int64_t num_blocks, block_size, kv_heads, head_dim;
};

// Checks shared by decode and prefill attention.
CacheShape check_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& context_lens) {
  const auto device = q.device();
  check_device(q, "q", device);
  check_device(k_cache, "k_cache", device);
  check_device(v_cache, "v_cache", device);
  dtype_of(q, "q");
  TORCH_CHECK(q.dim() == 3, "q must be [tokens, q_heads, head_dim], got shape ", shape(q.sizes()));
  TORCH_CHECK(q.stride(2) == 1, "q's head_dim must be contiguous, got strides ", shape(q.strides()));
  TORCH_CHECK(k_cache.dim() == 4,
              "k_cache must be [num_blocks, block_size, kv_heads, head_dim], got shape ",
              shape(k_cache.sizes()));
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache has shape ", shape(v_cache.sizes()),
              " but k_cache has shape ", shape(k_cache.sizes()));
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous (pass kv_cache[layer, 0] and kv_cache[layer, 1])");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q, k_cache and v_cache must share a dtype, got ", dtype_name(q), ", ",
              dtype_name(k_cache), " and ", dtype_name(v_cache));
  CacheShape c{k_cache.size(0), k_cache.size(1), k_cache.size(2), k_cache.size(3)};
  TORCH_CHECK(c.head_dim == 64 || c.head_dim == 128, "head_dim must be 64 or 128, got ", num(c.head_dim));
  TORCH_CHECK(q.size(2) == c.head_dim, "q's head_dim is ", num(q.size(2)), " but the cache's is ",
              num(c.head_dim));
  TORCH_CHECK(c.kv_heads > 0 && q.size(1) % c.kv_heads == 0, "q_heads (", num(q.size(1)),
              ") must be a positive multiple of kv_heads (", num(c.kv_heads), ")");
  check_aligned16(k_cache, "k_cache");
  check_aligned16(v_cache, "v_cache");
  check_int32(block_tables, "block_tables", 2, device);
  check_int32(context_lens, "context_lens", 1, device);
  TORCH_CHECK(context_lens.size(0) == block_tables.size(0), "context_lens has ",
              num(context_lens.size(0)), " entries but block_tables has ", num(block_tables.size(0)),
              " rows");
  TORCH_CHECK(block_tables.size(1) * c.block_size < INT_MAX,
              "block_tables covers more than 2^31 tokens per sequence");
  return c;
}

// A device attribute, read once per device: the runtime call is cheap but not
// free, and the answer never changes.
int device_attribute(cudaDeviceAttr attr, int device) {
  static std::array<std::array<int, 2>, 64> cache{};  // [device] -> {sm count, cc major}, 0 = unknown
  const int slot = attr == cudaDevAttrMultiProcessorCount ? 0 : 1;
  TORCH_CHECK(device >= 0 && device < 64, "device index ", num(device), " out of range");
  int& value = cache[device][slot];
  if (value == 0) {
    int v = 0;
    const cudaError_t err = cudaDeviceGetAttribute(&v, attr, device);
    TORCH_CHECK(err == cudaSuccess, "cudaDeviceGetAttribute failed: ", cudaGetErrorString(err));
    value = v;
  }
  return value;
}

int num_sms(int device) { return device_attribute(cudaDevAttrMultiProcessorCount, device); }

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Splits of the keys per row: enough CTAs to keep every SM streaming when few
// sequences run, but never below kMinPartitionTokens keys per split for the
// longest row the block table can describe. `slots` is how many CTAs the SMs
// hold at once (0: unknown): a launch runs in waves of that many.
int64_t choose_splits(int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t max_tokens,
                      int sms, int64_t slots) {
  const int64_t group = q_heads / kv_heads;
  const int64_t heads_per_cta = rows_heads_per_cta(static_cast<int>(group));
  const int64_t base = std::max<int64_t>(1, rows * kv_heads * ((group + heads_per_cta - 1) / heads_per_cta));
  // Few rows: about six CTAs an SM, so that every SM streams keys. Once (seq,
  // kv head) pairs alone fill that, extra splits only add partial-output
  // traffic: batch 128 x 8 kv heads and up get none on the H200.
  const int64_t target = 6LL * sms;
  const int64_t useful = std::max<int64_t>(1, (max_tokens + kMinPartitionTokens - 1) / kMinPartitionTokens);
  const int64_t cap = std::min<int64_t>(useful, 256);
  int64_t splits = std::clamp<int64_t>((target + base - 1) / base, 1, cap);
  if (slots <= 0) return splits;
  // The rows fit one wave: splitting them past it only adds a second wave
  // (64 rows x 8 heads on the H200's 528 slots: 1 split 0.140 ms, 2 0.147).
  if (base <= slots && base * splits > slots) splits = std::max<int64_t>(1, slots / base);
  const int64_t tail = base * splits % slots;
  if (base * splits <= slots || tail == 0 || 2 * tail > slots) return splits;
  // A short last wave: its few CTAs start when the rest end and run nearly
  // alone (33 rows x 8 heads on 128 slots, 32 SMs under MPS, leave 8 CTAs for a
  // third wave: ~15 % of a 16k-context step, where reading their keys at full
  // bandwidth would add 3 %). With at least four slots' worth of CTAs, what is left over
  // is short. A last wave over half full costs less than the splits would.
  return std::clamp<int64_t>((4 * slots + base - 1) / base, splits, std::max(splits, cap));
}

// CTAs the SMs of `device` hold at once for the row kernel of these shapes: its
// occupancy (asked once per instance) times the SMs this process may use.
int64_t rows_slots(DType dtype, int64_t head_dim, int64_t group, int device) {
  static std::array<std::array<int, 4>, 6> cache{};  // [dtype * 2 + (head_dim == 128)][heads/CTA index]
  const int hpc = rows_heads_per_cta(static_cast<int>(group));
  const int index = hpc == 1 ? 0 : hpc == 2 ? 1 : hpc == 4 ? 2 : 3;
  int& ctas = cache[static_cast<int>(dtype) * 2 + (head_dim == 128)][index];
  if (ctas == 0) ctas = attention_rows_ctas_per_sm(dtype, static_cast<int>(head_dim), static_cast<int>(group));
  return static_cast<int64_t>(ctas) * num_sms(device);
}

// Splits of the keys per prefill tile: only when the tiles alone leave SMs idle
// (a few short queries over long contexts), enough for two waves at the two
// CTAs per SM the kernel's registers allow (215 a thread at head_dim 128 on
// sm_90), and never below
// kMinPrefillSplitKeys keys per split for the longest context the block table
// can describe. A large prefill gets 1: its tiles fill the GPU already.
int64_t choose_prefill_splits(int64_t tiles, int64_t kv_heads, int64_t max_tokens, int sms) {
  const int64_t base = std::max<int64_t>(1, tiles * kv_heads);
  const int64_t target = 4LL * sms;
  const int64_t useful = std::max<int64_t>(1, max_tokens / kMinPrefillSplitKeys);
  return std::clamp<int64_t>(target / base, 1, std::min<int64_t>(useful, 256));
}

// The split count a launch uses: the caller's, or else the one the shapes choose.
int64_t pick_splits(int64_t requested, int64_t chosen, const char* what) {
  const int64_t splits = requested > 0 ? requested : chosen;
  TORCH_CHECK(splits < 65536, what, ": num_splits must be below 65536, got ", num(splits));
  return splits;
}

// The partial outputs and log-sum-exps that a launch with key splits merges (none for one
// split), held by the caller until the launch is queued.
struct SplitWorkspace {
  at::Tensor out, lse;
  SplitWorkspace(const at::Tensor& q, int64_t rows, int64_t splits, int64_t head_dim) {
    if (splits <= 1) return;
    const auto f32 = q.options().dtype(at::kFloat);
    out = at::empty({rows, q.size(1), splits, head_dim}, f32);
    lse = at::empty({rows, q.size(1), splits}, f32);
  }
  float* out_ptr() const { return out.defined() ? out.data_ptr<float>() : nullptr; }
  float* lse_ptr() const { return lse.defined() ? lse.data_ptr<float>() : nullptr; }
};

// The prefill kernel's query tiles: enough for each sequence's ceil(len / tokens_per_tile).
int64_t prefill_tiles(int64_t total_q, int64_t num_seqs, int64_t tokens_per_tile) {
  return (total_q + num_seqs * (tokens_per_tile - 1)) / tokens_per_tile;
}

// The fields both attention kernels' arguments share (AttentionRowsArgs and PrefillArgs name
// them alike): `q` over the cache, these tables and lengths.
template <typename Args>
Args attention_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& context_lens, const CacheShape& c,
                    double scale) {
  Args a{};
  a.q = q.data_ptr();
  a.q_row_stride = q.stride(0);
  a.q_head_stride = q.stride(1);
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int>();
  a.block_table_stride = block_tables.stride(0);
  a.context_lens = context_lens.data_ptr<int>();
  a.num_seqs = static_cast<int>(block_tables.size(0));
  a.q_heads = static_cast<int>(q.size(1));
  a.kv_heads = static_cast<int>(c.kv_heads);
  a.block_size = static_cast<int>(c.block_size);
  a.block_shift = block_shift(c.block_size);
  a.max_blocks = static_cast<int>(block_tables.size(1));
  a.scale_log2 = static_cast<float>(scale * kLog2E);
  return a;
}

// The row kernel's arguments: all but the query layout, the outputs and the splits.
AttentionRowsArgs rows_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            const CacheShape& c, double scale) {
  auto a = attention_args<AttentionRowsArgs>(q, k_cache, v_cache, block_tables, context_lens, c, scale);
  a.num_rows = static_cast<int>(q.size(0));
  return a;
}

// The tensor-core prefill kernel's arguments for the `total_q` query tokens of `q` in the
// sequences `query_start_loc` bounds, causal: all but the outputs and the splits.
PrefillArgs prefill_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         const at::Tensor& query_start_loc, const CacheShape& c, double scale,
                         int64_t total_q, const char* what) {
  auto a = attention_args<PrefillArgs>(q, k_cache, v_cache, block_tables, context_lens, c, scale);
  a.query_start_loc = query_start_loc.data_ptr<int>();
  a.tokens_per_tile = static_cast<int>(kPrefillRows / (q.size(1) / c.kv_heads));
  const int64_t tiles = prefill_tiles(total_q, block_tables.size(0), a.tokens_per_tile);
  TORCH_CHECK(tiles < INT_MAX && c.kv_heads < 65536, what, ": batch too large");
  a.num_tiles = static_cast<int>(tiles);
  a.total_q = static_cast<int>(total_q);
  a.causal = 1;
  return a;
}

// Whether q's dtype, layout and device let the tensor-core prefill kernel run for a GQA group.
bool tensor_cores_fit(const at::Tensor& q, int64_t group) {
  return dtype_of(q, "q") != DType::kF32 && group <= kPrefillRows &&
         device_attribute(cudaDevAttrComputeCapabilityMajor, q.get_device()) >= 8 && q.stride(0) % 8 == 0 &&
         q.stride(1) % 8 == 0 && is_aligned16(q);
}

at::Tensor run_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& context_lens,
                    const at::Tensor* query_start_loc, const CacheShape& c, double scale,
                    int64_t num_splits, const char* what) {
  const int64_t rows = q.size(0), q_heads = q.size(1);
  auto out = at::empty({rows, q_heads, c.head_dim}, q.options());
  if (rows == 0) return out;
  const int64_t group = q_heads / c.kv_heads;
  TORCH_CHECK(rows < INT_MAX, what, ": too many query rows (", num(rows), ")");
  TORCH_CHECK(c.kv_heads * ((group + 7) / 8) < 65536, what, ": too many kv heads");
  const int64_t max_tokens = block_tables.size(1) * c.block_size;
  const int64_t splits = pick_splits(
      num_splits,
      choose_splits(rows, q_heads, c.kv_heads, max_tokens, num_sms(q.get_device()),
                    rows_slots(dtype_of(q, "q"), c.head_dim, group, q.get_device())),
      what);

  AttentionRowsArgs a = rows_args(q, k_cache, v_cache, block_tables, context_lens, c, scale);
  a.query_start_loc = query_start_loc ? query_start_loc->data_ptr<int>() : nullptr;
  a.out = out.data_ptr();
  const SplitWorkspace workspace(q, rows, splits, c.head_dim);
  a.partial_out = workspace.out_ptr();
  a.partial_lse = workspace.lse_ptr();
  a.num_splits = a.split_stride = static_cast<int>(splits);
  check_launch(launch_attention_rows(dtype_of(q, "q"), static_cast<int>(c.head_dim), a,
                                     current_stream()),
               what);
  return out;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  int64_t num_splits) {
  const CacheShape c = check_attention(q, k_cache, v_cache, block_tables, context_lens);
  TORCH_CHECK(block_tables.size(0) == q.size(0),
              "decode takes one query per sequence: q has ", num(q.size(0)),
              " rows but block_tables has ", num(block_tables.size(0)));
  TORCH_CHECK(num_splits >= 0, "num_splits must be >= 0 (0 picks one), got ", num(num_splits));
  const c10::cuda::CUDAGuard guard(q.device());
  return run_rows(q, k_cache, v_cache, block_tables, context_lens, nullptr, c, scale, num_splits,
                  "paged_decode_attention");
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& context_lens,
                                   const at::Tensor& query_start_loc, double scale,
                                   bool use_tensor_cores, int64_t num_splits) {
  const CacheShape c = check_attention(q, k_cache, v_cache, block_tables, context_lens);
  check_int32(query_start_loc, "query_start_loc", 1, q.device());
  const int64_t num_seqs = block_tables.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1, "query_start_loc must have num_seqs + 1 = ",
              num(num_seqs + 1), " entries, got ", num(query_start_loc.size(0)));
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t total_q = q.size(0), q_heads = q.size(1);
  const int64_t group = q_heads / c.kv_heads;
  if (num_seqs == 0) return at::zeros_like(q, at::MemoryFormat::Contiguous);
  TORCH_CHECK(num_splits >= 0, "num_splits must be >= 0 (0 picks one), got ", num(num_splits));

  const DType dtype = dtype_of(q, "q");
  if (!use_tensor_cores || !tensor_cores_fit(q, group))
    return run_rows(q, k_cache, v_cache, block_tables, context_lens, &query_start_loc, c, scale, num_splits,
                    "paged_attention");

  auto out = at::empty({total_q, q_heads, c.head_dim}, q.options());
  if (total_q == 0) return out;
  PrefillArgs a = prefill_args(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, c, scale,
                               total_q, "paged_attention");
  a.out = out.data_ptr();
  const int64_t max_tokens = block_tables.size(1) * c.block_size;
  const int64_t splits = pick_splits(
      num_splits, choose_prefill_splits(a.num_tiles, c.kv_heads, max_tokens, num_sms(q.get_device())),
      "paged_attention");
  const SplitWorkspace workspace(q, total_q, splits, c.head_dim);
  a.partial_out = workspace.out_ptr();
  a.partial_lse = workspace.lse_ptr();
  a.num_splits = a.split_stride = static_cast<int>(splits);
  check_launch(launch_prefill_mma(dtype, static_cast<int>(c.head_dim), a,
                                  current_stream()),
               "paged_attention");
  return out;
}

// Decode over groups of rows that share a cached prefix (cascade attention): each group's
// shared keys are read once, on tensor cores, for all of its rows (the prefill kernel,
// non-causal, over the group's prefix_lens[g] keys of prefix_tables[g]), and each row attends
// with the row kernel to the rest of its keys, from kv_start[row] on; the two passes' partials
// merge by their log-sum-exps. prefix_rows lists the grouped rows, group by group, the groups
// bounded by prefix_starts (entries past the last group's end are never read; groups past the
// last row are empty); a row in no group has kv_start 0. The caller guarantees what only the
// device could check: a row is in a group exactly when its kv_start is above 0, and then its
// first kv_start keys are its group's prefix (the same cached blocks), at least one key short
// of its context.
at::Tensor cascade_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache, const at::Tensor& block_tables,
                                    const at::Tensor& context_lens, const at::Tensor& kv_start,
                                    const at::Tensor& prefix_tables, const at::Tensor& prefix_lens,
                                    const at::Tensor& prefix_starts, const at::Tensor& prefix_rows,
                                    double scale, int64_t num_splits, int64_t prefix_splits) {
  constexpr const char* what = "cascade_decode_attention";
  const CacheShape c = check_attention(q, k_cache, v_cache, block_tables, context_lens);
  const auto device = q.device();
  check_int32(kv_start, "kv_start", 1, device);
  check_int32(prefix_tables, "prefix_tables", 2, device);
  check_int32(prefix_lens, "prefix_lens", 1, device);
  check_int32(prefix_starts, "prefix_starts", 1, device);
  check_int32(prefix_rows, "prefix_rows", 1, device);
  const int64_t rows = q.size(0), q_heads = q.size(1), groups = prefix_lens.size(0);
  TORCH_CHECK(block_tables.size(0) == rows, what, ": one query per sequence: q has ", num(rows),
              " rows but block_tables has ", num(block_tables.size(0)));
  TORCH_CHECK(rows < INT_MAX && c.kv_heads * ((q_heads / c.kv_heads + 7) / 8) < 65536, what,
              ": too many rows or kv heads");
  TORCH_CHECK(kv_start.size(0) == rows && prefix_rows.size(0) <= rows, what,
              ": kv_start needs one entry per row (", num(rows), ") and prefix_rows at most as many, got ",
              num(kv_start.size(0)), " and ", num(prefix_rows.size(0)));
  TORCH_CHECK(prefix_tables.size(0) == groups && prefix_starts.size(0) == groups + 1, what,
              ": prefix_tables needs one row and prefix_starts groups + 1 entries for ", num(groups),
              " groups, got ", num(prefix_tables.size(0)), " and ", num(prefix_starts.size(0)));
  TORCH_CHECK(prefix_tables.size(1) * c.block_size < INT_MAX, what, ": prefix_tables covers too many tokens");
  TORCH_CHECK(num_splits >= 0 && prefix_splits >= 0, what, ": split counts must be >= 0 (0 picks one)");
  const int64_t group = q_heads / c.kv_heads;
  TORCH_CHECK(tensor_cores_fit(q, group), what,
              " reads shared prefixes on tensor cores: q must be fp16 or bf16, 16-byte aligned, with "
              "strides of multiples of 8, on a device of compute capability 8 or more");
  const c10::cuda::CUDAGuard guard(device);
  // No group: every row reads its whole context (its kv_start is 0), as plain decode does.
  if (groups == 0) return run_rows(q, k_cache, v_cache, block_tables, context_lens, nullptr, c, scale, num_splits, what);
  auto out = at::empty({rows, q_heads, c.head_dim}, q.options());
  if (rows == 0) return out;
  const int sms = num_sms(q.get_device());
  const DType dtype = dtype_of(q, "q");
  const int64_t splits = pick_splits(
      num_splits,
      choose_splits(rows, q_heads, c.kv_heads, block_tables.size(1) * c.block_size, sms,
                    rows_slots(dtype, c.head_dim, group, q.get_device())),
      what);
  PrefillArgs p = prefill_args(q, k_cache, v_cache, prefix_tables, prefix_lens, prefix_starts, c, scale,
                               prefix_rows.size(0), what);
  // As many splits as one group's tile needs to fill the GPU: the largest group decides the
  // step's time, and the host cannot see the grouping (it is on the device, and a CUDA graph
  // serves any grouping of its rows). A shorter prefix leaves its trailing splits empty.
  const int64_t prefix_splits_used = pick_splits(
      prefix_splits, choose_prefill_splits(1, c.kv_heads, prefix_tables.size(1) * c.block_size, sms), what);
  const int64_t slots = splits + prefix_splits_used;
  TORCH_CHECK(slots < 65536, what, ": too many splits (", num(slots), ")");
  const SplitWorkspace workspace(q, rows, slots, c.head_dim);
  // The prefix pass fills slots [splits, slots); the row pass [0, splits), then merges them all.
  p.q_rows = prefix_rows.data_ptr<int>();
  p.causal = 0;
  p.out = out.data_ptr();
  p.partial_out = workspace.out_ptr();
  p.partial_lse = workspace.lse_ptr();
  p.num_splits = static_cast<int>(prefix_splits_used);
  p.split_stride = static_cast<int>(slots);
  p.split_base = static_cast<int>(splits);
  if (p.num_tiles > 0)
    check_launch(launch_prefill_mma(dtype, static_cast<int>(c.head_dim), p, current_stream()), what);
  AttentionRowsArgs r = rows_args(q, k_cache, v_cache, block_tables, context_lens, c, scale);
  r.kv_start = kv_start.data_ptr<int>();
  r.out = out.data_ptr();
  r.partial_out = workspace.out_ptr();
  r.partial_lse = workspace.lse_ptr();
  r.num_splits = static_cast<int>(splits);
  r.split_stride = static_cast<int>(slots);
  check_launch(launch_attention_rows(dtype, static_cast<int>(c.head_dim), r, current_stream()), what);
  return out;
}

void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
              const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const auto device = k_cache.device();
  check_device(key, "key", device);
  check_device(value, "value", device);
  check_device(k_cache, "k_cache", device);
  check_device(v_cache, "v_cache", device);
  check_ids(slot_mapping, "slot_mapping", device);
  TORCH_CHECK(k_cache.dim() == 4,
              "k_cache must be [num_blocks, block_size, kv_heads, head_dim], got shape ",
              shape(k_cache.sizes()));
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache has shape ", shape(v_cache.sizes()),
              " but k_cache has shape ", shape(k_cache.sizes()));
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous");
  const int64_t kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  TORCH_CHECK(key.dim() == 3 && key.size(1) == kv_heads && key.size(2) == head_dim,
              "key must be [tokens, ", num(kv_heads), ", ", num(head_dim),
              "] to match the cache, got shape ", shape(key.sizes()));
  TORCH_CHECK(value.sizes() == key.sizes(), "value has shape ", shape(value.sizes()),
              " but key has shape ", shape(key.sizes()));
  TORCH_CHECK(slot_mapping.size(0) == key.size(0), "slot_mapping has ", num(slot_mapping.size(0)),
              " entries but key has ", num(key.size(0)), " tokens");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1,
              "key and value must have a contiguous head_dim, got strides ",
              shape(key.strides()), " and ", shape(value.strides()));
  const auto dt = k_cache.scalar_type();
  dtype_of(k_cache, "k_cache");
  TORCH_CHECK(v_cache.scalar_type() == dt && key.scalar_type() == dt && value.scalar_type() == dt,
              "key, value, k_cache and v_cache must share a dtype, got ", dtype_name(key), ", ",
              dtype_name(value), ", ", dtype_name(k_cache), " and ", dtype_name(v_cache));
  TORCH_CHECK(key.size(0) < INT_MAX, "write_kv: too many tokens");
  const c10::cuda::CUDAGuard guard(device);

  const int64_t esize = k_cache.element_size();
  const int64_t vec = 16 / esize;
  const bool vectorized = is_aligned16(key) && is_aligned16(value) && is_aligned16(k_cache) &&
                          is_aligned16(v_cache) && head_dim % vec == 0 &&
                          key.stride(0) % vec == 0 && key.stride(1) % vec == 0 &&
                          value.stride(0) % vec == 0 && value.stride(1) % vec == 0;
  WriteKVArgs a{};
  a.key = key.data_ptr();
  a.value = value.data_ptr();
  a.key_row_stride = key.stride(0);
  a.key_head_stride = key.stride(1);
  a.value_row_stride = value.stride(0);
  a.value_head_stride = value.stride(1);
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.slot_mapping = slot_mapping.data_ptr();
  a.slots_int64 = slot_mapping.scalar_type() == at::kLong;
  a.num_tokens = static_cast<int>(key.size(0));
  a.kv_heads = static_cast<int>(kv_heads);
  a.head_dim = static_cast<int>(head_dim);
  a.elem_size = static_cast<int>(esize);
  a.num_slots = k_cache.size(0) * k_cache.size(1);
  a.vectorized = vectorized;
  check_launch(launch_write_kv(a, current_stream()), "write_kv");
}

BlockCopyArgs block_copy_args(const at::Tensor& kv_cache, const at::Tensor& block_ids,
                              int64_t max_ctas, const char* what) {
  TORCH_CHECK(max_ctas >= 0, what, ": max_ctas must be >= 0 (0: no cap), got ", num(max_ctas));
  check_device(kv_cache, "kv_cache", kv_cache.device());
  check_ids(block_ids, "block_ids", kv_cache.device());
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2,
              "kv_cache must be [layers, 2, num_blocks, block_size, kv_heads, head_dim], got shape ",
              shape(kv_cache.sizes()));
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  check_aligned16(kv_cache, "kv_cache");
  const int64_t block_bytes =
      kv_cache.size(3) * kv_cache.size(4) * kv_cache.size(5) * kv_cache.element_size();
  TORCH_CHECK(block_bytes % 16 == 0, what, " copies 16-byte vectors, but one block of one layer is ",
              num(block_bytes), " bytes");
  BlockCopyArgs a{};
  a.kv_cache = kv_cache.data_ptr();
  a.block_ids = block_ids.data_ptr();
  a.ids_int64 = block_ids.scalar_type() == at::kLong;
  a.planes = kv_cache.size(0) * 2;
  a.num_blocks = kv_cache.size(2);
  a.num_ids = block_ids.size(0);
  a.block_bytes = block_bytes;
  a.max_ctas = max_ctas;
  const int64_t tiles = (block_bytes / 16 + 1023) / 1024;
  TORCH_CHECK(a.planes * a.num_ids * tiles < INT_MAX, what, ": too many blocks in one call (",
              num(a.num_ids), ")");
  return a;
}

at::Tensor pack_kv(const at::Tensor& kv_cache, const at::Tensor& block_ids, int64_t max_ctas,
                   bool keep_payload) {
  BlockCopyArgs a = block_copy_args(kv_cache, block_ids, max_ctas, "pack_kv");
  a.keep_payload = keep_payload;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  auto payload = at::empty({kv_cache.size(0), 2, block_ids.size(0), kv_cache.size(3),
                            kv_cache.size(4), kv_cache.size(5)},
                           kv_cache.options());
  a.payload = payload.data_ptr();
  check_launch(launch_pack_kv(a, current_stream()), "pack_kv");
  return payload;
}

void unpack_kv(const at::Tensor& kv_cache, const at::Tensor& block_ids, const at::Tensor& payload,
               int64_t max_ctas) {
  BlockCopyArgs a = block_copy_args(kv_cache, block_ids, max_ctas, "unpack_kv");
  check_device(payload, "payload", kv_cache.device());
  const std::vector<int64_t> expected{kv_cache.size(0), 2, block_ids.size(0), kv_cache.size(3),
                                      kv_cache.size(4), kv_cache.size(5)};
  TORCH_CHECK(payload.sizes() == at::IntArrayRef(expected), "payload must have shape ",
              shape(expected), " for ", num(block_ids.size(0)), " block ids, got ",
              shape(payload.sizes()));
  TORCH_CHECK(payload.scalar_type() == kv_cache.scalar_type(), "payload dtype ",
              dtype_name(payload), " differs from kv_cache dtype ", dtype_name(kv_cache));
  TORCH_CHECK(payload.is_contiguous(), "payload must be contiguous");
  check_aligned16(payload, "payload");
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  a.payload = payload.data_ptr();
  check_launch(launch_unpack_kv(a, current_stream()), "unpack_kv");
}

void check_norm_weight(const at::Tensor& weight, const at::Tensor& x, int64_t dim) {
  check_device(weight, "weight", x.device());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim && weight.is_contiguous(),
              "weight must be a contiguous [", num(dim), "] tensor, got shape ", shape(weight.sizes()));
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight dtype ", dtype_name(weight),
              " differs from the input's ", dtype_name(x));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor, got a tensor on ", dev(x.device()));
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, dim] with a contiguous last dimension, got shape ",
              shape(x.sizes()), " strides ", shape(x.strides()));
  check_norm_weight(weight, x, x.size(1));
  const DType dtype = dtype_of(x, "x");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  RmsNormArgs a{};
  a.x = x.data_ptr();
  a.x_row_stride = x.stride(0);
  a.weight = weight.data_ptr();
  a.out = out.data_ptr();
  a.rows = x.size(0);
  a.dim = static_cast<int>(x.size(1));
  a.eps = static_cast<float>(eps);
  check_launch(launch_rms_norm(dtype, a, current_stream()), "rms_norm");
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  for (const auto& [t, name] : {std::pair{x, "x"}, std::pair{residual, "residual"}}) {
    TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got a tensor on ", dev(t.device()));
    TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name,
                " must be [rows, dim] with a contiguous last dimension, got shape ", shape(t.sizes()),
                " strides ", shape(t.strides()));
  }
  check_device(residual, "residual", x.device());
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual has shape ", shape(residual.sizes()), ", x ",
              shape(x.sizes()));
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "residual dtype ", dtype_name(residual),
              " differs from the input's ", dtype_name(x));
  check_norm_weight(weight, x, x.size(1));
  const DType dtype = dtype_of(x, "x");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  auto sum = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.numel() == 0) return {out, sum};
  const c10::cuda::CUDAGuard guard(x.device());
  RmsNormArgs a{};
  a.x = x.data_ptr();
  a.x_row_stride = x.stride(0);
  a.residual = residual.data_ptr();
  a.residual_row_stride = residual.stride(0);
  a.sum_out = sum.data_ptr();
  a.weight = weight.data_ptr();
  a.out = out.data_ptr();
  a.rows = x.size(0);
  a.dim = static_cast<int>(x.size(1));
  a.eps = static_cast<float>(eps);
  check_launch(launch_rms_norm(dtype, a, current_stream()), "add_rms_norm");
  return {out, sum};
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_cuda(), "gate_up must be a CUDA tensor, got a tensor on ", dev(gate_up.device()));
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 * dim] with a contiguous last dimension, got shape ",
              shape(gate_up.sizes()), " strides ", shape(gate_up.strides()));
  TORCH_CHECK(gate_up.size(1) / 2 <= INT_MAX, "silu_mul: rows too wide");
  const DType dtype = dtype_of(gate_up, "gate_up");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(gate_up.device());
  SiluMulArgs a{};
  a.gate_up = gate_up.data_ptr();
  a.row_stride = gate_up.stride(0);
  a.out = out.data_ptr();
  a.rows = gate_up.size(0);
  a.dim = static_cast<int>(gate_up.size(1) / 2);
  check_launch(launch_silu_mul(dtype, a, current_stream()), "silu_mul");
  return out;
}

// x[rows, k] @ w[n, k]^T for at most kSkinnyMaxRows rows of fp16 or bf16, reading each weight once.
bool skinny_linear_fits(const at::Tensor& x, const at::Tensor& w) {
  return x.is_cuda() && w.is_cuda() && x.dim() == 2 && w.dim() == 2 && x.scalar_type() == w.scalar_type() &&
         (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16) && x.size(0) >= 1 &&
         x.size(0) <= kSkinnyMaxRows && x.size(1) == w.size(1) && x.size(1) % 8 == 0 && x.size(1) <= INT_MAX &&
         x.stride(1) == 1 && w.stride(1) == 1 && x.stride(0) % 8 == 0 && w.stride(0) % 8 == 0 &&
         is_aligned16(x) && is_aligned16(w) && x.device() == w.device();
}

// x @ w^T through ``launcher`` (the skinny kernel, or its tensor-core candidate) into a new tensor.
at::Tensor run_skinny(const at::Tensor& x, const at::Tensor& w, const char* what,
                      cudaError_t (*launcher)(DType, const SkinnyLinearArgs&, cudaStream_t)) {
  TORCH_CHECK(skinny_linear_fits(x, w), what, " takes x [1..", num(kSkinnyMaxRows), ", k] and w [n, k] of ",
              "one half dtype on one CUDA device, k a multiple of 8, rows contiguous and 16-byte aligned; got x ",
              shape(x.sizes()), " ", dtype_name(x), " strides ", shape(x.strides()), ", w ", shape(w.sizes()), " ",
              dtype_name(w), " strides ", shape(w.strides()));
  auto out = at::empty({x.size(0), w.size(0)}, x.options());
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  SkinnyLinearArgs a{};
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.w = w.data_ptr();
  a.w_stride = w.stride(0);
  a.out = out.data_ptr();
  a.rows = static_cast<int>(x.size(0));
  a.k = static_cast<int>(x.size(1));
  a.n = w.size(0);
  check_launch(launcher(dtype_of(x, "x"), a, current_stream()), what);
  return out;
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w) {
  return run_skinny(x, w, "skinny_linear", launch_skinny_linear);
}

at::Tensor skinny_linear_mma(const at::Tensor& x, const at::Tensor& w) {
  return run_skinny(x, w, "skinny_linear_mma", launch_skinny_linear_mma);
}

// A linear layer without bias: where a few half rows fit, the skinny kernel at up to
// kSkinnyLinearRows rows and its tensor-core kernel past that (launchers.h); else cuBLAS
// (at::linear).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w) {
  if (!skinny_linear_fits(x, w)) return at::linear(x, w);
  return x.size(0) <= kSkinnyLinearRows ? skinny_linear(x, w) : skinny_linear_mma(x, w);
}

// The rotary tables (fp32 [positions, dim / 2]) and the tokens' positions for the rows of x.
void check_rotation(const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions, const at::Tensor& x,
                    int64_t dim) {
  for (const auto& [table, name] : {std::pair{cos, "cos"}, std::pair{sin, "sin"}}) {
    check_device(table, name, x.device());
    TORCH_CHECK(table.scalar_type() == at::kFloat && table.dim() == 2 && table.size(1) == dim / 2 &&
                    table.is_contiguous(),
                name, " must be a contiguous float32 [positions, ", num(dim / 2), "] table, got ",
                dtype_name(table), " shape ", shape(table.sizes()));
  }
  TORCH_CHECK(cos.size(0) == sin.size(0) && cos.size(0) > 0, "cos and sin must have the same, non-zero, rows");
  check_ids(positions, "positions", x.device());
  TORCH_CHECK(positions.size(0) == x.size(0), "positions has ", num(positions.size(0)), " entries for ",
              num(x.size(0)), " tokens");
}

// q/k RMSNorm and rotation over a whole qkv projection, the keys and values stored into the
// paged cache at their tokens' slots (what qk_norm_rope twice and write_kv do); returns q.
at::Tensor qkv_norm_rope_store(const at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                               double eps, const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& positions, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t heads) {
  TORCH_CHECK(qkv.is_cuda(), "qkv must be a CUDA tensor, got a tensor on ", dev(qkv.device()));
  check_device(k_cache, "k_cache", qkv.device());
  check_device(v_cache, "v_cache", qkv.device());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, kv_heads, head_dim] alike, got shapes ",
              shape(k_cache.sizes()), " and ", shape(v_cache.sizes()));
  const int64_t kv_heads = k_cache.size(2), dim = k_cache.size(3);
  TORCH_CHECK(heads > 0 && dim % 2 == 0 && dim <= kMaxRopeHeadDim, "heads must be > 0 and head_dim even and at most ",
              num(kMaxRopeHeadDim), ", got ", num(heads), " and ", num(dim));
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "qkv must be [tokens, (", num(heads), " + 2 x ", num(kv_heads), ") x ", num(dim),
              "] with a contiguous last dimension, got shape ", shape(qkv.sizes()), " strides ",
              shape(qkv.strides()));
  check_norm_weight(q_weight, qkv, dim);
  check_norm_weight(k_weight, qkv, dim);
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "the caches' dtype ", dtype_name(k_cache), " differs from qkv's ", dtype_name(qkv));
  check_rotation(cos, sin, positions, qkv, dim);
  check_ids(slot_mapping, "slot_mapping", qkv.device());
  TORCH_CHECK(slot_mapping.size(0) == qkv.size(0), "slot_mapping has ", num(slot_mapping.size(0)),
              " entries for ", num(qkv.size(0)), " tokens");
  TORCH_CHECK(qkv.size(0) <= INT_MAX / (heads + 2 * kv_heads), "qkv_norm_rope_store: too many tokens");
  const DType dtype = dtype_of(qkv, "qkv");
  auto q = at::empty({qkv.size(0), heads, dim}, qkv.options());
  if (qkv.size(0) == 0) return q;
  const c10::cuda::CUDAGuard guard(qkv.device());
  QkvNormRopeStoreArgs a{};
  a.qkv = qkv.data_ptr();
  a.qkv_token_stride = qkv.stride(0);
  a.q_weight = q_weight.data_ptr();
  a.k_weight = k_weight.data_ptr();
  a.cos = cos.data_ptr<float>();
  a.sin = sin.data_ptr<float>();
  a.positions = positions.data_ptr();
  a.positions_int64 = positions.scalar_type() == at::kLong;
  a.num_positions = cos.size(0);
  a.q_out = q.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.slot_mapping = slot_mapping.data_ptr();
  a.slots_int64 = slot_mapping.scalar_type() == at::kLong;
  a.num_slots = k_cache.size(0) * k_cache.size(1);
  a.tokens = static_cast<int>(qkv.size(0));
  a.heads = static_cast<int>(heads);
  a.kv_heads = static_cast<int>(kv_heads);
  a.dim = static_cast<int>(dim);
  a.eps = static_cast<float>(eps);
  check_launch(launch_qkv_norm_rope_store(dtype, a, current_stream()), "qkv_norm_rope_store");
  return q;
}

at::Tensor qk_norm_rope(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& positions) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor, got a tensor on ", dev(x.device()));
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1,
              "x must be [tokens, heads, head_dim] with a contiguous last dimension, got shape ",
              shape(x.sizes()), " strides ", shape(x.strides()));
  const int64_t dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0 && dim <= kMaxRopeHeadDim, "head_dim must be even and at most ",
              num(kMaxRopeHeadDim), ", got ", num(dim));
  check_norm_weight(weight, x, dim);
  check_rotation(cos, sin, positions, x, dim);
  const DType dtype = dtype_of(x, "x");
  auto out = at::empty({x.size(0), x.size(1), dim}, x.options());
  if (x.numel() == 0) return out;
  TORCH_CHECK(x.size(0) <= INT_MAX && x.size(1) <= INT_MAX, "qk_norm_rope: too many tokens or heads");
  const c10::cuda::CUDAGuard guard(x.device());
  QkNormRopeArgs a{};
  a.x = x.data_ptr();
  a.x_token_stride = x.stride(0);
  a.x_head_stride = x.stride(1);
  a.weight = weight.data_ptr();
  a.cos = cos.data_ptr<float>();
  a.sin = sin.data_ptr<float>();
  a.positions = positions.data_ptr();
  a.positions_int64 = positions.scalar_type() == at::kLong;
  a.num_positions = cos.size(0);
  a.out = out.data_ptr();
  a.tokens = static_cast<int>(x.size(0));
  a.heads = static_cast<int>(x.size(1));
  a.dim = static_cast<int>(dim);
  a.eps = static_cast<float>(eps);
  check_launch(launch_qk_norm_rope(dtype, a, current_stream()), "qk_norm_rope");
  return out;
}

int64_t decode_splits(int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t max_tokens,
                      int64_t device_index, int64_t head_dim, at::ScalarType dtype) {
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, "q_heads must be a multiple of kv_heads");
  const int device = static_cast<int>(device_index);
  return choose_splits(rows, q_heads, kv_heads, max_tokens, num_sms(device),
                       rows_slots(dtype_of(dtype, "dtype"), head_dim, q_heads / kv_heads, device));
}

int64_t decode_slots(int64_t q_heads, int64_t kv_heads, int64_t device_index, int64_t head_dim,
                     at::ScalarType dtype) {
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, "q_heads must be a multiple of kv_heads");
  return rows_slots(dtype_of(dtype, "dtype"), head_dim, q_heads / kv_heads, static_cast<int>(device_index));
}

int64_t prefill_splits(int64_t total_q, int64_t num_seqs, int64_t q_heads, int64_t kv_heads,
                       int64_t max_tokens, int64_t device_index) {
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, "q_heads must be a multiple of kv_heads");
  const int64_t tpt = kPrefillRows / (q_heads / kv_heads);
  TORCH_CHECK(tpt > 0, "the GQA group is larger than a prefill tile");
  return choose_prefill_splits(prefill_tiles(total_q, num_seqs, tpt), kv_heads, max_tokens,
                               num_sms(static_cast<int>(device_index)));
}

// Programmatic dependent launch of the decode path's kernels, for this process (launchers.h):
// on only where the current device has compute capability 9.0 or more. Returns whether it is on.
bool set_dependent_launch(bool on) {
  const int device = c10::cuda::current_device();
  dependent_launch_on() = on && device_attribute(cudaDevAttrComputeCapabilityMajor, device) >= 9;
  return dependent_launch_on();
}

}  // namespace
}  // namespace lmpool

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "LMPool paged-KV CUDA kernels (layouts: lmpool/ops/reference.py)";
  m.def("paged_decode_attention", &lmpool::paged_decode_attention, py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("num_splits") = 0,
        "One query per sequence; num_splits=0 picks the split-K factor from the shapes.");
  m.def("paged_prefill_attention", &lmpool::paged_prefill_attention, py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("query_start_loc"), py::arg("scale"), py::arg("use_tensor_cores") = true,
        py::arg("num_splits") = 0,
        "Ragged causal attention over cached prefixes; fp16/bf16 use tensor cores when allowed; "
        "num_splits=0 picks the split of the keys from the shapes.");
  m.def("cascade_decode_attention", &lmpool::cascade_decode_attention, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("kv_start"),
        py::arg("prefix_tables"), py::arg("prefix_lens"), py::arg("prefix_starts"), py::arg("prefix_rows"),
        py::arg("scale"), py::arg("num_splits") = 0, py::arg("prefix_splits") = 0,
        "One query per sequence, groups of sequences sharing a cached prefix reading it once; "
        "split counts of 0 are picked from the shapes.");
  m.def("write_kv", &lmpool::write_kv, py::arg("key"), py::arg("value"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slot_mapping"), "Store K/V rows at their slots; -1 is skipped.");
  m.def("pack_kv", &lmpool::pack_kv, py::arg("kv_cache"), py::arg("block_ids"),
        py::arg("max_ctas") = 0, py::arg("keep_payload") = false,
        "Gather blocks of every layer into [layers, 2, B, block_size, kv_heads, head_dim]; "
        "max_ctas > 0 caps the grid (SMs left free for concurrent kernels); keep_payload "
        "stores without the evict-first hint, for a reader right after.");
  m.def("unpack_kv", &lmpool::unpack_kv, py::arg("kv_cache"), py::arg("block_ids"),
        py::arg("payload"), py::arg("max_ctas") = 0,
        "Scatter a packed payload into block_ids of every layer; max_ctas as for pack_kv.");
  m.def("rms_norm", &lmpool::rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"),
        "RMSNorm of [rows, dim] (transformers' Qwen3 roundings), into a new contiguous tensor.");
  m.def("add_rms_norm", &lmpool::add_rms_norm, py::arg("x"), py::arg("residual"), py::arg("weight"),
        py::arg("eps"), "(RMSNorm of x + residual, x + residual), the sum rounded to the dtype as torch adds.");
  m.def("skinny_linear", &lmpool::skinny_linear, py::arg("x"), py::arg("w"),
        "x [1..8, k] @ w [n, k]^T in fp16 or bf16 with fp32 sums, each weight read once.");
  m.def("skinny_linear_mma", &lmpool::skinny_linear_mma, py::arg("x"), py::arg("w"),
        "skinny_linear on the tensor cores (m16n8k16): what linear runs for 3-8 rows.");
  m.def("linear", &lmpool::linear, py::arg("x"), py::arg("w"),
        "x @ w^T: skinny_linear (1-2 rows) or skinny_linear_mma (3-8) where they fit (contiguous half rows), "
        "else at::linear.");
  m.def("silu_mul", &lmpool::silu_mul, py::arg("gate_up"),
        "SiLU(gate) * up of [rows, 2 * dim] (gate first), torch's roundings, into a new [rows, dim] tensor.");
  m.def("qkv_norm_rope_store", &lmpool::qkv_norm_rope_store, py::arg("qkv"), py::arg("q_weight"),
        py::arg("k_weight"), py::arg("eps"), py::arg("cos"), py::arg("sin"), py::arg("positions"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"), py::arg("heads"),
        "q/k RMSNorm and rotation over [tokens, (heads + 2 kv_heads) * head_dim], keys and values stored at "
        "their slots (-1: none); returns q [tokens, heads, head_dim].");
  m.def("qk_norm_rope", &lmpool::qk_norm_rope, py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::arg("cos"), py::arg("sin"), py::arg("positions"),
        "Per-head RMSNorm of [tokens, heads, head_dim], then rotary embedding at each token's position.");
  m.def("decode_splits", &lmpool::decode_splits, py::arg("rows"), py::arg("q_heads"),
        py::arg("kv_heads"), py::arg("max_tokens"), py::arg("device_index"),
        py::arg("head_dim") = 128, py::arg("dtype") = at::kBFloat16,
        "The split-K factor paged_decode_attention picks for these shapes.");
  m.def("decode_slots", &lmpool::decode_slots, py::arg("q_heads"), py::arg("kv_heads"),
        py::arg("device_index"), py::arg("head_dim") = 128, py::arg("dtype") = at::kBFloat16,
        "CTAs of the decode kernel the device's SMs (this process's share) hold at once.");
  m.def("set_dependent_launch", &lmpool::set_dependent_launch, py::arg("on"),
        "Let the decode path's kernels start before the kernel ahead of them ends (compute capability 9.0+); "
        "returns whether that is now on. One setting a process.");
  m.def("prefill_splits", &lmpool::prefill_splits, py::arg("total_q"), py::arg("num_seqs"),
        py::arg("q_heads"), py::arg("kv_heads"), py::arg("max_tokens"), py::arg("device_index"),
        "The key split paged_prefill_attention's tensor-core path picks for these shapes.");
}
