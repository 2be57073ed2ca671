// Torch-facing entry point of the KV-transfer kernel (kv_transfer.cu) and its
// Python module, built apart from the engine's kernels (bindings.cpp) by
// lmpool/transfer/block_copy.py.
//
// This file owns input validation (every check names the argument and says
// what was expected) and enabling peer access when the source cache lives on
// another GPU. It never reads device memory from the host and never
// synchronizes: the copy is enqueued on the destination device's current
// stream, ordered after the caller's earlier work on that stream.
#include <ATen/cuda/PeerToPeerAccess.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include <algorithm>
#include <climits>
#include <string>
#include <vector>

#include "kv_transfer.h"

namespace lmpool {
namespace {

// Numbers reach messages as std::string, never streamed as integers: see the
// note on libstdc++ in bindings.cpp.
std::string num(int64_t v) { return std::to_string(v); }

std::string shape(at::IntArrayRef dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

void check_cache(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.is_cuda(), name, " must be a CUDA tensor, got one on ", cache.device().str());
  TORCH_CHECK(cache.dim() == 6 && cache.size(1) == 2, name,
              " must be [layers, 2, num_blocks, block_size, kv_heads, head_dim], got shape ",
              shape(cache.sizes()));
  TORCH_CHECK(cache.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(cache.data_ptr()) % 16 == 0, name,
              "'s data must be 16-byte aligned for vector access");
}

void check_ids(const std::vector<int64_t>& ids, const char* name, int64_t num_blocks) {
  for (const int64_t id : ids) {
    TORCH_CHECK(id >= 0 && id < num_blocks, name, " holds block id ", num(id), ", outside [0, ",
                num(num_blocks), ")");
  }
}

void copy_blocks(const at::Tensor& src_cache, const std::vector<int64_t>& src_ids, const at::Tensor& dst_cache,
                 const std::vector<int64_t>& dst_ids) {
  check_cache(src_cache, "src_cache");
  check_cache(dst_cache, "dst_cache");
  const at::Device device = dst_cache.device();
  TORCH_CHECK(src_ids.size() == dst_ids.size(), "src_ids has ", num(src_ids.size()),
              " ids but dst_ids has ", num(dst_ids.size()));
  TORCH_CHECK(src_cache.scalar_type() == dst_cache.scalar_type(), "src_cache is ",
              c10::toString(src_cache.scalar_type()), " but dst_cache is ",
              c10::toString(dst_cache.scalar_type()));
  for (int d : {0, 3, 4, 5}) {
    TORCH_CHECK(src_cache.size(d) == dst_cache.size(d),
                "the caches differ in more than num_blocks: src_cache ", shape(src_cache.sizes()),
                ", dst_cache ", shape(dst_cache.sizes()));
  }
  check_ids(src_ids, "src_ids", src_cache.size(2));
  check_ids(dst_ids, "dst_ids", dst_cache.size(2));
  const int64_t block_bytes =
      dst_cache.size(3) * dst_cache.size(4) * dst_cache.size(5) * dst_cache.element_size();
  TORCH_CHECK(block_bytes % 16 == 0, "copy_blocks copies 16-byte vectors, but one block of one layer is ",
              num(block_bytes), " bytes");
  if (src_cache.device() != device) {
    // A peer GPU's memory: this device must be allowed to read it (NVLink or PCIe P2P).
    TORCH_CHECK(at::cuda::get_p2p_access(device.index(), src_cache.device().index()),
                device.str(), " cannot access ", src_cache.device().str(),
                " directly (no peer access between them)");
  }
  CopyBlocksArgs a{};
  a.src_cache = src_cache.data_ptr();
  a.dst_cache = dst_cache.data_ptr();
  a.planes = dst_cache.size(0) * 2;
  a.src_num_blocks = src_cache.size(2);
  a.dst_num_blocks = dst_cache.size(2);
  a.block_bytes = block_bytes;
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int64_t n = static_cast<int64_t>(dst_ids.size());
  // Launches of at most kMaxPairs pairs, the ids in each launch's parameters.
  for (int64_t first = 0; first < n; first += kMaxPairs) {
    BlockPairs pairs{};
    a.num_ids = std::min<int64_t>(kMaxPairs, n - first);
    for (int64_t i = 0; i < a.num_ids; ++i) {
      pairs.src[i] = static_cast<int32_t>(src_ids[first + i]);
      pairs.dst[i] = static_cast<int32_t>(dst_ids[first + i]);
    }
    TORCH_CHECK(copy_blocks_ctas(a) < INT_MAX, "copy_blocks: a launch of ", num(a.num_ids),
                " blocks needs too many CTAs");
    const cudaError_t err = launch_copy_blocks(a, pairs, stream);
    TORCH_CHECK(err == cudaSuccess, "copy_blocks: kernel launch failed: ", cudaGetErrorString(err));
  }
}

}  // namespace
}  // namespace lmpool

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "LMPool KV-transfer kernel (layout: lmpool/ops/reference.py)";
  m.def("copy_blocks", &lmpool::copy_blocks, py::arg("src_cache"), py::arg("src_ids"),
        py::arg("dst_cache"), py::arg("dst_ids"),
        "dst_cache[:, :, dst_ids] = src_cache[:, :, src_ids] on dst_cache's device; the ids are host "
        "lists, carried in the kernels' parameters.");
}
