// Torch-facing launcher of the attention-mask CUDA kernels: checks, allocation and the current stream; the kernels
// live in mask_kernels.cu (no torch headers there).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "checks/cuda.h"
#include "checks/deferred.h"
#include "checks/mask.h"
#include "deferred_cuda.h"
#include "mask_kernels.h"
#include "peagle/deferred.h"
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

struct Elements {
  at::Tensor anchors, depths;  // int64, contiguous
};

// Deferred checks: the statistics the value checks decide from, computed by ATen ops on the device, and one thread
// that decides and records (no synchronisation).
void record_value_errors(int64_t op, const Elements& e, const at::Tensor& document_ids, const at::Tensor* table) {
  const int64_t length = document_ids.size(0);
  const bool has_elements = e.anchors.numel() > 0;
  const auto opts = e.anchors.options();
  std::vector<at::Tensor> stats(deferred::kMaskStats, at::zeros({}, opts));
  if (has_elements) {
    const auto [amin, amax] = at::aminmax(e.anchors);
    const at::Tensor outside = e.depths >= length;
    const at::Tensor first = outside.to(at::kInt).argmax().to(at::kLong);  // the first True (0 when none)
    stats[deferred::kAnchorMin] = amin;
    stats[deferred::kAnchorMax] = amax;
    stats[deferred::kDepthMin] = e.depths.min();
    stats[deferred::kDepthMax] = e.depths.max();
    stats[deferred::kFirstOutside] = at::where(outside.any(), first, at::full({}, -1, opts));
    // squeeze, not view({}): view({}) picks view(ScalarType{}), a byte view of shape [8].
    stats[deferred::kFirstOutsideDepth] = e.depths.index_select(0, first.view({1})).squeeze(0);
  }
  if (length > 0) stats[deferred::kDocumentMin] = document_ids.to(at::kLong).min();
  const at::Tensor packed = at::stack(stats).contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_cuda(
      cuda::mask_validate(packed.data_ptr<int64_t>(), has_elements, length, table ? table->size(0) : -1,
                          table ? table->size(1) : -1, op, deferred_record(document_ids.get_device(), stream), stream),
      "check_errors");
}

// Host value checks in the order of check_mask_slice_args (the CPU's).
void check_values_on_host(const char* op, const at::Tensor& anchors, const at::Tensor& depths,
                          const at::Tensor& document_ids, const at::Tensor* table) {
  check_not_capturing(op, c10::cuda::getCurrentCUDAStream());
  check_mask_element_values(op, anchors, depths, document_ids);
  if (table == nullptr) return;
  check_mask_slice_table(op, *table, anchors);
  check_mask_slice_values(op, *table, anchors, depths);
}

// All checks of a mask op's elements (and slice table), then the int64 elements. With deferred checks the value
// checks run on the device, and the elements are clamped into the ranges the kernels index (a no-op for valid
// inputs), so bad values read nothing out of bounds before check_errors() raises. An empty row or table with elements
// is checked on the host (no valid range to clamp into).
Elements checked_elements(const char* op, int64_t op_id, const at::Tensor& anchors, const at::Tensor& depths,
                          const at::Tensor& document_ids, const c10::optional<int64_t>& window,
                          const at::Tensor* table) {
  check_mask_element_args(op, anchors, depths, document_ids, window);
  Elements e{anchors.to(at::kLong).contiguous(), depths.to(at::kLong).contiguous()};
  if (!deferred_checks_enabled()) {
    check_values_on_host(op, anchors, depths, document_ids, table);
    return e;
  }
  if (table != nullptr) check_mask_slice_table(op, *table, anchors);
  int64_t anchor_end = document_ids.size(0), depth_end = document_ids.size(0);
  if (table != nullptr) {
    anchor_end = std::min(anchor_end, table->size(1));
    depth_end = std::min(depth_end, table->size(0));
  }
  if (e.anchors.numel() > 0 && (anchor_end == 0 || depth_end == 0)) {
    check_values_on_host(op, anchors, depths, document_ids, table);
    return e;
  }
  record_value_errors(op_id, e, document_ids, table);
  if (e.anchors.numel() == 0) return e;
  return {e.anchors.clamp(0, anchor_end - 1), e.depths.clamp(0, depth_end - 1)};
}

at::Tensor mask_dense_cuda(const at::Tensor& anchors, const at::Tensor& depths, const at::Tensor& document_ids,
                           c10::optional<int64_t> window) {
  const c10::cuda::CUDAGuard guard(anchors.device());
  const Elements e =
      checked_elements("mask_dense", deferred::kMaskDense, anchors, depths, document_ids, window, nullptr);
  return dense_from_lows(e.anchors, e.depths, element_documents(e.anchors, document_ids),
                         window_lows(e.anchors, e.depths, window), "mask_dense");
}

Blocks mask_block_cuda(const at::Tensor& anchors, const at::Tensor& depths, const at::Tensor& document_ids,
                       int64_t block_size, c10::optional<int64_t> window) {
  const c10::cuda::CUDAGuard guard(anchors.device());
  const Elements e =
      checked_elements("mask_block", deferred::kMaskBlock, anchors, depths, document_ids, window, nullptr);
  check_block_size("mask_block", block_size);
  return blocks_from_lows(e.anchors, e.depths, element_documents(e.anchors, document_ids),
                          window_lows(e.anchors, e.depths, window), block_size, "mask_block");
}

at::Tensor mask_slice_dense_cuda(const at::Tensor& table, const at::Tensor& anchors, const at::Tensor& depths,
                                 const at::Tensor& document_ids) {
  const c10::cuda::CUDAGuard guard(anchors.device());
  const Elements e = checked_elements("mask_slice_dense", deferred::kMaskSliceDense, anchors, depths, document_ids,
                                      c10::nullopt, &table);
  return dense_from_lows(e.anchors, e.depths, element_documents(e.anchors, document_ids),
                         table_lows(table, e.anchors, e.depths), "mask_slice_dense");
}

Blocks mask_slice_block_cuda(const at::Tensor& table, const at::Tensor& anchors, const at::Tensor& depths,
                             const at::Tensor& document_ids, int64_t block_size) {
  const c10::cuda::CUDAGuard guard(anchors.device());
  const Elements e = checked_elements("mask_slice_block", deferred::kMaskSliceBlock, anchors, depths, document_ids,
                                      c10::nullopt, &table);
  check_block_size("mask_slice_block", block_size);
  return blocks_from_lows(e.anchors, e.depths, element_documents(e.anchors, document_ids),
                          table_lows(table, e.anchors, e.depths), block_size, "mask_slice_block");
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  m.impl("mask_dense", &peagle::mask_dense_cuda);
  m.impl("mask_block", &peagle::mask_block_cuda);
  m.impl("mask_slice_dense", &peagle::mask_slice_dense_cuda);
  m.impl("mask_slice_block", &peagle::mask_slice_block_cuda);
}
