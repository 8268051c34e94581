// CPU kernels of the attention-mask family: the dense boolean mask and the block-sparse classification.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <tuple>

#include "checks/mask.h"
#include "peagle/mask.h"

namespace peagle {
namespace {

// Document of every element's anchor (the predicate only looks at doc(a)).
at::Tensor element_documents(const at::Tensor& anchors_c, const at::Tensor& document_ids) {
  return document_ids.to(at::kLong).index_select(0, anchors_c).contiguous();
}

int64_t window_arg(const c10::optional<int64_t>& window) { return window.has_value() ? *window : mask::kNoWindow; }

}  // namespace

// [nb, block_size]: each block's valid anchors sorted ascending, then padding (kBig). ATen ops, shared with CUDA.
at::Tensor sorted_block_anchors(const at::Tensor& anchors_c, const at::Tensor& edoc, int64_t block_size) {
  const int64_t n = anchors_c.size(0);
  const int64_t nb = (n + block_size - 1) / block_size;
  at::Tensor keyed = at::where(edoc.ne(-1), anchors_c, at::scalar_tensor(mask::kBig, anchors_c.options()));
  keyed = at::constant_pad_nd(keyed, {0, nb * block_size - n}, mask::kBig).view({nb, block_size});
  return std::get<0>(keyed.sort(1)).contiguous();
}

namespace {

// The general per-cell predicate over int64 fields: only for inputs whose values do not fit the 32-bit row kernel.
void mask_dense_rows_int64(bool* o, int64_t n, const int64_t* a, const int64_t* d, const int64_t* doc, int64_t w) {
  at::parallel_for(0, n, std::max<int64_t>(1, 4096 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      bool* row = o + q * n;
      const int64_t aq = a[q], dq = d[q], docq = doc[q];
      for (int64_t k = 0; k < n; ++k) row[k] = mask::allowed(aq, dq, docq, a[k], d[k], doc[k], w);
    }
  });
}

bool fits_int32(const at::Tensor& t) {
  return t.numel() == 0 || (t.min().item<int64_t>() >= INT32_MIN + 1 && t.max().item<int64_t>() <= INT32_MAX - 1);
}

at::Tensor mask_dense_cpu(const at::Tensor& anchors, const at::Tensor& depths, const at::Tensor& document_ids,
                          c10::optional<int64_t> window) {
  check_mask_elements("mask_dense", anchors, depths, document_ids, window);
  const at::Tensor a_c = anchors.to(at::kLong).contiguous();
  const at::Tensor d_c = depths.to(at::kLong).contiguous();
  const at::Tensor doc_c = element_documents(a_c, document_ids);
  const int64_t n = anchors.size(0);
  const int64_t w = window_arg(window);
  at::Tensor out = at::empty({n, n}, anchors.options().dtype(at::kBool));
  bool* o = out.data_ptr<bool>();
  if (!(fits_int32(a_c) && fits_int32(d_c) && fits_int32(doc_c))) {
    mask_dense_rows_int64(o, n, a_c.data_ptr<int64_t>(), d_c.data_ptr<int64_t>(), doc_c.data_ptr<int64_t>(), w);
    return out;
  }
  const at::Tensor a32 = a_c.to(at::kInt), d32 = d_c.to(at::kInt), doc32 = doc_c.to(at::kInt);
  const at::Tensor root32 = at::where(d_c.eq(0), a_c, at::scalar_tensor(INT32_MAX, a_c.options())).to(at::kInt);
  const int32_t* a = a32.data_ptr<int32_t>();
  const int32_t* d = d32.data_ptr<int32_t>();
  const int32_t* doc = doc32.data_ptr<int32_t>();
  const int32_t* root = root32.data_ptr<int32_t>();
  at::parallel_for(0, n, std::max<int64_t>(1, 4096 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      // Causal keys need a_k > a_q + d_q - W: the bound in int64, clamped into int32 (anchors fit in int32).
      const int64_t lo64 = w == mask::kNoWindow ? INT32_MIN : std::max<int64_t>(INT32_MIN, a[q] + d[q] - w);
      const int32_t lo = static_cast<int32_t>(std::min<int64_t>(lo64, INT32_MAX));
      mask::dense_row(o + q * n, n, a[q], d[q], doc[q], lo, doc, a, d, root);
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mask_block_cpu(const at::Tensor& anchors,
                                                                          const at::Tensor& depths,
                                                                          const at::Tensor& document_ids,
                                                                          int64_t block_size,
                                                                          c10::optional<int64_t> window) {
  check_mask_block_args(anchors, depths, document_ids, block_size, window);
  const at::Tensor a_c = anchors.to(at::kLong).contiguous();
  const at::Tensor d_c = depths.to(at::kLong).contiguous();
  const at::Tensor doc_c = element_documents(a_c, document_ids);
  const int64_t n = anchors.size(0);
  const int64_t nb = (n + block_size - 1) / block_size;
  const int64_t w = window_arg(window);
  const int64_t* a = a_c.data_ptr<int64_t>();
  const int64_t* d = d_c.data_ptr<int64_t>();
  const int64_t* doc = doc_c.data_ptr<int64_t>();

  // O(N): one summary per block.
  at::Tensor summary = at::empty({nb, mask::kSummaryFields}, a_c.options());
  int64_t* s = summary.data_ptr<int64_t>();
  at::parallel_for(0, nb, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      mask::summarize(a, d, doc, b * block_size, std::min(n, (b + 1) * block_size), s + b * mask::kSummaryFields);
    }
  });

  const at::Tensor q_sorted = sorted_block_anchors(a_c, doc_c, block_size);
  const int64_t* q_sorted_p = q_sorted.data_ptr<int64_t>();

  // O(blocks^2 log block_size): classify every pair from the summaries, compacting partial and full kv blocks per q
  // block.
  const auto int_opts = anchors.options().dtype(at::kInt);
  at::Tensor kv_num = at::empty({nb}, int_opts);
  at::Tensor kv_idx = at::zeros({nb, nb}, int_opts);
  at::Tensor full_num = at::empty({nb}, int_opts);
  at::Tensor full_idx = at::zeros({nb, nb}, int_opts);
  int32_t* kv_num_p = kv_num.data_ptr<int32_t>();
  int32_t* kv_idx_p = kv_idx.data_ptr<int32_t>();
  int32_t* full_num_p = full_num.data_ptr<int32_t>();
  int32_t* full_idx_p = full_idx.data_ptr<int32_t>();
  at::parallel_for(0, nb, std::max<int64_t>(1, 2048 / std::max<int64_t>(nb, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t qb = begin; qb < end; ++qb) {
      const int64_t* qs = s + qb * mask::kSummaryFields;
      int32_t partial = 0, full = 0;
      int32_t* kv_row = kv_idx_p + qb * nb;
      int32_t* full_row = full_idx_p + qb * nb;
      for (int64_t kb = 0; kb < nb; ++kb) {
        const int8_t kind = mask::classify(qs, s + kb * mask::kSummaryFields, w, q_sorted_p + qb * block_size);
        if (kind == mask::kPartial) kv_row[partial++] = static_cast<int32_t>(kb);
        if (kind == mask::kFull) full_row[full++] = static_cast<int32_t>(kb);
      }
      kv_num_p[qb] = partial;
      full_num_p[qb] = full;
    }
  });
  return {kv_num, kv_idx, full_num, full_idx};
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CPU, m) {
  m.impl("mask_dense", &peagle::mask_dense_cpu);
  m.impl("mask_block", &peagle::mask_block_cpu);
}
