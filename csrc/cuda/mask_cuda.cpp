// Torch-facing launcher of the attention-mask CUDA kernels: checks, allocation and the current stream; the kernels
// live in mask_kernels.cu (no torch headers there).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "checks/cuda.h"
#include "checks/mask.h"
#include "mask_kernels.h"
#include "peagle/mask.h"

namespace peagle {
namespace {

using Blocks = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

at::Tensor element_documents(const at::Tensor& a_c, const at::Tensor& document_ids) {
  return document_ids.to(at::kLong).index_select(0, a_c).contiguous();
}

// The dense mask given each query's causal lower bound low[q] (int64 [N], on the device).
at::Tensor dense_from_lows(const at::Tensor& a_c, const at::Tensor& d_c, const at::Tensor& doc_c, const at::Tensor& low,
                           const char* op) {
  const int64_t n = a_c.size(0);
  at::Tensor out = at::empty({n, n}, a_c.options().dtype(at::kBool));
  check_cuda(cuda::mask_dense(a_c.data_ptr<int64_t>(), d_c.data_ptr<int64_t>(), doc_c.data_ptr<int64_t>(),
                              low.data_ptr<int64_t>(), n, out.data_ptr<bool>(), c10::cuda::getCurrentCUDAStream()),
             op);
  return out;
}

// The block-sparse tensors given each element's causal lower bound low[i].
Blocks blocks_from_lows(const at::Tensor& a_c, const at::Tensor& d_c, const at::Tensor& doc_c, const at::Tensor& low,
                        int64_t block_size, const char* op) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n = a_c.size(0);
  const int64_t nb = (n + block_size - 1) / block_size;
  at::Tensor summary = at::empty({nb, mask::kSummaryFields}, a_c.options());
  check_cuda(cuda::mask_block_summaries(a_c.data_ptr<int64_t>(), d_c.data_ptr<int64_t>(), doc_c.data_ptr<int64_t>(),
                                        low.data_ptr<int64_t>(), n, block_size, summary.data_ptr<int64_t>(), stream),
             op);
  const auto int_opts = a_c.options().dtype(at::kInt);
  at::Tensor kv_num = at::empty({nb}, int_opts);
  at::Tensor kv_idx = at::zeros({nb, nb}, int_opts);
  at::Tensor full_num = at::empty({nb}, int_opts);
  at::Tensor full_idx = at::zeros({nb, nb}, int_opts);
  const at::Tensor q_sorted = sorted_block_anchors(a_c, doc_c, block_size);
  check_cuda(cuda::mask_block_classify(summary.data_ptr<int64_t>(), q_sorted.data_ptr<int64_t>(), nb, block_size,
                                       kv_num.data_ptr<int32_t>(), kv_idx.data_ptr<int32_t>(),
                                       full_num.data_ptr<int32_t>(), full_idx.data_ptr<int32_t>(), stream),
             op);
  return {kv_num, kv_idx, full_num, full_idx};
}

at::Tensor mask_dense_cuda(const at::Tensor& anchors, const at::Tensor& depths, const at::Tensor& document_ids,
                           c10::optional<int64_t> window) {
  check_mask_elements("mask_dense", anchors, depths, document_ids, window);
  const c10::cuda::CUDAGuard guard(anchors.device());
  const at::Tensor a_c = anchors.to(at::kLong).contiguous();
  const at::Tensor d_c = depths.to(at::kLong).contiguous();
  return dense_from_lows(a_c, d_c, element_documents(a_c, document_ids), window_lows(a_c, d_c, window), "mask_dense");
}

Blocks mask_block_cuda(const at::Tensor& anchors, const at::Tensor& depths, const at::Tensor& document_ids,
                       int64_t block_size, c10::optional<int64_t> window) {
  check_mask_block_args(anchors, depths, document_ids, block_size, window);
  const c10::cuda::CUDAGuard guard(anchors.device());
  const at::Tensor a_c = anchors.to(at::kLong).contiguous();
  const at::Tensor d_c = depths.to(at::kLong).contiguous();
  return blocks_from_lows(a_c, d_c, element_documents(a_c, document_ids), window_lows(a_c, d_c, window), block_size,
                          "mask_block");
}

at::Tensor mask_slice_dense_cuda(const at::Tensor& table, const at::Tensor& anchors, const at::Tensor& depths,
                                 const at::Tensor& document_ids) {
  check_mask_slice_args("mask_slice_dense", table, anchors, depths, document_ids);
  const c10::cuda::CUDAGuard guard(anchors.device());
  const at::Tensor a_c = anchors.to(at::kLong).contiguous();
  const at::Tensor d_c = depths.to(at::kLong).contiguous();
  return dense_from_lows(a_c, d_c, element_documents(a_c, document_ids), table_lows(table, a_c, d_c),
                         "mask_slice_dense");
}

Blocks mask_slice_block_cuda(const at::Tensor& table, const at::Tensor& anchors, const at::Tensor& depths,
                             const at::Tensor& document_ids, int64_t block_size) {
  check_mask_slice_args("mask_slice_block", table, anchors, depths, document_ids);
  check_block_size("mask_slice_block", block_size);
  const c10::cuda::CUDAGuard guard(anchors.device());
  const at::Tensor a_c = anchors.to(at::kLong).contiguous();
  const at::Tensor d_c = depths.to(at::kLong).contiguous();
  return blocks_from_lows(a_c, d_c, element_documents(a_c, document_ids), table_lows(table, a_c, d_c), block_size,
                          "mask_slice_block");
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  m.impl("mask_dense", &peagle::mask_dense_cuda);
  m.impl("mask_block", &peagle::mask_block_cuda);
  m.impl("mask_slice_dense", &peagle::mask_slice_dense_cuda);
  m.impl("mask_slice_block", &peagle::mask_slice_block_cuda);
}
